"""A later patchset's work done ahead, in a forked child, while the first one runs.

A cold ``scan`` or ``apply`` is CPU-bound and runs its patchsets one after
the other; on a machine with a second core, the second patchset's work can
run beside the first one's. :func:`start` forks a child that runs a
function and sends back its value (pickled), what it printed, and this
command's analyses it made (:func:`gdn_backport.cache.snapshot`: named by
content, so they are what the parent would have computed).

Nothing here decides whether the child's value is the one the run would
have computed: the caller does (``pipeline``: a scan of another patchset
always is; a plan where the patchsets before it rewrote nothing, or
nothing it reads: ``Patchset.unaffected_by``). A
child that fails in any way (it died, its value does not pickle) is no
result: the caller then computes the value itself, as without a child.

Only a process running its own ``scan``, ``apply`` or ``revert`` forks
(``cli.main``: a caller's process, or ``verify`` running models, may hold
threads, which a fork does not copy), and never beside a second Python
thread; ``GDN_BACKPORT_JOBS=1`` turns it off, any other value (``2``)
forces it on (the tests: pytest-xdist's workers hold a thread that the
child never touches).

A patchset may also give the child work for the *first* patchset's own run
(``registry.Patchset.prepare``): before the later work, the child computes
values the parent would compute (libcst parses of a patchset's candidate
functions) and streams each into a :class:`Feed` under a key that names its
input exactly (the function's text). The parent asks the feed before
computing (:func:`offered`); a key the child has not reached yet is computed
as without a child. The child skips what the parent has asked for already,
and stops when the parent's work is over (the parent waits for the later
work's value only). A value is taken only whole: each record carries its
length and a CRC, and a record that fails the check turns the feed off.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import signal
import struct
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

_state = {"own": False}

# What a child does ahead for the parent's own run, offering values by key
# into a Feed (its ``put``), as long as the parent wants them.
Prepare = Callable[["Feed"], None]


def allow(own: bool) -> None:
    """Whether this process runs its own command (``cli.main``)."""
    _state["own"] = own


def wanted() -> bool:
    """Forking can help here: allowed, on Linux (``fork`` is safe there for
    a single-threaded process), with a second CPU to run on."""
    jobs = os.environ.get("GDN_BACKPORT_JOBS", "")
    if jobs == "1" or (jobs == "" and not _state["own"]):
        return False
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    if jobs == "" and threading.active_count() > 1:  # a fork copies one of them
        return False
    try:
        return len(os.sched_getaffinity(0)) > 1
    except OSError:  # pragma: no cover - a kernel without affinity
        return False


class Feed:
    """Values streamed from a child to its parent, and the parent's progress
    back. Values go through an unlinked file made before the fork (in memory
    where ``/dev/shm`` is): the child appends records (:meth:`put`), the
    parent reads them where it is asked for a key (:meth:`offered`), from
    its own offset (``pread``: the file offset both share is the child's).
    Each key the parent asks for goes back through a pipe, and the pipe's
    end tells the child the parent's work is over (:meth:`taken`,
    :meth:`wanted`): the child stops where the parent caught up with it."""

    _HEAD = struct.Struct("<16sII")  # key digest, length, CRC-32 of the value

    def __init__(self, fd: int, asked: tuple[int, int]) -> None:
        self._fd = fd
        self._asked_r, self._asked_w = asked
        self._end = 0  # how far the parent has indexed
        self._where: dict[bytes, tuple[int, int, int]] = {}
        self._broken = False
        self._taken: set[bytes] = set()
        self._over = False

    @classmethod
    def create(cls) -> Feed | None:
        folder = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        try:
            with tempfile.TemporaryFile(dir=folder) as fh:  # unlinked: nothing left behind
                fd = os.dup(fh.fileno())
        except OSError:
            return None
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        return cls(fd, (read, write))

    def forked(self, child: bool) -> None:
        """Each side keeps its own end of the pipe (the child sees its end
        only when the parent's copy is the last one closed)."""
        with contextlib.suppress(OSError):
            os.close(self._asked_w if child else self._asked_r)

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    # -- the child ---------------------------------------------------------
    def put(self, key: str, value: object) -> None:
        """``value`` for ``key``, appended whole or not at all (a short write
        leaves a record the parent never completes)."""
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        record = self._HEAD.pack(self._digest(key), len(data), zlib.crc32(data)) + data
        view = memoryview(record)
        while view:
            view = view[os.write(self._fd, view) :]

    def wanted(self) -> bool:
        """The parent still runs the work this feed serves."""
        self._drain()
        return not self._over

    def taken(self, key: str) -> bool:
        """The parent has asked for ``key`` already: it computed it itself."""
        self._drain()
        return self._digest(key) in self._taken

    def _drain(self) -> None:
        while not self._over:
            try:
                chunk = os.read(self._asked_r, 16 * 256)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._over = True
                return
            # Digests are written whole (16 bytes, far below PIPE_BUF).
            self._taken.update(chunk[i : i + 16] for i in range(0, len(chunk), 16))

    # -- the parent --------------------------------------------------------
    def offered(self, key: str) -> object | None:
        """The value the child sent for ``key``, or None (not sent yet, or
        the feed is off)."""
        if self._broken:
            return None
        digest = self._digest(key)
        with contextlib.suppress(OSError):  # full: the child parses one more
            os.write(self._asked_w, digest)
        self._index()
        where = self._where.pop(digest, None)
        if where is None:
            return None
        at, size, crc = where
        data = os.pread(self._fd, size, at)
        if len(data) != size or zlib.crc32(data) != crc:
            self._broken = True
            return None
        try:
            value: object = pickle.loads(data)
        except Exception:
            self._broken = True
            return None
        return value

    def _index(self) -> None:
        end = os.fstat(self._fd).st_size
        head = self._HEAD.size
        while self._end + head <= end:
            digest, size, crc = self._HEAD.unpack(os.pread(self._fd, head, self._end))
            if self._end + head + size > end:
                break  # being written
            self._where.setdefault(digest, (self._end + head, size, crc))
            self._end += head + size

    def done(self) -> None:
        """The parent's work is over: the child stops feeding."""
        with contextlib.suppress(OSError):
            os.close(self._asked_w)

    def close(self) -> None:
        for fd in (self._fd, self._asked_r, self._asked_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._broken = True


_feed: list[Feed] = []  # the feed of the child running beside this run, if any


def offered(key: str) -> object | None:
    """What a child computed ahead for ``key`` (:class:`Feed`), or None:
    the caller then computes it, as without a child."""
    return _feed[-1].offered(key) if _feed else None


class Ahead(Generic[T]):
    """A child computing a value; :meth:`take` waits for it."""

    def __init__(self, pid: int, fd: int, feed: Feed | None = None) -> None:
        self._pid: int | None = pid
        self._fd = fd
        self.feed = feed

    def take(self) -> tuple[T] | None:
        """``(value,)`` from the child, or None where it gave nothing usable
        (it raised: the caller runs the work itself and raises it there,
        with its own traceback). Its output is printed, its analyses kept."""
        with os.fdopen(self._fd, "rb") as fh:
            data = fh.read()
        self._reap(kill=False)
        try:
            kind, value, out, err, memo = pickle.loads(data)
        except Exception:  # died, or sent what does not unpickle
            return None
        from gdn_backport import cache

        cache.remember_all(memo)
        if kind != "value":
            return None
        if out:
            sys.stdout.write(out)
        if err:
            sys.stderr.write(err)
        return (value,)

    def drop(self) -> None:
        """The value is not needed: stop the child."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._reap(kill=True)

    def _reap(self, kill: bool) -> None:
        if self.feed is not None:
            self.feed.close()
        if self._pid is None:
            return
        pid, self._pid = self._pid, None
        if kill:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def start(fn: Callable[[], T] | None, prepare: Prepare | None = None) -> Ahead[T] | None:
    """``fn()`` running in a forked child, after ``prepare`` fed the parent
    (:class:`Feed`) for as long as it wanted; None where forking is not
    wanted (:func:`wanted`) or fails. Without ``fn`` the value is None."""
    if not wanted():
        return None
    from gdn_backport import cache

    sys.stdout.flush()
    sys.stderr.flush()
    feed = Feed.create() if prepare is not None else None
    read, write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        if feed is not None:
            feed.close()
        return None
    if pid:
        os.close(write)
        if feed is not None:
            feed.forked(child=False)
        return Ahead(pid, read, feed)
    # The child: never returns into the caller's stack (its finally blocks,
    # the tree lock's release, the exit handlers are the parent's).
    try:
        os.close(read)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        out, err = io.StringIO(), io.StringIO()
        sys.stdout, sys.stderr = out, err
        if feed is not None and prepare is not None:
            # First, while the parent's own work still wants it: after the
            # later work, most of it would come too late to be taken.
            feed.forked(child=True)
            with contextlib.suppress(Exception):
                prepare(feed)
        try:
            kind, value = "value", fn() if fn is not None else None
        except BaseException:
            kind, value = "raised", None
        try:
            data = pickle.dumps(
                (kind, value, out.getvalue(), err.getvalue(), cache.snapshot()),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception:
            data = b""
        with os.fdopen(write, "wb") as fh:
            fh.write(data)
    finally:
        os._exit(0)


def beside(
    first: Callable[[], U], later: Callable[[], T] | None, prepare: Prepare | None = None
) -> tuple[U, tuple[T] | None]:
    """``first()`` here while ``later()`` runs in a child (None: no later
    work), the child feeding ``first`` before (``prepare``): the first's
    value and :meth:`Ahead.take`'s (None without ``later``). The child is
    stopped where ``first`` raises."""
    child = start(later, prepare) if later is not None or prepare is not None else None
    if child is not None and child.feed is not None:
        _feed.append(child.feed)
    try:
        done = first()
    except BaseException:
        if child is not None:
            child.drop()
        raise
    finally:
        if child is not None and child.feed is not None:
            _feed.remove(child.feed)
            child.feed.done()
    if child is None:
        return done, None
    if later is None:
        child.drop()
        return done, None
    return done, child.take()
