"""The ``gather`` strategy: upstream's fix (vLLM PR #51812) in the site's own names."""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from typing import ClassVar

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, SkipFile

from gdn_backport import locate
from gdn_backport.analysis import SiteAnalysis, SpecCall, Status, analyse
from gdn_backport.dataflow import Def, Flow, _names_in, walk
from gdn_backport.patchset import Patchset, load
from gdn_backport.provenance import Prov, consistent


class Refusal(Exception):
    """The codemod cannot prove a rewrite correct: the file stays as it is."""


@dataclass
class _Plan:
    inserts: dict[int, list[cst.SimpleStatementLine]] = field(
        default_factory=lambda: defaultdict(list)
    )
    swaps: dict[int, str] = field(default_factory=dict)  # id(Arg) -> new name


def _index_select_dim0(call: cst.Call) -> bool:
    pos = [a for a in call.args if a.keyword is None]
    kw = {a.keyword.value: a for a in call.args if a.keyword is not None}
    torch_form = dotted_owner(call) == "torch"
    dim = (
        (pos[1] if len(pos) > 1 else kw.get("dim"))
        if torch_form
        else (pos[0] if pos else kw.get("dim"))
    )
    return dim is not None and isinstance(dim.value, cst.Integer) and dim.value.value == "0"


def dotted_owner(call: cst.Call) -> str | None:
    func = call.func
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name):
        return func.value.value
    return None


def _mirror(gather: cst.BaseExpression, gate: str) -> cst.BaseExpression:
    """The spec gather of the q/k/v rows, applied to the gate instead."""
    if isinstance(gather, cst.Subscript):
        if len(gather.slice) != 1:
            raise Refusal("the spec rows are gathered along a dimension other than 0")
        return gather.with_changes(value=cst.Name(gate))
    assert isinstance(gather, cst.Call)
    if not _index_select_dim0(gather):
        raise Refusal("the spec rows are gathered along a dimension other than 0")
    if dotted_owner(gather) == "torch":
        first, *rest = gather.args
        return gather.with_changes(args=[first.with_changes(value=cst.Name(gate)), *rest])
    func = gather.func
    assert isinstance(func, cst.Attribute)
    return gather.with_changes(func=func.with_changes(value=cst.Name(gate)))


