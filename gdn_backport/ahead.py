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
and stops when the parent's work is over. It feeds before the later work
where that is short (a scan), after it where the parent would wait for it
(a plan: another patchset's rewrite and proof can outlast the first's). A
value is taken only whole: each record carries its length and a CRC, and a
record that fails the check turns the feed off.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import struct
import sys
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


# What a forked child runs before it exits: it never returns into the
# caller's stack, so the caller's finally blocks do not run there.
_child_exits: list[Callable[[], None]] = []


def at_child_exit(fn: Callable[[], None], remove: bool = False) -> None:
    """Run ``fn`` in a child of :func:`start` before it exits (``remove``:
    no longer)."""
    if remove:
        with contextlib.suppress(ValueError):
            _child_exits.remove(fn)
    else:
        _child_exits.append(fn)


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

    # The key's hash (the same in a forked child: one hash seed), the
    # lengths of the key and the value, the CRC-32 of both.
    _HEAD = struct.Struct("<qIII")
    _HASH = struct.Struct("<q")

    def __init__(self, fd: int, asked: tuple[int, int]) -> None:
        self._fd = fd
        self._asked_r, self._asked_w = asked
        self._end = 0  # how far the parent has indexed
        self._where: dict[int, list[tuple[int, int, int, int]]] = {}
        self._broken = False
        self._taken: set[int] = set()
        self._over = False

    @classmethod
    def create(cls) -> Feed | None:
        try:
            fd = _unlinked_file()
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

    # -- the child ---------------------------------------------------------
    def put(self, key: str, value: object) -> None:
        """``value`` for ``key``, appended whole or not at all (a short write
        leaves a record the parent never completes)."""
        self.put_pickled(key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))

    def put_pickled(self, key: str, data: bytes) -> None:
        """:meth:`put` of a value the caller pickled (``pickle.loads`` reads
        it back), for values with a faster pickler of their own."""
        name = key.encode("utf-8", "surrogatepass")
        crc = zlib.crc32(data, zlib.crc32(name))
        record = self._HEAD.pack(hash(key), len(name), len(data), crc) + name + data
        view = memoryview(record)
        while view:
            view = view[os.write(self._fd, view) :]

    def wanted(self) -> bool:
        """The parent still runs the work this feed serves."""
        self._drain()
        return not self._over

    def taken(self, key: str) -> bool:
        """The parent has asked for ``key`` already: it computed it itself
        (by hash: a collision costs one value not made, never a wrong one)."""
        self._drain()
        return hash(key) in self._taken

    def _drain(self) -> None:
        size = self._HASH.size
        while not self._over:
            try:
                chunk = os.read(self._asked_r, size * 512)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._over = True
                return
            # Hashes are written whole (8 bytes, far below PIPE_BUF).
            self._taken.update(h for (h,) in self._HASH.iter_unpack(chunk))

    # -- the parent --------------------------------------------------------
    def offered(self, key: str) -> object | None:
        """The value the child sent for ``key``, or None (not sent yet, or
        the feed is off). The key is compared whole."""
        if self._broken:
            return None
        digest = hash(key)
        with contextlib.suppress(OSError):  # full: the child makes one more
            os.write(self._asked_w, self._HASH.pack(digest))
        self._index()
        name = key.encode("utf-8", "surrogatepass")
        for at, key_size, size, crc in self._where.get(digest, ()):
            if key_size != len(name):
                continue
            data = os.pread(self._fd, key_size + size, at)
            if len(data) != key_size + size or zlib.crc32(data) != crc:
                self._broken = True
                return None
            if data[:key_size] != name:
                continue
            try:
                value: object = pickle.loads(data[key_size:])
            except Exception:
                self._broken = True
                return None
            return value
        return None

    def _index(self) -> None:
        end = os.fstat(self._fd).st_size
        head = self._HEAD.size
        while self._end + head <= end:
            digest, key_size, size, crc = self._HEAD.unpack(os.pread(self._fd, head, self._end))
            if self._end + head + key_size + size > end:
                break  # being written
            self._where.setdefault(digest, []).append((self._end + head, key_size, size, crc))
            self._end += head + key_size + size

    def done(self) -> None:
        """The parent's work is over: the child stops feeding."""
        with contextlib.suppress(OSError):
            os.close(self._asked_w)

    def close(self) -> None:
        for fd in (self._fd, self._asked_r, self._asked_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._broken = True


def _unlinked_file() -> int:
    """A file no one else can open, in memory where ``/dev/shm`` is."""
    for folder in ("/dev/shm", None):
        if folder is not None and hasattr(os, "O_TMPFILE"):
            with contextlib.suppress(OSError):
                return os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
    import tempfile

    with tempfile.TemporaryFile() as fh:
        return os.dup(fh.fileno())


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


def start(
    fn: Callable[[], T] | None, prepare: Prepare | None = None, feed_first: bool = True
) -> Ahead[T] | None:
    """``fn()`` running in a forked child, and ``prepare`` feeding the
    parent (:class:`Feed`) for as long as it wants, before ``fn`` or after
    it (``feed_first``); None where forking is not wanted (:func:`wanted`)
    or fails. Without ``fn`` the value is None."""
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
        if feed is not None:
            feed.forked(child=True)
        if feed_first:
            _feeding(feed, prepare)
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
        if not feed_first:
            _feeding(feed, prepare)
        for exit_fn in _child_exits:
            with contextlib.suppress(Exception):
                exit_fn()
    finally:
        os._exit(0)


def _feeding(feed: Feed | None, prepare: Prepare | None) -> None:
    if feed is not None and prepare is not None:
        with contextlib.suppress(Exception):
            prepare(feed)


def beside(
    first: Callable[[], U],
    later: Callable[[], T] | None,
    prepare: Prepare | None = None,
    feed_first: bool = True,
) -> tuple[U, tuple[T] | None]:
    """``first()`` here while ``later()`` runs in a child (None: no later
    work), the child feeding ``first`` (``prepare``) before the later work
    or after it (``feed_first``: where the later work is short, else the
    parent would wait for its value): the first's value and
    :meth:`Ahead.take`'s (None without ``later``). The child is stopped
    where ``first`` raises."""
    child = start(later, prepare, feed_first) if later is not None or prepare is not None else None
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
