"""The version matrix (``matrix/releases.toml``): load, scan, compare, render,
and run its cells (fetch, patch a copy, scan before/after, verify).

A *cell* is one target (a release of the matrix, or a fork's own tree) with
one strategy (``gather``/``kernel`` for affected releases, ``none`` for the
others). :func:`run_cells` runs cells in this process, one after the other,
and :func:`write_results` writes JUnit XML per cell plus a summary as JSON
and Markdown; the noxfile, ``gdn-backport matrix --run`` and the CI exports
(:mod:`gdn_backport.ci_export`) all go through these.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata, resources
from pathlib import Path
from typing import TextIO

from packaging.version import InvalidVersion, Version

from gdn_backport import __version__, sources
from gdn_backport.analysis import Status
from gdn_backport.errors import UsageError
from gdn_backport.patchset import load as load_patchset
from gdn_backport.report import table
from gdn_backport.scan import Site, scan_tree
from gdn_backport.verify import VerifyReport, verify_tree

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

WHERE = "matrix/releases.toml"
# "none": an unaffected release runs unpatched; the rest are the patchset's.
STRATEGIES = ("none", *load_patchset().strategies)
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

    @property
    def strategies(self) -> tuple[str, ...]:
        """The matrix cells of this release: patch only what is affected."""
        return STRATEGIES[1:] if self.status is Status.AFFECTED else ("none",)


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
        releases.append(
            Release(
                str(v),
                e["path"],
                e["function"],
                status,
                bool(e.get("wheel_only", False)),
                e.get("skip_verify", ""),
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
class Result:
    release: Release
    found: Status | None  # status of the expected site, None if not found
    sites: tuple[Site, ...]
    problems: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        r = self.release
        return {
            "version": r.version,
            "path": r.path,
            "function": r.function,
            "expected": r.status.value,
            "found": self.found.value if self.found else None,
            "strategies": list(r.strategies),
            "sites": [s.to_json() for s in self.sites],
            "ok": self.ok,
            "problems": list(self.problems),
            "seconds": round(self.seconds, 3),
        }


def check(release: Release, sites: list[Site]) -> Result:
    problems: list[str] = []
    main = [s for s in sites if s.path == release.path and s.function == release.function]
    found = main[0].status if len(main) == 1 else None
    if len(main) != 1:
        problems.append(
            f"expected one site {release.function} in {release.path}, found {len(main)}"
        )
    elif found is not None and found is not release.status:
        problems.append(f"{release.path}: expected {release.status.value}, scan says {found.value}")
    for s in sites:
        # Other spec paths must be correct: vLLM's CPU path (0.26.0 on) calls
        # its raw-gate kernel with gathered gates (fixed), OLMo/Kimi/... gather
        # precomputed g/beta (not affected).
        if s not in main and s.status not in (Status.NOT_AFFECTED, Status.FIXED):
            problems.append(f"{s.path}:{s.line} {s.function}: unexpected {s.status.value}")
    return Result(release, found, tuple(sites), tuple(problems), 0.0)


def roundtrip(release: Release, strategy: str = "gather") -> list[str]:
    """Patch a private copy, then prove: every site fixed, a second apply
    changes nothing, revert gives back the original bytes. Problems found."""
    from gdn_backport.engine import Mode, apply_tree, revert_tree

    problems: list[str] = []
    pristine = sources.release_tree(release.version)
    with tempfile.TemporaryDirectory(prefix="gdn-roundtrip-") as tmp:
        tree = sources.copy_release(release.version, Path(tmp) / "tree")
        first = apply_tree(tree, strategy, Mode.WRITE)
        if first.exit_code != 0 or not first.written:
            problems.append(f"apply: exit {first.exit_code}, wrote {first.written}")
        _, after = scan_tree(tree)
        left = [s for s in after if s.status not in (Status.FIXED, Status.NOT_AFFECTED)]
        problems += [f"after apply: {s.path}:{s.line} still {s.status.value}" for s in left]
        second = apply_tree(tree, strategy, Mode.WRITE)
        if second.written or second.exit_code != 0:
            problems.append(f"second apply not idempotent: wrote {second.written}")
        back = revert_tree(tree, Mode.WRITE)
        if back.refused or back.written != first.written:
            problems.append(f"revert: refused {back.refused}, restored {back.written}")
        for rel in first.written:
            if (tree / rel).read_bytes() != (pristine / rel).read_bytes():
                problems.append(f"revert: {rel} differs from the release")
    return problems


def run(
    matrix: Matrix, only: list[str] | None = None, with_roundtrip: bool = False
) -> list[Result]:
    wanted = {str(Version(v)) for v in only} if only else None
    results = []
    for release in matrix.releases:
        if wanted is not None and release.version not in wanted:
            continue
        if wanted is None and release.wheel_only:
            continue
        t0 = time.perf_counter()
        _, sites = scan_tree(sources.release_tree(release.version))
        res = check(release, sites)
        if with_roundtrip and release.status is Status.AFFECTED:
            extra = tuple(
                f"{strategy}: {p}"
                for strategy in release.strategies
                for p in roundtrip(release, strategy)
            )
            res = Result(res.release, res.found, res.sites, res.problems + extra, 0.0)

        results.append(
            Result(res.release, res.found, res.sites, res.problems, time.perf_counter() - t0)
        )
    return results


def render(results: list[Result]) -> str:
    rows = []
    for r in results:
        others = len(r.sites) - (1 if r.found else 0)
        rows.append(
            (
                r.release.version,
                r.release.path.removeprefix("vllm/model_executor/"),
                r.release.status.value,
                r.found.value if r.found else "-",
                others,
                ",".join(r.release.strategies),
                "ok" if r.ok else "MISMATCH: " + "; ".join(r.problems),
            )
        )
    ok = sum(r.ok for r in results)
    head = ["release", "site (vllm/model_executor/...)", "expected", "scan", "other sites",
            "cells", "result"]  # fmt: skip
    return table(head, rows) + f"\n{ok}/{len(results)} releases as expected"


# -- cells: one target with one strategy -----------------------------------------


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
        """Arguments of ``gdn-backport matrix --run`` that run exactly this cell."""
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


def parse_heads(text: str) -> tuple[int, int, int]:
    try:
        h, hv, dim = (int(x) for x in text.split(","))
    except ValueError as exc:
        raise UsageError(f"--heads {text}: expected H,HV,D (three integers)") from exc
    return h, hv, dim


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when torch sees a CUDA device, else ``cpu``."""
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {device}: choose auto, cpu or cuda")
    if device != "auto":
        return device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_scenarios(device: str) -> tuple[str, ...]:
    """Every scenario on the GPU; the small CI set on the CPU interpreter."""
    from gdn_backport.harness.scenarios import CI_SCENARIOS, SCENARIOS

    return tuple(s.name for s in SCENARIOS) if device == "cuda" else CI_SCENARIOS


