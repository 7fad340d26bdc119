"""The parent side end to end on the CPU: the fake vLLM in child processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from gdn_backport.engine_suite.scenarios import collect
from gdn_backport.engine_suite.suite import Variant, run_engine_suite
from tests.engine_fake_vllm import make_site


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return make_site(tmp_path)


def suite(
    tmp_path: Path,
    site: Path,
    names: list[str],
    workdir: str = "work",
    scenarios: Any = None,
    **env: str,
) -> Any:
    return run_engine_suite(
        None,
        names,
        workdir=tmp_path / workdir,
        json=True,
        variant=Variant("fake", {"PYTHONPATH": str(site), **env}),
        require_cuda=False,
        scenarios=scenarios,
    )


def test_recipe_passes_on_a_correct_engine_and_fails_on_ungathered_gates(
    tmp_path: Path, site: Path
) -> None:
    good = suite(tmp_path, site, ["pr51812-recipe"])
    (r,) = good.results
    assert (r.result, good.exit_code) == ("PASS", 0), r.reason
    assert r.misordered == 4 and r.builds == 128 and r.tagged.count == 58
    assert r.post_mixed.count == 58 and r.gates.startswith("gates vary")
    bad = suite(tmp_path, site, ["pr51812-recipe"], FAKE_VLLM_GATES="ungathered")
    (r,) = bad.results
    assert (r.result, bad.exit_code) == ("FAIL", 1)
    assert r.tagged.mean > 0.04 and r.worst[0].tag in ("misordered", "after")
    # The reference of the first run's tokens was cached: only the second
    # run's new sequences needed a reference engine (the fake keeps tokens).
    assert len(list((tmp_path / "work" / "runs" / "reference").rglob("*.result.json"))) == 1
    assert "pr51812-recipe" in bad.table() and '"result": "FAIL"' in bad.to_json()


def test_new_rows_on_recycled_slots(tmp_path: Path, site: Path) -> None:
    report = suite(
        tmp_path, site, ["pr51565-eager", "pr51565-full-graphs"], FAKE_VLLM_NEW_ROW="bug"
    )
    assert [r.result for r in report.results] == ["FAIL", "FAIL"]
    assert report.results[0].new_rows == {"decode": 6} and report.results[0].recycled >= 4
    half = suite(tmp_path, site, ["pr51565-eager", "pr51565-full-graphs"], FAKE_VLLM_NEW_ROW="half")
    eager, graphs = half.results
    assert eager.result == "PASS", eager.reason
    assert graphs.result == "FAIL" and graphs.stale_replays > 0
    assert graphs.reason.startswith("the runner replayed the FULL decode graph"), graphs.reason
    fixed = suite(tmp_path, site, ["pr51565-full-graphs"], FAKE_VLLM_NEW_ROW="fixed")
    assert fixed.results[0].result == "PASS" and fixed.results[0].stale_replays == 0


def test_flat_gates_make_it_inconclusive(tmp_path: Path, site: Path) -> None:
    report = suite(
        tmp_path, site, ["pr51812-recipe"], FAKE_VLLM_FLAT_GATES="1", FAKE_VLLM_GATES="ungathered"
    )
    (r,) = report.results
    assert r.result == "INCONCLUSIVE" and r.reason.startswith("model unfit: gates flat")
    assert report.exit_code == 1


def test_a_crashing_and_a_hanging_engine(tmp_path: Path, site: Path) -> None:
    (recipe,) = collect(names=["pr51812-recipe"])
    crash = suite(tmp_path, site, [], scenarios=[recipe], FAKE_VLLM_CRASH="1")
    (r,) = crash.results
    assert r.result == "FAIL" and r.reason.startswith(
        "engine: RuntimeError: fake engine: CUDA out of memory"
    )
    assert Path(r.logs["stderr"]).exists()
    quick = dataclasses.replace(recipe, timeout_s=1.5)
    hang = suite(tmp_path, site, [], workdir="hang", scenarios=[quick], FAKE_VLLM_HANG="1")
    (r,) = hang.results
    assert r.result == "FAIL" and "timed out after 2 s" in r.reason


def test_refusal_stops_before_any_engine(tmp_path: Path) -> None:
    report = run_engine_suite(
        None,
        ["pr51812-recipe"],
        workdir=tmp_path / "w",
        json=True,
        variant=Variant("none", {"PYTHONPATH": str(tmp_path / "empty")}),
    )
    assert report.exit_code == 2 and report.refusal is not None
    assert report.refusal.line() == "gdn-backport: vllm: no vLLM importable in this Python"
    assert not (tmp_path / "w" / "runs").exists()
