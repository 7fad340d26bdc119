"""The engine child: ``python -m gdn_backport.engine_suite.driver --spec FILE``.

One process, one engine: it builds ``vllm.LLM`` from a JSON run spec (our
seeded weights in place of the dummy ones, the recorder and the gate meter
installed first), drives ``llm.llm_engine`` step by step and writes one JSON
result to the spec's ``result`` path (stdout when it has none). Jobs:

``run``
    add each workload request at its arrival step, call
    ``LLMEngine.step()`` until all are done; every request's output token
    ids and chosen logprobs (greedy, ``logprobs=0``, ``ignore_eos``), each
    token tagged with the step that produced it; the recorder's builds and
    steps, the gate statistics, the probe counters, engine metrics.
``score``
    the teacher-forced reference: each given token sequence as a prompt
    with ``prompt_logprobs=0``; the logprob of every actual token from
    ``start`` on.
``throughput``
    batches of equal requests one after another; seconds per step.

Any exception gives ``{"ok": false, "error", "traceback"}`` and exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gdn_backport.engine_suite.config import ENGINE_ENV, EngineConfig
from gdn_backport.engine_suite.model import ModelShape
from gdn_backport.engine_suite.weights import WeightRules
from gdn_backport.engine_suite.workload import Request, Workload

__all__ = ["main"]

RESULT_VERSION = 1
# The attribute our in-memory patch (the vLLM plugin) sets on the function it
# installs, with its record (the runtime patch's ``live.MARKER``): read by name,
# so the driver needs none of the analysis the plugin imports.
PATCH_MARK = "__gdn_backport__"
MAX_STEPS = 5000


@dataclasses.dataclass
class _Tracked:
    request: Request
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    steps: list[int] = dataclasses.field(default_factory=list)
    added: int | None = None
    finished: int | None = None
    finish_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "steps": self.steps,
            "role": self.request.role,
            "added_step": self.added,
            "finished_step": self.finished,
            "finish_reason": self.finish_reason,
        }


def _vllm() -> Any:
    # Imported only in the engine process, after the environment is set.
    import importlib

    return importlib.import_module("vllm")


def _chosen(entry: Any, token: int) -> float | None:
    """The logprob of ``token`` in one position's logprobs (a dict of
    ``Logprob``, or None where vLLM gave none)."""
    if entry is None:
        return None
    try:
        lp = entry[token]
    except (KeyError, IndexError, TypeError):
        return None
    value = getattr(lp, "logprob", lp)
    return float(value) if value is not None else None


def _resolve(workload: Workload, block_size: int | None) -> dict[str, list[int]]:
    """Each request's real prompt (``prefix_of`` needs the engine's block size)."""
    prompts: dict[str, list[int]] = {}
    for r in workload.requests:
        if r.prefix_of is None:
            prompts[r.id] = list(r.prompt)
            continue
        if not block_size:
            raise RuntimeError(f"request {r.id}: prefix_of needs the engine's block size")
        source = prompts.get(r.prefix_of) or list(
            next(s.prompt for s in workload.requests if s.id == r.prefix_of)
        )
        blocks = r.prefix_blocks or len(source) // block_size
        need = blocks * block_size
        if not blocks or len(source) < need:
            raise RuntimeError(
                f"request {r.id}: prefix_of {r.prefix_of} needs {blocks or 1} block(s) of "
                f"{block_size} tokens; {r.prefix_of}'s prompt has {len(source)}"
            )
        prompts[r.id] = source[:need] + list(r.prompt)
    return prompts


class Session:
    """One engine process: the LLM, the recorder and the gate meter."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from gdn_backport.engine_suite import gates, recorder, weights

        self.spec = spec
        self.model = ModelShape.from_json(spec.get("model", {}))
        self.rules = WeightRules.from_json(spec.get("weights", {}))
        self.engine_config = EngineConfig.from_json(spec.get("engine", {}))
        self.weights_undo = weights.install(self.rules)
        self.recorder = recorder.Recorder()
        self.recorder.enabled = bool(spec.get("record", True))
        self.meter = gates.GateMeter(self.recorder.tokens)
        self.layers: dict[str, Any] = {}
        self.next_step = 0
        # The runner's request ids (vLLM adds a random suffix) -> ours.
        self.names: dict[str, str] = {}
        self.recorder.on_first_step.append(self._first_step)
        self.recorder_undo = recorder.install(self.recorder)

        LLM = _vllm().LLM
        kwargs = self.engine_config.llm_kwargs(
            str(spec["model_dir"]), int(spec.get("seed", 0)), self.model.dtype
        )
        start = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.init_s = time.perf_counter() - start
        self.kwargs = kwargs

    def _first_step(self, runner: Any) -> None:
        from gdn_backport.engine_suite import gates

        context = getattr(
            getattr(runner, "compilation_config", None), "static_forward_context", None
        )
        self.layers = gates.find_gdn_layers(dict(context or {}))
        if self.recorder.enabled:
            self.meter.attach(self.layers)

    @property
    def engine(self) -> Any:
        return self.llm.llm_engine

    def block_size(self) -> int | None:
        config = getattr(self.engine, "vllm_config", None)
        size = getattr(getattr(config, "cache_config", None), "block_size", None)
        return int(size) if size else None

    def drive(
        self, workload: Workload, prefix: str = ""
    ) -> tuple[dict[str, _Tracked], list[dict[str, Any]]]:
        """Run ``workload`` to the end; returns the requests and per-step timing."""
        SamplingParams = _vllm().SamplingParams
        prompts = _resolve(workload, self.block_size())
        tracked = {r.id: _Tracked(r, prompts[r.id]) for r in workload.requests}
        pending = list(workload.requests)
        timing: list[dict[str, Any]] = []
        # Steps count on across the workloads of one engine (throughput phases).
        step = first = self.next_step
        engine = self.engine
        while True:
            for r in list(pending):
                if self._due(r, step, tracked):
                    params = SamplingParams(
                        max_tokens=r.max_tokens,
                        temperature=0.0,
                        logprobs=0,
                        detokenize=False,
                        ignore_eos=True,
                    )
                    internal = engine.add_request(
                        prefix + r.id, {"prompt_token_ids": tracked[r.id].prompt}, params
                    )
                    self.names[str(internal) if internal is not None else prefix + r.id] = r.id
                    tracked[r.id].added = step
                    pending.remove(r)
            if not pending and not engine.has_unfinished_requests():
                break
            if step - first >= MAX_STEPS:
                raise RuntimeError(
                    f"workload {workload.name}: not finished after {MAX_STEPS} steps"
                )
            self.recorder.step = step
            self.recorder.step_dispatch = None
            cpu = time.process_time()
            start = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu
            made = firsts = 0
            for out in outputs:
                t = tracked.get(str(out.request_id)[len(prefix) :])
                if t is None:
                    continue
                new, had = self._collect(t, out, step)
                made += new
                firsts += bool(new and had == 0)
            # cpu_s: this process's CPU time (all threads) in the step: a
            # wall time that grows without it is waiting (GPU, contention).
            timing.append(
                {
                    "step": step,
                    "s": round(seconds, 6),
                    "cpu_s": round(cpu, 6),
                    "tokens": made,
                    "firsts": firsts,
                    "dispatch": self.recorder.step_dispatch,
                }
            )
            step += 1
        self.recorder.step = None
        self.next_step = step
        return tracked, timing

    @staticmethod
    def _due(r: Request, step: int, tracked: dict[str, _Tracked]) -> bool:
        if r.after is None:
            return step >= r.arrival
        done = tracked[r.after].finished
        return done is not None and step >= done + r.arrival

    @staticmethod
    def _collect(t: _Tracked, out: Any, step: int) -> tuple[int, int]:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = completion.logprobs
        had = len(t.tokens)
        for i in range(had, len(tokens)):
            entry = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            t.tokens.append(int(tokens[i]))
            t.logprobs.append(_chosen(entry, int(tokens[i])))
            t.steps.append(step)
        if out.finished and t.finished is None:
            t.finished = step
            t.finish_reason = getattr(completion, "finish_reason", None)
        return len(tokens) - had, had

    def score(self, sequences: Sequence[dict[str, Any]]) -> dict[str, list[float | None]]:
        SamplingParams = _vllm().SamplingParams
        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, ignore_eos=True
        )
        prompts = [{"prompt_token_ids": list(s["tokens"])} for s in sequences]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        scored: dict[str, list[float | None]] = {}
        for seq, out in zip(sequences, outputs, strict=True):
            tokens = list(seq["tokens"])
            plp = out.prompt_logprobs or []
            scored[str(seq["id"])] = [
                _chosen(plp[p] if p < len(plp) else None, tokens[p])
                for p in range(int(seq["start"]), len(tokens))
            ]
        return scored

    # -- what the result says about the engine ------------------------------

    def facts(self) -> dict[str, Any]:
        from gdn_backport.engine_suite import weights

        vllm = _vllm()

        facts: dict[str, Any] = {
            "vllm": {
                "version": getattr(vllm, "__version__", None),
                "path": os.path.dirname(vllm.__file__ or ""),
            },
            "env": {
                k: os.environ.get(k) for k in ("VLLM_PLUGINS", "GDN_BACKPORT_PROBE", "PYTHONPATH")
            },
            "llm_kwargs": self.kwargs,
            "init_s": round(self.init_s, 3),
            "block_size": self.block_size(),
            "live": live_forward_core(self.layers),
            "weights": [r.to_json() for r in weights.REPORTS],
            "metrics": engine_metrics(self.llm),
            "probe": probe_counts(),
        }
        torch = sys.modules.get("torch")
        if torch is not None:
            cuda = torch.cuda.is_available()
            facts["torch"] = {
                "version": torch.__version__,
                "device": torch.cuda.get_device_name(0) if cuda else None,
            }
        config = getattr(self.engine, "vllm_config", None)
        if config is not None:
            facts["cudagraph_mode"] = str(
                getattr(config.compilation_config, "cudagraph_mode", None)
            )
        return facts


