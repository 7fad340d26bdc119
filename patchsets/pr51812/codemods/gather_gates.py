"""The ``gather`` strategy: upstream's fix (vLLM PR #51812) in the site's own names."""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import libcst as cst

from gdn_backport.cst_nodes import index_select_parts

from ..analysis import GateUse, SpecCall, gate_aligned
from ..codemods import examples as ex
from ..codemods.base import Edit, Plan, Planner, Refusal, Selection, SiteCodemod, live
from ..provenance import Prov, Val


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


def selected(sel: Selection, name: str) -> cst.BaseExpression:
    """What the gate ``name`` is set to beside the q/k/v selection ``sel``."""
    d = sel.definition
    if sel.kind == "gather":
        assert d.gather is not None
        return mirror(d.gather, name)
    return cst.Name(name)


def _gate_line(name: str, new: str, sel: Selection) -> cst.SimpleStatementLine:
    """``new = <name's rows as sel chose q/k/v's>``."""
    value = selected(sel, name)
    return cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(new))], value)])


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

    DESCRIPTION: str = "gate rows a/b gathered by the spec token index, as upstream"

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
            here = Plan()
            try:
                for sel in planner.selections(call):
                    d = sel.definition
                    planner.insert(here, d, new, selected(sel, name), expect)
            except Refusal as exc:
                if "is reassigned between" not in str(exc):
                    raise
                # The gate is set after the q/k/v rows were chosen (staged
                # through a local, or made contiguous): choose its rows
                # right before the call, the way q/k/v's were chosen.
                here = Plan()
                planner.gather_before_call(here, call, name, new, partial(_gate_line, name, new))
            plan.merge(here)
            plan.edits[planner.ref(arg)] = _rename_arg(new)

    # Examples, run by tests/test_codemods.py (before -> after; after again ->
    # unchanged; refusals leave the source alone and say why). They are
    # written here, shaped like the real code, and double as documentation.
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.UPSTREAM_SHAPE, ex.UPSTREAM_SHAPE_FIXED),
        (ex.RENAMED_POSITIONAL, ex.RENAMED_POSITIONAL_FIXED),
        (ex.NO_FAST_PATH, ex.NO_FAST_PATH_FIXED),
        (ex.MASKED, ex.MASKED_FIXED),
        (ex.ONE_GATE, ex.ONE_GATE_FIXED),
        (ex.GATE_REASSIGNED, ex.GATE_REASSIGNED_FIXED),
        (ex.STAGED_GATES, ex.STAGED_GATES_FIXED),
    )
    UNCHANGED: ClassVar[tuple[str, ...]] = (
        ex.UPSTREAM_SHAPE_FIXED,
        ex.PRECOMPUTED_GATES,
        ex.NO_SPEC_PATH,
    )
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.STAGED_GATES_CALLED_TEST, "calls a function: it cannot be repeated"),
        (ex.WRAPPED_KERNEL, "not a known kernel"),
        (ex.STARRED, "*args/**kwargs"),
        (ex.GATE_EXPRESSION, "passed as an expression"),
    )
