"""The matrix as data: its releases and fork trees (``matrix/releases.toml``),
each patchset's expectations of them (``patchsets/<id>/expected.toml``), and
the cells (one target with one patchset's strategy) selected by id, release
or tree."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path

from packaging.version import InvalidVersion, Version

from gdn_backport import registry, tomlfile
from gdn_backport.errors import UsageError
from gdn_backport.registry import Patchset
from gdn_backport.site import Status

WHERE = "matrix/releases.toml"
EXPECTED = "expected.toml"
# A realistic GDN layer for GPU runs (key heads, value heads, head dim).
GPU_HEADS = (16, 32, 128)
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


def all_strategies() -> tuple[str, ...]:
    """Every cell strategy: the patchsets' own, and their ``unaffected`` cells
    (``none``: a release verified as shipped)."""
    out: list[str] = []
    for ps in registry.discover():
        out += [s for s in (*unaffected_cells(ps), *ps.info.strategies) if s not in out]
    return tuple(out)


def unaffected_cells(ps: Patchset) -> tuple[str, ...]:
    table = ps.info.data.get("matrix", {})
    return tomlfile.identifiers(table, "unaffected", f"{ps.info.where}: matrix") if table else ()


@dataclass(frozen=True)
class Expectation:
    """What one patchset expects of one release: its worst status, or, with
    ``path``/``function``, the status of that one site (every other site of
    the patchset then must be correct); whether ``apply`` patches or refuses."""

    status: Status
    path: str = ""
    function: str = ""
    apply: str = "patch"


@dataclass(frozen=True)
class Release:
    version: str
    wheel_only: bool = False
    # Why the regression harness cannot drive this release: its cells report
    # "skip" with this reason when verify says it cannot (exit 2), never "ok".
    skip_verify: str = ""
    # Patchset id -> its expectation (a patchset with none has no cell here).
    expected: dict[str, Expectation] = field(default_factory=dict, compare=False)

    def expectation(self, patchset: str) -> Expectation | None:
        return self.expected.get(patchset)

    def cells(self) -> tuple[tuple[str, str], ...]:
        """(patchset, strategy) of each cell: patch only what is affected."""
        out: list[tuple[str, str]] = []
        for ps in registry.discover():
            exp = self.expected.get(ps.info.id)
            if exp is None:
                continue
            chosen = ps.info.strategies if exp.status is Status.AFFECTED else unaffected_cells(ps)
            out += [(ps.info.id, s) for s in chosen]
        return tuple(out)

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(s for _, s in self.cells())


@dataclass(frozen=True)
class Tree:
    """A fork's own tree as a matrix target: a directory holding ``vllm/``,
    optionally read at a git ``ref`` of the repository it lies in."""

    name: str
    path: str
    ref: str = ""
    # Empty: every patchset's default strategy.
    strategies: tuple[str, ...] = ()

    def resolved(self) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(self.path)))

    def cell_strategies(self) -> tuple[str, ...]:
        return self.strategies or tuple(ps.info.strategies[0] for ps in registry.discover())


@dataclass(frozen=True)
class Matrix:
    releases: tuple[Release, ...]
    trees: tuple[Tree, ...] = ()


def _strategies(value: object, at: str) -> tuple[str, ...]:
    known = all_strategies()
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        raise UsageError(f"{at}: key 'strategies' must be a list of strategy names")
    for s in value:
        if s not in known:
            raise UsageError(f"{at}: key 'strategies': {s!r} is not one of {', '.join(known)}")
    return tuple(value)


def _parse_trees(data: dict[str, object], where: str) -> tuple[Tree, ...]:
    trees: list[Tree] = []
    for i, e in enumerate(tomlfile.tables(data, "tree", where)):
        at = f"{where}: tree[{i}]"
        name, path = tomlfile.text(e, "name", at), tomlfile.text(e, "path", at)
        if not _NAME.match(name):
            raise UsageError(f"{at}: key 'name': {name!r} (letters, digits, '_.-')")
        ref = tomlfile.get(e, "ref", str, at, default="")
        chosen = _strategies(e["strategies"], at) if "strategies" in e else ()
        if any(t.name == name for t in trees):
            raise UsageError(f"{at}: name {name!r} listed twice")
        trees.append(Tree(name, path, ref, chosen))
    return tuple(trees)


def _status(value: object, at: str) -> Status:
    try:
        return Status(value)
    except ValueError as exc:
        raise UsageError(f"{at}: key 'status': {value!r} is not a status") from exc


def parse_expectations(data: dict[str, object], where: str) -> dict[str, Expectation]:
    """A patchset's ``expected.toml``: version -> expectation."""
    out: dict[str, Expectation] = {}
    for i, e in enumerate(tomlfile.tables(data, "release", where)):
        at = f"{where}: release[{i}]"
        version = _version(tomlfile.text(e, "version", at), at)
        if version in out:
            raise UsageError(f"{at}: version {version} listed twice")
        site = tomlfile.get(e, "site", dict, at, default={})
        path = tomlfile.text(site, "path", f"{at}: site") if site else ""
        function = tomlfile.text(site, "function", f"{at}: site") if site else ""
        apply = tomlfile.get(e, "apply", str, at, default="patch")
        if apply not in ("patch", "refuse"):
            raise UsageError(f"{at}: key 'apply' must be 'patch' or 'refuse'")
        status = _status(tomlfile.text(e, "status", at), at)
        out[version] = Expectation(status, path, function, apply)
    return out


