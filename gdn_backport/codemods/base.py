"""What every site codemod shares: find the sites, plan, rewrite, prove.

A strategy decides what to insert next to the assignments that select the
spec rows of q/k/v, and how to change the spec-kernel call (:meth:`SiteCodemod.
plan_call`). Everything else is here: the analysis of each candidate
function, the fail-closed rules, the edit itself, and the proof: the
rewritten module must compile and every rewritten site must analyse as
aligned, or the codemod fails and nothing is written.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, SkipFile

from gdn_backport import locate
from gdn_backport.analysis import SiteAnalysis, SpecCall, Status, analyse
from gdn_backport.dataflow import Def, Flow, _names_in, walk
from gdn_backport.patchset import Patchset, load
from gdn_backport.provenance import Prov, Val, consistent


class Refusal(Exception):
    """The codemod cannot prove a rewrite correct: the file stays as it is."""


Edit = Callable[[cst.CSTNode], cst.CSTNode]


@dataclass
class Plan:
    # id(statement) -> lines to insert after it
    inserts: dict[int, list[cst.SimpleStatementLine]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # id(original node) -> how to rebuild it from its updated self
    edits: dict[int, Edit] = field(default_factory=dict)


def code_of(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def live(vals: frozenset[Val], path: frozenset[tuple[str, bool]]) -> list[Val]:
    return [v for v in vals if consistent(v.assume, path) is not None]


def _latest(flow: Flow, defs: frozenset[int], name: str) -> int:
    """The last definition of ``name`` a value went through (-1: none)."""
    return max((i for i in defs if flow.defs[i].name == name), default=-1)


def _reads(expr: cst.BaseExpression | None, name: str) -> bool:
    return expr is not None and any(n.value == name for n in _names_in(expr))


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


@dataclass(frozen=True)
class Selection:
    """An assignment that picks the rows q/k/v reach the spec kernel with."""

    definition: Def
    kind: str  # "gather" (mixed branch) or "alias" (all rows: pure-spec path)


class Planner:
    """Where and under which names a strategy may add lines to one site."""

    def __init__(self, func: cst.FunctionDef, result: SiteAnalysis) -> None:
        assert result.flow is not None
        self.func = func
        self.flow = result.flow
        self.result = result
        self.taken = {n.value for n in _names_in(func)}
        self.blocks: dict[int, tuple[cst.IndentedBlock, int]] = {}
        self.fresh: dict[str, str] = {}
        for node in walk(func):
            if isinstance(node, cst.IndentedBlock):
                for i, stmt in enumerate(node.body):
                    self.blocks[id(stmt)] = (node, i)

    def defs_at(self, stmt: cst.CSTNode, name: str) -> set[int]:
        """The last definitions of ``name`` that may hold after ``stmt``."""
        env = self.flow.env_after.get(id(stmt), {})
        return {_latest(self.flow, v.defs, name) for v in env.get(name, frozenset())}

    def defs_at_call(self, call: SpecCall, vals: frozenset[Val], name: str) -> set[int]:
        return {_latest(self.flow, v.defs, name) for v in live(vals, call.record.path)}

    def anchor(self, stmt: cst.CSTNode, reads: list[str]) -> cst.CSTNode:
        """Where to insert after ``stmt``: the end of its run of selection
        lines (upstream's placement), if every name the new line reads still
        holds the same value there; else right after ``stmt``."""
        if id(stmt) not in self.blocks:
            raise Refusal("the spec gather is not on a line of its own")
        block, i = self.blocks[id(stmt)]
        end = i
        while end + 1 < len(block.body) and _is_selection(block.body[end + 1]):
            end += 1
        last = block.body[end]
        if all(self.defs_at(last, n) == self.defs_at(stmt, n) for n in reads):
            return last
        return stmt

    def selections(self, call: SpecCall) -> list[Selection]:
        """The assignments of the one variable that selects the spec rows of
        q/k/v: gathers (mixed branch) and aliases of all rows (fast path)."""
        q_param = next(iter(call.rows))
        vals = live(call.rows[q_param], call.record.path)
        closure = frozenset().union(*(v.defs for v in vals))
        gathers = [self.flow.defs[i] for i in sorted(closure) if self.flow.defs[i].gather]
        spec_vars = {d.name for d in gathers}
        if len(spec_vars) != 1:
            raise Refusal(
                "cannot find the one variable that gathers the spec rows of q/k/v"
                f" (found {sorted(spec_vars) or 'none'})"
            )
        var = spec_vars.pop()
        out: list[Selection] = []
        for i in sorted(closure):
            d = self.flow.defs[i]
            if d.name != var or (d.gather is None and _reads(d.value, var)):
                continue
            if d.gather is not None:
                out.append(Selection(d, "gather"))
            elif d.value is not None and not (
                isinstance(d.value, cst.Name) and d.value.value == "None"
            ):
                env = self.flow.env_after.get(id(d.stmt), {})
                provs = {v.prov for v in env.get(var, frozenset()) if i in v.defs}
                if provs != {Prov.ALL}:
                    raise Refusal(f"`{var}` is set from rows the analysis cannot name")
                out.append(Selection(d, "alias"))
        return out

    def new_name(self, base: str) -> str:
        """A name unused in the function, the same one for the same base."""
        if base not in self.fresh:
            name, n = base, 1
            while name in self.taken:
                n += 1
                name = f"{base}{n}"
            self.taken.add(name)
            self.fresh[base] = name
        return self.fresh[base]

    def insert(self, plan: Plan, after: Def, target: str, value: cst.BaseExpression) -> None:
        """Plan ``target = value`` after ``after``'s line (or its run)."""
        reads = sorted({n.value for n in _names_in(value)})
        anchor = self.anchor(after.stmt, reads)
        line = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(target))], value)])
        if not any(code_of(x) == code_of(line) for x in plan.inserts[id(anchor)]):
            plan.inserts[id(anchor)].append(line)


