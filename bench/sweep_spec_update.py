"""Where the spec-update kernel's time goes: launch configurations side by side.

For each case (N requests, tokens per request, HV) this times vLLM's fixed path
(two gathers + vLLM's kernel, from ``--vllm-tree``) and our launcher under
every configuration given, all as CUDA-graph replays in one process, so the
kernel time is compared without host launch noise. Each configuration is
cross-checked against vLLM's output and states first.

    python bench/sweep_spec_update.py --vllm-tree /path/vllm-0.27.1 [--json out.json]

Configurations: ``--config BV,warps,NT,preload`` (repeatable; see
``LaunchConfig``), e.g. ``--config 4,1,0,1`` = [4, K] state tiles on one
warp, whole-request tiles (0: min(C, 8); or NT tokens), every token of a tile loaded before its
recurrence; ``auto`` is the launcher's own choice; ``baseline`` an earlier
package's launcher (``--baseline-kernels``). A fifth field is ignored (the
session-4 sweep's Gram flag; that variant is gone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_update import (
    Case,
    copy_bandwidth,
    cross_check,
    load_baseline,
    load_vllm_kernel,
    make_inputs,
    paths,
    time_graph,
)

from gdn_backport_kernels import spec_update

DEFAULT_CONFIGS = [
    "baseline",
    "auto",  # one token per tile (session 4's default)
    "4,1,0,0",  # unrolled tile, loads inside the recurrence
    "4,1,2,1",  # tiles of two tokens, loads first
    "2,1,0,1",  # whole-request tiles, loads first
    "4,1,0,1",
    "8,1,0,1",
    "8,1,1,1",
]
DEFAULT_CASES = [
    "1,3,16", "1,3,64", "8,3,16", "8,3,32", "8,3,64", "8,7,32", "64,3,32", "64,7,64",
    "256,1,64", "256,3,64", "256,7,64",
]  # fmt: skip


def parse_config(text: str) -> dict[str, Any]:
    if text in ("auto", "baseline"):
        return {}
    bv, warps, nt, preload, *_ = (int(x) for x in text.split(","))
    return {
        "block_v": bv,
        "num_warps": warps,
        "token_tile": nt,
        "preload": bool(preload),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-tree", required=True)
    p.add_argument("--config", action="append", help="BV,warps,NT,preload or auto")
    p.add_argument("--case", action="append", help="N,num_spec,HV[,bf16]")
    p.add_argument("--baseline-kernels", help="an earlier kernels/gdn_backport_kernels folder")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    vllm_fn, null_slot_id, path = load_vllm_kernel(Path(args.vllm_tree))
    print(f"vLLM kernel: {path}", file=sys.stderr)
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", file=sys.stderr)
    configs = args.config or DEFAULT_CONFIGS
    baseline_fn = load_baseline(Path(args.baseline_kernels)) if args.baseline_kernels else None
    if baseline_fn is None:
        configs = [c for c in configs if c != "baseline"]
    rows: list[dict[str, Any]] = []
    header = ["N", "tok", "HV", "roof_us", "vllm_us", *configs]
    print(" ".join(f"{h:>9}" for h in header))
    for spec in args.case or DEFAULT_CASES:
        n, s, hv, *sd = spec.split(",")
        case = Case(N=int(n), num_spec=int(s), HV=int(hv), state_dtype=sd[0] if sd else "fp32")
        x = make_inputs(case, "cuda")
        roof = case.bytes_moved() / bw * 1e6
        row: dict[str, Any] = {**{k: v for k, v in vars(case).items()}, "roofline_us": roof}
        row["tokens_per_req"] = case.num_spec + 1
        base = paths(x, vllm_fn, null_slot_id, baseline_fn=baseline_fn)
        row["vllm_us"] = time_graph(base["vllm"])
        for cfg in configs:
            if cfg == "baseline":
                fn = base["baseline"]
            else:
                fn = paths(x, vllm_fn, null_slot_id, parse_config(cfg))["launcher"]
            cross_check(x, {"vllm": base["vllm"], cfg: fn})
            row[cfg] = time_graph(fn)
        rows.append(row)
        cells = [case.N, case.num_spec + 1, case.HV, roof, row["vllm_us"]]
        cells += [row[c] for c in configs]
        print(" ".join(f"{c:>9.1f}" if isinstance(c, float) else f"{c:>9}" for c in cells))
        print(
            "  roofline fraction: vllm {:.0%}; ".format(roof / row["vllm_us"])
            + ", ".join(f"{c} {roof / row[c]:.0%}" for c in configs),
            flush=True,
        )
        del x
        torch.cuda.empty_cache()
    # Registers and spills of every compiled variant (occupancy: 64K
    # registers per SM, at most 32 one-warp programs).
    for plan in spec_update._PLANS.values():
        compiled = getattr(plan, "compiled", None)
        if compiled is not None:
            cfg = {k: v for k, v in plan.constexprs.items() if k in ("BV", "NT", "PRELOAD")}
            print(f"  compiled {cfg} warps={plan.num_warps}: {compiled.n_regs} registers, "
                  f"{compiled.n_spills} spills")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth": bw, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
