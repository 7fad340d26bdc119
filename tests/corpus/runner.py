"""The mutation corpus's runner: one (release, variant, strategy) through the CLI.

:func:`run_case` drives a case through the real command line
(:func:`gdn_backport.cli.main`) on a private slim copy of the release
(:func:`slim_tree`). Anything other than the expected outcome is ``wrong``,
and a patched variant that fails verification is the worst kind of wrong;
the corpus must report none. :func:`render` and :func:`counts_table` print
the results.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from gdn_backport import atomic, sources
from gdn_backport.report import table
from tests.corpus.variants import (
    STRATEGIES,
    Expect,
    Layout,
    Variant,
    layout,
    variant,
    variant_files,
)


def slim_tree(version: str, dest: Path) -> Path:
    """A private copy of a release, cheap to scan and to copy again.

    Real files: the GDN module and every module with ``ops`` on its path
    (the kernels; the kernel strategy reads its slot rule from one). The
    rest of the release is there as symbolic links into the cache (a whole
    folder as one link where it holds no real file): the regression harness
    may read any of it, while ``scan``/``apply`` never follow links, so it
    costs them nothing and they cannot write into the cache.
    """
    src = sources.release_tree(version)
    lay = layout(version)
    kernels = {p.relative_to(src) for p in (src / "vllm").rglob("*.py")}
    real = {Path(lay.path)} | {r for r in kernels if "ops" in r.parts[1:-1]}
    keep = {parent for r in real for parent in r.parents}

    def fill(rel: Path) -> None:
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for entry in sorted((src / rel).iterdir()):
            sub = rel / entry.name
            if sub in real:
                shutil.copyfile(entry, dest / sub)
            elif sub in keep:
                fill(sub)
            else:
                (dest / sub).symlink_to(entry, target_is_directory=entry.is_dir())

    fill(Path("vllm"))
    return dest


def snapshot(root: Path) -> dict[str, bytes]:
    """The bytes of every regular file below ``root`` (links not followed,
    the records folder left out)."""
    out: dict[str, bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != atomic.STATE_DIR]
        for name in filenames:
            path = Path(dirpath, name)
            if not path.is_symlink():
                out[path.relative_to(root).as_posix()] = path.read_bytes()
    return dict(sorted(out.items()))


@dataclass
class CaseResult:
    version: str
    variant: str
    strategy: str
    expected: Expect
    got: str = ""  # "patched" | "fixed" | "refused" | what happened instead
    scan_status: str = ""
    reason: str = ""  # the refusal line, or the site's reason
    verified: bool | None = None  # None: not verified in this run
    verify_note: str = ""
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def wrong(self) -> bool:
        return bool(self.problems)

    @property
    def id(self) -> str:
        return f"{self.version}-{self.variant}-{self.strategy}"


def _cli(*argv: str) -> tuple[int, str, str]:
    from gdn_backport.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _site(doc: dict[str, object], rel: str, cls: str) -> dict[str, object] | None:
    sites = doc.get("sites")
    assert isinstance(sites, list)
    for s in sites:
        if s["path"] == rel and s["function"] == f"{cls}._forward_core":
            return cast(dict[str, object], s)
    return None


def _variant_into(
    tree: Path, lay: Layout, var: Variant, source: str | None = None
) -> tuple[str, dict[str, str]]:
    """Write the variant (and the files it adds) into a copy of the release."""
    target = tree / lay.path
    text, files = variant_files(target.read_text(encoding="utf-8"), lay, var)
    target.write_text(source if source is not None else text, encoding="utf-8")
    for rel, content in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(content, encoding="utf-8")
    return source if source is not None else text, files


def run_case(
    base: Path,
    lay: Layout,
    var: Variant,
    strategy: str,
    work: Path,
    verify: Sequence[str] | None = None,
    source: str | None = None,
    device: str = "cpu",
    heads: tuple[int, int, int] | None = None,
) -> CaseResult:
    """Drive one variant through scan, apply (and verify, revert) on a copy.

    ``base``: a :func:`slim_tree` of ``lay``'s release (left untouched);
    ``work``: an empty scratch directory; ``verify``: scenario names to run
    on a patched result (None: do not verify); ``source``: the variant's
    text if the caller has it.
    """
    t0 = time.perf_counter()
    expect = var.expect(strategy)
    res = CaseResult(lay.version, var.name, strategy, expect)
    problems = res.problems
    tree = work / res.id
    shutil.copytree(base, tree, symlinks=True)
    target = tree / lay.path
    source, _ = _variant_into(tree, lay, var, source)
    before = snapshot(tree)

    code, out, err = _cli("scan", str(tree), "--json")
    site = _site(json.loads(out), lay.path, lay.cls) if code in (0, 1, 2) and out else None
    res.scan_status = str(site["status"]) if site else "no site"
    if site:
        res.reason = str(site["reason"])
    want_scan = {"patched": {"affected"}, "fixed": {"fixed"}, "refused": {"affected", "unknown"}}
    if res.scan_status not in want_scan[expect.outcome]:
        problems.append(f"scan: {res.scan_status} ({res.reason or err.strip()})")

    code, out, err = _cli("apply", str(tree), "--json", "--strategy", strategy)
    after = snapshot(tree)
    if code == 2:
        res.got = "refused"
        lines = err.strip().splitlines()
        res.reason = err.strip()
        if after != before:
            problems.append("refused, but the tree changed")
        if len(lines) != 1 or str(target) not in lines[0]:
            problems.append(f"refusal is not one line naming the file: {err.strip()!r}")
        if expect.outcome == "refused" and expect.reason not in err:
            problems.append(f"refusal without the reason {expect.reason!r}: {err.strip()}")
    elif code == 0 and after == before:
        res.got = "fixed" if res.scan_status == "fixed" else f"unchanged ({res.scan_status})"
        if res.got == "fixed" and verify is not None:
            # "fixed" is a claim about the code: the variant itself must pass.
            _verify(res, tree, verify, "WRONG VERDICT: fixed, but verify failed", device, heads)
    elif code == 0:
        res.got = "patched"
        changed = set(after) ^ set(before) | {k for k in after if after.get(k) != before.get(k)}
        if changed != {lay.path}:
            problems.append(f"apply changed other files: {sorted(changed - {lay.path})}")
        site = _site(json.loads(out), lay.path, lay.cls)
        if not site or (site["status"], site["changed"]) != ("fixed", True):
            problems.append(f"apply reports {site}")
        _after_patch(res, tree, strategy, before, after, verify, device, heads)
    else:
        res.got = f"exit {code}"
        problems.append(f"apply exit {code}: {err.strip()}")
    if res.got != expect.outcome:
        problems.append(f"expected {expect}, got {res.got}")
    shutil.rmtree(tree)
    res.seconds = time.perf_counter() - t0
    return res


def _after_patch(
    res: CaseResult,
    tree: Path,
    strategy: str,
    before: dict[str, bytes],
    after: dict[str, bytes],
    verify: Sequence[str] | None,
    device: str = "cpu",
    heads: tuple[int, int, int] | None = None,
) -> None:
    """The patched variant: checked clean, idempotent, verified, reverted."""
    problems = res.problems
    code, _, err = _cli("apply", "--check", str(tree), "--strategy", strategy)
    if code != 0:
        problems.append(f"apply --check after apply: exit {code} {err.strip()}")
    code, _, err = _cli("apply", str(tree), "--strategy", strategy)
    if code != 0 or snapshot(tree) != after:
        problems.append(f"second apply not a no-op: exit {code} {err.strip()}")
    if verify is not None:
        _verify(res, tree, verify, "WRONG PATCH: verify failed", device, heads)
    code, _, err = _cli("revert", str(tree))
    if code != 0 or snapshot(tree) != before:
        problems.append(f"revert did not restore the bytes: exit {code} {err.strip()}")


def _report(
    tree: Path,
    scenarios: Sequence[str],
    device: str = "cpu",
    heads: tuple[int, int, int] | None = None,
) -> tuple[bool | None, str]:
    """Verify ``tree`` on CPU: (passed, one-line notes); None when the
    harness itself broke (not a verdict on the tree)."""
    from gdn_backport.verify import verify_tree

    try:
        report = verify_tree(tree, device=device, scenarios=list(scenarios), heads=heads)
    except Exception as exc:
        return None, f"verify raised {type(exc).__name__}: {exc}"
    note = report.error or "; ".join(
        f"{r.name} {'ok' if r.passed else 'FAIL'} {r.max_abs_err:.2g}"
        + ("" if r.passed else f" ({r.note})")
        for r in report.rows
    )
    return report.passed, note


def _verify(
    res: CaseResult,
    tree: Path,
    scenarios: Sequence[str],
    wrong: str,
    device: str = "cpu",
    heads: tuple[int, int, int] | None = None,
) -> None:
    asked = variant(res.variant).scenarios(scenarios)
    passed, res.verify_note = _report(tree, asked, device, heads)
    res.verified = passed
    if passed is None:
        res.problems.append(f"could not verify: {res.verify_note}")
    elif not passed:
        res.problems.append(f"{wrong}: {res.verify_note}")


def unpatched_fails(
    base: Path,
    lay: Layout,
    var: Variant,
    work: Path,
    scenarios: Sequence[str] = ("pr_layout",),
    device: str = "cpu",
    heads: tuple[int, int, int] | None = None,
) -> tuple[bool, str]:
    """The mutation check of one variant: unpatched, the mixed scenarios must
    fail, or the variant does not carry the bug and proves nothing.
    Returns (they all failed, the report's notes)."""
    tree = work / f"{lay.version}-{var.name}-unpatched"
    shutil.copytree(base, tree, symlinks=True)
    _variant_into(tree, lay, var)
    from gdn_backport.verify import verify_tree

    try:
        report = verify_tree(tree, device=device, scenarios=list(scenarios), heads=heads)
    except Exception as exc:
        return False, f"verify raised {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tree)
    notes = report.error or ", ".join(
        f"{r.name} {'ok' if r.passed else 'FAIL'} {r.max_abs_err:.2g}" for r in report.rows
    )
    return not report.error and bool(report.rows) and not any(r.passed for r in report.rows), notes


# --- the report ------------------------------------------------------------------

COLUMNS = ("variants", "patched-and-verified", "patched (unverified)", "already fixed", "refused")


def _counts(results: Iterable[CaseResult]) -> list[int]:
    rs = list(results)
    ok = [r for r in rs if not r.wrong]
    return [
        len(rs),
        sum(r.got == "patched" and r.verified is True for r in ok),
        sum(r.got == "patched" and r.verified is None for r in ok),
        sum(r.got == "fixed" for r in ok),
        sum(r.got == "refused" for r in ok),
        sum(r.wrong for r in rs),
    ]


def counts_table(results: Sequence[CaseResult]) -> str:
    """Counts per strategy and in total: variants / patched-and-verified /
    patched, not verified in this run / already fixed / refused / wrong."""
    rows: list[list[object]] = []
    for strategy in STRATEGIES:
        part = [r for r in results if r.strategy == strategy]
        if part:
            rows.append([strategy, *_counts(part)])
    rows.append(["total", *_counts(results)])
    return table(["strategy", *COLUMNS, "wrong"], rows)


def render(results: Sequence[CaseResult]) -> str:
    """One line per case, then the counts."""
    rows = [
        (
            r.version,
            r.variant,
            r.strategy,
            str(r.expected),
            r.got,
            {True: "yes", False: "NO", None: "-"}[r.verified],
            f"{r.seconds:.1f}",
            "; ".join(r.problems) or "",
        )
        for r in results
    ]
    head = ["release", "variant", "strategy", "expected", "got", "verified", "s", "problems"]
    return table(head, rows) + "\n\n" + counts_table(results)
