"""Classify the spec calls of one walk: are their gate rows the rows of q/k/v?

A walk (:mod:`gdn_backport.dataflow`) starts at an *entry* function and
follows the helpers it calls. Every call in it that receives the spec
requests' state slots is accounted for, in exactly one way:

* a kernel of the patchset (or one the tree declares): a *spec call*; the
  analysis compares, branch by branch, the row selection of its token-row
  arguments (q/k/v) with that of each gate argument (a/b, g/beta, ...):

  - the same selection on every consistent path -> ``fixed`` when the kernel
    is the one upstream's fix is about (raw a/b gates) and some path
    gathered spec rows, else ``not_affected``;
  - q/k/v gathered by the spec index but a gate not (or the other way
    round) on some path -> ``affected``;
  - anything the analysis cannot trace -> ``unknown``, with the reason;

* a benign call (the patchset's conv kernels, PyTorch's own ops, builtins);
* a helper of the tree that was followed (its own calls are accounted);
* any other callee: ``not_affected`` when every row argument carries the
  same rows, else ``unknown`` with a ready-to-paste declaration that would
  let the tool decide. A callee handed no token rows at all cannot misalign
  them and is no site.

Spec calls are grouped into *sites* by the function whose code the fix
changes: the one that gathers the spec rows of q/k/v.
"""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass, field

import libcst as cst

from gdn_backport.cst_nodes import code, dotted, walk
from gdn_backport.site import ORDER, Status

from .config import KernelSpec, Patchset
from .dataflow import TENSOR_ATTRS, CallRecord, Flow, FlowWalker, Frame, Resolver, Scope, Vals
from .provenance import GATHERED, NONE_VAL, Assume, Prov, Val, consistent

_BUILTINS = frozenset(dir(builtins))


@dataclass
class GateUse:
    """A gate argument of a spec call, with what the rewriter needs to know."""

    param: str  # the kernel's parameter name (``a``)
    arg: cst.Arg  # the argument as written
    vals: Vals


@dataclass
class SpecCall:
    record: CallRecord
    kernel: KernelSpec | None  # None: a callee outside the kernel table
    rows: dict[str, Vals]  # q/k/v param -> values
    gates: list[GateUse]
    status: Status
    reason: str
    chain: list[Frame] = field(default_factory=list)  # the entry down to the call's frame
    select: Frame | None = None  # the frame whose code the fix changes
    flow: Flow | None = None  # the walk it was found in

    @property
    def name(self) -> str:
        if self.kernel is not None:
            return self.kernel.name
        return self.record.callee or code(self.record.node.func)

    @property
    def via(self) -> list[str]:
        """``Class._forward_core -> Class.helper -> kernel`` as a list."""
        return [f.qualname for f in self.chain] + [self.name]

    @property
    def chained(self) -> bool:
        return len(self.chain) > 1


@dataclass
class SiteAnalysis:
    """The spec calls whose fix goes into one function, and their verdict."""

    status: Status
    reason: str
    calls: list[SpecCall] = field(default_factory=list)
    flow: Flow | None = None
    via: list[str] | None = None  # the worst call's chain, when it goes through helpers


@dataclass
class Walk:
    """One entry's walk, classified."""

    flow: Flow
    calls: list[SpecCall]
    # Every call that receives the spec state slots, and what became of it:
    # "site", "benign", "followed" or "no-rows" (the no-silent-miss ledger).
    ledger: list[tuple[CallRecord, str]]


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


def _arg_for(record: CallRecord, kernel: KernelSpec, param: str | None) -> cst.Arg | None:
    if param is None:
        return None
    for position, (keyword, arg, _) in enumerate(record.args):
        if (keyword or kernel.bind(position)) == param:
            return arg
    return None


def _live(vals: Vals, path: frozenset[tuple[str, bool]]) -> list[Val]:
    return [v for v in vals if consistent(v.assume, path) is not None]