@dataclass(frozen=True)
class RunOptions:
    device: str = "cpu"  # resolved: "cpu" or "cuda"
    scenarios: tuple[str, ...] = ()  # empty: default_scenarios(device)
    heads: tuple[int, int, int] | None = None  # None: small on CPU, GPU_HEADS on CUDA
    workdir: Path | None = None  # where patched copies live while a cell runs

    def scenario_names(self) -> tuple[str, ...]:
        return self.scenarios or default_scenarios(self.device)

    def layer_heads(self) -> tuple[int, int, int] | None:
        if self.heads is None and self.device == "cuda":
            return GPU_HEADS
        return self.heads


@dataclass(frozen=True)
class Check:
    """One thing a cell proved or failed to prove: a JUnit testcase."""

    name: str
    ok: bool
    message: str = ""  # one line: what was seen, or why it is wrong
    detail: str = ""
    skipped: str = ""  # why it could not run (expected), "" if it ran
    seconds: float | None = None  # None: timed as part of its phase (verify scenarios)


@dataclass(frozen=True)
class Verified:
    """One ``verify`` of a cell's tree: the report and what it had to show."""

    phase: str  # "unpatched" (as shipped) or "patched"
    report: VerifyReport
    must_fail: frozenset[str]  # scenarios that must fail here (the mutation check)
    seconds: float
    shared_with: str = ""  # the cell whose run of the same tree this reuses

    @property
    def worst(self) -> float | None:
        errs = [r.max_abs_err for r in self.report.rows]
        return max(errs) if errs else None

    def summary(self) -> str:
        if self.report.error:
            return "not run"
        rows = self.report.rows
        failed = sum(not r.passed for r in rows)
        if failed == 0:
            return f"{len(rows)}/{len(rows)} pass"
        return f"{failed}/{len(rows)} fail"

    def to_json(self) -> dict[str, object]:
        return {
            "phase": self.phase,
            "site": self.report.site,
            "device": self.report.device,
            "dtype": self.report.dtype,
            "error": self.report.error,
            "must_fail": sorted(self.must_fail),
            "seconds": round(self.seconds, 3),
            "shared_with": self.shared_with,
            "rows": [
                {
                    "name": r.name,
                    "passed": r.passed,
                    "expected": "fail" if r.name in self.must_fail else "pass",
                    "max_abs_err": _num(r.max_abs_err),
                    "tolerance": r.tolerance,
                    "layout": r.layout,
                    "note": r.note,
                }
                for r in self.report.rows
            ],
        }