def live_forward_core(layers: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``_forward_core`` each GDN layer class holds now: where it comes
    from, the file's digest, and our in-memory patch's record if it is ours."""
    seen: dict[type, dict[str, Any]] = {}
    for layer in layers.values():
        cls = type(layer)
        if cls in seen:
            continue
        fn = getattr(cls, "_forward_core", None)
        code = getattr(fn, "__code__", None)
        file = getattr(code, "co_filename", None)
        digest = None
        if file and Path(file).is_file():
            digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16]
        mark = getattr(fn, PATCH_MARK, None)
        seen[cls] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "file": file,
            "line": getattr(code, "co_firstlineno", None),
            "sha256": digest,
            "runtime_patch": {k: v for k, v in mark.items() if k in ("upstream", "strategy")}
            if isinstance(mark, dict)
            else None,
        }
    return list(seen.values())


def probe_counts() -> dict[str, Any] | None:
    """Our reachability probe's counters when it runs in this process."""
    if os.environ.get("GDN_BACKPORT_PROBE") != "1":
        return None
    from gdn_backport.runtime import probe

    return probe.PROBE.counts().to_json()


def engine_metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for m in llm.get_metrics():
            if not any(k in m.name for k in ("spec_decode", "prefix_cache", "num_preempt")):
                continue
            for attr in ("value", "values", "sum"):
                value = getattr(m, attr, None)
                if value is not None:
                    out[m.name] = (
                        value if isinstance(value, int | float) else [float(v) for v in value]
                    )
                    break
    except Exception as exc:  # metrics are a nicety, never a failure
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _summary(result: dict[str, Any]) -> str:
    if not result.get("ok"):
        return f"gdn-backport engine: {result.get('kind')}: error: {result.get('error')}"
    if result["kind"] != "run":
        seconds = f"init {result.get('init_s')} s, gen {result.get('gen_s')} s"
        return f"gdn-backport engine: {result['kind']}: ok ({seconds})"
    rec = result.get("recorder") or {}
    builds = rec.get("builds", [])
    tokens = sum(len(r["tokens"]) for r in result["requests"].values())
    misordered = sum(1 for b in builds if b["misordered"])
    from gdn_backport.engine_suite.gates import GateThresholds, verdict

    _, gates = verdict(result.get("gates"), GateThresholds())
    return (
        f"gdn-backport engine: run: {len(result['requests'])} requests, {tokens} tokens in "
        f"{len(result.get('timing', []))} steps; {len(builds)} builds, {misordered} misordered; "
        f"{gates}"
    )


def run(spec: dict[str, Any]) -> dict[str, Any]:
    job = spec.get("job", {})
    kind = job.get("kind", "run")
    if kind not in ("run", "score", "throughput"):
        raise ValueError(f"job kind {kind!r}: expected run, score or throughput")
    if kind != "run":
        spec = {**spec, "record": False}
    session = Session(spec)
    result: dict[str, Any] = {"ok": True, "kind": kind, "version": RESULT_VERSION}
    start = time.perf_counter()
    if kind == "run":
        tracked, timing = session.drive(Workload.from_json(job["workload"]))
        result["requests"] = {rid: t.to_json() for rid, t in tracked.items()}
        result["timing"] = timing
    elif kind == "score":
        result["scores"] = session.score(job["sequences"])
    else:
        from gdn_backport.engine_suite.workload import throughput

        phases = []
        for batch in job["batches"]:
            w = throughput(
                int(spec.get("seed", 0)),
                session.model.prompt_token_range,
                int(batch),
                int(job["prompt_len"]),
                int(job["max_tokens"]),
            )
            phase_start = time.perf_counter()
            tracked, timing = session.drive(w, prefix=f"b{batch}-")
            phases.append(
                {
                    "batch": int(batch),
                    "seconds": round(time.perf_counter() - phase_start, 4),
                    "tokens": sum(len(t.tokens) for t in tracked.values()),
                    "timing": timing,
                }
            )
        result["phases"] = phases
    result["gen_s"] = round(time.perf_counter() - start, 3)
    result.update(session.facts())
    if session.recorder.enabled:
        result["recorder"] = session.recorder.to_json(session.names)
        result["gates"] = session.meter.summary()
    return result


def _load(text: str) -> dict[str, Any]:
    data = json.loads(
        text if text.lstrip().startswith("{") else Path(text).read_text(encoding="utf-8")
    )
    if not isinstance(data, dict):
        raise ValueError("the run spec is not a JSON object")
    return data


def _write(path: str | None, result: dict[str, Any]) -> None:
    text = json.dumps(result, default=str) + "\n"
    if not path:
        sys.stdout.write(text)
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdn_backport.engine_suite.driver")
    parser.add_argument("--spec", required=True, help="the run spec: a JSON file, or JSON text")
    args = parser.parse_args(argv)
    result_path: str | None = None
    kind: str | None = None
    try:
        spec = _load(args.spec)
        kind = spec.get("job", {}).get("kind", "run")
        result_path = spec.get("result")
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        result = run(spec)
        code = 0
    except BaseException as exc:  # the parent needs a result whatever happened
        result = {
            "ok": False,
            "kind": kind,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        code = 1
    _write(result_path, result)
    print(_summary(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
