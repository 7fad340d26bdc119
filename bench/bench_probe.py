"""What the reachability probe adds to one metadata build, in microseconds.

A builder with vLLM's ``build`` signature that does nothing (returns a
prepared metadata object) is timed bare and wrapped by
``gdn_backport.runtime.probe.wrap_builder``; the difference is the probe's
cost per build. Inputs are CPU tensors shaped like the model runner's
(``query_start_loc_cpu``, ``num_decode_draft_tokens_cpu``). Each figure is
the best of --repeat rounds of --number builds (timeit's advice: the minimum
is the least disturbed).

    python bench/bench_probe.py
    python bench/bench_probe.py --rows 8 64 512 --number 20000
"""

from __future__ import annotations

import argparse
import platform
import timeit
import types
from typing import Any

import torch

from gdn_backport.runtime.probe import Probe, wrap_builder


def make_builder(result: Any) -> type:
    class Builder:
        use_spec_decode = True

        def build(
            self,
            common_prefix_len: int,
            common_attn_metadata: Any,
            num_accepted_tokens: Any = None,
            num_decode_draft_tokens_cpu: Any = None,
            fast_build: bool = False,
        ) -> Any:
            return result

    return Builder


def layout(rows: int, kind: str) -> tuple[Any, torch.Tensor]:
    """``rows`` requests: spec rows of 4 tokens, and for "nonspec_first" a
    one-token non-spec row first (the bug's layout), for "nonspec_last" a
    5-token prefill chunk last (mixed, a prefix: the whole batch is read)."""
    lens = [4] * rows
    drafts = [3] * rows
    if kind == "nonspec_first":
        lens[0], drafts[0] = 1, -1
    elif kind == "nonspec_last":
        lens[-1], drafts[-1] = 5, -1
    qsl = torch.zeros(rows + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return types.SimpleNamespace(query_start_loc_cpu=qsl), torch.tensor(drafts, dtype=torch.int32)


def per_build_us(builder: Any, m: Any, drafts: torch.Tensor, number: int, repeat: int) -> float:
    def call() -> Any:
        return builder.build(0, m, None, drafts)

    best = min(timeit.repeat(call, number=number, repeat=repeat))
    return 1e6 * best / number


MIXED = dict(spec=1, prefills=1, decodes=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.processor()}")
    print(f"best of {args.repeat} x {args.number} builds; overhead = wrapped - bare")
    print(f"{'case':<44} {'rows':>5} {'bare us':>8} {'wrapped us':>10} {'overhead us':>11}")
    cases = [
        # (name, layout kind, what the builder returns)
        ("pure spec (counts say: not mixed)", "pure", dict(spec=1, prefills=0, decodes=0)),
        ("mixed, non-spec first (not a prefix)", "nonspec_first", MIXED),
        ("mixed, non-spec last (prefix, full scan)", "nonspec_last", MIXED),
        ("mixed, non-spec last, no counts (fork)", "nonspec_last", None),
    ]
    for rows in args.rows:
        for name, kind, counts in cases:
            result = (
                types.SimpleNamespace(
                    num_spec_decodes=counts["spec"],
                    num_prefills=counts["prefills"],
                    num_decodes=counts["decodes"],
                )
                if counts
                else object()
            )
            m, drafts = layout(rows, kind)
            bare = make_builder(result)()
            cls = make_builder(result)
            probe = Probe(every=0)
            assert wrap_builder(cls, probe)
            wrapped = cls()
            t_bare = per_build_us(bare, m, drafts, args.number, args.repeat)
            t_wrapped = per_build_us(wrapped, m, drafts, args.number, args.repeat)
            assert probe.counts().errors == 0
            extra = t_wrapped - t_bare
            print(f"{name:<44} {rows:>5} {t_bare:>8.2f} {t_wrapped:>10.2f} {extra:>11.2f}")


if __name__ == "__main__":
    main()