def _num(x: float | None) -> float | str | None:
    # JSON has no infinity: a scenario that raised reports "inf".
    if x is None:
        return None
    return x if x == x and abs(x) != float("inf") else str(x)


@dataclass
class CellResult:
    cell: Cell
    checks: list[Check] = field(default_factory=list)
    status_before: Status | None = None
    status_after: Status | None = None
    written: tuple[str, ...] = ()
    unpatched: Verified | None = None
    patched: Verified | None = None
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        return [f"{c.name}: {c.message}" for c in self.checks if not c.ok]

    @property
    def skipped(self) -> str:
        return next((c.skipped for c in self.checks if c.skipped), "")

    @property
    def result(self) -> str:
        """``ok``, ``fail`` (something did not hold) or ``skip`` (verify
        cannot drive this release, as the matrix says: never a pass)."""
        if self.problems:
            return "fail"
        return "skip" if self.skipped else "ok"

    def to_json(self) -> dict[str, object]:
        c = self.cell
        return {
            "id": c.id,
            "release": c.release.version if c.release else None,
            "tree": c.tree.path if c.tree else None,
            "ref": c.tree.ref if c.tree and c.tree.ref else None,
            "strategy": c.strategy,
            "expected": c.release.status.value if c.release else None,
            "status_before": self.status_before.value if self.status_before else None,
            "status_after": self.status_after.value if self.status_after else None,
            "written": list(self.written),
            "result": self.result,
            "problems": self.problems,
            "skipped": self.skipped,
            "worst_err_unpatched": _num(self.unpatched.worst if self.unpatched else None),
            "worst_err_patched": _num(self.patched.worst if self.patched else None),
            "verify_unpatched": self.unpatched.to_json() if self.unpatched else None,
            "verify_patched": self.patched.to_json() if self.patched else None,
            "checks": [dataclasses.asdict(k) for k in self.checks],
            "seconds": round(self.seconds, 3),
        }


def _tree_status(sites: Sequence[Site], after: bool) -> tuple[Status | None, list[str]]:
    """A fork tree's status: its worst site; problems if it cannot be proven."""
    if not sites:
        return None, ["no GDN spec path found"]
    found = {s.status for s in sites}
    for status in (Status.UNKNOWN, Status.AFFECTED, Status.FIXED, Status.NOT_AFFECTED):
        if status in found:
            break
    problems = [
        f"{s.path}:{s.line} {s.function}: {s.status.value} ({s.reason})"
        for s in sites
        if s.status is Status.UNKNOWN or (after and s.status is Status.AFFECTED)
    ]
    return status, problems


def _release_status(
    release: Release, sites: Sequence[Site], expected: Status
) -> tuple[Status | None, list[str]]:
    res = check(dataclasses.replace(release, status=expected), list(sites))
    return res.found, list(res.problems)


