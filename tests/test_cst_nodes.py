"""cst_nodes.py: node text, dotted names, the fast walks, index_select, call positions,
a node's pickle."""

from __future__ import annotations

import ast
import pickle

import libcst as cst
import pytest

from gdn_backport import cst_nodes
from gdn_backport.cst_nodes import IndexSelect, code, dotted, index_select_parts


def _expr(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


def _call(text: str) -> cst.Call:
    node = _expr(text)
    assert isinstance(node, cst.Call)
    return node


def test_code_and_dotted() -> None:
    assert code(_expr("a.b( c ,d)")) == "a.b( c ,d)"
    assert dotted(_expr("a.b.c")) == "a.b.c"
    assert dotted(_expr("a")) == "a"
    assert dotted(_expr("a().b")) is None
    assert dotted(_expr("a[0].b")) is None


def test_index_select_binds_positional_and_keyword_arguments() -> None:
    parts = index_select_parts(_call("x.index_select(0, idx)"))
    assert parts is not None and not parts.torch_form
    assert [code(p) for p in (parts.base, parts.dim, parts.index) if p] == ["x", "0", "idx"]
    parts = index_select_parts(_call("torch.index_select(x, dim=1, index=i)"))
    assert parts is not None and parts.torch_form
    assert [code(p) for p in (parts.base, parts.dim, parts.index) if p] == ["x", "1", "i"]
    parts = index_select_parts(_call("th.index_select(x, 0, i)"), torch_names=("th",))
    assert parts is not None and parts.torch_form
    bare = index_select_parts(_call("x.index_select()"))
    assert bare is not None and bare.base is not None and code(bare.base) == "x"
    assert (bare.dim, bare.index, bare.torch_form) == (None, None, False)
    assert isinstance(bare, IndexSelect)
    assert index_select_parts(_call("x.gather(0, i)")) is None
    assert index_select_parts(_call("index_select(x, 0, i)")) is None


def test_walk_is_depth_first_in_source_order_and_prunes() -> None:
    node = _expr("f(a, g(b), c)")
    names = [n.value for n in cst_nodes.walk(node) if isinstance(n, cst.Name)]
    assert names == ["f", "a", "g", "b", "c"]
    pruned = [n.value for n in cst_nodes.walk(node, prune=cst.Call) if isinstance(n, cst.Name)]
    assert pruned == []  # the top call itself is yielded, not entered
    inner = [n for n in cst_nodes.walk(node) if isinstance(n, cst.Call)]
    assert [code(c) for c in inner] == ["f(a, g(b), c)", "g(b)"]
    # No layout node (whitespace, commas) is walked.
    assert not any(isinstance(n, (cst.Comma, cst.SimpleWhitespace)) for n in cst_nodes.walk(node))


def test_names_in_leaves_out_attribute_labels_and_keywords() -> None:
    node = _expr("f(x.attr, key=y, **z)[w]")
    assert [n.value for n in cst_nodes.names_in(node)] == ["f", "x", "y", "z", "w"]


def test_ast_walk_finds_what_ast_walk_finds_without_the_leaves() -> None:
    tree = ast.parse("def f(a):\n    return g(a.b, k=c) + 1\n")
    mine = {type(n).__name__ for n in cst_nodes.ast_walk(tree)}
    theirs = {type(n).__name__ for n in ast.walk(tree)}
    assert {"Call", "Attribute", "keyword", "Constant", "BinOp"} <= mine
    assert mine <= theirs and "Load" not in mine and "Add" not in mine
    # Depth first (not source order): every name once.
    found = sorted(n.id for n in cst_nodes.ast_walk(tree) if isinstance(n, ast.Name))
    assert found == ["a", "c", "g"]


_SRC = "def f(x):\n    a = k(x)\n    b = k(y)\n    return h(k(x), z=1)\n"


def _pair() -> tuple[cst.Module, ast.Module, list[cst.Call]]:
    module = cst.parse_module(_SRC)
    calls = [n for n in cst_nodes.walk(module) if isinstance(n, cst.Call)]
    return module, ast.parse(_SRC), calls


def test_call_positions_pair_each_call_with_its_ast_span() -> None:
    module, tree, calls = _pair()
    got = cst_nodes.call_positions(module, tree)
    assert [(code(c), got[id(c)]) for c in calls] == [
        ("k(x)", (2, 8, 2, 12)),
        ("k(y)", (3, 8, 3, 12)),
        ("h(k(x), z=1)", (4, 11, 4, 23)),
        ("k(x)", (4, 13, 4, 17)),
    ]


def test_call_positions_leave_out_a_callee_whose_calls_do_not_pair_up() -> None:
    module, _, calls = _pair()
    other = ast.parse("def f(x):\n    a = k(x)\n    return h(q)\n")
    got = cst_nodes.call_positions(module, other)
    assert {code(c) for c in calls if id(c) in got} == {"h(k(x), z=1)"}


def test_call_spans_pair_by_print_and_fall_back_to_positions() -> None:
    module, tree, calls = _pair()
    k_y = calls[1]
    assert cst_nodes.call_spans([k_y], module, tree, {(3, 8, 3, 12)}) == {id(k_y): (3, 8, 3, 12)}
    # k(x) prints alike twice: paired by position instead.
    first, last = calls[0], calls[3]
    wanted = {(2, 8, 2, 12), (4, 13, 4, 17)}
    assert cst_nodes.call_spans([first, last], module, tree, wanted) == {
        id(first): (2, 8, 2, 12),
        id(last): (4, 13, 4, 17),
    }
    # A call whose callee is not wanted gets no span.
    assert cst_nodes.call_spans([calls[2]], module, tree, {(3, 8, 3, 12)}) == {}


_PICKLED = [
    "def f(a, /, b: int = 1, *c, d, **e) -> None:\n    return a[b:c, ...] @ d\n",
    "class C(B, metaclass=M):\n    @dec(x)\n    async def g(self):\n"
    "        async with a as b, c:\n            yield f'{x!r:>{w}}'\n",
    "if x:  # comment\n    y = (lambda *a: a)(1,)\nelif z := w:\n    pass\nelse:\n    del q\n",
    "try:\n    import a.b as c\nexcept* E as e:\n    raise\nfinally:\n    x: list[int] = []\n",
]


@pytest.mark.parametrize("text", _PICKLED)
def test_a_nodes_pickle_is_libcsts_own_byte_for_byte(text: str) -> None:
    # Byte-equal to libcst's own pickle: whatever reads that reads this,
    # with no pickler of ours on the reading side.
    node = cst.parse_module(text)
    data = cst_nodes.pickled(node)
    assert data == pickle.dumps(node, protocol=pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(data)
    assert back.deep_equals(node) and back.code == text
