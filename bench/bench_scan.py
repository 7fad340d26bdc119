"""Time `scan` and `apply` on whole extracted release trees.

Side by side in one process with the floor, `grep -rl _forward_core` over
the same tree (merely reading it). Each figure is the median (and min) of
--repeat runs after one warm-up run, so the page cache is warm for all.

    python bench/bench_scan.py                 # 0.25.1 (affected) and 0.33.0 (newest)
    python bench/bench_scan.py --release 0.18.1 --repeat 9
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gdn_backport import sources
from gdn_backport.patchsets.pr51812.plan import apply_tree
from gdn_backport.patchsets.pr51812.scan import scan_tree
from gdn_backport.pipeline import Mode, revert_tree
from gdn_backport.report import table


def timed(
    fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None
) -> list[float]:
    if setup:
        setup()
    fn()  # warm-up: page cache, imports
    out = []
    for _ in range(repeat):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench(version: str, repeat: int) -> list[tuple[str, ...]]:
    tree = sources.release_tree(version)
    files = sum(1 for _ in tree.rglob("*.py"))
    rows = []

    def grep() -> None:
        subprocess.run(["grep", "-rl", "_forward_core", str(tree)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip

    def scan() -> None:
        scan_tree(tree)

    def cli() -> None:
        # A fresh process: interpreter start, imports and every parse cold.
        subprocess.run([sys.executable, "-m", "gdn_backport", "scan", str(tree)],
                       stdout=subprocess.DEVNULL)  # fmt: skip

    def dry() -> None:
        apply_tree(tree, "gather", Mode.DRY_RUN)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "tree"
        shutil.copytree(tree, work)

        def write() -> None:
            apply_tree(work, "gather", Mode.WRITE)

        def reset() -> None:
            revert_tree(work, Mode.WRITE)

        measured = {
            "grep -rl _forward_core": timed(grep, repeat),
            "scan": timed(scan, repeat),
            "scan, new process (CLI)": timed(cli, repeat),
            "apply --dry-run": timed(dry, repeat),
            "apply (write)": timed(write, repeat, setup=reset),
        }
    floor = statistics.median(measured["grep -rl _forward_core"])
    for name, times in measured.items():
        med = statistics.median(times)
        rows.append(
            (version, str(files), name, f"{med:.3f}", f"{min(times):.3f}", f"{med / floor:.1f}x")
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", action="append", help="default: 0.25.1 and 0.33.0")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for version in args.release or ["0.25.1", "0.33.0"]:
        rows += bench(version, args.repeat)
    print(table(["release", ".py files", "operation", "median s", "min s", "vs grep"], rows))


if __name__ == "__main__":
    main()
