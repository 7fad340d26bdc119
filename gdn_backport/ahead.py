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
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

_state = {"own": False}


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


class Ahead(Generic[T]):
    """A child computing a value; :meth:`take` waits for it."""

    def __init__(self, pid: int, fd: int) -> None:
        self._pid: int | None = pid
        self._fd = fd

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
        if self._pid is None:
            return
        pid, self._pid = self._pid, None
        if kill:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def start(fn: Callable[[], T]) -> Ahead[T] | None:
    """``fn()`` running in a forked child; None where forking is not wanted
    (:func:`wanted`) or fails."""
    if not wanted():
        return None
    from gdn_backport import cache

    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if pid:
        os.close(write)
        return Ahead(pid, read)
    # The child: never returns into the caller's stack (its finally blocks,
    # the tree lock's release, the exit handlers are the parent's).
    try:
        os.close(read)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        out, err = io.StringIO(), io.StringIO()
        sys.stdout, sys.stderr = out, err
        try:
            kind, value = "value", fn()
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


def beside(first: Callable[[], U], later: Callable[[], T] | None) -> tuple[U, tuple[T] | None]:
    """``first()`` here while ``later()`` runs in a child (None: no later
    work): the first's value and :meth:`Ahead.take`'s. The child is stopped
    where ``first`` raises."""
    child = start(later) if later is not None else None
    try:
        done = first()
    except BaseException:
        if child is not None:
            child.drop()
        raise
    return done, child.take() if child is not None else None
