"""The matrix as data: its releases and fork trees (``matrix/releases.toml``),
and its cells (one target with one strategy) selected by id, release or tree."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from packaging.version import InvalidVersion, Version

from gdn_backport import fixes
from gdn_backport.analysis import Status
from gdn_backport.errors import UsageError
from gdn_backport.patchset import load as load_patchset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

WHERE = "matrix/releases.toml"
# "none": an unaffected release runs unpatched; the rest are the patchsets'
# (each strategy belongs to one patchset: gather and kernel to pr51812,
# reclassify to pr51565, so a cell id names its patchset too).
STRATEGIES = ("none", *(s for name in fixes.available() for s in fixes.load_fix(name).strategies))
SPLIT_PATCHSET = "pr51565"
# A realistic GDN layer for GPU runs (key heads, value heads, head dim).
GPU_HEADS = (16, 32, 128)
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Release:
    version: str
    path: str  # where the Qwen GDN spec path lives
    function: str
    status: Status  # its expected status
    wheel_only: bool = False
    # Why the regression harness cannot drive this release: its cells report
    # "skip" with this reason when verify says it cannot (exit 2), never "ok".
    skip_verify: str = ""
    # Patchset pr51565: the tree's expected status, and whether apply
    # patches it ("patch") or refuses with the reason ("refuse").
    split_status: Status | None = None
    split_apply: str = "patch"

    @property
    def strategies(self) -> tuple[str, ...]:
        """The matrix cells of this release: patch only what is affected
        (pr51812's strategies or "none"; pr51565's where it is affected)."""
        own = load_patchset().strategies if self.status is Status.AFFECTED else ("none",)
        split = fixes.load_fix(SPLIT_PATCHSET).strategies
        return (*own, *(split if self.split_status is Status.AFFECTED else ()))


@dataclass(frozen=True)
class Tree:
    """A fork's own tree as a matrix target: a directory holding ``vllm/``,
    optionally read at a git ``ref`` of the repository it lies in."""

    name: str
    path: str
    ref: str = ""
    strategies: tuple[str, ...] = ("gather",)

    def resolved(self) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(self.path)))


@dataclass(frozen=True)
class Matrix:
    releases: tuple[Release, ...]
    trees: tuple[Tree, ...] = ()


def _strategies(value: object, at: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        raise UsageError(f"{at}: key 'strategies' must be a list of strategy names")
    for s in value:
        if s not in STRATEGIES:
            raise UsageError(f"{at}: key 'strategies': {s!r} is not one of {', '.join(STRATEGIES)}")
    return tuple(value)


def _parse_trees(entries: object, where: str) -> tuple[Tree, ...]:
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise UsageError(f"{where}: 'tree' must be an array of tables ([[tree]])")
    trees: list[Tree] = []
    for i, e in enumerate(entries):
        at = f"{where}: tree[{i}]"
        if not isinstance(e, dict):
            raise UsageError(f"{at}: must be a table")
        for key in ("name", "path"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise UsageError(f"{at}: key '{key}' must be a non-empty string")
        if not _NAME.match(e["name"]):
            raise UsageError(f"{at}: key 'name': {e['name']!r} (letters, digits, '_.-')")
        ref = e.get("ref", "")
        if not isinstance(ref, str):
            raise UsageError(f"{at}: key 'ref' must be a string")
        strategies = _strategies(e["strategies"], at) if "strategies" in e else ("gather",)
        if any(t.name == e["name"] for t in trees):
            raise UsageError(f"{at}: name {e['name']!r} listed twice")
        trees.append(Tree(e["name"], e["path"], ref, strategies))
    return tuple(trees)


def _split(entry: object, at: str) -> tuple[Status | None, str]:
    """A release's ``pr51565 = { status = ..., apply = "patch"|"refuse" }``."""
    if entry is None:
        return None, "patch"
    key = f"{at}: key '{SPLIT_PATCHSET}'"
    if not isinstance(entry, dict) or not isinstance(entry.get("status"), str):
        raise UsageError(f"{key} must be a table with a 'status'")
    try:
        status = Status(entry["status"])
    except ValueError as exc:
        raise UsageError(f"{key}: {entry['status']!r} is not a status") from exc
    apply = entry.get("apply", "patch")
    if apply not in ("patch", "refuse"):
        raise UsageError(f"{key}: apply must be 'patch' or 'refuse'")
    return status, str(apply)


