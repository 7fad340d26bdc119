"""Engine scenarios of patchset pr51812 (vLLM #51812): in a mixed spec
step the spec kernel reads the first T_spec *ungathered* gate rows, so a
non-spec row before spec rows hands them other tokens' gates.

Each scenario passes when the tokens the bug reaches (produced by a step
whose build displaced the request's spec rows, and every later token of
that request) err no more than 3x the run's clean tokens against the
teacher-forced reference; it is inconclusive when too few tokens were
reached or the model's gates are flat.
"""

from __future__ import annotations

from gdn_backport.engine_suite.config import EngineConfig
from gdn_backport.engine_suite.model import ModelShape
from gdn_backport.engine_suite.rules import TaggedFloorRule
from gdn_backport.engine_suite.scenario import EngineScenario
from gdn_backport.engine_suite.workload import misorder_rich, pr_recipe, production_mixed

from . import ID as PATCHSET

SEED = 0
VOCAB = ModelShape().prompt_token_range
ATTRIBUTES_TO = (
    "the spec kernel's gate rows (a, b) in builds whose spec_token_indx is not a leading "
    "prefix: _forward_core's fused_sigmoid_gating_delta_rule_update call"
)

_recipe = EngineConfig(num_speculative_tokens=2, max_model_len=128, max_num_seqs=8)
_misorder = EngineConfig(num_speculative_tokens=2, max_model_len=128, max_num_seqs=16)

SCENARIOS = (
    EngineScenario(
        name="pr51812-recipe",
        patchset=PATCHSET,
        description="vLLM #51812's reproduction: V1, eager, 2 MTP drafts, max_model_len=128, "
        "prompts of 120 and 64 tokens (the long one's last step fits no draft)",
        engine=_recipe,
        workload=pr_recipe(SEED, VOCAB, (120, 64), max_tokens=64),
        rule=TaggedFloorRule(min_tagged=16, min_floor=8),
        attributes_to=ATTRIBUTES_TO,
        tags=("upstream", "eager"),
        seed=SEED,
    ),
    EngineScenario(
        name="pr51812-production",
        patchset=PATCHSET,
        description="production shape: prefix caching (mamba 'align'), 3 MTP drafts, streams "
        "sharing a system prompt, chunked prefills under a 512-token budget; follow-up pairs "
        "whose hit leaves 2-3 tokens and 1 token (padded to a spec row), conversations that "
        "run into max_model_len (redesigned after the H200 run: not yet run on a GPU)",
        engine=EngineConfig(
            num_speculative_tokens=3,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            max_model_len=1280,
            max_num_seqs=16,
            max_num_batched_tokens=512,
        ),
        workload=production_mixed(SEED, VOCAB, max_model_len=1280),
        rule=TaggedFloorRule(min_tagged=16),
        attributes_to=ATTRIBUTES_TO,
        tags=("production", "prefix-caching", "eager"),
        seed=SEED,
    ),
    EngineScenario(
        name="pr51812-misorder-eager",
        patchset=PATCHSET,
        description="misorder-rich: requests running into max_model_len every 2 steps while "
        "streams decode with 2 drafts (their last step is a one-token non-spec row)",
        engine=_misorder,
        workload=misorder_rich(SEED, VOCAB, max_model_len=128, num_spec=2),
        rule=TaggedFloorRule(),
        attributes_to=ATTRIBUTES_TO,
        tags=("misorder-rich", "eager"),
        seed=SEED,
    ),
    EngineScenario(
        name="pr51812-misorder-graphs",
        patchset=PATCHSET,
        description="the misorder-rich workload with CUDA graphs (FULL_AND_PIECEWISE): mixed "
        "steps run piecewise, uniform spec steps replay FULL graphs",
        engine=_misorder.replace(enforce_eager=False, cudagraph_mode="FULL_AND_PIECEWISE"),
        workload=misorder_rich(SEED, VOCAB, max_model_len=128, num_spec=2),
        rule=TaggedFloorRule(),
        attributes_to=ATTRIBUTES_TO,
        tags=("misorder-rich", "graphs"),
        seed=SEED,
        timeout_s=540.0,
    ),
)
