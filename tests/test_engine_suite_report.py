"""engine_suite/report.py: the engine suite's table, JSON document and exit code."""

from __future__ import annotations

import json

from gdn_backport.engine_suite.preflight import Refusal
from gdn_backport.engine_suite.report import EngineReport, ScenarioResult
from gdn_backport.engine_suite.rules import FAIL, INCONCLUSIVE, PASS
from gdn_backport.engine_suite.scoring import Aggregate


def _row(result: str = PASS, **kw: object) -> ScenarioResult:
    return ScenarioResult("s-" + result.lower(), "ps", result, "why", **kw)  # type: ignore[arg-type]


def test_exit_code_is_0_all_passed_1_otherwise_2_a_refusal() -> None:
    assert EngineReport([_row(), _row()]).exit_code == 0
    assert EngineReport([_row(), _row(FAIL)]).exit_code == 1
    assert EngineReport([_row(INCONCLUSIVE)]).exit_code == 1
    assert EngineReport([]).exit_code == 1  # nothing ran is no pass
    assert EngineReport([_row()], refusal=Refusal("vllm", "no GPU")).exit_code == 2


def test_a_refusal_is_one_line_and_its_json() -> None:
    report = EngineReport(refusal=Refusal("/venv/bin/python", "vllm is not installed"))
    assert report.table() == "gdn-backport: /venv/bin/python: vllm is not installed"
    doc = json.loads(report.to_json())
    assert doc["refusal"] == {"path": "/venv/bin/python", "reason": "vllm is not installed"}
    assert doc["exit_code"] == 2 and doc["results"] == []


def test_misordered_per_1000_builds() -> None:
    assert _row(builds=2000, misordered=3).per_1000 == 1.5
    assert _row(builds=0, misordered=3).per_1000 == 0.0
    assert _row(builds=3, misordered=1).to_json()["misordered_per_1000"] == 333.33


def test_the_table_has_a_row_per_scenario_and_its_details() -> None:
    row = _row(
        FAIL,
        builds=1000,
        misordered=4,
        tagged=Aggregate.of([0.5, 1.5]),
        clean=Aggregate.of([0.25]),
        ratio=4.0,
        post_mixed=Aggregate.of([2.0]),
        gates="gates: ok",
        live=[{"file": "gdn.py", "line": 9, "sha256": "ab", "runtime_patch": "gather"}],
        other_builds={"capture": 2},
    )
    row.reason = "x" * 70
    table = EngineReport([row]).table()
    head, first = table.splitlines()[:2]
    assert head.split()[:4] == ["scenario", "patchset", "variant", "result"]
    cells = first.split()
    assert cells[:5] == ["s-fail", "ps", "installed", "FAIL", "1000"]
    assert cells[5:11] == ["4.0", "2", "1.0000", "1.5000", "0.2500", "4.0"]
    assert cells[11] == "x" * 57 + "..."  # a long reason is cut in the table only
    assert f"s-fail [installed, eager]: FAIL: {'x' * 70}" in table
    assert "builds 1000 in steps (2 capture, 0 other), 0 mixed, 4 misordered (4.0/1000)" in table
    assert "from the first misordered step on: n=1 mean 2.0000 max 2.0000" in table
    assert "live _forward_core: gdn.py:9 sha256 ab (in-memory patch gather)" in table


def test_empty_aggregates_and_missing_ratios_are_dashes_and_json_nulls() -> None:
    row = _row()
    cells = EngineReport([row]).table().splitlines()[1].split()
    assert cells[6:11] == ["0", "-", "-", "-", "-"]
    doc = json.loads(EngineReport([row], facts={"gpu": "H200"}, seconds=1.26).to_json())
    (got,) = doc["results"]
    assert got["ratio"] is None and got["tagged"]["count"] == 0
    assert doc["facts"] == {"gpu": "H200"} and doc["seconds"] == 1.3 and doc["exit_code"] == 0
