"""No import circle among ``verify``, the shared harness and the patchsets' suites.

``verify`` runs every suite through the registry (``Patchset.suite()``), so
it depends on each suite module; a suite that imports ``verify`` back (for
its error type, its report) closes a circle. The graph is read from the
source with ``ast``: every import counts, at module level, inside functions
and under ``TYPE_CHECKING`` alike, and importing ``a.b.c`` from outside
``a.b`` runs ``a.b``'s ``__init__`` too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from gdn_backport import registry

REPO = Path(__file__).resolve().parent.parent
PATCHSETS = "gdn_backport.patchsets."
VERIFY = "gdn_backport.verify"


def _file(module: str) -> Path | None:
    if module.startswith(PATCHSETS):
        parts = ["patchsets", *module.removeprefix(PATCHSETS).split(".")]
    else:
        parts = module.split(".")
    base = REPO.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(module: str, path: Path | None = None) -> set[str]:
    """Every module of this checkout that ``module``'s source (at ``path``,
    default where the module lives) imports, by absolute name."""
    path = path or _file(module)
    assert path is not None, module
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    found = {m for m in out if _file(m) is not None}
    # Importing a.b.c runs a.b (and a) first, unless we are inside a.b already.
    for name in list(found):
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if not module.startswith(parent + ".") and module != parent and _file(parent):
                found.add(parent)
    found.discard(module)
    return found


def _graph() -> tuple[dict[str, set[str]], set[str]]:
    harness = {"gdn_backport.harness"} | {
        f"gdn_backport.harness.{p.stem}"
        for p in (REPO / "gdn_backport" / "harness").glob("*.py")
        if p.stem != "__init__"
    }
    suites = {type(ps.suite()).__module__ for ps in registry.discover() if ps.suite() is not None}
    assert suites, "no patchset has a suite"
    # The suites' own helper modules (a patchset's scenarios, metadata,
    # builder) are followed: a circle may run through them.
    nodes = {VERIFY, *harness, *suites}
    todo = list(suites)
    while todo:
        for name in _imports(todo.pop()):
            if name.startswith(PATCHSETS) and name not in nodes and name.count(".") > 2:
                nodes.add(name)
                todo.append(name)
    graph = {n: _imports(n) & nodes for n in nodes}
    # verify -> the registry -> Patchset.suite() -> the suite's module.
    graph[VERIFY] |= suites
    return graph, suites


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_among_verify_the_harness_and_the_suites() -> None:
    graph, suites = _graph()
    assert {"gdn_backport.harness.suite", "gdn_backport.harness.layer"} <= set(graph)
    assert all(s in graph[VERIFY] for s in suites)
    circle = _cycle(graph)
    assert circle is None, " -> ".join(circle or [])


def test_the_suites_take_their_contract_from_the_harness() -> None:
    graph, suites = _graph()
    for suite in suites:
        assert VERIFY not in graph[suite], f"{suite} imports {VERIFY}"
        assert "gdn_backport.harness.suite" in graph[suite], suite


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reader counts a relative import, one inside a function and one
    under TYPE_CHECKING (the forms a suite's import of verify took)."""
    source = tmp_path / "suite.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .config import load\n"
        "from gdn_backport.harness.layer import LayerShape\n"
        "if TYPE_CHECKING:\n    from gdn_backport.verify import VerifyReport\n"
        "def run():\n    from gdn_backport import verify\n"
    )
    deps = _imports(f"{PATCHSETS}pr51565.suite", source)
    assert deps == {
        f"{PATCHSETS}pr51565.config",
        "gdn_backport.harness.layer",
        "gdn_backport.harness",  # its package runs first
        "gdn_backport.verify",
        "gdn_backport",
    }