def _sites_text(sites: Sequence[Site]) -> str:
    return "\n".join(f"{s.path}:{s.line} {s.function}: {s.status.value}" for s in sites)


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _materialise(tree: Tree, dest: Path) -> Path:
    """A private copy of a fork's ``vllm/`` (at ``tree.ref`` if given) under ``dest``."""
    src = tree.resolved()
    if not src.is_dir():
        raise UsageError(f"{src}: no such directory")
    if tree.ref:
        import git

        try:
            repo = git.Repo(src, search_parent_directories=True)
            commit = repo.commit(tree.ref)
        except Exception as exc:
            # Not a repository, or a ref git cannot resolve (gitdb's BadName).
            raise UsageError(f"{src}: cannot read git ref {tree.ref!r} ({exc})") from exc
        top = Path(str(repo.working_tree_dir)).resolve()
        prefix = src.resolve().relative_to(top).as_posix()
        try:
            sub = commit.tree / (f"{prefix}/vllm" if prefix != "." else "vllm")
        except KeyError:
            raise UsageError(f"{src}: no vllm/ at {tree.ref}") from None
        for item in sub.traverse():
            if item.type != "blob":  # type: ignore[union-attr]
                continue
            rel = Path(str(item.path)).relative_to(sub.path)  # type: ignore[union-attr]
            out = dest / "vllm" / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(item.data_stream.read())  # type: ignore[union-attr]
        return dest
    if not (src / "vllm").is_dir():
        raise UsageError(f"{src}: no vllm/ here (name the checkout that holds vllm/)")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", ".git", ".gdn-backport")
    shutil.copytree(src / "vllm", dest / "vllm", ignore=ignore)
    return dest


