"""What every site codemod shares: find the sites, plan, rewrite, prove.

A strategy decides what to insert next to the assignments that select the
spec rows of q/k/v, and how to change the spec-kernel call (:meth:`SiteCodemod.
plan_call`). Everything else is here: the analysis of the module's spec
paths (their helpers followed, in the module or elsewhere in the tree), the
fail-closed rules, the edit itself, and the proof: the rewritten module must
compile and every rewritten site must analyse as aligned, or the codemod
fails and nothing is written.

The fix goes where the rows are known: into the function that gathers the
spec rows of q/k/v. When the kernel sits in a helper below it, the gathered
gate is passed down the chain instead of the raw one, which needs every
helper in between to only forward the gate (read once, as the argument it
hands on); the helpers themselves are left untouched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import libcst as cst
from libcst.codemod import CodemodContext, SkipFile

from gdn_backport import files
from gdn_backport.codemod import Command
from gdn_backport.cst_nodes import children_of, code, names_in, walk
from gdn_backport.errors import Refusal
from gdn_backport.site import Status

from .. import locate
from ..analysis import SpecCall, Walk
from ..config import Patchset, for_tree
from ..dataflow import Def, Flow, Frame, Resolver
from ..provenance import Prov, Val, consistent
from ..resolve import ModuleInfo, TreeIndex
from ..sites import analyse_modules

__all__ = ["Plan", "Planner", "Refusal", "Rewrite", "SiteCodemod", "live", "where"]

# A site function: (module key, qualname, occurrence).
Key = tuple[str, str, int]


@dataclass(frozen=True)
class Rewrite:
    """What a codemod made of a module: the new text, the site functions it
    rewrote, and whether it proved them itself (else its caller must)."""

    text: str
    sites: frozenset[Key]
    proven: bool


Edit = Callable[[cst.CSTNode], cst.CSTNode]


# A node of a site function as the analysis saw it: (the function, id(node)).
# Functions of identical text may share parsed nodes, so the id alone is not
# enough to say which one an edit is for.
NodeRef = tuple[Key, int]


@dataclass
class Plan:
    # the statement -> lines to insert after it
    inserts: dict[NodeRef, list[cst.SimpleStatementLine]] = field(
        default_factory=lambda: defaultdict(list)
    )
    # the original node -> how to rebuild it from its updated self
    edits: dict[NodeRef, Edit] = field(default_factory=dict)
    # the statement -> statements to insert before it (a gate gathered right
    # before the kernel call, where the upstream placement cannot see the
    # value the call reads)
    before: dict[NodeRef, list[cst.BaseStatement]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def merge(self, other: Plan) -> None:
        """Add ``other``'s edits to this plan (lines already planned once)."""
        for ref, lines in other.inserts.items():
            have = self.inserts[ref]
            for line in lines:
                if not any(code(x) == code(line) for x in have):
                    have.append(line)
        for ref, statements in other.before.items():
            for statement in statements:
                add_before(self.before[ref], statement)
        self.edits.update(other.edits)


@dataclass
class _Bound:
    """A plan keyed by the ids of the nodes of the module being rewritten."""

    inserts: dict[int, list[cst.SimpleStatementLine]]
    edits: dict[int, Edit]
    before: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    # The functions rewritten, and the statements and blocks holding them:
    # every edit lies in one of the functions, so nothing else is visited.
    targets: frozenset[int] = frozenset()
    holders: frozenset[int] = frozenset()


def live(vals: frozenset[Val], path: frozenset[tuple[str, bool]]) -> list[Val]:
    return [v for v in vals if consistent(v.assume, path) is not None]


def where(call: SpecCall) -> str:
    """The site function, and the chain when the kernel sits below it."""
    assert call.select is not None
    if call.chained:
        return f"{call.select.qualname} ({' -> '.join(call.via)})"
    return call.select.qualname


def _reads(expr: cst.BaseExpression | None, name: str) -> bool:
    return expr is not None and any(n.value == name for n in names_in(expr))