def _has(vals: Vals, path: frozenset[tuple[str, bool]], prov: Prov) -> bool:
    return any(v.prov is prov for v in _live(vals, path))


def _compare(q: Vals, gate: Vals, path: frozenset[tuple[str, bool]]) -> tuple[str, str] | None:
    """('affected'|'unknown', detail) for the worst pair, None if all align.

    q/k/v gathered while the gate is not (or gathered by another index) is
    the bug: affected. The reverse, gates gathered while q/k/v hold every
    row, is right only where every row is a spec token (a pure-spec batch,
    where the index is the identity); the analysis cannot tell, so unknown.
    """
    pairs = 0
    unknown: str | None = None
    for qv in _live(q, path):
        for gv in _live(gate, path):
            if consistent(qv.assume, gv.assume, path) is None:
                continue
            pairs += 1
            if qv.prov.is_rows and gv.prov.is_rows:
                if qv.prov is gv.prov:
                    continue
                detail = f"{gv.prov.value} rows while q/k/v carry {qv.prov.value} rows"
                if qv.prov is not Prov.ALL:
                    return "affected", detail
                if unknown is None:
                    unknown = detail + " (right only if every row is a spec token there)"
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


def _is_spec(record: CallRecord, kernel: KernelSpec, bound: dict[str, Vals]) -> bool:
    """The spec call is the one fed the spec requests' state slots; a fork that
    renamed those still passes the accepted-token counts, the other calls not."""
    path = record.path
    state = bound.get(kernel.state_indices)
    accepted_arg = _arg_for(record, kernel, kernel.accepted)
    return (state is not None and _has(state, path, Prov.STATE_SPEC)) or (
        accepted_arg is not None
        and code(accepted_arg.value) != "None"
        and not (state is not None and _has(state, path, Prov.STATE_NONSPEC))
    )


def _spec_call(record: CallRecord, kernel: KernelSpec) -> SpecCall | None:
    bound = _bind(record, kernel)
    if isinstance(bound, str):
        if not _consumes(record):
            return None
        return SpecCall(record, kernel, {}, [], Status.UNKNOWN, f"{kernel.name}: {bound}")
    if not _is_spec(record, kernel, bound):
        return None
    path = record.path
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
    names = ", ".join(f"{g.param}={code(g.arg.value)}" for g in gates)
    gathered = any(v.prov is Prov.SPEC for v in _live(rows[q_param], path))
    if kernel.fix_target and gathered:
        status, reason = (
            Status.FIXED,
            f"{kernel.name}: gates ({names}) carry the same rows as q/k/v on every path",
        )
    elif kernel.fix_target:
        status, reason = (
            Status.NOT_AFFECTED,
            f"{kernel.name}: no spec gather on this path; q/k/v and the gates ({names}) "
            "carry the same rows",
        )
    else:
        status, reason = (
            Status.NOT_AFFECTED,
            f"{kernel.name}: gates ({names}) carry the same rows as q/k/v on every path",
        )
        if gathered and all(_has(g.vals, path, Prov.SPEC) for g in gates):
            # Pre-0.18 upstream, OLMo, forks: g/beta computed for every token
            # and gathered by the spec token index along their token axis.
            reason += " (the gates are gathered by the spec token index, as q/k/v are)"
    return SpecCall(record, kernel, rows, gates, status, reason)


def _selected(gate: Vals, index: Vals) -> Vals:
    """The rows a kernel reads from ``gate`` when it selects them by ``index``."""
    out = set()
    for g in gate:
        for i in index:
            a = consistent(g.assume, i.assume)
            if a is None:
                continue
            if i.prov in (Prov.NONE, Prov.NULL, Prov.IDX_ALL):
                prov = g.prov
            elif i.prov in GATHERED and g.prov is Prov.ALL:
                prov = GATHERED[i.prov]
            else:
                prov = Prov.CONFLICT
            out.add(Val(a, prov, g.defs | i.defs, g.lead))
    return frozenset(out)


