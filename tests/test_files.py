"""files.py: the walk, leftovers, the marker sieve, decoding as Python does, parsing."""

from __future__ import annotations

import ast
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from gdn_backport import files
from gdn_backport.atomic import STATE_DIR
from gdn_backport.errors import Refusal, UsageError


def _names(walk: files.Walk) -> list[str]:
    return [p.relative_to(walk.root).as_posix() for p in walk.files]


def test_walk_takes_python_files_skips_state_and_caches_and_follows_links(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("")
    (tmp_path / "pkg" / "notes.txt").write_text("")
    for skip in (".git", "__pycache__", STATE_DIR, ".venv"):
        (tmp_path / skip).mkdir()
        (tmp_path / skip / "c.py").write_text("")
    os.mkfifo(tmp_path / "pkg" / "fifo.txt")  # not a module: never read, it would block
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "linked.py").write_text("")
    (tmp_path / "link").symlink_to(outside)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # not a module
    (tmp_path / "self").symlink_to(tmp_path / "self")  # a loop, not a module
    (tmp_path / ".git" / "dangling.py").symlink_to(tmp_path / "nowhere.py")  # not walked
    (tmp_path / "pkg" / "loop").symlink_to(tmp_path / "pkg")  # holds the tree's files
    (tmp_path / "pkg" / "up").symlink_to(tmp_path.parent)  # holds the tree
    walk = files.walk(tmp_path)
    assert _names(walk) == ["pkg/a.py", "pkg/sub/b.py", "link/linked.py"]
    assert walk.links == {tmp_path / "link" / "linked.py": outside / "linked.py"}
    assert list(files.python_files(tmp_path)) == walk.files


def _unreadable(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """``os.scandir`` of ``folder`` fails as a folder without read permission does
    (the tests run as root, whom no mode stops)."""
    real = os.scandir

    def scandir(path: Any = ".") -> Any:
        if os.fspath(path) == str(folder):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("dangling", "symbolic link to nothing"),
        ("loop", "a loop of symbolic links"),
        ("loop-of-two", "a loop of symbolic links"),
        ("fifo", "not a regular file"),
        ("link-to-fifo", "not a regular file"),
        ("unreadable-folder", "cannot read (Permission denied)"),
        ("unreadable-linked-folder", "cannot read (Permission denied)"),
    ],
)
def test_a_module_the_walk_cannot_take_is_a_usage_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, reason: str
) -> None:
    """A ``*.py`` the walk cannot read, or a folder it cannot list, is bad
    input (D7): skipped, its module would be missing from the scan, and
    ``apply`` would write a half fix. One line naming it and the reason."""
    pkg = tmp_path / "vllm" / "worker"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("")
    bad = pkg / "runner.py"
    if kind == "dangling":
        bad.symlink_to("/nonexistent/runner.py")
    elif kind == "loop":
        bad.symlink_to("runner.py")
    elif kind == "loop-of-two":
        (pkg / "other.py").symlink_to("runner.py")
        bad.symlink_to("other.py")
        bad = pkg / "other.py"  # the link of the loop that sorts first
    elif kind == "fifo":
        os.mkfifo(bad)
    elif kind == "link-to-fifo":
        os.mkfifo(tmp_path / "pipe")
        bad.symlink_to(tmp_path / "pipe")
    elif kind == "unreadable-folder":
        bad = pkg
        _unreadable(monkeypatch, pkg)
    else:
        outside = tmp_path.parent / f"{tmp_path.name}-outside"
        outside.mkdir()
        bad = tmp_path / "vllm" / "linked"
        bad.symlink_to(outside)
        _unreadable(monkeypatch, bad)
    with pytest.raises(UsageError) as got:
        files.walk(tmp_path)
    message = str(got.value)
    assert "\n" not in message
    assert message.startswith(f"{bad}: "), message
    assert reason in message, message


def test_a_file_reached_twice_through_a_linked_folder_keeps_its_real_path(
    tmp_path: Path,
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "m.py").write_text("")
    (tmp_path / "alink").symlink_to(tmp_path / "real")  # sorts first, walked last
    walk = files.walk(tmp_path)
    assert _names(walk) == ["real/m.py"] and walk.links == {}


