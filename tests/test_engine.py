"""apply / revert on small trees: writes, refusals, records, lock."""

from __future__ import annotations

import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from gdn_backport import atomic
from gdn_backport.errors import UsageError
from gdn_backport.patchsets.pr51812.plan import apply_tree
from gdn_backport.pipeline import Mode, revert_tree
from gdn_backport.site import Status
from tests.conftest import FIXED

SITE = Path("vllm/model_executor/layers/mamba/gdn_linear_attn.py")


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and atomic.STATE_DIR not in p.parts
    }


def test_apply_writes_the_fix_and_keeps_the_mode(affected_tree: Path) -> None:
    target = affected_tree / SITE
    os.chmod(target, 0o640)
    out = apply_tree(affected_tree)
    assert out.exit_code == 0
    assert out.written == [SITE.as_posix()]
    assert target.read_text() == FIXED
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    [change] = out.changes
    assert (change.site.status, change.status, change.changed) == (
        Status.AFFECTED,
        Status.FIXED,
        True,
    )
    assert "+                a_spec = a.index_select(0, spec_token_indx)" in out.diff


def test_dry_run_and_check_change_nothing(affected_tree: Path) -> None:
    before = snapshot(affected_tree)
    dry = apply_tree(affected_tree, mode=Mode.DRY_RUN)
    assert dry.diff and not dry.written and dry.changes[0].rewritten.status is Status.FIXED
    check = apply_tree(affected_tree, mode=Mode.CHECK)
    assert check.exit_code == 1
    assert snapshot(affected_tree) == before
    assert not (affected_tree / atomic.STATE_DIR).exists()


@pytest.mark.parametrize("strategy", ["gather", "kernel"])
def test_apply_analyses_a_rewritten_file_once_and_proves_it_once(
    affected_tree: Path, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    # Each entry function is walked once to plan (the scan the codemod plans
    # from) and once to prove (the whole tree with every rewrite in place).
    from gdn_backport.patchsets.pr51812.dataflow import FlowWalker

    walked: list[str] = []
    real = FlowWalker.run

    def counting(self: FlowWalker, func: Any, *args: Any) -> Any:
        walked.append(func.name.value)
        return real(self, func, *args)

    monkeypatch.setattr(FlowWalker, "run", counting)
    if strategy == "kernel":
        kernel = affected_tree / "vllm" / "fla" / "ops" / "fused_sigmoid_gating.py"
        kernel.parent.mkdir(parents=True)
        kernel.write_text(
            "def fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v):\n"
            "    if state_idx <= 0:\n        return\n"
        )
    out = apply_tree(affected_tree, strategy, mode=Mode.DRY_RUN)
    assert not out.refused and out.diff, out.refused
    assert walked and all(walked.count(q) == 2 for q in walked), walked


def test_second_apply_is_a_no_op_and_revert_restores_bytes(affected_tree: Path) -> None:
    before = snapshot(affected_tree)
    apply_tree(affected_tree)
    patched = snapshot(affected_tree)
    again = apply_tree(affected_tree)
    assert not again.written and again.exit_code == 0
    assert "nothing to do" in again.message
    assert snapshot(affected_tree) == patched
    back = revert_tree(affected_tree)
    assert back.written == [SITE.as_posix()]
    assert snapshot(affected_tree) == before
    assert revert_tree(affected_tree).message.startswith("nothing to revert")


def test_revert_refuses_a_file_edited_after_the_patch(affected_tree: Path) -> None:
    apply_tree(affected_tree)
    target = affected_tree / SITE
    target.write_text(target.read_text() + "# local edit\n")
    edited = target.read_bytes()
    out = revert_tree(affected_tree)
    assert out.exit_code == 2 and "changed since" in out.refused[0][1]
    assert target.read_bytes() == edited


def test_unknown_site_refuses_the_whole_run(affected_tree: Path) -> None:
    from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod

    wrapped = GatherGatesCodemod.REFUSES[1][0]
    (affected_tree / "vllm" / "fork_layer.py").write_text(wrapped)
    before = snapshot(affected_tree)
    out = apply_tree(affected_tree)
    assert out.exit_code == 2
    assert out.refused[0][0] == "vllm/fork_layer.py"
    assert not out.written
    assert snapshot(affected_tree) == before


def test_a_second_writer_waits_then_gives_up(
    affected_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GDN_BACKPORT_LOCK_TIMEOUT", "0.3")
    state = affected_tree / atomic.STATE_DIR
    state.mkdir()
    with open(state / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        before = snapshot(affected_tree)
        t0 = time.monotonic()
        with pytest.raises(UsageError, match="another gdn-backport run holds this tree's lock"):
            apply_tree(affected_tree)
        assert time.monotonic() - t0 >= 0.3
        assert snapshot(affected_tree) == before


def test_the_lock_is_taken_again_in_the_same_run(affected_tree: Path) -> None:
    """``apply --commit`` holds the lock and runs apply (and revert) inside."""
    with atomic.tree_lock(affected_tree):
        assert apply_tree(affected_tree).written == [SITE.as_posix()]
        assert revert_tree(affected_tree).written == [SITE.as_posix()]
    # Released: another process could take it now.
    with open(affected_tree / atomic.STATE_DIR / "lock") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_lock_only_folder_is_removed_again(affected_tree: Path) -> None:
    """A writing run that writes nothing leaves no records folder behind."""
    (affected_tree / SITE).write_text(FIXED)
    assert apply_tree(affected_tree).exit_code == 0
    assert not (affected_tree / atomic.STATE_DIR).exists()


def test_nothing_outside_the_tree_is_touched(tmp_path: Path, affected_tree: Path) -> None:
    sibling = tmp_path / "sibling.py"
    sibling.write_text(FIXED)
    names = sorted(p.name for p in tmp_path.iterdir())
    mtime = sibling.stat().st_mtime_ns
    apply_tree(affected_tree)
    revert_tree(affected_tree)
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert sibling.stat().st_mtime_ns == mtime


def test_single_file_target(affected_tree: Path) -> None:
    target = affected_tree / SITE
    out = apply_tree(target)
    assert out.written == [SITE.name]
    assert (target.parent / atomic.STATE_DIR / "manifest.json").exists()
    revert_tree(target)
    assert target.read_text() != FIXED
