"""The parent side: preflight, the engine children, the reference, the verdicts.

For each scenario the engine under test runs once (a child process); rules
that compare with an alone run get one more engine (cached). Then one
reference engine per model scores, teacher-forced, every token sequence not
scored before (cached by model and sequence, so variants of the same vLLM
share it). Last, each scenario's rule judges its evidence.

:func:`run_engine_suite` is the whole thing for the vLLM this Python (or
``python``) imports; the pieces (:func:`run_engines`,
:func:`score_references`, :func:`evaluate`) let ``bench/bench_engine.py`` run
several variants of one install and score them all with one reference.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gdn_backport.engine_suite import preflight
from gdn_backport.engine_suite.cache import JsonCache, key
from gdn_backport.engine_suite.config import EngineConfig
from gdn_backport.engine_suite.gates import verdict as gate_verdict
from gdn_backport.engine_suite.model import (
    ARCHITECTURE,
    MTP_ARCHITECTURE,
    ModelShape,
    write_model_dir,
)
from gdn_backport.engine_suite.process import ChildResult, child_env, run_child
from gdn_backport.engine_suite.recorder import BuildRecord, StepRecord
from gdn_backport.engine_suite.report import EngineReport, ScenarioResult
from gdn_backport.engine_suite.rules import FAIL, INCONCLUSIVE
from gdn_backport.engine_suite.scenario import EngineScenario
from gdn_backport.engine_suite.scoring import (
    Evidence,
    RunRequest,
    aggregate,
    attribute,
    post_mixed,
    score_tokens,
    union,
    worst,
)
from gdn_backport.engine_suite.weights import WeightRules
from gdn_backport.engine_suite.workload import Request, Workload

__all__ = [
    "Context",
    "ScenarioRun",
    "Variant",
    "as_run",
    "evaluate",
    "run_engine_suite",
    "run_engines",
    "score_references",
    "stored_run",
]

REFERENCE_TIMEOUT_S = 420.0
# Below this many seconds before the deadline no engine is started.
MIN_START_S = 45.0


@dataclass(frozen=True)
class Variant:
    """One build of the installed vLLM: a name and the environment that
    selects it (PYTHONPATH of a patched copy, VLLM_PLUGINS, ...)."""

    name: str = "installed"
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Context:
    workdir: Path
    python: str = sys.executable
    base_env: Mapping[str, str] | None = None
    reuse: bool = False
    deadline: float | None = None  # time.monotonic() after which nothing starts
    timeout_scale: float = 1.0
    log: Callable[[str], None] = lambda line: None
    deadline_hit: bool = False

    def __post_init__(self) -> None:
        self.cache = JsonCache(self.workdir / "cache")

    def env(self, variant: Variant) -> dict[str, str]:
        return child_env(variant.env, base=self.base_env)

    def run(
        self,
        spec: dict[str, Any],
        folder: Path,
        name: str,
        timeout: float,
        variant: Variant,
        reuse: bool = False,
    ) -> ChildResult:
        """One engine child; one killed because the deadline cut its timeout
        short marks the deadline as hit (its work is redone next time)."""
        child = run_child(self.python, spec, folder, name, timeout, self.env(variant), reuse=reuse)
        if child.timed_out and self.deadline is not None and time.monotonic() >= self.deadline - 1:
            self.deadline_hit = True
        return child

    def timeout(self, wanted: float) -> float | None:
        """The timeout a child may have now; None when none may start."""
        wanted *= self.timeout_scale
        if self.deadline is None:
            return wanted
        left = self.deadline - time.monotonic()
        if left < MIN_START_S:
            self.deadline_hit = True
            return None
        return min(wanted, left)


@dataclass
class ScenarioRun:
    scenario: EngineScenario
    variant: Variant
    run: ChildResult | None
    alone: dict[str, Any] | None = None
    skipped: str | None = None


def _model_dir(ctx: Context, scenario: EngineScenario) -> Path:
    return write_model_dir(ctx.workdir / "models" / scenario.model.digest(), scenario.model)


def _spec(
    ctx: Context,
    scenario: EngineScenario,
    engine: EngineConfig,
    job: dict[str, Any],
    record: bool = True,
) -> dict[str, Any]:
    return {
        "model_dir": str(_model_dir(ctx, scenario)),
        "model": scenario.model.to_json(),
        "weights": scenario.weights.to_json(),
        "seed": scenario.seed,
        "engine": engine.to_json(),
        "job": job,
        "record": record,
    }


def _model_key(scenario: EngineScenario) -> list[Any]:
    return [scenario.model.digest(), scenario.weights.to_json(), scenario.seed]


def _skipped(ctx: Context, name: str, folder: Path) -> ChildResult:
    return ChildResult(
        name, None, None, "not started: the deadline was reached", 0.0, folder / "-", folder / "-"
    )


def run_engines(
    scenarios: Sequence[EngineScenario], variant: Variant, ctx: Context
) -> list[ScenarioRun]:
    """Each scenario's engine, then its alone run where its rule wants one."""
    out = []
    for scenario in scenarios:
        folder = ctx.workdir / "runs" / variant.name / scenario.name
        timeout = ctx.timeout(scenario.timeout_s)
        if timeout is None:
            out.append(
                ScenarioRun(scenario, variant, _skipped(ctx, "run", folder), skipped="deadline")
            )
            continue
        ctx.log(f"engine: {variant.name}: {scenario.name} ({scenario.engine.graphs})")
        job = {"kind": "run", "workload": scenario.workload.to_json()}
        child = ctx.run(
            _spec(ctx, scenario, scenario.engine, job), folder, "run", timeout, variant, ctx.reuse
        )
        ctx.log(f"  {'ok' if child.ok else 'error: ' + str(child.error)} ({child.seconds:.0f} s)")
        sr = ScenarioRun(scenario, variant, child, skipped="deadline" if ctx.deadline_hit else None)
        sr.alone = _alone(sr, ctx)
        out.append(sr)
    return out