def line_of(frame: Frame, stmt: cst.CSTNode) -> int | None:
    """The line of ``stmt`` in its file, from its frame's ``def`` line (the
    first line of the function's text that reads as the statement's first)."""
    lines = cst.Module([]).code_for_node(frame.func).splitlines()
    first = code(stmt).strip().splitlines()
    if not first:
        return None
    start = next(
        (i for i, t in enumerate(lines) if t.lstrip().startswith(("def ", "async def "))), None
    )
    if start is None:
        return None
    for i in range(start, len(lines)):
        if lines[i].strip() == first[0].strip():
            return frame.line + i - start
    return None


def _partial_of_kernel(flow: Flow, call: SpecCall, patchset: Patchset) -> str:
    """For a call of a local bound to ``functools.partial(kernel, ...)``:
    what stopped the analysis, and where (empty otherwise)."""
    func = call.record.node.func
    if call.kernel is not None or not isinstance(func, cst.Name):
        return ""
    for d in flow.defs:
        value = d.value
        if d.name != func.value or d.frame != call.record.frame or not isinstance(value, cst.Call):
            continue
        callee = dotted(value.func) or ""
        if callee.rsplit(".", 1)[-1] != "partial" or not value.args:
            continue
        bound = dotted(value.args[0].value) or ""
        kernel = patchset.kernel_for(bound.rsplit(".", 1)[-1])
        if kernel is None:
            continue
        frame = flow.frames[d.frame]
        line = line_of(frame, d.stmt)
        at = f"line {line}" if line is not None else "its definition"
        return (
            f"`{func.value}` is `{code(value.func)}({kernel.name}, ...)` at {at} of "
            f"{frame.qualname}: a kernel bound by a partial, which the analysis does not "
            "follow (call the kernel by its name with its arguments written out); "
        )
    return ""


def _missing_helpers(flow: Flow, call: SpecCall) -> str:
    """Where rows the call cannot trace came from a function imported from a
    module the tree given does not hold: which, and what would decide."""
    vals = [v for vals in (*call.rows.values(), *(g.vals for g in call.gates)) for v in vals]
    defs = {i for v in vals if v.prov in (Prov.CONFLICT, Prov.NONE) for i in v.defs}
    values = [flow.defs[i].value for i in sorted(defs)]
    notes = []
    for record in flow.calls:
        if record.missing is None:
            continue
        node = record.node
        if not any(value is not None and any(n is node for n in walk(value)) for value in values):
            continue
        module, _, name = record.missing.rpartition(".")
        where = flow.frames[record.frame].qualname
        note = (
            f"the rows come from `{code(node.func)}(...)` in {where}, `{name}` imported from "
            f"`{module}`, which the tree given does not hold: scan a tree that includes "
            f"{module.replace('.', '/')}.py (or its package) so the tool can follow it "
            "(a function that gathers rows cannot be declared; .gdn-backport.toml "
            "declares kernels only)"
        )
        if note not in notes:
            notes.append(note)
    return "; " + "; ".join(notes) if notes else ""


def _lineage(
    flow: Flow, vals: Vals, path: Assume, arg: cst.BaseExpression | None
) -> tuple[set[int], set[str]]:
    """What a value was computed by: the ids of every node of its
    definitions' expressions and of ``arg``, and those definitions' names."""
    defs = [flow.defs[i] for v in _live(vals, path) for i in v.defs]
    values = [d.value for d in defs if d.value is not None]
    nodes = {id(n) for value in [*values, *([arg] if arg is not None else [])] for n in walk(value)}
    return nodes, {d.name for d in defs}


