"""matrix/releases.toml: validation, and what counts as a mismatch."""

from __future__ import annotations

import pytest

from gdn_backport import matrix
from gdn_backport.analysis import Status
from gdn_backport.errors import UsageError
from gdn_backport.scan import Site


def test_shipped_matrix_loads() -> None:
    m = matrix.load()
    versions = [r.version for r in m.releases]
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))))
    with_sdist = [r for r in m.releases if not r.wheel_only]
    assert len(with_sdist) == 34
    assert sum(r.status is Status.AFFECTED for r in with_sdist) == 17
    assert {r.strategies for r in m.releases} == {("none",), ("gather", "kernel")}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "no \\[\\[release\\]\\] tables"),
        ({"release": [{"version": "1.0", "path": "p", "function": "f"}]}, "key 'status'"),
        (
            {"release": [{"version": "x.y", "path": "p", "function": "f", "status": "fixed"}]},
            "key 'version'",
        ),
        (
            {"release": [{"version": "1.0", "path": "p", "function": "f", "status": "broken"}]},
            "'broken' is not a status",
        ),
        (
            {"release": [{"version": "1.0", "path": "p", "function": "f", "status": "fixed"}] * 2},
            "listed twice",
        ),
    ],
)
def test_bad_matrix_names_file_and_key(doc: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=f"matrix/releases.toml: .*{message}"):
        matrix.parse(doc)


def _site(path: str, function: str, status: Status) -> Site:
    return Site(path, 1, function, status, "")


def test_check_flags_wrong_status_missing_site_and_surprising_others() -> None:
    release = matrix.Release("1.0", "a.py", "L._forward_core", Status.AFFECTED)
    assert matrix.check(release, [_site("a.py", "L._forward_core", Status.AFFECTED)]).ok
    wrong = matrix.check(release, [_site("a.py", "L._forward_core", Status.FIXED)])
    assert not wrong.ok and "expected affected" in wrong.problems[0]
    assert not matrix.check(release, []).ok
    other = matrix.check(
        release,
        [
            _site("a.py", "L._forward_core", Status.AFFECTED),
            _site("olmo.py", "O._forward_core", Status.UNKNOWN),
        ],
    )
    assert not other.ok and "unexpected unknown" in other.problems[0]