def _alone_job(sr: ScenarioRun) -> tuple[str, Workload] | None:
    """The cache key and workload of a run's alone run; None when its rule
    wants none (or the run has no result)."""
    scenario = sr.scenario
    roles = scenario.rule.alone_roles
    if not roles or scenario.alone is None or sr.run is None or not sr.run.ok:
        return None
    assert sr.run.result is not None
    declared = {r.id: r for r in scenario.workload.requests}
    subjects = tuple(
        Request(rid, tuple(data["prompt"]), declared[rid].max_tokens, role=data["role"])
        for rid, data in sr.run.result["requests"].items()
        if data["role"] in roles
    )
    if not subjects:
        return None
    workload = Workload(f"{scenario.name}-alone", subjects)
    k = key("alone", _model_key(scenario), scenario.alone.to_json(), workload.to_json())
    return k, workload


def _alone(sr: ScenarioRun, ctx: Context) -> dict[str, Any] | None:
    found = _alone_job(sr)
    if found is None:
        return None
    k, workload = found
    scenario = sr.scenario
    assert scenario.alone is not None
    subjects = workload.requests
    cached = ctx.cache.get(k)
    if isinstance(cached, dict):
        return cached
    folder = ctx.workdir / "runs" / "alone" / k[:16]
    timeout = ctx.timeout(scenario.timeout_s)
    if timeout is None:
        return {"error": "not started: the deadline was reached"}
    ctx.log(f"alone: {scenario.name}: {len(subjects)} requests")
    job = {"kind": "run", "workload": workload.to_json()}
    # Alone runs are clean by construction (fresh slots, eager): any variant serves.
    child = ctx.run(_spec(ctx, scenario, scenario.alone, job), folder, "alone", timeout, sr.variant)
    if not child.ok or child.result is None:
        return {"error": f"alone run: {child.error}"}
    data = {"requests": child.result["requests"]}
    ctx.cache.put(k, data)
    return data


def as_run(scenario: EngineScenario, spec: Mapping[str, Any]) -> EngineScenario:
    """``scenario`` with the engine, workload, model and seed a stored run
    spec says were run (its rule stays the current one): a scenario
    redesigned since is still scored on what actually ran."""
    return dataclasses.replace(
        scenario,
        engine=EngineConfig.from_json(dict(spec["engine"])),
        workload=Workload.from_json(dict(spec["job"]["workload"])),
        model=ModelShape.from_json(dict(spec["model"])),
        weights=WeightRules.from_json(dict(spec["weights"])),
        seed=int(spec["seed"]),
    )