def _untrusted_gates(flow: Flow, call: SpecCall) -> None:
    """A spec call is unknown where a gate came through rows the analysis
    kept but cannot vouch for: rows picked by an index it cannot name
    (``a_s = a[perm]``: flow.unnamed_picks), or a prefix cut by a count q/k/v
    did not come through (``a_s = a[:num_spec_decode_tokens]``,
    ``index_select(0, torch.arange(n))``: flow.cuts, read as every row),
    a gate whose index arithmetic differs from q/k/v's (``idx + off`` for
    one of them: flow.shifts, kept as the index), and gates whose names
    cross the kernel's parameters (``a=b_spec``). Before, ``apply``
    gathered picked or cut rows again by the spec index: a wrong patch;
    shifted ones read ``fixed``."""
    path = call.record.path
    name = call.kernel.name if call.kernel is not None else call.record.callee
    q_nodes: set[int] = set()
    for vals in call.rows.values():
        q_nodes |= _lineage(flow, vals, path, None)[0]
    q_counts = {count for node, count in flow.cuts if id(node) in q_nodes}
    q_shifts = {shift for node, shift in flow.shifts if id(node) in q_nodes}
    for gate in call.gates:
        nodes, names = _lineage(flow, gate.vals, path, gate.arg.value)
        written = f"gate {gate.param}={code(gate.arg.value)}"
        why = None
        for pick in flow.unnamed_picks:
            if id(pick) in nodes:
                why = (
                    f"{written} has rows picked by `{code(pick)}`, an index the analysis "
                    "cannot name: neither every row in order nor the spec rows"
                )
                break
        for node, count in flow.cuts if why is None else ():
            if count not in q_counts and id(node) in nodes:
                why = (
                    f"{written} has rows cut by `{code(node)}`, a count q/k/v did not come "
                    "through: not every row of the step (a prefix of the spec or decode rows?)"
                )
                break
        # The names the gate's value came through (its definitions, the
        # argument): one of another gate parameter's name and never its own
        # is a swap (``a=b_spec``) or the other tensor (``a_s = b[idx]``).
        if isinstance(gate.arg.value, cst.Name):
            names.add(gate.arg.value.value)
        crossed = sorted(names & ({g.param for g in call.gates} - {gate.param}))
        if why is None and crossed and gate.param not in names:
            why = (
                f"{written} comes from `{crossed[0]}`, the name of another gate parameter, "
                f"and from nothing named `{gate.param}`: the gates look swapped"
            )
        shifts = {shift for node, shift in flow.shifts if id(node) in nodes}
        # Raw gates (affected) carry no index: the rewrite gathers them by
        # q/k/v's own.
        if why is None and call.status is Status.FIXED and shifts != q_shifts:
            mine = ", ".join(f"`{code(n)}`" for n, c in flow.shifts if c in shifts - q_shifts)
            theirs = ", ".join(f"`{code(n)}`" for n, c in flow.shifts if c in q_shifts - shifts)
            why = (
                f"{written} and q/k/v come through different index arithmetic "
                f"({mine or 'none'} against {theirs or 'none'}): not the same rows"
            )
        if why is not None:
            call.status, call.reason = Status.UNKNOWN, f"{name}: {why}"
            return


def _off_axis(flow: Flow, call: SpecCall) -> str:
    """Why a gate's rows are unknown where it was selected by a token index
    along another axis than its tokens' (``[T, H]`` by dim 1, ``[1, T, H]``
    by dim 0): empty where no such selection reaches it."""
    defs = {
        i
        for gate in call.gates
        for v in _live(gate.vals, call.record.path)
        for i in v.defs
        if v.prov is Prov.CONFLICT
    }
    values = [flow.defs[i].value for i in sorted(defs)]
    notes = []
    for node, dim, lead in flow.off_axis:
        if not any(value is not None and any(n is node for n in walk(value)) for value in values):
            continue
        shape = "[" + "1, " * (lead or 0) + "T, ...]"
        along = f"dim {dim}" if dim is not None else "a dimension the analysis cannot tell"
        note = (
            f"`{code(node)}` selects along {along}, but the token axis of what it selects "
            f"from is dim {lead} ({shape}): not the spec token rows"
        )
        if note not in notes:
            notes.append(note)
    return "; " + "; ".join(notes) if notes else ""


