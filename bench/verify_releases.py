"""The regression suite over many releases, unpatched and patched, in one process.

For each release (default: every sdist release of
matrix/releases.toml) and each layer shape, runs ``verify`` on the release as
published and, where the release is affected, on a copy patched with each
strategy. Prints one line per run as it goes and a table at the end: per
run the mixed scenarios' worst error (the bug's layouts), the others' worst
error, and whether the run did what it must (affected and unpatched: mixed
scenarios fail, the rest pass; everything else: all pass).

    python bench/verify_releases.py --device cuda --heads 16,32,128
    python bench/verify_releases.py --device cpu --release 0.27.1 --scenario pr_layout
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from gdn_backport import matrix, sources
from gdn_backport.patchsets.pr51812.config import load as load_patchset
from gdn_backport.patchsets.pr51812.plan import apply_tree
from gdn_backport.patchsets.pr51812.scenarios import SCENARIOS
from gdn_backport.pipeline import Mode
from gdn_backport.report import table
from gdn_backport.site import Status
from gdn_backport.verify import verify_tree

EXPECT = {s.name: s.expect_unpatched for s in SCENARIOS}


def judge(report: object, must_fail_mixed: bool) -> tuple[str, float, float]:
    rows = report.rows  # type: ignore[attr-defined]
    if report.error:  # type: ignore[attr-defined]
        return "ERROR", float("nan"), float("nan")
    mixed = [r for r in rows if EXPECT.get(r.name) == "fail"]
    other = [r for r in rows if EXPECT.get(r.name) != "fail"]
    worst_mixed = max((r.max_abs_err for r in mixed), default=0.0)
    worst_other = max((r.max_abs_err for r in other), default=0.0)
    if must_fail_mixed:
        ok = all(not r.passed for r in mixed) and all(r.passed for r in other)
    else:
        ok = all(r.passed for r in rows)
    return ("ok" if ok else "MISMATCH"), worst_mixed, worst_other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--release", action="append", help="default: every sdist release")
    ap.add_argument("--heads", action="append", help="H,HV,D (repeatable); default small")
    ap.add_argument("--scenario", action="append", help="default: all")
    ap.add_argument("--strategy", action="append", help="default: gather and kernel")
    ap.add_argument("--json", help="write every report here")
    args = ap.parse_args()
    releases = [
        r
        for r in matrix.load().releases
        if not r.wheel_only and (not args.release or r.version in args.release)
    ]
    shapes: list[tuple[int, int, int] | None] = [
        tuple(int(x) for x in h.split(","))
        for h in args.heads or []  # type: ignore[misc]
    ] or [None]
    rows, docs = [], []
    work = Path(tempfile.mkdtemp(prefix="gdn-verify-"))
    for release in releases:
        variants: list[tuple[str, Path]] = [("unpatched", sources.release_tree(release.version))]
        if release.status is Status.AFFECTED:
            for strategy in args.strategy or load_patchset().strategies:
                dest = sources.copy_release(release.version, work / f"{release.version}-{strategy}")
                out = apply_tree(dest, strategy, Mode.WRITE)
                assert out.written and out.exit_code == 0, (release.version, strategy, out.refused)
                variants.append((strategy, dest))
        for shape in shapes:
            for variant, tree in variants:
                t0 = time.perf_counter()
                report = verify_tree(tree, args.device, args.scenario, heads=shape)
                seconds = time.perf_counter() - t0
                must_fail = release.status is Status.AFFECTED and variant == "unpatched"
                verdict, mixed, other = judge(report, must_fail)
                passed = sum(r.passed for r in report.rows)
                hv = "-" if shape is None else ",".join(map(str, shape))
                row = (release.version, release.status.value, variant, hv,
                       f"{passed}/{len(report.rows)}", f"{mixed:.3g}", f"{other:.3g}",
                       verdict, f"{seconds:.1f}")  # fmt: skip
                why = report.error or next(
                    (r.note for r in report.rows if r.note.startswith("raised")), ""
                )
                print("  ".join(row) + (f"  {why}" if verdict != "ok" else ""), flush=True)
                rows.append(row)
                docs.append({"release": release.version, "variant": variant, "heads": hv,
                             "verdict": verdict, "seconds": seconds,
                             "report": json.loads(report.to_json())})  # fmt: skip
    head = ["release", "status", "variant", "H,HV,D", "passed", "worst mixed err",
            "worst other err", "verdict", "s"]  # fmt: skip
    print(table(head, rows))
    bad = sum(r[7] != "ok" for r in rows)
    print(f"{len(rows) - bad}/{len(rows)} runs as expected")
    if args.json:
        Path(args.json).write_text(json.dumps(docs, indent=1, default=str))


if __name__ == "__main__":
    main()