def stored_run(scenario: EngineScenario, variant: Variant, ctx: Context) -> ScenarioRun | None:
    """The run of ``scenario`` under ``variant`` that an earlier call left in
    ``ctx.workdir`` (its alone run from the cache), without starting
    anything; None when there is no stored result. Offline rescoring."""
    folder = ctx.workdir / "runs" / variant.name / scenario.name
    result_path, spec_path = folder / "run.result.json", folder / "run.spec.json"
    try:
        result = json.loads(result_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(result, dict):
        return None
    if spec_path.exists():
        scenario = as_run(scenario, json.loads(spec_path.read_text(encoding="utf-8")))
    error = None if result.get("ok") else str(result.get("error") or "the stored run failed")
    child = ChildResult(
        "run",
        0,
        result,
        error,
        0.0,
        folder / "run.stdout.txt",
        folder / "run.stderr.txt",
        reused=True,
    )
    sr = ScenarioRun(scenario, variant, child)
    job = _alone_job(sr)
    if job is not None:
        cached = ctx.cache.get(job[0])
        sr.alone = cached if isinstance(cached, dict) else {"error": "no stored alone run"}
    return sr


def _ref_key(scenario: EngineScenario, prompt: Sequence[int], tokens: Sequence[int]) -> str:
    return key("reference", _model_key(scenario), list(prompt), list(tokens))


def _sequences(sr: ScenarioRun) -> Iterable[tuple[str, list[int], int]]:
    """``(cache key, prompt + output, start)`` of every request of a run and
    of its alone run."""
    results = []
    if sr.run is not None and sr.run.ok and sr.run.result is not None:
        results.append(sr.run.result["requests"])
    if sr.alone and "requests" in sr.alone:
        results.append(sr.alone["requests"])
    for requests in results:
        for data in requests.values():
            prompt, tokens = list(data["prompt"]), list(data["tokens"])
            if tokens:
                yield _ref_key(sr.scenario, prompt, tokens), prompt + tokens, len(prompt)


def score_references(
    runs: Sequence[ScenarioRun], ctx: Context, variant: Variant | None = None
) -> dict[str, str]:
    """Score every sequence the cache lacks: one reference engine per model.
    Returns errors by model key (empty when all went well)."""
    groups: dict[str, tuple[EngineScenario, dict[str, tuple[list[int], int]]]] = {}
    for sr in runs:
        for k, tokens, start in _sequences(sr):
            if ctx.cache.get(k) is not None:
                continue
            gk = key(_model_key(sr.scenario))
            groups.setdefault(gk, (sr.scenario, {}))[1][k] = (tokens, start)
    errors: dict[str, str] = {}
    for gk, (scenario, seqs) in groups.items():
        longest = max(len(t) for t, _ in seqs.values())
        engine = EngineConfig(max_model_len=64 * math.ceil((longest + 8) / 64), max_num_seqs=32)
        job = {
            "kind": "score",
            "sequences": [{"id": k, "tokens": t, "start": s} for k, (t, s) in seqs.items()],
        }
        timeout = ctx.timeout(REFERENCE_TIMEOUT_S)
        if timeout is None:
            errors[gk] = "not started: the deadline was reached"
            continue
        ctx.log(f"reference: {len(seqs)} sequences (longest {longest})")
        child = ctx.run(
            _spec(ctx, scenario, engine, job, record=False),
            ctx.workdir / "runs" / "reference" / gk[:16],
            f"score-{int(time.time())}",
            timeout,
            variant or Variant(),
        )
        if not child.ok or child.result is None:
            errors[gk] = f"reference engine: {child.error}"
            continue
        for k, lps in child.result["scores"].items():
            ctx.cache.put(k, lps)
    return errors


def _requests(data: Mapping[str, Any]) -> dict[str, RunRequest]:
    return {rid: RunRequest.from_json(rid, d) for rid, d in data.items()}


def _reference(
    ctx: Context, scenario: EngineScenario, requests: Mapping[str, RunRequest]
) -> tuple[dict[str, list[float | None]], int]:
    refs: dict[str, list[float | None]] = {}
    missing = 0
    for rid, r in requests.items():
        if not r.tokens:
            continue
        lps = ctx.cache.get(_ref_key(scenario, r.prompt, r.tokens))
        if lps is None:
            missing += 1
        else:
            refs[rid] = lps
    return refs, missing


def evaluate(sr: ScenarioRun, ctx: Context, reference_error: str | None = None) -> ScenarioResult:
    scenario = sr.scenario
    base = ScenarioResult(
        scenario.name,
        scenario.patchset,
        FAIL,
        "",
        variant=sr.variant.name,
        graphs=scenario.engine.graphs,
    )
    if sr.run is None or not sr.run.ok or sr.run.result is None:
        base.result = INCONCLUSIVE if sr.skipped else FAIL
        base.reason = f"engine: {sr.run.error if sr.run else 'not run'}"
        if sr.run is not None:
            base.logs = {"stdout": str(sr.run.stdout), "stderr": str(sr.run.stderr)}
        return base
    result = sr.run.result
    requests = _requests(result["requests"])
    rec = result.get("recorder") or {}
    builds = [BuildRecord.from_json(b) for b in rec.get("builds", [])]
    steps = [StepRecord.from_json(s) for s in rec.get("steps", [])]
    events = attribute(builds)
    refs, missing = _reference(ctx, scenario, requests)
    scores = score_tokens(requests.values(), refs, events)
    fit, gates_line = gate_verdict(result.get("gates"), scenario.gates)
    alone_requests = alone_scores = None
    if sr.alone and "requests" in sr.alone:
        alone_requests = _requests(sr.alone["requests"])
        alone_refs, alone_missing = _reference(ctx, scenario, alone_requests)
        missing += alone_missing
        alone_scores = score_tokens(alone_requests.values(), alone_refs, {})
    ev = Evidence(
        scores, requests, builds, steps, events, fit, gates_line, alone_requests, alone_scores
    )
    if missing:
        verdict_result, reason = (
            INCONCLUSIVE,
            (
                f"no reference scores for {missing} requests"
                + (f" ({reference_error})" if reference_error else "")
            ),
        )
    elif sr.alone and "error" in sr.alone:
        verdict_result, reason = INCONCLUSIVE, str(sr.alone["error"])
    else:
        v = scenario.rule.evaluate(ev)
        verdict_result, reason = v.result, v.reason
    tagged = union(scores, scenario.rule.tags)
    clean = union(scores, ("clean",))
    ratio = tagged.mean / max(clean.mean, 1e-12) if tagged.count and clean.count else None
    base.result, base.reason = verdict_result, reason
    base.builds = len(builds)
    base.other_builds = dict(rec.get("other_builds", {}))
    base.mixed = sum(b.mixed for b in builds)
    base.misordered = sum(b.misordered for b in builds)
    classes: dict[str, int] = {}
    for e in events.values():
        if e.new_row_class:
            classes[e.new_row_class] = classes.get(e.new_row_class, 0) + 1
    base.new_rows = classes
    base.stale_replays = sum(b.stale_replay for b in builds)
    base.stale_steps = len({b.step for b in builds if b.stale_replay})
    base.recycled = len({rid for s in steps for rid in s.recycled})
    base.tagged, base.clean, base.ratio = tagged, clean, ratio
    base.post_mixed = post_mixed(scores, events)
    base.tags = aggregate(scores)
    base.worst = worst(scores, 10)
    base.gates = gates_line
    base.live = list(result.get("live", []))
    base.seconds = {
        "init": float(result.get("init_s", 0.0)),
        "gen": float(result.get("gen_s", 0.0)),
        "child": round(sr.run.seconds, 1),
    }
    base.logs = {"stdout": str(sr.run.stdout), "stderr": str(sr.run.stderr)}
    return base


def architectures(scenarios: Iterable[EngineScenario]) -> list[str]:
    """The model classes the engine must know for these scenarios."""
    archs = [ARCHITECTURE]
    if any(s.engine.num_speculative_tokens for s in scenarios):
        archs.append(MTP_ARCHITECTURE)
    return archs


def run_engine_suite(
    patchsets: Sequence[str] | None,
    scenario_names: Sequence[str] | None,
    *,
    workdir: Path,
    python: str | None = None,
    json: bool = False,
    variant: Variant | None = None,
    require_cuda: bool = True,
    scenarios: Sequence[EngineScenario] | None = None,
    reuse: bool = False,
) -> EngineReport:
    """Run the engine scenarios of ``patchsets`` (all when None; only
    ``scenario_names`` when given) on the vLLM ``python`` imports.

    ``json``: no progress lines on stderr. ``scenarios``: these instead of
    the registered ones (tests). ``require_cuda=False`` is for CPU fakes."""
    from gdn_backport.engine_suite import scenarios as registry

    started = time.monotonic()
    chosen = (
        list(scenarios) if scenarios is not None else registry.collect(patchsets, scenario_names)
    )
    if scenarios is not None and scenario_names:
        chosen = [s for s in chosen if s.name in scenario_names]
    if not chosen:
        raise ValueError(f"no engine scenario for patchset(s) {', '.join(patchsets or ['any'])}")
    variant = variant or Variant()

    def log(line: str) -> None:
        if not json:
            print(f"gdn-backport engine: {line}", file=sys.stderr, flush=True)

    ctx = Context(Path(workdir), python or sys.executable, reuse=reuse, log=log)
    refusal, facts = preflight.check(
        ctx.python, ctx.env(variant), architectures(chosen), require_cuda=require_cuda
    )
    report = EngineReport(refusal=refusal, facts=facts)
    if refusal is not None:
        return report
    runs = run_engines(chosen, variant, ctx)
    errors = score_references(runs, ctx, variant)
    report.results = [
        evaluate(sr, ctx, reference_error=next(iter(errors.values()), None)) for sr in runs
    ]
    report.seconds = time.monotonic() - started
    return report