class _Rewriter(cst.CSTTransformer):
    def __init__(self, plan: Plan) -> None:
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

    def on_leave(
        self, original_node: cst.CSTNodeT, updated_node: cst.CSTNodeT
    ) -> cst.CSTNodeT | cst.RemovalSentinel | cst.FlattenSentinel[cst.CSTNodeT]:
        updated = super().on_leave(original_node, updated_node)
        edit = self.plan.edits.get(id(original_node))
        if edit is None or not isinstance(updated, cst.CSTNode):
            return updated
        self.applied.add(id(original_node))
        return edit(updated)  # type: ignore[return-value]


def site_functions(
    tree: cst.Module, patchset: Patchset, text: str | None = None
) -> tuple[dict[str, str], list[tuple[str, int, cst.FunctionDef]]]:
    """The module's imports and the functions worth analysing, in order.

    ``text`` is ``tree.code`` when the caller has it (generating it again
    costs as much as parsing)."""
    text = tree.code if text is None else text
    parsed = locate.parse_ast(Path("<module>"), text)
    wanted = {
        (c.qualname, c.occurrence)
        for c in locate.candidates(parsed, text.splitlines(keepends=True), patchset)
    }
    funcs = [f for f in locate.index_functions(tree) if (f[0], f[1]) in wanted]
    return locate.module_imports(parsed), funcs


class SiteCodemod(Codemod):
    """Rewrite every affected GDN spec site of a module, or fail closed."""

    DESCRIPTION: str = ""
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = ()
    UNCHANGED: ClassVar[tuple[str, ...]] = ()
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Constructor arguments the examples run with.
    EXAMPLE_ARGS: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        context: CodemodContext | None = None,
        source: str | None = None,
        tree: Path | None = None,
    ) -> None:
        super().__init__(context or CodemodContext())
        self.source = source  # the module's text, if the caller has it
        self.tree = tree  # the tree the module belongs to, if known
        self.rewritten: str | None = None  # the result's text, once proven

    def plan_call(self, planner: Planner, call: SpecCall, plan: Plan) -> None:
        """Add to ``plan`` what fixes one affected spec call."""
        raise NotImplementedError

    def finish(self, tree: cst.Module) -> cst.Module:
        """Last touches after the edits (e.g. imports); default none."""
        return tree

    def transform_module(self, tree: cst.Module) -> cst.Module:
        # No metadata is used: skip the MetadataWrapper's deep copy of the tree.
        return self.transform_module_impl(tree)

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        patchset = load()
        imports, funcs = site_functions(tree, patchset, self.source)
        plan = Plan()
        sites: set[tuple[str, int]] = set()
        for qual, occurrence, func in funcs:
            result = analyse(func, patchset, imports)
            if result is None or result.status in (Status.FIXED, Status.NOT_AFFECTED):
                continue
            if result.status is Status.UNKNOWN:
                raise Refusal(f"{qual}: {result.reason}")
            planner = Planner(func, result)
            try:
                for call in result.calls:
                    if call.status is Status.UNKNOWN:
                        raise Refusal(call.reason)
                    if call.status is Status.AFFECTED:
                        self.plan_call(planner, call, plan)
            except Refusal as exc:
                raise Refusal(f"{qual}: {exc}") from exc
            sites.add((qual, occurrence))
        if not sites:
            raise SkipFile("no affected GDN spec path")
        rewriter = _Rewriter(plan)
        new_tree = tree.visit(rewriter)
        if rewriter.applied != set(plan.inserts) | set(plan.edits):
            raise Refusal("some planned edits found no place in the tree")
        new_tree = self.finish(new_tree)
        self.rewritten = self._prove(new_tree, patchset, sites)
        return new_tree

    @staticmethod
    def _prove(tree: cst.Module, patchset: Patchset, sites: set[tuple[str, int]]) -> str:
        """Re-analyse the rewritten sites: each must now be aligned. Returns
        the rewritten text."""
        text = tree.code
        compile(locate.parse_ast(Path("<rewritten>"), text), "<rewritten>", "exec")
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
