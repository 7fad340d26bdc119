"""The version matrix (``matrix/releases.toml``): load, scan, compare, render."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from packaging.version import InvalidVersion, Version

from gdn_backport import sources
from gdn_backport.analysis import Status
from gdn_backport.errors import UsageError
from gdn_backport.report import table
from gdn_backport.scan import Site, scan_tree

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

WHERE = "matrix/releases.toml"


@dataclass(frozen=True)
class Release:
    version: str
    path: str  # where the Qwen GDN spec path lives
    function: str
    status: Status  # its expected status
    wheel_only: bool = False

    @property
    def strategies(self) -> tuple[str, ...]:
        """The matrix cells of this release: patch only what is affected."""
        return ("gather", "kernel") if self.status is Status.AFFECTED else ("none",)


@dataclass(frozen=True)
class Matrix:
    releases: tuple[Release, ...]


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
            Release(str(v), e["path"], e["function"], status, bool(e.get("wheel_only", False)))
        )
    return Matrix(tuple(sorted(releases, key=lambda r: Version(r.version))))


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
        if s not in main and s.status is not Status.NOT_AFFECTED:
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
