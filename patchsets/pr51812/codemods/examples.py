"""Example sources of the codemods, shaped like vLLM's code and written here.

Each codemod's ``REWRITES`` (before, after), ``UNCHANGED`` and ``REFUSES``
(source, reason) name these; ``tests/test_codemods.py`` runs them all, so
they double as documentation that cannot go stale.
"""

UPSTREAM_SHAPE = """\
class Layer:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = get_forward_context().attn_metadata[self.prefix]
        spec_sequence_masks = m.spec_sequence_masks
        spec_token_indx = m.spec_token_indx
        non_spec_token_indx = m.non_spec_token_indx
        spec_state_indices_tensor = m.spec_state_indices_tensor
        non_spec_state_indices_tensor = m.non_spec_state_indices_tensor
        ssm_state = self.kv_cache[1]
        if spec_sequence_masks is not None:
            if m.num_prefills == 0 and m.num_decodes == 0:
                mixed_qkv_spec = mixed_qkv
                mixed_qkv_non_spec = None
            else:
                mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
                mixed_qkv_non_spec = mixed_qkv.index_select(0, non_spec_token_indx)
        else:
            mixed_qkv_spec = None
            mixed_qkv_non_spec = mixed_qkv
        query_spec, key_spec, value_spec = self.rearrange_mixed_qkv(mixed_qkv_spec)
        query, key, value = self.rearrange_mixed_qkv(mixed_qkv_non_spec)
        if spec_sequence_masks is not None:
            out_spec, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log,
                a=a,  # the gate rows the bug is about
                b=b,
                dt_bias=self.dt_bias,
                q=query_spec,
                k=key_spec,
                v=value_spec,
                initial_state=ssm_state,
                ssm_state_indices=spec_state_indices_tensor,
                num_accepted_tokens=m.num_accepted_tokens,
            )
        if m.num_decodes > 0:
            # The non-spec decode call: its a=a, b=b is right and stays.
            out, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias,
                q=query, k=key, v=value, initial_state=ssm_state,
                ssm_state_indices=non_spec_state_indices_tensor,
            )
"""

UPSTREAM_SHAPE_FIXED = """\
class Layer:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = get_forward_context().attn_metadata[self.prefix]
        spec_sequence_masks = m.spec_sequence_masks
        spec_token_indx = m.spec_token_indx
        non_spec_token_indx = m.non_spec_token_indx
        spec_state_indices_tensor = m.spec_state_indices_tensor
        non_spec_state_indices_tensor = m.non_spec_state_indices_tensor
        ssm_state = self.kv_cache[1]
        if spec_sequence_masks is not None:
            if m.num_prefills == 0 and m.num_decodes == 0:
                mixed_qkv_spec = mixed_qkv
                mixed_qkv_non_spec = None
                a_spec = a
                b_spec = b
            else:
                mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
                mixed_qkv_non_spec = mixed_qkv.index_select(0, non_spec_token_indx)
                a_spec = a.index_select(0, spec_token_indx)
                b_spec = b.index_select(0, spec_token_indx)
        else:
            mixed_qkv_spec = None
            mixed_qkv_non_spec = mixed_qkv
        query_spec, key_spec, value_spec = self.rearrange_mixed_qkv(mixed_qkv_spec)
        query, key, value = self.rearrange_mixed_qkv(mixed_qkv_non_spec)
        if spec_sequence_masks is not None:
            out_spec, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log,
                a=a_spec,  # the gate rows the bug is about
                b=b_spec,
                dt_bias=self.dt_bias,
                q=query_spec,
                k=key_spec,
                v=value_spec,
                initial_state=ssm_state,
                ssm_state_indices=spec_state_indices_tensor,
                num_accepted_tokens=m.num_accepted_tokens,
            )
        if m.num_decodes > 0:
            # The non-spec decode call: its a=a, b=b is right and stays.
            out, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias,
                q=query, k=key, v=value, initial_state=ssm_state,
                ssm_state_indices=non_spec_state_indices_tensor,
            )
"""

