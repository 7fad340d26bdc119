"""Time gdn-backport's commands as a user runs them: cold processes, whole trees.

Every figure is the median of --repeat fresh processes (``python -m
gdn_backport ...``, both patchsets), with the peak RSS of the slowest-memory
one, side by side with the floor, ``grep -rl _forward_core`` over the same
tree (merely reading it). The page cache is warm for all (one untimed run
first), as are the bytecode and the compiled dataclass methods beside it
(``gdn_backport.dataclass_code``; the header says how many) where
``PYTHONDONTWRITEBYTECODE`` is unset. Rows:

- ``--help``;
- ``scan`` cold (``GDN_BACKPORT_NO_CACHE=1``: every file analysed), beside
  the same in one process (``GDN_BACKPORT_JOBS=1``: the later patchset not
  run ahead in a child, :mod:`gdn_backport.ahead`), the two interleaved run
  by run (the machine's speed drifts);
- ``scan`` again with the analysis cache (an unchanged tree: every entry a hit);
- ``apply --dry-run`` cold (and in one process, interleaved); ``apply`` on
  a fresh copy of the tree, cold;
- ``scan`` of a tree holding one huge module (``--huge-mb``, default 10)
  that names a spec field (issue 24 D14): time and memory must be linear.

Also prints the load average and a pure-Python loop's time: the figures
are wall-clock times of a machine that may be shared, whose speed drifts
(session 11 saw the same cold scan take 1.3 s and 2.0 s within an hour).

    python bench/bench_scan.py                      # 0.25.1 0.27.1 0.33.0
    python bench/bench_scan.py --release 0.27.1 --repeat 9 --out bench/results/x.txt
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gdn_backport import dataclass_code, sources
from gdn_backport.report import table

HEAD = ["command", "tree", "median s", "min s", "peak RSS MB", "grep s", "vs grep"]


def cold(argv: list[str], env: dict[str, str], timeout: float = 600) -> tuple[float, float]:
    """One fresh process: (wall seconds, peak RSS in MB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = t0 + timeout
    while True:
        pid, _, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            return float("inf"), float("nan")
        time.sleep(0.002)
    proc.returncode = 0  # reaped here
    return time.perf_counter() - t0, usage.ru_maxrss / 1024


def measure(
    argv: list[str], env: dict[str, str], repeat: int, setup: object = None, warm: bool = True
) -> tuple[list[float], float]:
    return interleaved([(argv, env)], repeat, setup, warm)[0]


def interleaved(
    runs: list[tuple[list[str], dict[str, str]]],
    repeat: int,
    setup: object = None,
    warm: bool = True,
) -> list[tuple[list[float], float]]:
    """Each run ``repeat`` times, taking turns (one untimed round first
    where ``warm``; ``setup`` before every run): its times and peak RSS."""

    def once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
        if callable(setup):
            setup()
        return cold(argv, env)

    if warm:
        for argv, env in runs:
            once(argv, env)
    times: list[list[float]] = [[] for _ in runs]
    peaks = [0.0 for _ in runs]
    for _ in range(repeat):
        for i, (argv, env) in enumerate(runs):
            wall, rss = once(argv, env)
            times[i].append(wall)
            peaks[i] = max(peaks[i], rss)
    return list(zip(times, peaks, strict=True))


def loop_time() -> float:
    """A fixed pure-Python loop (10**7 additions): the machine's speed now."""
    t0 = time.perf_counter()
    x = 0
    for i in range(10**7):
        x += i
    return time.perf_counter() - t0


def grep_time(tree: Path, repeat: int) -> float:
    argv = ["grep", "-rl", "_forward_core", str(tree)]
    return statistics.median(measure(argv, dict(os.environ), repeat)[0])


def huge_module(folder: Path, megabytes: float) -> Path:
    """A tree whose one module is ``megabytes`` of unrelated functions around
    an affected spec path (the gather codemod's upstream-shaped example)."""
    from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod

    root = folder / "huge"
    pkg = root / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    site = GatherGatesCodemod.REWRITES[0][0]
    filler = []
    size, i = 0, 0
    while size < megabytes * 1e6:
        chunk = (
            f"def helper_{i}(x, y):\n    z = x + y * {i}\n    if z > {i}:\n"
            f"        return [z, x, y]\n    return {{'a': z, 'b': {i}}}\n\n\n"
        )
        filler.append(chunk)
        size += len(chunk)
        i += 1
    half = len(filler) // 2
    (pkg / "big.py").write_text("".join(filler[:half]) + site + "\n\n" + "".join(filler[half:]))
    return root


def row(command: str, tree: str, times: list[float], rss: float, floor: float) -> tuple[str, ...]:
    med = statistics.median(times)
    ratio = f"{med / floor:.0f}x" if floor > 0 else "-"
    return command, tree, f"{med:.3f}", f"{min(times):.3f}", f"{rss:.0f}", f"{floor:.3f}", ratio


def bench(version: str, repeat: int, py: list[str]) -> list[tuple[str, ...]]:
    tree = sources.release_tree(version)
    files = sum(1 for _ in tree.rglob("*.py"))
    name = f"{version} ({files} files)"
    floor = grep_time(tree, repeat)
    base = dict(os.environ)
    nocache = {**base, "GDN_BACKPORT_NO_CACHE": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cached = {**base, "GDN_BACKPORT_CACHE": str(Path(tmp) / "cache")}
        cached.pop("GDN_BACKPORT_NO_CACHE", None)
        one = {**nocache, "GDN_BACKPORT_JOBS": "1"}
        scan = [*py, "scan", str(tree)]
        forked, alone = interleaved([(scan, nocache), (scan, one)], repeat)
        rows.append(row("scan (cold, no cache)", name, *forked, floor))
        rows.append(row("  the same, one process", name, *alone, floor))
        rows.append(row("scan (rescan, cache hit)", name, *measure(scan, cached, repeat), floor))
        dry = [*py, "apply", "--dry-run", str(tree)]
        forked, alone = interleaved([(dry, nocache), (dry, one)], repeat)
        rows.append(row("apply --dry-run (cold)", name, *forked, floor))
        rows.append(row("  the same, one process", name, *alone, floor))
        work = Path(tmp) / "tree"

        def fresh() -> None:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(tree, work, symlinks=True)

        write = [*py, "apply", str(work)]
        rows.append(
            row("apply, a copy (cold)", name, *measure(write, nocache, repeat, fresh), floor)
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", action="append", help="default: 0.25.1, 0.27.1 and 0.33.0")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--huge-mb", type=float, default=10.0, help="0: no huge-module row")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args()
    py = [sys.executable, "-m", "gdn_backport"]
    rows = []
    times, rss = measure([*py, "--help"], dict(os.environ), args.repeat)
    rows.append(row("--help", "-", times, rss, 0.0))
    for version in args.release or ["0.25.1", "0.27.1", "0.33.0"]:
        rows += bench(version, args.repeat, py)
    if args.huge_mb:
        with tempfile.TemporaryDirectory() as tmp:
            root = huge_module(Path(tmp), args.huge_mb)
            env = {**os.environ, "GDN_BACKPORT_NO_CACHE": "1"}
            floor = grep_time(root, 3)
            what = f"one {args.huge_mb:g} MB module"
            times, rss = measure([*py, "scan", str(root)], env, 1, warm=False)
            rows.append(row("scan (cold, no cache)", what, times, rss, floor))
    bytecode = "off" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "on"
    # The compiled dataclass methods the runs read (gdn_backport.dataclass_code).
    stored = sum(
        len(dataclass_code.load(path))
        for package in ("libcst", "gdn_backport")
        if (path := dataclass_code.store_path(package)) is not None
    )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = (
        f"# bench/bench_scan.py --repeat {args.repeat}; {when}; "
        f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}; Python {sys.version.split()[0]}; "
        f"bytecode cache {bytecode} (dataclass code: {stored} sources); "
        f"a 10**7 Python loop {loop_time():.2f} s\n" + table(HEAD, rows)
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
