"""Bad and hostile inputs through the command line (``gdn_backport.cli.main``).

Each refusal: exit 2, one line on stderr naming the file and the reason, and
nothing changed on disk (the tree's bytes are compared before and after).
Inputs the tool can handle (a byte-order mark, CRLF, two sites in one file,
an empty tree, link loops inside the tree) are handled, byte-exactly.
``tests/test_cli.py`` and ``tests/test_engine.py`` hold the first cases
(syntax error, non-UTF-8, binary for scan/apply, a held lock); this file
extends them. Nothing of the target is ever executed: see the last test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gdn_backport import atomic, sources
from gdn_backport.patchsets.pr51812 import plan as engine
from gdn_backport.patchsets.pr51812.codemods.base import Rewrite, SiteCodemod
from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod
from tests.conftest import AFFECTED, FIXED, run
from tests.test_engine import SITE

REPO = Path(__file__).resolve().parents[1]
WRAPPED = GatherGatesCodemod.REFUSES[1][0]  # a kernel behind an unknown wrapper


def snapshot(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root`` (the records folder excluded)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and atomic.STATE_DIR not in p.parts
    }


def refused(err: str, *needles: str) -> None:
    """One line on stderr holding every needle (the file, the reason)."""
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def no_records(capsys: pytest.CaptureFixture[str], root: Path) -> None:
    code, out, _ = run(capsys, "revert", str(root))
    assert code == 0 and "nothing to revert" in out, out


# -- paths that are not what they claim ------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["apply"], ["apply", "--check"], ["apply", "--dry-run"], ["revert"], ["scan", "--json"]],
    ids=" ".join,
)
def test_missing_path(capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]) -> None:
    missing = tmp_path / "no" / "such"
    code, out, err = run(capsys, *argv, str(missing))
    # --json: a document says it too (D12); else nothing on stdout.
    assert code == 2 and (json.loads(out)["exit_code"] == 2 if "--json" in argv else not out)
    refused(err, str(missing), "no such file or directory")
    assert list(tmp_path.iterdir()) == []


def test_path_is_a_link_loop(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    loop = tmp_path / "loop.py"
    loop.symlink_to(loop)
    for command in ("scan", "apply", "revert"):
        code, _, err = run(capsys, command, str(loop))
        assert code == 2
        refused(err, str(loop), "symbolic link to nothing")


def test_link_loops_inside_the_tree_end_the_walk(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    vllm = affected_tree / "vllm"
    (vllm / "a").symlink_to(vllm / "b")  # links that are no module: skipped
    (vllm / "b").symlink_to(vllm / "a")
    (vllm / "loop").symlink_to(vllm, target_is_directory=True)
    (vllm / "up").symlink_to(affected_tree.parent, target_is_directory=True)
    (vllm / "dangling").symlink_to(vllm / "nowhere")
    before = snapshot(affected_tree)
    code, out, _ = run(capsys, "scan", str(affected_tree), "--json")
    assert code == 1 and out.count('"path"') == 1  # the one site, once
    code, out, _ = run(capsys, "apply", str(affected_tree), "--json")
    assert code == 0 and '"changed": true' in out
    assert (affected_tree / SITE).read_text() == FIXED
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert snapshot(affected_tree) == before


@pytest.mark.parametrize(
    ("how", "reason"),
    [("loop", "a loop of symbolic links"), ("dangling", "symbolic link to nothing")],
)
def test_a_module_that_is_a_broken_link_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, how: str, reason: str
) -> None:
    """A ``*.py`` link to nothing, or a loop of them, is a module the scan
    cannot read: refused (D7), never skipped into a half fix."""
    vllm = affected_tree / "vllm"
    if how == "loop":
        (vllm / "a.py").symlink_to(vllm / "b.py")
        (vllm / "b.py").symlink_to(vllm / "a.py")
    else:
        (vllm / "a.py").symlink_to(vllm / "nowhere.py")
    before = snapshot(affected_tree)
    for argv in (["scan"], ["apply", "--check"], ["apply", "--dry-run"], ["apply"]):
        code, out, err = run(capsys, *argv, str(affected_tree))
        assert (code, out) == (2, ""), argv
        refused(err, str(vllm / "a.py"), reason)
    assert snapshot(affected_tree) == before
    no_records(capsys, affected_tree)


@pytest.mark.parametrize("how", ["file", "folder"])
def test_a_linked_module_outside_the_tree_is_a_site_never_written(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, how: str
) -> None:
    """The GDN module is a symbolic link (or sits in a linked folder) to a
    file outside the tree: scan reports it where it points, --check fails,
    apply refuses with the reason and changes nothing."""
    outside = tmp_path / "elsewhere" / "layers"
    outside.mkdir(parents=True)
    (outside / "gdn_linear_attn.py").write_text(AFFECTED)
    tree = tmp_path / "tree"
    (tree / "vllm" / "model_executor").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    if how == "file":
        (tree / "vllm" / "model_executor" / "layers").mkdir()
        link = tree / "vllm" / "model_executor" / "layers" / "gdn_linear_attn.py"
        link.symlink_to(outside / "gdn_linear_attn.py")
    else:
        (tree / "vllm" / "model_executor" / "layers").symlink_to(outside, True)
    rel = "vllm/model_executor/layers/gdn_linear_attn.py"
    real = str(outside / "gdn_linear_attn.py")
    code, out, _ = run(capsys, "scan", str(tree), "--json")
    assert code == 1
    [site] = json.loads(out)["sites"]
    assert (site["path"], site["status"], site["target"]) == (rel, "affected", real)
    code, out, _ = run(capsys, "scan", str(tree))
    assert f"{rel}:2 -> {real}" in out
    code, out, _ = run(capsys, "apply", "--check", str(tree))
    assert code == 1 and "no GDN spec path" not in out
    for argv in (["apply"], ["apply", "--dry-run"], ["apply", "--strategy", "kernel"]):
        code, _, err = run(capsys, *argv, str(tree))
        assert code == 2, argv
        refused(err, str(tree / rel), f"is a symbolic link to {real} outside the tree")
        assert (outside / "gdn_linear_attn.py").read_text() == AFFECTED
    assert not (tree / atomic.STATE_DIR).exists()


@pytest.mark.parametrize("how", ["file", "folder", "hidden"])
def test_a_link_to_a_file_inside_the_tree_writes_the_target_once(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, how: str
) -> None:
    """A link whose target is inside the tree: one site, the target written
    once (through whichever path), the record at the real path, revert back."""
    target = affected_tree / SITE
    vllm = affected_tree / "vllm"
    if how == "file":
        (vllm / "alias.py").symlink_to(target)
    elif how == "folder":
        (vllm / "layers_alias").symlink_to(target.parent, target_is_directory=True)
    else:
        # The real file sits where the walk does not go (.venv), reached only by the link.
        hidden = affected_tree / ".venv" / "gdn.py"
        hidden.parent.mkdir()
        target.rename(hidden)
        target.symlink_to(hidden)
        target = hidden
    before = snapshot(affected_tree)
    code, out, _ = run(capsys, "scan", str(affected_tree), "--json")
    assert code == 1 and len(json.loads(out)["sites"]) == 1
    code, out, err = run(capsys, "apply", str(affected_tree), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [s["changed"] for s in doc["sites"]] == [True]
    assert doc["written"] == [target.relative_to(affected_tree).as_posix()]
    assert target.read_text() == FIXED
    assert run(capsys, "apply", "--check", str(affected_tree))[0] == 0
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert target.read_text() == AFFECTED
    assert snapshot(affected_tree) == before


def test_fifo_named_py_does_not_hang(tmp_path: Path, affected_tree: Path) -> None:
    os.mkfifo(affected_tree / "vllm" / "pipe.py")
    # In a child with a timeout: reading a FIFO blocks forever.
    proc = subprocess.run(
        [sys.executable, "-m", "gdn_backport", "scan", str(affected_tree)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    # A module that cannot be read is refused (D7), without reading it.
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("pipe.py: not a regular file\n"), proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "gdn_backport", "scan", str(affected_tree / "vllm" / "pipe.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2 and "not a regular file" in proc.stderr


# -- contents that are not plain UTF-8 Python -------------------------------------

# Each names a spec field and defines a function: it may hold a site, so
# it is read, and its defect stops the run.
BAD_CONTENT = [
    (b"def f(:\n    spec_token_indx\n", "syntax error"),
    (b"def f(md):\n    return md.spec_token_indx\n\xff\xfe\n", "not valid UTF-8"),
    (b"\x00\x01def spec_token_indx\x00", "binary data"),
    # Declarations Python rejects (a latin-1 one is read: see below).
    (b"# coding: klingon\ndef f(md):\n    return md.spec_token_indx\n", "bad coding"),
    (b"# coding: utf-16\ndef f(md):\n    return md.spec_token_indx\n", "bad coding"),
    (b"# coding: ascii\ndef f(md):\n    return md.spec_token_indx  # \xe9\n", "not valid ascii"),
]


@pytest.mark.parametrize(("content", "reason"), BAD_CONTENT, ids=lambda x: str(x)[:18])
@pytest.mark.parametrize(
    "argv",
    [["apply", "--check"], ["apply", "--dry-run"], ["apply", "--strategy", "kernel"], ["revert"]],
    ids=" ".join,
)
def test_bad_file_in_other_modes(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    argv: list[str],
    content: bytes,
    reason: str,
) -> None:
    bad = affected_tree / "vllm" / "bad.py"
    if argv == ["revert"]:
        # A patched tree whose other file turned bad: revert does not read it.
        assert run(capsys, "apply", str(affected_tree))[0] == 0
        bad.write_bytes(content)
        assert run(capsys, "revert", str(affected_tree))[0] == 0
        assert (affected_tree / SITE).read_text() == AFFECTED
        return
    bad.write_bytes(content)
    before = snapshot(affected_tree)
    code, _, err = run(capsys, *argv, str(affected_tree))
    assert code == 2
    refused(err, str(bad), reason)
    assert snapshot(affected_tree) == before


def test_binary_junk_without_gdn_fields_is_skipped(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    (affected_tree / "vllm" / "blob.py").write_bytes(bytes(range(256)) * 64)
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    assert (affected_tree / SITE).read_text() == FIXED


@pytest.mark.parametrize("cookie", ["latin-1", "iso-8859-15", "cp1252"])
def test_a_declared_encoding_is_read_and_written_back(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, cookie: str
) -> None:
    """PEP 263: a module declaring latin-1 (valid Python; issue 13 found it
    refused as "not valid UTF-8", and blocking the scan of the whole tree)
    is decoded by its declaration, patched, and written back in it."""
    target = affected_tree / SITE
    header = f"# -*- coding: {cookie} -*-\n# Auteur : Andr\u00e9\n"
    target.write_bytes((header + AFFECTED).encode(cookie))
    # Another file in the tree naming both fields, in the same encoding.
    other = affected_tree / "vllm" / "legacy.py"
    note = "NOTE = 'spec_token_indx spec_state_indices_tensor \u00e9'\n"
    other.write_bytes(f"# -*- coding: {cookie} -*-\n{note}".encode(cookie))
    before = snapshot(affected_tree)
    assert run(capsys, "scan", str(affected_tree))[0] == 1
    code, _, err = run(capsys, "apply", str(affected_tree))
    assert code == 0, err
    assert target.read_bytes() == (header + FIXED).encode(cookie)
    assert run(capsys, "apply", "--check", str(affected_tree))[0] == 0
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert snapshot(affected_tree) == before


def test_a_rewrite_the_declared_encoding_cannot_hold_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = affected_tree / SITE
    target.write_bytes(("# -*- coding: ascii -*-\n" + AFFECTED).encode())
    real = SiteCodemod.rewrite

    def rewrite(self: SiteCodemod, tree: Any) -> Rewrite | None:
        got = real(self, tree)
        if got is None:
            return None
        text = got.text.replace("# the gate rows", "# the gate rows \u2192")
        return dataclasses.replace(got, text=text)

    monkeypatch.setattr(SiteCodemod, "rewrite", rewrite)
    before = snapshot(affected_tree)
    code, _, err = run(capsys, "apply", str(affected_tree))
    assert code == 2
    refused(err, str(target), "which the file's encoding ascii cannot hold")
    assert snapshot(affected_tree) == before


@pytest.mark.parametrize("encoding", ["bom", "crlf", "bom+crlf"])
def test_byte_order_mark_and_crlf_survive(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, encoding: str
) -> None:
    target = affected_tree / SITE
    data = AFFECTED.encode()
    if "crlf" in encoding:
        data = data.replace(b"\n", b"\r\n")
    if "bom" in encoding:
        data = b"\xef\xbb\xbf" + data
    target.write_bytes(data)
    before = snapshot(affected_tree)
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    patched = target.read_bytes()
    expected = FIXED.encode()
    if "crlf" in encoding:
        expected = expected.replace(b"\n", b"\r\n")
    if "bom" in encoding:
        expected = b"\xef\xbb\xbf" + expected
    assert patched == expected
    assert run(capsys, "apply", "--check", str(affected_tree))[0] == 0
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert snapshot(affected_tree) == before


# -- empty input -------------------------------------------------------------------


ALL_COMMANDS = [["scan"], ["apply"], ["apply", "--check"], ["apply", "--dry-run"], ["revert"],
                ["verify"], ["apply", "--commit"]]  # fmt: skip


@pytest.mark.parametrize("argv", ALL_COMMANDS, ids=" ".join)
def test_a_path_without_vllm_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    """An empty folder, or one holding Python but no vllm package (issue 13:
    `apply --check` passed on both): exit 2, one line, nothing created."""
    for tree in (tmp_path / "empty", tmp_path / "blank"):
        tree.mkdir()
    (tmp_path / "blank" / "__init__.py").write_bytes(b"")
    (tmp_path / "blank" / "spec_token_indx.py").write_bytes(b"import os\n")
    (tmp_path / "blank" / "vllm").mkdir()  # no __init__.py: not the package
    for tree in (tmp_path / "empty", tmp_path / "blank"):
        before = snapshot(tree)
        code, out, err = run(capsys, *argv, str(tree))
        assert (code, out) == (2, "")
        refused(err, f"{tree}: no vllm package under this path", "vllm/__init__.py")
        assert snapshot(tree) == before and not (tree / atomic.STATE_DIR).exists()


@pytest.mark.parametrize(
    "layout", ["root", "sdist-one-level-down", "the-package-itself", "plugin", "one-file"]
)
def test_what_counts_as_a_vllm_tree(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, layout: str
) -> None:
    """Nothing to do is exit 0, not an error, on every shape of vLLM tree."""
    if layout == "plugin":
        pkg = tmp_path / "vllm_ascend"
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        (pkg / "models.py").write_text("from vllm.config import VllmConfig\n")
        path = tmp_path
    else:
        top = tmp_path / "vllm-0.25.1" if layout == "sdist-one-level-down" else tmp_path
        (top / "vllm").mkdir(parents=True)
        (top / "vllm" / "__init__.py").write_text("")
        (top / "vllm" / "spec_token_indx.py").write_bytes(b"\n")
        path = {"the-package-itself": top / "vllm", "one-file": top / "vllm" / "__init__.py"}.get(
            layout, tmp_path
        )
    before = snapshot(tmp_path)
    for argv in (["scan"], ["apply"], ["apply", "--check"], ["revert"]):
        code, out, err = run(capsys, *argv, str(path))
        if layout == "one-file" and argv != ["revert"]:
            # A gate on one file that holds no site must not pass (D2).
            assert code == 2 and err.count("\n") == 1 and "no site of" in err, (argv, err)
            continue
        assert (code, err) == (0, ""), (argv, err)
        assert "nothing" in out or "no GDN spec path" in out
    assert snapshot(tmp_path) == before and not list(tmp_path.rglob(atomic.STATE_DIR))


# -- files and folders that cannot be written --------------------------------------


def _chattr(flag: str, path: Path) -> bool:
    """``chattr +i``/``-i``: a real immutable file or folder, where allowed."""
    if shutil.which("chattr") is None:
        return False
    proc = subprocess.run(["chattr", flag, str(path)], capture_output=True)
    return proc.returncode == 0


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    if not _chattr("+i", path):
        pytest.skip("chattr +i is not allowed here (the simulated case still runs)")
    try:
        yield
    finally:
        _chattr("-i", path)


@pytest.mark.parametrize("how", ["immutable", "simulated"])
def test_file_without_write_permission(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """Root ignores mode bits: a real immutable file (``chattr +i``), or
    EACCES from the open the engine checks writability with."""
    target = affected_tree / SITE
    before = snapshot(affected_tree)
    if how == "simulated":
        real_open = Path.open

        def open_(self: Path, mode: str = "r", *args: object, **kwargs: object) -> object:
            if self == target and ("+" in mode or "w" in mode):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real_open(self, mode, *args, **kwargs)  # type: ignore[call-overload]

        monkeypatch.setattr(Path, "open", open_)
        ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    else:
        ctx = immutable(target)
    with ctx:
        code, _, err = run(capsys, "apply", str(affected_tree))
        after = snapshot(affected_tree)
    assert code == 2
    refused(err, str(target), "cannot write")
    assert after == before
    no_records(capsys, affected_tree)


@pytest.mark.parametrize("how", ["immutable", "simulated"])
def test_read_only_directory(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """No file can be created beside the target (the temporary a write
    needs): a real immutable folder, or EROFS from ``mkstemp`` there."""
    target = affected_tree / SITE
    folder = target.parent
    before = snapshot(affected_tree)
    if how == "simulated":
        real_mkstemp = tempfile.mkstemp

        def mkstemp(*args: object, **kwargs: object) -> tuple[int, str]:
            if Path(str(kwargs.get("dir"))) == folder:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder))
            return real_mkstemp(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
        ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    else:
        ctx = immutable(folder)
    with ctx:
        code, _, err = run(capsys, "apply", str(affected_tree))
        after = snapshot(affected_tree)
    assert code == 2
    refused(err, str(target), "cannot write", str(folder))
    assert after == before
    no_records(capsys, affected_tree)


def _two_affected(root: Path) -> tuple[Path, Path]:
    first, second = root / "vllm" / "a_layer.py", root / "vllm" / "b_layer.py"
    first.parent.mkdir(parents=True, exist_ok=True)
    first.write_text(AFFECTED)
    second.write_text(AFFECTED)
    (root / "vllm" / "__init__.py").write_text("")
    return first, second


def test_rename_failing_half_way_leaves_nothing_changed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files to patch; the second rename fails (EROFS): the first, already
    replaced, gets its original back, and no record is left behind."""
    first, second = _two_affected(tmp_path)
    before = snapshot(tmp_path)
    real_replace = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if Path(dst) == second:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run(capsys, "apply", str(tmp_path))
    assert code == 2
    refused(err, str(second), "cannot write")
    assert snapshot(tmp_path) == before
    assert not list(tmp_path.rglob("*.tmp"))
    monkeypatch.undo()
    no_records(capsys, tmp_path)
    assert run(capsys, "apply", str(tmp_path))[0] == 0
    assert first.read_text() == second.read_text() == FIXED


