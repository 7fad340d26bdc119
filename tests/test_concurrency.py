"""Concurrent runs on one tree: serialised by the lock, never an undo lost.

Each writing run (``apply``, ``revert``, ``apply --commit``) holds the
tree's lock from its first read to its last write; a second run waits and
then works on what the first one left. Invariants, checked while the runs
go (every read of a file) and after each round:

* every file is always either its original or its patched bytes, and the
  tree as a whole (two files, patched together) original or patched when
  no run is going;
* the records match the tree: a patched file has the record of exactly
  those bytes, whose stored original is the original;
* ``revert`` always brings the original bytes back.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import git
import pytest

from gdn_backport import atomic
from gdn_backport.records import Records
from tests.conftest import AFFECTED, FIXED

REPO = Path(__file__).resolve().parents[1]
FILES = ("vllm/model_executor/layers/a_gdn.py", "vllm/model_executor/layers/b_gdn.py")
BRANCH = "gdn-backport/pr51812"
ORIGINAL, PATCHED = AFFECTED.encode(), FIXED.encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(autouse=True)
def _no_user_git_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def make_tree(root: Path, with_git: bool) -> Path:
    for rel in FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(ORIGINAL)
    (root / "vllm" / "__init__.py").write_text("# a fork\n")
    if with_git:
        repo = git.Repo.init(root, initial_branch="main")
        repo.git.config("user.name", "Fork Maintainer")
        repo.git.config("user.email", "fork@example.invalid")
        repo.git.add("-A")
        repo.git.commit("-qm", "vllm tree")
    return root


def spawn(argv: list[str], log: Path) -> int:
    """``gdn-backport ARGV`` in a forked child (no interpreter start-up: many
    runs stay cheap); stdout and stderr go to ``log``.out/.err."""
    pid = os.fork()
    if pid:
        return pid
    code = 70
    try:
        with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
            sys.stdout, sys.stderr = out, err
            try:
                from gdn_backport.cli import main

                code = main(argv)
            except BaseException:
                traceback.print_exc()
            out.flush()
            err.flush()
    finally:
        os._exit(code)


def check_file_bytes(root: Path) -> list[bytes]:
    states = []
    for rel in FILES:
        data = (root / rel).read_bytes()
        assert data in (ORIGINAL, PATCHED), f"{rel}: neither original nor patched"
        states.append(data)
    return states


def check_records(root: Path) -> None:
    """Quiescent: the tree is wholly original or wholly patched, and each
    patched file has the record of its bytes with the right original."""
    states = check_file_bytes(root)
    assert len(set(states)) == 1, "one file patched, the other not"
    records = Records(root)
    for rel, data in zip(FILES, states, strict=True):
        rec = records.matching(rel, sha(data))
        if data == PATCHED:
            assert rec is not None, f"{rel} is patched and has no record"
            assert records.original(rec) == ORIGINAL
    assert not list(root.rglob("*.tmp")), "a temporary was left behind"


def run_round(root: Path, argvs: list[list[str]], logs: Path) -> list[tuple[list[str], int, str]]:
    """Start every run at once; read the files while they go; the results."""
    pids = [spawn([*argv, str(root)], logs / f"{i}") for i, argv in enumerate(argvs)]
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        check_file_bytes(root)
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.002)
    results = []
    for i, (argv, pid) in enumerate(zip(argvs, pids, strict=True)):
        err = (logs / f"{i}.err").read_text()
        results.append((argv, codes[pid], err))
    return results


def check_results(results: list[tuple[list[str], int, str]]) -> None:
    for argv, code, err in results:
        assert "Traceback" not in err, (argv, err)
        if argv[-1] == "--commit":
            # A second --commit finds its branch made, or the tree patched
            # (uncommitted) by a plain apply: a clean refusal.
            assert code in (0, 2), (argv, code, err)
            if code == 2:
                assert err.count("\n") == 1 and err.startswith("gdn-backport: "), err
        else:
            assert code == 0, (argv, code, err)


def reset(root: Path, repo: git.Repo | None, logs: Path) -> None:
    """revert gives the original bytes back; then back on main."""
    [(_, code, err)] = run_round(root, [["revert"]], logs)
    assert code == 0, err
    assert check_file_bytes(root) == [ORIGINAL] * len(FILES)
    if repo is not None:
        if repo.active_branch.name != "main":
            # The work tree holds main's bytes already (reverted).
            repo.git.checkout("-q", "-f", "main")
        if BRANCH in repo.heads:
            repo.git.branch("-D", BRANCH)
        assert repo.git.status("--porcelain") == ""


@pytest.mark.parametrize("with_git", [False, True], ids=["plain", "git"])
def test_stress_parallel_apply_revert_commit(tmp_path: Path, with_git: bool) -> None:
    """Six runs at once, 10 rounds: apply, revert and (on a git tree)
    apply --commit in random order."""
    root = make_tree(tmp_path / "tree", with_git)
    repo = git.Repo(root) if with_git else None
    logs = tmp_path / "logs"
    logs.mkdir()
    ops = [["apply"], ["revert"]] + ([["apply", "--commit"]] if with_git else [])
    rng = random.Random(13)
    committed = 0
    for _ in range(10):
        results = run_round(root, [rng.choice(ops) for _ in range(6)], logs)
        check_results(results)
        committed += sum(argv[-1] == "--commit" and code == 0 for argv, code, _ in results)
        check_records(root)
        reset(root, repo, logs)
        check_records(root)
    assert committed > 0 or not with_git


def test_two_applies_at_once_keep_the_undo_record(tmp_path: Path) -> None:
    """Bug 1 of issue 13: `apply & apply & wait; revert` lost the record (the
    tree patched, the manifest empty, revert finding nothing)."""
    for attempt in range(5):
        root = make_tree(tmp_path / f"tree{attempt}", with_git=False)
        logs = tmp_path / f"logs{attempt}"
        logs.mkdir()
        results = run_round(root, [["apply"], ["apply"]], logs)
        assert [code for _, code, _ in results] == [0, 0], results
        outs = [(logs / f"{i}.out").read_text() for i in range(2)]
        # One patched; the other waited for the lock and found it done.
        assert sum("patched 2 file(s)" in o for o in outs) == 1, outs
        assert sum("nothing to do" in o for o in outs) == 1, outs
        check_records(root)
        [(_, code, err)] = run_round(root, [["revert"]], logs)
        assert code == 0, err
        assert check_file_bytes(root) == [ORIGINAL, ORIGINAL]


@pytest.mark.network
def test_parallel_applies_on_a_real_release_copy(tmp_path: Path) -> None:
    """The issue's reproduction, with the real CLI: `cp -r <0.25.1> cc;
    gdn-backport apply cc & gdn-backport apply cc & wait; gdn-backport revert cc`."""
    from gdn_backport import sources

    tree = sources.copy_release("0.25.1", tmp_path / "cc")
    gdn = tree / "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
    original = gdn.read_bytes()
    builder = tree / "vllm/v1/attention/backends/gdn_attn.py"
    original_builder = builder.read_bytes()
    cli = [sys.executable, "-m", "gdn_backport"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([*cli, "apply", str(tree)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    # Both patchsets: pr51812's layer file, pr51565's builder and runners.
    assert sum("pr51812: patched 1 file(s)" in o for o in outs) == 1
    assert sum("pr51565: patched 3 file(s)" in o for o in outs) == 1
    assert sum("nothing to do" in o and "patched" not in o for o in outs) == 2
    assert gdn.read_bytes() != original
    proc = subprocess.run([*cli, "revert", str(tree)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "restored 4 file(s)" in proc.stdout, proc.stdout
    assert gdn.read_bytes() == original and builder.read_bytes() == original_builder
    shutil.rmtree(tree / atomic.STATE_DIR)
