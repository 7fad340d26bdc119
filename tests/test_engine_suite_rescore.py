"""bench/engine_rescore.py on a tiny synthetic results folder: the stored
runs and cached scores are rescored with the current rules, nothing starts
an engine, the verdicts that changed are listed, a tarball works too."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gdn_backport.engine_suite import process, suite
from gdn_backport.engine_suite.cache import JsonCache
from gdn_backport.engine_suite.recorder import StepRecord, describe_build
from gdn_backport.engine_suite.scenarios import collect

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_engine")
rescore = _load("engine_rescore")

SCENARIO = "pr51565-full-graphs"
GATES = {
    "measured": True,
    "layers": {"l0": {}},
    "observations": 3,
    "beta_std": 0.3,
    "g_std": 0.7,
    "beta_step": 0.3,
    "g_step": 0.5,
}


def _request(prompt: list[int], tokens: list[int], role: str, first_step: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "tokens": tokens,
        "logprobs": [-1.0] * len(tokens),
        "steps": list(range(first_step, first_step + len(tokens))),
        "role": role,
    }


def _write_run(
    work: Path, variant: str, new_tokens: list[int], stale: bool, new_error: float
) -> None:
    """One stored run of the scenario: a stream o0 decoding, a background
    b0 finished, a brand-new one-token request n0 on b0's recycled slot in
    a uniform step; the reference and the alone run in the cache."""
    (scenario,) = collect(names=[SCENARIO])
    requests = {
        "o0": _request([5, 6, 7], list(range(300, 320)), "stream", 0),
        "b0": _request([8, 9], [400, 401, 402], "background", 0),
        "n0": _request([11], new_tokens, "new", 4),
    }
    # The half fix: the builder calls n0 a prefill (no decode buffers
    # filled) and the runner replays FULL by shape.
    build = describe_build(
        step=4,
        group=0,
        query_start_loc=[0, 1, 2],
        drafts=None,
        counts=(0, 1, 1) if stale else (0, 2, 0),
        req_ids=["o0", "n0"],
        computed=[7, 0],
        full_graph=(True, 16),
        dispatch="FULL" if stale else "PIECEWISE",
    )
    step = StepRecord(4, {"o0": 1, "n0": 1}, {}, ["n0"], ["b0"], {"n0": [[0, "b0"]]}, True)
    result = {
        "ok": True,
        "requests": requests,
        "recorder": {"builds": [build.to_json()], "steps": [step.to_json()]},
        "gates": GATES,
    }
    folder = work / "runs" / variant / SCENARIO
    folder.mkdir(parents=True)
    (folder / "run.result.json").write_text(json.dumps(result))
    spec = {
        "model": scenario.model.to_json(),
        "weights": scenario.weights.to_json(),
        "seed": scenario.seed,
        "engine": scenario.engine.to_json(),
        "job": {"kind": "run", "workload": scenario.workload.to_json()},
    }
    (folder / "run.spec.json").write_text(json.dumps(spec))
    cache = JsonCache(work / "cache")
    for rid, data in requests.items():
        error = new_error if rid == "n0" else (0.05 if stale and rid == "o0" else 0.0)
        ref = [-1.0 - 0.01 - error] * len(data["tokens"])
        cache.put(suite._ref_key(scenario, data["prompt"], data["tokens"]), ref)
    # The alone run: n0 alone greedily picked another first token (a tie).
    ctx = suite.Context(work)
    sr = suite.ScenarioRun(
        scenario,
        suite.Variant(variant),
        process.ChildResult("run", 0, result, None, 0.0, Path("-"), Path("-")),
    )
    job = suite._alone_job(sr)
    assert job is not None
    alone = {"n0": _request([11], list(range(500, 512)), "new", 0)}
    ctx.cache.put(job[0], {"requests": alone})
    cache.put(suite._ref_key(scenario, [11], alone["n0"]["tokens"]), [-1.01] * 12)


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "engine-results"
    work = root / "work"
    _write_run(work, "half", list(range(500, 512)), stale=True, new_error=0.5)
    # The full fix: a greedy tie went the other way at output 0, errors at
    # the floor; the old rule failed it on the tokens alone.
    _write_run(work, "full", [999, *range(501, 512)], stale=False, new_error=0.0)
    old = [
        {"scenario": SCENARIO, "variant": "half", "result": "FAIL", "reason": "old"},
        {"scenario": SCENARIO, "variant": "full", "result": "FAIL", "reason": "old"},
    ]
    (root / "s2-pr51565-graphs.json").write_text(json.dumps({"results": old}))
    phases = [
        {"batch": 1, "timing": [{"s": 0.5, "tokens": 1, "firsts": 1}, {"s": 0.01, "tokens": 3}]}
    ]
    for name in ("unpatched", "kernel"):
        folder = work / "runs" / name / "throughput"
        folder.mkdir(parents=True)
        scale = 1.0 if name == "unpatched" else 1.25
        for p in phases:
            p["timing"][1]["firsts"] = 0
            p["timing"][1]["s"] = 0.01 * scale
        (folder / "throughput.result.json").write_text(json.dumps({"ok": True, "phases": phases}))

    def no_engine(*args: object, **kw: object) -> None:
        raise AssertionError("rescoring started an engine")

    monkeypatch.setattr(suite, "run_child", no_engine)
    return root


def test_rescore_applies_the_current_rules_to_the_stored_runs(results: Path) -> None:
    done, notes = rescore.rescore(results)
    by = {(r["variant"]): r for r in done["s2-pr51565-graphs"]["results"]}
    assert by["half"]["result"] == "FAIL"
    assert by["half"]["reason"].startswith("the runner replayed the FULL decode graph")
    assert by["half"]["stale_steps"] == 1 and by["half"]["stale_replays"] == 1
    assert by["full"]["result"] == "PASS", by["full"]["reason"]
    assert "n0 at output 0" in by["full"]["reason"]
    assert notes == []
    stats = done["s7-throughput"]["variants"]["kernel"]["phases"][0]
    assert stats["step_ms"] == pytest.approx(12.5)


def test_rescore_main_prints_the_tables_and_the_changed_verdicts(
    results: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tmp_path / "engine-results.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(results, arcname="engine-results")
    out = tmp_path / "rescored.txt"
    assert rescore.main([str(archive), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    assert "pr51565-full-graphs [full]: FAIL -> PASS" in text
    assert "pr51565-full-graphs [half]" not in text.split("differ from the stored")[1]
    assert "1 builds in 1 steps" in text and "pr51565-full-graphs [full]: PASS:" in text
    assert "(0.800)" in text  # kernel throughput vs unpatched, re-derived from the raw timings


def test_a_redesigned_workload_is_rescored_on_what_ran(results: Path) -> None:
    spec_path = results / "work" / "runs" / "full" / SCENARIO / "run.spec.json"
    spec = json.loads(spec_path.read_text())
    spec["job"]["workload"]["name"] = "an-older-design"
    spec_path.write_text(json.dumps(spec))
    _, notes = rescore.rescore(results)
    assert notes and notes[0].startswith(f"{SCENARIO} [full]: rescored on the workload that ran")


def test_no_results_folder_is_exit_2(tmp_path: Path) -> None:
    assert rescore.main([str(tmp_path)]) == 2
