"""Every GDN spec site of a set of modules: entries, their walks, the sites.

A *candidate* is a function whose code names a spec-token field. The
candidates no other candidate calls are *entries*: each is walked with its
tensor parameters holding every row of the step, following the helpers it
calls (:mod:`gdn_backport.dataflow`); a candidate no walk reached is walked
as an entry of its own, so every one is looked at. The spec calls found are
grouped into sites by the function whose code the fix changes.

Then the sweep (:mod:`.sweep`) is held against the walks
(:func:`reconcile`): every call it finds handed the spec index or slots
must be one the analysis accounted for, found by its position; the
function of any other is an ``unknown`` site.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from gdn_backport.cst_nodes import Span, call_spans
from gdn_backport.site import Status

from .analysis import SiteAnalysis, SpecCall, Walk, accounted, site_of, walk_entry
from .dataflow import CallRecord, Frame
from .provenance import Prov, consistent
from .resolve import FunctionInfo, ModuleInfo, TreeIndex
from .sweep import Argument, Reach, Vocabulary, sweep_module

Key = tuple[str, str, int]  # (module key, qualname, occurrence)


@dataclass
class TreeAnalysis:
    index: TreeIndex
    walks: list[tuple[FunctionInfo, Walk]] = field(default_factory=list)
    sites: dict[Key, SiteAnalysis] = field(default_factory=dict)
    lines: dict[Key, int] = field(default_factory=dict)  # the site function's def line
    # Every call the sweep found handed the spec index or slots, and how the
    # analysis accounted for it ("site", "benign", "followed", "no-rows";
    # "other-rows": it traced the names the sweep flagged to other values),
    # or "unknown": it did not, and the call's function is an unknown site.
    swept: list[tuple[Reach, str]] = field(default_factory=list)

    def calls(self) -> list[SpecCall]:
        return [c for _, walk in self.walks for c in walk.calls]


def walk(index: TreeIndex, fn: FunctionInfo) -> Walk:
    """Walk one entry function of the index."""
    return walk_entry(
        fn.module.cst_function(fn),
        index.patchset,
        dict(fn.module.imports),
        index,
        fn.scope,
        fn.qualname,
        fn.module.key,
        fn.line,
        fn.key,
        index.entry_objects(fn),
    )


def entries(index: TreeIndex, modules: list[ModuleInfo]) -> list[FunctionInfo]:
    """The candidates of ``modules`` that no candidate calls."""
    cands = [fn for m in modules for fn in index.candidates(m)]
    keys = {fn.key for fn in cands}
    names = frozenset(fn.node.name for fn in cands)
    called = {callee.key for fn in cands for callee in index.calls(fn, names) if callee.key in keys}
    return [fn for fn in cands if fn.key not in called]


def analyse_modules(index: TreeIndex, modules: list[ModuleInfo]) -> TreeAnalysis:
    out = TreeAnalysis(index)
    reached: set[Key] = set()
    first = entries(index, modules)
    keys = {fn.key for fn in first}
    rest = [fn for m in modules for fn in index.candidates(m) if fn.key not in keys]
    for fn in [*first, *rest]:
        if fn.key in reached:
            continue
        w = walk(index, fn)
        out.walks.append((fn, w))
        reached |= {f.key for f in w.flow.frames}
    grouped: dict[Key, list[SpecCall]] = {}
    for _, w in out.walks:
        for call in w.calls:
            assert call.select is not None
            grouped.setdefault(call.select.key, []).append(call)
            out.lines[call.select.key] = call.select.line
    order = {m.key: i for i, m in enumerate(index.modules.values())}
    for key in sorted(grouped, key=lambda k: (order.get(k[0], len(order)), out.lines[k], k)):
        calls = grouped[key]
        out.sites[key] = site_of(calls, calls[0].flow)
    reconcile(out, modules)
    return out


# -- the sweep's calls against the analysis (sweep.py) -------------------


Position = tuple[str, int, int, int, int]  # (module key, *the call's Span)


def accounted_positions(
    analysis: TreeAnalysis,
    wanted: dict[Key, set[Span]],
    among: dict[Key, list[ast.Call]] | None = None,
) -> tuple[dict[Position, str], dict[Position, list[CallRecord]]]:
    """Where each call the analysis accounted for is, and how
    (:func:`gdn_backport.analysis.accounted`, with ":callee" where it did
    not judge the call as a kernel's: "site:callee", "no-rows:callee"), and
    every call it saw, by position (``ast``'s, as the sweep gives them), of
    the ``wanted`` calls (by function); ``among``: every call of each such
    function's own code (:class:`.sweep.Swept`), to pair with."""
    patchset = analysis.index.patchset
    # By function and node: two modules with a function of the same text
    # (vendor copies) share its parse, so the node alone names neither.
    frames: dict[tuple[Key, int], tuple[Frame, list[tuple[CallRecord, str | None]]]] = {}
    for _, w in analysis.walks:
        fates = {id(record): how for record, how in accounted(w, patchset)}
        for record in w.flow.calls:
            frame = w.flow.frames[record.frame]
            if frame.key in wanted:
                entry = frames.setdefault((frame.key, id(frame.func)), (frame, []))
                entry[1].append((record, fates.get(id(record))))
    done: dict[Position, str] = {}
    seen: dict[Position, list[CallRecord]] = {}
    for frame, records in frames.values():
        module = analysis.index.modules.get(frame.key[0])
        fn = module.function(frame.key[1], frame.key[2]) if module is not None else None
        if fn is None:
            continue
        nodes = [record.node for record, _ in records]
        mine = (among or {}).get(frame.key)
        spans = call_spans(nodes, frame.func, fn.node, wanted[frame.key], mine)
        for record, how in records:
            where = spans.get(id(record.node))
            if where is None:
                continue
            position = (frame.key[0], *where)
            seen.setdefault(position, []).append(record)
            if how is not None and patchset.kernel_for(record.callee) is None:
                # Judged, but not as a kernel's call: as an unknown callee's,
                # a PyTorch op's, ... (the sweep may know the callee better).
                how = f"{how}:callee" if how in ("site", "benign", "no-rows") else how
            # A kernel's call over anything else: a call judged in one walk is judged.
            if how is not None and done.get(position) not in ("site", "benign"):
                done[position] = how
    return done, seen


def reconcile(analysis: TreeAnalysis, modules: list[ModuleInfo]) -> None:
    """Hold the analysis to the sweep: every call the sweep finds in
    ``modules`` handed the spec index or slots must be one the analysis
    accounted for; each other call makes its function an ``unknown`` site
    with a reason a user can act on (the worst status: ``apply`` refuses)."""
    vocab = Vocabulary.of(analysis.index.patchset)
    found: list[Reach] = []
    among: dict[Key, list[ast.Call]] = {}
    for m in modules:
        swept = sweep_module(m.key, m.tree, m.text, vocab)
        found += swept.reaches
        among.update(swept.calls)
    if not found:
        return
    wanted: dict[Key, set[Span]] = {}
    for r in found:
        wanted.setdefault(r.key, set()).add(r.position[1:])
    done, seen = accounted_positions(analysis, wanted, among)
    missed: dict[Key, list[tuple[Reach, str]]] = {}
    for r in found:
        how = done.get(r.position, "unknown")
        records = seen.get(r.position, [])
        plain = r.plain
        why = "unfollowed"
        if how == "unknown" and plain and records and all(_other_rows(c, plain) for c in records):
            how = "other-rows"
        elif r.kernel is not None and how.endswith(":callee"):
            # A kernel the analysis took for something else: its verdict on
            # the call is about the wrong thing.
            how, why = "unknown", "unresolved"
        how = how.removesuffix(":callee")
        analysis.swept.append((r, how))
        if how == "unknown":
            missed.setdefault(r.key, []).append((r, why))
    if not missed:
        return
    for key, reaches in missed.items():
        old = analysis.sites.get(key)
        if old is not None and old.status is Status.UNKNOWN:
            continue  # already refused, with its own reason
        reason = unfollowed_reason(reaches)
        calls = old.calls if old is not None else []
        flow = old.flow if old is not None else None
        analysis.sites[key] = SiteAnalysis(Status.UNKNOWN, reason, calls, flow)
        analysis.lines.setdefault(key, reaches[0][0].def_line)
    order = {m.key: i for i, m in enumerate(analysis.index.modules.values())}
    ranked = sorted(
        analysis.sites, key=lambda k: (order.get(k[0], len(order)), analysis.lines[k], k)
    )
    analysis.sites = {k: analysis.sites[k] for k in ranked}


# What a plain name the analysis traced holds when it is not the spec path's:
# another selection's slots or rows, every row, or None.
_OTHER = frozenset(
    {Prov.STATE_NONSPEC, Prov.IDX_NONSPEC, Prov.NONSPEC, Prov.ALL, Prov.IDX_ALL, Prov.NULL}
)


def _other_rows(record: CallRecord, plain: tuple[Argument, ...]) -> bool:
    """The analysis traced each of these arguments of ``record`` (plain names
    the sweep saw assigned the spec index or slots somewhere) to other values
    on every path that reaches the call: the sweep, blind to which assignment
    reaches, saw one that does not (``slots`` reassigned in another branch)."""
    positional = [vals for keyword, arg, vals in record.args if keyword is None and not arg.star]
    keywords = {keyword: vals for keyword, _, vals in record.args if keyword is not None}
    for keyword, position in plain:
        if keyword is not None:
            vals = keywords.get(keyword)
        else:
            vals = positional[position] if position < len(positional) else None
        if vals is None:
            return False
        live = {v.prov for v in vals if consistent(v.assume, record.path) is not None}
        if not live or not live <= _OTHER:
            return False
    return True


def unfollowed_reason(reaches: list[tuple[Reach, str]]) -> str:
    """Why a function whose calls the sweep found unaccounted is unknown:
    the first such call (a kernel first), what reaches it, what to do."""
    r, why = min(reaches, key=lambda rw: (rw[0].kernel is None, rw[0].line, rw[0].col))
    via = r.field if r.shape in (r.field, r.source) else f"{r.field} ({r.source})"
    head = f"{r.callee}(...) at line {r.line} receives {via} through {r.shape}, "
    if why == "unresolved":
        head += (
            f"and is the kernel {r.kernel} under a name the analysis does not resolve (it "
            "judged the call as an unknown callee's); "
        )
    else:
        head += "which the analysis does not follow; "
    if r.kernel is not None:
        advice = (
            "call the kernel by its name with its arguments written out (no ** or * "
            "unpacking, alias, partial, table or lambda around it) so its gate rows can "
            "be checked"
        )
    else:
        advice = (
            "if it runs a spec kernel, declare that kernel (.gdn-backport.toml, see "
            '"Forks" in the README) and call it with its arguments written out, else '
            "pass the value by name (name=value) so the analysis can follow it"
        )
    more = f" ({len(reaches) - 1} more such call(s) in this function)" if len(reaches) > 1 else ""
    return head + advice + more
