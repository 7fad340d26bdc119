"""Standard output that goes away or fills up, in real processes.

``gdn-backport scan PATH | head -1``: the reader may leave before the
output is written; that is no error of the run (no traceback, exit 141 as
a process killed by SIGPIPE reports, never 1, the "affected" code). Output
that cannot be written (``> /dev/full``) is one line on stderr and exit 2:
a CI gate must not read a failed run's code as a verdict.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARGVS = [["scan"], ["scan", "--json"], ["apply", "--check"], ["apply", "--dry-run"]]


def _spawn(argv: list[str], stdout: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gdn_backport", *argv],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=stdout,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("argv", ARGVS, ids=" ".join)
def test_a_reader_that_left_is_a_quiet_exit(affected_tree: Path, argv: list[str]) -> None:
    """D8: the reader of the pipe is gone before the run writes (``| head
    -1`` once it has its line): no traceback, nothing on stderr, exit 141
    (it used to print a traceback, or Python's 'Exception ignored', and
    exit 1 or 120)."""
    read, write = os.pipe()
    os.close(read)
    proc = _spawn([*argv, str(affected_tree)], write)
    os.close(write)
    _, err = proc.communicate(timeout=120)
    assert err.decode() == ""
    assert proc.returncode == 141


def test_head_1_gets_its_line(affected_tree: Path) -> None:
    """D8: ``scan PATH | head -1`` reads the first line; the run then exits
    0/141 when it could not write the rest, or with its own code when all
    was written before the reader left: never a traceback."""
    read, write = os.pipe()
    proc = _spawn(["scan", str(affected_tree)], write)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        first = pipe.readline()
    _, err = proc.communicate(timeout=120)
    assert first.startswith(b"tree: ")
    assert err.decode() == ""
    assert proc.returncode in (1, 141)  # 1: scan's own verdict, all of it written in time


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("argv", ARGVS, ids=" ".join)
def test_output_to_a_full_disk_is_one_line_and_exit_2(affected_tree: Path, argv: list[str]) -> None:
    """D8: ``scan PATH > /dev/full``: one line naming where the output went
    and why, exit 2 (it used to print a traceback and exit 1 or 120)."""
    with open("/dev/full", "wb") as full:
        proc = _spawn([*argv, str(affected_tree)], full.fileno())
        _, err = proc.communicate(timeout=120)
    text = err.decode()
    assert text.count("\n") == 1 and text.startswith("gdn-backport: /dev/full: "), text
    assert "No space left on device" in text
    assert proc.returncode == 2