def _version(text: str, at: str) -> str:
    try:
        return str(Version(text))
    except InvalidVersion as exc:
        raise UsageError(f"{at}: key 'version': {exc}") from exc


def parse(
    data: dict[str, object],
    where: str = WHERE,
    expectations: dict[str, dict[str, Expectation]] | None = None,
) -> Matrix:
    """``expectations``: patchset id -> version -> expectation (default: the
    patchsets' own ``expected.toml`` files)."""
    expectations = load_expectations() if expectations is None else expectations
    entries = tomlfile.tables(data, "release", where)
    if not entries:
        raise UsageError(f"{where}: no [[release]] tables")
    releases: list[Release] = []
    for i, e in enumerate(entries):
        at = f"{where}: release[{i}]"
        version = _version(tomlfile.text(e, "version", at), at)
        if any(r.version == version for r in releases):
            raise UsageError(f"{at}: version {version} listed twice")
        skip = tomlfile.get(e, "skip_verify", str, at, default="")
        expected = {ps: exp[version] for ps, exp in expectations.items() if version in exp}
        releases.append(
            Release(version, tomlfile.get(e, "wheel_only", bool, at, default=False), skip, expected)
        )
    listed = {r.version for r in releases}
    for ps, exp in expectations.items():
        extra = sorted(set(exp) - listed, key=Version)
        if extra:
            raise UsageError(f"patchsets/{ps}/{EXPECTED}: release {extra[0]} is not in {WHERE}")
    trees = _parse_trees(data, where)
    return Matrix(tuple(sorted(releases, key=lambda r: Version(r.version))), trees)


def load_expectations() -> dict[str, dict[str, Expectation]]:
    out: dict[str, dict[str, Expectation]] = {}
    for ps in registry.discover():
        res = resources.files(ps.package).joinpath(EXPECTED)
        if res.is_file():
            where = f"patchsets/{ps.info.id}/{EXPECTED}"
            out[ps.info.id] = parse_expectations(tomlfile.load(res, where), where)
    return out


@cache
def load() -> Matrix:
    res = resources.files("gdn_backport._matrix").joinpath("releases.toml")
    return parse(tomlfile.load(res, WHERE))


@dataclass(frozen=True)
class Cell:
    """One matrix cell: a release (or a fork's tree) with one patchset's strategy."""

    strategy: str
    release: Release | None = None
    tree: Tree | None = None
    # A tree named on the command line (--tree), not in matrix/: selecting it
    # again takes its path, not only its id.
    adhoc: bool = False

    @property
    def patchset(self) -> str:
        """The patchset this cell proves: its strategy's (``none``: the
        patchset whose unaffected cell it is)."""
        for ps in registry.discover():
            if self.strategy in ps.info.strategies or self.strategy in unaffected_cells(ps):
                return ps.info.id
        raise UsageError(f"cell strategy {self.strategy!r} belongs to no patchset")

    @property
    def expectation(self) -> Expectation | None:
        return self.release.expectation(self.patchset) if self.release is not None else None

    @property
    def target(self) -> str:
        if self.release is not None:
            return self.release.version
        assert self.tree is not None
        return self.tree.name

    @property
    def id(self) -> str:
        """``<release>-<strategy>``, e.g. ``0.25.1-gather``: the nox session
        ``cell(0.25.1-gather)``, the CI job, the JUnit and result file names."""
        return f"{self.target}-{self.strategy}"

    def selector(self) -> list[str]:
        """Arguments of ``gdn-backport matrix run`` that run exactly this cell."""
        if self.adhoc and self.tree is not None:
            ref = ["--ref", self.tree.ref] if self.tree.ref else []
            return ["--tree", self.tree.path, *ref, "--cell", self.id]
        return ["--cell", self.id]


