"""ahead.py: work run in a forked child, its value and analyses handed back."""

from __future__ import annotations

import os
import pickle
import sys
import zlib
from typing import Any

import pytest

from gdn_backport import ahead, cache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork: Linux only")


@pytest.fixture(autouse=True)
def _forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GDN_BACKPORT_JOBS", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})


def test_the_value_comes_from_another_process_with_what_it_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def work() -> tuple[int, list[str]]:
        print("from the child")
        return os.getpid(), ["a", "b"]

    child = ahead.start(work)
    assert child is not None
    got = child.take()
    assert got is not None
    pid, value = got[0]
    assert pid != os.getpid() and value == ["a", "b"]
    assert capsys.readouterr().out == "from the child\n"


def test_the_childs_analyses_join_this_commands_memory() -> None:
    name = cache.key("test.ahead", "content")
    with cache.run():
        child = ahead.start(lambda: cache.cached(name, lambda: 41 + 1, lambda v: v, int))
        assert child is not None and child.take() == (42,)
        # Read back from memory: the compute here would give another answer.
        assert cache.cached(name, lambda: -1, lambda v: v, int) == 42


@pytest.mark.parametrize(
    "work",
    [
        lambda: 1 / 0,  # raised: the caller runs it itself, with its traceback
        lambda: lambda: None,  # a value that does not pickle
        lambda: os._exit(3),  # died without a word
    ],
)
def test_a_child_that_gives_nothing_usable_is_no_result(work: object) -> None:
    child = ahead.start(work)  # type: ignore[arg-type]
    assert child is not None
    assert child.take() is None


def test_drop_stops_the_child() -> None:
    child = ahead.start(lambda: __import__("time").sleep(60))
    assert child is not None
    pid = child._pid
    child.drop()
    assert pid is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_no_fork_when_turned_off_or_not_the_process_own_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GDN_BACKPORT_JOBS", "1")
    assert ahead.start(lambda: 1) is None
    monkeypatch.delenv("GDN_BACKPORT_JOBS")
    ahead.allow(False)
    assert ahead.start(lambda: 1) is None  # a caller's process (threads)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setenv("GDN_BACKPORT_JOBS", "2")
    assert ahead.start(lambda: 1) is None  # one CPU: nothing to gain


def test_no_fork_beside_another_thread_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.delenv("GDN_BACKPORT_JOBS")
    ahead.allow(True)
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    try:
        assert ahead.start(lambda: 1) is None
        monkeypatch.setenv("GDN_BACKPORT_JOBS", "2")
        child = ahead.start(lambda: 1)
        assert child is not None and child.take() == (1,)
    finally:
        ahead.allow(False)


@pytest.mark.parametrize(
    ("version", "command"),
    [
        ("0.25.1", "scan"),  # both patchsets affected
        ("0.33.0", "scan"),  # the first patchset's parses fed from the child
        ("0.27.1", "scan-first"),  # the first patchset alone: a child only feeding it
        ("0.25.1", "apply"),  # both rewrite: pr51565 keeps its plan made ahead
        ("0.33.0", "apply"),  # pr51812 rewrites nothing
        ("0.19.1", "apply"),  # pr51565 refuses
    ],
)
def test_a_release_reads_the_same_with_and_without_the_child(
    release: Any, version: str, command: str
) -> None:
    """The CLI's own process, with and without the later patchset ahead:
    the same document, the same stderr, the same exit code."""
    import subprocess

    argv = [command, "--json", str(release(version))]
    if command == "scan-first":
        from gdn_backport import registry

        argv = ["scan", "--patchset", registry.discover()[0].info.id, *argv[1:]]
    if command == "apply":
        argv.insert(1, "--dry-run")
    seen = []
    for jobs in ("1", "2"):
        env = {**os.environ, "GDN_BACKPORT_NO_CACHE": "1", "GDN_BACKPORT_JOBS": jobs}
        done = subprocess.run(
            [sys.executable, "-m", "gdn_backport", *argv], capture_output=True, env=env
        )
        seen.append((done.returncode, done.stdout, done.stderr))
    assert seen[0] == seen[1]
    assert seen[0][1].startswith(b"{")


def test_beside_stops_the_child_where_the_first_raises() -> None:
    started: list[int] = []
    real = ahead.start

    def spy(fn: Any, *more: Any) -> Any:
        child = real(fn, *more)
        started.append(child._pid)
        return child

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ahead, "start", spy)
        with pytest.raises(ZeroDivisionError):
            ahead.beside(lambda: 1 / 0, lambda: __import__("time").sleep(60))
    (pid,) = started
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # killed and reaped, not left to sleep
    assert ahead.beside(lambda: 1, lambda: 2) == (1, (2,))
    assert ahead.beside(lambda: 1, None) == (1, None)


