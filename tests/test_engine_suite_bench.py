"""bench/bench_engine.py's CPU-checkable parts: variants by hard-link copy
(the original untouched), the half variant, step resumption, the summary and
what goes to $OUT."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from gdn_backport.engine_suite import process, suite
from tests.conftest import AFFECTED

ROOT = Path(__file__).resolve().parent.parent


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_engine", ROOT / "bench" / "bench_engine.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_engine"] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()
LAYER = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"


def small_site(tmp_path: Path, runner: str = "# the runner\n") -> Path:
    site = tmp_path / "site"
    for rel, text in {
        "vllm/__init__.py": "# a small vLLM\n",
        LAYER: AFFECTED,
        "vllm/other.py": "x = 1\n",
        bench.RUNNER_FILES[0]: runner,
    }.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return site


def test_apply_on_a_hard_link_copy_leaves_the_original_untouched(tmp_path: Path) -> None:
    site = small_site(tmp_path)
    original = site / LAYER
    inode = original.stat().st_ino
    variant = bench.prepare_variant("gather", site, tmp_path / "variants")
    copy = tmp_path / "variants" / "gather"
    assert variant.env["PYTHONPATH"].split(":")[0] == str(copy)
    assert variant.env["VLLM_PLUGINS"] == ""
    assert original.read_text() == AFFECTED and original.stat().st_ino == inode
    assert (copy / LAYER).read_text() != AFFECTED and (copy / LAYER).stat().st_ino != inode
    # Files apply did not touch are still the same inode (linked, not copied).
    assert (copy / "vllm/other.py").stat().st_ino == (site / "vllm/other.py").stat().st_ino
    # Made once: a second call finds it ready.
    marker = copy / ".gdn-backport-variant.json"
    stamp = marker.stat().st_mtime_ns
    bench.prepare_variant("gather", site, tmp_path / "variants")
    assert marker.stat().st_mtime_ns == stamp


def test_half_copies_the_original_runners_back(tmp_path: Path) -> None:
    site = small_site(tmp_path)
    seen: list[tuple[str, ...]] = []

    def apply(python: str, args: tuple[str, ...], dest: Path, root: Path) -> list[str]:
        # What apply does to a file: a new one renamed over the old one.
        seen.append(tuple(args))
        for rel in (LAYER, bench.RUNNER_FILES[0]):
            tmp = dest / (rel + ".tmp")
            tmp.write_text("# patched\n")
            tmp.replace(dest / rel)
        return ["patched 2 file(s)"]

    bench.prepare_variant("half", site, tmp_path / "variants", apply=apply)
    copy = tmp_path / "variants" / "half"
    assert seen == [("--patchset", "pr51565")]
    assert (copy / bench.RUNNER_FILES[0]).read_text() == "# the runner\n"
    assert (copy / LAYER).read_text() == "# patched\n"
    assert (site / LAYER).read_text() == AFFECTED


def test_plugin_and_unpatched_need_no_copy(tmp_path: Path) -> None:
    plugin = bench.prepare_variant("plugin", tmp_path / "site", tmp_path / "v")
    assert plugin.env["VLLM_PLUGINS"] == "gdn_backport" and plugin.env["GDN_BACKPORT_PROBE"] == "1"
    assert (
        bench.prepare_variant("unpatched", tmp_path / "site", tmp_path / "v").env["VLLM_PLUGINS"]
        == ""
    )
    assert not (tmp_path / "v").exists()


def test_steps_resume_in_priority_order(tmp_path: Path) -> None:
    names = [s.name for s in bench.STEPS]
    assert names[:2] == ["s1-pr51812", "s2-pr51565-graphs"] and names[-5:] == [
        "s7-throughput",
        "s8-doctor",
        "s9-kernel-cost",
        "s10-kernel-cost-piecewise",
        "s11-kernel-cost-rounds",
    ]
    assert bench.STEPS[0].variants == ("unpatched", "gather")
    (tmp_path / "s1-pr51812.json").write_text("{}")
    assert [s.name for s in bench.pending(bench.STEPS, tmp_path)] == names[1:]
    # --only (ENGINE_STEPS): a call runs the selected steps and is done with them.
    (tmp_path / "s8-doctor.json").write_text("{}")
    args = ["--results", str(tmp_path), "--only", "s8-doctor", "--deadline", "0"]
    assert bench.main(args) == 0


def _result(scenario: str, variant: str, result: str, mean: float) -> dict[str, object]:
    agg = {"count": 40, "mean": mean, "max": mean * 3, "p99": mean * 2}
    return {
        "scenario": scenario,
        "variant": variant,
        "result": result,
        "reason": "because",
        "misordered_per_1000": 31.2,
        "post_mixed": agg,
        "tagged": agg,
        "new_rows": {"decode": 4},
        "stale_replays": 0,
    }


def test_summary_and_what_goes_to_out(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "work" / "runs").mkdir(parents=True)
    (results / "work" / "runs" / "x.stderr.txt").write_text("log\n")
    (results / "s1-pr51812.json").write_text(
        json.dumps(
            {
                "results": [
                    _result("pr51812-recipe", "unpatched", "FAIL", 0.012),
                    _result("pr51812-recipe", "gather", "PASS", 0.0002),
                ]
            }
        )
    )
    (results / "s2-pr51565-graphs.json").write_text(
        json.dumps(
            {
                "results": [
                    _result("pr51565-full-graphs", "half", "FAIL", 0.3),
                    _result("pr51565-full-graphs", "full", "PASS", 0.0002),
                ]
            }
        )
    )
    (results / "s7-throughput.json").write_text(
        json.dumps(
            {
                "variants": {
                    "unpatched": {
                        "phases": [{"batch": 8, "tokens_per_s": 800.0, "step_ms": 10.0, "steps": 9}]
                    },
                    "gather": {
                        "phases": [{"batch": 8, "tokens_per_s": 792.0, "step_ms": 10.1, "steps": 9}]
                    },
                }
            }
        )
    )
    text = bench.summary(results, {"s1-pr51812": 300.0})
    assert "0.0120 / 0.0360 (n=40) FAIL" in text and "0.0002 / 0.0006 (n=40) PASS" in text
    assert re.search(r"pr51565-full-graphs +half +decode 4 +0 +- +- +.* FAIL", text)
    assert "792 (0.990)" in text
    assert re.search(r"s1-pr51812 +done +300", text) and re.search(r"s8-doctor +pending", text)
    files = bench.package(results, tmp_path / "out", text)
    out = sorted(p for p in (tmp_path / "out").rglob("*"))
    assert out == sorted(files) and len(out) <= 8
    assert all(p.stat().st_size <= 16 * 1024 * 1024 for p in out)
    assert all(len(p.relative_to(tmp_path / "out").parts) <= 2 for p in out)
    with tarfile.open(files[1]) as tar:
        assert "engine-results/s1-pr51812.json" in tar.getnames()


def test_decode_stats_leave_out_prefill_steps() -> None:
    phase = {
        "batch": 2,
        "timing": [
            {"step": 0, "s": 1.0, "tokens": 2, "firsts": 2},
            {"step": 1, "s": 0.01, "tokens": 2, "firsts": 0},
            {"step": 2, "s": 0.03, "tokens": 2, "firsts": 0},
        ],
    }
    stats = bench.decode_stats(phase)
    assert stats["tokens_per_s"] == pytest.approx(100.0) and stats["step_ms"] == pytest.approx(20.0)


def _no_apply(python: str, args: tuple[str, ...], dest: Path, root: Path) -> list[str]:
    return []


def test_kernel_off_is_the_kernel_copy_with_the_guard_switched_off(tmp_path: Path) -> None:
    site = small_site(tmp_path)
    kernel = bench.prepare_variant("kernel", site, tmp_path / "variants", apply=_no_apply)
    off = bench.prepare_variant("kernel-off", site, tmp_path / "variants", apply=_no_apply)
    assert off.name == "kernel-off" and off.env["GDN_BACKPORT_KERNEL"] == "off"
    assert off.env["PYTHONPATH"] == kernel.env["PYTHONPATH"]
    assert sorted(p.name for p in (tmp_path / "variants").iterdir()) == ["kernel"]


def test_kernel_cost_steps_alternate_variants_in_their_own_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (s9,) = [s for s in bench.STEPS if s.name == "s9-kernel-cost"]
    (s10,) = [s for s in bench.STEPS if s.name == "s10-kernel-cost-piecewise"]
    runs = bench.throughput_runs(s9)
    assert [r[0] for r in runs] == [
        "kernel", "gather", "kernel-off", "unpatched",
        "kernel#2", "gather#2", "kernel-off#2", "unpatched#2",
    ]  # fmt: skip
    assert runs[0][2] == "kernel-cost" and runs[4] == ("kernel#2", "kernel", "kernel-cost-2")
    seen: list[tuple[str, str, str | None]] = []

    def fake_child(python, spec, folder, name, timeout, env, reuse=False):  # type: ignore[no-untyped-def]
        seen.append((folder.name, spec["engine"]["cudagraph_mode"], env.get("GDN_BACKPORT_KERNEL")))

        def t(step: int, s: float, firsts: int, mode: str) -> dict[str, object]:
            return {"step": step, "s": s, "cpu_s": 0.004, "tokens": 2, "firsts": firsts,
                    "dispatch": mode}  # fmt: skip

        timing = [t(0, 0.5, 2, "PIECEWISE"), t(1, 0.006, 0, "FULL"), t(2, 0.009, 0, "PIECEWISE")]
        result = {"ok": True, "phases": [{"batch": 1, "timing": timing}]}
        return process.ChildResult(name, 0, result, None, 0.0, folder, folder)

    monkeypatch.setattr(bench, "run_child", fake_child)
    ctx = suite.Context(tmp_path / "work")
    site = small_site(tmp_path)
    variants = {
        n: bench.prepare_variant(n, site, tmp_path / "v", apply=_no_apply)
        for n in ("kernel", "gather", "kernel-off", "unpatched")
    }
    data = bench.run_throughput_step(s10, variants, ctx)
    assert [s[0] for s in seen] == ["kernel-cost-piecewise"] * 4
    assert {s[1] for s in seen} == {"PIECEWISE"} and seen[2][2] == "off"
    phase = data["variants"]["kernel-off"]["phases"][0]
    assert phase["dispatch"] == {"FULL": 1, "PIECEWISE": 1} and phase["cpu_ms"] == pytest.approx(
        4.0
    )
    assert phase["median_ms"] == pytest.approx(9.0) and phase["step_ms"] == pytest.approx(7.5)
    text = bench.render({s10.name: data})
    assert "throughput, s10-kernel-cost-piecewise (MTP 2 drafts, PIECEWISE)" in text
    assert "9.00 / 9.00 [4.00] {FULL 1, PIECEWISE 1}" in text
