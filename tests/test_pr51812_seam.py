"""pr51812 through its seam: a scan cache entry that read a module outside
the tree's walk is not stored (its key names only the walk's files); a plan
and its proof sieve the tree once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from gdn_backport.patchsets.pr51812 import locate
from gdn_backport.patchsets.pr51812.seam import _outside
from gdn_backport.pipeline import Mode
from gdn_backport.tree import Tree


def test_a_module_outside_the_walk_is_told_by_its_real_path(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / "vllm/sub").mkdir(parents=True)
    (root / "vllm/__init__.py").write_text("")
    (root / "vllm/a.py").write_text("x = 1\n")
    (root / "vllm/sub/link.py").symlink_to(root / "vllm/a.py")
    (tmp_path / "other.py").write_text("y = 1\n")
    tree = Tree.of(root)

    def outside(*paths: Path | None) -> bool:
        return _outside(tree, [SimpleNamespace(path=p) for p in paths])

    assert not outside(None, root / "vllm/a.py", root / "vllm/__init__.py")
    # Spelled otherwise than the walk spells it, the same files.
    assert not outside(root / "vllm/sub/../a.py", root / "vllm/sub/link.py")
    assert outside(root / "vllm/a.py", tmp_path / "other.py")
    assert outside(root / "vllm/sub/../../../other.py")


def test_the_plan_and_its_proof_sieve_each_file_once(
    affected_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proof scans the tree again with the rewrite in place: the files
    it did not rewrite keep the plan's sieve verdict (each was sieved twice)."""
    (affected_tree / "vllm/other.py").write_text("def f():\n    return 1\n")
    seen: Counter[bytes] = Counter()
    real = locate.may_hold_site

    def counted(data: bytes, patchset: object) -> bool:
        seen[data] += 1
        return real(data, patchset)  # type: ignore[arg-type]

    monkeypatch.setattr(locate, "may_hold_site", counted)
    from gdn_backport.patchsets.pr51812.plan import plan

    result = plan(Tree.of(affected_tree), "gather", Mode.DRY_RUN)
    assert result.outcome.refused == [] and result.texts
    on_disk = sorted(p.read_bytes() for p in affected_tree.rglob("*.py"))
    # The rewritten text is sieved in the proof: it is not the file's bytes.
    assert sorted(d for d in seen if d in on_disk) == on_disk
    assert all(seen[d] == 1 for d in on_disk)
