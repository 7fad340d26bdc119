"""An engine scenario: one engine configuration, one workload, one pass rule.

Scenarios are data declared by each patchset (``scenarios/<id>.py`` for
now); the suite runs any of them the same way. ``patchset`` is a plain
string: the core never names one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gdn_backport.engine_suite.config import EngineConfig
from gdn_backport.engine_suite.gates import GateThresholds
from gdn_backport.engine_suite.model import ModelShape
from gdn_backport.engine_suite.rules import PassRule
from gdn_backport.engine_suite.weights import WeightRules
from gdn_backport.engine_suite.workload import Workload

__all__ = ["EngineScenario"]


@dataclass(frozen=True)
class EngineScenario:
    name: str
    patchset: str
    description: str
    engine: EngineConfig
    workload: Workload
    rule: PassRule
    # What a failure means: which code path produced the tagged errors.
    attributes_to: str
    tags: tuple[str, ...] = ()
    # The subject requests run alone in a fresh engine of this config (rules
    # that compare with an alone run need it).
    alone: EngineConfig | None = None
    seed: int = 0
    model: ModelShape = field(default_factory=ModelShape)
    weights: WeightRules = field(default_factory=WeightRules)
    gates: GateThresholds = field(default_factory=GateThresholds)
    timeout_s: float = 420.0

    def __post_init__(self) -> None:
        # vLLM refuses a prompt that leaves no room for one output token;
        # outputs may run into max_model_len on purpose (no drafts fit there).
        for r in self.workload.requests:
            if len(r.prompt) >= self.engine.max_model_len:
                raise ValueError(
                    f"scenario {self.name}: request {r.id}: prompt of {len(r.prompt)} tokens "
                    f">= max_model_len {self.engine.max_model_len}"
                )