# A fork: other local names, the kernel imported under an alias and called
# positionally, a gate named like a kernel parameter it is not bound to.
RENAMED_POSITIONAL = """\
from fla.ops import fused_sigmoid_gating_delta_rule_update as gdn_update


class ForkLayer:
    def _forward_core(self, qkv, beta_raw, alpha, out):
        md = self.metadata()
        sti = md.spec_token_indx
        slots = md.spec_state_indices_tensor
        if md.spec_sequence_masks is None:
            return self.plain(qkv, beta_raw, alpha, out)
        if md.num_prefills == 0 and md.num_decodes == 0:
            qkv_s = qkv
        else:
            qkv_s = qkv.index_select(0, sti)
        qkv_s = self.conv(qkv_s, slots[:, 0])
        q, k, v = self.split(qkv_s)
        o, _ = gdn_update(self.A_log, alpha, beta_raw, self.dt_bias, q, k, v,
                          initial_state=self.state, ssm_state_indices=slots,
                          num_accepted_tokens=md.num_accepted_tokens)
        out.index_copy_(0, sti, o)
"""

RENAMED_POSITIONAL_FIXED = """\
from fla.ops import fused_sigmoid_gating_delta_rule_update as gdn_update


class ForkLayer:
    def _forward_core(self, qkv, beta_raw, alpha, out):
        md = self.metadata()
        sti = md.spec_token_indx
        slots = md.spec_state_indices_tensor
        if md.spec_sequence_masks is None:
            return self.plain(qkv, beta_raw, alpha, out)
        if md.num_prefills == 0 and md.num_decodes == 0:
            qkv_s = qkv
            alpha_spec = alpha
            beta_raw_spec = beta_raw
        else:
            qkv_s = qkv.index_select(0, sti)
            alpha_spec = alpha.index_select(0, sti)
            beta_raw_spec = beta_raw.index_select(0, sti)
        qkv_s = self.conv(qkv_s, slots[:, 0])
        q, k, v = self.split(qkv_s)
        o, _ = gdn_update(self.A_log, alpha_spec, beta_raw_spec, self.dt_bias, q, k, v,
                          initial_state=self.state, ssm_state_indices=slots,
                          num_accepted_tokens=md.num_accepted_tokens)
        out.index_copy_(0, sti, o)
"""

# No pure-spec fast path, torch.index_select, and a name `a_spec` already in
# use for something else: the new name must not collide.
NO_FAST_PATH = """\
def spec_step(layer, mixed_qkv, b, a, md):
    a_spec = layer.unrelated
    rows = md.spec_token_indx
    mixed_qkv_spec = torch.index_select(mixed_qkv, 0, rows)
    q, k, v = layer.rearrange_mixed_qkv(mixed_qkv_spec)
    return fused_sigmoid_gating_delta_rule_update(
        A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
"""

NO_FAST_PATH_FIXED = """\
def spec_step(layer, mixed_qkv, b, a, md):
    a_spec = layer.unrelated
    rows = md.spec_token_indx
    mixed_qkv_spec = torch.index_select(mixed_qkv, 0, rows)
    a_spec2 = torch.index_select(a, 0, rows)
    b_spec = torch.index_select(b, 0, rows)
    q, k, v = layer.rearrange_mixed_qkv(mixed_qkv_spec)
    return fused_sigmoid_gating_delta_rule_update(
        A_log=layer.A_log, a=a_spec2, b=b_spec, dt_bias=layer.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
"""

# Boolean-mask selection, as 0.10-era code selects rows.
MASKED = """\
def spec_step(self, mixed_qkv, b, a, md):
    spec_token_masks = md.spec_token_masks
    mixed_qkv_spec = mixed_qkv[spec_token_masks]
    mixed_qkv_non_spec = mixed_qkv[~spec_token_masks]
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""

MASKED_FIXED = """\
def spec_step(self, mixed_qkv, b, a, md):
    spec_token_masks = md.spec_token_masks
    mixed_qkv_spec = mixed_qkv[spec_token_masks]
    mixed_qkv_non_spec = mixed_qkv[~spec_token_masks]
    a_spec = a[spec_token_masks]
    b_spec = b[spec_token_masks]
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a_spec, b=b_spec, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""

