"""What pr51565's codemods share: the facts of the tree a builder rule may
read, the walk over the methods that hold a site, and where the sites come
from (the plan's analysis of the tree, or the file's own).

A codemod rewrites the sites of its ``KIND`` it is handed and nothing else:
only the methods named by a site are walked (a runner module is 8,000
lines), functions nested in them are left alone, and a site the codemod
cannot find as a statement it knows refuses the whole file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, SkipFile

from gdn_backport.codemod import VisitorCommand
from gdn_backport.errors import Refusal
from gdn_backport.site import Status

from ..analysis import Finding, analyse_module
from ..config import Config, load

__all__ = ["TAG", "FindingCodemod", "InTree", "TreeFacts", "facts_of", "fresh", "used_names"]

# The first words of every comment the codemods write: the patched code names its fix.
TAG = "gdn-backport: vllm-project/vllm#51565"


@dataclass(frozen=True)
class TreeFacts:
    """What the tree's metadata class and split function offer the rule."""

    fields: frozenset[str]  # CommonAttentionMetadata's fields
    split_params: frozenset[str]
    replace_method: bool  # CommonAttentionMetadata.replace(...) exists


def facts_of(modules: Iterable[ast.Module], split: str) -> TreeFacts | None:
    """The fields of ``CommonAttentionMetadata`` and the parameters of the
    split function, from their definitions at the top of ``modules``; None
    if either is not found (several definitions: what all of them offer)."""
    fields: set[str] | None = None
    params: set[str] | None = None
    replace_method = True
    for module in modules:
        for node in module.body:
            if isinstance(node, ast.ClassDef) and node.name == "CommonAttentionMetadata":
                names = {
                    s.target.id
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                names |= {s.name for s in node.body if isinstance(s, ast.FunctionDef)}
                replace_method &= "replace" in names
                fields = names if fields is None else fields & names
            elif isinstance(node, ast.FunctionDef) and node.name == split:
                a = node.args
                have = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
                params = have if params is None else params & have
    if fields is None or params is None:
        return None
    return TreeFacts(frozenset(fields), frozenset(params), replace_method)


@dataclass(frozen=True)
class InTree:
    """What the plan knows of the module's tree: the module's sites to fix
    (runner verdicts settled over the tree's builders), the tree's facts,
    and the module's text."""

    findings: tuple[Finding, ...]
    facts: TreeFacts | None
    source: str
    # The module's ast where the codemod is run over its methods alone
    # (:mod:`.segments`): what it reads of the rest of the module.
    module: ast.Module | None = None


def used_names(nodes: Sequence[cst.CSTNode]) -> set[str]:
    out: set[str] = set()
    for node in nodes:
        out.update(n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name))
    return out