def _is_selection(stmt: cst.BaseStatement) -> bool:
    """A line like the ones upstream puts its gate gathers after: plain
    assignments of a name, ``None``, a slice or an ``index_select``."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    if not isinstance(small, cst.Assign):
        return False
    value = small.value
    if isinstance(value, cst.Call):
        func = value.func
        return isinstance(func, cst.Attribute) and func.attr.value == "index_select"
    return isinstance(value, (cst.Name, cst.Subscript, cst.Attribute))


def _latest(flow: Flow, defs: frozenset[int], name: str) -> int:
    """The last definition of ``name`` a value went through (-1: none)."""
    return max((i for i in defs if flow.defs[i].name == name), default=-1)


def _reads(expr: cst.BaseExpression | None, name: str) -> bool:
    return expr is not None and any(n.value == name for n in _names_in(expr))


class _Planner:
    def __init__(self, func: cst.FunctionDef, result: SiteAnalysis) -> None:
        assert result.flow is not None
        self.func = func
        self.flow = result.flow
        self.result = result
        self.taken = {n.value for n in _names_in(func)}
        self.blocks: dict[int, tuple[cst.IndentedBlock, int]] = {}
        self.fresh: dict[tuple[str, int], str] = {}

        for node in walk(func):
            if isinstance(node, cst.IndentedBlock):
                for i, stmt in enumerate(node.body):
                    self.blocks[id(stmt)] = (node, i)

    def _gate_defs_at(self, stmt: cst.CSTNode, name: str) -> set[int]:
        env = self.flow.env_after.get(id(stmt), {})
        return {_latest(self.flow, v.defs, name) for v in env.get(name, frozenset())}

    def _anchor(self, stmt: cst.CSTNode, reads: list[str]) -> cst.CSTNode:
        """Where to insert after ``stmt``: the end of its run of simple
        statements (upstream's placement), if every name the new line reads
        still holds the same value there; else right after ``stmt``."""
        if id(stmt) not in self.blocks:
            raise Refusal("the spec gather is not on a line of its own")
        block, i = self.blocks[id(stmt)]
        end = i
        while end + 1 < len(block.body) and _is_selection(block.body[end + 1]):
            end += 1
        last = block.body[end]
        if all(self._gate_defs_at(last, n) == self._gate_defs_at(stmt, n) for n in reads):
            return last
        return stmt

    def _selection_defs(self, call: SpecCall, q_param: str) -> list[tuple[Def, str]]:
        path = call.record.path
        live = [v for v in call.rows[q_param] if consistent(v.assume, path) is not None]
        closure = frozenset().union(*(v.defs for v in live))
        gathers = [self.flow.defs[i] for i in sorted(closure) if self.flow.defs[i].gather]
        spec_vars = {d.name for d in gathers}
        if len(spec_vars) != 1:
            raise Refusal(
                "cannot find the one variable that gathers the spec rows of q/k/v"
                f" (found {sorted(spec_vars) or 'none'})"
            )
        var = spec_vars.pop()
        out: list[tuple[Def, str]] = []
        for i in sorted(closure):
            d = self.flow.defs[i]
            if d.name != var or (d.gather is None and _reads(d.value, var)):
                continue
            if d.gather is not None:
                out.append((d, "gather"))
            elif d.value is not None and not (
                isinstance(d.value, cst.Name) and d.value.value == "None"
            ):
                provs = {
                    v.prov
                    for v in self.flow.env_after.get(id(d.stmt), {}).get(var, frozenset())
                    if i in v.defs
                }
                if provs != {Prov.ALL}:
                    raise Refusal(f"`{var}` is set from rows the analysis cannot name")
                out.append((d, "alias"))
        return out

    def plan(self) -> _Plan:
        plan = _Plan()
        for call in self.result.calls:
            if call.status is Status.UNKNOWN:
                raise Refusal(call.reason)
            if call.status is not Status.AFFECTED:
                continue
            q_param = next(iter(call.rows))
            selections = self._selection_defs(call, q_param)
            path = call.record.path
            for gate in call.gates:
                live = [v for v in gate.vals if consistent(v.assume, path) is not None]
                if all(v.prov is Prov.SPEC for v in live):
                    continue
                if not isinstance(gate.arg.value, cst.Name):
                    raise Refusal(f"gate {gate.param} is passed as an expression, not a name")
                name = gate.arg.value.value
                if any(v.prov is not Prov.ALL for v in live):
                    raise Refusal(f"gate `{name}` does not carry all token rows on every path")
                at_call = {_latest(self.flow, v.defs, name) for v in live}
                new = self._new_name(name, id(call.record.node))
                for d, kind in selections:
                    if self._gate_defs_at(d.stmt, name) != at_call:
                        raise Refusal(
                            f"`{name}` is reassigned between the spec gather and the kernel call"
                        )
                    if kind == "gather":
                        assert d.gather is not None
                        rhs = _mirror(d.gather, name)
                    else:
                        rhs = cst.Name(name)
                    reads = sorted({n.value for n in _names_in(rhs)})
                    anchor = self._anchor(d.stmt, reads)
                    line = cst.SimpleStatementLine(
                        [cst.Assign([cst.AssignTarget(cst.Name(new))], rhs)]
                    )
                    if not any(code_of(x) == code_of(line) for x in plan.inserts[id(anchor)]):
                        plan.inserts[id(anchor)].append(line)
                plan.swaps[id(gate.arg)] = new
        return plan

    def _new_name(self, gate: str, call: int) -> str:
        key = (gate, call)
        if key not in self.fresh:
            base = f"{gate}_spec"
            name, n = base, 1
            while name in self.taken:
                n += 1
                name = f"{base}{n}"
            self.taken.add(name)
            self.fresh[key] = name
        return self.fresh[key]


def code_of(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


class _Rewriter(cst.CSTTransformer):
    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.applied: set[int] = set()

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        if not any(id(s) in self.plan.inserts for s in original_node.body):
            return updated_node
        body: list[cst.BaseStatement] = []
        for orig, upd in zip(original_node.body, updated_node.body, strict=True):
            body.append(upd)
            if id(orig) in self.plan.inserts:
                body.extend(self.plan.inserts[id(orig)])
                self.applied.add(id(orig))
        return updated_node.with_changes(body=body)

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        new = self.plan.swaps.get(id(original_node))
        if new is None:
            return updated_node
        self.applied.add(id(original_node))
        return updated_node.with_changes(value=cst.Name(new))


def site_functions(
    tree: cst.Module, patchset: Patchset, text: str | None = None
) -> tuple[dict[str, str], list[tuple[str, int, cst.FunctionDef]]]:
    """The module's imports and the functions worth analysing, in order.

    ``text`` is ``tree.code`` when the caller has it (generating it again
    costs as much as parsing)."""
    text = tree.code if text is None else text
    parsed = ast.parse(text)
    wanted = {
        (c.qualname, c.occurrence)
        for c in locate.candidates(parsed, text.splitlines(keepends=True), patchset)
    }
    funcs = [f for f in locate.index_functions(tree) if (f[0], f[1]) in wanted]
    return locate.module_imports(parsed), funcs


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


class GatherGatesCodemod(Codemod):
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

    def __init__(self, context: CodemodContext | None = None, source: str | None = None) -> None:
        super().__init__(context or CodemodContext())
        self.source = source  # the module's text, if the caller has it
        self.rewritten: str | None = None  # the result's text, once proven

    def transform_module(self, tree: cst.Module) -> cst.Module:
        # No metadata is used: skip the MetadataWrapper's deep copy of the tree.
        return self.transform_module_impl(tree)

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        patchset = load()
        imports, funcs = site_functions(tree, patchset, self.source)
        plans: list[tuple[str, int, _Plan]] = []
        for qual, occurrence, func in funcs:
            result = analyse(func, patchset, imports)
            if result is None:
                continue
            if result.status is Status.UNKNOWN:
                raise Refusal(f"{qual}: {result.reason}")
            if result.status is Status.AFFECTED:
                try:
                    plans.append((qual, occurrence, _Planner(func, result).plan()))
                except Refusal as exc:
                    raise Refusal(f"{qual}: {exc}") from exc
        if not plans:
            raise SkipFile("no affected GDN spec path")
        merged = _Plan()
        for _, _, p in plans:
            merged.inserts.update(p.inserts)
            merged.swaps.update(p.swaps)
        rewriter = _Rewriter(merged)
        new_tree = tree.visit(rewriter)
        expected = set(merged.inserts) | set(merged.swaps)
        if rewriter.applied != expected:
            raise Refusal("some planned edits found no place in the tree")
        self.rewritten = self._prove(new_tree, patchset, {(q, o) for q, o, _ in plans})
        return new_tree

    @staticmethod
    def _prove(tree: cst.Module, patchset: Patchset, sites: set[tuple[str, int]]) -> str:
        """Re-analyse the rewritten sites: each must now be aligned. Returns
        the rewritten text."""
        text = tree.code
        compile(text, "<rewritten>", "exec")
        imports, funcs = site_functions(tree, patchset, text)
        seen = set()
        for qual, occurrence, func in funcs:
            if (qual, occurrence) not in sites:
                continue
            seen.add((qual, occurrence))
            result = analyse(func, patchset, imports)
            if result is None or result.status not in (Status.FIXED, Status.NOT_AFFECTED):
                got = "no site" if result is None else f"{result.status.value}: {result.reason}"
                raise Refusal(f"{qual}: the rewrite does not prove aligned ({got})")
        if seen != sites:
            raise Refusal("a rewritten site disappeared from the analysis")
        return text

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
