"""Rescore a results folder of ``bench/bench_engine.py`` offline: no GPU, no vLLM.

Reloads every stored engine run (``work/runs/<variant>/<scenario>/run.result.json``
and the ``run.spec.json`` it ran from), the cached teacher-forced reference
scores and alone runs (``work/cache``) and the throughput runs, and applies
the *current* pass rules to them; prints the same tables as the GPU run
(``bench_engine.render``), every verdict's reason, and which verdicts differ
from those the step files recorded. A scenario whose declared workload
changed since is scored on the workload that actually ran (from its spec),
and says so.

    python bench/engine_rescore.py bench/results/h200_engine_s7/engine-results.tar.gz
    python bench/engine_rescore.py /tmp/eres/engine-results --out rescored.txt

``RESULTS`` is the unpacked folder (``s1-*.json``, ``work/``), a folder that
holds it as ``engine-results/``, or the ``.tar.gz`` itself (unpacked to a
temporary folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import bench_engine
except ImportError:  # imported from outside bench/ (tests)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_engine

from gdn_backport.engine_suite import suite
from gdn_backport.engine_suite.scenarios import collect

__all__ = ["find_root", "main", "rescore"]


def find_root(path: Path, scratch: Path) -> Path:
    """The folder holding the step files and ``work/``."""
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path) as tar:
            tar.extractall(scratch, filter="data")
        path = scratch
    for candidate in (path, path / "engine-results"):
        if (candidate / "work").is_dir():
            return candidate
    raise FileNotFoundError(f"{path}: no work/ folder of a bench_engine.py run in it")


def _stored_steps(root: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for step in bench_engine.STEPS:
        path = root / f"{step.name}.json"
        if path.exists():
            out[step.name] = json.loads(path.read_text(encoding="utf-8"))
    return out


def _suite_step(step: Any, ctx: suite.Context, notes: list[str]) -> dict[str, Any] | None:
    scenarios = collect(names=list(step.scenarios))
    results, probe = [], {}
    for variant in step.variants:
        for scenario in scenarios:
            sr = suite.stored_run(scenario, suite.Variant(variant), ctx)
            if sr is None:
                continue
            if sr.scenario.workload != scenario.workload:
                notes.append(
                    f"{scenario.name} [{variant}]: rescored on the workload that ran "
                    f"({sr.scenario.workload.name}, {len(sr.scenario.workload.requests)} "
                    "requests); the scenario now declares another, not run yet"
                )
            result = suite.evaluate(sr, ctx)
            data = result.to_json()
            # Logs name paths on the GPU machine; nothing here reads them.
            data.pop("logs", None)
            results.append(data)
            assert sr.run is not None and sr.run.result is not None
            if sr.run.result.get("probe"):
                probe[f"{variant}/{scenario.name}"] = sr.run.result["probe"]
    if not results:
        return None
    return {"step": step.name, "results": results, "probe": probe, "complete": True}


def _throughput_step(step: Any, root: Path) -> dict[str, Any] | None:
    variants: dict[str, Any] = {}
    for label, name, folder in bench_engine.throughput_runs(step):
        path = root / "work" / "runs" / name / folder / "throughput.result.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        if not data.get("ok"):
            variants[label] = {"error": data.get("error")}
            continue
        variants[label] = {
            "phases": [bench_engine.decode_stats(p) for p in data["phases"]],
            "init_s": data.get("init_s"),
        }
    if not variants:
        return None
    return {
        "step": step.name,
        "variants": variants,
        "cudagraph_mode": step.cudagraph_mode,
        "complete": True,
    }


def rescore(root: Path) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The step results recomputed from the raw data under ``root`` with
    the current rules, and notes on what could not be taken as it ran."""
    ctx = suite.Context(root / "work")
    stored = _stored_steps(root)
    done: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    for step in bench_engine.STEPS:
        data: dict[str, Any] | None = None
        if step.kind == "suite":
            data = _suite_step(step, ctx, notes)
        elif step.kind == "throughput":
            data = _throughput_step(step, root)
        elif step.name in stored:
            # doctor verdicts are the doctor's own output: nothing to rescore.
            data = stored[step.name]
        if data is not None:
            done[step.name] = data
    return done, notes


def changes(
    stored: Mapping[str, Mapping[str, Any]], done: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """One line per result whose verdict differs from the stored step files."""

    def verdicts(steps: Mapping[str, Mapping[str, Any]]) -> dict[tuple[str, str], str]:
        return {
            (r["scenario"], r["variant"]): r["result"]
            for data in steps.values()
            for r in data.get("results", [])
        }

    before, after = verdicts(stored), verdicts(done)
    out = []
    for k in sorted(set(before) | set(after)):
        old, new = before.get(k, "-"), after.get(k, "-")
        if old != new:
            out.append(f"  {k[0]} [{k[1]}]: {old} -> {new}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("results", type=Path, help="results folder or engine-results.tar.gz")
    ap.add_argument("--out", type=Path, help="also write the text here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gdn-rescore-") as scratch:
        try:
            root = find_root(args.results, Path(scratch))
        except (OSError, tarfile.TarError) as exc:
            print(f"engine_rescore: {exc}", file=sys.stderr)
            return 2
        done, notes = rescore(root)
        stored = _stored_steps(root)
        timings_path = root / "timings.json"
        timings = json.loads(timings_path.read_text()) if timings_path.exists() else None
    lines = [
        "Rescored offline with the current rules (bench/engine_rescore.py): the stored runs, "
        "the cached reference scores and alone runs, the throughput runs.",
        "",
        bench_engine.render(done, timings, all_reasons=True),
        "",
        "verdicts that differ from the stored step files:",
        *(changes(stored, done) or ["  none"]),
    ]
    if notes:
        lines += ["", "notes:", *(f"  {n}" for n in notes)]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
