"""Engine scenarios of patchset pr51565 (vLLM #51565): a brand-new request
whose first chunk is one token is a decode to the 0.25.1 builder, which
reads its recycled state slot unmasked; with FULL CUDA graphs a builder that
calls it a prefill no longer fills the persistent decode buffers, while the
runner still replays the FULL decode graph by batch shape (the "half fix").

No speculative decoding (with spec rows present 0.25.1's builder already
reclassifies one-token rows as prefills). A scenario fails on any stale
FULL replay (observed by the recorder), and passes when every new request's
teacher-forced error stays within 3x the floor of the same requests run
alone in a fresh engine and the other requests stay there too; where the
new requests' greedy tokens differ from their alone runs is reported only
(random weights: nearly flat logits, bf16 ties).
"""

from __future__ import annotations

from gdn_backport.engine_suite.config import EngineConfig
from gdn_backport.engine_suite.model import ModelShape
from gdn_backport.engine_suite.rules import AloneMatchRule
from gdn_backport.engine_suite.scenario import EngineScenario
from gdn_backport.engine_suite.workload import one_token_arrivals, prefix_hit

from . import ID as PATCHSET

SEED = 0
VOCAB = ModelShape().prompt_token_range
ATTRIBUTES_TO = (
    "new one-token rows: the builder's split (decode: the recycled slot read unmasked) and "
    "the runner's FULL decode-graph dispatch (stale persistent buffers)"
)

_eager = EngineConfig(max_model_len=256, max_num_seqs=16)
_arrivals = one_token_arrivals(SEED, VOCAB)

SCENARIOS = (
    EngineScenario(
        name="pr51565-eager",
        patchset=PATCHSET,
        description="new one-token prompts arrive the step after background requests finish "
        "(recycled slots), while others decode; eager",
        engine=_eager,
        workload=_arrivals,
        rule=AloneMatchRule(),
        attributes_to=ATTRIBUTES_TO,
        tags=("upstream", "eager"),
        alone=_eager,
        seed=SEED,
    ),
    EngineScenario(
        name="pr51565-full-graphs",
        patchset=PATCHSET,
        description="the same arrivals with CUDA graphs FULL_AND_PIECEWISE: the one-token batch "
        "has the uniform decode shape, so the runner replays the FULL decode graph",
        engine=_eager.replace(enforce_eager=False, cudagraph_mode="FULL_AND_PIECEWISE"),
        workload=_arrivals,
        rule=AloneMatchRule(require_uniform_step=True),
        attributes_to=ATTRIBUTES_TO,
        tags=("graphs", "full"),
        alone=_eager,
        seed=SEED,
        timeout_s=540.0,
    ),
    EngineScenario(
        name="pr51565-piecewise",
        patchset=PATCHSET,
        description="the same arrivals with PIECEWISE CUDA graphs (no FULL replay: the GDN op "
        "runs outside the graphs with this step's metadata)",
        engine=_eager.replace(enforce_eager=False, cudagraph_mode="PIECEWISE"),
        workload=_arrivals,
        rule=AloneMatchRule(),
        attributes_to=ATTRIBUTES_TO,
        tags=("graphs", "piecewise"),
        alone=_eager,
        seed=SEED,
        timeout_s=540.0,
    ),
    EngineScenario(
        name="pr51565-prefix-hit",
        patchset=PATCHSET,
        description="a prefix-cache hit (mamba 'align') that leaves exactly one new token, "
        "while others decode: a row with prior state, a decode in every variant",
        engine=EngineConfig(
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            max_model_len=1024,
            max_num_seqs=16,
        ),
        workload=prefix_hit(SEED, VOCAB),
        rule=AloneMatchRule(roles=("prefix_hit",), require_recycled=False, first_chunk="hit"),
        attributes_to="the decode path of a one-token row whose state comes from the prefix cache",
        tags=("prefix-caching", "eager", "control"),
        alone=_eager.replace(max_model_len=1024),
        seed=SEED,
    ),
)
