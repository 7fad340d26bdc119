"""matrix/check.py: judging a scan's sites against what the matrix expects."""

from __future__ import annotations

from gdn_backport import matrix
from gdn_backport.site import Site, Status


def _site(path: str, function: str, status: Status) -> Site:
    return Site(path, 1, function, status, "")


def test_check_flags_wrong_status_missing_site_and_surprising_others() -> None:
    expected = matrix.Expectation(Status.AFFECTED, "a.py", "L._forward_core")
    assert matrix.check_sites(expected, [_site("a.py", "L._forward_core", Status.AFFECTED)]) == (
        Status.AFFECTED,
        [],
    )
    _, wrong = matrix.check_sites(expected, [_site("a.py", "L._forward_core", Status.FIXED)])
    assert wrong and "expected affected" in wrong[0]
    assert matrix.check_sites(expected, [])[1]
    _, other = matrix.check_sites(
        expected,
        [
            _site("a.py", "L._forward_core", Status.AFFECTED),
            _site("olmo.py", "O._forward_core", Status.UNKNOWN),
        ],
    )
    assert other and "unexpected unknown" in other[0]


def test_check_without_a_site_judges_the_worst() -> None:
    expected = matrix.Expectation(Status.AFFECTED)
    sites = [_site("b.py", "B.build", Status.AFFECTED), _site("r.py", "R.run", Status.FIXED)]
    assert matrix.check_sites(expected, sites) == (Status.AFFECTED, [])
    found, problems = matrix.check_sites(expected, sites[1:])
    assert found is Status.FIXED and problems == ["expected affected, scan says fixed"]
    assert matrix.check_sites(expected, [])[1] == ["expected affected, scan says no site"]