def _consumes(record: CallRecord) -> bool:
    """The call is handed the spec requests' state slots (on a path that runs)."""
    return any(_has(vals, record.path, Prov.STATE_SPEC) for _, _, vals in record.args)


def _benign(record: CallRecord, patchset: Patchset) -> bool:
    """Calls that take state slots but run no recurrence of their own."""
    callee = record.callee or ""
    short = callee.rsplit(".", 1)[-1]
    if short in patchset.benign:
        return True
    if callee.startswith("torch.") and not callee.startswith("torch.ops."):
        return True  # a PyTorch op (torch.cat, torch.index_select, F.pad, ...)
    if "." not in callee and callee in _BUILTINS:
        return True  # len(), getattr(), isinstance()
    if short[:1].isupper() or callee in ("dataclasses.replace", "copy.copy", "copy.deepcopy"):
        return True  # a class built or copied (a metadata record), not a kernel run
    func = record.node.func
    return isinstance(func, cst.Attribute) and func.attr.value in TENSOR_ATTRS


def _label(i: int, keyword: str | None, arg: cst.Arg, taken: set[str]) -> str:
    """A parameter name for a declaration snippet: the keyword, else the
    argument's own name, else its position."""
    name = keyword
    if name is None and isinstance(arg.value, cst.Name):
        name = re.sub(r"\W", "_", arg.value.value)
    if name is None or not name.isidentifier() or name in taken:
        name = f"arg{i + 1}"
    taken.add(name)
    return name


def declaration(record: CallRecord) -> str:
    """A ``.gdn-backport.toml`` line declaring ``record``'s callee as a
    kernel, its roles guessed from this call (for the user to check)."""
    name = record.callee or code(record.node.func)
    taken: set[str] = set()
    params, rows, gates = [], [], []
    state = accepted = ""
    raw = False
    for i, (keyword, arg, vals) in enumerate(record.args):
        label = _label(i, keyword, arg, taken)
        params.append(label)
        provs = {v.prov for v in _live(vals, record.path)}
        if Prov.STATE_SPEC in provs and not state:
            state = label
        elif "accepted" in code(arg.value) and not accepted:
            accepted = label
        elif provs & {Prov.SPEC, Prov.NONSPEC}:
            rows.append(label)
        elif Prov.ALL in provs or Prov.CONFLICT in provs:
            gates.append(label)
            # A gate handed every row beside gathered q/k/v: the kernel takes
            # raw gates, the kind upstream's fix is about (fixed once gathered).
            raw = raw or Prov.ALL in provs

    def names(xs: list[str]) -> str:
        return "[" + ", ".join(f'"{x}"' for x in xs) + "]"

    accepted_part = f', accepted = "{accepted}"' if accepted else ""
    return (
        f'kernel = [{{name = "{name}", params = {names(params)}, rows = {names(rows)}, '
        f'gates = {names(gates)}, state_indices = "{state}"{accepted_part}, '
        f"fix_target = {'true' if raw and rows else 'false'}}}]"
    )


