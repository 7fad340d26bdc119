"""The GDN speculative-verify update: vLLM's fixed path against our op, one process.

vLLM's way (the PR #51812 fix) is two ``index_select`` gathers of the gates
plus vLLM's own ``fused_sigmoid_gating_delta_rule_update``, loaded from an
extracted release (``--vllm-tree``, e.g. the tree ``gdn-backport fetch``
unpacks) with stand-ins for the one vLLM module it imports. Ours is
``gated_delta_rule_spec_update`` (through the ``torch.library`` op) taking the
ungathered gates and the token index; "launcher" calls the Triton launcher
directly, which shows what the dispatcher costs.

For each case: median time (``triton.testing.do_bench``), eager and as
CUDA-graph replays; the roofline time, i.e. the minimal bytes the update must
move over the bandwidth of a large device-to-device copy measured here; the
fraction of it reached; and our speedup. Before timing, both paths run from
the same state and must agree.

    python bench/bench_spec_update.py --vllm-tree /path/vllm-0.27.1 [--json out.json]
    python bench/bench_spec_update.py --smoke [--vllm-tree ...]   # CPU, interpreter

``--smoke`` runs one tiny case on CPU under the Triton interpreter to prove
the script works; its times are not measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
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

from gdn_backport_kernels import gated_delta_rule_spec_update
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


@dataclass
class Case:
    N: int
    num_spec: int
    HV: int
    H: int = 16
    K: int = 128
    V: int = 128
    n_nonspec: int = 16  # non-spec rows placed before the spec rows

    @property
    def tokens(self) -> int:
        return self.N * (1 + self.num_spec)

    def bytes_moved(self) -> int:
        """Minimal HBM traffic: initial states, every token's state, q/k/v/out,
        gates, indices (bf16 activations and gates, fp32 state)."""
        T, N, H, HV, K, V = self.tokens, self.N, self.H, self.HV, self.K, self.V
        state = (N + T) * HV * V * K * 4
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
    state = torch.empty(num_slots, HV, V, K, device=device)
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
    launcher_kw: dict[str, Any],
) -> dict[str, Fn]:
    common = {k: x[k] for k in ("A_log", "dt_bias", "q", "k", "v", "initial_state")}
    meta = {k: x[k] for k in ("cu_seqlens", "ssm_state_indices", "num_accepted_tokens")}

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

    def launcher() -> Any:
        return gated_delta_rule_spec_update_fwd(
            x["A_log"],
            x["a"],
            x["b"],
            x["dt_bias"],
            x["q"][0],
            x["k"][0],
            x["v"][0],
            x["initial_state"],
            x["cu_seqlens"],
            x["ssm_state_indices"],
            x["num_accepted_tokens"],
            x["spec_token_indx"],
            null_slot_id=null_slot_id,
            **launcher_kw,
        )

    out: dict[str, Fn] = {"ours": ours, "launcher": launcher}
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

        out = {"vllm": vllm, **out}
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
    for name, (o, s) in results.items():
        torch.testing.assert_close(o, ref_out, atol=2e-2, rtol=2e-2, msg=name)
        torch.testing.assert_close(s, ref_state, atol=1e-3, rtol=1e-3, msg=name)
    del start, results
    print(f"  paths agree with {ref_name}: {', '.join(fns)}", file=sys.stderr)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a 2 GiB device-to-device copy (read + write counted)."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n / (ms * 1e-3)


def time_eager(fn: Fn) -> float:
    return float(triton.testing.do_bench(fn, return_mode="median")) * 1e3  # us


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


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: only --smoke runs on CPU")
    vllm_fn, null_slot_id = None, 0
    if args.vllm_tree:
        vllm_fn, null_slot_id, path = load_vllm_kernel(Path(args.vllm_tree))
        print(f"vLLM kernel: {path} (null_slot_id={null_slot_id})", file=sys.stderr)
    launcher_kw = {
        "block_v": args.block_v,
        "num_warps": args.num_warps,
        "preload_qkv": not args.per_token_loads,
    }

    if args.smoke:
        cases = [
            Case(N=2, num_spec=1, HV=4, H=2, K=32, V=32, n_nonspec=3),
            Case(N=3, num_spec=3, HV=6, H=2, K=64, V=48, n_nonspec=5),
        ]
        bw = float("nan")
    else:
        cases = [Case(N=n, num_spec=s, HV=hv) for hv in args.hv for n in args.n for s in args.spec]
        bw = copy_bandwidth(device)
        print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", file=sys.stderr)

    rows = []
    for case in cases:
        print(f"case {asdict(case)}", file=sys.stderr)
        x = make_inputs(case, device)
        fns = paths(x, vllm_fn, null_slot_id, launcher_kw)
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
            row[f"{name}_us"] = time_eager(fn)
            if not args.no_graph:
                row[f"{name}_graph_us"] = time_graph(fn)
        rows.append(row)
        del x, fns
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["N", "tokens_per_req", "HV", "MB", "roofline_us"]
    for r in rows:
        r["MB"] = r["bytes"] / 1e6
        for mode in ("", "_graph"):
            ours = r.get(f"ours{mode}_us")
            if ours is None:
                continue
            r[f"ours{mode}_roof"] = r["roofline_us"] / ours
            if f"vllm{mode}_us" in r:
                r[f"vllm{mode}_roof"] = r["roofline_us"] / r[f"vllm{mode}_us"]
                r[f"speedup{mode}"] = r[f"vllm{mode}_us"] / ours
    for key in (
        "vllm_us",
        "ours_us",
        "launcher_us",
        "speedup",
        "vllm_roof",
        "ours_roof",
        "vllm_graph_us",
        "ours_graph_us",
        "launcher_graph_us",
        "speedup_graph",
        "vllm_graph_roof",
        "ours_graph_roof",
    ):
        if any(key in r for r in rows):
            cols.append(key)
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(_fmt(r.get(c, float("nan"))) for c in cols) for r in rows]
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> str:
    """The issue's targets: 1.5x at N=8 with 4 tokens, 90% roofline at N>=64."""
    lines = []
    for mode in ("", "_graph"):
        n8 = [
            r[f"speedup{mode}"]
            for r in rows
            if f"speedup{mode}" in r and r["N"] == 8 and r["tokens_per_req"] == 4
        ]
        big = [r[f"ours{mode}_roof"] for r in rows if f"ours{mode}_roof" in r and r["N"] >= 64]
        label = "graph" if mode else "eager"
        if n8:
            lines.append(f"{label}: speedup N=8, 4 tok/req: min {min(n8):.2f} (>= 1.5)")
        if big:
            lines.append(f"{label}: roofline N>=64: min {min(big):.0%} (>= 90%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-tree", help="extracted vLLM release (sdist) root")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run, no timing")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--n", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--spec", type=int, nargs="+", default=[1, 3, 7])
    p.add_argument("--hv", type=int, nargs="+", default=[16, 32, 48, 64])
    p.add_argument("--block-v", type=int, help="launcher column only")
    p.add_argument("--num-warps", type=int, help="launcher column only")
    p.add_argument("--per-token-loads", action="store_true", help="launcher: q/k/v in the loop")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timing")
    args = p.parse_args(argv)

    rows = run(args)
    env = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vllm_tree": args.vllm_tree,
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
