"""Classify one function: is it a GDN spec path, and are its gate rows right?

A function is a *site* when it gathers token rows by a spec token index and
calls a recurrent kernel with the spec requests' state slots. For every such
spec call the analysis compares, branch by branch, the row selection of the
kernel's token-row arguments (q/k/v) with that of each gate argument (a/b,
g/beta, ...):

* the same selection on every consistent path -> ``fixed`` when the kernel is
  the one upstream's fix is about (raw a/b gates), else ``not_affected``;
* q/k/v gathered by the spec index but a gate not (or the other way round) on
  some path -> ``affected``;
* anything the analysis cannot trace -> ``unknown``, with the reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import libcst as cst

from gdn_backport.dataflow import CallRecord, Flow, FlowWalker, Vals, code
from gdn_backport.patchset import KernelSpec, Patchset
from gdn_backport.provenance import GATHERED, NONE_VAL, Prov, Val, consistent


class Status(str, enum.Enum):
    AFFECTED = "affected"
    FIXED = "fixed"
    NOT_AFFECTED = "not_affected"
    UNKNOWN = "unknown"


@dataclass
class GateUse:
    """A gate argument of a spec call, with what the rewriter needs to know."""

    param: str  # the kernel's parameter name (``a``)
    arg: cst.Arg  # the argument as written
    vals: Vals


@dataclass
class SpecCall:
    record: CallRecord
    kernel: KernelSpec
    rows: dict[str, Vals]  # q/k/v param -> values
    gates: list[GateUse]
    status: Status
    reason: str


@dataclass
class SiteAnalysis:
    status: Status
    reason: str
    calls: list[SpecCall] = field(default_factory=list)
    flow: Flow | None = None


def _bind(record: CallRecord, kernel: KernelSpec) -> dict[str, Vals] | str:
    """Kernel parameter -> argument values, or why the binding is unknowable."""
    if record.starred:
        return "arguments are passed through *args/**kwargs"
    bound: dict[str, Vals] = {}
    for position, (keyword, _, vals) in enumerate(record.args):
        name = keyword if keyword is not None else kernel.bind(position)
        if name is None:
            return f"positional argument {position + 1} is beyond the known signature"
        bound[name] = vals
    return bound


def _arg_for(record: CallRecord, kernel: KernelSpec, param: str) -> cst.Arg | None:
    for position, (keyword, arg, _) in enumerate(record.args):
        if (keyword or kernel.bind(position)) == param:
            return arg
    return None


def _live(vals: Vals, path: frozenset[tuple[str, bool]]) -> list[Val]:
    return [v for v in vals if consistent(v.assume, path) is not None]


def _has(vals: Vals, path: frozenset[tuple[str, bool]], prov: Prov) -> bool:
    return any(v.prov is prov for v in _live(vals, path))


def _line(node: cst.CSTNode, positions: dict[cst.CSTNode, int] | None) -> str:
    if positions and node in positions:
        return f" (line {positions[node]})"
    return ""


def _compare(q: Vals, gate: Vals, path: frozenset[tuple[str, bool]]) -> tuple[str, str] | None:
    """('affected'|'unknown', detail) for the first bad pair, None if all align."""
    pairs = 0
    unknown: str | None = None
    for qv in _live(q, path):
        for gv in _live(gate, path):
            if consistent(qv.assume, gv.assume, path) is None:
                continue
            pairs += 1
            if qv.prov.is_rows and gv.prov.is_rows:
                if qv.prov is not gv.prov:
                    return (
                        "affected",
                        f"{gv.prov.value} rows while q/k/v carry {qv.prov.value} rows",
                    )
            elif unknown is None:
                unknown = f"rows cannot be traced (q/k/v: {qv.prov.value}, gate: {gv.prov.value})"
    if pairs == 0:
        return "unknown", "no path reaches the call with both q/k/v and the gate defined"
    return ("unknown", unknown) if unknown else None


def gate_aligned(call: SpecCall, gate: GateUse) -> bool:
    """``gate`` carries the rows q/k/v carry, on every consistent path."""
    if not call.rows:
        return False
    q = next(iter(call.rows.values()))
    return _compare(q, gate.vals, call.record.path) is None


def _spec_call(record: CallRecord, kernel: KernelSpec) -> SpecCall | None:
    bound = _bind(record, kernel)
    if isinstance(bound, str):
        return SpecCall(record, kernel, {}, [], Status.UNKNOWN, f"{kernel.name}: {bound}")
    path = record.path
    state = bound.get(kernel.state_indices)
    accepted_arg = _arg_for(record, kernel, kernel.accepted)
    # The spec call is the one fed the spec requests' state slots; a fork that
    # renamed those still passes the accepted-token counts, the other calls not.
    is_spec = (state is not None and _has(state, path, Prov.STATE_SPEC)) or (
        accepted_arg is not None
        and code(accepted_arg.value) != "None"
        and not (state is not None and _has(state, path, Prov.STATE_NONSPEC))
    )
    if not is_spec:
        return None
    rows = {p: bound[p] for p in kernel.rows if p in bound}
    gates = [
        GateUse(p, arg, bound[p])
        for p in kernel.gates
        if p in bound and (arg := _arg_for(record, kernel, p)) is not None
    ]
    if not rows or not gates:
        missing = "q/k/v" if not rows else "gate"
        return SpecCall(
            record,
            kernel,
            rows,
            gates,
            Status.UNKNOWN,
            f"{kernel.name}: no {missing} argument found",
        )
    if kernel.token_index is not None:
        # The kernel gathers the gate rows itself by this index.
        index = bound.get(kernel.token_index, frozenset({NONE_VAL}))
        gates = [GateUse(g.param, g.arg, _selected(g.vals, index)) for g in gates]
    q_param = next(iter(rows))
    for other, vals in rows.items():
        bad = _compare(rows[q_param], vals, path)
        if bad is not None:
            # q against itself fails only when its rows cannot be traced.
            why = (
                f"the rows of {q_param} cannot be traced"
                if other == q_param
                else f"{q_param} and {other} do not carry the same rows"
            )
            return SpecCall(record, kernel, rows, gates, Status.UNKNOWN, f"{kernel.name}: {why}")
    worst: tuple[Status, str] | None = None
    for gate in gates:
        bad = _compare(rows[q_param], gate.vals, path)
        if bad is None:
            continue
        kind, detail = bad
        status = Status.AFFECTED if kind == "affected" else Status.UNKNOWN
        reason = f"{kernel.name}: gate {gate.param}={code(gate.arg.value)} has {detail}"
        if worst is None or (worst[0] is Status.AFFECTED and status is Status.UNKNOWN):
            worst = (status, reason)
    if worst is not None:
        return SpecCall(record, kernel, rows, gates, worst[0], worst[1])
    status = Status.FIXED if kernel.fix_target else Status.NOT_AFFECTED
    names = ", ".join(f"{g.param}={code(g.arg.value)}" for g in gates)
    return SpecCall(
        record,
        kernel,
        rows,
        gates,
        status,
        f"{kernel.name}: gates ({names}) carry the same rows as q/k/v on every path",
    )


def _selected(gate: Vals, index: Vals) -> Vals:
    """The rows a kernel reads from ``gate`` when it selects them by ``index``."""
    out = set()
    for g in gate:
        for i in index:
            a = consistent(g.assume, i.assume)
            if a is None:
                continue
            if i.prov is Prov.NONE:
                prov = g.prov
            elif i.prov in GATHERED and g.prov is Prov.ALL:
                prov = GATHERED[i.prov]
            else:
                prov = Prov.CONFLICT
            out.add(Val(a, prov, g.defs | i.defs))
    return frozenset(out)


def _unknown_consumer(record: CallRecord, patchset: Patchset, flow: Flow) -> str | None:
    """A call outside the kernel table that takes spec state slots and rows
    of different selections: it may be a wrapped kernel we cannot see into.

    A tensor parameter counts as token rows here only with evidence (it, or a
    value computed from it, is gathered by a token index somewhere): weights
    and caches passed in as tensors are not rows.
    """
    if record.callee and record.callee.rsplit(".", 1)[-1] in patchset.benign:
        return None
    path = record.path
    if not any(_has(v, path, Prov.STATE_SPEC) for _, _, v in record.args):
        return None
    params = {d.id for d in flow.defs if d.param}
    evidence = flow.gathered_defs & params

    def counts(v: Val) -> bool:
        if v.prov is Prov.ALL:
            return bool(v.defs & evidence) or not (v.defs & params)
        return v.prov.is_rows or v.prov is Prov.CONFLICT

    rows = [[v for v in _live(vals, path) if counts(v)] for _, _, vals in record.args]
    rows = [r for r in rows if r]
    for i, left in enumerate(rows):
        for right in rows[i + 1 :]:
            for lv in left:
                for rv in right:
                    if consistent(lv.assume, rv.assume, path) is None:
                        continue
                    if lv.prov is not rv.prov or lv.prov is Prov.CONFLICT:
                        return (
                            f"{record.callee or code(record.node.func)}(...) takes the "
                            "spec state slots and rows of different selections; it is "
                            "not a known kernel"
                        )
    return None


def analyse(
    func: cst.FunctionDef, patchset: Patchset, imports: dict[str, str]
) -> SiteAnalysis | None:
    """The site analysis of ``func``, or None if it is not a GDN spec path."""
    flow = FlowWalker(patchset.fields, dict(imports)).run(func)
    gathered = any(p is Prov.IDX_SPEC for _, p in flow.gathers)
    calls: list[SpecCall] = []
    opaque: list[str] = []
    for record in flow.calls:
        short = record.callee.rsplit(".", 1)[-1] if record.callee else None
        kernel = patchset.kernels.get(short) if short else None
        if kernel is not None:
            spec = _spec_call(record, kernel)
            if spec is not None:
                calls.append(spec)
        elif gathered:
            why = _unknown_consumer(record, patchset, flow)
            if why is not None:
                opaque.append(why)
    if not gathered:
        # No traceable spec gather, yet a kernel gets the spec state slots.
        # Only a call whose rows cannot be traced (an index from a helper or
        # ``getattr``) makes this a site, ``unknown``: saying nothing would
        # let a fork's bug pass ``apply --check``.
        calls = [c for c in calls if c.status is Status.UNKNOWN]
    if not calls and not opaque:
        return None
    if opaque:
        return SiteAnalysis(Status.UNKNOWN, opaque[0], calls, flow)
    order = [Status.UNKNOWN, Status.AFFECTED, Status.FIXED, Status.NOT_AFFECTED]
    worst = min(calls, key=lambda c: order.index(c.status))
    return SiteAnalysis(worst.status, worst.reason, calls, flow)
