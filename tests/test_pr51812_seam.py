"""pr51812's scan cache entry: a result that read a module outside the
tree's walk is not stored (its key names only the walk's files)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from gdn_backport.patchsets.pr51812.seam import _outside
from gdn_backport.tree import Tree


def test_a_module_outside_the_walk_is_told_by_its_real_path(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / "vllm/sub").mkdir(parents=True)
    (root / "vllm/__init__.py").write_text("")
    (root / "vllm/a.py").write_text("x = 1\n")
    (root / "vllm/sub/link.py").symlink_to(root / "vllm/a.py")
    (tmp_path / "other.py").write_text("y = 1\n")
    tree = Tree.of(root)

    def outside(*paths: Path | None) -> bool:
        return _outside(tree, [SimpleNamespace(path=p) for p in paths])

    assert not outside(None, root / "vllm/a.py", root / "vllm/__init__.py")
    # Spelled otherwise than the walk spells it, the same files.
    assert not outside(root / "vllm/sub/../a.py", root / "vllm/sub/link.py")
    assert outside(root / "vllm/a.py", tmp_path / "other.py")
    assert outside(root / "vllm/sub/../../../other.py")
