"""The scan-only check of the matrix: each release's sites against what the
matrix expects (and, with ``--roundtrip``, a patched copy's apply, second
apply and revert)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from gdn_backport import sources
from gdn_backport.analysis import Status
from gdn_backport.matrix.model import Matrix, Release
from gdn_backport.report import table
from gdn_backport.scan import Site, scan_tree


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


def check_sites(
    release: Release, sites: Sequence[Site], expected: Status
) -> tuple[Status | None, list[str]]:
    """The status of the release's own GDN site among ``sites`` (None: not
    found once), and what does not hold: that site must be ``expected``,
    every other one correct."""
    problems: list[str] = []
    main = [s for s in sites if s.path == release.path and s.function == release.function]
    found = main[0].status if len(main) == 1 else None
    if len(main) != 1:
        problems.append(
            f"expected one site {release.function} in {release.path}, found {len(main)}"
        )
    elif found is not None and found is not expected:
        problems.append(f"{release.path}: expected {expected.value}, scan says {found.value}")
    for s in sites:
        # Other spec paths must be correct: vLLM's CPU path (0.26.0 on) calls
        # its raw-gate kernel with gathered gates (fixed), OLMo/Kimi/... gather
        # precomputed g/beta (not affected).
        if s not in main and s.status not in (Status.NOT_AFFECTED, Status.FIXED):
            problems.append(f"{s.path}:{s.line} {s.function}: unexpected {s.status.value}")
    return found, problems


def check(release: Release, sites: list[Site]) -> Result:
    """The release's scan against the matrix's expectation."""
    found, problems = check_sites(release, sites, release.status)
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