def parse(data: dict[str, object], where: str = WHERE) -> Matrix:
    entries = data.get("release")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{where}: no [[release]] tables")
    releases: list[Release] = []
    seen: set[Version] = set()
    for i, e in enumerate(entries):
        at = f"{where}: release[{i}]"
        if not isinstance(e, dict):
            raise UsageError(f"{at}: must be a table")
        for key in ("version", "path", "function", "status"):
            if not isinstance(e.get(key), str):
                raise UsageError(f"{at}: key '{key}' must be a string")
        if not isinstance(e.get("skip_verify", ""), str):
            raise UsageError(f"{at}: key 'skip_verify' must be a string (the reason)")
        try:
            v = Version(e["version"])
        except InvalidVersion as exc:
            raise UsageError(f"{at}: key 'version': {exc}") from exc
        if v in seen:
            raise UsageError(f"{at}: version {v} listed twice")
        seen.add(v)
        try:
            status = Status(e["status"])
        except ValueError as exc:
            raise UsageError(f"{at}: key 'status': {e['status']!r} is not a status") from exc
        split_status, split_apply = _split(e.get(SPLIT_PATCHSET), at)
        releases.append(
            Release(
                str(v),
                e["path"],
                e["function"],
                status,
                bool(e.get("wheel_only", False)),
                e.get("skip_verify", ""),
                split_status,
                split_apply,
            )
        )
    trees = _parse_trees(data.get("tree"), where)
    return Matrix(tuple(sorted(releases, key=lambda r: Version(r.version))), trees)


def load() -> Matrix:
    text = resources.files("gdn_backport._matrix").joinpath("releases.toml").read_text()
    try:
        return parse(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{WHERE}: {exc}") from exc


@dataclass(frozen=True)
class Cell:
    """One matrix cell: a release (or a fork's tree) with one strategy."""

    strategy: str
    release: Release | None = None
    tree: Tree | None = None
    # A tree named on the command line (--tree), not in matrix/: selecting it
    # again takes its path, not only its id.
    adhoc: bool = False

    @property
    def patchset(self) -> str:
        """The patchset this cell proves: its strategy's ("none": pr51812's
        unaffected releases, run unpatched)."""
        for name in fixes.available():
            if self.strategy in fixes.load_fix(name).strategies:
                return name
        return load_patchset().id

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
    """A ``--tree PATH`` target, named after its directory."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", path.resolve().name)
    if not _NAME.match(name):
        name = f"tree-{name}".rstrip("-")
    return Tree(name, str(path), ref)


def _cell_by_id(cell_id: str, matrix: Matrix, trees: Sequence[Tree]) -> Cell:
    target, _, strategy = cell_id.rpartition("-")
    if strategy not in STRATEGIES or not target:
        raise UsageError(f"--cell {cell_id}: expected <release or tree>-<{'|'.join(STRATEGIES)}>")
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
    for s in strategies or ():
        if s not in STRATEGIES:
            raise UsageError(f"--strategy {s}: choose from {', '.join(STRATEGIES)}")
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
        out += [Cell(s, tree=t, adhoc=adhoc) for s in (strategies or t.strategies)]
    ids_seen = [c.id for c in out]
    dup = sorted({i for i in ids_seen if ids_seen.count(i) > 1})
    if dup:
        raise UsageError(f"cell ids {', '.join(dup)} appear twice (rename a [[tree]])")
    return out