def adhoc_tree(path: Path, ref: str = "") -> Tree:
    """A ``--tree PATH`` target, named after its directory: a folder holding
    ``vllm/``, or with ``ref`` one in a git work tree (read at that ref). A
    missing folder is a usage error: a CI document for it would run nothing."""
    from gdn_backport.tree import check_vllm_tree

    if ref:
        if not path.is_dir():
            raise UsageError(f"{path}: no such directory (--tree)")
    else:
        check_vllm_tree(path)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", path.resolve().name)
    if not _NAME.match(name):
        name = f"tree-{name}".rstrip("-")
    return Tree(name, str(path), ref)


def _cell_by_id(cell_id: str, matrix: Matrix, trees: Sequence[Tree]) -> Cell:
    known = all_strategies()
    target, _, strategy = cell_id.rpartition("-")
    if strategy not in known or not target:
        raise UsageError(f"--cell {cell_id}: expected <release or tree>-<{'|'.join(known)}>")
    for t in trees:
        if t.name == target:
            return Cell(strategy, tree=t, adhoc=True)
    for t in matrix.trees:
        if t.name == target:
            return Cell(strategy, tree=t)
    try:
        wanted = Version(target)
    except InvalidVersion:
        raise UsageError(f"--cell {cell_id}: no release or tree {target!r} in {WHERE}") from None
    for r in matrix.releases:
        if Version(r.version) == wanted:
            return Cell(strategy, release=r)
    raise UsageError(f"--cell {cell_id}: release {target} is not in {WHERE}")


def cells(
    matrix: Matrix,
    releases: Sequence[str] | None = None,
    strategies: Sequence[str] | None = None,
    ids: Sequence[str] | None = None,
    trees: Sequence[Tree] = (),
    include_wheel_only: bool = False,
) -> list[Cell]:
    """The cells to run, in matrix order.

    ``ids`` names exact cells (any strategy, also one the matrix does not
    list, e.g. ``0.25.1-none`` for the mutation check alone). Otherwise:
    every release's cells (``wheel_only`` releases only when named in
    ``releases`` or with ``include_wheel_only``) and the matrix's
    ``[[tree]]`` entries, or only the named ``releases`` and ``trees``;
    ``strategies`` keeps the release cells of those strategies and sets the
    strategies of the trees.
    """
    known = all_strategies()
    for s in strategies or ():
        if s not in known:
            raise UsageError(f"--strategy {s}: choose from {', '.join(known)}")
    if ids:
        if releases:
            raise UsageError("--cell and --release exclude each other")
        chosen = [_cell_by_id(i, matrix, trees) for i in ids]
        return list({c.id: c for c in chosen}.values())
    named: set[Version] = set()
    for v in releases or ():
        try:
            named.add(Version(v))
        except InvalidVersion as exc:
            raise UsageError(f"--release {v}: not a version number") from exc
    listed = {Version(r.version) for r in matrix.releases}
    missing = sorted(str(v) for v in named - listed)
    if missing:
        raise UsageError(f"--release {', '.join(missing)}: not in {WHERE}")
    out: list[Cell] = []
    everything = not named and not trees
    for r in matrix.releases:
        if named and Version(r.version) not in named:
            continue
        if not named and (not everything or (r.wheel_only and not include_wheel_only)):
            continue
        out += [Cell(s, release=r) for s in r.strategies if not strategies or s in strategies]
    extra = [(t, True) for t in trees] + [(t, False) for t in matrix.trees if everything]
    for t, adhoc in extra:
        out += [Cell(s, tree=t, adhoc=adhoc) for s in (strategies or t.cell_strategies())]
    ids_seen = [c.id for c in out]
    dup = sorted({i for i in ids_seen if ids_seen.count(i) > 1})
    if dup:
        raise UsageError(f"cell ids {', '.join(dup)} appear twice (rename a [[tree]])")
    return out
