"""matrix/results.py: JUnit XML, JSON, Markdown, the table and the progress line."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from gdn_backport import matrix
from gdn_backport.site import Status
from gdn_backport.verify import ScenarioResult, VerifyReport


def _report(*rows: tuple[str, bool, float], error: str = "") -> VerifyReport:
    made = [ScenarioResult(n, "tag", "[N1, S3]", err, 0.02, ok, "") for n, ok, err in rows]
    return VerifyReport("t", "s", "cpu", "float16", made, error)


def _release_cell(version: str, strategy: str) -> matrix.Cell:
    return matrix.cells(matrix.load(), ids=[f"{version}-{strategy}"])[0]


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
