"""Real vLLM releases fetched from PyPI at test time: one per layout.

Expectations come from matrix/releases.toml; the tool derives every status
by analysis. Affected releases also go through apply -> re-scan -> second
apply -> revert on a private copy.
"""

from __future__ import annotations

import pytest

from gdn_backport import matrix
from gdn_backport.patchsets.pr51812.scan import scan_tree
from gdn_backport.site import Status

pytestmark = pytest.mark.network

# One release per layout of DESIGN.md's table, plus the first fixed one.
RELEASES = ["0.10.2", "0.17.1", "0.18.1", "0.21.0", "0.27.1", "0.28.0"]
BY_VERSION = {r.version: r for r in matrix.load().releases}


@pytest.mark.parametrize("version", RELEASES)
def test_scan_matches_the_matrix(version: str, release) -> None:  # type: ignore[no-untyped-def]
    expected = BY_VERSION[version]
    _, sites = scan_tree(release(version))
    result = matrix.check(expected, sites)
    assert result.ok, result.problems


def test_olmo_layer_is_reported_not_affected(release) -> None:  # type: ignore[no-untyped-def]
    _, sites = scan_tree(release("0.27.1"))
    olmo = [s for s in sites if "olmo" in s.path]
    assert olmo and all(s.status is Status.NOT_AFFECTED for s in olmo)
    assert "g_spec" in olmo[0].reason


@pytest.mark.parametrize("strategy", ["gather", "kernel"])
@pytest.mark.parametrize("version", ["0.18.1", "0.21.0", "0.27.1"])
def test_apply_roundtrip(version: str, strategy: str) -> None:
    assert matrix.roundtrip(BY_VERSION[version], strategy) == []