def _is_selection(stmt: cst.BaseStatement) -> bool:
    """A line like the ones upstream puts its gate gathers after: plain
    assignments of a name, ``None``, a slice or an ``index_select``."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    if not isinstance(small, cst.Assign):
        return False
    value = small.value
    if isinstance(value, cst.Tuple):
        # ``a_g, b_g = a, b`` / ``= a[i], b[i]``: one selection per name.
        return all(_selects(e.value) for e in value.elements)
    return _selects(value)


def _selects(value: cst.BaseExpression) -> bool:
    if isinstance(value, cst.Call):
        func = value.func
        return isinstance(func, cst.Attribute) and func.attr.value == "index_select"
    return isinstance(value, (cst.Name, cst.Subscript, cst.Attribute))


@dataclass(frozen=True)
class Selection:
    """An assignment that picks the rows q/k/v reach the spec kernel with."""

    definition: Def
    kind: str  # "gather" (mixed branch) or "alias" (all rows: pure-spec path)


@dataclass
class Names:
    """The names of one function, and those the rewrite adds to it."""

    taken: set[str]
    fresh: dict[str, str] = field(default_factory=dict)


class Planner:
    """Where and under which names a strategy may add lines to one site:
    the function of ``frame`` (the one that gathers the spec rows), as one
    walk (``flow``) saw it."""

    def __init__(self, func: cst.FunctionDef, flow: Flow, frame: Frame, names: Names) -> None:
        self.func = func
        self.flow = flow
        self.frame = frame
        self.names = names
        self.blocks: dict[int, tuple[cst.IndentedBlock, int]] = {}
        for node in walk(func):
            if isinstance(node, cst.IndentedBlock):
                for i, stmt in enumerate(node.body):
                    self.blocks[id(stmt)] = (node, i)
        self._parent: dict[int, cst.CSTNode] | None = None

    def ancestors(self, node: cst.CSTNode) -> list[cst.CSTNode]:
        """The nodes of this function holding ``node``, innermost first."""
        if self._parent is None:
            parent: dict[int, cst.CSTNode] = {}
            stack: list[cst.CSTNode] = [self.func]
            while stack:
                current = stack.pop()
                for child in children_of(current):
                    parent[id(child)] = current
                    stack.append(child)
            self._parent = parent
        out = []
        current = node
        while id(current) in self._parent:
            current = self._parent[id(current)]
            out.append(current)
        return out

    def gather_before_call(
        self,
        plan: Plan,
        call: SpecCall,
        name: str,
        new: str,
        gate_line: Callable[[Selection], cst.SimpleStatementLine],
    ) -> None:
        """Plan the gate's selection right before the kernel call's line: the
        selection of the q/k/v rows repeated (the ``if`` that chose them, its
        tests as written, each arm's line for the gate), for a gate staged
        after the q/k/v rows were chosen (``a_in = None ... if a_in is None:
        a_in = a.contiguous()``), where the line after the q/k/v selection
        cannot see the value the call reads. The tests must read what they
        read where they were written; the proof of the rewrite holds every
        path to that."""
        reassigned = f"`{name}` is reassigned between the spec gather and the kernel call"
        if call.record.frame != self.frame.id:
            raise Refusal(f"{reassigned}, which sits in a helper")
        holders = self.ancestors(call.record.node)
        stmt = next((n for n in holders if id(n) in self.blocks), None)
        if stmt is None:
            raise Refusal(f"{reassigned}, and the call is not on a line of its own")
        selections = self.selections(call)
        if not selections:
            raise Refusal(reassigned)
        lines = {id(sel.definition.stmt): sel for sel in selections}
        reads: set[str] = set()
        if len(selections) == 1 and selections[0].kind == "gather":
            structure: cst.BaseStatement = gate_line(selections[0])
        else:
            shared = None
            for sel in selections:
                ifs = [n for n in self.ancestors(sel.definition.stmt)
                       if isinstance(n, cst.If) and id(n) in self.blocks]  # fmt: skip
                ids = {id(n) for n in ifs}
                shared = ifs if shared is None else [n for n in shared if id(n) in ids]
            if not shared:
                raise Refusal(f"{reassigned}, and the spec rows are not chosen by one `if`")
            choice = shared[0]
            if any(n is choice for n in holders):
                raise Refusal(f"{reassigned}, inside the `if` that chooses the spec rows")
            structure = _repeat(choice, lines, gate_line, reads)
        for sel in selections:
            here = sel.definition.stmt
            for n in sorted(reads | {m.value for m in names_in(gate_line(sel))} - {name, new}):
                if self.defs_at(here, n) != self.defs_at(stmt, n):
                    raise Refusal(
                        f"{reassigned}, and `{n}` changes before the call: the spec rows "
                        "cannot be chosen again there"
                    )
        add_before(plan.before[self.ref(stmt)], structure)

    def _latest(self, defs: frozenset[int], name: str) -> int:
        """The last definition of ``name`` in this frame a value went through."""
        return max(
            (
                i
                for i in defs
                if self.flow.defs[i].name == name and self.flow.defs[i].frame == self.frame.id
            ),
            default=-1,
        )

    def defs_at(self, stmt: cst.CSTNode, name: str) -> set[int]:
        """The last definitions of ``name`` that may hold after ``stmt``."""
        key = (self.frame.id, id(stmt))
        env = self.flow.env_after.get(key, {})
        path = self.flow.path_at.get(key, frozenset())
        return {self._latest(v.defs, name) for v in live(env.get(name, frozenset()), path)}

    def defs_at_call(self, call: SpecCall, vals: frozenset[Val], name: str) -> set[int]:
        return {self._latest(v.defs, name) for v in live(vals, call.record.path)}

    def gate_defs(
        self, call: SpecCall, vals: frozenset[Val], name: str, stmt: cst.CSTNode
    ) -> set[int]:
        """The definitions of ``name`` the call sees on the paths through ``stmt``."""
        path = consistent(
            call.record.path, self.flow.path_at.get((self.frame.id, id(stmt)), frozenset())
        )
        if path is None:
            return set()
        return {self._latest(v.defs, name) for v in live(vals, path)}

    def anchor(
        self,
        stmt: cst.CSTNode,
        reads: list[str],
        expect: dict[str, tuple[SpecCall, frozenset[Val]]] | None = None,
    ) -> cst.CSTNode:
        """Where to insert after ``stmt``: the last line of its run of
        selection lines (upstream's placement) where every name the new line
        reads holds the value it has at ``stmt`` (or, for a name in
        ``expect``, the value the kernel call sees)."""
        if id(stmt) not in self.blocks:
            raise Refusal("the spec gather is not on a line of its own")
        expect = expect or {}
        block, i = self.blocks[id(stmt)]
        end = i
        while end + 1 < len(block.body) and _is_selection(block.body[end + 1]):
            end += 1
        base = {n: self.defs_at(stmt, n) for n in reads if n not in expect}
        for j in range(end, i - 1, -1):
            here = block.body[j]
            if all(self.defs_at(here, n) == want for n, want in base.items()) and all(
                self.defs_at(here, n) == self.gate_defs(call, vals, n, here)
                for n, (call, vals) in expect.items()
            ):
                return here
        name = next(iter(expect), reads[0] if reads else "a name")
        raise Refusal(f"`{name}` is reassigned between the spec gather and the kernel call")

    def selections(self, call: SpecCall) -> list[Selection]:
        """The assignments of the one variable that selects the spec rows of
        q/k/v: gathers (mixed branch) and aliases of all rows (fast path)."""
        q_param = next(iter(call.rows))
        vals = live(call.rows[q_param], call.record.path)
        closure = frozenset().union(*(v.defs for v in vals))
        mine = [self.flow.defs[i] for i in sorted(closure)]
        mine = [d for d in mine if d.frame == self.frame.id]
        gathers = [d for d in mine if d.gather is not None]
        spec_vars = {d.name for d in gathers}
        if len(spec_vars) != 1:
            raise Refusal(
                "cannot find the one variable that gathers the spec rows of q/k/v"
                f" (found {sorted(spec_vars) or 'none'})"
            )
        var = spec_vars.pop()
        out: list[Selection] = []
        for d in mine:
            if d.name != var or (d.gather is None and _reads(d.value, var)):
                continue
            if d.gather is not None:
                out.append(Selection(d, "gather"))
            elif d.value is not None and not (
                isinstance(d.value, cst.Name) and d.value.value == "None"
            ):
                env = self.flow.env_after.get((self.frame.id, id(d.stmt)), {})
                provs = {v.prov for v in env.get(var, frozenset()) if d.id in v.defs}
                if provs != {Prov.ALL}:
                    raise Refusal(f"`{var}` is set from rows the analysis cannot name")
                out.append(Selection(d, "alias"))
        return out

    def passed_arg(self, call: SpecCall, arg: cst.Arg) -> cst.Arg:
        """The argument of this frame's function that reaches the kernel as
        ``arg``: ``arg`` itself when the kernel is called here, else the one
        handed down the chain, through helpers that only forward it."""
        chain = call.chain
        here = next(i for i, f in enumerate(chain) if f.id == self.frame.id)
        for helper in reversed(chain[here + 1 :]):
            value = arg.value
            if not (isinstance(value, cst.Name) and value.value in helper.bindings):
                raise Refusal(
                    f"{helper.qualname} does not hand its caller's gate straight on "
                    f"(it passes {code(arg.value)})"
                )
            param = value.value
            uses = [n for n in names_in(helper.func.body) if n.value == param]
            if len(uses) != 1:
                raise Refusal(
                    f"{helper.qualname} uses its parameter `{param}` beyond passing it to "
                    "the kernel: the gate its caller passes cannot be changed"
                )
            arg = helper.bindings[param]
        return arg

    def new_name(self, base: str) -> str:
        """A name unused in the function, the same one for the same base."""
        names = self.names
        if base not in names.fresh:
            name, n = base, 1
            while name in names.taken:
                n += 1
                name = f"{base}{n}"
            names.taken.add(name)
            names.fresh[base] = name
        return names.fresh[base]

    def insert(
        self,
        plan: Plan,
        after: Def,
        target: str,
        value: cst.BaseExpression,
        expect: dict[str, tuple[SpecCall, frozenset[Val]]] | None = None,
    ) -> None:
        """Plan ``target = value`` after ``after``'s line (or its run);
        ``expect``: names that must hold there what the kernel call sees."""
        reads = sorted({n.value for n in names_in(value)})
        anchor = self.anchor(after.stmt, reads, expect)
        line = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(target))], value)])
        lines = plan.inserts[self.ref(anchor)]
        if not any(code(x) == code(line) for x in lines):
            lines.append(line)

    def ref(self, node: cst.CSTNode) -> NodeRef:
        """``node`` of this site's function, as a plan names it."""
        return (self.frame.key, id(node))


def _repeat(
    choice: cst.If,
    lines: dict[int, Selection],
    gate_line: Callable[[Selection], cst.SimpleStatementLine],
    reads: set[str],
) -> cst.If:
    """``choice`` with each selection line replaced by the gate's, every other
    line left out, its tests as written (their names added to ``reads``)."""

    def block(body: cst.BaseSuite) -> cst.IndentedBlock:
        if not isinstance(body, cst.IndentedBlock):
            raise Refusal("the `if` that chooses the spec rows is written on one line")
        out: list[cst.BaseStatement] = []
        for stmt in body.body:
            if id(stmt) in lines:
                out.append(gate_line(lines[id(stmt)]))
            elif isinstance(stmt, cst.If):
                inner = arm(stmt)
                if any(id(n) in lines for n in walk(stmt)):
                    out.append(inner)
            elif any(id(n) in lines for n in walk(stmt)):
                raise Refusal("the spec rows are chosen inside a loop, `with` or `try`")
        return body.with_changes(body=out or [cst.SimpleStatementLine([cst.Pass()])])

    def arm(node: cst.If) -> cst.If:
        test = node.test
        if any(isinstance(n, (cst.Call, cst.NamedExpr, cst.Await)) for n in walk(test)):
            raise Refusal(
                f"the test `{code(test)}` that chooses the spec rows calls a function: "
                "it cannot be repeated before the kernel call"
            )
        reads.update(n.value for n in names_in(test))
        orelse = node.orelse
        if isinstance(orelse, cst.If):
            new_else: cst.If | cst.Else | None = arm(orelse)
        elif isinstance(orelse, cst.Else):
            new_else = orelse.with_changes(body=block(orelse.body), leading_lines=[])
        else:
            new_else = None
        return node.with_changes(body=block(node.body), orelse=new_else, leading_lines=[])

    return arm(choice)


def add_before(have: list[cst.BaseStatement], structure: cst.BaseStatement) -> None:
    """Add ``structure`` to the lines planned before one statement: once, and
    an ``if`` of the same tests as a planned one joined with it."""
    for i, x in enumerate(have):
        if code(x) == code(structure):
            return
        if (
            isinstance(x, cst.If)
            and isinstance(structure, cst.If)
            and _shape(x) == _shape(structure)
        ):
            have[i] = _zip(x, structure)  # one `if` for both gates
            return
    have.append(structure)


def _shape(node: cst.CSTNode) -> object:
    """An ``if`` built by :func:`_repeat` without its gate lines' text."""
    if isinstance(node, cst.If):
        orelse = node.orelse
        rest = _shape(orelse) if orelse is not None else None
        return ("if", code(node.test), _shape(node.body), rest)
    if isinstance(node, cst.Else):
        return ("else", _shape(node.body))
    if isinstance(node, cst.IndentedBlock):
        return tuple(_shape(s) for s in node.body)
    return "line"


def _zip(left: cst.If, right: cst.If) -> cst.If:
    """Two ``if``s of one :func:`_shape`, their lines side by side."""

    def block(x: cst.BaseSuite, y: cst.BaseSuite) -> cst.BaseSuite:
        assert isinstance(x, cst.IndentedBlock) and isinstance(y, cst.IndentedBlock)
        out: list[cst.BaseStatement] = []
        for a, b in zip(x.body, y.body, strict=True):
            if isinstance(a, cst.If) and isinstance(b, cst.If):
                out.append(_zip(a, b))
            elif code(a) == code(b):
                out.append(a)  # ``pass``
            else:
                out.extend([a, b])
        return x.with_changes(body=out)

    orelse = left.orelse
    other = right.orelse
    if isinstance(orelse, cst.If) and isinstance(other, cst.If):
        new_else: cst.If | cst.Else | None = _zip(orelse, other)
    elif isinstance(orelse, cst.Else) and isinstance(other, cst.Else):
        new_else = orelse.with_changes(body=block(orelse.body, other.body))
    else:
        new_else = orelse
    return left.with_changes(body=block(left.body, right.body), orelse=new_else)


class _Rewriter(cst.CSTTransformer):
    def __init__(self, plan: _Bound) -> None:
        self.plan = plan
        self.applied: set[int] = set()
        self._inside = 0  # how many rewritten functions the visit is in

    def on_visit(self, node: cst.CSTNode) -> bool:
        plan = self.plan
        if id(node) in plan.targets:
            self._inside += 1
        elif (
            not self._inside
            and plan.targets
            and isinstance(node, cst.BaseStatement)
            and id(node) not in plan.holders
        ):
            return False  # a statement holding no rewritten function stays as it is
        return super().on_visit(node)

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        plan = self.plan
        if not any(id(s) in plan.inserts or id(s) in plan.before for s in original_node.body):
            return updated_node
        body: list[cst.BaseStatement] = []
        for orig, upd in zip(original_node.body, updated_node.body, strict=True):
            if id(orig) in plan.before:
                # Above the statement and its own comments (its leading
                # lines belong to it and stay with it).
                body.extend(plan.before[id(orig)])
                self.applied.add(id(orig))
            body.append(upd)
            if id(orig) in self.plan.inserts:
                body.extend(self.plan.inserts[id(orig)])
                self.applied.add(id(orig))
        return updated_node.with_changes(body=body)

    def on_leave(
        self, original_node: cst.CSTNodeT, updated_node: cst.CSTNodeT
    ) -> cst.CSTNodeT | cst.RemovalSentinel | cst.FlattenSentinel[cst.CSTNodeT]:
        updated = super().on_leave(original_node, updated_node)
        if id(original_node) in self.plan.targets:
            self._inside -= 1
        edit = self.plan.edits.get(id(original_node))
        if edit is None or not isinstance(updated, cst.CSTNode):
            return updated
        self.applied.add(id(original_node))
        return edit(updated)  # type: ignore[return-value]


def _holders(tree: cst.Module, targets: frozenset[int]) -> frozenset[int]:
    """The ids of the nodes on the way from ``tree`` to each of ``targets``
    (compound statements, classes and functions among them, and blocks)."""
    out: set[int] = set()

    def visit(node: cst.CSTNode) -> bool:
        found = False
        for child in children_of(node):
            if id(child) in targets:
                found = True
            elif isinstance(child, locate.BLOCKS) and visit(child):
                out.add(id(child))
                found = True
        return found

    visit(tree)
    return frozenset(out)


def _onto(plan: Plan, tree: cst.Module, funcs: dict[Key, cst.FunctionDef]) -> _Bound:
    """``plan`` keyed by the nodes of ``tree``.

    The analysis may have walked each function parsed on its own (scan does,
    for speed); the same function in the whole module's parse has the same
    shape, so its nodes pair off in walk order (where the function is
    ``tree``'s own node, each pairs with itself).
    """
    own = {(q, o): f for q, o, f in locate.index_functions(tree)}
    moved: dict[NodeRef, int] = {}
    for key, func in funcs.items():
        target = own.get(key[1:])
        if target is None:
            raise Refusal(f"{key[1]} is not in the module being rewritten")
        pairs = list(zip(walk(func), walk(target), strict=False))
        if len(pairs) != sum(1 for _ in walk(target)) or any(
            type(a) is not type(b) for a, b in pairs
        ):
            raise Refusal(f"{key[1]}: the module's parse differs from the analysed one")
        moved.update(((key, id(a)), id(b)) for a, b in pairs)
    targets = frozenset(id(own[key[1:]]) for key in funcs)
    try:
        return _Bound(
            {moved[ref]: lines for ref, lines in plan.inserts.items()},
            {moved[ref]: edit for ref, edit in plan.edits.items()},
            {moved[ref]: lines for ref, lines in plan.before.items()},
            targets,
            _holders(tree, targets),
        )
    except KeyError as exc:
        raise Refusal("a planned edit lies outside the functions it rewrites") from exc


class SiteCodemod(Command):
    """Rewrite every affected GDN spec site of a module, or fail closed.

    ``apply`` hands it the tree's analysis (``walks``): the plan comes from
    there, helpers in other files included, and ``apply`` proves the whole
    tree afterwards. Without one (``python -m libcst.tool codemod``, the
    examples, the runtime plugin) it analyses the module alone: helpers are
    followed within the file only (a call into another module is a callee
    it does not know, so such a site is refused rather than guessed), and it
    proves its own rewrite (compiled, every rewritten site aligned)."""

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
        path: Path | None = None,
        patchset: Patchset | None = None,
        resolver: Resolver | None = None,
        walks: Sequence[Walk] | None = None,
        module_key: str | None = None,
    ) -> None:
        """``source``: the module's text, if the caller has it; ``tree``: the
        tree it belongs to and ``path`` its file there (its helpers are
        followed into the tree); ``resolver``: where calls go that the tree
        does not resolve (a live process's objects).

        ``walks`` (with ``module_key``): the caller's analysis of the tree;
        the plan comes from it (its nodes are carried over onto the module
        this codemod is given, function by function) and the caller proves
        the result (apply proves the whole tree at once). Without, the
        codemod analyses the module itself and proves its own rewrite."""
        super().__init__(context or CodemodContext())
        self.source = source
        self.tree = tree
        self.path = path
        self.patchset = patchset
        self.resolver = resolver
        self.walks = list(walks) if walks is not None else None
        self.module_key = module_key
        self.result: Rewrite | None = None
        self._sites: set[Key] = set()

    def plan_call(self, planner: Planner, call: SpecCall, plan: Plan) -> None:
        """Add to ``plan`` what fixes one affected spec call."""
        raise NotImplementedError

    def transform_module(self, tree: cst.Module) -> cst.Module:
        self.result = None
        self._sites = set()
        # The edits (transform_module_impl), then the imports they scheduled.
        new_tree = super().transform_module(tree)
        text = new_tree.code
        alone = self.walks is None
        if alone:
            self._prove(text, self._sites)
        self.result = Rewrite(text, frozenset(self._sites), proven=alone)
        return new_tree

    def _patchset(self) -> Patchset:
        if self.patchset is None:
            self.patchset = for_tree(self.tree)
        return self.patchset

    def _index(self, text: str, overrides: dict[Path, str] | None) -> tuple[TreeIndex, ModuleInfo]:
        index = TreeIndex(self.tree, self._patchset(), overrides, self.resolver)
        if self.path is not None and self.tree is not None:
            return index, index.add(self.path, text)
        return index, index.add_text("<module>", text)

    def rewrite(self, tree: cst.Module) -> Rewrite | None:
        """Rewrite ``tree``: the result, or None where nothing is affected.
        Refusal when the rewrite cannot be planned (or, analysing alone,
        proven)."""
        try:
            self.transform_module(tree)
        except SkipFile:
            return None
        return self.result

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if self.walks is not None:
            assert self.module_key is not None, "walks come with their module's key"
            walks, key = self.walks, self.module_key
        else:
            text = tree.code if self.source is None else self.source
            index, module = self._index(text, None)
            module.use_tree(tree)
            walks = [w for _, w in analyse_modules(index, [module]).walks]
            key = module.key
        plan = Plan()
        planners: dict[tuple[int, int], Planner] = {}
        names: dict[Key, Names] = {}
        sites: set[tuple[str, str, int]] = set()
        for w in walks:
            for call in w.calls:
                select = call.select
                assert select is not None
                if select.key[0] != key or call.status in (
                    Status.FIXED,
                    Status.NOT_AFFECTED,
                ):
                    continue
                if call.status is Status.UNKNOWN:
                    raise Refusal(f"{where(call)}: {call.reason}")
                func = select.func
                planner = planners.get((id(w.flow), select.id))
                if planner is None:
                    shared = names.setdefault(select.key, Names({n.value for n in names_in(func)}))
                    planner = planners[(id(w.flow), select.id)] = Planner(
                        func, w.flow, select, shared
                    )
                try:
                    self.plan_call(planner, call, plan)
                except Refusal as exc:
                    raise Refusal(f"{where(call)}: {exc}") from exc
                sites.add(select.key)
        if not sites:
            raise SkipFile("no affected GDN spec path")
        bound = _onto(plan, tree, {p.frame.key: p.func for p in planners.values()})
        rewriter = _Rewriter(bound)
        new_tree = tree.visit(rewriter)
        if rewriter.applied != set(bound.inserts) | set(bound.edits) | set(bound.before):
            raise Refusal("some planned edits found no place in the tree")
        self._sites = sites
        return new_tree

    def _prove(self, text: str, sites: set[Key]) -> None:
        """Walk the rewritten module's spec paths again: every rewritten
        site must now be aligned."""
        compile(files.parse_ast(Path("<rewritten>"), text), "<rewritten>", "exec")
        overrides = {self.path: text} if self.path is not None and self.tree is not None else None
        index, module = self._index(text, overrides)
        seen = set()
        for _, w in analyse_modules(index, [module]).walks:
            for call in w.calls:
                assert call.select is not None
                if call.select.key not in sites:
                    continue
                seen.add(call.select.key)
                if call.status not in (Status.FIXED, Status.NOT_AFFECTED):
                    raise Refusal(
                        f"{where(call)}: the rewrite does not prove aligned "
                        f"({call.status.value}: {call.reason})"
                    )
        if seen != sites:
            raise Refusal("a rewritten site disappeared from the analysis")
