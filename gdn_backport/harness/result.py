"""A scenario's outcome and the tolerances every suite judges by (torch-free:
reports load where the suites cannot run, e.g. in ``matrix check``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TOLERANCES", "ScenarioResult", "tolerance"]

# Largest absolute error against the float64 oracle, by activation dtype.
TOLERANCES: dict[str, float] = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 5e-3}


def tolerance(dtype: object) -> float:
    """The tolerance of a torch dtype (or its name)."""
    return TOLERANCES[str(dtype).removeprefix("torch.")]


@dataclass
class ScenarioResult:
    """One scenario's outcome: the worst error over its oracles (``errors``,
    by oracle) against the dtype's tolerance."""

    name: str
    tag: str
    layout: str
    max_abs_err: float
    tolerance: float
    passed: bool
    note: str = ""
    errors: dict[str, float] = field(default_factory=dict)
