"""harness/suite.py: the suites' contract with verify, and whether Triton can run the kernels."""

from __future__ import annotations

import sys
import types

import pytest

from gdn_backport.harness import suite
from gdn_backport.harness.suite import SuiteError, triton_problem


def _triton(monkeypatch: pytest.MonkeyPatch, version: str | None) -> None:
    if version is None:
        monkeypatch.setitem(sys.modules, "triton", None)  # import fails
    else:
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))


@pytest.mark.parametrize("version", ["3.6.0", "3.8.9", "3.2.0+git1234"])
def test_a_triton_before_the_bound_is_fine(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    _triton(monkeypatch, version)
    assert triton_problem() == ""


@pytest.mark.parametrize("version", ["3.9.0", "3.9.0rc1", "4.0.0"])
def test_a_triton_without_block_pointers_is_named(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    _triton(monkeypatch, version)
    problem = triton_problem()
    assert problem.startswith(f"triton {version} removed block pointers")
    assert "install triton<3.9" in problem


def test_no_triton_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    _triton(monkeypatch, None)
    assert triton_problem() == "triton is not installed"


def test_suite_error_is_a_plain_exception_with_its_reason() -> None:
    exc = SuiteError("no _forward_core")
    assert str(exc) == "no _forward_core" and not isinstance(exc, ValueError)
    assert set(suite.__all__) == {"TRITON_TOO_NEW", "Suite", "SuiteError", "SuiteReport",
                                  "triton_problem"}  # fmt: skip
