"""Generic libcst node helpers: source text of a node, dotted names, a fast
walk over the nodes that carry code, the names an expression reads, how an
``index_select`` call binds its arguments, and where a call is in the source
(paired with the ``ast`` of the same code).

Nothing here knows about vLLM or the bug; the data flow, the locator, the
codemods and the corpus share these.
"""

from __future__ import annotations

import ast
import copyreg
import dataclasses
import io
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import libcst as cst

_EMPTY = cst.Module(body=[])


def code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


def dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr.value}" if inner else None
    return None


@dataclass(frozen=True)
class IndexSelect:
    """The arguments of ``x.index_select(dim, index)`` / ``torch.index_select(x, dim, index)``."""

    base: cst.BaseExpression | None
    dim: cst.BaseExpression | None
    index: cst.BaseExpression | None
    torch_form: bool  # called as torch.index_select(x, ...)


def index_select_parts(
    call: cst.Call, torch_names: Sequence[str] = ("torch",)
) -> IndexSelect | None:
    """How an ``index_select`` call binds its arguments, None for other calls."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "index_select"):
        return None
    pos = [a.value for a in call.args if a.keyword is None and not a.star]
    kw = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    if dotted(func.value) in torch_names:
        return IndexSelect(
            pos[0] if pos else kw.get("input"),
            pos[1] if len(pos) > 1 else kw.get("dim"),
            pos[2] if len(pos) > 2 else kw.get("index"),
            True,
        )
    return IndexSelect(
        func.value,
        pos[0] if pos else kw.get("dim"),
        pos[1] if len(pos) > 1 else kw.get("index"),
        False,
    )


_FIELDS: dict[type, tuple[str, ...]] = {}


def walk(node: cst.CSTNode, prune: type | tuple[type, ...] = ()) -> Iterator[cst.CSTNode]:
    """Every node below ``node`` (itself first), depth first, source order.

    Reads the dataclass fields directly: libcst's own visitor traversal
    rebuilds each node it passes, which made analysis several times slower.
    Nodes of a ``prune`` type are yielded but not entered.
    """
    stack: list[cst.CSTNode] = [node]
    while stack:
        current = stack.pop()
        yield current
        if prune and isinstance(current, prune):
            continue
        children = list(children_of(current))
        stack.extend(reversed(children))


def names_in(node: cst.CSTNode) -> list[cst.Name]:
    """Names read in ``node``: not an attribute's ``.attr``, not ``kw=`` keys."""
    nodes = list(walk(node))
    labels = {id(n.attr) for n in nodes if isinstance(n, cst.Attribute)}
    labels |= {id(n.keyword) for n in nodes if isinstance(n, cst.Arg) and n.keyword}
    return [n for n in nodes if isinstance(n, cst.Name) and id(n) not in labels]


# Fields that hold only layout (whitespace, comments, punctuation): about two
# thirds of a module's nodes, and nothing the analysis reads. Operators stay.
_LAYOUT_FIELDS = frozenset(
    {
        "newline", "first_line", "last_line", "empty_lines", "trailing_whitespace",
        "leading_lines", "lines_after_decorators", "header", "footer", "comment",
        "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace",
        "comma", "semicolon", "colon", "dot", "equal",
    }
)  # fmt: skip


def children_of(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """The node's children that carry code (layout-only fields skipped)."""
    kind = type(node)
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(
            f.name
            for f in dataclasses.fields(node)
            if f.name not in _LAYOUT_FIELDS and not f.name.startswith("whitespace")
        )
    for name in names:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, cst.CSTNode))


# --- where a libcst call is in the source ----------------------------------------

# Nodes whose dataclass fields are not in source order: the order their code is.
_SOURCE_ORDER: dict[type, tuple[str, ...]] = {
    cst.IfExp: ("body", "test", "orelse"),
    cst.FunctionDef: ("decorators", "params", "returns", "body"),
    cst.ClassDef: ("decorators", "bases", "keywords", "body"),
    cst.ExceptHandler: ("type", "name", "body"),
    cst.ExceptStarHandler: ("type", "name", "body"),
    cst.Parameters: ("posonly_params", "params", "star_arg", "kwonly_params", "star_kwarg"),
    cst.MatchCase: ("pattern", "guard", "body"),
}


