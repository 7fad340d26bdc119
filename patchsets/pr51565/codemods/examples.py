"""Example sources of pr51565's codemods, shaped like vLLM's code and written here.

Each codemod's ``REWRITES`` (before, after), ``UNCHANGED`` and ``REFUSES``
(source, reason) name these; ``tests/test_codemods.py`` runs them all and
``tests/test_codemod_commands.py`` runs the first of each through
``python -m libcst.tool codemod``, so they double as documentation that
cannot go stale. A codemod runs here as under the tool: on the file alone,
so a builder example defines the ``CommonAttentionMetadata`` and split
function its rule reads (in vLLM they live in another module). The "after"
texts are the codemods' output verbatim, long lines included.
"""

# -- the builder rule --------------------------------------------------------------

_FACTS = '''\
from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None


def split_decodes_and_prefills(
    common_attn_metadata, decode_threshold=1, treat_short_extends_as_decodes=True
):
    """Decodes first: rows of at most decode_threshold tokens."""
'''

_BUILD = """

class GDNAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None):
        m = common_attn_metadata
        if num_accepted_tokens is None:
            num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
                split_decodes_and_prefills(m, decode_threshold=1)
            )
        else:
            num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = 0, 0, 0, 0
        return GDNAttentionMetadata(
            num_prefills=num_prefills,
            num_decodes=num_decodes,
            non_spec_state_indices_tensor=m.block_table_tensor[:, 0],
        )
"""

BUILDER = _FACTS + _BUILD

BUILDER_FIXED = (
    _FACTS.replace("import dataclass", "import replace, dataclass")
    + """

class GDNAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None):
        m = common_attn_metadata
        if num_accepted_tokens is None:
            # gdn-backport: vllm-project/vllm#51565. Classify first chunks as prefills to mask
            # recycled state; resumed one-token chunks can still use the decode kernels.
            assert m.seq_lens_cpu_upper_bound is not None
            query_lens_cpu = m.query_start_loc_cpu.diff()
            no_prior_state = (query_lens_cpu > 0) & (m.seq_lens_cpu_upper_bound <= query_lens_cpu)
            # Capture batches also have seq_len == query_len, but are not prefills.
            if m.is_prefilling is not None:
                no_prior_state &= m.is_prefilling
            else:
                no_prior_state = torch.zeros_like(no_prior_state)
            num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
                split_decodes_and_prefills(replace(m, is_prefilling=no_prior_state), decode_threshold=1, treat_short_extends_as_decodes=False)
            )
            # Exclude trailing padding from both prefill counts.
            if num_prefills:
                num_prefills -= int((query_lens_cpu[num_decodes:] == 0).sum())
                num_prefill_tokens = (
                    int(m.query_start_loc_cpu[num_decodes + num_prefills])
                    - num_decode_tokens
                )
        else:
            num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = 0, 0, 0, 0
        return GDNAttentionMetadata(
            num_prefills=num_prefills,
            num_decodes=num_decodes,
            non_spec_state_indices_tensor=m.block_table_tensor[:, 0],
        )
"""
)

# A fork's builder: its own names for the counts and the metadata, a name
# already taken, and a metadata class with its own ``replace``.
_FACTS_REPLACE_METHOD = _FACTS.replace(
    "    is_prefilling: torch.Tensor | None = None\n",
    "    is_prefilling: torch.Tensor | None = None\n\n"
    "    def replace(self, **changes):\n"
    "        return type(self)(**{**self.__dict__, **changes})\n",
)

BUILDER_REPLACE_METHOD = (
    _FACTS_REPLACE_METHOD
    + """

class KDAMetadataBuilder:
    def build(self, common_prefix_len, common, fast_build=False):
        query_lens_cpu = common.query_start_loc_cpu.diff()
        nd, np_, ndt, npt = split_decodes_and_prefills(common, 1)
        return KDAMetadata(nd, np_, ndt, npt, non_spec_state_indices_tensor=None)
"""
)

BUILDER_REPLACE_METHOD_FIXED = (
    _FACTS_REPLACE_METHOD
    + """

class KDAMetadataBuilder:
    def build(self, common_prefix_len, common, fast_build=False):
        query_lens_cpu = common.query_start_loc_cpu.diff()
        # gdn-backport: vllm-project/vllm#51565. Classify first chunks as prefills to mask
        # recycled state; resumed one-token chunks can still use the decode kernels.
        assert common.seq_lens_cpu_upper_bound is not None
        query_lens_cpu_1 = common.query_start_loc_cpu.diff()
        no_prior_state = (query_lens_cpu_1 > 0) & (common.seq_lens_cpu_upper_bound <= query_lens_cpu_1)
        # Capture batches also have seq_len == query_len, but are not prefills.
        if common.is_prefilling is not None:
            no_prior_state &= common.is_prefilling
        else:
            no_prior_state = torch.zeros_like(no_prior_state)
        nd, np_, ndt, npt = split_decodes_and_prefills(common.replace(is_prefilling=no_prior_state), 1, treat_short_extends_as_decodes=False)
        # Exclude trailing padding from both prefill counts.
        if np_:
            np_ -= int((query_lens_cpu_1[nd:] == 0).sum())
            npt = (
                int(common.query_start_loc_cpu[nd + np_])
                - ndt
            )
        return KDAMetadata(nd, np_, ndt, npt, non_spec_state_indices_tensor=None)
"""
)

