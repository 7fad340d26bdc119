"""The scan-only check of the matrix: each release's sites, patchset by
patchset, against what that patchset expects (and, with ``--roundtrip``, a
patched copy's apply, second apply and revert)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from gdn_backport import registry, sources
from gdn_backport.matrix.model import Expectation, Matrix, Release
from gdn_backport.report import table
from gdn_backport.site import Site, Status, worst
from gdn_backport.tree import Tree


@dataclass(frozen=True)
class Found:
    """One patchset's scan of a release: the status it judged (the expected
    site's, or the worst) and its sites."""

    patchset: str
    expected: Expectation
    status: Status | None
    sites: tuple[Site, ...]

    def to_json(self) -> dict[str, object]:
        e = self.expected
        doc: dict[str, object] = {
            "expected": e.status.value,
            "found": self.status.value if self.status else None,
            "apply": e.apply,
            "sites": [s.to_json() for s in self.sites],
        }
        if e.path:
            doc = {"path": e.path, "function": e.function, **doc}
        return doc


@dataclass(frozen=True)
class Result:
    release: Release
    found: tuple[Found, ...]
    problems: tuple[str, ...]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        r = self.release
        doc: dict[str, object] = {"version": r.version}
        # The first patchset's fields at the top, the others under their id
        # (the layout this document had before patchsets were packages).
        for i, f in enumerate(self.found):
            if i == 0:
                doc.update(f.to_json())
            else:
                doc[f.patchset] = f.to_json()
        doc["patchsets"] = {f.patchset: f.to_json() for f in self.found}
        doc["strategies"] = list(r.strategies)
        doc["ok"] = self.ok
        doc["problems"] = list(self.problems)
        doc["seconds"] = round(self.seconds, 3)
        return doc


def check_sites(
    expected: Expectation, sites: Sequence[Site], status: Status | None = None
) -> tuple[Status | None, list[str]]:
    """What ``sites`` (one patchset's) say against ``expected`` (``status``
    overrides its status, e.g. ``fixed`` after apply): the status judged
    (None: not found) and what does not hold. With a site named, that site
    must be there once with the status and every other site correct; else
    the worst status over all sites must be it."""
    want = status or expected.status
    if not expected.path:
        found = worst(s.status for s in sites)
        if found is want:
            return found, []
        seen = found.value if found else "no site"
        return found, [f"expected {want.value}, scan says {seen}"]
    problems: list[str] = []
    main = [s for s in sites if s.path == expected.path and s.function == expected.function]
    found = main[0].status if len(main) == 1 else None
    if len(main) != 1:
        problems.append(
            f"expected one site {expected.function} in {expected.path}, found {len(main)}"
        )
    elif found is not want:
        problems.append(f"{expected.path}: expected {want.value}, scan says {found}")
    for s in sites:
        # Other sites must be correct (fixed or not affected).
        if s not in main and s.status not in (Status.NOT_AFFECTED, Status.FIXED):
            problems.append(f"{s.path}:{s.line} {s.function}: unexpected {s.status.value}")
    return found, problems


def scan_release(release: Release, tree: Path) -> tuple[list[Found], list[str]]:
    """Every patchset with an expectation of ``release``, scanned over ``tree``."""
    found: list[Found] = []
    problems: list[str] = []
    view = Tree.of(tree)
    for ps in registry.discover():
        exp = release.expectation(ps.info.id)
        if exp is None:
            continue
        sites = ps.scan(view)
        status, wrong = check_sites(exp, sites)
        found.append(Found(ps.info.id, exp, status, tuple(sites)))
        problems += [f"{ps.info.id}: {p}" for p in wrong]
    return found, problems


def roundtrip(release: Release, patchset: str, strategy: str) -> list[str]:
    """One patchset with one strategy on a private copy: where it expects a
    refusal, exit 2 and nothing written; else every site fixed or not
    affected after apply, a second apply changes nothing, revert gives the
    original bytes back. The problems found."""
    from gdn_backport import pipeline
    from gdn_backport.pipeline import Mode, revert_tree

    ps = registry.get(patchset)
    exp = release.expectation(patchset)
    problems: list[str] = []
    pristine = sources.release_tree(release.version)
    with tempfile.TemporaryDirectory(prefix="gdn-roundtrip-") as tmp:
        tree = sources.copy_release(release.version, Path(tmp) / "tree")

        def apply() -> pipeline.Outcome:
            return pipeline.apply(tree, [ps], strategy, Mode.WRITE)[0][1]

        first = apply()
        if exp is not None and exp.apply == "refuse":
            if first.exit_code != 2 or first.written:
                problems.append(f"apply: expected a refusal, exit {first.exit_code}")
            return problems
        if first.exit_code != 0 or not first.written:
            problems.append(f"apply: exit {first.exit_code}, wrote {first.written} {first.refused}")
        left = [
            s for s in ps.scan(Tree.of(tree)) if s.status not in (Status.FIXED, Status.NOT_AFFECTED)
        ]
        problems += [f"after apply: {s.path}:{s.line} still {s.status.value}" for s in left]
        second = apply()
        if second.written or second.exit_code != 0:
            problems.append(f"second apply not idempotent: wrote {second.written}")
        back = revert_tree(tree, Mode.WRITE)
        if back.refused or sorted(back.written) != sorted(first.written):
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
        found, problems = scan_release(release, sources.release_tree(release.version))
        if with_roundtrip:
            for patchset, strategy in release.cells():
                exp = release.expectation(patchset)
                if exp is None or exp.status is not Status.AFFECTED:
                    continue
                problems += [
                    f"{patchset} {strategy}: {p}" for p in roundtrip(release, patchset, strategy)
                ]
        results.append(Result(release, tuple(found), tuple(problems), time.perf_counter() - t0))
    return results


def render(results: list[Result]) -> str:
    ids = [ps.info.id for ps in registry.discover()]
    rows = []
    for r in results:
        by = {f.patchset: f for f in r.found}
        cells = []
        for i in ids:
            f = by.get(i)
            if f is None:
                cells.append("-")
                continue
            seen = f.status.value if f.status else "-"
            text = (
                seen
                if seen == f.expected.status.value
                else f"{seen} (expected {f.expected.status.value})"
            )
            cells.append(text + (" (refuse)" if f.expected.apply == "refuse" else ""))
        rows.append(
            (
                r.release.version,
                *cells,
                ",".join(r.release.strategies),
                "ok" if r.ok else "MISMATCH: " + "; ".join(r.problems),
            )
        )
    ok = sum(r.ok for r in results)
    head = ["release", *ids, "cells", "result"]
    return table(head, rows) + f"\n{ok}/{len(results)} releases as expected"
