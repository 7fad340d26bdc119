"""The engine suite on the GPU machine, over variants of one installed vLLM.

Variants of the vLLM at ``--site`` (vLLM 0.25.1 there, affected by both fixes):

``unpatched``  the install as is (``VLLM_PLUGINS=`` empty: no plugin loads)
``gather``     a hard-link copy (``cp -al``) of ``vllm/`` under ``--variants``,
               patched by ``gdn-backport apply --patchset pr51812`` (our writes
               are temp+rename, so the linked originals stay untouched)
``kernel``     the same with ``--strategy kernel``
``plugin``     the install as is, ``VLLM_PLUGINS=gdn_backport`` (the in-memory
               fix) and ``GDN_BACKPORT_PROBE=1`` (the probe's counters)
``full``       a copy patched by ``--patchset pr51565`` (builder and runners)
``half``       ``full`` with the original runner files copied back: only the
               builder rewrite, what vLLM 0.31-0.33 ship
``kernel-off`` the ``kernel`` copy with ``GDN_BACKPORT_KERNEL=off``: the
               guarded call site sends every call to its fallback (the tree's
               kernel on gathered gates), so against ``kernel`` and ``gather``
               it splits the kernel strategy's step cost into the guard's and
               the op's (docs/engine_suite.md, "Open")

Steps run in priority order, each writing ``--results/<step>.json`` when
complete; a step whose file exists is skipped, and within a step every
engine result already there is reused, so a second call on the still-warm
machine continues where the first stopped. Reference scores are cached by
(model, seed, token sequence) and shared by all variants. Nothing starts
after ``--deadline`` seconds; the summary (the vLLM #51812 table per
variant, the pr51565 half-vs-full table, throughput, doctor, a progress
table) is printed last and copied with a tar.gz of the results to ``--out``.

    python bench/bench_engine.py --site /tmp/site --results /tmp/engine-results --out "$OUT"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gdn_backport.engine_suite import suite
from gdn_backport.engine_suite.config import EngineConfig
from gdn_backport.engine_suite.model import ModelShape, write_model_dir
from gdn_backport.engine_suite.process import child_env, run_child
from gdn_backport.engine_suite.scenarios import collect
from gdn_backport.engine_suite.weights import WeightRules

RUNNER_FILES = ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/model_runner.py")
APPLY = {
    "gather": ("--patchset", "pr51812"),
    "kernel": ("--patchset", "pr51812", "--strategy", "kernel"),
    "full": ("--patchset", "pr51565"),
    "half": ("--patchset", "pr51565"),
}
# Variants that are another variant's copy under extra environment.
ENV_VARIANTS = {"kernel-off": ("kernel", {"GDN_BACKPORT_KERNEL": "off"})}
PR51812 = ("pr51812-recipe", "pr51812-misorder-eager", "pr51812-misorder-graphs")
OUT_LIMIT = 15 * 1024 * 1024


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # suite, throughput, doctor
    # A throughput step may name a variant more than once: each run is its
    # own engine, in this order (alternating variants spreads drift).
    variants: tuple[str, ...]
    scenarios: tuple[str, ...] = ()
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # throughput steps
    folder: str = "throughput"  # throughput steps: runs/<variant>/<folder>[-n]


STEPS = (
    Step("s1-pr51812", "suite", ("unpatched", "gather"), PR51812),
    Step("s2-pr51565-graphs", "suite", ("half", "full", "unpatched"), ("pr51565-full-graphs",)),
    Step("s3-kernel", "suite", ("kernel",), PR51812),
    Step("s4-plugin", "suite", ("plugin",), PR51812),
    Step("s5-production", "suite", ("unpatched", "gather"), ("pr51812-production",)),
    Step(
        "s6-pr51565-rest",
        "suite",
        ("unpatched", "half", "full"),
        ("pr51565-eager", "pr51565-piecewise", "pr51565-prefix-hit"),
    ),
    Step("s7-throughput", "throughput", ("unpatched", "gather", "kernel")),
    Step("s8-doctor", "doctor", ("unpatched", "gather", "kernel", "plugin")),
    # The kernel strategy's step cost (docs/engine_suite.md, "Open"): each
    # variant twice, alternating; then PIECEWISE only, where the GDN op runs
    # outside any graph every step (the host cost of the guard and the op).
    Step(
        "s9-kernel-cost",
        "throughput",
        ("kernel", "gather", "kernel-off", "unpatched") * 2,
        folder="kernel-cost",
    ),
    Step(
        "s10-kernel-cost-piecewise",
        "throughput",
        ("kernel", "gather", "kernel-off", "unpatched"),
        cudagraph_mode="PIECEWISE",
        folder="kernel-cost-piecewise",
    ),
    # The same at FULL_AND_PIECEWISE with the order rotated over three
    # rounds after one warm-up engine (s9's first round showed the first
    # engine of a call paying for the call's compiles).
    Step(
        "s11-kernel-cost-rounds",
        "throughput",
        (
            "unpatched",  # warm-up, not compared
            *("unpatched", "kernel", "gather"),
            *("kernel", "gather", "unpatched"),
            *("gather", "unpatched", "kernel"),
        ),
        folder="kernel-cost-rounds",
    ),
)

BATCHES = (1, 8, 64)
THROUGHPUT: dict[str, Any] = {"batches": list(BATCHES), "prompt_len": 64, "max_tokens": 128}
THROUGHPUT_ENGINE = EngineConfig(
    num_speculative_tokens=2,
    enforce_eager=False,
    cudagraph_mode="FULL_AND_PIECEWISE",
    max_model_len=256,
    max_num_seqs=64,
)


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


# -- variants ---------------------------------------------------------------


def run_apply(python: str, args: Sequence[str], dest: Path, site: Path) -> list[str]:
    """``gdn-backport apply ARGS DEST``; its summary lines (the diff left out)."""
    proc = subprocess.run(
        [python, "-m", "gdn_backport", "apply", *args, str(dest)],
        env=child_env({"PYTHONPATH": str(site)}),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"apply {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return [line for line in proc.stdout.splitlines() if line and line[0] not in "+-@ "]


def prepare_variant(
    name: str,
    site: Path,
    root: Path,
    python: str = sys.executable,
    apply: Callable[[str, Sequence[str], Path, Path], list[str]] = run_apply,
) -> suite.Variant:
    """The environment that selects variant ``name`` (making its copy once)."""
    if name == "unpatched":
        return suite.Variant(name, {"PYTHONPATH": str(site), "VLLM_PLUGINS": ""})
    if name == "plugin":
        return suite.Variant(
            name,
            {
                "PYTHONPATH": str(site),
                "VLLM_PLUGINS": "gdn_backport",
                "GDN_BACKPORT_PROBE": "1",
                "GDN_BACKPORT_PROBE_EVERY": "0",
            },
        )
    if name in ENV_VARIANTS:
        base, extra = ENV_VARIANTS[name]
        made = prepare_variant(base, site, root, python, apply)
        return suite.Variant(name, {**made.env, **extra})
    dest = root / name
    ready = dest / ".gdn-backport-variant.json"
    if not ready.exists():
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        subprocess.run(["cp", "-al", str(site / "vllm"), str(dest / "vllm")], check=True)
        lines = apply(python, APPLY[name], dest, site)
        if name == "half":
            # Only the builder rewrite stays: the runners are upstream's again.
            for rel in RUNNER_FILES:
                if (site / rel).exists():
                    (dest / rel).unlink()
                    shutil.copy2(site / rel, dest / rel)
        ready.write_text(json.dumps({"name": name, "apply": list(APPLY[name]), "stdout": lines}))
    return suite.Variant(name, {"PYTHONPATH": f"{dest}{os.pathsep}{site}", "VLLM_PLUGINS": ""})


# -- steps ------------------------------------------------------------------


def run_suite_step(
    step: Step, variants: Mapping[str, suite.Variant], ctx: suite.Context
) -> dict[str, Any]:
    scenarios = collect(names=list(step.scenarios))
    runs = []
    for name in step.variants:
        runs += suite.run_engines(scenarios, variants[name], ctx)
    errors = suite.score_references(runs, ctx, variants.get("unpatched"))
    results = [suite.evaluate(sr, ctx, next(iter(errors.values()), None)) for sr in runs]
    incomplete = ctx.deadline_hit or any(sr.skipped for sr in runs)
    probe = {
        f"{sr.variant.name}/{sr.scenario.name}": sr.run.result.get("probe")
        for sr in runs
        if sr.run is not None and sr.run.result and sr.run.result.get("probe")
    }
    return {"results": [r.to_json() for r in results], "probe": probe, "complete": not incomplete}


def _throughput_spec(ctx: suite.Context, cudagraph_mode: str | None = None) -> dict[str, Any]:
    shape = ModelShape()
    engine = THROUGHPUT_ENGINE
    if cudagraph_mode is not None:
        engine = engine.replace(cudagraph_mode=cudagraph_mode)
    return {
        "model_dir": str(write_model_dir(ctx.workdir / "models" / shape.digest(), shape)),
        "model": shape.to_json(),
        "weights": WeightRules().to_json(),
        "seed": 0,
        "engine": engine.to_json(),
        "job": {"kind": "throughput", **THROUGHPUT},
        "record": False,
    }


def throughput_runs(step: Step) -> list[tuple[str, str, str]]:
    """``(label, variant, folder name)`` of each engine of a throughput step;
    a variant's repeats are ``name#2``, ``name#3``... in ``<folder>-2``..."""
    seen: dict[str, int] = {}
    out = []
    for name in step.variants:
        seen[name] = seen.get(name, 0) + 1
        n = seen[name]
        label = name if n == 1 else f"{name}#{n}"
        out.append((label, name, step.folder if n == 1 else f"{step.folder}-{n}"))
    return out