class CellRunner:
    """Runs cells in this process; the unpatched verify of a release is run
    once and shared by its cells (gather and kernel see the same tree)."""

    def __init__(self, options: RunOptions) -> None:
        self.options = options
        self._unpatched: dict[tuple[str, str], Verified] = {}

    def run(self, cell: Cell, stage: Callable[[str], None] | None = None) -> CellResult:
        res = CellResult(cell)
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(
                prefix=f"gdn-cell-{cell.id}-", dir=self.options.workdir
            ) as tmp:
                self._run(cell, res, Path(tmp), stage or (lambda _: None))
        except UsageError as exc:
            res.checks.append(Check("run", False, str(exc)))
        except Exception as exc:
            # One broken cell must not stop the others: recorded, with why.
            import traceback

            res.checks.append(
                Check("run", False, f"{type(exc).__name__}: {exc}", traceback.format_exc())
            )
        res.seconds = time.perf_counter() - t0
        return res

    def _scan(self, cell: Cell, root: Path, after: bool) -> tuple[Status | None, Check]:
        t0 = time.perf_counter()
        _, sites = scan_tree(root)
        name = "scan after" if after else "scan before"
        if cell.release is not None:
            expected = cell.release.status
            if after and expected is Status.AFFECTED:
                expected = Status.FIXED
            status, problems = _release_status(cell.release, sites, expected)
        else:
            status, problems = _tree_status(sites, after)
        seen = status.value if status else "no site"
        message = "; ".join(problems) if problems else seen
        return status, Check(
            name, not problems, message, _sites_text(sites), seconds=time.perf_counter() - t0
        )

    def _verify(self, cell: Cell, root: Path, phase: str, must_fail: bool) -> Verified:
        from gdn_backport.harness.scenarios import scenario

        opts = self.options
        names = opts.scenario_names()
        key = (str(root), phase)
        cached = self._unpatched.get(key) if cell.release is not None else None
        if cached is not None:
            return dataclasses.replace(cached, seconds=0.0)
        fail = frozenset(n for n in names if must_fail and scenario(n).expect_unpatched == "fail")
        t0 = time.perf_counter()
        report = verify_tree(root, device=opts.device, scenarios=names, heads=opts.layer_heads())
        done = Verified(phase, report, fail, time.perf_counter() - t0)
        if cell.release is not None and phase == "unpatched":
            self._unpatched[key] = dataclasses.replace(done, shared_with=cell.id)
        return done

    def _verify_checks(self, cell: Cell, v: Verified) -> list[Check]:
        if v.report.error:
            reason = cell.release.skip_verify if cell.release else ""
            if reason:
                return [Check(f"verify {v.phase}", True, detail=v.report.error, skipped=reason)]
            return [Check(f"verify {v.phase}", False, f"could not run: {v.report.error}")]
        out = []
        for r in v.report.rows:
            err = f"max_abs_err {_fmt(r.max_abs_err)}, tolerance {_fmt(r.tolerance)}"
            if r.name in v.must_fail:
                ok = not r.passed
                msg = (
                    f"fails as it must unpatched ({err})"
                    if ok
                    else f"passes on the unpatched tree: the suite cannot see the bug ({err})"
                )
            else:
                ok = r.passed
                msg = err if ok else f"{err}: {r.note}" if r.note else err
            detail = f"layout {r.layout}\n{r.note}".strip()
            if v.shared_with:
                detail += f"\n(same unpatched run as cell {v.shared_with})"
            out.append(Check(f"verify {v.phase}: {r.name}", ok, msg, detail))
        return out

    def _run(self, cell: Cell, res: CellResult, tmp: Path, stage: Callable[[str], None]) -> None:
        from gdn_backport.engine import Mode, apply_tree

        stage("fetch")
        t0 = time.perf_counter()
        if cell.release is not None:
            root = sources.release_tree(cell.release.version)
        else:
            assert cell.tree is not None
            root = _materialise(cell.tree, tmp / "source")
        res.checks.append(Check("fetch", True, str(root), seconds=time.perf_counter() - t0))

        stage("scan")
        res.status_before, scanned = self._scan(cell, root, after=False)
        res.checks.append(scanned)
        expected = cell.release.status if cell.release else res.status_before
        affected = expected is Status.AFFECTED

        if cell.strategy == "none":
            stage("verify")
            res.unpatched = self._verify(cell, root, "unpatched", must_fail=affected)
            res.checks += self._verify_checks(cell, res.unpatched)
            res.status_after = res.status_before
            return

        if affected:
            stage("verify unpatched")
            res.unpatched = self._verify(cell, root, "unpatched", must_fail=True)
            res.checks += self._verify_checks(cell, res.unpatched)

        stage(f"patch ({cell.strategy})")
        t0 = time.perf_counter()
        work = tmp / "patched"
        if cell.release is not None:
            sources.copy_release(cell.release.version, work)
        else:
            shutil.copytree(root, work)
        out = apply_tree(work, cell.strategy, Mode.WRITE)
        res.written = tuple(out.written)
        refused = "; ".join(f"{p}: {r}" for p, r in out.refused)
        if refused:
            ok, msg = False, f"refused: {refused}"
        elif affected and not out.written:
            ok, msg = False, f"wrote nothing on an affected tree ({out.message})"
        elif not affected and out.written:
            ok, msg = False, f"changed a tree that was not affected: {', '.join(out.written)}"
        else:
            ok, msg = out.exit_code == 0, f"exit {out.exit_code}, wrote {len(out.written)} file(s)"
        res.checks.append(Check("apply", ok, msg, out.diff, seconds=time.perf_counter() - t0))

        stage("scan after")
        res.status_after, scanned = self._scan(cell, work, after=True)
        res.checks.append(scanned)

        stage("verify patched")
        res.patched = self._verify(cell, work, "patched", must_fail=False)
        res.checks += self._verify_checks(cell, res.patched)


def run_cells(
    todo: Sequence[Cell],
    options: RunOptions,
    progress: Callable[[int, int, Cell, str, CellResult | None], None] | None = None,
) -> list[CellResult]:
    """Run ``todo`` one after the other in this process.

    ``progress(i, n, cell, stage, result)`` is called when a cell enters a
    stage (``result`` None) and once when it is done (stage ``"done"``).
    """
    runner = CellRunner(options)
    results = []
    for i, cell in enumerate(todo, 1):

        def stage(name: str, i: int = i, cell: Cell = cell) -> None:
            if progress:
                progress(i, len(todo), cell, name, None)

        res = runner.run(cell, stage)
        if progress:
            progress(i, len(todo), cell, "done", res)
        results.append(res)
    return results


