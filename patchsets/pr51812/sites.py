"""Every GDN spec site of a set of modules: entries, their walks, the sites.

A *candidate* is a function whose code names a spec-token field. The
candidates no other candidate calls are *entries*: each is walked with its
tensor parameters holding every row of the step, following the helpers it
calls (:mod:`gdn_backport.dataflow`); a candidate no walk reached is walked
as an entry of its own, so every one is looked at. The spec calls found are
grouped into sites by the function whose code the fix changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .analysis import SiteAnalysis, SpecCall, Walk, site_of, walk_entry
from .resolve import FunctionInfo, ModuleInfo, TreeIndex

Key = tuple[str, str, int]  # (module key, qualname, occurrence)


@dataclass
class TreeAnalysis:
    index: TreeIndex
    walks: list[tuple[FunctionInfo, Walk]] = field(default_factory=list)
    sites: dict[Key, SiteAnalysis] = field(default_factory=dict)
    lines: dict[Key, int] = field(default_factory=dict)  # the site function's def line

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
    return out