# A half-done local fix: b was gathered, a was not. Only a is rewritten.
ONE_GATE = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    b_spec = b.index_select(0, idx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a, b=b_spec, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""

ONE_GATE_FIXED = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    b_spec = b.index_select(0, idx)
    a_spec = a.index_select(0, idx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a_spec, b=b_spec, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""

# 0.11-0.17 style: gates computed for every token, then gathered: immune.
PRECOMPUTED_GATES = """\
def spec_step(self, mixed_qkv, b, a, md):
    spec_token_indx = md.spec_token_indx
    g, beta = fused_gdn_gating(self.A_log, a, b, self.dt_bias)
    mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
    g_spec = g.index_select(1, spec_token_indx)
    beta_spec = beta.index_select(1, spec_token_indx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    out, _ = fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g_spec, beta=beta_spec,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""

NO_SPEC_PATH = """\
def decode(self, mixed_qkv, b, a, md):
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv)
    return fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.non_spec_state_indices_tensor,
    )
"""

GATE_REASSIGNED = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    a = a.float()
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""

# The same gate gathered right before the call, where it holds what the
# call reads (b, not reassigned, gets upstream's placement).
GATE_REASSIGNED_FIXED = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    b_spec = b.index_select(0, idx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    a = a.float()
    a_spec = a.index_select(0, idx)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a_spec, b=b_spec, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""

# Gates staged through locals that start as None and are set under a
# condition after q/k/v's rows were chosen: the rows of each gate are chosen
# again right before the call, by the `if` that chose q/k/v's.
_STAGED = """\
class Layer:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = get_forward_context().attn_metadata[self.prefix]
        spec_sequence_masks = m.spec_sequence_masks
        spec_token_indx = m.spec_token_indx
        if spec_sequence_masks is not None:
            if {test}:
                mixed_qkv_spec = mixed_qkv
            else:
                mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
        else:
            mixed_qkv_spec = None
        query_spec, key_spec, value_spec = self.rearrange_mixed_qkv(mixed_qkv_spec)
        a_in = None
        b_in = None
        if spec_sequence_masks is not None and self.fp32_gates:
            a_in = a.float()
            b_in = b.float()
        if a_in is None:
            a_in = a.contiguous()
        if b_in is None:
            b_in = b.contiguous()
        if spec_sequence_masks is not None:
{gather}            out_spec, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log, a={a}, b={b}, dt_bias=self.dt_bias,
                q=query_spec, k=key_spec, v=value_spec, initial_state=self.kv_cache[1],
                ssm_state_indices=m.spec_state_indices_tensor,
                num_accepted_tokens=m.num_accepted_tokens,
            )
"""
_PURE = "m.num_prefills == 0 and m.num_decodes == 0"
STAGED_GATES = _STAGED.format(test=_PURE, gather="", a="a_in", b="b_in")
STAGED_GATES_FIXED = _STAGED.format(
    test=_PURE,
    gather=f"""\
            if {_PURE}:
                a_in_spec = a_in
                b_in_spec = b_in
            else:
                a_in_spec = a_in.index_select(0, spec_token_indx)
                b_in_spec = b_in.index_select(0, spec_token_indx)
""",
    a="a_in_spec",
    b="b_in_spec",
)
# The q/k/v rows chosen by a test that calls a method: repeating it before
# the kernel call could choose otherwise, so the staged shape is refused.
STAGED_GATES_CALLED_TEST = _STAGED.format(test="self.pure_spec(m)", gather="", a="a_in", b="b_in")

# A kernel behind a fork's own wrapper: the gates are per-token (the
# non-spec path gathers them) but what the wrapper does with them is unseen.
WRAPPED_KERNEL = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    a_non_spec = a.index_select(0, md.non_spec_token_indx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    return self.my_spec_kernel(q, k, v, a, b, md.spec_state_indices_tensor)
"""