def _in_source_order(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    stack: list[cst.CSTNode] = [node]
    while stack:
        current = stack.pop()
        yield current
        order = _SOURCE_ORDER.get(type(current))
        if order is None:
            children = list(children_of(current))
        else:
            children = []
            for name in order:
                value = getattr(current, name)
                if isinstance(value, cst.CSTNode):
                    children.append(value)
                elif isinstance(value, (list, tuple)):
                    children.extend(v for v in value if isinstance(v, cst.CSTNode))
        stack.extend(reversed(children))


def _cst_callee(func: cst.BaseExpression) -> str:
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute):
        return f"{_cst_callee(func.value)}.{func.attr.value}"
    return {cst.Call: "()", cst.Subscript: "[]", cst.Lambda: "lambda"}.get(type(func), "?")


def _ast_callee(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_ast_callee(func.value)}.{func.attr}"
    return {ast.Call: "()", ast.Subscript: "[]", ast.Lambda: "lambda"}.get(type(func), "?")


Span = tuple[int, int, int, int]  # (line, col, end line, end col), as ``ast`` counts

# ``ast`` fields that never hold code: contexts, operators, names as strings.
_AST_LEAVES = frozenset({"ctx", "op", "ops", "kind", "type_comment", "id", "arg", "attr"})
_AST_FIELDS: dict[type, tuple[str, ...]] = {}


def ast_fields(kind: type[ast.AST]) -> tuple[str, ...]:
    """The fields of an ``ast`` node type that may hold code."""
    names = _AST_FIELDS.get(kind)
    if names is None:
        names = _AST_FIELDS[kind] = tuple(f for f in kind._fields if f not in _AST_LEAVES)
    return names


