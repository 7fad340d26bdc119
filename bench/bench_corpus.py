"""Run the whole mutation corpus and print its counts (tests/corpus).

Every (release, variant, strategy) goes through scan and apply on a private
copy; every patched variant (and every "already fixed" one) is verified by
the regression suite on CPU under Triton's interpreter, so this needs the
Triton that runs vLLM's kernels (3.6 here) and ``TRITON_INTERPRET=1``:

    TRITON_INTERPRET=1 python bench/bench_corpus.py
    TRITON_INTERPRET=1 python bench/bench_corpus.py --release 0.27.1 --variant positional_args
    python bench/bench_corpus.py --no-verify          # scan/apply only, any Triton
    TRITON_INTERPRET=1 python bench/bench_corpus.py --negative   # + mutation check

``--negative`` also runs each patch-expected variant unpatched: its mixed
scenario must fail, or the variant does not carry the bug. Exit status 0
when no case is wrong, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from gdn_backport.report import table

# The corpus is test-fixture code (tests/corpus), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import corpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--release", action="append", help="only these releases (default: all)")
    p.add_argument("--variant", action="append", help="only these variants (default: all)")
    p.add_argument("--strategy", action="append", choices=corpus.STRATEGIES)
    p.add_argument("--no-verify", action="store_true", help="skip the regression suite")
    p.add_argument(
        "--scenarios",
        default="pr_layout,pure_spec",
        help="scenarios verified on each patched variant (comma list)",
    )
    p.add_argument("--negative", action="store_true", help="also verify unpatched variants fail")
    p.add_argument("--json", type=Path, help="write every case's result here")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where verify runs")
    p.add_argument("--heads", help="H,HV,D of the verified layer (default: small CPU shape)")
    args = p.parse_args(argv)
    heads = tuple(int(x) for x in args.heads.split(",")) if args.heads else None
    assert heads is None or len(heads) == 3, "--heads H,HV,D"

    scenarios = None if args.no_verify else tuple(args.scenarios.split(","))
    if scenarios is not None:
        from gdn_backport.verify import triton_problem

        problem = triton_problem()
        if problem:
            print(f"bench_corpus: cannot verify: {problem} (or pass --no-verify)", file=sys.stderr)
            return 2
    layouts = [corpus.layout(v) for v in args.release] if args.release else corpus.LAYOUTS
    variants = [corpus.variant(n) for n in args.variant] if args.variant else corpus.VARIANTS
    strategies = args.strategy or corpus.STRATEGIES

    t0 = time.perf_counter()
    results: list[corpus.CaseResult] = []
    negatives: list[tuple[str, str, bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="gdn-corpus-") as tmp:
        work = Path(tmp)
        for lay in layouts:
            base = corpus.slim_tree(lay.version, work / f"base-{lay.version}")
            original = (base / lay.path).read_text(encoding="utf-8")
            for var in variants:
                source = corpus.variant_source(original, lay, var)
                for strategy in strategies:
                    r = corpus.run_case(
                        base,
                        lay,
                        var,
                        strategy,
                        work,
                        scenarios,
                        source,
                        args.device,
                        heads,  # type: ignore[arg-type]
                    )
                    results.append(r)
                    flag = "WRONG " if r.wrong else ""
                    print(
                        f"{flag}{r.id}: {r.got} ({r.seconds:.1f} s) {'; '.join(r.problems)}",
                        file=sys.stderr,
                        flush=True,
                    )
                if args.negative and var.gather.outcome == "patched":
                    failed, note = corpus.unpatched_fails(
                        base,
                        lay,
                        var,
                        work,
                        device=args.device,
                        heads=heads,  # type: ignore[arg-type]
                    )
                    negatives.append((lay.version, var.name, failed, note))
    elapsed = time.perf_counter() - t0

    print(corpus.render(results))
    if negatives:
        print("\nmutation check: unpatched variants must fail the mixed scenario")
        rows = [(v, n, "yes" if f else "NO", note) for v, n, f, note in negatives]
        print(table(["release", "variant", "fails unpatched", "notes"], rows))
    print(f"\n{len(results)} cases in {elapsed:.0f} s ({elapsed / 60:.1f} min)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2, default=str))
    bad = any(r.wrong for r in results) or any(not f for _, _, f, _ in negatives)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
