"""matrix/releases.toml: validation, and what counts as a mismatch."""

from __future__ import annotations

import io
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gdn_backport import matrix, sources
from gdn_backport.cli import main
from gdn_backport.errors import UsageError
from gdn_backport.matrix import runner
from gdn_backport.site import Site, Status
from gdn_backport.verify import ScenarioResult, VerifyReport
from tests.harness_fixtures import interpreted


def test_shipped_matrix_loads() -> None:
    m = matrix.load()
    versions = [r.version for r in m.releases]
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))))
    with_sdist = [r for r in m.releases if not r.wheel_only]
    assert len(with_sdist) == 34
    layer = [r.expectation("pr51812") for r in with_sdist]
    assert sum(e is not None and e.status is Status.AFFECTED for e in layer) == 17
    assert {r.strategies for r in m.releases} == {
        ("none", "reclassify"),
        ("gather", "kernel", "reclassify"),
    }
    # pr51565: affected everywhere (0.31.0+ through the V1 runner's route),
    # refused where the metadata has no fields for a rule (before 0.20.0).
    split = {r.version: r.expectation("pr51565") for r in with_sdist}
    assert {e.status for e in split.values() if e} == {Status.AFFECTED}
    refused = [v for v, e in split.items() if e and e.apply == "refuse"]
    assert refused[0] == "0.10.2" and refused[-1] == "0.19.1" and len(refused) == 15


def test_bad_expectation_names_file_and_key() -> None:
    where = "patchsets/x/expected.toml"
    with pytest.raises(UsageError, match=r"x/expected.toml: release\[0\]: key 'status'.*'bad'"):
        matrix.model.parse_expectations({"release": [{"version": "1.0", "status": "bad"}]}, where)
    with pytest.raises(UsageError, match="key 'apply' must be 'patch' or 'refuse'"):
        matrix.model.parse_expectations(
            {"release": [{"version": "1.0", "status": "affected", "apply": "x"}]}, where
        )
    with pytest.raises(UsageError, match=r"release 9\.0 is not in matrix/releases\.toml"):
        matrix.parse(
            {"release": [{"version": "1.0"}]},
            expectations={"x": {"9.0": matrix.Expectation(Status.FIXED)}},
        )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "no \\[\\[release\\]\\] tables"),
        ({"release": [{"path": "p"}]}, "missing key 'version'"),
        ({"release": [{"version": "x.y"}]}, "key 'version'"),
        ({"release": [{"version": "1.0", "wheel_only": "yes"}]}, "key 'wheel_only'"),
        ({"release": [{"version": "1.0"}] * 2}, "listed twice"),
    ],
)
def test_bad_matrix_names_file_and_key(doc: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=f"matrix/releases.toml: .*{message}"):
        matrix.parse(doc, expectations={})


def _site(path: str, function: str, status: Status) -> Site:
    return Site(path, 1, function, status, "")


def test_check_flags_wrong_status_missing_site_and_surprising_others() -> None:
    expected = matrix.Expectation(Status.AFFECTED, "a.py", "L._forward_core")
    assert matrix.check_sites(expected, [_site("a.py", "L._forward_core", Status.AFFECTED)]) == (
        Status.AFFECTED,
        [],
    )
    _, wrong = matrix.check_sites(expected, [_site("a.py", "L._forward_core", Status.FIXED)])
    assert wrong and "expected affected" in wrong[0]
    assert matrix.check_sites(expected, [])[1]
    _, other = matrix.check_sites(
        expected,
        [
            _site("a.py", "L._forward_core", Status.AFFECTED),
            _site("olmo.py", "O._forward_core", Status.UNKNOWN),
        ],
    )
    assert other and "unexpected unknown" in other[0]


def test_check_without_a_site_judges_the_worst() -> None:
    expected = matrix.Expectation(Status.AFFECTED)
    sites = [_site("b.py", "B.build", Status.AFFECTED), _site("r.py", "R.run", Status.FIXED)]
    assert matrix.check_sites(expected, sites) == (Status.AFFECTED, [])
    found, problems = matrix.check_sites(expected, sites[1:])
    assert found is Status.FIXED and problems == ["expected affected, scan says fixed"]
    assert matrix.check_sites(expected, [])[1] == ["expected affected, scan says no site"]


