"""The tests mirror the core: every module of ``gdn_backport/`` has its same-stem test file.

``gdn_backport/<stem>.py`` -> ``tests/test_<stem>.py``; a module of a
subpackage, ``gdn_backport/<package>/<stem>.py`` -> ``tests/test_<package>_<stem>.py``
(deeper: every folder joined by ``_``). ``__init__`` and ``__main__`` are
left out. A test file may test more than its module, and must hold a test.
No module is exempt: every one can be tested alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORE = REPO / "gdn_backport"
TESTS = REPO / "tests"


def _modules() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if p.stem not in ("__init__", "__main__"))


def _test_name(module: Path) -> str:
    parts = module.relative_to(CORE).with_suffix("").parts
    return f"test_{'_'.join(parts)}.py"


def _dotted(module: Path) -> str:
    return ".".join(("gdn_backport", *module.relative_to(CORE).with_suffix("").parts))


def _tests_in(test: Path) -> list[str]:
    tree = ast.parse(test.read_text(encoding="utf-8"))
    return [
        n.name
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
    ]


def test_the_core_has_modules_to_mirror() -> None:
    names = {_dotted(m) for m in _modules()}
    assert {"gdn_backport.tree", "gdn_backport.matrix.export"} <= names
    assert _test_name(CORE / "matrix" / "export.py") == "test_matrix_export.py"
    assert _test_name(CORE / "tree.py") == "test_tree.py"
    # No two modules share a test name (matrix/export.py and a matrix_export.py would).
    tests = [_test_name(m) for m in _modules()]
    assert len(set(tests)) == len(tests)


def test_every_core_module_has_its_same_stem_test_file() -> None:
    missing = [
        f"{m.relative_to(REPO)} -> tests/{_test_name(m)}"
        for m in _modules()
        if not (TESTS / _test_name(m)).is_file()
    ]
    assert missing == [], "core modules without their same-stem test file:\n" + "\n".join(missing)


def test_every_same_stem_test_file_holds_tests() -> None:
    empty = [
        f"tests/{_test_name(m)}"
        for m in _modules()
        if (TESTS / _test_name(m)).is_file() and not _tests_in(TESTS / _test_name(m))
    ]
    assert empty == [], "same-stem test files without a test: " + ", ".join(empty)
