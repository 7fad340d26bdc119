"""engine_suite/scenario.py: a scenario is data, and refuses a prompt with no room to answer."""

from __future__ import annotations

import dataclasses

import pytest

from gdn_backport.engine_suite.config import EngineConfig
from gdn_backport.engine_suite.model import ModelShape
from gdn_backport.engine_suite.rules import TaggedFloorRule
from gdn_backport.engine_suite.scenario import EngineScenario
from gdn_backport.engine_suite.workload import Request, Workload


def _scenario(prompt_len: int, max_model_len: int = 64) -> EngineScenario:
    requests = (Request("r0", tuple(range(prompt_len)), max_tokens=8),)
    return EngineScenario(
        name="toy",
        patchset="p",
        description="a toy",
        engine=EngineConfig(max_model_len=max_model_len),
        workload=Workload("w", requests),
        rule=TaggedFloorRule(),
        attributes_to="nothing",
    )


def test_a_prompt_shorter_than_max_model_len_is_a_scenario_with_defaults() -> None:
    s = _scenario(63)
    assert s.alone is None and s.tags == () and s.seed == 0 and s.timeout_s == 420.0
    assert s.model == ModelShape()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("length", [64, 100])
def test_a_prompt_that_leaves_no_room_for_a_token_is_refused(length: int) -> None:
    with pytest.raises(ValueError, match=f"scenario toy: request r0: prompt of {length} tokens "
                                         ">= max_model_len 64"):  # fmt: skip
        _scenario(length)