# -- cells -----------------------------------------------------------------------


def test_cells_of_the_shipped_matrix() -> None:
    m = matrix.load()
    cells = matrix.cells(m)
    ids = [c.id for c in cells]
    # 17 affected releases x (gather, kernel) + 17 others x none, and every
    # release x reclassify (pr51565); no wheel_only.
    assert len(cells) == 85 and len(set(ids)) == 85
    assert "0.25.1-gather" in ids and "0.25.1-kernel" in ids and "0.28.0-none" in ids
    assert "0.25.1-reclassify" in ids and "0.10.2-reclassify" in ids
    assert {c.patchset for c in cells if c.strategy == "reclassify"} == {"pr51565"}
    assert {c.patchset for c in cells if c.strategy != "reclassify"} == {"pr51812"}
    assert not any(i.startswith("0.15.") for i in ids)
    assert all(c.selector() == ["--cell", c.id] for c in cells)
    named = matrix.cells(m, releases=["0.15.0", "0.25.1"])
    assert [c.id for c in named] == [
        "0.15.0-none",
        "0.15.0-reclassify",
        "0.25.1-gather",
        "0.25.1-kernel",
        "0.25.1-reclassify",
    ]
    assert [c.id for c in matrix.cells(m, strategies=["kernel"])][:2] == [
        "0.18.0-kernel",
        "0.18.1-kernel",
    ]
    assert len(matrix.cells(m, include_wheel_only=True)) == 89


def test_cell_ids_name_exact_cells_even_off_the_matrix() -> None:
    m = matrix.load()
    (mutation,) = matrix.cells(m, ids=["0.25.1-none"])
    assert mutation.expectation is not None and mutation.expectation.status is Status.AFFECTED
    assert mutation.strategy == "none"
    for bad, message in [
        ("0.25.1-sideways", "expected <release or tree>-"),
        ("9.9.9-gather", "not in matrix/releases.toml"),
        ("nope-gather", "no release or tree 'nope'"),
    ]:
        with pytest.raises(UsageError, match=message):
            matrix.cells(m, ids=[bad])
    with pytest.raises(UsageError, match="not in matrix"):
        matrix.cells(m, releases=["9.9.9"])
    with pytest.raises(UsageError, match="exclude each other"):
        matrix.cells(m, releases=["0.25.1"], ids=["0.25.1-gather"])


def test_tree_entries_and_adhoc_trees(tmp_path: Path) -> None:
    base = {"release": [{"version": "1.0"}]}
    layer = {"pr51812": {"1.0": matrix.Expectation(Status.FIXED, "p", "f")}}
    doc = {**base, "tree": [{"name": "fork", "path": "~/fork", "strategies": ["gather", "kernel"]}]}
    m = matrix.parse(doc, expectations=layer)
    assert m.trees == (matrix.Tree("fork", "~/fork", "", ("gather", "kernel")),)
    assert [c.id for c in matrix.cells(m)] == ["1.0-none", "fork-gather", "fork-kernel"]
    assert matrix.cells(m, ids=["fork-kernel"])[0].selector() == ["--cell", "fork-kernel"]
    # An adhoc --tree runs alone, with the strategies asked for (default:
    # every patchset's default strategy).
    (tmp_path / "my-fork" / "vllm").mkdir(parents=True)
    (tmp_path / "my-fork" / "vllm" / "__init__.py").write_text("")
    adhoc = matrix.adhoc_tree(tmp_path / "my-fork", ref="main")
    cells = matrix.cells(m, trees=[adhoc])
    assert [c.id for c in cells] == ["my-fork-gather", "my-fork-reclassify"]
    only = cells[0]
    assert only.adhoc
    assert only.selector() == ["--tree", str(tmp_path / "my-fork"), "--ref", "main",
                               "--cell", "my-fork-gather"]  # fmt: skip
    with pytest.raises(UsageError, match="no such file or directory"):
        matrix.adhoc_tree(tmp_path / "missing")
    for tree, message in [
        ({"name": "1x", "path": "p"}, "key 'name'"),
        ({"name": "a", "path": ""}, "key 'path'"),
        (
            {"name": "a", "path": "p", "strategies": ["gather", "magic"]},
            "key 'strategies': 'magic'",
        ),
        ({"name": "a", "path": "p", "ref": 3}, "key 'ref'"),
    ]:
        with pytest.raises(UsageError, match=r"matrix/releases.toml: tree\[0\]: " + message):
            matrix.parse({**base, "tree": [tree]}, expectations=layer)


