"""The fast paths give the answers of the slow ones (no timings asserted)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from gdn_backport.patchsets.pr51565 import analysis
from tests.conftest import AFFECTED, FIXED, run


def filler(count: int) -> str:
    return "".join(
        f"def helper_{i}(x, y):\n    z = x + y * {i}\n    if z > {i}:\n        return [z]\n"
        f"    return {{'a': z}}\n\n\n"
        for i in range(count)
    )


@pytest.mark.parametrize("site", [AFFECTED, FIXED])
def test_a_huge_module_gives_the_verdicts_of_its_site_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], site: str
) -> None:
    """Issue 24 D14: thousands of module functions around a spec path (the
    sweep once copied the module's names for each) change nothing but the line."""

    def sites(text: str, name: str) -> list[dict[str, object]]:
        root = tmp_path / name
        (root / "vllm").mkdir(parents=True)
        (root / "vllm/__init__.py").write_text("")
        (root / "vllm/gdn.py").write_text(text)
        code, out, _ = run(capsys, "scan", str(root), "--json")
        assert code in (0, 1)
        found: list[dict[str, object]] = json.loads(out)["sites"]
        return found

    alone = sites(site, "alone")
    head = filler(1500)
    big = sites(head + site + "\n\n" + filler(1500), "big")
    shift = head.count("\n")
    assert alone
    assert [{**s, "line": int(str(s["line"])) + shift} for s in alone] == big


def reference_builds(tree: ast.Module) -> dict[str, str]:
    """``_installed_builds`` as it was: every node of ``ast.walk``."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "build":
                    value: ast.expr = node.value
                    while isinstance(value, ast.Call):
                        value = value.args[-1] if value.args else value.func
                    if isinstance(value, ast.Name):
                        names[value.id] = ast.unparse(target.value)
    return names


INSTALLS = """\
import functools
if x:
    try:
        A.build = functools.wraps(o)(fn)
    except E:
        B.build = g
    finally:
        pass
else:
    with m:
        match q:
            case 1:
                C.build = h
for i in y:
    while z:
        E.build = k
class K:
    def f(self):
        D.build = fn
        async def g2():
            F.build = g2
"""


def test_installed_builds_finds_what_every_node_finds() -> None:
    tree = ast.parse(INSTALLS)
    assert analysis._installed_builds(tree) == reference_builds(tree)
    assert analysis._installed_builds(tree)["fn"] == "D"  # the later of ast.walk's order
    assert set(analysis._installed_builds(tree)) == {"fn", "g", "h", "k", "g2"}


WALKED = """
class A(B):
    @staticmethod
    def f(x, *a, k=1, **kw):
        def g():
            return [y async for y in x] if x else {**kw}
        try:
            pass
        except* ValueError as e:
            match x:
                case [1, *rest] if rest:
                    def h():
                        return lambda q: q
        finally:
            with open(x) as fh, ctx():
                def h():
                    yield from g()
for i in range(3):
    while i:
        i -= 1
    else:
        def e():
            pass
"""


def test_the_index_walk_gives_ast_walks_nodes_in_its_order() -> None:
    """``resolve._walk`` replaced ``tuple(ast.walk(...))`` and the function
    index reads statement lists only: the same nodes, order and index."""
    from gdn_backport.patchsets.pr51812 import resolve

    tree = ast.parse(WALKED)
    assert resolve._walk(tree) == tuple(ast.walk(tree))
    names = [(e[1], e[2]) for e in resolve._raw_index(tree) if e[0] == "function"]
    assert names == [("A.f", 0), ("A.f.g", 0), ("A.f.h", 0), ("A.f.h", 1), ("e", 0)]
    assert [e[1] for e in resolve._raw_index(tree) if e[0] == "class"] == ["A"]
