"""pipeline.py: every patchset plans, then all is written or nothing.

Public API only (apply, revert_tree, Plan, Outcome, conclude, merged,
unified_diff), over made-up patchsets that rewrite a word: no real analysis.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gdn_backport import ahead, atomic, pipeline
from gdn_backport.errors import UsageError
from gdn_backport.pipeline import Mode, Outcome, Plan, SiteChange, conclude, unified_diff
from gdn_backport.site import Site, Status
from gdn_backport.tree import Tree

REL = "vllm/m.py"


class _Word:
    """A patchset that rewrites ``old`` to ``new`` in every file holding it."""

    def __init__(
        self,
        pid: str,
        old: str,
        new: str,
        refuse: str = "",
        crash: bool = False,
        independent: bool = False,
    ):
        self.info = SimpleNamespace(id=pid, upstream=f"o/r#{pid}")
        self.old, self.new, self.refuse, self.crash = old, new, refuse, crash
        self.independent = independent  # says its plan ignores others' rewrites
        self.seen: list[str] = []

    def unaffected_by(self, changed: dict[Path, tuple[bytes, str]]) -> bool:
        return self.independent

    def prepare(self, tree: Tree) -> ahead.Prepare | None:
        return None

    def scan(self, tree: Tree) -> list[Site]:
        tree.notes.append(f"{self.info.id} in {os.getpid()}")
        return [
            Site(tree.relative(f), 1, "f", Status.AFFECTED, "", patchset=self.info.id)
            for f in tree.walk().files
            if self.old in tree.text(f)
        ]

    def strategy(self, asked: str | None) -> str:
        return asked or "word"

    def plan(self, tree: Tree, strategy: str, mode: Mode) -> Plan:
        if self.crash:
            raise RuntimeError("a bug in the plan")
        out = Outcome(tree.root)
        plan = Plan(out, strategy=strategy)
        for file in tree.walk().files:
            text = tree.text(file)
            self.seen.append(text)
            if self.old not in text:
                continue
            rel = tree.relative(file)
            site = Site(rel, 1, "f", Status.AFFECTED, "", patchset=self.info.id)
            out.changes.append(SiteChange(site, Site(rel, 1, "f", Status.FIXED, ""), False))
            if self.refuse:
                out.refused.append((rel, self.refuse))
                continue
            new = text.replace(self.old, self.new)
            out.diff += unified_diff(rel, text, new)
            plan.staged.append((file, rel, text.encode(), new.encode()))
            plan.texts[file] = new
        conclude(out, mode, bool(plan.staged))
        return plan


def _tree(tmp_path: Path, text: str = "x = 'old'\n") -> Path:
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / REL).write_text(text)
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_every_plan_is_written_a_later_one_reading_the_earlier_rewrite(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    first, second = _Word("a", "old", "mid"), _Word("b", "mid", "new")
    results = pipeline.apply(root, [first, second])
    assert (root / REL).read_text() == "x = 'new'\n"
    assert "x = 'mid'\n" in second.seen  # the overlay, not the disk
    for _, out in results:
        assert out.written == [REL] and out.refused == []
        assert out.message.startswith("patched 1 file(s); undo with `gdn-backport revert")
        assert [c.changed for c in out.changes] == [True] and out.exit_code == 0
    assert (root / atomic.STATE_DIR / "manifest.json").is_file()
    # revert takes both layers off: the original bytes come back.
    back = pipeline.revert_tree(root)
    assert back.refused == [] and back.written == [REL, REL]
    assert (root / REL).read_text() == "x = 'old'\n"


def test_a_refusal_of_one_patchset_leaves_nothing_on_disk(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = _snapshot(root)
    first, second = _Word("a", "old", "mid"), _Word("b", "mid", "", refuse="cannot prove it")
    called: list[object] = []
    results = pipeline.apply(root, [first, second], before_write=called.append)
    assert _snapshot(root) == before  # no records folder, no temporary
    assert called == []
    (_, one), (_, two) = results
    assert one.diff == "" and one.message == "not written: another patchset refused"
    assert one.written == [] and [c.changed for c in one.changes] == [False]
    assert two.refused == [(REL, "cannot prove it")] and two.exit_code == 2
    assert two.message == "refused: nothing was changed"
    merged = pipeline.merged(results, root)
    assert merged.refused == [(REL, "b: cannot prove it")]
    assert merged.message == "refused: nothing was changed"


def test_a_plan_that_crashes_is_a_refusal_with_its_traceback(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = _snapshot(root)
    results = pipeline.apply(root, [_Word("a", "old", "new"), _Word("b", "", "", crash=True)])
    assert _snapshot(root) == before
    _, out = results[1]
    ((path, reason),) = out.refused
    assert path == "." and "patchset b" in reason
    assert "a bug in the plan" in out.tracebacks["."]
    assert out.to_json()["refused"][0]["traceback"] == out.tracebacks["."]


def test_before_write_sees_every_file_and_its_refusal_stops_the_run(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = _snapshot(root)
    seen: list[tuple[str, list[tuple[Path, bytes]]]] = []

    def refuse(batch: list[tuple[Any, Outcome, list[tuple[Path, bytes]]]]) -> None:
        seen.extend((ps.info.id, files) for ps, _, files in batch)
        raise UsageError("git: the tree has uncommitted changes")

    with pytest.raises(UsageError, match="uncommitted"):
        pipeline.apply(root, [_Word("a", "old", "new")], before_write=refuse)
    assert seen == [("a", [(root / REL, b"x = 'new'\n")])]
    assert _snapshot(root) == before


@pytest.mark.parametrize(
    ("mode", "message", "hook_called"),
    [
        (Mode.DRY_RUN, "dry run: nothing was changed", True),
        (Mode.CHECK, "check failed: 1 affected site(s): vllm/m.py:1 f", False),
    ],
)
def test_dry_run_and_check_write_nothing(
    tmp_path: Path, mode: Mode, message: str, hook_called: bool
) -> None:
    root = _tree(tmp_path)
    before = _snapshot(root)
    called: list[object] = []
    ((_, out),) = pipeline.apply(root, [_Word("a", "old", "new")], mode=mode,
                                 before_write=called.append)  # fmt: skip
    assert _snapshot(root) == before
    assert out.message == message and out.written == []
    assert out.diff.startswith("--- a/vllm/m.py\n+++ b/vllm/m.py\n")
    assert bool(called) is hook_called and out.exit_code == 1


def test_nothing_to_do_and_nothing_to_revert(tmp_path: Path) -> None:
    root = _tree(tmp_path, "x = 1\n")
    ((_, out),) = pipeline.apply(root, [_Word("a", "old", "new")])
    assert out.message == "nothing to do: no affected site" and out.exit_code == 0
    assert not (root / atomic.STATE_DIR).exists()
    back = pipeline.revert_tree(root)
    assert back.message == "nothing to revert: no gdn-backport record in this tree"


def test_reverting_a_patchset_with_no_record_left_names_the_records_that_remain(
    tmp_path: Path,
) -> None:
    """D11 (session 15): ``revert --patchset pr51812`` run twice said "no
    gdn-backport record in this tree" while pr51565's records were there."""
    root = _tree(tmp_path)
    pipeline.apply(root, [_Word("a", "old", "new")])
    out = pipeline.revert_tree(root, upstreams=frozenset({"o/r#b"}))
    assert out.message == (
        "nothing to revert: no record of o/r#b in this tree (the records of o/r#a remain)"
    )
    assert (root / REL).read_text() == "x = 'new'\n"


