"""The production scenario on the CPU fake's 0.25.1 scheduler: the fake
schedules the H200 run's first production workload exactly as vLLM 0.25.1
did (every build's rows and query lengths, from the committed run data), and
the redesigned workload reaches misordered builds through both of its
mechanisms (follow-up pairs, conversations running into max_model_len)."""

from __future__ import annotations

import dataclasses
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from gdn_backport.engine_suite.model import ModelShape
from gdn_backport.engine_suite.scenarios import collect
from gdn_backport.engine_suite.suite import Variant, run_engine_suite
from gdn_backport.engine_suite.workload import production
from tests.engine_fake_vllm import make_site

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "bench" / "results" / "h200_engine_s7" / "engine-results.tar.gz"
MEMBER = "engine-results/work/runs/unpatched/pr51812-production/run.result.json"


def _run(tmp_path: Path, workload: Any = None, **env: str) -> tuple[Any, dict[str, Any]]:
    (scenario,) = collect(names=["pr51812-production"])
    if workload is not None:
        scenario = dataclasses.replace(scenario, workload=workload)
    site = make_site(tmp_path)
    work = tmp_path / "work"
    report = run_engine_suite(
        None,
        None,
        workdir=work,
        json=True,
        variant=Variant("fake", {"PYTHONPATH": str(site), **env}),
        require_cuda=False,
        scenarios=[scenario],
    )
    result = work / "runs" / "fake" / scenario.name / "run.result.json"
    return report.results[0], json.loads(result.read_text())


def _rows(result: dict[str, Any]) -> list[tuple[int, list[str | None], list[int]]]:
    return [
        (b["step"], b["req_ids"], b["query_lens"])
        for b in result["recorder"]["builds"]
        if b["group"] == 0
    ]


def test_the_fake_schedules_the_h200_production_run_as_vllm_did(tmp_path: Path) -> None:
    with tarfile.open(H200) as tar:
        member = tar.extractfile(MEMBER)
        assert member is not None
        gpu = json.load(member)
    old = production(0, ModelShape().prompt_token_range, streams=8, shared_prefix=320, gap=3)
    assert [r["prompt"] for r in gpu["requests"].values()] == [list(r.prompt) for r in old.requests]
    verdict, fake = _run(tmp_path, workload=old)
    # Chunk sizes (432/144/146: the align split with MTP's last-block prune),
    # prefix hits of 144 and 288, row order: all 128 steps alike.
    assert _rows(fake) == _rows(gpu)
    assert verdict.result == "INCONCLUSIVE" and verdict.misordered == 0


@pytest.fixture(scope="module")
def redesigned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("production"))


def test_the_redesigned_workload_reaches_misordered_builds_both_ways(
    redesigned: tuple[Any, dict[str, Any]],
) -> None:
    verdict, result = redesigned
    assert verdict.result == "PASS", verdict.reason
    builds = [b for b in result["recorder"]["builds"] if b["misordered"] and b["group"] == 0]
    pairs = [b for b in builds if any(r.startswith("fb") for r in b["displaced"])]
    limits = [b for b in builds if b not in pairs]
    assert len(pairs) == 6 and len(limits) >= 4, [b["step"] for b in builds]
    # A pair's step: the 2-3 token follow-up (no drafts), then the padded
    # one-token follow-up as a spec row (1 + 3 tokens, 3 placeholder drafts).
    first = pairs[0]
    row = first["req_ids"].index("fb0")
    assert first["req_ids"][row - 1] == "fa0" and first["drafts"][row - 1] == -1
    assert first["query_lens"][row] == 4 and first["drafts"][row] == 3
    assert first["computed"][row] == 288  # the hit: two 144-token blocks
    # A conversation's last step before max_model_len: one token, no drafts.
    last = limits[0]
    ids = [r for r, d in zip(last["req_ids"], last["drafts"], strict=True) if d == -1]
    assert any(r.startswith("L") for r in ids)
    assert verdict.tagged.count >= 100


def test_the_redesigned_workload_fails_on_ungathered_gates(tmp_path: Path) -> None:
    verdict, _ = _run(tmp_path, FAKE_VLLM_GATES="ungathered")
    assert verdict.result == "FAIL" and "x the floor" in verdict.reason