def fresh(base: str, used: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever ``used`` lacks (then taken)."""
    name, i = base, 1
    while name in used:
        name, i = f"{base}_{i}", i + 1
    used.add(name)
    return name


class FindingCodemod(VisitorCommand):
    """Fix the sites of one kind, as found by pr51565's analysis.

    ``within`` is the plan's view of the tree (:class:`InTree`). Without it
    (``python -m libcst.tool codemod``, the examples) the codemod analyses
    the file alone: every site of its kind the file holds is fixed, with
    the facts the file itself defines, and the rewrite must analyse as
    fixed before it is returned. Subclasses say what alone cannot see.
    """

    KIND: ClassVar[str]
    DESCRIPTION: str = ""
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = ()
    UNCHANGED: ClassVar[tuple[str, ...]] = ()
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = ()
    EXAMPLE_ARGS: ClassVar[dict[str, Any]] = {}
    # Schedules imports (``AddImportsVisitor``): run over its methods alone,
    # the module's head is needed too (:mod:`.segments`).
    IMPORTS: ClassVar[bool] = False

    def __init__(self, context: CodemodContext | None = None, within: InTree | None = None) -> None:
        super().__init__(context or CodemodContext())
        self.within = within
        self.cfg: Config = load()
        self.todo: dict[str, Finding] = {}
        self.done: set[str] = set()
        self.facts: TreeFacts | None = None
        self.source = ""
        self.scope = "the tree"
        self._classes: list[str] = []
        self._functions: list[cst.FunctionDef] = []

    def missing(self) -> str:
        """The statement a site is, for the refusal when it is not found."""
        raise NotImplementedError

    # -- the run ------------------------------------------------------------------

    def transform_module(self, tree: cst.Module) -> cst.Module:
        new = super().transform_module(tree)
        if self.within is None:
            self._prove(new)
        return new

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        within = self.within if self.within is not None else self._alone(tree)
        self.scope = "the tree" if self.within is not None else "this file (analysed alone)"
        self.facts, self.source = within.facts, within.source
        self.todo = {f.function: f for f in within.findings if f.kind == self.KIND}
        self.done = set()
        # An earlier run that refused mid-walk left its place behind.
        self._classes, self._functions = [], []
        if not self.todo:
            raise SkipFile(f"no {self.KIND} site to fix")
        new = super().transform_module_impl(tree)
        missed = sorted(set(self.todo) - self.done)
        if missed:
            raise Refusal(
                f"{missed[0]}: {self.missing()} is not a statement of the method's body this "
                "rewrite knows"
            )
        self.after_visit(tree)
        return new

    def after_visit(self, tree: cst.Module) -> None:
        """Schedule what the edits need (imports); default nothing."""

    def _alone(self, tree: cst.Module) -> InTree:
        text = tree.code
        parsed = ast.parse(text)
        mine = [f for f in analyse_module(parsed, text, self.cfg) if f.kind == self.KIND]
        for f in mine:
            if f.status is Status.UNKNOWN:
                raise Refusal(f"{f.function} (line {f.line}): {f.reason}")
        # Alone, a runner's route is affected while open: the tree's builders
        # are out of sight, and a guard without the builder fix costs only
        # the FULL graph of batches with a new row.
        todo = tuple(f for f in mine if f.status is Status.AFFECTED)
        return InTree(todo, facts_of([parsed], self.cfg.split), text)

    def _prove(self, new: cst.Module) -> None:
        """Alone, the rewrite compiles and each rewritten site now analyses fixed."""
        text = new.code
        try:
            parsed = ast.parse(text)
            compile(parsed, "<rewritten>", "exec")
        except SyntaxError as exc:
            raise Refusal(f"the rewrite does not compile: {exc}") from exc
        after = [f for f in analyse_module(parsed, text, self.cfg) if f.kind == self.KIND]
        for function in sorted(self.todo):
            now = [f for f in after if f.function == function]
            if not now or any(f.status is not Status.FIXED for f in now):
                why = "; ".join(f"{f.status.value}: {f.reason}" for f in now) or "gone"
                raise Refusal(f"{function}: the rewrite does not analyse as fixed ({why})")

    # -- the walk: only the methods with a site -------------------------------------

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node.name.value)

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        self._classes.pop()
        return updated_node

    def _qual(self, fn: cst.FunctionDef) -> str:
        return f"{self._classes[-1]}.{fn.name.value}" if self._classes else fn.name.value

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self._functions.append(node)
        return len(self._functions) == 1 and self._qual(node) in self.todo

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self._functions.pop()
        return updated_node

    def site(self) -> Finding | None:
        """The site of the method being walked (methods only, not functions
        nested in them)."""
        if len(self._functions) != 1:
            return None
        return self.todo.get(self._qual(self._functions[-1]))

    def method(self) -> cst.FunctionDef:
        return self._functions[-1]

    def fixed(self, site: Finding) -> None:
        self.done.add(site.function)

    @staticmethod
    def where(site: Finding) -> str:
        return f"{site.function} (line {site.line})"


def assignment(stmt: cst.BaseStatement) -> cst.Assign | None:
    """``stmt`` as a one-assignment line, else None."""
    if (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Assign)
    ):
        return stmt.body[0]
    return None


def call_name(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


def assigns_call(stmt: cst.BaseStatement, name: str) -> bool:
    """``stmt`` is ``<targets> = name(...)`` (or ``x.name(...)``)."""
    a = assignment(stmt)
    return a is not None and isinstance(a.value, cst.Call) and call_name(a.value.func) == name


def tight_equal() -> cst.AssignEqual:
    """``=`` of a keyword argument, as vLLM writes it (no spaces)."""
    return cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
    )
