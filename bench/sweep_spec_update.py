"""Where the spec-update kernel's time goes: launch configurations side by side.

For each case (N requests, tokens per request, HV) this times vLLM's fixed path
(two gathers + vLLM's kernel, from ``--vllm-tree``) and our launcher under
every configuration given (q/k/v preloaded as a tile or loaded per token, V
block, warps, streaming state stores), all as CUDA-graph replays in one
process, so the kernel time is compared without host launch noise. Each
configuration is cross-checked against vLLM's output and states first.

    python bench/sweep_spec_update.py --vllm-tree /path/vllm-0.27.1 [--json out.json]

Configurations: ``--config preload,BV,warps,stream[,for]`` (repeatable), e.g.
``--config 0,8,1,0,1`` = per-token loads, BV=8, one warp, plain stores, a
counted token loop (0: the `while` loop the interpreter needs); ``auto`` is
the launcher's own choice.
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
    load_vllm_kernel,
    make_inputs,
    paths,
    time_graph,
)

DEFAULT_CONFIGS = [
    "0,4,1,0,1",
    "0,8,2,0,1",
    "0,16,1,0,1",
    "auto",
    "1,32,4,0,0",  # the first default: q/k/v tiles, `while` token loop
    "0,32,4,0,1",  # vLLM's launch shape: BV=32, 4 warps, counted loop
    "0,8,1,1,1",  # streaming state stores
]
DEFAULT_CASES = [
    "1,3,32", "8,3,16", "8,3,32", "8,3,64", "64,3,64", "64,7,32", "256,1,64", "256,3,64",
    "256,7,64",
]  # fmt: skip


def parse_config(text: str) -> dict[str, Any]:
    if text == "auto":
        return {}
    preload, bv, warps, stream, *loop = (int(x) for x in text.split(","))
    return {
        "preload_qkv": bool(preload),
        "block_v": bv,
        "num_warps": warps,
        "stream_stores": bool(stream),
        "for_loop": bool(loop[0]) if loop else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-tree", required=True)
    p.add_argument("--config", action="append", help="preload,BV,warps,stream or auto")
    p.add_argument("--case", action="append", help="N,num_spec,HV")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    vllm_fn, null_slot_id, path = load_vllm_kernel(Path(args.vllm_tree))
    print(f"vLLM kernel: {path}", file=sys.stderr)
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", file=sys.stderr)
    configs = args.config or DEFAULT_CONFIGS
    rows: list[dict[str, Any]] = []
    header = ["N", "tok", "HV", "roof_us", "vllm_us", *configs]
    print(" ".join(f"{h:>9}" for h in header))
    for spec in args.case or DEFAULT_CASES:
        n, s, hv = (int(x) for x in spec.split(","))
        case = Case(N=n, num_spec=s, HV=hv)
        x = make_inputs(case, "cuda")
        roof = case.bytes_moved() / bw * 1e6
        row: dict[str, Any] = {"N": n, "tokens_per_req": s + 1, "HV": hv, "roofline_us": roof}
        base = paths(x, vllm_fn, null_slot_id, {})
        row["vllm_us"] = time_graph(base["vllm"])
        for cfg in configs:
            fns = paths(x, vllm_fn, null_slot_id, parse_config(cfg))
            cross_check(x, {"vllm": fns["vllm"], "launcher": fns["launcher"]})
            row[cfg] = time_graph(fns["launcher"])
        rows.append(row)
        cells = [n, s + 1, hv, roof, row["vllm_us"], *(row[c] for c in configs)]
        print(" ".join(f"{c:>9.1f}" if isinstance(c, float) else f"{c:>9}" for c in cells))
        print(
            "  roofline fraction: vllm {:.0%}; ".format(roof / row["vllm_us"])
            + ", ".join(f"{c} {roof / row[c]:.0%}" for c in configs),
            flush=True,
        )
        del x
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth": bw, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