_SKIPPED = {"version": "0.9.0", "skip_verify": "harness cannot drive this layout"}


def test_skip_verify_is_data() -> None:
    # The harness drives every release of the matrix (both layouts).
    assert not [r.version for r in matrix.load().releases if r.skip_verify]
    (release,) = matrix.parse({"release": [_SKIPPED]}, expectations={}).releases
    assert release.skip_verify == "harness cannot drive this layout"
    bad = {**_SKIPPED, "skip_verify": 1}
    with pytest.raises(UsageError, match="key 'skip_verify'"):
        matrix.parse({"release": [bad]}, expectations={})


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


def _fake_result() -> matrix.CellResult:
    cell = _release_cell("0.25.1", "gather")
    unpatched = matrix.Verified(
        "unpatched",
        _report(("pr_layout", False, 0.75), ("pure_spec", True, 0.001)),
        frozenset({"pr_layout"}),
        3.0,
    )
    patched = matrix.Verified(
        "patched", _report(("pr_layout", False, float("inf")), ("pure_spec", True, 0.001)),
        frozenset(), 2.0,
    )  # fmt: skip
    runner = matrix.CellRunner(matrix.RunOptions())
    checks = [matrix.Check("scan before", True, "affected")]
    checks += runner._verify_checks(cell, unpatched) + runner._verify_checks(cell, patched)
    return matrix.CellResult(cell, checks, Status.AFFECTED, Status.FIXED, ("a.py",),
                             unpatched, patched, seconds=5.0)  # fmt: skip


def test_results_junit_json_markdown(tmp_path: Path) -> None:
    res = _fake_result()
    assert res.result == "fail"
    env = matrix.environment(matrix.RunOptions())
    files = matrix.write_results([res], env, tmp_path, 5.0)
    assert [f.name for f in files] == ["0.25.1-gather.xml", "summary.json", "summary.md"]
    suite = ET.parse(files[0]).getroot().find("testsuite")
    assert suite is not None and suite.get("name") == "cell(0.25.1-gather)"
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [
        "scan before",
        "verify unpatched: pr_layout",
        "verify unpatched: pure_spec",
        "verify patched: pr_layout",
        "verify patched: pure_spec",
    ]
    assert suite.get("tests") == "5" and suite.get("failures") == "1"
    failure = cases[3].find("failure")
    assert failure is not None and "max_abs_err inf" in failure.get("message", "")
    doc = json.loads(files[1].read_text())
    assert doc["counts"] == {"ok": 0, "fail": 1, "skip": 0} and doc["ok"] is False
    (cell,) = doc["cells"]
    assert cell["worst_err_patched"] == "inf" and cell["worst_err_unpatched"] == 0.75
    assert cell["status_before"] == "affected" and cell["status_after"] == "fixed"
    md = files[2].read_text()
    assert "| 0.25.1-gather | affected | fixed | 1/2 fail | 1/2 fail | 0.75 -> inf |" in md
    table = matrix.render_cells([res], 5.0)
    assert table.splitlines()[0].split() == ["cell", "before", "after", "verify", "unpatched",
                                             "verify", "patched", "worst", "err", "time",
                                             "result"]  # fmt: skip
    assert "0 ok, 1 failed, 0 skipped of 1 cells in 5.0 s" in table


def test_progress_line_without_a_terminal() -> None:
    out = io.StringIO()
    show = matrix.ProgressLine(out)
    res = _fake_result()
    show(12, 51, res.cell, "fetch", None)
    show(12, 51, res.cell, "verify patched", None)
    show(12, 51, res.cell, "done", res)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[12/51] 0.25.1 gather ..."
    assert lines[1].startswith("[12/51] 0.25.1 gather: FAIL (5.0 s): verify patched: pr_layout")


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
