"""The ``gather`` strategy: upstream's fix (vLLM PR #51812) in the site's own names."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from gdn_backport.analysis import GateUse, SpecCall, gate_aligned
from gdn_backport.codemods.base import Edit, Plan, Planner, Refusal, SiteCodemod, live
from gdn_backport.dataflow import index_select_parts
from gdn_backport.provenance import Prov, Val


def mirror(gather: cst.BaseExpression, base: str) -> cst.BaseExpression:
    """The spec gather of the q/k/v rows, applied to ``base`` instead."""
    if isinstance(gather, cst.Subscript):
        if len(gather.slice) != 1:
            raise Refusal("the spec rows are gathered along a dimension other than 0")
        return gather.with_changes(value=cst.Name(base))
    assert isinstance(gather, cst.Call)
    parts = index_select_parts(gather)
    assert parts is not None
    if not (isinstance(parts.dim, cst.Integer) and parts.dim.value == "0"):
        raise Refusal("the spec rows are gathered along a dimension other than 0")
    if parts.torch_form:
        first, *rest = gather.args
        return gather.with_changes(args=[first.with_changes(value=cst.Name(base)), *rest])
    func = gather.func
    assert isinstance(func, cst.Attribute)
    return gather.with_changes(func=func.with_changes(value=cst.Name(base)))


def _rename_arg(new: str) -> Edit:
    def edit(arg: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(arg, cst.Arg)
        return arg.with_changes(value=cst.Name(new))

    return edit


def gate_name(arg: cst.Arg, param: str) -> str:
    """The local name a gate argument passes; refuse anything else."""
    if not isinstance(arg.value, cst.Name):
        raise Refusal(f"gate {param} is passed as an expression, not a name")
    return arg.value.value


def gate_arg(planner: Planner, call: SpecCall, gate: GateUse) -> tuple[cst.Arg, str]:
    """The argument (in the site function) that carries ``gate`` to the
    kernel, and the local name it passes."""
    arg = planner.passed_arg(call, gate.arg)
    return arg, gate_name(arg, gate.param)


def all_rows(call: SpecCall, name: str, vals: frozenset[Val]) -> None:
    """The gate must carry all token rows on every path to the call."""
    if any(v.prov is not Prov.ALL for v in live(vals, call.record.path)):
        raise Refusal(f"gate `{name}` does not carry all token rows on every path")


def check_gate(planner: Planner, call: SpecCall, name: str, vals: frozenset[Val]) -> None:
    """The gate must carry all rows on every path and hold, at every spec
    selection, the value the call sees."""
    all_rows(call, name, vals)
    for sel in planner.selections(call):
        stmt = sel.definition.stmt
        if planner.defs_at(stmt, name) != planner.gate_defs(call, vals, name, stmt):
            raise Refusal(f"`{name}` is reassigned between the spec gather and the kernel call")


# --- examples ------------------------------------------------------------

_UPSTREAM_SHAPE = """\
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

_UPSTREAM_SHAPE_FIXED = """\
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
_RENAMED_POSITIONAL = """\
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

_RENAMED_POSITIONAL_FIXED = """\
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
_NO_FAST_PATH = """\
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

_NO_FAST_PATH_FIXED = """\
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
_MASKED = """\
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

_MASKED_FIXED = """\
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
_ONE_GATE = """\
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

_ONE_GATE_FIXED = """\
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
_PRECOMPUTED_GATES = """\
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

_NO_SPEC_PATH = """\
def decode(self, mixed_qkv, b, a, md):
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv)
    return fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.non_spec_state_indices_tensor,
    )
"""

_GATE_REASSIGNED = """\
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

# A kernel behind a fork's own wrapper: the gates are per-token (the
# non-spec path gathers them) but what the wrapper does with them is unseen.
_WRAPPED_KERNEL = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    a_non_spec = a.index_select(0, md.non_spec_token_indx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    return self.my_spec_kernel(q, k, v, a, b, md.spec_state_indices_tensor)
"""

_STARRED = """\
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

_GATE_EXPRESSION = """\
def spec_step(self, mixed_qkv, b, a, md):
    idx = md.spec_token_indx
    mixed_qkv_spec = mixed_qkv.index_select(0, idx)
    q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a=a[: md.num_actual_tokens], b=b, dt_bias=self.dt_bias,
        q=q, k=k, v=v, ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
    return out
"""


class GatherGatesCodemod(SiteCodemod):
    """Gather the gate rows of every affected GDN spec-kernel call.

    For each site the analysis calls ``affected``, the q/k/v rows reach the
    spec kernel through one variable set by a spec gather (mixed branch) or
    an alias of all rows (pure-spec fast path). Next to each of those
    assignments the gate gets the same treatment under a fresh name
    (``a_spec = a.index_select(0, spec_token_indx)`` / ``a_spec = a``) and the
    kernel call takes the new name. The result is analysed again and must
    come out aligned; anything else leaves the file untouched.
    """

    DESCRIPTION: str = "Backport vLLM PR #51812: gather GDN spec-kernel gate rows."

    def plan_call(self, planner: Planner, call: SpecCall, plan: Plan) -> None:
        for gate in call.gates:
            # A gate already aligned with q/k/v on every path is left alone:
            # a half-done local fix may gather one gate in the mixed branch
            # and alias it in the fast path, as upstream does.
            if gate_aligned(call, gate):
                continue
            arg, name = gate_arg(planner, call, gate)
            all_rows(call, name, gate.vals)
            new = planner.new_name(f"{name}_spec")
            # The new line must read the gate the call reads.
            expect = {name: (call, gate.vals)}
            for sel in planner.selections(call):
                d = sel.definition
                if sel.kind == "gather":
                    assert d.gather is not None
                    planner.insert(plan, d, new, mirror(d.gather, name), expect)
                else:
                    planner.insert(plan, d, new, cst.Name(name), expect)
            plan.edits[id(arg)] = _rename_arg(new)

    # Examples, run by tests/test_codemods.py (before -> after; after again ->
    # unchanged; refusals leave the source alone and say why). They are
    # written here, shaped like the real code, and double as documentation.
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = (
        (_UPSTREAM_SHAPE, _UPSTREAM_SHAPE_FIXED),
        (_RENAMED_POSITIONAL, _RENAMED_POSITIONAL_FIXED),
        (_NO_FAST_PATH, _NO_FAST_PATH_FIXED),
        (_MASKED, _MASKED_FIXED),
        (_ONE_GATE, _ONE_GATE_FIXED),
    )
    UNCHANGED: ClassVar[tuple[str, ...]] = (
        _UPSTREAM_SHAPE_FIXED,
        _PRECOMPUTED_GATES,
        _NO_SPEC_PATH,
    )
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = (
        (_GATE_REASSIGNED, "reassigned between the spec gather and the kernel call"),
        (_WRAPPED_KERNEL, "not a known kernel"),
        (_STARRED, "*args/**kwargs"),
        (_GATE_EXPRESSION, "passed as an expression"),
    )