# -- two sites, huge files -------------------------------------------------------------


def _second_class(text: str, name: str) -> str:
    return text.replace("class Layer:", f"class {name}:", 1)


def test_two_sites_in_one_file_are_both_patched(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    target = affected_tree / SITE
    target.write_text(AFFECTED + "\n\n" + _second_class(AFFECTED, "OtherLayer"))
    before = snapshot(affected_tree)
    code, out, _ = run(capsys, "apply", str(affected_tree), "--json")
    assert code == 0
    assert out.count('"changed": true') == 2
    assert target.read_text() == FIXED + "\n\n" + _second_class(FIXED, "OtherLayer")
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert snapshot(affected_tree) == before


def test_two_sites_with_one_name_are_both_patched(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    """The same ``Layer._forward_core`` twice (two arms of an ``if``)."""

    def arms(text: str) -> str:
        body = "".join("    " + line if line.strip() else line for line in text.splitlines(True))
        return f"if USE_FORK:\n{body}else:\n{body}"

    target = affected_tree / SITE
    target.write_text(arms(AFFECTED))
    code, out, _ = run(capsys, "apply", str(affected_tree), "--json")
    assert code == 0 and out.count('"changed": true') == 2
    assert target.read_text() == arms(FIXED)


def test_a_file_with_an_affected_and_an_unknown_site_is_refused_whole(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    target = affected_tree / SITE
    target.write_text(AFFECTED + "\n\n" + WRAPPED)
    before = snapshot(affected_tree)
    code, _, err = run(capsys, "apply", str(affected_tree))
    assert code == 2
    refused(err, str(target), "spec_step", "not a known kernel")
    assert snapshot(affected_tree) == before


def test_a_broken_file_naming_a_field_is_refused_not_skipped(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    """A file that names a spec-token field and defines a function may hold a
    site: one that cannot be parsed stops the scan with its reason (it is
    never silently skipped); one with no function at all is not read."""
    notes = affected_tree / "vllm" / "notes.py"
    notes.write_bytes(b"def f(:\n    spec_token_indx\n\xff\n")
    code, out, err = run(capsys, "scan", str(affected_tree), "--json")
    assert code == 2
    refused(err, str(notes), "not valid UTF-8")
    notes.write_bytes(b"# spec_token_indx rows\nX = (:\n")
    code, out, err = run(capsys, "scan", str(affected_tree), "--json")
    assert (code, err) == (1, "")
    assert [s["path"] for s in json.loads(out)["sites"]] == [SITE.as_posix()]


def test_a_large_file_is_parsed_only_if_it_may_hold_a_site(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2.5 MiB of generated data naming a field but defining no function
    (issue 13: a 43 MB file took scan 12.8 s): never decoded or parsed. With
    a function (its ``def`` across a 1 MiB read boundary), it is read whole
    and scanned."""
    from gdn_backport import files

    decoded: list[Path] = []
    real_decode = files.decode

    def decode(path: Path, data: bytes) -> str:
        decoded.append(path)
        return real_decode(path, data)

    monkeypatch.setattr(files, "decode", decode)
    big = affected_tree / "vllm" / "table.py"
    row = b"ROW = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20)\n"
    body = row * (5 * 2**19 // len(row))
    big.write_bytes(b"# rows indexed by spec_token_indx\n" + body)
    assert run(capsys, "scan", str(affected_tree))[0] == 1
    assert big not in decoded
    # A comment pads to the 1 MiB read boundary: ``def `` straddles it.
    data = big.read_bytes()
    line = data.rindex(b"\n", 0, files.CHUNK - 2) + 1
    pad = b"#" * (files.CHUNK - 2 - line) + b"\n"
    func = b"def rows(md):\n    return md.spec_state_indices_tensor\n"
    big.write_bytes(data[:line] + pad + func + data[line:])
    assert big.read_bytes().index(b"def rows") == files.CHUNK - 1
    assert run(capsys, "scan", str(affected_tree))[0] == 1
    assert big in decoded


@pytest.mark.network
def test_huge_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A real site padded with megabytes of unrelated code: scan finds it;
    apply refuses, above the size it can rewrite in reasonable time."""
    real = sources.release_tree("0.27.1") / "vllm/model_executor/layers/mamba/gdn"
    text = (real / "qwen_gdn_linear_attn.py").read_text(encoding="utf-8")
    line = text[: text.index("    def _forward_core(")].count("\n") + 1
    pad = []
    size = len(text)
    i = 0
    while size < engine.MAX_REWRITE_BYTES + 512 * 1024:
        chunk = f"\n\ndef unrelated_{i}(x, y=3):\n    z = x * y + {i}\n    return [z] * y\n"
        pad.append(chunk)
        size += len(chunk)
        i += 1
    target = tmp_path / "vllm" / "huge.py"
    target.parent.mkdir()
    target.write_text(text + "".join(pad), encoding="utf-8")
    before = snapshot(tmp_path)
    code, out, _ = run(capsys, "scan", str(tmp_path), "--json")
    assert code == 1 and f'"line": {line},' in out
    code, _, err = run(capsys, "apply", str(tmp_path))
    assert code == 2
    refused(err, str(target), "too large to rewrite")
    assert snapshot(tmp_path) == before


# -- other processes: a second run, a run killed mid-write -----------------------------

# Runs ``apply`` in a child that stops (and waits to be killed) at one point
# of the write: ``stage`` half-way through writing the target's temporary,
# ``rename`` just before the target is replaced, ``renamed`` just after,
# ``between`` before the second of two files is replaced.
_CHILD = r"""
import os, sys, time
from pathlib import Path
from gdn_backport import atomic, cli

point, target, ready, tree = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

def stop():
    ready.write_text(point)
    time.sleep(600)

real_stage, real_commit = atomic.stage, atomic.commit

def stage(path, data, like=None):
    if point == "stage" and path == target:
        tmp = real_stage(path, data[: len(data) // 2], like)
        stop()
    return real_stage(path, data, like)

def commit(staged, path):
    if point in ("rename", "between") and path == target:
        stop()
    real_commit(staged, path)
    if point == "renamed" and path == target:
        stop()

atomic.stage, atomic.commit = stage, commit
sys.exit(cli.main(["apply", tree]))
"""


def _child(point: str, target: Path, tree: Path, ready: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, point, str(target), str(ready), str(tree)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            stderr = proc.communicate()[1].decode()
            pytest.fail(f"the child never reached {point}: {stderr}")
        time.sleep(0.05)
    return proc


def test_a_second_process_waits_for_the_lock_then_gives_up(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While one run holds the lock (here stopped just before its rename), a
    second apply or revert waits; after GDN_BACKPORT_LOCK_TIMEOUT it gives
    up with one line naming the lock and the holder's pid."""
    monkeypatch.setenv("GDN_BACKPORT_LOCK_TIMEOUT", "0.5")
    target = affected_tree / SITE
    proc = _child("rename", target, affected_tree, tmp_path / "ready")
    before = snapshot(affected_tree)  # the child's staged temporary included
    try:
        for argv in (["apply"], ["revert"]):
            code, _, err = run(capsys, *argv, str(affected_tree))
            assert code == 2
            lock = affected_tree / atomic.STATE_DIR / "lock"
            refused(err, str(lock), f"another gdn-backport run (pid {proc.pid}) holds", "0.5 s")
            assert snapshot(affected_tree) == before
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("point", ["stage", "rename", "renamed", "between"])
def test_killed_mid_write_leaves_whole_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, point: str
) -> None:
    """SIGKILL at each point of a write: every file holds its original bytes
    or its complete new ones, never a mix; the next run completes the job
    and revert then restores every original byte for byte."""
    tree = tmp_path / "tree"
    tree.mkdir()
    first, second = _two_affected(tree)
    before = snapshot(tree)
    target = second if point == "between" else first
    proc = _child(point, target, tree, tmp_path / "ready")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for file in (first, second):
        assert file.read_text() in (AFFECTED, FIXED), point
    if point == "between":
        assert (first.read_text(), second.read_text()) == (FIXED, AFFECTED)
    if point == "renamed":
        assert first.read_text() == FIXED
    # The lock died with the process; a new run finishes the job.
    code, _, err = run(capsys, "apply", str(tree))
    assert code == 0, err
    assert first.read_text() == second.read_text() == FIXED
    assert not list(tree.rglob("*.tmp"))
    assert run(capsys, "revert", str(tree))[0] == 0
    assert snapshot(tree) == before


@pytest.mark.parametrize("then", ["revert", "apply"])
def test_leftovers_of_a_killed_run_are_reported_then_removed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, then: str
) -> None:
    """kill -9 half-way through staging leaves ``.<name>.<random>.tmp`` beside
    the module: scan (and --check) report it, with a warning; revert or apply
    removes it under the lock."""
    tree = tmp_path / "tree"
    tree.mkdir()
    first, _ = _two_affected(tree)
    proc = _child("stage", first, tree, tmp_path / "ready")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [temp] = list(first.parent.glob(f".{first.name}.*.tmp"))
    rel = temp.relative_to(tree).as_posix()
    code, out, err = run(capsys, "scan", str(tree), "--json")
    assert code == 1 and json.loads(out)["leftovers"] == [rel]
    assert err.count("\n") == 1 and "warning: 1 leftover temporary file(s)" in err and rel in err
    code, out, err = run(capsys, "apply", "--check", str(tree))
    assert code == 1 and rel in err and temp.exists()
    code, out, err = run(capsys, then, str(tree), "--json")
    assert code == 0 and err == "", err
    doc = json.loads(out)
    assert (doc["leftovers"], doc["leftovers_removed"]) == ([rel], True)
    assert not temp.exists() and not list(tree.rglob("*.tmp"))
    assert json.loads(run(capsys, "scan", str(tree), "--json")[1])["leftovers"] == []


def test_a_lock_held_by_a_plain_flock(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any holder of the lock (e.g. a wrapper script serialising its own
    runs) makes a writer wait; readers (scan, --check) are not blocked."""
    monkeypatch.setenv("GDN_BACKPORT_LOCK_TIMEOUT", "0.2")
    _two_affected(tmp_path)
    state = tmp_path / atomic.STATE_DIR
    state.mkdir()
    before = snapshot(tmp_path)
    with open(state / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert run(capsys, "scan", str(tmp_path))[0] == 1
        assert run(capsys, "apply", "--check", str(tmp_path))[0] == 1
        code, _, err = run(capsys, "apply", str(tmp_path))
        assert code == 2
        refused(err, str(state / "lock"), "another gdn-backport run holds this tree's lock")
    assert snapshot(tmp_path) == before


# -- no code of the target runs ----------------------------------------------------------

_HOSTILE_KERNEL = """\
from pathlib import Path
Path({marker!r}).write_text("kernel module imported")


def fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v, **kw):
    Path({marker!r}).write_text("kernel called")
    state_idx = kw["ssm_state_indices"]
    if state_idx <= 0:
        return None
"""


def _hostile_tree(root: Path, marker: Path) -> Path:
    """An affected tree whose every module writes ``marker`` if imported or run:
    at top level, in a decorator, in a default argument, in the class body,
    in the method, in the package ``__init__``, and in the kernel module."""
    mark = f"Path({str(marker)!r}).write_text"
    site = AFFECTED.replace(
        "class Layer:\n    def _forward_core(self, mixed_qkv, b, a, core_attn_out):\n",
        "class Layer:\n"
        f'    {mark}("class body")\n\n'
        "    @_mark\n"
        "    def _forward_core(self, mixed_qkv, b, a, core_attn_out,\n"
        f'                      _default={mark}("default argument")):\n'
        f'        {mark}("method")\n',
    )
    assert site != AFFECTED
    header = (
        "from pathlib import Path\n"
        f'{mark}("module top level")\n\n\n'
        "def _mark(fn):\n"
        f'    {mark}("decorator")\n'
        "    return fn\n\n\n"
    )
    files = {
        SITE: header + site,
        Path("vllm/__init__.py"): f'from pathlib import Path\n{mark}("package")\n',
        Path("vllm/model_executor/layers/fla/ops/fused_sigmoid_gating.py"): (
            _HOSTILE_KERNEL.format(marker=str(marker))
        ),
        Path("setup.py"): f'from pathlib import Path\n{mark}("setup.py")\n',
        Path("conftest.py"): f'from pathlib import Path\n{mark}("conftest")\n',
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("strategy", ["gather", "kernel"])
def test_scan_apply_revert_execute_nothing_of_the_target(tmp_path: Path, strategy: str) -> None:
    """In a fresh interpreter whose working directory (first on sys.path) is
    the target tree: an import of ``vllm`` or any exec of target code would
    write the marker."""
    marker = tmp_path / "EXECUTED"
    tree = _hostile_tree(tmp_path / "tree", marker)
    before = snapshot(tree)

    def cli(*argv: str) -> int:
        proc = subprocess.run(
            [sys.executable, "-m", "gdn_backport", *argv],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert not marker.exists(), f"{argv}: target code ran: {marker.read_text()}"
        return proc.returncode

    assert cli("scan", str(tree)) == 1
    assert cli("apply", "--check", str(tree)) == 1
    assert cli("apply", "--dry-run", "--strategy", strategy, str(tree)) == 0
    assert cli("apply", "--strategy", strategy, str(tree)) == 0
    assert snapshot(tree) != before
    assert cli("scan", str(tree)) == 0
    assert cli("revert", str(tree)) == 0
    assert snapshot(tree) == before