# vLLM's Mamba builders: every prompt chunk is a prefill (the runner's own
# is_prefilling), so a new one-token request never takes the decode path.
BUILDER_EVERY_CHUNK_A_PREFILL = BUILDER.replace(
    "split_decodes_and_prefills(m, decode_threshold=1)",
    "split_decodes_and_prefills(m, decode_threshold=1, treat_short_extends_as_decodes=False)",
)

BUILDER_NO_DECODES = BUILDER.replace(
    "split_decodes_and_prefills(m, decode_threshold=1)",
    "split_decodes_and_prefills(m, decode_threshold=0)",
)

# An attention builder outside the GDN family (it fills no GDN field).
BUILDER_OTHER_FAMILY = (
    _FACTS
    + """

class FlashAttentionMetadataBuilder:
    def build(self, common_prefix_len, common_attn_metadata):
        num_decodes, num_prefills, _, _ = split_decodes_and_prefills(common_attn_metadata)
        return FlashAttentionMetadata(num_decodes=num_decodes, num_prefills=num_prefills)
"""
)

# Releases before 0.20.0: neither the upper bound nor is_prefilling exists.
BUILDER_OLD_FIELDS = (
    _FACTS.replace("    seq_lens_cpu_upper_bound: torch.Tensor | None = None\n", "")
    .replace("    is_prefilling: torch.Tensor | None = None\n", "")
    .replace(", treat_short_extends_as_decodes=True", "")
    + _BUILD
)

# The builder's module as vLLM ships it: the metadata class and the split
# function are imported, and a file analysed alone does not show them.
BUILDER_AS_SHIPPED = (
    "from vllm.v1.attention.backends.utils import split_decodes_and_prefills\n" + _BUILD
)

BUILDER_COUNTS_IN_ONE_NAME = BUILDER.replace(
    "            num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (\n"
    "                split_decodes_and_prefills(m, decode_threshold=1)\n"
    "            )\n",
    "            counts = split_decodes_and_prefills(m, decode_threshold=1)\n"
    "            num_decodes, num_prefills = counts[0], counts[1]\n",
)

BUILDER_OWN_REPLACE = (
    BUILDER
    + """

def replace(text, old, new):
    return text.replace(old, new)
"""
)

BUILDER_TREAT_FLAG = BUILDER.replace(
    "split_decodes_and_prefills(m, decode_threshold=1)",
    "split_decodes_and_prefills(m, decode_threshold=1, treat_short_extends_as_decodes=self.short)",
)

# -- the V1 runner guard -------------------------------------------------------------

_V1_HEAD = """\
class GPUModelRunner:
    def _is_uniform_decode(self, max_num_scheduled_tokens, uniform_decode_query_len,
                           num_tokens, num_reqs, force_uniform_decode=None):
        if force_uniform_decode is not None:
            return force_uniform_decode
        return max_num_scheduled_tokens == uniform_decode_query_len

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs,
                                               force_uniform_decode=None, **kwargs):
        uniform = self._is_uniform_decode(1, 1, num_tokens, num_reqs, force_uniform_decode)
        return ("FULL" if uniform else "PIECEWISE"), num_tokens

    def _update_states(self, scheduler_output):
        for i, req in enumerate(scheduler_output.scheduled_new_reqs):
            self.input_batch.num_computed_tokens_cpu[i] = req.num_computed_tokens
"""

_V1_STEP = """
    def execute_model(self, scheduler_output):
        self._update_states(scheduler_output)
        num_reqs = self.input_batch.num_reqs
        cudagraph_mode, padded = self._determine_batch_execution_and_padding(
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_reqs=num_reqs,
            use_cascade_attn=False,
        )
        return self._model_forward(cudagraph_mode, padded)

    def _dummy_run(self, num_tokens, uniform_decode=False):
        return self._determine_batch_execution_and_padding(
            num_tokens=num_tokens, num_reqs=1, force_uniform_decode=uniform_decode
        )
"""

V1_RUNNER = _V1_HEAD + _V1_STEP

V1_RUNNER_GUARDED = V1_RUNNER.replace(
    "            use_cascade_attn=False,\n",
    "            use_cascade_attn=False,\n"
    "            force_uniform_decode=False if bool((self.input_batch.num_computed_tokens_cpu[:num_reqs] == 0).any()) else None,\n",
)