def test_walk_of_a_single_file_is_that_file(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("")
    link = tmp_path / "l.py"
    link.symlink_to(f)
    assert files.walk(f).files == [f] and files.walk(f).links == {}
    assert files.walk(link).links == {link: f}


def test_leftovers_of_an_interrupted_run_are_found_beside_their_module(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("")
    beside = tmp_path / ".m.py.abcd1234.tmp"
    beside.write_text("")
    (tmp_path / ".other.py.abcd1234.tmp").write_text("")  # no other.py: not ours
    (tmp_path / ".m.py.short.tmp").write_text("")
    state = tmp_path / STATE_DIR
    state.mkdir()
    probe = state / ".gdn-backport.zz99aa11.probe"
    probe.write_text("")
    (state / "manifest.json").write_text("{}")
    walk = files.walk(tmp_path)
    assert sorted(walk.leftovers) == sorted([beside, probe])
    assert files.leftovers_beside([tmp_path / "m.py"]) == [beside]
    assert files.state_leftovers(tmp_path) == [probe]
    assert files.state_leftovers(tmp_path / "nope") == []


def test_read_marked_keeps_only_files_naming_a_marker_and_defining_a_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "m.py"
    f.write_bytes(b"def f():\n    kernel()\n")
    assert files.read_marked(f, [b"kernel"]) == b"def f():\n    kernel()\n"
    assert files.read_marked(f, [b"other"]) is None
    f.write_bytes(b"kernel = 1\n")
    assert files.read_marked(f, [b"kernel"]) is None
    # Chunked: a marker cut by a chunk boundary is still seen.
    monkeypatch.setattr(files, "CHUNK", 8)
    data = b"def f():\n" + b"#" * 20 + b"ker" + b"nel\n" + b"x" * 30
    f.write_bytes(data)
    assert files.read_marked(f, [b"kernel"]) == data
    f.write_bytes(b"def f():\n" + b"#" * 40)
    assert files.read_marked(f, [b"kernel"]) is None


def test_decode_follows_pep_263_and_the_bom_round_trips(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    latin = "# -*- coding: latin-1 -*-\nx = 'é'\n".encode("latin-1")
    assert files.source_encoding(p, latin) == "iso-8859-1"
    text = files.decode(p, latin)
    assert text.endswith("x = 'é'\n")
    assert files.encode(p, text, latin) == latin
    bom = files.BOM + b"x = 1\n"
    assert files.decode(p, bom) == "x = 1\n"
    assert files.encode(p, "x = 2\n", bom) == files.BOM + b"x = 2\n"
    assert files.source_encoding(p, b"x = 1\n") == "utf-8"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"x = 1\0\n", "binary data"),
        (b"# coding: nope\nx = 1\n", "bad coding declaration"),
        (b"# coding: utf-16\nx = 1\n", "not ASCII-compatible"),
        (b"x = '\xff'\n", r"not valid UTF-8 \(invalid start byte at byte 5\)"),
    ],
)
def test_decode_refuses_what_python_would_not_read(
    tmp_path: Path, data: bytes, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        files.decode(tmp_path / "m.py", data)


def test_encode_refuses_a_character_the_file_cannot_hold(tmp_path: Path) -> None:
    like = b"# coding: latin-1\n"
    with pytest.raises(Refusal, match="cannot hold; nothing was written") as got:
        files.encode(tmp_path / "m.py", "x = '€'\n", like)
    assert got.value.path == tmp_path / "m.py"


def test_parse_ast_names_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    assert isinstance(files.parse_ast(p, "x = 1\n"), ast.Module)
    with pytest.raises(UsageError, match=r"m\.py:2: syntax error"):
        files.parse_ast(p, "x = 1\ndef (:\n")


def test_module_imports_maps_local_names_outside_functions() -> None:
    tree = ast.parse(
        "import a.b\n"
        "import c.d as e\n"
        "from f.g import h, i as j\n"
        "from . import k\n"
        "from .helpers import fn\n"
        "try:\n    from x import y\nexcept ImportError:\n    from z import y as w\n"
        "if True:\n    import q\n"
        "def inside():\n    import hidden\n"
    )
    assert files.module_imports(tree) == {
        "a": "a",
        "e": "c.d",
        "h": "f.g.h",
        "j": "f.g.i",
        "k": ".k",
        "fn": ".helpers.fn",
        "y": "x.y",
        "w": "z.y",
        "q": "q",
    }
