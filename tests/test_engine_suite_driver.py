"""The driver's JSON contract, against the fake vLLM (tests/engine_fake_vllm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gdn_backport.engine_suite.config import EngineConfig
from gdn_backport.engine_suite.model import ModelShape, write_model_dir
from gdn_backport.engine_suite.process import child_env
from gdn_backport.engine_suite.weights import WeightRules
from gdn_backport.engine_suite.workload import pr_recipe
from tests.engine_fake_vllm import make_site

VOCAB = ModelShape().prompt_token_range
BAD_SPEC = '{"job": {"kind": "dance"}}'


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return make_site(tmp_path)


def drive(
    tmp_path: Path, site: Path, job: dict[str, Any], engine: EngineConfig, **env: str
) -> tuple[int, dict[str, Any], str]:
    spec = {
        "model_dir": str(write_model_dir(tmp_path / "model")),
        "model": ModelShape().to_json(),
        "weights": WeightRules().to_json(),
        "seed": 0,
        "engine": engine.to_json(),
        "job": job,
        "result": str(tmp_path / "result.json"),
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "gdn_backport.engine_suite.driver", "--spec", str(path)],
        env=child_env({"PYTHONPATH": str(site), **env}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, json.loads((tmp_path / "result.json").read_text()), proc.stdout


def test_run_job(tmp_path: Path, site: Path) -> None:
    workload = pr_recipe(0, VOCAB, (120, 64), max_tokens=64)
    engine = EngineConfig(num_speculative_tokens=2, max_model_len=128, max_num_seqs=8)
    rc, result, stdout = drive(
        tmp_path, site, {"kind": "run", "workload": workload.to_json()}, engine
    )
    assert rc == 0 and result["ok"] and result["kind"] == "run"
    p0, p1 = result["requests"]["p0"], result["requests"]["p1"]
    assert p0["prompt"] == list(workload.requests[0].prompt)
    # p0 runs into max_model_len=128: 8 tokens; p1 makes all 64.
    assert (len(p0["tokens"]), len(p1["tokens"])) == (8, 64)
    assert p1["steps"] == list(range(64)) and p0["finish_reason"] == "length"
    assert all(isinstance(lp, float) for lp in p1["logprobs"])
    rec = result["recorder"]
    misordered = [b for b in rec["builds"] if b["misordered"]]
    # The fake drafts nothing once 1 + k tokens would pass the limit: two steps.
    assert {b["step"] for b in misordered} == {6, 7} and misordered[0]["displaced"] == {"p1": 1}
    assert rec["other_builds"] == {"capture": 0, "other": 1}
    assert result["gates"]["measured"]
    assert result["vllm"]["version"] == "0.0.fake" and result["vllm"]["path"].startswith(str(site))
    assert (
        result["live"][0]["class"].endswith("FakeGatedDeltaNet")
        and result["live"][0]["runtime_patch"] is None
    )
    assert result["llm_kwargs"]["async_scheduling"] is False
    assert result["llm_kwargs"]["speculative_config"] == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }
    assert result["weights"] and result["block_size"] == 16
    assert "2 requests, 72 tokens" in stdout and "gates vary" in stdout


def test_score_job(tmp_path: Path, site: Path) -> None:
    seq = {"id": "s", "tokens": [20, 21, 22, 23, 24], "start": 3}
    rc, result, _ = drive(tmp_path, site, {"kind": "score", "sequences": [seq]}, EngineConfig())
    assert rc == 0 and result["kind"] == "score"
    assert len(result["scores"]["s"]) == 2 and "recorder" not in result


def test_an_exception_gives_a_traceback_and_exit_1(tmp_path: Path, site: Path) -> None:
    rc, result, stdout = drive(
        tmp_path,
        site,
        {"kind": "run", "workload": {"name": "w", "requests": []}},
        EngineConfig(),
        FAKE_VLLM_CRASH="1",
    )
    assert rc == 1 and result["ok"] is False
    assert result["error"].startswith("RuntimeError: fake engine: CUDA out of memory")
    assert "Traceback" in result["traceback"] and "error:" in stdout


def test_a_bad_spec_still_answers(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gdn_backport.engine_suite.driver", "--spec", BAD_SPEC],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    result = json.loads(proc.stdout.splitlines()[0])
    assert result["ok"] is False and "job kind 'dance'" in result["error"]


def test_the_patch_mark_is_the_plugins() -> None:
    from gdn_backport.engine_suite.driver import PATCH_MARK
    from gdn_backport.patchsets.pr51812.runtime import live

    assert live.MARKER == PATCH_MARK


def test_throughput_steps_carry_their_graph_mode_and_cpu_time(tmp_path: Path, site: Path) -> None:
    # What separates a lost FULL replay from a host cost (docs/engine_suite.md, "Open").
    engine = EngineConfig(
        num_speculative_tokens=2,
        enforce_eager=False,
        cudagraph_mode="FULL_AND_PIECEWISE",
        max_model_len=256,
        max_num_seqs=8,
    )
    job = {"kind": "throughput", "batches": [2], "prompt_len": 8, "max_tokens": 6}
    rc, result, _ = drive(tmp_path, site, job, engine)
    assert rc == 0 and result["ok"], result
    (phase,) = result["phases"]
    modes = [t["dispatch"] for t in phase["timing"]]
    # The prompt step is mixed (PIECEWISE), the uniform spec steps FULL.
    assert modes[0] == "PIECEWISE" and set(modes[1:]) == {"FULL"}
    assert all(t["cpu_s"] >= 0.0 for t in phase["timing"])
    assert "recorder" not in result