def _feed() -> ahead.Feed:
    feed = ahead.Feed.create()
    assert feed is not None
    return feed


def test_a_feed_hands_over_each_value_whole_by_its_key() -> None:
    feed = _feed()
    try:
        assert feed.offered("a") is None  # nothing sent yet
        feed.put("a", {"x": [1, 2]})
        feed.put("b", "two")
        assert feed.offered("b") == "two"
        assert feed.offered("a") == {"x": [1, 2]}
        assert feed.offered("a") == {"x": [1, 2]}  # again: a caller may forget it
    finally:
        feed.close()


def test_a_value_pickled_by_the_caller_reads_back_as_put_would_give_it() -> None:
    feed = _feed()
    try:
        feed.put_pickled("mine", pickle.dumps(("pickled", 1)))
        feed.put("theirs", ("put", 2))
        assert feed.offered("mine") == ("pickled", 1)
        assert feed.offered("theirs") == ("put", 2)
    finally:
        feed.close()


def _record(key: str, value: object, crc: int | None = None) -> bytes:
    name = key.encode()
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    crc = zlib.crc32(data, zlib.crc32(name)) if crc is None else crc
    return ahead.Feed._HEAD.pack(hash(key), len(name), len(data), crc) + name + data


def test_a_record_being_written_is_not_read_and_a_damaged_one_turns_the_feed_off() -> None:
    feed = _feed()
    try:
        feed.put("whole", 1)
        late = _record("late", "late")
        os.write(feed._fd, late[:-1])  # the child is still writing it
        assert feed.offered("late") is None
        assert feed.offered("whole") == 1
        os.write(feed._fd, late[-1:])
        assert feed.offered("late") == "late"
        os.write(feed._fd, _record("bad", "bad", crc=0))
        feed.put("after", 2)
        assert feed.offered("bad") is None  # CRC mismatch: not taken
        assert feed.offered("after") is None  # and nothing more from this feed
    finally:
        feed.close()


def test_a_key_is_compared_whole_not_by_its_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    feed = _feed()
    try:
        os.write(
            feed._fd,
            _record("other", "wrong")[:8].replace(
                ahead.Feed._HASH.pack(hash("other")), ahead.Feed._HASH.pack(hash("mine"))
            )
            + _record("other", "wrong")[8:],
        )  # a collision: the hash of "mine", another key
        assert feed.offered("mine") is None
        feed.put("mine", "right")
        assert feed.offered("mine") == "right"
    finally:
        feed.close()


def test_the_child_learns_what_the_parent_took_and_when_it_is_done() -> None:
    feed = _feed()
    try:
        feed.offered("mine")  # the parent asked (and computed it itself)
        assert feed.taken("mine") and not feed.taken("other")
        assert feed.wanted()
        feed.done()
        assert not feed.wanted()
    finally:
        feed.close()


def test_the_parent_takes_what_the_child_prepared_while_it_runs() -> None:
    def prepare(feed: ahead.Feed) -> None:
        feed.put("k", os.getpid())

    def first() -> object:
        import time

        deadline = time.monotonic() + 30
        while (got := ahead.offered("k")) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return got

    got, rest = ahead.beside(first, lambda: "later", prepare)
    assert isinstance(got, int) and got != os.getpid()
    assert rest == ("later",)
    assert ahead.offered("k") is None  # the feed is the run's only


def test_the_child_stops_preparing_when_the_parent_is_done() -> None:
    import time

    def prepare(feed: ahead.Feed) -> None:
        while feed.wanted():  # a preparation the parent never takes
            time.sleep(0.01)

    t0 = time.monotonic()
    assert ahead.beside(lambda: 1, lambda: 2, prepare) == (1, (2,))
    assert time.monotonic() - t0 < 20


def test_a_child_runs_its_exit_hooks_before_it_exits(tmp_path: Any) -> None:
    """A child never returns into the caller's stack (no finally of the
    caller runs there): what must happen at its end is a hook."""
    done = tmp_path / "done"
    removed = tmp_path / "removed"

    def hook() -> None:
        done.write_text(str(os.getpid()))

    def gone() -> None:
        removed.write_text("ran")

    ahead.at_child_exit(hook)
    ahead.at_child_exit(gone)
    ahead.at_child_exit(gone, remove=True)
    try:
        child = ahead.start(lambda: os.getpid())
        assert child is not None
        got = child.take()
    finally:
        ahead.at_child_exit(hook, remove=True)
    assert got is not None and done.read_text() == str(got[0]) != str(os.getpid())
    assert not removed.exists()
    assert ahead._child_exits == []
