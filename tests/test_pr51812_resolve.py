"""pr51812's module index (``resolve.TreeIndex``): which paths an import
reaches become modules."""

from __future__ import annotations

from pathlib import Path

from gdn_backport.patchsets.pr51812.config import for_tree
from gdn_backport.patchsets.pr51812.resolve import TreeIndex


def test_an_import_reaches_files_of_the_tree_and_a_rewrite_not_yet_on_disk(
    tmp_path: Path,
) -> None:
    root = tmp_path / "tree"
    (root / "vllm" / "pkg").mkdir(parents=True)
    (root / "vllm" / "helper.py").write_text("def h():\n    return 1\n")
    (root / "vllm" / "pkg" / "__init__.py").write_text("")
    index = TreeIndex(root, for_tree(root))
    found = index.module_at(root / "vllm" / "helper.py")
    assert found is not None and found.key == "vllm/helper.py"
    assert index.module_at(root / "vllm" / "pkg.py") is None  # a package, not a file
    assert index.module_at(root / "vllm" / "missing.py") is None
    assert index.module_at(tmp_path / "outside.py") is None
    # A text to analyse in place of a file (a rewrite being proven) is read
    # from the overrides, on disk or not.
    new = root / "vllm" / "added.py"
    proving = TreeIndex(root, for_tree(root), {new: "def added():\n    return 2\n"})
    module = proving.module_at(new)
    assert module is not None and "def added" in module.text
    assert proving.module_at(root / "vllm" / "missing.py") is None