def _other_consumer(record: CallRecord) -> SpecCall | str:
    """A call outside the kernel table that takes the spec state slots: a
    not_affected or unknown SpecCall, or "no-rows"."""
    name = record.callee or code(record.node.func)
    if record.unfollowed is not None:
        reason = (
            f"{name}(...) takes the spec state slots; it was not followed ({record.unfollowed})"
        )
        return SpecCall(record, None, {}, [], Status.UNKNOWN, reason)
    path = record.path
    rows: dict[str, Vals] = {}
    for i, (keyword, arg, vals) in enumerate(record.args):
        live = frozenset(v for v in _live(vals, path) if v.prov.is_rows or v.prov is Prov.CONFLICT)
        if live:
            rows[keyword or f"#{i + 1} {code(arg.value)}"] = live
    if not rows:
        return "no-rows"
    labels = list(rows)
    for i, left in enumerate(labels):
        for right in labels[i + 1 :]:
            for lv in _ordered(rows[left]):
                for rv in _ordered(rows[right]):
                    if consistent(lv.assume, rv.assume, path) is None:
                        continue
                    if lv.prov is not rv.prov or lv.prov is Prov.CONFLICT:
                        reason = (
                            f"{name}(...) takes the spec state slots and rows of different "
                            f"selections ({_arg_text(left)}: {lv.prov.value}, "
                            f"{_arg_text(right)}: {rv.prov.value}); it is not a known kernel. "
                            "If it is one, declare it in .gdn-backport.toml at the tree root "
                            "(or under [tool.gdn-backport] in pyproject.toml, or in a "
                            "--kernels FILE), checking the roles guessed from this call: "
                            + declaration(record)
                        )
                        return SpecCall(record, None, rows, [], Status.UNKNOWN, reason)
    prov = _ordered(rows[labels[0]])[0].prov.value
    splat = " it is handed by name" if record.starred else ""
    reason = (
        f"{name}(...) takes the spec state slots and every row argument{splat} carries "
        f"{prov} rows (not a kernel of the patchset; declare it to have its gates checked)"
    )
    return SpecCall(record, None, rows, [], Status.NOT_AFFECTED, reason)


_PROV_ORDER = {p: i for i, p in enumerate(Prov)}


def _ordered(vals: Vals) -> list[Val]:
    """``vals`` in one order in every process (a set's order follows string
    hashes, which differ per process: a reason naming "the first" value
    would differ from run to run)."""
    return sorted(vals, key=lambda v: (_PROV_ORDER[v.prov], sorted(v.assume), sorted(v.defs)))


def _arg_text(label: str) -> str:
    return label.split(" ", 1)[1] if label.startswith("#") else label


def _select_frame(flow: Flow, call: SpecCall) -> Frame:
    """The frame that gathers the spec rows q/k/v reach the call with (where
    the fix goes); the entry when none does."""
    if call.rows:
        vals = _live(next(iter(call.rows.values())), call.record.path)
        closure = frozenset().union(*(v.defs for v in vals)) if vals else frozenset()
        frames = sorted({flow.defs[i].frame for i in closure if flow.defs[i].gather is not None})
        if frames:
            return flow.frames[frames[0]]
    return call.chain[0]


def classify(flow: Flow, patchset: Patchset) -> Walk:
    """Every spec call of a walk, and the ledger of slot-receiving calls."""
    calls: list[SpecCall] = []
    ledger: list[tuple[CallRecord, str]] = []
    # Frames (and their callers) in which some call takes the spec slots on.
    inner: set[int] = set()
    for record in flow.calls:
        if record.entered is None and _consumes(record):
            frame: int | None = record.frame
            while frame is not None and frame not in inner:
                inner.add(frame)
                frame = flow.frames[frame].parent
    for record in flow.calls:
        if record.entered is not None:
            if _consumes(record) and record.entered not in inner:
                # The helper was handed the slots and passes them to no call
                # (``slots.data_ptr()`` into a raw launch): the helper is the
                # boundary the analysis sees, judged like any unknown callee.
                boundary = _other_consumer(record)
                if isinstance(boundary, str):
                    ledger.append((record, boundary))
                else:
                    boundary.chain = flow.chain(record.frame)
                    boundary.select = _select_frame(flow, boundary)
                    boundary.flow = flow
                    calls.append(boundary)
                    ledger.append((record, "site"))
            elif _consumes(record):
                ledger.append((record, "followed"))
            continue
        kernel = patchset.kernel_for(record.callee)
        found: SpecCall | str | None = None
        if record.unfollowed is not None:
            # A helper that may reach the spec path (past the depth followed,
            # or recursive): what it does is unseen, so never "nothing".
            found = _other_consumer(record)
        elif kernel is not None:
            found = _spec_call(record, kernel)
            if found is None and _consumes(record):
                found = "benign"  # a kernel's non-spec call handed the slots elsewhere
        elif not _consumes(record):
            continue
        elif _benign(record, patchset):
            found = "benign"
        else:
            found = _other_consumer(record)
        if found is None:
            continue
        if isinstance(found, str):
            ledger.append((record, found))
            continue
        if found.status in (Status.AFFECTED, Status.FIXED):
            _untrusted_gates(flow, found)
        if found.status is Status.UNKNOWN and flow.off_axis:
            found.reason += _off_axis(flow, found)
        if found.status is Status.UNKNOWN:
            found.reason = _partial_of_kernel(flow, found, patchset) + found.reason
            found.reason += _missing_helpers(flow, found)
        found.chain = flow.chain(record.frame)
        found.select = _select_frame(flow, found)
        found.flow = flow
        calls.append(found)
        ledger.append((record, "site"))
    return Walk(flow, calls, ledger)