def ast_children(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.iter_child_nodes`` without the leaves (a third of the nodes)."""
    for name in ast_fields(type(node)):
        value = getattr(node, name, None)
        if value.__class__ is list:
            yield from (v for v in value if isinstance(v, ast.AST))
        elif isinstance(value, ast.AST):
            yield value


def ast_walk(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` (depth first, not breadth first) without the leaves."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(ast_children(current))


def span(node: ast.expr) -> Span:
    """Where ``node`` starts and ends (``f(x)(y)`` and ``f(x)`` start alike)."""
    return (node.lineno, node.col_offset, node.end_lineno or 0, node.end_col_offset or 0)


def call_positions(node: cst.CSTNode, same: ast.AST) -> dict[int, Span]:
    """``id`` of each ``cst.Call`` below ``node`` -> the :data:`Span` of that
    call in ``same``, the ``ast`` of the same code (``ast``'s numbers: cols
    in UTF-8 bytes). Calls are paired in source order among those of one
    callee as written, so a parse of a function alone (libcst) pairs with
    the module's ``ast``; a callee whose calls do not pair up one for one
    is left out (its calls have no position)."""
    by_callee: dict[str, list[Span]] = {}
    for a in ast_walk(same):
        if isinstance(a, ast.Call):
            by_callee.setdefault(_ast_callee(a.func), []).append(span(a))
    mine: dict[str, list[cst.Call]] = {}
    for c in _in_source_order(node):
        if isinstance(c, cst.Call):
            mine.setdefault(_cst_callee(c.func), []).append(c)
    out: dict[int, Span] = {}
    for callee, calls in mine.items():
        # Source order; of two calls that start alike, the outer one first.
        theirs = sorted(by_callee.get(callee, ()), key=lambda w: (w[0], w[1], -w[2], -w[3]))
        if len(theirs) == len(calls):
            out.update((id(c), w) for c, w in zip(calls, theirs, strict=True))
    return out


def _cst_value(node: cst.BaseExpression) -> str:
    name = dotted(node)
    return "." if name is None or name in ("None", "True", "False") else name


def _ast_value(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _ast_value(node.value)
        return "." if inner == "." else f"{inner}.{node.attr}"
    return "."


def _cst_print(call: cst.Call) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """What ``_ast_print`` says of the same call: its callee, its positional
    arguments in order (``*x`` too), its keywords (``**x`` too) sorted."""
    pos, kws = [], []
    for a in call.args:
        value = _cst_value(a.value)
        if a.star == "**":
            kws.append(f"**{value}")
        elif a.keyword is not None:
            kws.append(f"{a.keyword.value}={value}")
        else:
            pos.append(f"{a.star}{value}")
    return _cst_callee(call.func), tuple(pos), tuple(sorted(kws))


def _ast_print(call: ast.Call) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    pos = [
        f"*{_ast_value(a.value)}" if isinstance(a, ast.Starred) else _ast_value(a)
        for a in call.args
    ]
    kws = [f"{'**' if k.arg is None else k.arg + '='}{_ast_value(k.value)}" for k in call.keywords]
    return _ast_callee(call.func), tuple(pos), tuple(sorted(kws))


def call_spans(
    calls: Sequence[cst.Call],
    node: cst.CSTNode,
    same: ast.AST,
    wanted: set[Span],
    among: Sequence[ast.Call] | None = None,
) -> dict[int, Span]:
    """``id`` of each of ``calls`` (calls below ``node``) that is one of the
    ``wanted`` calls of ``same`` (the ``ast`` of the same code) -> its span.

    :func:`call_positions` for a few calls, without a walk of ``node``: a
    call is paired by its print (callee, arguments' names and keywords) when
    one call of ``same`` alone has that print; where one does not, by
    :func:`call_positions`. ``among``: the calls of ``same`` any of
    ``calls`` can be (all of them unless given)."""
    found = among if among is not None else [a for a in ast_walk(same) if isinstance(a, ast.Call)]
    keys = {_ast_callee(a.func) for a in found if span(a) in wanted}
    prints: dict[tuple[str, tuple[str, ...], tuple[str, ...]], list[Span]] = {}
    for a in found:
        if _ast_callee(a.func) in keys:
            prints.setdefault(_ast_print(a), []).append(span(a))
    out: dict[int, Span] = {}
    for c in calls:
        if _cst_callee(c.func) not in keys:
            continue
        spans = prints.get(_cst_print(c), [])
        if len(spans) != 1:
            full = call_positions(node, same)
            return {id(c): full[id(c)] for c in calls if id(c) in full}
        out[id(c)] = spans[0]
    return out


# -- a node's pickle -------------------------------------------------------------
#
# libcst's own pickle (``add_slots``' ``__getstate__``) lists
# ``dataclasses.fields`` and asks ``hasattr`` per field of every node: 85 %
# of pickling a parsed function. A node handed between processes
# (``ahead.Feed``) is pickled with the same opcodes (``NEWOBJ``, then its
# state dict for libcst's own ``__setstate__``), its field names looked up
# once per class: byte for byte libcst's own pickle (tests/test_cst_nodes.py),
# read back by plain ``pickle.loads``. 0.17-0.36 s -> 0.09 s for the 32
# candidate functions of 0.33.0, in the child that feeds them.

_STATE_FIELDS: dict[type, tuple[str, ...] | None] = {}


def _state_fields(cls: type) -> tuple[str, ...] | None:
    if cls not in _STATE_FIELDS:
        _STATE_FIELDS[cls] = (
            tuple(f.name for f in dataclasses.fields(cls)) if issubclass(cls, cst.CSTNode) else None
        )
    return _STATE_FIELDS[cls]


class _NodePickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> Any:
        names = _state_fields(type(obj))
        if names is None:
            return NotImplemented
        state = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
        return copyreg.__newobj__, (type(obj),), state  # type: ignore[attr-defined]


def pickled(node: cst.CSTNode) -> bytes:
    """``node`` pickled as libcst's own pickle reads (``pickle.loads``)."""
    out = io.BytesIO()
    _NodePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(node)
    return out.getvalue()