def decode_stats(phase: Mapping[str, Any]) -> dict[str, Any]:
    """Output tokens per second and mean step latency over the decode steps
    (those in which no request produced its first token); the median and
    90th percentile (a burst of slow steps moves the mean, not the median),
    and where the driver recorded them, the process CPU ms per step and the
    CUDA-graph modes the steps ran with."""
    steps = [t for t in phase["timing"] if not t["firsts"] and t["tokens"]]
    seconds = sum(t["s"] for t in steps)
    tokens = sum(t["tokens"] for t in steps)
    ms = sorted(1000.0 * t["s"] for t in steps)
    out: dict[str, Any] = {
        "batch": phase["batch"],
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "step_ms": 1000.0 * seconds / len(steps) if steps else 0.0,
        "steps": len(steps),
        "median_ms": ms[len(ms) // 2] if ms else 0.0,
        "p90_ms": ms[min(len(ms) - 1, (9 * len(ms)) // 10)] if ms else 0.0,
    }
    cpu = [t["cpu_s"] for t in steps if "cpu_s" in t]
    if cpu:
        out["cpu_ms"] = 1000.0 * sum(cpu) / len(cpu)
    modes: dict[str, int] = {}
    for t in steps:
        if "dispatch" in t:
            mode = str(t["dispatch"])
            modes[mode] = modes.get(mode, 0) + 1
    if modes:
        out["dispatch"] = modes
    return out


def run_throughput_step(
    step: Step, variants: Mapping[str, suite.Variant], ctx: suite.Context
) -> dict[str, Any]:
    out: dict[str, Any] = {"variants": {}, "complete": True, "cudagraph_mode": step.cudagraph_mode}
    for label, name, folder in throughput_runs(step):
        if name not in variants:
            continue
        timeout = ctx.timeout(420.0)
        if timeout is None:
            out["complete"] = False
            break
        log(f"throughput: {label} ({step.cudagraph_mode})")
        child = run_child(
            ctx.python,
            _throughput_spec(ctx, step.cudagraph_mode),
            ctx.workdir / "runs" / name / folder,
            "throughput",
            timeout,
            ctx.env(variants[name]),
            reuse=True,
        )
        if not child.ok or child.result is None:
            out["variants"][label] = {"error": child.error}
            continue
        out["variants"][label] = {
            "phases": [decode_stats(p) for p in child.result["phases"]],
            "init_s": child.result.get("init_s"),
            "live": child.result.get("live"),
        }
    return out


def run_doctor_step(
    step: Step, variants: Mapping[str, suite.Variant], ctx: suite.Context
) -> dict[str, Any]:
    out: dict[str, Any] = {"variants": {}, "complete": True}
    for name in step.variants:
        timeout = ctx.timeout(300.0)
        if timeout is None:
            out["complete"] = False
            break
        proc = subprocess.run(
            [ctx.python, "-m", "gdn_backport", "doctor", "--json"],
            env=ctx.env(variants[name]),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        try:
            doc: Any = json.loads(proc.stdout)
        except json.JSONDecodeError:
            doc = {"stdout": proc.stdout[-2000:]}
        out["variants"][name] = {
            "rc": proc.returncode,
            "doctor": doc,
            "stderr": proc.stderr[-2000:],
        }
    return out


RUNNERS = {"suite": run_suite_step, "throughput": run_throughput_step, "doctor": run_doctor_step}


def pending(steps: Sequence[Step], results: Path) -> list[Step]:
    """The steps without a result file, in priority order."""
    return [s for s in steps if not (results / f"{s.name}.json").exists()]


# -- the summary ------------------------------------------------------------


def _load(results: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for step in STEPS:
        path = results / f"{step.name}.json"
        if path.exists():
            out[step.name] = json.loads(path.read_text())
    return out


def _num(v: Any, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _agg(a: Mapping[str, Any] | None, digits: int = 3) -> str:
    """``mean / max (n)`` of an aggregate's JSON, ``-`` when empty."""
    if not a or not a.get("count"):
        return "-"
    return f"{_num(a['mean'], digits)} / {_num(a['max'], 2)} (n={a['count']})"


def pr51565_table(by: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[str]:
    """vLLM #51565 per scenario and variant: how the new one-token rows were
    classified, the stale FULL replays, the new rows' errors and the other
    requests' errors from the first replay they took part in on."""
    names = sorted({s for s, _ in by if s.startswith("pr51565")})
    if not names:
        return []
    rows = [
        [
            "scenario",
            "variant",
            "new rows",
            "stale FULL replays",
            "new-row error",
            "others after replay",
            "clean",
            "result",
        ]
    ]
    for s in names:
        for v in ("unpatched", "half", "full"):
            r = by.get((s, v))
            if r is None:
                continue
            tags = r.get("tags") or {}
            classes = ", ".join(f"{k} {n}" for k, n in sorted((r["new_rows"] or {}).items()))
            steps = r.get("stale_steps")
            replays = f"{r['stale_replays']} builds" + (
                f" in {steps} steps" if steps is not None and r["stale_replays"] else ""
            )
            rows.append(
                [
                    s,
                    v,
                    classes or "-",
                    replays if r["stale_replays"] else "0",
                    _agg(tags.get("new_row")),
                    _agg(tags.get("stale")),
                    _agg(r.get("clean") or tags.get("clean")),
                    r["result"],
                ]
            )
    return [
        "vLLM #51565: half fix (builder only, as in 0.31-0.33) vs full fix (builder + runner); "
        "errors: mean / max |chosen-logprob error| (n tokens)",
        _grid(rows),
        "",
    ]


def throughput_tables(step: Step, data: Mapping[str, Any]) -> list[str]:
    """Tokens/s (ratio to the step's first ``unpatched`` run) and mean step
    ms per batch; then, where the runs recorded them, the step-time median
    and p90, the process CPU ms per step and the steps' CUDA-graph modes."""
    thr: Mapping[str, Any] = data["variants"]
    mode = data.get("cudagraph_mode", step.cudagraph_mode)
    lines = [f"throughput, {step.name} (MTP 2 drafts, {mode}): decode tokens/s and mean step ms"]
    base = {p["batch"]: p for p in thr.get("unpatched", {}).get("phases", [])}

    def phase(d: Mapping[str, Any], batch: int) -> Mapping[str, Any] | None:
        return next((p for p in d.get("phases", []) if p["batch"] == batch), None)

    rows = [["batch", *[f"{v} tok/s (x)" for v in thr], *[f"{v} ms" for v in thr]]]
    for batch in BATCHES:
        rates, ms = [], []
        for d in thr.values():
            p = phase(d, batch)
            if p is None:
                rates.append(str(d.get("error", "-"))[:30])
                ms.append("-")
                continue
            ref = base.get(batch, {}).get("tokens_per_s")
            ratio = f" ({p['tokens_per_s'] / ref:.3f})" if ref else ""
            rates.append(f"{p['tokens_per_s']:.0f}{ratio}")
            ms.append(f"{p['step_ms']:.2f}")
        rows.append([str(batch), *rates, *ms])
    lines.append(_grid(rows))
    if not any("median_ms" in p for d in thr.values() for p in d.get("phases", [])):
        return lines
    lines += [
        "",
        f"step ms, {step.name}: median / p90 [process CPU ms per step] {{CUDA-graph modes}}",
    ]
    rows = [["batch", *thr]]
    for batch in BATCHES:
        cells = []
        for d in thr.values():
            p = phase(d, batch)
            if p is None or "median_ms" not in p:
                cells.append("-")
                continue
            cell = f"{p['median_ms']:.2f} / {p['p90_ms']:.2f}"
            if "cpu_ms" in p:
                cell += f" [{p['cpu_ms']:.2f}]"
            if p.get("dispatch"):
                cell += " {" + ", ".join(f"{k} {n}" for k, n in sorted(p["dispatch"].items())) + "}"
            cells.append(cell)
        rows.append([str(batch), *cells])
    lines.append(_grid(rows))
    return lines


def render(
    done: Mapping[str, Mapping[str, Any]],
    timings: Mapping[str, float] | None = None,
    all_reasons: bool = False,
) -> str:
    """The summary of the step results ``done`` (step name -> its JSON):
    the vLLM #51812 table, the pr51565 table, the reasons (of every result
    that did not pass; of all with ``all_reasons``), throughput, doctor,
    probe counters and the progress table."""
    by: dict[tuple[str, str], Mapping[str, Any]] = {}
    for data in done.values():
        for r in data.get("results", []):
            by[(r["scenario"], r["variant"])] = r
    lines: list[str] = []
    order = ("unpatched", "gather", "kernel", "plugin")
    pr = sorted({s for s, v in by if s.startswith("pr51812")})
    if pr:
        lines.append(
            "vLLM #51812 table: mean / max |chosen-logprob error| from each request's first "
            "misordered step on (n tokens), result; misordered builds per 1000"
        )
        rows = [["scenario", "misord/1k", *order]]
        for s in pr:
            cells = []
            per_1000 = "-"
            for v in order:
                r = by.get((s, v))
                if r is None:
                    cells.append("-")
                    continue
                pm = r["post_mixed"]
                per_1000 = f"{r['misordered_per_1000']:.1f}"
                cells.append(
                    f"{_num(pm['mean'])} / {_num(pm['max'])} (n={pm['count']}) {r['result']}"
                )
            rows.append([s, per_1000, *cells])
        lines += [_grid(rows), ""]
    lines += pr51565_table(by)
    for (s, v), r in sorted(by.items()):
        if all_reasons or r["result"] != "PASS":
            lines.append(f"{s} [{v}]: {r['result']}: {r['reason']}")
    for step in STEPS:
        data = done.get(step.name)
        if step.kind == "throughput" and data and data.get("variants"):
            lines += ["", *throughput_tables(step, data)]
    doc = done.get("s8-doctor", {}).get("variants", {})
    if doc:
        lines += ["", "doctor --json per variant:"]
        for v, d in doc.items():
            report = d.get("doctor")
            verdict = report.get("verdict") if isinstance(report, dict) else None
            lines.append(f"  {v}: rc {d['rc']}: {verdict or d.get('stderr', '')[-200:]}")
    probes = {k: v for data in done.values() for k, v in data.get("probe", {}).items()}
    if probes:
        lines += ["", "probe counters (plugin variant, GDN_BACKPORT_PROBE=1):"]
        lines += [f"  {k}: {v}" for k, v in probes.items()]
    for name, data in done.items():
        if data.get("error"):
            lines.append(f"{name}: error: {data['error']}")
        for variant, why in (data.get("variant_errors") or {}).items():
            lines.append(f"{name}: variant {variant} not run: {why[:300]}")
    rows = [["step", "status", "seconds"]]
    for step in STEPS:
        status = "done" if step.name in done else "pending"
        secs = (timings or {}).get(step.name)
        rows.append([step.name, status, f"{secs:.0f}" if secs is not None else "-"])
    lines += ["", "progress:", _grid(rows)]
    return "\n".join(lines)


def summary(results: Path, timings: Mapping[str, float] | None = None) -> str:
    return render(_load(results), timings)


def package(results: Path, out: Path, text: str) -> list[Path]:
    """``out/engine-summary.txt`` and ``out/engine-results.tar.gz`` (logs
    left out when the archive would pass the size limit)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine-summary.txt").write_text(text + "\n")
    archive = out / "engine-results.tar.gz"

    def make(skip_logs: bool) -> None:
        with tarfile.open(archive, "w:gz") as tar:
            for path in sorted(results.rglob("*")):
                if path.is_file() and not (
                    skip_logs and path.name.endswith((".stdout.txt", ".stderr.txt"))
                ):
                    tar.add(path, arcname=str(Path("engine-results") / path.relative_to(results)))

    make(skip_logs=False)
    if archive.stat().st_size > OUT_LIMIT:
        make(skip_logs=True)
    return [out / "engine-summary.txt", archive]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"), help="the folder holding vllm/")
    ap.add_argument("--results", type=Path, default=Path("/tmp/engine-results"))
    ap.add_argument("--variants", type=Path, default=Path("/tmp/variants"))
    ap.add_argument(
        "--deadline", type=float, default=540.0, help="seconds from now; nothing starts after"
    )
    ap.add_argument(
        "--out", default=os.environ.get("OUT", ""), help="copy the summary and a tar.gz here"
    )
    ap.add_argument("--only", action="append", metavar="STEP", help="only these steps")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    started = time.monotonic()
    results: Path = args.results
    results.mkdir(parents=True, exist_ok=True)
    ctx = suite.Context(
        results / "work", args.python, reuse=True, deadline=started + args.deadline, log=log
    )
    timings_path = results / "timings.json"
    timings: dict[str, float] = (
        json.loads(timings_path.read_text()) if timings_path.exists() else {}
    )
    selected = [s for s in STEPS if not args.only or s.name in args.only]
    steps = pending(selected, results)
    variants: dict[str, suite.Variant] = {}
    failed: dict[str, str] = {}
    for step in steps:
        if ctx.timeout(60.0) is None:
            log(f"deadline: {step.name} and later steps wait for the next call")
            break
        log(f"step {step.name}: {', '.join(step.variants)}")
        step_start = time.monotonic()
        problems: dict[str, str] = {}
        for name in ("unpatched", *step.variants):
            if name not in variants and name not in failed:
                try:
                    variants[name] = prepare_variant(name, args.site, args.variants, args.python)
                except Exception as exc:  # a variant that cannot be made costs only itself
                    failed[name] = f"{type(exc).__name__}: {exc}"
            if name in failed:
                problems[name] = failed[name]
                log(f"variant {name}: {failed[name]}")
        runnable = tuple(v for v in step.variants if v in variants)
        try:
            data = RUNNERS[step.kind](dataclasses.replace(step, variants=runnable), variants, ctx)
        except Exception as exc:  # one step's failure must not cost the others
            log(f"step {step.name}: {type(exc).__name__}: {exc}")
            data = {"error": f"{type(exc).__name__}: {exc}", "complete": True}
        data["variant_errors"] = problems
        timings[step.name] = timings.get(step.name, 0.0) + time.monotonic() - step_start
        timings_path.write_text(json.dumps(timings))
        if data.get("complete"):
            (results / f"{step.name}.json").write_text(
                json.dumps({"step": step.name, **data}, indent=1)
            )
            log(f"step {step.name}: done ({timings[step.name]:.0f} s)")
        else:
            log(f"step {step.name}: partial, continues in the next call")
            break
    text = summary(results, timings)
    if args.out:
        package(results, Path(args.out), text)
    print(text)
    return 0 if not pending(selected, results) else 3


if __name__ == "__main__":
    sys.exit(main())
