"""tree.py: what a PATH names (tree_root, check_vllm_tree) and a run's Tree.

Public API only: read/text/parse are made once per run, the overlay wins.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gdn_backport.errors import UsageError
from gdn_backport.tree import Tree, check_vllm_tree, relative, tree_root


def _pkg(root: Path) -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    return root


def test_tree_root_is_the_folder_or_the_file_s_folder(tmp_path: Path) -> None:
    f = tmp_path / "a.py"
    f.write_text("x = 1\n")
    assert tree_root(tmp_path) == tmp_path
    assert tree_root(f) == tmp_path
    with pytest.raises(UsageError, match="no such file or directory"):
        tree_root(tmp_path / "missing")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UsageError, match="symbolic link to nothing"):
        tree_root(tmp_path / "dangling")


def test_tree_root_refuses_what_is_neither_file_nor_folder(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file or a directory"):
        tree_root(fifo)


def test_a_vllm_tree_is_found_at_the_top_one_down_or_as_the_package(tmp_path: Path) -> None:
    top = _pkg(tmp_path / "top")
    check_vllm_tree(top)
    check_vllm_tree(top / "vllm")
    sdist = _pkg(tmp_path / "sdist" / "vllm-1.0")
    check_vllm_tree(sdist.parent)
    single = tmp_path / "one.py"
    single.write_text("anything\n")
    check_vllm_tree(single)


def test_a_plugin_that_imports_vllm_is_a_tree(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin"
    (plugin / "pkg").mkdir(parents=True)
    (plugin / "pkg" / "layer.py").write_text("import torch\nfrom vllm.x import y\n")
    check_vllm_tree(plugin)


def test_a_folder_without_vllm_is_refused_unless_it_holds_records(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "m.py").write_text("import vllmish  # not vllm\n# from vllm import x\n")
    with pytest.raises(UsageError, match="no vllm package under this path"):
        check_vllm_tree(other)
    (other / ".gdn-backport").mkdir()
    (other / ".gdn-backport" / "manifest.json").write_text("{}")
    with pytest.raises(UsageError):
        check_vllm_tree(other)
    check_vllm_tree(other, records=True)


def test_read_text_and_parse_are_made_once_per_run(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    tree = Tree.of(f)
    assert tree.root == tmp_path and tree.path == f
    assert tree.read(f) == b"x = 1\n"
    assert tree.text(f) == "x = 1\n"
    first = tree.parse(f)
    f.write_text("x = 2\n")  # a change on disk mid-run is not seen
    assert tree.read(f) == b"x = 1\n" and tree.text(f) == "x = 1\n"
    assert tree.parse(f) is first  # one parse per text
    assert first.body[0].value.value == 1  # type: ignore[attr-defined]
    assert Tree.of(f).text(f) == "x = 2\n"  # a new run reads it afresh
    assert Tree.of(f, kernels=[f], within="vllm").kernels == (f,)


def test_the_overlay_is_what_a_later_patchset_reads(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    tree = Tree.of(tmp_path)
    tree.overlay[f] = "x = 3\n"
    assert tree.text(f) == "x = 3\n"
    assert tree.parse(f).body[0].value.value == 3  # type: ignore[attr-defined]
    assert tree.read(f) == b"x = 1\n"  # the bytes on disk are unchanged


def test_an_unreadable_file_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    tree = Tree.of(tmp_path)
    with pytest.raises(UsageError, match=r"missing\.py: cannot read"):
        tree.read(tmp_path / "missing.py")


def test_walk_is_every_python_file_below_path_once(tmp_path: Path) -> None:
    root = _pkg(tmp_path / "t")
    (root / "vllm" / "a.py").write_text("")
    (root / "vllm" / "notes.txt").write_text("")
    tree = Tree.of(root)
    walk = tree.walk()
    assert walk is tree.walk()
    assert sorted(relative(p, root) for p in walk.files) == ["vllm/__init__.py", "vllm/a.py"]
    assert tree.relative(root / "vllm" / "a.py") == "vllm/a.py"
    assert Tree.of(root / "vllm", root=tmp_path).relative(root / "vllm" / "a.py") == "t/vllm/a.py"


def test_a_sieve_reads_each_file_once_per_run_and_name(tmp_path: Path) -> None:
    """A plan's proof sieves the tree again: the verdict is the run's, made
    once from the run's bytes; another sieve name asks its own rule."""
    f = tmp_path / "m.py"
    f.write_text("def build(): pass\n")
    tree = Tree.of(tmp_path)
    asked: list[bytes] = []

    def keep(data: bytes) -> bool:
        asked.append(data)
        return b"build" in data

    assert tree.kept("a", f, keep) and tree.kept("a", f, keep)
    assert asked == [b"def build(): pass\n"]
    f.write_text("x = 1\n")  # a change on disk mid-run is not seen
    assert tree.kept("a", f, keep) and len(asked) == 1
    assert not tree.kept("b", f, lambda data: b"x = 1" in data)  # the run's bytes
    assert Tree.of(tmp_path).kept("a", f, keep) is False  # a new run reads afresh
