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
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


LOCK = "lock"
# How long a run waits for another run's lock (seconds); the environment's
# GDN_BACKPORT_LOCK_TIMEOUT overrides it.
DEFAULT_LOCK_TIMEOUT = 120.0
# Locks this process holds: realpath of the lock file -> [fd, depth]. A run
# that holds its tree's lock may call code that takes it again (``apply
# --commit`` runs apply, and revert on a git failure).
_HELD: dict[str, list[int]] = {}


def lock_timeout() -> float:
    raw = os.environ.get("GDN_BACKPORT_LOCK_TIMEOUT")
    if raw is None:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(f"GDN_BACKPORT_LOCK_TIMEOUT={raw!r}: expected a number of seconds >= 0")
    return value


GITIGNORE = ".gitignore"
# The records folder ignores itself: it stays out of the user's git status and
# commits without touching their own .gitignore.
GITIGNORE_TEXT = b"*\n"


def ensure_gitignore(state: Path) -> None:
    """Make ``state/.gitignore`` hold exactly :data:`GITIGNORE_TEXT`.

    A missing, empty or edited one (a full disk used to leave it empty, and
    ``git add -A`` then committed the records) is replaced, atomically: a
    failed write leaves the old file or none, never a partial one. UsageError
    (naming the file) if it cannot be written."""
    path = state / GITIGNORE
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
    if mode is not None and stat.S_ISDIR(mode):
        raise UsageError(
            f"{path}: a folder, not the file that keeps the records out of git: remove it"
        )
    if mode is not None and stat.S_ISREG(mode):
        with contextlib.suppress(OSError):
            if path.read_bytes() == GITIGNORE_TEXT:
                return
    staged = stage(path, GITIGNORE_TEXT)
    try:
        commit(staged, path)
    except OSError as exc:
        staged.unlink(missing_ok=True)
        raise UsageError(f"{path}: cannot write ({exc.strerror})") from exc


def _make_state(state: Path) -> bool | None:
    """Make the records folder if missing: True if made here, False if it
    was there, None if it cannot be made for lack of permission (a
    read-only tree: nothing can be written there, so nothing to serialise)."""
    try:
        mode = os.lstat(state).st_mode
    except FileNotFoundError:
        try:
            state.mkdir()
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return None
            raise UsageError(f"{state}: cannot create the lock ({exc.strerror})") from exc
        try:
            ensure_gitignore(state)
        except UsageError:
            # Without it the records would be committed: refuse, and leave
            # no folder behind.
            with contextlib.suppress(OSError):
                state.rmdir()
            raise
        return True
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        raise UsageError(
            f"{state}: not a folder (a symbolic link?); gdn-backport keeps its lock and "
            "records in a real folder of the tree: remove it"
        )
    return False


def _holder(fd: int) -> str:
    """`` (pid N)`` as the holder wrote it in the lock file, or ``""``."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return f" (pid {int(os.pread(fd, 32, 0).split()[0])})"
    return ""


@dataclass
class _Held:
    fd: int
    made_state: bool  # the records folder was made for this lock
    made_lock: bool  # the lock file was
    was: bytes  # what the lock file held before this run wrote its pid in it
    entries: frozenset[str]  # the records folder's entries then, the lock aside


def _entries(state: Path) -> frozenset[str]:
    return frozenset(p.name for p in state.iterdir()) - {LOCK}


def _open_lock(lock: Path) -> tuple[int, bool]:
    """The lock file's fd, and whether it was made here (FileNotFoundError
    if the folder is gone)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    try:
        return os.open(lock, flags), False
    except FileNotFoundError:
        return _open_lock(lock)  # removed by the run that made it, just now


def _acquire(state: Path, timeout: float) -> _Held | None:
    """Open and lock ``state/lock``, waiting up to ``timeout`` seconds; None
    on a read-only tree."""
    lock = state / LOCK
    start = time.monotonic()
    delay, told = 0.01, False
    while True:
        created = _make_state(state)
        if created is None:
            return None
        try:
            fd, made_lock = _open_lock(lock)
        except FileNotFoundError:
            continue  # the holder we waited for removed the folder: make it again
        except OSError as exc:
            raise UsageError(f"{lock}: cannot create the lock ({exc.strerror})") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise UsageError(f"{lock}: cannot lock ({exc.strerror})") from exc
            holder = _holder(fd)
            os.close(fd)
            waited = time.monotonic() - start
            if waited >= timeout:
                raise UsageError(
                    f"{lock}: another gdn-backport run{holder} holds this tree's lock; "
                    f"gave up after {timeout:g} s (GDN_BACKPORT_LOCK_TIMEOUT sets the wait)"
                ) from exc
            if not told and waited >= 1.0 and sys.stderr.isatty():
                print(f"gdn-backport: waiting for {lock}{holder} ...", file=sys.stderr)
                told = True
            time.sleep(min(delay, max(timeout - waited, 0.0)))
            delay = min(delay * 2, 0.1)
            continue
        # The run we waited for may have removed the lock file as it ended:
        # a lock on a file no longer there serialises nothing.
        try:
            now = os.stat(lock, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is None or (now.st_ino, now.st_dev) != (mine.st_ino, mine.st_dev):
            os.close(fd)
            continue
        was = b""
        with contextlib.suppress(OSError):
            was = os.pread(fd, max(os.fstat(fd).st_size, 0), 0)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return _Held(fd, created, made_lock, was, _entries(state))


def _release(state: Path, held: _Held) -> None:
    """Leave the records folder as the run found it where the run added
    nothing (a refusal): no folder or lock file made for it, the lock
    file's bytes as they were. Done while still locked: a waiter then finds
    its lock file gone and retries."""
    try:
        now = _entries(state)
        if held.made_state and now <= {GITIGNORE}:
            for name in (GITIGNORE, LOCK):
                (state / name).unlink(missing_ok=True)
            state.rmdir()
        elif held.made_lock and now == held.entries:
            (state / LOCK).unlink()
        else:
            os.ftruncate(held.fd, 0)
            os.pwrite(held.fd, held.was, 0)
    except OSError:
        pass


@contextlib.contextmanager
def tree_lock(root: Path, timeout: float | None = None) -> Iterator[None]:
    """Serialise the runs that write one tree, over their whole run.

    A second run waits for the first (up to ``timeout``, default
    :func:`lock_timeout`), then sees its result; on timeout UsageError names
    the lock and the holder's pid (written in the lock file while it is
    held). Taking the lock again in the same process is a no-op. A run that
    added nothing to the records folder leaves it as it was (see
    :func:`_release`): a refusal changes no byte there."""
    state = root / STATE_DIR
    key = os.path.realpath(state / LOCK)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    held = _acquire(state, lock_timeout() if timeout is None else timeout)
    if held is None:
        yield  # read-only tree: any write is refused by its own checks
        return
    _HELD[key] = [held.fd, 1]
    try:
        yield
    finally:
        del _HELD[key]
        try:
            _release(state, held)
        finally:
            os.close(held.fd)