def accounted(walk: Walk, patchset: Patchset) -> list[tuple[CallRecord, str]]:
    """Every call of a walk the analysis accounted for, and how: its ledger
    (the calls handed the spec state slots), and of the other calls those it
    followed into ("followed") or judged benign ("benign": a call handed only
    the spec index is a PyTorch op, a builtin, a record built, ...). A call
    the walk saw but that is not here was not judged: the sweep
    (:mod:`.sweep`) holds the analysis to that."""
    out = list(walk.ledger)
    ledgered = {id(record) for record, _ in walk.ledger}
    for record in walk.flow.calls:
        if id(record) in ledgered:
            continue
        if record.entered is not None:
            out.append((record, "followed"))
        elif patchset.kernel_for(record.callee) is None and _benign(record, patchset):
            out.append((record, "benign"))
    return out


def walk_entry(
    func: cst.FunctionDef,
    patchset: Patchset,
    imports: dict[str, str],
    resolver: Resolver | None = None,
    scope: Scope | None = None,
    qualname: str = "",
    path: str | None = None,
    line: int = 0,
    key: tuple[str, str, int] | None = None,
    objects: set[str] | None = None,
) -> Walk:
    """Walk ``func`` as an entry (its tensor parameters hold every row of the
    step), following the tree's helpers through ``resolver``."""

    def stop(callee: str) -> bool:
        return patchset.kernel_for(callee) is not None or callee.rsplit(".", 1)[-1] in (
            patchset.benign
        )

    walker = FlowWalker(
        patchset.fields, imports, resolver, stop, patchset.row_gathers, patchset.leading_one
    )
    flow = walker.run(func, scope, qualname, path, line, key, objects)
    return classify(flow, patchset)


def group(walk: Walk) -> dict[tuple[str, str, int], SiteAnalysis]:
    """The walk's spec calls by the function whose code the fix changes."""
    by_key: dict[tuple[str, str, int], list[SpecCall]] = {}
    for call in walk.calls:
        assert call.select is not None
        by_key.setdefault(call.select.key, []).append(call)
    return {key: site_of(calls, walk.flow) for key, calls in by_key.items()}


def site_of(calls: list[SpecCall], flow: Flow | None) -> SiteAnalysis:
    """The verdict of one function from its spec calls: the worst one's."""
    worst = min(calls, key=lambda c: (ORDER.index(c.status), len(c.chain)))
    return SiteAnalysis(
        worst.status, worst.reason, calls, flow, worst.via if worst.chained else None
    )


def analyse(
    func: cst.FunctionDef, patchset: Patchset, imports: dict[str, str]
) -> SiteAnalysis | None:
    """The site analysis of ``func`` alone (no helper followed), or None if
    it is not a GDN spec path."""
    walk = walk_entry(func, patchset, imports)
    if not walk.calls:
        return None
    return site_of(walk.calls, walk.flow)
