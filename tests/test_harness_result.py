"""harness/result.py: a scenario's outcome and the tolerance of each dtype."""

from __future__ import annotations

import pytest

from gdn_backport.harness.result import TOLERANCES, ScenarioResult, tolerance


def test_tolerance_takes_a_torch_dtype_or_its_name() -> None:
    torch = pytest.importorskip("torch")
    assert tolerance(torch.float16) == tolerance("float16") == 2e-2
    assert tolerance(torch.bfloat16) == 6e-2
    assert tolerance("torch.float32") == 5e-3
    # Lower precision, wider tolerance.
    assert TOLERANCES["float32"] < TOLERANCES["float16"] < TOLERANCES["bfloat16"]


def test_an_unknown_dtype_has_no_tolerance() -> None:
    with pytest.raises(KeyError):
        tolerance("int8")


def test_a_result_holds_its_errors_by_oracle() -> None:
    row = ScenarioResult("pr_layout", "mixed", "[N1, S3@1]", 0.5, 2e-2, False)
    assert row.note == "" and row.errors == {}
    other = ScenarioResult("pr_layout", "mixed", "[N1, S3@1]", 0.5, 2e-2, False)
    other.errors["reference"] = 0.5
    assert row.errors == {}  # not shared between rows
    assert row != other