STARRED = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    kw = dict(a=a, b=b)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        q=q, k=k, v=v, ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens, **kw,
    )
    return out
"""

GATE_EXPRESSION = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a.float(), b=b, dt_bias=self.dt_bias,
        q=q, k=k, v=v, ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""


UPSTREAM_SHAPE_SWAPPED = """\
from gdn_backport_kernels import gated_delta_rule_spec_update, gather_token_rows, use_spec_update

class Layer:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = get_forward_context().attn_metadata[self.prefix]
        spec_sequence_masks = m.spec_sequence_masks
        spec_token_indx = m.spec_token_indx
        non_spec_token_indx = m.non_spec_token_indx
        spec_state_indices_tensor = m.spec_state_indices_tensor
        non_spec_state_indices_tensor = m.non_spec_state_indices_tensor
        ssm_state = self.kv_cache[1]
        if spec_sequence_masks is not None:
            if m.num_prefills == 0 and m.num_decodes == 0:
                mixed_qkv_spec = mixed_qkv
                mixed_qkv_non_spec = None
                spec_token_rows = None
            else:
                mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
                mixed_qkv_non_spec = mixed_qkv.index_select(0, non_spec_token_indx)
                spec_token_rows = spec_token_indx
        else:
            mixed_qkv_spec = None
            mixed_qkv_non_spec = mixed_qkv
        query_spec, key_spec, value_spec = self.rearrange_mixed_qkv(mixed_qkv_spec)
        query, key, value = self.rearrange_mixed_qkv(mixed_qkv_non_spec)
        if spec_sequence_masks is not None:
            out_spec, _ = (
                gated_delta_rule_spec_update(
                    A_log=self.A_log,
                    a=a,  # the gate rows the bug is about
                    b=b,
                    dt_bias=self.dt_bias,
                    q=query_spec,
                    k=key_spec,
                    v=value_spec,
                    initial_state=ssm_state,
                    ssm_state_indices=spec_state_indices_tensor,
                    num_accepted_tokens=m.num_accepted_tokens,
                    spec_token_indx=spec_token_rows,
                    null_slot_id=0,
                )
                if use_spec_update(
                    A_log=self.A_log,
                    a=a,  # the gate rows the bug is about
                    b=b,
                    dt_bias=self.dt_bias,
                    q=query_spec,
                    k=key_spec,
                    v=value_spec,
                    initial_state=ssm_state,
                    ssm_state_indices=spec_state_indices_tensor,
                    num_accepted_tokens=m.num_accepted_tokens,
                    spec_token_indx=spec_token_rows,
                    null_slot_id=0,
                )
                else fused_sigmoid_gating_delta_rule_update(
                    A_log=self.A_log,
                    a=gather_token_rows(a, spec_token_rows),  # the gate rows the bug is about
                    b=gather_token_rows(b, spec_token_rows),
                    dt_bias=self.dt_bias,
                    q=query_spec,
                    k=key_spec,
                    v=value_spec,
                    initial_state=ssm_state,
                    ssm_state_indices=spec_state_indices_tensor,
                    num_accepted_tokens=m.num_accepted_tokens,
                )
            )
        if m.num_decodes > 0:
            # The non-spec decode call: its a=a, b=b is right and stays.
            out, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias,
                q=query, k=key, v=value, initial_state=ssm_state,
                ssm_state_indices=non_spec_state_indices_tensor,
            )
"""


# A call in an argument (``next_accepted(m)``): evaluated by the guard and
# again by the branch, it might run twice.
CALL_IN_ARGUMENT = UPSTREAM_SHAPE.replace(
    "num_accepted_tokens=m.num_accepted_tokens", "num_accepted_tokens=next_accepted(m)"
)