def test_revert_refuses_a_file_changed_since_it_was_patched(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    pipeline.apply(root, [_Word("a", "old", "new")])
    (root / REL).write_text("x = 'edited'\n")
    out = pipeline.revert_tree(root)
    assert out.refused == [(REL, "changed since gdn-backport patched it; not restoring")]
    assert (root / REL).read_text() == "x = 'edited'\n"
    dry = pipeline.revert_tree(root, Mode.DRY_RUN)
    assert dry.refused and dry.written == []


def test_conclude_and_unified_diff() -> None:
    out = Outcome(Path("."), diff="d")
    out.refused.append(("a.py", "no"))
    assert conclude(out, Mode.WRITE, True) is False
    assert out.diff == "" and out.message == "refused: nothing was changed"
    fine = Outcome(Path("."))
    assert conclude(fine, Mode.WRITE, True) is True
    assert conclude(fine, Mode.WRITE, False) is False
    assert fine.message == "nothing to do: no affected site"
    assert unified_diff("a.py", "x\n", "x\n") == ""
    assert unified_diff("a.py", "x\n", "y\n") == "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y\n"


def test_site_change_reports_the_site_as_it_now_is() -> None:
    was = Site("a.py", 1, "f", Status.AFFECTED, "r")
    fixed = Site("a.py", 2, "f", Status.FIXED, "r2")
    assert SiteChange(was, fixed, False).status is Status.AFFECTED
    change = SiteChange(was, fixed, True)
    assert change.now is fixed
    assert change.to_json() == {**fixed.to_json(), "status_before": "affected",
                                "status_rewritten": "fixed", "changed": True}  # fmt: skip


def test_merged_names_patchsets_only_when_several_spoke(tmp_path: Path) -> None:
    quiet, loud = Outcome(tmp_path, message="nothing"), Outcome(tmp_path, message="patched")
    loud.changes.append(SiteChange(*(Site("a", 1, "f", Status.FIXED, ""),) * 2, True))
    ps: Callable[[str], Any] = lambda pid: SimpleNamespace(info=SimpleNamespace(id=pid))  # noqa: E731
    assert pipeline.merged([(ps("a"), quiet), (ps("b"), loud)], tmp_path).message == "patched"
    both = pipeline.merged([(ps("a"), loud), (ps("b"), loud)], tmp_path)
    assert both.message == "a: patched; b: patched" and len(both.changes) == 2


# -- later patchsets ahead, in a forked child (gdn_backport.ahead) -----------

ahead_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork: Linux only")


@pytest.fixture
def forking(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GDN_BACKPORT_JOBS", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})


@ahead_only
def test_a_later_plan_made_ahead_is_the_runs_where_the_first_rewrote_nothing(
    tmp_path: Path, forking: None
) -> None:
    root = _tree(tmp_path)
    first, second = _Word("a", "absent", "x"), _Word("b", "old", "new")
    results = pipeline.apply(root, [first, second])
    assert (root / REL).read_text() == "x = 'new'\n"
    assert [out.written for _, out in results] == [[], [REL]]
    assert first.seen and not second.seen  # the second planned in the child


@ahead_only
def test_a_later_plan_made_ahead_is_made_again_on_the_first_ones_rewrite(
    tmp_path: Path, forking: None
) -> None:
    root = _tree(tmp_path)
    first, second = _Word("a", "old", "mid"), _Word("b", "mid", "new")
    pipeline.apply(root, [first, second])
    # The child saw 'old' (no site); the run's plan read the overlay.
    assert (root / REL).read_text() == "x = 'new'\n"
    assert "x = 'mid'\n" in second.seen and "x = 'old'\n" not in second.seen


@ahead_only
def test_a_later_patchset_sure_of_its_plan_keeps_the_one_made_ahead(
    tmp_path: Path, forking: None
) -> None:
    """``unaffected_by``: a patchset that says the rewrite changes nothing of
    its plan keeps the child's (here, wrongly: the proof that it is asked)."""
    root = _tree(tmp_path)
    first, second = _Word("a", "old", "mid"), _Word("b", "mid", "new", independent=True)
    pipeline.apply(root, [first, second])
    assert (root / REL).read_text() == "x = 'mid'\n" and not second.seen


@ahead_only
def test_a_scan_gives_each_patchsets_sites_and_notes_in_order(
    tmp_path: Path, forking: None
) -> None:
    root = _tree(tmp_path)
    tree = Tree.of(root)
    sites = pipeline.scan(tree, [_Word("a", "old", "x"), _Word("b", "x =", "y")])
    assert [s.patchset for s in sites] == ["a", "b"]
    first, second = tree.notes
    assert first == f"a in {os.getpid()}" and second.startswith("b in ")
    assert second != f"b in {os.getpid()}"  # scanned in the child


class _Fed(_Word):
    """A patchset whose scan takes a value its child prepared."""

    def prepare(self, tree: Tree) -> ahead.Prepare | None:
        return lambda feed: feed.put(f"{self.info.id}.pid", os.getpid())

    def scan(self, tree: Tree) -> list[Site]:
        deadline = time.monotonic() + 30
        while (got := ahead.offered(f"{self.info.id}.pid")) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tree.notes.append(f"fed by {got}")
        return super().scan(tree)


@ahead_only
@pytest.mark.parametrize("later", [False, True])
def test_the_first_patchsets_work_ahead_runs_in_the_child(
    tmp_path: Path, forking: None, later: bool
) -> None:
    tree = Tree.of(_tree(tmp_path))
    chosen = [_Fed("a", "old", "x"), *([_Word("b", "x =", "y")] if later else [])]
    sites = pipeline.scan(tree, chosen)
    assert [s.patchset for s in sites] == ["a", "b"][: len(chosen)]
    fed = tree.notes[0]
    assert fed.startswith("fed by ") and fed != f"fed by {os.getpid()}"


@ahead_only
def test_a_first_patchset_that_fails_stops_the_child_and_raises(
    tmp_path: Path, forking: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path)
    bad = _Word("a", "old", "x")
    monkeypatch.setattr(bad, "scan", lambda tree: (_ for _ in ()).throw(UsageError("bad input")))
    with pytest.raises(UsageError, match="bad input"):
        pipeline.scan(Tree.of(root), [bad, _Word("b", "old", "y")])
