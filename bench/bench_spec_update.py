"""The GDN speculative-verify update: vLLM's fixed path against our op, one process.

vLLM's way (the PR #51812 fix) is two ``index_select`` gathers of the gates
plus vLLM's own ``fused_sigmoid_gating_delta_rule_update``, loaded from an
extracted release (``--vllm-tree``, e.g. the tree ``gdn-backport fetch``
unpacks) with stand-ins for the one vLLM module it imports. Ours is
``gated_delta_rule_spec_update`` taking the ungathered gates and the token
index (eager: its direct launch; under graph capture: the ``torch.library``
op); "guarded" is the call site ``apply --strategy kernel`` writes (the
``use_spec_update`` guard, then ours); "op" calls the registered op through
the dispatcher; "baseline" is an
earlier kernel package's launcher (``--baseline-kernels``), to compare
against in the same process.

For each case: the kernels' time as CUDA-graph replays (median of
``triton.testing.do_bench``, which flushes L2 before each replay); the
roofline time, i.e. the minimal bytes the update must move over the bandwidth
of a large device-to-device copy measured here; the fraction of it reached;
our speedup. For N <= ``--host-max-n``, each path's host time per eager call:
``time.perf_counter_ns`` around single calls (the device drained before each,
so a full launch queue never blocks the host), ``--host-calls`` calls after a
warm-up, median and inter-quartile range. Before timing, every path runs from
the same state and must agree with the first.

    python bench/bench_spec_update.py --vllm-tree /path/vllm-0.27.1 [--json out.json]
    python bench/bench_spec_update.py --smoke [--vllm-tree ...]   # CPU, interpreter

``--smoke`` runs tiny cases on CPU under the Triton interpreter to prove the
script works; its times are not measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

# Before any @triton.jit module is imported: the interpreter switch is read then.
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Run from a checkout without installing: the kernel package stands alone.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

import triton
import triton.language as tl

from gdn_backport_kernels import (
    gated_delta_rule_spec_update,
    gated_delta_rule_spec_update_v1,
    gather_token_rows,
    use_spec_update,
)
from gdn_backport_kernels.spec_update import (
    gated_delta_rule_spec_update_fwd,
)

Fn = Callable[[], Any]


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    """Just enough of ``vllm`` for its fused_sigmoid_gating module to import.

    It imports ``from vllm.triton_utils import tl, triton`` and nothing else in
    the affected releases; a real installed vllm is shadowed only meanwhile.
    """
    names = ("vllm", "vllm.triton_utils")
    saved = {n: sys.modules.get(n) for n in names}
    pkg = types.ModuleType("vllm")
    pkg.__path__ = []
    utils = types.ModuleType("vllm.triton_utils")
    utils.tl = tl  # type: ignore[attr-defined]
    utils.triton = triton  # type: ignore[attr-defined]
    sys.modules.update({"vllm": pkg, "vllm.triton_utils": utils})
    try:
        yield
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod


def load_vllm_kernel(tree: Path) -> tuple[Fn, int, Path]:
    """vLLM's ``fused_sigmoid_gating_delta_rule_update`` and its null slot id."""
    found = sorted(tree.rglob("ops/fused_sigmoid_gating.py"))
    found = [p for p in found if "tests" not in p.relative_to(tree).parts]
    if not found:
        raise SystemExit(f"--vllm-tree {tree}: no */ops/fused_sigmoid_gating.py")
    path = found[0]
    src = path.read_text()
    # 0.20.0 on skip slot ids <= 0 (NULL_BLOCK_ID); 0.18-0.19 skip ids < 0.
    null_slot_id = 0 if "state_idx <= 0" in src else -1
    spec = importlib.util.spec_from_file_location("_bench_vllm_fsg", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _stand_ins():
        try:
            spec.loader.exec_module(module)
        except ImportError as e:
            raise SystemExit(f"{path}: needs a stand-in for {e.name}: {e}") from e
    return module.fused_sigmoid_gating_delta_rule_update, null_slot_id, path


def load_baseline(path: Path) -> Fn:
    """``gated_delta_rule_spec_update_fwd`` of another kernel package's
    ``spec_update.py`` (a folder holding it, or the file), loaded on its own:
    it registers no op, so it sits beside ours in one process."""
    file = path / "spec_update.py" if path.is_dir() else path
    found = sorted(file.parent.rglob("spec_update.py")) if not file.is_file() else [file]
    if not found:
        raise SystemExit(f"--baseline-kernels {path}: no spec_update.py")
    spec = importlib.util.spec_from_file_location("_bench_baseline_spec_update", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print(f"baseline launcher: {found[0]}", file=sys.stderr)
    return module.gated_delta_rule_spec_update_fwd  # type: ignore[no-any-return]


@dataclass
class Case:
    N: int
    num_spec: int
    HV: int
    H: int = 16
    K: int = 128
    V: int = 128
    n_nonspec: int = 16  # non-spec rows placed before the spec rows
    state_dtype: str = "fp32"  # the state pool: "fp32" or "bf16"

    @property
    def tokens(self) -> int:
        return self.N * (1 + self.num_spec)

    def bytes_moved(self) -> int:
        """Minimal HBM traffic: initial states, every token's state, q/k/v/out,
        gates, indices (bf16 activations and gates, fp32 or bf16 state)."""
        T, N, H, HV, K, V = self.tokens, self.N, self.H, self.HV, self.K, self.V
        state = (N + T) * HV * V * K * (4 if self.state_dtype == "fp32" else 2)
        act = T * (2 * H * K + 2 * HV * V) * 2
        gates = 2 * T * HV * 2 + T * 8 + N * (1 + self.num_spec) * 4 + 2 * N * 4
        return state + act + gates


def make_inputs(case: Case, device: str, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, N, S = case.tokens, case.N, case.num_spec
    H, HV, K, V = case.H, case.HV, case.K, case.V
    bf16 = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    # Like vLLM 0.22+: b, a = ba.chunk(2, -1) over all rows (non-contiguous),
    # q/k/v contiguous views of one buffer (rearrange_mixed_qkv).
    T_all = case.n_nonspec + T
    b, a = randn(T_all, 2 * HV).to(bf16).chunk(2, dim=-1)
    qkv = randn(T * (2 * H * K + HV * V)).to(bf16)
    q = qkv[: T * H * K].view(1, T, H, K)
    k = qkv[T * H * K : 2 * T * H * K].view(1, T, H, K)
    v = qkv[2 * T * H * K :].view(1, T, HV, V)
    num_slots = 1 + N * (S + 1)  # slot 0 is vLLM's null block
    state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.state_dtype]
    state = torch.empty(num_slots, HV, V, K, device=device, dtype=state_dtype)
    torch.manual_seed(seed)  # the pool is drawn on the device: 8 GiB at N=256
    state.normal_().mul_(0.1)
    acc = torch.randint(1, S + 2, (N,), generator=g, dtype=torch.int32)
    return dict(
        A_log=randn(HV) * 0.5,
        a=a,
        b=b,
        dt_bias=randn(HV) * 0.5,
        q=q,
        k=k,
        v=v,
        initial_state=state,
        cu_seqlens=torch.arange(0, T + 1, S + 1, dtype=torch.int32, device=device),
        ssm_state_indices=torch.arange(1, num_slots, dtype=torch.int32, device=device).view(
            N, S + 1
        ),
        num_accepted_tokens=acc.to(device),
        spec_token_indx=torch.arange(case.n_nonspec, T_all, device=device),
    )


def paths(
    x: dict[str, Any],
    vllm_fn: Fn | None,
    null_slot_id: int,
    launcher_kw: dict[str, Any] | None = None,
    baseline_fn: Fn | None = None,
) -> dict[str, Fn]:
    """The paths to time, by name: vllm (if loaded), ours, op, baseline (if
    loaded), launcher (only with ``launcher_kw``: the launcher with overrides)."""
    common = {k: x[k] for k in ("A_log", "dt_bias", "q", "k", "v", "initial_state")}
    meta = {k: x[k] for k in ("cu_seqlens", "ssm_state_indices", "num_accepted_tokens")}
    flat = (x["A_log"], x["a"], x["b"], x["dt_bias"], x["q"][0], x["k"][0], x["v"][0],
            x["initial_state"], x["cu_seqlens"], x["ssm_state_indices"],
            x["num_accepted_tokens"], x["spec_token_indx"])  # fmt: skip

    def ours() -> Any:
        return gated_delta_rule_spec_update(
            a=x["a"],
            b=x["b"],
            **common,
            **meta,
            inplace_final_state=True,
            use_qk_l2norm_in_kernel=True,
            spec_token_indx=x["spec_token_indx"],
            null_slot_id=null_slot_id,
        )

    def guarded() -> Any:
        # What `apply --strategy kernel` writes: the guard and the op each
        # take the call's arguments; the fallback (never taken here: the op
        # serves every case) is vLLM's kernel on gathered gates, or ours.
        rows = x["spec_token_indx"]
        return (
            gated_delta_rule_spec_update(a=x["a"], b=x["b"], **common, **meta,
                                         inplace_final_state=True, use_qk_l2norm_in_kernel=True,
                                         spec_token_indx=rows, null_slot_id=null_slot_id)
            if use_spec_update(a=x["a"], b=x["b"], **common, **meta, inplace_final_state=True,
                               use_qk_l2norm_in_kernel=True, spec_token_indx=rows,
                               null_slot_id=null_slot_id)
            else (vllm_fn or gated_delta_rule_spec_update)(
                a=gather_token_rows(x["a"], rows), b=gather_token_rows(x["b"], rows), **common,
                **meta, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
                **({} if vllm_fn else {"spec_token_indx": None, "null_slot_id": null_slot_id}),
            )
        )  # fmt: skip

    def op() -> Any:
        # What a call through the dispatcher costs: the wrapper's slow path.
        q, k, v = x["q"][0], x["k"][0], x["v"][0]
        args = (*flat[:4], q, k, v, *flat[7:])
        return gated_delta_rule_spec_update_v1(*args, null_slot_id, None, 1.0, 20.0, True)

    out: dict[str, Fn] = {}
    if vllm_fn is not None:
        fused = vllm_fn

        def vllm() -> Any:
            # The upstream fix: gather the gate rows, then vLLM's kernel.
            a_spec = x["a"].index_select(0, x["spec_token_indx"])
            b_spec = x["b"].index_select(0, x["spec_token_indx"])
            return fused(
                a=a_spec,
                b=b_spec,
                **common,
                **meta,
                inplace_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )

        out["vllm"] = vllm
    out["ours"] = ours
    out["guarded"] = guarded
    out["op"] = op
    if baseline_fn is not None:
        base = baseline_fn

        def baseline() -> Any:
            return base(*flat, null_slot_id=null_slot_id)

        out["baseline"] = baseline
    if launcher_kw is not None:
        kw = launcher_kw

        def launcher() -> Any:
            return gated_delta_rule_spec_update_fwd(*flat, null_slot_id=null_slot_id, **kw)

        out["launcher"] = launcher
    return out


def cross_check(x: dict[str, Any], fns: dict[str, Fn]) -> None:
    """Every path from the same state: same outputs, same written slots."""
    state = x["initial_state"]
    start = state.clone()
    results = {}
    for name, fn in fns.items():
        state.copy_(start)
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        results[name] = (out.reshape(-1).float().clone(), state.clone())
    state.copy_(start)
    ref_name, (ref_out, ref_state) = next(iter(results.items()))
    # A bf16 pool rounds each stored state: one bf16 step apart is agreement.
    tol = 1e-3 if state.dtype == torch.float32 else 2e-2
    for name, (o, s) in results.items():
        torch.testing.assert_close(o, ref_out, atol=2e-2, rtol=2e-2, msg=name)
        torch.testing.assert_close(s, ref_state, atol=tol, rtol=tol, msg=name)
    del start, results
    print(f"  paths agree with {ref_name}: {', '.join(fns)}", file=sys.stderr)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n / (ms * 1e-3)


def time_host(fn: Fn, calls: int, warmup: int = 50, drain_every: int = 16) -> tuple[float, float]:
    """Host time of one eager call, us: (median, inter-quartile range).

    Each call is timed on its own; every ``drain_every`` calls the device is
    drained (outside the timed region), so the launch queue never fills and
    blocks the host: this is the time a call keeps the host while the GPU
    keeps up, as in a decode step. (On the H200, draining before every call
    gave the same medians: bench/results/h200_host_drain1_s4.txt.)
    """
    times = []
    for i in range(warmup + calls):
        if i % drain_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        if i >= warmup:
            times.append(t1 - t0)
    torch.cuda.synchronize()
    q1, med, q3 = statistics.quantiles(times, n=4)
    return med / 1e3, (q3 - q1) / 1e3


def time_graph(fn: Fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    us = float(triton.testing.do_bench(graph.replay, return_mode="median")) * 1e3
    del graph
    return us


@triton.jit
def _empty_kernel(x):  # type: ignore[no-untyped-def]
    pass


@triton.jit
def _floor_kernel(h, rows, out, C: tl.constexpr, BV: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
    """The bytes-only floor of this update's program shape (after
    /work/shared/tools/gpu_floor.py): a [BV, K] state tile read once and
    written once per token, a token row read per token; no index loads, no
    reductions on a chain."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    o_v = i_v * BV + tl.arange(0, BV)
    o_k = tl.arange(0, K)
    base = i_nh.to(tl.int64) * (C + 1) * V * K
    b_h = tl.load(h + base + o_v[:, None] * K + o_k[None, :]).to(tl.float32)
    for t in tl.static_range(C):
        r = tl.load(rows + (i_nh.to(tl.int64) * C + t) * K + o_k).to(tl.float32)
        b_h = b_h + r[None, :]
        p = h + base + (t + 1) * V * K + o_v[:, None] * K + o_k[None, :]
        tl.store(p, b_h.to(h.dtype.element_ty))
    tl.store(out + i_nh * V + o_v, tl.sum(b_h, 1))


def floor_us(case: Case, device: str) -> float:
    """Graph-replay time of the floor kernel at this case's size (BV=4, one
    warp, the shape the launcher uses up to 512 request x head pairs)."""
    C, n = case.num_spec + 1, case.N * case.HV
    dt = torch.float32 if case.state_dtype == "fp32" else torch.bfloat16
    h = torch.zeros(n * (C + 1), case.V, case.K, device=device, dtype=dt)
    rows = torch.zeros(n * C, case.K, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, case.V, device=device)
    kernel: Any = _floor_kernel
    return time_graph(
        lambda: kernel[(case.V // 4, n)](h, rows, out, C=C, BV=4, K=case.K, V=case.V, num_warps=1)
    )


def empty_kernel_us(device: str) -> float:
    """Graph-replay time of an empty kernel, measured like every case: what
    a launch costs in this method before any work."""
    z = torch.zeros(1, device=device)
    kernel: Any = _empty_kernel
    return time_graph(lambda: kernel[(1,)](z))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: only --smoke runs on CPU")
    vllm_fn, null_slot_id = None, 0
    if args.vllm_tree:
        vllm_fn, null_slot_id, path = load_vllm_kernel(Path(args.vllm_tree))
        print(f"vLLM kernel: {path} (null_slot_id={null_slot_id})", file=sys.stderr)
    baseline_fn = load_baseline(Path(args.baseline_kernels)) if args.baseline_kernels else None

    if args.smoke:
        cases = [
            Case(N=2, num_spec=1, HV=4, H=2, K=32, V=32, n_nonspec=3),
            Case(N=3, num_spec=3, HV=6, H=2, K=64, V=48, n_nonspec=5, state_dtype="bf16"),
        ]
        bw = float("nan")
    else:
        cases = [
            Case(N=n, num_spec=s, HV=hv, state_dtype=sd)
            for sd in args.state
            for hv in args.hv
            for n in args.n
            for s in args.spec
        ]
        bw = copy_bandwidth(device)
        print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", file=sys.stderr)
        print(f"empty kernel, graph replay: {empty_kernel_us(device):.2f} us", flush=True)

    rows = []
    for case in cases:
        print(f"case {asdict(case)}", file=sys.stderr)
        x = make_inputs(case, device)
        fns = paths(x, vllm_fn, null_slot_id, baseline_fn=baseline_fn)
        cross_check(x, fns)
        row: dict[str, Any] = {**asdict(case), "tokens_per_req": 1 + case.num_spec}
        row["bytes"] = case.bytes_moved()
        row["roofline_us"] = row["bytes"] / bw * 1e6
        for name, fn in fns.items():
            if args.smoke:
                t0 = time.perf_counter()
                fn()
                row[f"{name}_us"] = (time.perf_counter() - t0) * 1e6
                continue
            if name not in ("op", "guarded"):
                row[f"{name}_graph_us"] = time_graph(fn)
            if args.host_max_n >= case.N and name in ("vllm", "ours", "guarded", "op"):
                row[f"{name}_host_us"], row[f"{name}_host_iqr_us"] = time_host(
                    fn, args.host_calls, drain_every=args.host_drain_every
                )
        if not args.smoke and args.floor_max_n >= case.N:
            row["floor_graph_us"] = floor_us(case, device)
        rows.append(row)
        print(f"  {row}", file=sys.stderr, flush=True)
        del x, fns
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    """One line per case: graph replays (us, roofline fraction, speedup over
    vLLM's path, ratio to the baseline) and eager host time (median, IQR)."""
    for r in rows:
        r["MB"] = r["bytes"] / 1e6
        for name in ("vllm", "ours", "baseline", "floor"):
            if f"{name}_graph_us" in r:
                r[f"{name}_roof"] = r["roofline_us"] / r[f"{name}_graph_us"]
        if "vllm_graph_us" in r and "ours_graph_us" in r:
            r["speedup"] = r["vllm_graph_us"] / r["ours_graph_us"]
        if "baseline_graph_us" in r and "ours_graph_us" in r:
            r["vs_baseline"] = r["baseline_graph_us"] / r["ours_graph_us"]
        for name in ("vllm", "ours", "guarded", "op"):
            if f"{name}_host_us" in r:
                r[f"{name}_host"] = f"{r[f'{name}_host_us']:.1f} ({r[f'{name}_host_iqr_us']:.1f})"
        if "vllm_host_us" in r and "ours_host_us" in r:
            r["host_ratio"] = r["ours_host_us"] / r["vllm_host_us"]
        if "vllm_host_us" in r and "guarded_host_us" in r:
            r["guarded_ratio"] = r["guarded_host_us"] / r["vllm_host_us"]
    cols = ["N", "tokens_per_req", "HV", "state_dtype", "MB", "roofline_us"]
    for key in (
        "vllm_graph_us",
        "ours_graph_us",
        "baseline_graph_us",
        "floor_graph_us",
        "speedup",
        "vs_baseline",
        "vllm_roof",
        "ours_roof",
        "floor_roof",
        "vllm_host",
        "ours_host",
        "guarded_host",
        "op_host",
        "host_ratio",
        "guarded_ratio",
        "vllm_us",
        "ours_us",
        "guarded_us",
        "op_us",
        "baseline_us",
    ):
        if any(key in r for r in rows):
            cols.append(key)
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(_fmt(r.get(c, float("nan"))) for c in cols) for r in rows]
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> str:
    """Issue 14's targets, each with the cases it covers and its worst value."""
    lines = []

    def report(label: str, cases: list[dict[str, Any]], key: str, ok: Callable[[float], bool],
               worst: Callable[..., float], fmt: str) -> None:  # fmt: skip
        vals = [(r[key], r) for r in cases if key in r]
        if not vals:
            return
        w, wr = worst(vals, key=lambda t: t[0])
        where = f"N={wr['N']} tok={wr['tokens_per_req']} HV={wr['HV']} {wr['state_dtype']}"
        verdict = "met" if all(ok(v) for v, _ in vals) else "MISSED"
        lines.append(f"{label}: {verdict}; worst {fmt.format(w)} at {where} ({len(vals)} cases)")

    for sd in sorted({r["state_dtype"] for r in rows}):
        rs = [r for r in rows if r["state_dtype"] == sd]
        report(f"[{sd}] graph, N>=8, tok>=4, HV>=32: >= 85% of roofline",
               [r for r in rs if r["N"] >= 8 and r["tokens_per_req"] >= 4 and r["HV"] >= 32],
               "ours_roof", lambda v: v >= 0.85, min, "{:.0%}")  # fmt: skip
        report(f"[{sd}] graph, N=8, tok=4, vLLM < 60% of roofline: >= 1.5x vLLM",
               [r for r in rs if r["N"] == 8 and r["tokens_per_req"] == 4
                and r.get("vllm_roof", 1) < 0.6],
               "speedup", lambda v: v >= 1.5, min, "{:.2f}x")  # fmt: skip
        report(f"[{sd}] graph, N=1, tok=4, HV 16-64: <= 8 us",
               [r for r in rs if r["N"] == 1 and r["tokens_per_req"] == 4 and 16 <= r["HV"] <= 64],
               "ours_graph_us", lambda v: v <= 8.0, max, "{:.1f} us")  # fmt: skip
        report(f"[{sd}] graph, every case: not slower than the baseline (>= 0.97x)",
               rs, "vs_baseline", lambda v: v >= 0.97, min, "{:.2f}x")  # fmt: skip
        report(f"[{sd}] eager host time, N<=8: ours <= 0.7x vLLM's path",
               [r for r in rs if r["N"] <= 8], "host_ratio", lambda v: v <= 0.7, max,
               "{:.2f}x")  # fmt: skip
        report(f"[{sd}] eager host time, N<=8: the guarded call site <= 0.7x vLLM's path",
               [r for r in rs if r["N"] <= 8], "guarded_ratio", lambda v: v <= 0.7, max,
               "{:.2f}x")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-tree", help="extracted vLLM release (sdist) root")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run, no timing")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--n", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--spec", type=int, nargs="+", default=[1, 3, 7])
    p.add_argument("--hv", type=int, nargs="+", default=[16, 32, 48, 64])
    p.add_argument("--state", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--baseline-kernels", help="an earlier kernels/gdn_backport_kernels folder")
    p.add_argument("--host-max-n", type=int, default=8, help="host timing up to this N")
    p.add_argument("--host-calls", type=int, default=2000)
    p.add_argument("--host-drain-every", type=int, default=16, help="calls between drains")
    p.add_argument("--floor-max-n", type=int, default=8, help="floor kernel up to this N")
    args = p.parse_args(argv)

    rows = run(args)
    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vllm_tree": args.vllm_tree,
        "baseline": args.baseline_kernels,
        "host_calls": args.host_calls,
        "host_drain_every": args.host_drain_every,
        "smoke": args.smoke,
    }
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    if args.smoke:
        print("(smoke: Triton interpreter on CPU; times are not measurements)")
    print(table(rows))
    if not args.smoke:
        print(targets(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
