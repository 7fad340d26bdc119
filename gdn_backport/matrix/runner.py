"""Running cells: fetch the target, scan it, verify it unpatched (the mutation
check), patch a private copy, scan and verify it again. One process, cells
one after the other; the unpatched verify of a release is shared by its
cells."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gdn_backport import registry, sources
from gdn_backport.errors import UsageError
from gdn_backport.matrix.check import check_sites
from gdn_backport.matrix.model import GPU_HEADS, Cell, Tree
from gdn_backport.site import Site, Status, worst
from gdn_backport.tree import Tree as TreeView
from gdn_backport.verify import VerifyReport, verify_tree


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


def default_scenarios(device: str, patchset: str) -> tuple[str, ...]:
    """A patchset's cell scenarios on this device (its suite says which:
    every one on the GPU, a smaller set on the CPU interpreter)."""
    suite = registry.get(patchset).suite()
    return tuple(suite.cell_scenarios(device)) if suite is not None else ()


@dataclass(frozen=True)
class RunOptions:
    device: str = "cpu"  # resolved: "cpu" or "cuda"
    scenarios: tuple[str, ...] = ()  # empty: each patchset's default_scenarios(device)
    heads: tuple[int, int, int] | None = None  # None: small on CPU, GPU_HEADS on CUDA
    workdir: Path | None = None  # where patched copies live while a cell runs

    def scenarios_of(self, patchset: str) -> tuple[str, ...]:
        """The scenarios a cell of ``patchset`` runs: the ``--scenario``
        names of its suite, else (none given, or none of its) its defaults."""
        suite = registry.get(patchset).suite()
        names = set(suite.names) if suite is not None else set()
        mine = tuple(n for n in self.scenarios if n in names)
        return mine or default_scenarios(self.device, patchset)

    def scenario_names(self, patchsets: Iterable[str] = ()) -> list[str]:
        """The scenario names of a run, for its first line (each patchset's
        after the first names it)."""
        chosen = [p for p in registry.available() if p in set(patchsets)] or list(
            registry.available()[:1]
        )
        out: list[str] = []
        for i, p in enumerate(chosen):
            out += [n if i == 0 else f"{n} ({p})" for n in self.scenarios_of(p)]
        return out

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
    may_fail: frozenset[str] = frozenset()  # either result is right here

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
            "patchset": c.patchset,
            "expected": _expected(c),
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


def _expected(cell: Cell) -> str | None:
    exp = cell.expectation
    return exp.status.value if exp else None


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


def _sites_text(sites: Sequence[Site]) -> str:
    return "\n".join(f"{s.path}:{s.line} {s.function}: {s.status.value}" for s in sites)


def format_err(x: float) -> str:
    """An error or a tolerance as the tables and messages print it."""
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


def _patched_copy(cell: Cell, root: Path, tmp: Path) -> Path:
    """The private copy a cell patches (the release's, or the tree's)."""
    work = tmp / "patched"
    if cell.release is not None:
        sources.copy_release(cell.release.version, work)
    else:
        shutil.copytree(root, work)
    return work


class CellRunner:
    """Runs cells in this process; the unpatched verify of a release is run
    once and shared by its cells (gather and kernel see the same tree)."""

    def __init__(self, options: RunOptions) -> None:
        self.options = options
        self._unpatched: dict[tuple[str, str, str], Verified] = {}

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

    def _scan(self, cell: Cell, root: Path, after: bool) -> tuple[list[Site], Check]:
        t0 = time.perf_counter()
        sites = registry.get(cell.patchset).scan(TreeView.of(root))
        name = "scan after" if after else "scan before"
        exp = cell.expectation
        if exp is not None:
            want = Status.FIXED if after and exp.status is Status.AFFECTED else exp.status
            if after and not exp.path:
                # After apply nothing of the patchset is left affected or unknown.
                left = [s for s in sites if s.status in (Status.AFFECTED, Status.UNKNOWN)]
                problems = [f"{s.path}:{s.line} {s.function}: still {s.status.value}" for s in left]
            else:
                _, problems = check_sites(exp, sites, want)
        else:
            _, problems = _tree_status(sites, after)
        found = worst(s.status for s in sites)
        seen = found.value if found else "no site"
        message = "; ".join(problems) if problems else seen
        return sites, Check(
            name, not problems, message, _sites_text(sites), seconds=time.perf_counter() - t0
        )

    def _verify(self, cell: Cell, root: Path, phase: str, sites: Sequence[Site] | None) -> Verified:
        """One verify of ``root`` with the cell's patchset's suite; ``sites``
        (unpatched only): what the scan found, from which the suite says
        which scenarios must fail (the mutation check) and which may."""
        opts = self.options
        names = opts.scenarios_of(cell.patchset)
        key = (str(root), phase, cell.patchset)
        cached = self._unpatched.get(key) if cell.release is not None else None
        if cached is not None:
            return dataclasses.replace(cached, seconds=0.0)
        suite = registry.get(cell.patchset).suite()
        must: frozenset[str] = frozenset()
        may: frozenset[str] = frozenset()
        if sites is not None and suite is not None:
            must, may = suite.expected_failures(names, sites)
        t0 = time.perf_counter()
        report = verify_tree(
            root,
            device=opts.device,
            scenarios=names or None,
            heads=opts.layer_heads(),
            patchsets=[cell.patchset],
            seed=0,
        )
        done = Verified(phase, report, must, time.perf_counter() - t0, may_fail=may)
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
            err = f"max_abs_err {format_err(r.max_abs_err)}, tolerance {format_err(r.tolerance)}"
            if r.name in v.may_fail:
                ok = True
                state = "fails" if not r.passed else "passes"
                msg = f"{state} unpatched; either is right for this release ({err})"
            elif r.name in v.must_fail:
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

    def _fetch(self, cell: Cell, res: CellResult, tmp: Path, stage: Callable[[str], None]) -> Path:
        stage("fetch")
        t0 = time.perf_counter()
        if cell.release is not None:
            root = sources.release_tree(cell.release.version)
        else:
            assert cell.tree is not None
            root = _materialise(cell.tree, tmp / "source")
        res.checks.append(Check("fetch", True, str(root), seconds=time.perf_counter() - t0))
        return root

    def _run(self, cell: Cell, res: CellResult, tmp: Path, stage: Callable[[str], None]) -> None:
        """Scan; verify as shipped (where the patchset expects it affected,
        the suite's must-fail scenarios must fail: the mutation check); then
        apply the patchset alone to a private copy (a refusal where the
        matrix expects one), scan again and verify again."""
        from gdn_backport import pipeline
        from gdn_backport.pipeline import Mode

        ps = registry.get(cell.patchset)
        root = self._fetch(cell, res, tmp, stage)
        stage("scan")
        sites, scanned = self._scan(cell, root, after=False)
        res.checks.append(scanned)
        res.status_before = worst(s.status for s in sites)
        exp = cell.expectation
        affected = (exp.status if exp else res.status_before) is Status.AFFECTED

        if cell.strategy not in ps.info.strategies:
            # An unaffected cell: the release verified as shipped, which must pass.
            stage("verify")
            res.unpatched = self._verify(cell, root, "unpatched", sites if affected else ())
            res.checks += self._verify_checks(cell, res.unpatched)
            res.status_after = res.status_before
            return
        if affected:
            stage("verify unpatched")
            res.unpatched = self._verify(cell, root, "unpatched", sites)
            res.checks += self._verify_checks(cell, res.unpatched)

        stage(f"patch ({cell.strategy})")
        t0 = time.perf_counter()
        work = _patched_copy(cell, root, tmp)
        out = pipeline.apply(work, [ps], cell.strategy, Mode.WRITE)[0][1]
        res.written = tuple(out.written)
        refused = "; ".join(f"{p}: {r}" for p, r in out.refused)
        if exp is not None and exp.apply == "refuse":
            ok = out.exit_code == 2 and not out.written
            msg = f"refused as expected: {refused}" if ok else f"expected a refusal ({out.message})"
            res.checks.append(Check("apply", ok, msg, seconds=time.perf_counter() - t0))
            res.status_after = res.status_before
            return
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
        after, scanned = self._scan(cell, work, after=True)
        res.checks.append(scanned)
        res.status_after = worst(s.status for s in after)

        stage("verify patched")
        res.patched = self._verify(cell, work, "patched", None)
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


def exit_code(results: Iterable[CellResult]) -> int:
    """0 every cell ok or skipped as the matrix says, 1 otherwise."""
    return 0 if all(r.result != "fail" for r in results) else 1