class ProgressLine:
    """``[12/51] 0.25.1 gather: verify patched ...``: one live line per cell on
    a terminal, a start and an end line per cell otherwise (CI logs)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def __call__(self, i: int, n: int, cell: Cell, stage: str, res: CellResult | None) -> None:
        head = f"[{i}/{n}] {cell.target} {cell.strategy}"
        if res is None:
            if self.live:
                self._write(f"\r\x1b[2K{head}: {stage} ...")
            elif stage == "fetch":
                self._write(f"{head} ...\n")
            return
        verdict = res.result if res.result != "fail" else "FAIL"
        why = f": {res.problems[0]}" if res.problems else f": {res.skipped}" if res.skipped else ""
        line = f"{head}: {verdict} ({res.seconds:.1f} s){why}"
        self._write(f"\r\x1b[2K{line[:200]}\n" if self.live else f"{line[:300]}\n")


# -- results: summary table, JSON, Markdown, JUnit XML ----------------------------


def environment(options: RunOptions) -> dict[str, object]:
    """What ran: versions first (printed before any cell), device, shapes."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    gpu = ""
    if options.device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(0)
    return {
        "gdn_backport": __version__,
        "python": platform.python_version(),
        "torch": version("torch"),
        "triton": version("triton"),
        "device": options.device,
        "gpu": gpu,
        "interpreter": options.device == "cpu",
        "heads": list(options.layer_heads() or ()) or "small CPU shape",
        "scenarios": list(options.scenario_names()),
        "cache": str(sources.cache_dir()),
        "offline": os.environ.get("GDN_BACKPORT_OFFLINE") == "1",
        "host": socket.gethostname(),
    }


def environment_line(env: dict[str, object]) -> str:
    device = f"cuda ({env['gpu']})" if env["device"] == "cuda" else "cpu (Triton interpreter)"
    heads = env["heads"]
    shape = ",".join(map(str, heads)) if isinstance(heads, list) else heads
    return (
        f"gdn-backport {env['gdn_backport']}, python {env['python']}, torch {env['torch']}, "
        f"triton {env['triton']}; device {device}; heads {shape}; "
        f"cache {env['cache']}{' (offline)' if env['offline'] else ''}"
    )


def _worst(res: CellResult) -> str:
    parts = []
    if res.unpatched and res.unpatched.worst is not None:
        parts.append(_fmt(res.unpatched.worst))
    if res.patched and res.patched.worst is not None:
        parts.append(_fmt(res.patched.worst))
    return " -> ".join(parts) or "-"


def _verdict(res: CellResult, width: int | None = 90) -> str:
    if res.result == "ok":
        return "ok"
    problems = "; ".join(res.problems)
    text = f"skip: {res.skipped}" if res.result == "skip" else f"FAIL: {problems}"
    return text if width is None or len(text) <= width else text[: width - 3] + "..."


def summary_rows(results: Sequence[CellResult], width: int | None = 90) -> list[list[str]]:
    rows = []
    for r in results:
        rows.append(
            [
                r.cell.id,
                r.status_before.value if r.status_before else "-",
                r.status_after.value if r.status_after else "-",
                r.unpatched.summary() if r.unpatched else "-",
                r.patched.summary() if r.patched else "-",
                _worst(r),
                f"{r.seconds:.1f} s",
                _verdict(r, width),
            ]
        )
    return rows


SUMMARY_HEAD = ["cell", "before", "after", "verify unpatched", "verify patched",
                "worst err", "time", "result"]  # fmt: skip


def counts(results: Sequence[CellResult]) -> dict[str, int]:
    return {k: sum(r.result == k for r in results) for k in ("ok", "fail", "skip")}


def render_cells(results: Sequence[CellResult], seconds: float | None = None) -> str:
    c = counts(results)
    tail = f"\n{c['ok']} ok, {c['fail']} failed, {c['skip']} skipped of {len(results)} cells"
    if seconds is not None:
        tail += f" in {seconds:.1f} s"
    return table(SUMMARY_HEAD, summary_rows(results)) + tail


