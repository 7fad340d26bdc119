"""ci_formats.py: the --format sarif|github seam: one dry run per patchset with an affected site."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gdn_backport import ci_formats
from gdn_backport.errors import UsageError
from gdn_backport.pipeline import Outcome
from gdn_backport.site import Site, Status


def _ps(pid: str, default: str = "gather") -> Any:
    return SimpleNamespace(info=SimpleNamespace(id=pid), strategy=lambda asked: asked or default)


def _site(pid: str, status: Status) -> Site:
    return Site("vllm/a.py", 1, "f", status, "r", patchset=pid)


def test_only_patchsets_with_an_affected_site_are_dry_run_with_their_strategy() -> None:
    calls: list[tuple[str, str]] = []

    def dry_run(ps: Any, strategy: str) -> Outcome:
        calls.append((ps.info.id, strategy))
        return Outcome(Path("."), diff="d")

    sites = [_site("a", Status.AFFECTED), _site("b", Status.UNKNOWN), _site("c", Status.AFFECTED)]
    chosen = [_ps("a"), _ps("b"), _ps("c", "reclassify"), _ps("d")]
    runs = ci_formats.fix_runs(sites, chosen, None, dry_run)
    assert calls == [("a", "gather"), ("c", "reclassify")]
    assert sorted(runs) == ["a", "c"]
    assert runs["c"].strategy == "reclassify" and runs["c"].outcome is not None
    # An asked-for strategy goes to each patchset's own choice.
    calls.clear()
    ci_formats.fix_runs(sites, chosen, "kernel", dry_run)
    assert calls == [("a", "kernel"), ("c", "kernel")]


def test_a_dry_run_that_raises_a_usage_error_is_kept_as_its_message() -> None:
    def dry_run(ps: Any, strategy: str) -> Outcome:
        if ps.info.id == "a":
            raise UsageError("a.py: refused by git")
        return Outcome(Path("."))

    sites = [_site("a", Status.AFFECTED), _site("b", Status.AFFECTED)]
    runs = ci_formats.fix_runs(sites, [_ps("a"), _ps("b")], None, dry_run)
    assert runs["a"].outcome is None and runs["a"].error == "a.py: refused by git"
    assert runs["b"].error == "" and runs["b"].outcome is not None


def test_github_lines_and_an_empty_sarif_log_for_a_clean_run(tmp_path: Path) -> None:
    def never(ps: Any, strategy: str) -> Outcome:
        raise AssertionError("nothing to fix")

    fixed = [_site("a", Status.FIXED)]
    assert ci_formats.render("github", tmp_path, fixed, [], 0, never) == ""
    doc = json.loads(ci_formats.render("sarif", tmp_path, fixed, [], 0, never))
    assert doc["version"] == "2.1.0" and doc["runs"][0]["results"] == []
    assert ci_formats.FORMATS == ("sarif", "github")


def test_an_unknown_site_is_one_github_error_line(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "a.py").write_text("def f():\n    pass\n")

    def never(ps: Any, strategy: str) -> Outcome:
        raise AssertionError("unknown sites get no dry run")

    out = ci_formats.render("github", tmp_path, [_site("a", Status.UNKNOWN)], [_ps("a")], 2, never)
    (line,) = out.splitlines()
    assert line.startswith("::error file=") and "line=1" in line
    assert "gdn-backport apply refuses this tree" in line
