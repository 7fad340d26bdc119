"""matrix/runner.py: materialising trees, what a cell requires of its reports, real cells.

The ones marked ``network`` run real cells on the CPU interpreter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gdn_backport import matrix, sources
from gdn_backport.cli import main
from gdn_backport.errors import UsageError
from gdn_backport.matrix import runner
from gdn_backport.site import Status
from gdn_backport.verify import ScenarioResult, VerifyReport
from tests.harness_fixtures import interpreted

_SKIPPED = {"version": "0.9.0", "skip_verify": "harness cannot drive this layout"}


def test_tree_at_a_git_ref_is_read_from_git_not_the_working_copy(
    affected_tree: Path, tmp_path: Path
) -> None:
    import git

    repo = git.Repo.init(affected_tree)
    repo.index.add(["vllm/__init__.py", "vllm/model_executor/layers/mamba/gdn_linear_attn.py"])
    repo.index.commit("fork", author=git.Actor("t", "t@example.com"))
    repo.create_tag("v1")
    (affected_tree / "vllm" / "__init__.py").write_text("# edited after the tag\n")
    got = runner._materialise(matrix.Tree("fork", str(affected_tree), "v1"), tmp_path / "out")
    assert (got / "vllm" / "__init__.py").read_text() == "# a fork's tree\n"
    assert (got / "vllm/model_executor/layers/mamba/gdn_linear_attn.py").exists()
    plain = runner._materialise(matrix.Tree("fork", str(affected_tree)), tmp_path / "copy")
    assert (plain / "vllm" / "__init__.py").read_text() == "# edited after the tag\n"
    with pytest.raises(UsageError, match="cannot read git ref"):
        runner._materialise(matrix.Tree("f", str(affected_tree), "nope"), tmp_path / "x")


# -- what a cell requires, on made-up reports (no kernels run) ---------------------


def _report(*rows: tuple[str, bool, float], error: str = "") -> VerifyReport:
    made = [ScenarioResult(n, "tag", "[N1, S3]", err, 0.02, ok, "") for n, ok, err in rows]
    return VerifyReport("t", "s", "cpu", "float16", made, error)


def _release_cell(version: str, strategy: str) -> matrix.Cell:
    return matrix.cells(matrix.load(), ids=[f"{version}-{strategy}"])[0]


def test_unpatched_must_fail_its_mixed_scenarios_and_pass_the_others() -> None:
    runner = matrix.CellRunner(matrix.RunOptions())
    cell = _release_cell("0.25.1", "gather")
    must = frozenset({"pr_layout"})
    good = matrix.Verified("unpatched", _report(("pr_layout", False, 0.9),
                                                ("pure_spec", True, 0.001)), must, 1.0)  # fmt: skip
    assert all(c.ok for c in runner._verify_checks(cell, good))
    blind = matrix.Verified("unpatched", _report(("pr_layout", True, 0.001)), must, 1.0)
    (check,) = runner._verify_checks(cell, blind)
    assert not check.ok and "cannot see the bug" in check.message
    broke = matrix.Verified("unpatched", _report(("pure_spec", False, 0.5)), must, 1.0)
    (check,) = runner._verify_checks(cell, broke)
    assert not check.ok and "max_abs_err 0.5" in check.message


def test_harness_refusal_is_a_skip_only_where_the_matrix_says_so() -> None:
    runner = matrix.CellRunner(matrix.RunOptions())
    refused = matrix.Verified("unpatched", _report(error="no _forward_core"), frozenset(), 1.0)
    layer = {"pr51812": {"0.9.0": matrix.Expectation(Status.NOT_AFFECTED, "p", "f")}}
    skipped = matrix.cells(matrix.parse({"release": [_SKIPPED]}, expectations=layer))[0]
    (skip,) = runner._verify_checks(skipped, refused)
    assert skip.ok and "harness cannot drive this layout" in skip.skipped
    res = matrix.CellResult(skipped, [skip])
    assert res.result == "skip" and matrix.exit_code([res]) == 0
    (fail,) = runner._verify_checks(_release_cell("0.28.0", "none"), refused)
    assert not fail.ok and "could not run: no _forward_core" in fail.message
    res = matrix.CellResult(_release_cell("0.28.0", "none"), [fail])
    assert res.result == "fail" and matrix.exit_code([res]) == 1


# -- real cells, on the CPU interpreter, with a reduced scenario list -------------


@pytest.mark.network
@pytest.mark.slow
def test_affected_cells_fail_before_and_pass_after(tmp_path: Path) -> None:
    interpreted()
    options = matrix.RunOptions("cpu", ("pr_layout", "pure_spec"), workdir=tmp_path)
    todo = matrix.cells(matrix.load(), ids=["0.27.1-gather", "0.27.1-kernel"])
    seen: list[tuple[int, str]] = []
    results = matrix.run_cells(todo, options, lambda i, n, c, stage, r: seen.append((i, stage)))
    for res in results:
        assert res.result == "ok", res.problems
        assert (res.status_before, res.status_after) == (Status.AFFECTED, Status.FIXED)
        assert res.unpatched is not None and res.patched is not None
        rows = {r.name: r for r in res.unpatched.report.rows}
        assert not rows["pr_layout"].passed and rows["pure_spec"].passed
        assert res.patched.report.passed
        assert res.written
    # The unpatched tree is verified once for both strategies.
    assert results[1].unpatched is not None and results[1].unpatched.shared_with == "0.27.1-gather"
    assert (1, "verify unpatched") in seen and (2, "done") in seen
    assert list(tmp_path.iterdir()) == []  # patched copies are gone


@pytest.mark.network
@pytest.mark.slow
def test_fork_tree_cell_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    interpreted()
    fork = tmp_path / "fork"
    shutil.copytree(sources.release_tree("0.21.0") / "vllm", fork / "vllm")
    results = tmp_path / "results"
    code = main(["matrix", "run", "--tree", str(fork), "--device", "cpu", "--strategy", "gather",
                 "--scenario", "pr_layout", "--results", str(results)])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert out.err.startswith("gdn-backport 0.1.0, python")
    assert "[1/1] fork gather: ok" in out.err
    row = next(line.split() for line in out.out.splitlines() if line.startswith("fork-gather"))
    assert row[:7] == ["fork-gather", "affected", "fixed", "1/1", "fail", "1/1", "pass"]
    (cell,) = json.loads((results / "summary.json").read_text())["cells"]
    assert cell["tree"] == str(fork) and cell["result"] == "ok" and cell["release"] is None
    assert (results / "fork-gather.xml").exists()
    # The fork's own files are never touched.
    assert not (fork / ".gdn-backport").exists()