def render_markdown(
    results: Sequence[CellResult], env: dict[str, object], seconds: float | None = None
) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "# gdn-backport matrix",
        "",
        environment_line(env),
        "",
        "| " + " | ".join(SUMMARY_HEAD) + " |",
        "|" + " --- |" * len(SUMMARY_HEAD),
    ]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in summary_rows(results, None)]
    c = counts(results)
    total = f" in {seconds:.1f} s" if seconds is not None else ""
    lines += ["", f"{c['ok']} ok, {c['fail']} failed, {c['skip']} skipped{total}."]
    failing = [r for r in results if r.result == "fail"]
    if failing:
        lines += ["", "## Failures", ""]
        for r in failing:
            lines += [f"- `{r.cell.id}`: " + cell("; ".join(r.problems))]
    return "\n".join(lines) + "\n"


def junit_xml(res: CellResult, env: dict[str, object]) -> ET.ElementTree:
    """One ``<testsuite>`` per cell, one ``<testcase>`` per check (each
    verify scenario is one), failures carrying the error size."""
    suite_name = f"cell({res.cell.id})"
    failures = sum(not c.ok for c in res.checks)
    skipped = sum(bool(c.skipped) for c in res.checks)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    root = ET.Element(
        "testsuites",
        name="gdn-backport matrix",
        tests=str(len(res.checks)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        time=f"{res.seconds:.3f}",
    )
    suite = ET.SubElement(
        root,
        "testsuite",
        name=suite_name,
        tests=str(len(res.checks)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        time=f"{res.seconds:.3f}",
        timestamp=stamp,
        hostname=str(env.get("host", "")),
    )
    props = ET.SubElement(suite, "properties")
    cell = res.cell
    info: dict[str, object] = {
        "release": cell.release.version if cell.release else "",
        "tree": cell.tree.path if cell.tree else "",
        "strategy": cell.strategy,
        "expected": cell.release.status.value if cell.release else "",
        "status_before": res.status_before.value if res.status_before else "",
        "status_after": res.status_after.value if res.status_after else "",
        "result": res.result,
        **{k: v for k, v in env.items() if k != "host"},
    }
    for k, v in info.items():
        value = ",".join(map(str, v)) if isinstance(v, list) else str(v)
        ET.SubElement(props, "property", name=k, value=value)
    for c in res.checks:
        case = ET.SubElement(suite, "testcase", classname=suite_name, name=c.name)
        if c.seconds is not None:
            case.set("time", f"{c.seconds:.3f}")
        if c.skipped:
            ET.SubElement(case, "skipped", message=c.skipped).text = c.detail or None
        elif not c.ok:
            fail = ET.SubElement(case, "failure", message=c.message, type="AssertionError")
            fail.text = c.detail or c.message
        elif c.message or c.detail:
            out = ET.SubElement(case, "system-out")
            out.text = "\n".join(x for x in (c.message, c.detail) if x)
    ET.indent(root)
    return ET.ElementTree(root)


def write_results(
    results: Sequence[CellResult],
    env: dict[str, object],
    directory: Path,
    seconds: float | None = None,
) -> list[Path]:
    """``<id>.xml`` (JUnit) per cell, ``summary.json`` and ``summary.md``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for res in results:
        path = directory / f"{res.cell.id}.xml"
        junit_xml(res, env).write(path, encoding="utf-8", xml_declaration=True)
        written.append(path)
    doc = {
        "environment": env,
        "seconds": round(seconds, 3) if seconds is not None else None,
        "counts": counts(results),
        "ok": all(r.result != "fail" for r in results),
        "cells": [r.to_json() for r in results],
    }
    summary = directory / "summary.json"
    summary.write_text(json.dumps(doc, indent=2) + "\n")
    markdown = directory / "summary.md"
    markdown.write_text(render_markdown(results, env, seconds))
    return [*written, summary, markdown]


def exit_code(results: Iterable[CellResult]) -> int:
    """0 every cell ok or skipped as the matrix says, 1 otherwise."""
    return 0 if all(r.result != "fail" for r in results) else 1
