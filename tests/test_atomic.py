"""atomic.py: crash-safe replacement, the writability checks, the per-tree lock.

(Runs as any user: nothing here relies on permission bits, which root ignores.)
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest

from gdn_backport import atomic
from gdn_backport.errors import UsageError


def test_write_atomic_replaces_the_file_keeping_its_mode_and_leaves_no_temporary(
    tmp_path: Path,
) -> None:
    f = tmp_path / "m.py"
    f.write_bytes(b"old\n")
    f.chmod(0o751)
    atomic.write_atomic(f, b"new\n")
    assert f.read_bytes() == b"new\n"
    assert stat.S_IMODE(f.stat().st_mode) == 0o751
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.py"]
    fresh = tmp_path / "fresh.py"
    atomic.write_atomic(fresh, b"x", like=f)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o751


def test_stage_then_commit_is_the_old_file_until_the_commit(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_bytes(b"old")
    staged = atomic.stage(f, b"new")
    assert staged.parent == tmp_path and staged.name.startswith(".m.py.")
    assert staged.name.endswith(".tmp")
    assert f.read_bytes() == b"old" and staged.read_bytes() == b"new"
    atomic.commit(staged, f)
    assert f.read_bytes() == b"new" and not staged.exists()
    assert stat.S_IMODE(atomic.stage(tmp_path / "new.py", b"").stat().st_mode) == 0o644


def test_writability_checks_name_the_file(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_bytes(b"")
    atomic.check_writable(f)
    with pytest.raises(UsageError, match=r"missing\.py: cannot write"):
        atomic.check_writable(tmp_path / "missing.py")
    with pytest.raises(UsageError, match=r"m\.py: cannot write in .*gone"):
        atomic.check_folder(tmp_path / "gone", f)
    with pytest.raises(UsageError, match="cannot create a file beside it"):
        atomic.stage(tmp_path / "gone" / "x.py", b"")
    assert list(tmp_path.iterdir()) == [f]  # the probes are removed


def test_lock_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GDN_BACKPORT_LOCK_TIMEOUT", raising=False)
    assert atomic.lock_timeout() == atomic.DEFAULT_LOCK_TIMEOUT
    monkeypatch.setenv("GDN_BACKPORT_LOCK_TIMEOUT", "2.5")
    assert atomic.lock_timeout() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("GDN_BACKPORT_LOCK_TIMEOUT", bad)
        with pytest.raises(UsageError, match="expected a number of seconds >= 0"):
            atomic.lock_timeout()


def test_a_lock_that_added_nothing_leaves_no_trace(tmp_path: Path) -> None:
    with atomic.tree_lock(tmp_path):
        state = tmp_path / atomic.STATE_DIR
        assert (state / atomic.LOCK).read_text() == f"{os.getpid()}\n"
        assert (state / atomic.GITIGNORE).read_bytes() == atomic.GITIGNORE_TEXT
        with atomic.tree_lock(tmp_path):  # re-entrant in one process
            pass
        assert state.is_dir()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_that_added_records_keeps_the_folder(tmp_path: Path) -> None:
    state = tmp_path / atomic.STATE_DIR
    with atomic.tree_lock(tmp_path):
        (state / "manifest.json").write_text("{}")
    assert sorted(p.name for p in state.iterdir()) == [".gitignore", "lock", "manifest.json"]
    assert (state / atomic.LOCK).read_bytes() == b""  # the pid is taken out again
    (state / atomic.LOCK).unlink()
    # A later run over existing records that adds nothing removes the lock
    # file it made.
    with atomic.tree_lock(tmp_path):
        assert (state / atomic.LOCK).exists()
    assert not (state / atomic.LOCK).exists()


def test_a_held_lock_times_out_naming_its_holder(tmp_path: Path) -> None:
    state = tmp_path / atomic.STATE_DIR
    state.mkdir()
    lock = state / atomic.LOCK
    lock.write_text("4242\n")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: another "run"
        held = r"another gdn-backport run \(pid 4242\) holds"
        with pytest.raises(UsageError, match=held), atomic.tree_lock(tmp_path, timeout=0.05):
            raise AssertionError("not reached")
    finally:
        os.close(fd)
    assert lock.read_text() == "4242\n"


def test_the_records_folder_must_be_a_real_folder(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / atomic.STATE_DIR).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match="not a folder"), atomic.tree_lock(tmp_path, timeout=0):
        pass


def test_ensure_gitignore_repairs_an_edited_one_and_refuses_a_folder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    atomic.ensure_gitignore(state)
    ignore = state / atomic.GITIGNORE
    assert ignore.read_bytes() == b"*\n"
    ignore.write_bytes(b"")
    atomic.ensure_gitignore(state)
    assert ignore.read_bytes() == b"*\n"
    ignore.unlink()
    ignore.mkdir()
    with pytest.raises(UsageError, match="a folder, not the file"):
        atomic.ensure_gitignore(state)
