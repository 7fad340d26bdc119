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
from gdn_backport.analysis import ORDER, Status
from gdn_backport.matrix.model import Matrix, Release
from gdn_backport.patchset import load as load_patchset
from gdn_backport.report import table
from gdn_backport.scan import Site, scan_tree


@dataclass(frozen=True)
class Result:
    release: Release
    found: Status | None  # status of the expected site, None if not found
    sites: tuple[Site, ...]
    problems: tuple[str, ...]
    seconds: float
    # Patchset pr51565: the tree's worst status and its sites.
    split_found: Status | None = None
    split_sites: tuple[Site, ...] = ()

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
            "pr51565": {
                "expected": r.split_status.value if r.split_status else None,
                "found": self.split_found.value if self.split_found else None,
                "apply": r.split_apply,
                "sites": [s.to_json() for s in self.split_sites],
            },
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


def split_sites(tree: Path) -> list[Site]:
    from gdn_backport.prior_state import engine

    return engine.scan_sites(tree)


def check(release: Release, sites: list[Site]) -> Result:
    """The release's scan against the matrix's expectation."""
    found, problems = check_sites(release, sites, release.status)
    return Result(release, found, tuple(sites), tuple(problems), 0.0)


def worst(sites: Sequence[Site]) -> Status | None:
    found = {s.status for s in sites}
    return next((s for s in ORDER if s in found), None)


def check_split(release: Release, sites: Sequence[Site]) -> list[str]:
    """pr51565's sites of ``release`` against the matrix: the worst status."""
    expected, found = release.split_status, worst(sites)
    if expected is None or found is expected:
        return []
    seen = found.value if found else "no site"
    return [f"pr51565: expected {expected.value}, scan says {seen}"]


def roundtrip_split(release: Release) -> list[str]:
    """pr51565 on a private copy: where the matrix says "patch", every site
    fixed after apply, a second apply idempotent, revert byte-identical;
    where it says "refuse", exit 2 and nothing written."""
    from gdn_backport.engine import Mode, revert_tree
    from gdn_backport.prior_state import engine

    problems: list[str] = []
    pristine = sources.release_tree(release.version)
    with tempfile.TemporaryDirectory(prefix="gdn-roundtrip-") as tmp:
        tree = sources.copy_release(release.version, Path(tmp) / "tree")
        first = engine.apply_tree(tree, mode=Mode.WRITE)
        if release.split_apply == "refuse":
            if first.exit_code != 2 or first.written:
                problems.append(f"apply: expected a refusal, exit {first.exit_code}")
            return [f"pr51565: {p}" for p in problems]
        if first.exit_code != 0 or not first.written:
            problems.append(f"apply: exit {first.exit_code}, wrote {first.written} {first.refused}")
        left = [s for s in engine.scan_sites(tree) if s.status is not Status.FIXED]
        left = [s for s in left if s.status is not Status.NOT_AFFECTED]
        problems += [f"after apply: {s.path}:{s.line} still {s.status.value}" for s in left]
        second = engine.apply_tree(tree, mode=Mode.WRITE)
        if second.written or second.exit_code != 0:
            problems.append(f"second apply not idempotent: wrote {second.written}")
        back = revert_tree(tree, Mode.WRITE)
        if back.refused or sorted(back.written) != sorted(first.written):
            problems.append(f"revert: refused {back.refused}, restored {back.written}")
        for rel in first.written:
            if (tree / rel).read_bytes() != (pristine / rel).read_bytes():
                problems.append(f"revert: {rel} differs from the release")
    return [f"pr51565: {p}" for p in problems]


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
        tree = sources.release_tree(release.version)
        _, sites = scan_tree(tree)
        res = check(release, sites)
        split = tuple(split_sites(tree))
        extra = tuple(check_split(release, split))
        if with_roundtrip and release.status is Status.AFFECTED:
            extra += tuple(
                f"{strategy}: {p}"
                for strategy in release.strategies
                if strategy in load_patchset().strategies
                for p in roundtrip(release, strategy)
            )
        if with_roundtrip and release.split_status is Status.AFFECTED:
            extra += tuple(roundtrip_split(release))
        results.append(
            Result(
                res.release,
                res.found,
                res.sites,
                res.problems + extra,
                time.perf_counter() - t0,
                worst(split),
                split,
            )
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
                (r.split_found.value if r.split_found else "-")
                + (" (refuse)" if r.release.split_apply == "refuse" else ""),
                ",".join(r.release.strategies),
                "ok" if r.ok else "MISMATCH: " + "; ".join(r.problems),
            )
        )
    ok = sum(r.ok for r in results)
    head = ["release", "site (vllm/model_executor/...)", "expected", "scan", "other sites",
            "pr51565", "cells", "result"]  # fmt: skip
    return table(head, rows) + f"\n{ok}/{len(results)} releases as expected"