# num_reqs passed by position, the call on one line.
V1_RUNNER_POSITIONAL = V1_RUNNER.replace(
    """        cudagraph_mode, padded = self._determine_batch_execution_and_padding(
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            num_reqs=num_reqs,
            use_cascade_attn=False,
        )
""",
    """        num_tokens = scheduler_output.total_num_scheduled_tokens
        cudagraph_mode, padded = self._determine_batch_execution_and_padding(num_tokens, num_reqs)
""",
)

V1_RUNNER_POSITIONAL_GUARDED = V1_RUNNER_POSITIONAL.replace(
    "self._determine_batch_execution_and_padding(num_tokens, num_reqs)",
    "self._determine_batch_execution_and_padding(num_tokens, num_reqs, force_uniform_decode=False if bool((self.input_batch.num_computed_tokens_cpu[:num_reqs] == 0).any()) else None)",
)

# A drafter's own dispatch (no _is_uniform_decode here): its layers are not GDN's.
V1_DRAFTER = """\
class EagleProposer:
    def propose(self, num_tokens, num_reqs):
        mode, _ = self.runner._determine_batch_execution_and_padding(
            num_tokens=num_tokens, num_reqs=num_reqs
        )
        return mode
"""

# Only capture and dummy runs dispatch here; they pass force_uniform_decode.
V1_CAPTURE_ONLY = (
    _V1_HEAD
    + """
    def capture_model(self, sizes):
        for size in sizes:
            self._determine_batch_execution_and_padding(
                num_tokens=size, num_reqs=size, force_uniform_decode=True
            )
"""
)

V1_RUNNER_REQS_EXPRESSION = V1_RUNNER.replace(
    "            num_reqs=num_reqs,\n", "            num_reqs=self.input_batch.num_reqs,\n"
)

V1_RUNNER_NO_COMPUTED = V1_RUNNER.replace(
    "            self.input_batch.num_computed_tokens_cpu[i] = req.num_computed_tokens\n",
    "            self.input_batch.computed_np[i] = req.num_computed_tokens\n",
)

# A guard of a fork's own that reads computed tokens some other way.
V1_RUNNER_OTHER_GUARD = V1_RUNNER.replace(
    "            use_cascade_attn=False,\n",
    "            use_cascade_attn=False,\n"
    "            force_uniform_decode=self.input_batch.num_computed_tokens_cpu.all(),\n",
)

# -- the V2 runner guard -------------------------------------------------------------

_V2_HEAD = """\
def get_uniform_token_count(num_reqs, num_tokens, max_query_len):
    if max_query_len * num_reqs == num_tokens:
        return max_query_len
    return None

"""

V2_RUNNER = (
    _V2_HEAD
    + """
class GPUModelRunner:
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        num_toks = scheduler_output.total_num_scheduled_tokens
        max_query_len = max(scheduler_output.num_scheduled_tokens.values())
        uniform_tok_count = get_uniform_token_count(num_reqs, num_toks, max_query_len)
        return self.cudagraph_manager.dispatch(num_reqs, num_toks, uniform_tok_count)
"""
)

V2_RUNNER_GUARDED = V2_RUNNER.replace(
    "        uniform_tok_count = get_uniform_token_count(num_reqs, num_toks, max_query_len)\n",
    """        uniform_tok_count = get_uniform_token_count(num_reqs, num_toks, max_query_len)
        # gdn-backport: vllm-project/vllm#51565: a request with no computed tokens is a
        # prefill for the GDN builder, which then fills no decode buffer: no FULL
        # decode graph for this batch.
        if uniform_tok_count is not None and (
            any(r.num_computed_tokens == 0 for r in scheduler_output.scheduled_new_reqs)
            or 0 in scheduler_output.scheduled_cached_reqs.num_computed_tokens
        ):
            uniform_tok_count = None
""",
)

# A speculator's own count (no scheduler_output): for its draft layers.
V2_SPECULATOR = (
    _V2_HEAD
    + """
class EagleSpeculator:
    def propose(self, num_reqs, num_tokens_across_dp):
        count = get_uniform_token_count(num_reqs, num_reqs, 1)
        return self.run_draft(count)
"""
)

V2_RUNNER_OTHER_GUARD = V2_RUNNER.replace(
    "        return self.cudagraph_manager",
    """        if any(r.num_computed_tokens < 2 for r in scheduler_output.scheduled_new_reqs):
            uniform_tok_count = None
        return self.cudagraph_manager""",
)

V2_RUNNER_ONE_LINE_IF = V2_RUNNER.replace(
    "        uniform_tok_count = get_uniform_token_count(num_reqs, num_toks, max_query_len)\n",
    "        uniform_tok_count = None\n"
    "        if num_toks: uniform_tok_count = get_uniform_token_count(num_reqs, num_toks, 1)\n",
)
