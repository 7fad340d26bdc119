"""``apply``/``--check`` over several patchsets: plan them all, then write.

Each patchset plans, proves and writes through its own engine
(:mod:`gdn_backport.fixes`), under one tree lock. A writing run with more
than one patchset first plans every one of them (a dry run, proofs
included); any refusal stops the run before the first write, so a tree is
never left with one fix in and the other refused. Then each writes in turn,
the later planning on what the earlier wrote; their records carry each
patchset's upstream, which is how ``revert --patchset`` picks them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

from gdn_backport import atomic
from gdn_backport.engine import BeforeWrite, Mode, Outcome
from gdn_backport.fixes import Fix
from gdn_backport.scan import tree_root

Results = list[tuple[Fix, Outcome]]


def apply_fixes(
    path: Path,
    fixes: Sequence[Fix],
    strategy: str | None = None,
    mode: Mode = Mode.WRITE,
    *,
    root: Path | None = None,
    within: str | None = None,
    kernels: Sequence[Path] = (),
    before_write: Callable[[Fix], BeforeWrite | None] | None = None,
) -> Results:
    """Each fix's outcome, in order. ``strategy``: where a patchset has it
    (``kernel`` is pr51812's), else the patchset's own."""
    root = root or tree_root(path)
    lock: contextlib.AbstractContextManager[None] = (
        atomic.tree_lock(root) if mode is Mode.WRITE else contextlib.nullcontext()
    )

    def run(fix: Fix, how: Mode, final: bool = True) -> Outcome:
        hook = before_write(fix) if before_write is not None and final else None
        return fix.engine.apply_tree(
            path,
            fix.strategy(strategy),
            how,
            root=root,
            before_write=hook,
            within=within,
            kernels=kernels,
        )

    with lock:
        if mode is Mode.WRITE and len(fixes) > 1:
            plans = [(fix, run(fix, Mode.DRY_RUN, final=False)) for fix in fixes]
            if any(out.refused for _, out in plans):
                for _, out in plans:
                    if not out.refused and out.diff:
                        out.diff = ""
                        out.message = "not written: another patchset refused"
                return plans
        results: Results = []
        for fix in fixes:
            out = run(fix, mode)
            results.append((fix, out))
            if out.refused:
                break  # what the earlier patchsets wrote stands, with its records
        return results


def merged(results: Results, root: Path) -> Outcome:
    """One outcome for the CLI: every site, diff and refusal. Messages and
    refusals name their patchset where more than one patchset found
    something in the tree; a patchset with no site says nothing."""
    out = Outcome(root)
    spoke = [(fix, one) for fix, one in results if one.changes or one.refused] or results[:1]
    several = len(spoke) > 1
    for fix, one in results:
        out.changes += one.changes
        out.diff += one.diff
        out.refused += [(p, f"{fix.id}: {r}" if several else r) for p, r in one.refused]
        out.written += one.written
        out.leftovers = sorted({*out.leftovers, *one.leftovers})
        out.leftovers_removed = out.leftovers_removed or one.leftovers_removed
    if not several:
        out.message = spoke[0][1].message if spoke else ""
    elif out.refused and not out.written:
        fine = [fix.id for fix, one in results if not one.refused and one.diff]
        alone = " ".join(f"--patchset {name}" for name in fine)
        out.message = "refused: nothing was changed" + (
            f" (the others apply alone: {alone})" if fine else ""
        )
    else:
        out.message = "; ".join(f"{fix.id}: {one.message}" for fix, one in spoke)
    return out
