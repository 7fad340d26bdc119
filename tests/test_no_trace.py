"""A refused run leaves no trace; the records never get into git.

Exit 2 means nothing changed on disk: not the tree, not its records folder
(``.gdn-backport/``, its lock file included), not the git object store. And
the records folder's own ``.gitignore`` is always exactly ``*``: written
atomically, repaired by the next writing run when something (a full disk)
left it empty.
"""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import git
import pytest

from gdn_backport import atomic
from tests.conftest import run
from tests.test_engine import SITE

STATE = atomic.STATE_DIR


@pytest.fixture(autouse=True)
def _no_user_git_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def everything(root: Path) -> dict[str, bytes | str]:
    """Every path below ``root`` but ``.git``, the records folder and its
    lock file included: a file's bytes, ``"folder"``, or a link's target."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in [*dirnames, *sorted(filenames)]:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                out[rel] = "folder"
            else:
                out[rel] = path.read_bytes()
    return out


def one_line(err: str, *needles: str) -> None:
    assert err.count("\n") == 1 and err.startswith("gdn-backport: "), err
    for needle in needles:
        assert needle in err, (needle, err)


def make_repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.config("user.name", "Fork Maintainer")
    repo.git.config("user.email", "fork@example.invalid")
    repo.git.add("-A")
    repo.git.commit("-qm", "vllm tree")
    return repo


class _FullDisk(io.RawIOBase):
    """A file on a full disk: the first write lands half, then ENOSPC."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def write(self, data: Any) -> int:
        self.real.write(data[: len(data) // 2])
        self.real.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return int(self.real.fileno())

    def close(self) -> None:
        self.real.close()
        super().close()


def fill_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on every file opened for writing in a records folder is on a
    full disk (``Path.write_text`` and ``os.fdopen`` both open through
    ``io.open``), until ``monkeypatch`` is undone."""
    real_open = io.open

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        name = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else file
        if set(mode) & set("wax+") and STATE in Path(os.fspath(name)).parts:
            return _FullDisk(fh)
        return fh

    monkeypatch.setattr(io, "open", open_)


def test_a_full_disk_leaves_no_records_folder_and_no_empty_gitignore(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    """D7: the first apply on a full disk is refused in one line and leaves
    no ``.gdn-backport/`` (it used to leave one whose ``.gitignore`` was
    empty, which no later run repaired: ``git add -A`` committed the records)."""
    repo = make_repo(affected_tree)
    before = everything(affected_tree)
    with pytest.MonkeyPatch.context() as mp:
        fill_disk(mp)
        code, out, err = run(capsys, "apply", str(affected_tree))
    assert code == 2, out
    one_line(err, str(affected_tree / STATE), "No space left on device")
    assert everything(affected_tree) == before
    # The disk has room again: the next run keeps its records out of git.
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    assert (affected_tree / STATE / ".gitignore").read_bytes() == b"*\n"
    repo.git.add("-A")
    assert repo.git.diff("--cached", "--name-only").splitlines() == [SITE.as_posix()]


@pytest.mark.parametrize("left", [b"", b"*", b"# edited\n", None], ids=repr)
def test_the_next_writing_run_repairs_the_gitignore(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, left: bytes | None
) -> None:
    """D7: a ``.gitignore`` that is empty (what a full disk left), partial,
    edited or missing holds exactly ``*`` after the next writing run, and
    ``git add -A`` then adds none of the records."""
    repo = make_repo(affected_tree)
    state = affected_tree / STATE
    state.mkdir()
    (state / "manifest.json").write_text('{"format": 2, "records": []}\n')
    if left is not None:
        (state / ".gitignore").write_bytes(left)
    code, _, err = run(capsys, "apply", str(affected_tree))
    assert code == 0, err
    assert (state / ".gitignore").read_bytes() == b"*\n"
    assert not list(state.glob(".*.tmp"))
    repo.git.add("-A")
    staged = repo.git.diff("--cached", "--name-only").splitlines()
    assert staged == [SITE.as_posix()]
