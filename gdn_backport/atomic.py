"""Crash-safe file replacement and the per-tree lock.

A file is never written in place: the new bytes go to a temporary file in
the same directory, are flushed and fsync'ed, get the original's mode bits,
and only then replace the original with one ``rename`` (atomic on POSIX), so
a reader, or a process killed half-way, sees either the old file or the new
one, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gdn_backport.errors import UsageError

STATE_DIR = ".gdn-backport"


def check_writable(path: Path) -> None:
    """Raise UsageError unless ``path`` can really be replaced.

    ``os.access`` answers for the real uid and lies under root; opening the
    file for update and creating a file beside it are what a write needs.
    """
    try:
        with path.open("r+b"):
            pass
    except OSError as exc:
        raise UsageError(f"{path}: cannot write ({exc.strerror})") from exc
    check_folder(path.parent, path)


def check_folder(folder: Path, needed_for: Path) -> None:
    """Raise UsageError (naming ``needed_for``) unless a file can be created
    in ``folder``: the atomic rename, records, removed bytecode caches."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".gdn-backport.", suffix=".probe")
    except OSError as exc:
        raise UsageError(f"{needed_for}: cannot write in {folder} ({exc.strerror})") from exc
    os.close(fd)
    os.unlink(tmp)


def stage(path: Path, data: bytes, like: Path | None = None) -> Path:
    """Write ``data`` to a fsync'ed temporary beside ``path``; return its name."""
    mode = stat.S_IMODE((like or path).stat().st_mode) if (like or path).exists() else 0o644
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise UsageError(f"{path}: cannot create a file beside it ({exc.strerror})") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UsageError(f"{path}: cannot write ({exc.strerror})") from exc
    return Path(tmp)


def commit(staged: Path, path: Path) -> None:
    os.replace(staged, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_atomic(path: Path, data: bytes, like: Path | None = None) -> None:
    commit(stage(path, data, like), path)


@contextlib.contextmanager
def tree_lock(root: Path) -> Iterator[None]:
    """Serialise writers of one tree; a second run fails at once (exit 2)."""
    state = root / STATE_DIR
    try:
        state.mkdir(exist_ok=True)
        # Keep the sidecar out of the user's git status without touching
        # their .gitignore.
        ignore = state / ".gitignore"
        if not ignore.exists():
            ignore.write_text("*\n")
        fd = os.open(state / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UsageError(f"{state}: cannot create the lock ({exc.strerror})") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(
                    f"{state / 'lock'}: another gdn-backport run is writing this tree"
                ) from exc
            raise
        yield
    finally:
        os.close(fd)
