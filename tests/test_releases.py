"""Real vLLM releases fetched from PyPI at test time: one per layout.

Expectations come from matrix/releases.toml and each patchset's
expected.toml; the tool derives every status by analysis. Affected
releases also go through apply -> re-scan -> second apply -> revert on a
private copy, for every patchset that expects them affected, with each of
its strategies.
"""

from __future__ import annotations

import pytest

from gdn_backport import matrix, registry
from gdn_backport.site import Status
from gdn_backport.tree import Tree

pytestmark = pytest.mark.network

# One release per layout of DESIGN.md's table, the first fixed one, and the
# releases that ship pr51565's builder fix without its runner guard.
RELEASES = ["0.10.2", "0.17.1", "0.18.1", "0.21.0", "0.27.1", "0.28.0", "0.31.0", "0.33.0"]
BY_VERSION = {r.version: r for r in matrix.load().releases}


@pytest.mark.parametrize("version", RELEASES)
def test_scan_matches_the_matrix(version: str, release) -> None:  # type: ignore[no-untyped-def]
    found, problems = matrix.scan_release(BY_VERSION[version], release(version))
    assert problems == []
    # Every patchset with an expectation of the release judged it.
    assert {f.patchset for f in found} == {
        ps.info.id for ps in registry.discover() if BY_VERSION[version].expectation(ps.info.id)
    }
    assert all(f.status is not None for f in found)


def test_olmo_layer_is_reported_not_affected(release) -> None:  # type: ignore[no-untyped-def]
    view = Tree.of(release("0.27.1"))
    sites = [s for ps in registry.discover() for s in ps.scan(view)]
    olmo = [s for s in sites if "olmo" in s.path]
    assert olmo and all(s.status is Status.NOT_AFFECTED for s in olmo)
    assert any("g_spec" in s.reason for s in olmo)


def _roundtrip_cells() -> list[tuple[str, str, str]]:
    cells = []
    for version in ("0.18.1", "0.21.0", "0.27.1", "0.31.0"):
        rel = BY_VERSION[version]
        for patchset, strategy in rel.cells():
            exp = rel.expectation(patchset)
            if exp is not None and exp.status is Status.AFFECTED:
                cells.append((version, patchset, strategy))
    return cells


@pytest.mark.parametrize(("version", "patchset", "strategy"), _roundtrip_cells())
def test_apply_roundtrip(version: str, patchset: str, strategy: str) -> None:
    assert matrix.roundtrip(BY_VERSION[version], patchset, strategy) == []


def test_roundtrip_cells_cover_every_patchset() -> None:
    """The round trips above reach every patchset and each of its strategies."""
    cells = _roundtrip_cells()
    for ps in registry.discover():
        assert {s for _, p, s in cells if p == ps.info.id} == set(ps.info.strategies), ps.info.id
