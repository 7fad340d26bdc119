"""``apply`` and ``revert`` over a tree: every patchset plans, then all is written or nothing.

Each chosen patchset plans its fix over the run's :class:`~gdn_backport.tree.Tree`
(analysed, rewritten, proven; nothing written) and returns a :class:`Plan`; a
later patchset reads what an earlier one rewrote (the tree's overlay). Only
when every plan went through, every file of every plan can be written, and the
callers' own checks (``before_write``: git, ``--installed``) passed, is
anything written: the originals go to the records first, then every file is
replaced, all or none, under one tree lock held from the first read to the
last write. A refusal anywhere leaves every file of every patchset as it was.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import glob
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport import __version__, ahead, atomic, cache, files
from gdn_backport.errors import UsageError
from gdn_backport.records import Record, Records, sha256
from gdn_backport.result import Failure, Success, attempt
from gdn_backport.site import Site, Status
from gdn_backport.tree import Tree, relative, tree_root

if TYPE_CHECKING:
    from gdn_backport.context import Vllm
    from gdn_backport.registry import Patchset

# A file a run will write: (the file, its path in the records: no link below
# the tree, the original bytes, the new bytes).
Staged = tuple[Path, str, bytes, bytes]


class Mode(str, enum.Enum):
    WRITE = "write"
    DRY_RUN = "dry_run"
    CHECK = "check"


@dataclass
class SiteChange:
    """One site through a run: as found, as the rewrite leaves it, on disk."""

    site: Site  # as found before the run
    rewritten: Site  # as the rewrite leaves it (``site`` itself if untouched)
    changed: bool  # the file on disk was changed by this run

    @property
    def now(self) -> Site:
        return self.rewritten if self.changed else self.site

    @property
    def status(self) -> Status:
        return self.now.status

    def to_json(self) -> dict[str, object]:
        return {
            **self.now.to_json(),
            "status_before": self.site.status.value,
            "status_rewritten": self.rewritten.status.value,
            "changed": self.changed,
        }


@dataclass
class Outcome:
    tree: Path
    changes: list[SiteChange] = field(default_factory=list)
    diff: str = ""
    refused: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    written: list[str] = field(default_factory=list)
    message: str = ""
    # Temporaries an interrupted run left (tree-relative); removed by a
    # writing run that went through (under the lock), else only reported.
    leftovers: list[str] = field(default_factory=list)
    leftovers_removed: bool = False
    # A refused path -> the traceback of the internal error refused there
    # (--json carries it; GDN_BACKPORT_TRACEBACK=1 prints it).
    tracebacks: dict[str, str] = field(default_factory=dict)

    def refuse(self, path: str, failure: Failure) -> None:
        """Refuse ``path`` for ``failure``'s reason, keeping its traceback."""
        self.refused.append((path, failure.reason))
        if failure.traceback is not None:
            self.tracebacks[path] = failure.traceback

    @property
    def exit_code(self) -> int:
        if self.refused:
            return 2
        return 1 if any(c.status is Status.AFFECTED for c in self.changes) else 0

    def to_json(self) -> dict[str, object]:
        return {
            "tree": str(self.tree),
            "sites": [c.to_json() for c in self.changes],
            "diff": self.diff,
            "refused": [
                {"path": p, "reason": r}
                | ({"traceback": self.tracebacks[p]} if p in self.tracebacks else {})
                for p, r in self.refused
            ],
            "written": self.written,
            "message": self.message,
            "exit_code": self.exit_code,
            "leftovers": self.leftovers,
            "leftovers_removed": self.leftovers_removed,
        }


def unified_diff(rel: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{rel}", f"b/{rel}"
        )
    )


# Called once every plan is proven and before anything is written (WRITE and
# DRY_RUN mode), with each patchset that has files to write, in order: (the
# patchset, its outcome, every (file, new bytes)). Raising UsageError stops
# the run with nothing changed: git and --installed check their own
# preconditions on the exact files here (git makes its commit objects).
BeforeWrite = Callable[[list[tuple["Patchset", Outcome, list[tuple[Path, bytes]]]]], None]


def conclude(out: Outcome, mode: Mode, staged: bool) -> bool:
    """The run's message from what it found; True when it goes on to write
    (every patchset's engine ends its run here)."""
    if out.refused:
        # Fail closed: one file we cannot prove stops every write.
        out.diff = ""
        out.message = "refused: nothing was changed"
        return False
    if mode is Mode.CHECK and out.exit_code == 1:
        affected = [c.site for c in out.changes if c.status is Status.AFFECTED]
        where = ", ".join(f"{s.path}:{s.line} {s.function}" for s in affected)
        out.message = f"check failed: {len(affected)} affected site(s): {where}"
        return False
    if not staged:
        out.message = "nothing to do: no affected site"
        return False
    if mode is Mode.DRY_RUN:
        out.message = "dry run: nothing was changed"
        return False
    return mode is Mode.WRITE


def _leftovers(out: Outcome, found: list[Path], mode: Mode) -> None:
    """Report what an interrupted run left; a writing run that went through
    (it holds the lock: nothing else of ours is writing) removes it."""
    if mode is Mode.WRITE and not out.refused and found:
        left = []
        for p in found:
            try:
                p.unlink(missing_ok=True)
            except OSError:
                left.append(p)
        out.leftovers_removed = not left
        found = left or found
    out.leftovers = [relative(p, out.tree) for p in found]


def _match(after: list[Site], site: Site) -> Site:
    """The same function in the other version of its file (lines may move)."""
    same = [s for s in after if s.function == site.function and s.path == site.path]
    return min(same, key=lambda s: abs(s.line - site.line)) if same else site


def _text(path: Path, data: bytes) -> str:
    """Source text for a diff; undecodable bytes shown escaped, never an error."""
    try:
        return files.decode(path, data)
    except UsageError:
        return data.decode("utf-8", "backslashreplace")


def _replace_all(items: list[tuple[Path, bytes, bytes]]) -> None:
    """Replace each ``(file, current, new)`` atomically, all or none.

    Every new file is staged (written and fsync'ed beside its original)
    before the first rename. If a rename fails (EROFS, EACCES, EPERM on an
    immutable file), the files already replaced get their ``current`` bytes
    back, so a run leaves either every file new or every file as it was.
    UsageError either way; if even putting a file back fails, it says so
    (that file then holds the new bytes, and its record stays).
    """
    temps: list[tuple[Path, Path]] = []
    done: list[tuple[Path, bytes]] = []
    try:
        for file, current, new in items:
            if file.read_bytes() != current:
                raise UsageError(f"{file}: changed on disk while gdn-backport ran")
            # A run killed between staging and renaming left its temporary
            # beside the file (the file itself whole); we hold the lock now.
            for stale in file.parent.glob(f".{glob.escape(file.name)}.*.tmp"):
                stale.unlink(missing_ok=True)
            temps.append((atomic.stage(file, new), file))
        for (tmp, file), (_, current, _) in zip(temps, items, strict=True):
            try:
                atomic.commit(tmp, file)
            except OSError as exc:
                why = f"{file}: cannot write ({exc.strerror})"
                for undo, old in reversed(done):
                    try:
                        atomic.write_atomic(undo, old)
                    except (OSError, UsageError) as again:
                        why += f"; {undo} keeps the new bytes (cannot put it back: {again})"
                raise UsageError(why) from exc
            done.append((file, current))
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)


@dataclass
class Plan:
    """One patchset's run over the tree before anything is written: its
    outcome (sites, diff, refusals, message), the files it would write, and
    the tree paths of the sites those rewrites change."""

    outcome: Outcome
    staged: list[Staged] = field(default_factory=list)
    strategy: str = ""
    # Tree path -> rewritten text (what a later patchset of the run reads).
    texts: dict[Path, str] = field(default_factory=dict)


def check_writable(staged: Sequence[Staged], root: Path) -> None:
    """Before the first write: every file every plan will write opens
    ``r+b``, a file can be made beside it (the atomic rename), and the
    records folder can be written. UsageError names the first that cannot,
    so a run never writes one patchset's files and then fails on another's."""
    for file in dict.fromkeys(item[0] for item in staged):
        atomic.check_writable(file)
    atomic.check_folder(root, root / atomic.STATE_DIR)


def write_plans(
    root: Path, plans: Sequence[tuple[str, Plan]], within: str | None = None
) -> list[str]:
    """Write every plan (``(upstream, plan)``, in the order they were made:
    a later plan's original of a file is an earlier plan's new bytes), all
    files or none; their records first. The tree paths written."""
    staged = [item for _, plan in plans for item in plan.staged]
    check_writable(staged, root)
    with atomic.tree_lock(root):
        records = Records(root, within)
        # The records go first: a process killed between the renames below
        # leaves each file whole (old or new) and revert able to undo it. A
        # record is keyed by the bytes we write, so earlier records (another
        # branch's patched file, a file since replaced by a reinstall) stay.
        # Two patchsets on one file: two records, one layer each.
        added: list[tuple[Record, Record | None, Staged]] = []
        try:
            for upstream, plan in plans:
                for item in plan.staged:
                    _, rel, original, new = item
                    rec = Record(
                        rel, sha256(original), sha256(new), plan.strategy, upstream, __version__
                    )
                    added.append((rec, records.add(rec, original), item))
            records.save()
        except OSError as exc:
            why = f"cannot keep the originals ({exc.strerror})"
            raise UsageError(f"{records.state}: {why}") from exc
        # Each file once: from what is on disk to the last plan's bytes.
        final: dict[Path, tuple[bytes, bytes]] = {}
        for file, _, original, new in staged:
            first = final[file][0] if file in final else original
            final[file] = (first, new)
        try:
            _replace_all([(file, old, new) for file, (old, new) in final.items()])
        except UsageError:
            _forget(records, added)
            raise
        records.collect()
    return list(dict.fromkeys(relative(file, root) for file in final))


def _undo_line(root: Path) -> str:
    return f"undo with `{shlex.join(['gdn-backport', 'revert', str(root)])}`"


Results = list[tuple["Patchset", Outcome]]


def leftovers_of(tree: Tree) -> list[Path]:
    """Temporaries an interrupted run of ours left in the tree."""
    return tree.leftovers()


def apply(
    path: Path,
    chosen: Sequence[Patchset],
    strategy: str | None = None,
    mode: Mode = Mode.WRITE,
    *,
    root: Path | None = None,
    within: str | None = None,
    kernels: Sequence[Path] = (),
    before_write: BeforeWrite | None = None,
    vllm: Vllm | None = None,
) -> Results:
    """Each patchset's outcome, in order: every one planned before anything
    is written; in WRITE mode a refusal of one means no file of any is
    changed. ``strategy``: where a patchset has it (e.g. ``kernel``), else
    the patchset's own. ``root``: the tree paths and records are relative to
    (``--installed``: site-packages); ``within``: the folder every record
    must name (``vllm``); ``kernels``: a fork's kernel declarations;
    ``vllm``: the vLLM a plugin's tree is read against (never written)."""
    tree = Tree.of(path, root, kernels, within, vllm)
    # A writing run holds the tree's lock from its first read to its last
    # write: a second run waits, then plans on what the first one left.
    lock: contextlib.AbstractContextManager[None] = (
        atomic.tree_lock(tree.root) if mode is Mode.WRITE else contextlib.nullcontext()
    )
    # Each proof analyses the tree again: only the rewritten texts anew.
    with lock, cache.run():
        plans = _plan_all(tree, chosen, strategy, mode)
        found = leftovers_of(tree)
        results: Results = [(ps, plan.outcome) for ps, plan in plans]
        refused = any(out.refused for _, out in results)
        if refused and len(plans) > 1:
            for _, out in results:
                if not out.refused and out.diff:
                    out.diff = ""
                    out.message = "not written: another patchset refused"
        writing = [(ps, plan) for ps, plan in plans if plan.staged]
        if not refused and writing and mode is not Mode.CHECK and before_write is not None:
            before_write(
                [
                    (ps, plan.outcome, [(file, new) for file, _, _, new in plan.staged])
                    for ps, plan in writing
                ]
            )
        if mode is Mode.WRITE and not refused:
            if writing:
                write_plans(tree.root, [(ps.info.upstream, plan) for ps, plan in writing], within)
                for _, plan in writing:
                    out = plan.outcome
                    out.written = list(
                        dict.fromkeys(relative(file, tree.root) for file, *_ in plan.staged)
                    )
                    out.message = f"patched {len(out.written)} file(s); {_undo_line(tree.root)}"
                    changed = {relative(file, tree.root) for file in plan.texts}
                    for c in out.changes:
                        c.changed = (
                            c.site.path in changed and c.rewritten.status is not c.site.status
                        )
            _clean_leftovers(results, found)
        else:
            for _, out in results:
                out.leftovers = [relative(p, tree.root) for p in found]
        return results


def _plan_all(
    tree: Tree, chosen: Sequence[Patchset], strategy: str | None, mode: Mode
) -> list[tuple[Patchset, Plan]]:
    """Each patchset's plan in turn, a later one reading what the earlier
    ones rewrote (the overlay). The later ones plan in a child beside the
    first (:mod:`gdn_backport.ahead`), on the tree as the run found it:
    their plans are the run's where the first rewrote nothing, or nothing
    they read (:func:`_stands`); else they plan again here, on its rewrites
    (what the child analysed is kept: named by content, not analysed again)."""

    def each(patchsets: Sequence[Patchset]) -> list[tuple[Plan, list[str]]]:
        done = []
        for ps in patchsets:
            before = len(tree.notes)
            plan = _plan(ps, tree, ps.strategy(strategy), mode)
            tree.overlay.update(plan.texts)
            done.append((plan, tree.notes[before:]))
        return done

    later = list(chosen[1:])
    ahead_of = (lambda: each(later)) if later and forkable(tree) else None
    # A later plan can take longer than the first's (a rewrite, its proof):
    # the child feeds the first only after it.
    first, got = ahead.beside(
        lambda: each(chosen[:1]), ahead_of, _prepare(tree, chosen), feed_first=ahead_of is None
    )
    rest = got[0] if got is not None and _stands(tree, later) else None
    if rest is None:
        rest = each(later)
    else:
        for plan, notes in rest:
            tree.overlay.update(plan.texts)
            tree.notes += notes
    return [(ps, plan) for ps, (plan, _) in zip(chosen, [*first, *rest], strict=True)]


def _stands(tree: Tree, later: Sequence[Patchset]) -> bool:
    """Plans made on the tree as the run found it are the run's: the first
    patchset rewrote nothing, or nothing the later ones read."""
    if not tree.overlay:
        return True
    try:
        changed = {file: (tree.read(file), text) for file, text in tree.overlay.items()}
    except UsageError:
        return False
    return all(ps.unaffected_by(changed) for ps in later)


def _prepare(tree: Tree, chosen: Sequence[Patchset]) -> ahead.Prepare | None:
    """What the child does ahead for the first patchset, after the later
    ones' work (its values are named by their input: right on any tree)."""
    return chosen[0].prepare(tree) if chosen else None


def forkable(tree: Tree) -> bool:
    """A child's work on this tree can stand for the run's: no patchset
    reads a vLLM beside it (what it read and noted of that vLLM is the
    run's shared state, which a child's copy would not hand back)."""
    return tree.vllm is None or tree.vllm.package(tree.root) is None


def scan(tree: Tree, chosen: Sequence[Patchset]) -> list[Site]:
    """Every chosen patchset's sites, in order; the later ones scan in a
    child beside the first (:mod:`gdn_backport.ahead`): a scan reads the
    tree alone, so theirs are the run's."""

    def each(patchsets: Sequence[Patchset]) -> tuple[list[Site], list[str]]:
        before = len(tree.notes)
        sites = [s for ps in patchsets for s in ps.scan(tree)]
        return sites, tree.notes[before:]

    later = list(chosen[1:])
    ahead_of = (lambda: each(later)) if later and forkable(tree) else None
    (sites, _), got = ahead.beside(lambda: each(chosen[:1]), ahead_of, _prepare(tree, chosen))
    if got is None:
        return sites + each(later)[0]  # its notes went onto the tree as it ran
    rest, notes = got[0]
    tree.notes += notes
    return sites + rest


def _plan(ps: Patchset, tree: Tree, strategy: str, mode: Mode) -> Plan:
    """``ps``'s plan; one that raised what nobody planned for is that
    plan's refusal (its traceback kept), never a crash of the run."""
    tried = attempt(lambda: ps.plan(tree, strategy, mode), f"the plan of patchset {ps.info.id}")
    if isinstance(tried, Success):
        return tried.value
    failure = tried if isinstance(tried, Failure) else Failure(tried.reason)
    out = Outcome(tree.root)
    out.refuse(relative(tree.path, tree.root) if tree.path != tree.root else ".", failure)
    conclude(out, mode, False)
    return Plan(out, strategy=strategy)


def _clean_leftovers(results: Results, found: list[Path]) -> None:
    """A writing run that went through (it holds the lock: nothing else of
    ours is writing) removes what an interrupted run left."""
    left = []
    for p in found:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            left.append(p)
    for _, out in results:
        out.leftovers = [relative(p, out.tree) for p in (left or found)]
        out.leftovers_removed = bool(found) and not left


def merged(results: Results, root: Path) -> Outcome:
    """One outcome for the CLI: every site, diff and refusal. Messages and
    refusals name their patchset where more than one patchset found
    something in the tree; a patchset with no site says nothing."""
    out = Outcome(root)
    spoke = [(ps, one) for ps, one in results if one.changes or one.refused] or results[:1]
    several = len(spoke) > 1
    for ps, one in results:
        out.changes += one.changes
        out.diff += one.diff
        out.refused += [(p, f"{ps.info.id}: {r}" if several else r) for p, r in one.refused]
        out.tracebacks.update(one.tracebacks)
        out.written += [w for w in one.written if w not in out.written]
        out.leftovers = sorted({*out.leftovers, *one.leftovers})
        out.leftovers_removed = out.leftovers_removed or one.leftovers_removed
    if not several:
        out.message = spoke[0][1].message if spoke else ""
    elif out.refused and not out.written:
        fine = [ps.info.id for ps, one in results if not one.refused and one.diff]
        alone = " ".join(f"--patchset {name}" for name in fine)
        out.message = "refused: nothing was changed" + (
            f" (the others apply alone: {alone})" if fine else ""
        )
    else:
        out.message = "; ".join(f"{ps.info.id}: {one.message}" for ps, one in spoke)
    return out


def _forget(records: Records, added: list[tuple[Record, Record | None, Staged]]) -> None:
    """After a failed write: drop this run's records of each file that holds
    what it held before the run again (a file left with the new bytes keeps
    its records, whatever else fails), put back what a record replaced."""
    before: dict[Path, bytes] = {}
    for _, _, (file, _, original, _) in added:
        before.setdefault(file, original)
    for rec, replaced, (file, _, _, _) in added:
        try:
            back = file.read_bytes() == before[file]
        except OSError:
            back = False
        if back:
            records.remove(rec)
            if replaced is not None:
                records.put_back(replaced)
    with contextlib.suppress(OSError, UsageError):
        records.save()


def revert_tree(
    path: Path,
    mode: Mode = Mode.WRITE,
    *,
    root: Path | None = None,
    within: str | None = None,
    upstreams: frozenset[str] | None = None,
) -> Outcome:
    """Restore every recorded file that holds the bytes a record says we
    wrote; a file that holds its original keeps its record (another
    checkout may have it patched). ``within``: see :class:`Records`;
    ``upstreams``: only the records of these patchsets (``--patchset``)."""
    root = root or tree_root(path)
    if mode is not Mode.WRITE or not (root / atomic.STATE_DIR).exists():
        # No records folder, no record: nothing to lock for.
        return _revert(path, mode, root, within, upstreams)
    with atomic.tree_lock(root):
        out = _revert(path, mode, root, within, upstreams)
        # Two patchsets on one file: each pass takes one layer off.
        for _ in range(8):
            if out.refused or not out.written:
                break
            more = _revert(path, mode, root, within, upstreams)
            if more.refused or not more.written:
                break
            out.written += more.written
            out.diff += more.diff
            out.changes += more.changes
            out.message = f"restored {len(out.written)} file(s) to their original bytes"
        return out


def _revert(
    path: Path, mode: Mode, root: Path, within: str | None, upstreams: frozenset[str] | None
) -> Outcome:
    found: list[Path] = []
    out = _revert_files(path, mode, root, within, found, upstreams)
    _leftovers(out, found, mode)
    return out


def _names(upstreams: frozenset[str]) -> str:
    """Patchset ids for records' upstreams (the upstream where none claims it)."""
    from gdn_backport import registry

    ids = ((registry.by_upstream(u), u) for u in sorted(upstreams))
    return ", ".join(p.info.id if p else u for p, u in ids)


def _revert_files(
    path: Path,
    mode: Mode,
    root: Path,
    within: str | None,
    found: list[Path],
    upstreams: frozenset[str] | None = None,
) -> Outcome:
    out = Outcome(root)
    records = Records(root, within)
    only = relative(path, root) if path.is_file() else None
    wanted = [
        rel
        for rel in records.paths()
        if (only is None or rel == only)
        and (upstreams is None or any(r.upstream in upstreams for r in records.for_path(rel)))
    ]
    # What a killed apply or revert left: beside the files it wrote (every
    # one has a record) and in the records folder.
    found += files.state_leftovers(root) + files.leftovers_beside(root / r for r in wanted)
    if not wanted:
        out.message = "nothing to revert: no gdn-backport record in this tree"
        others = sorted({r.upstream for rel in records.paths() for r in records.for_path(rel)})
        if upstreams is not None and others:
            # ``revert --patchset X`` where only other patchsets' records are left.
            out.message = (
                f"nothing to revert: no record of {_names(upstreams)} in this tree "
                f"(the records of {_names(frozenset(others))} remain)"
            )
        return out
    restore: list[tuple[Path, str, bytes, bytes, Record]] = []
    kept = 0
    for rel in wanted:
        file = root / rel
        try:
            current = file.read_bytes()
        except FileNotFoundError:
            out.refused.append((rel, "patched file is gone; nothing to restore it over"))
            continue
        except OSError as exc:
            out.refused.append((rel, f"cannot read ({exc.strerror})"))
            continue
        digest = sha256(current)
        rec = records.matching(rel, digest)
        if rec is not None and upstreams is not None and rec.upstream not in upstreams:
            why = f"holds the patch of {rec.upstream} on top; revert that patchset first"
            out.refused.append((rel, why))
            continue
        if rec is None:
            if any(r.original_sha256 == digest for r in records.for_path(rel)):
                kept += 1  # the original is there (reverted, or another checkout)
                continue
            out.refused.append((rel, "changed since gdn-backport patched it; not restoring"))
            continue
        original = records.original(rec)
        out.diff += unified_diff(rel, _text(file, current), _text(file, original))
        restore.append((file, rel, current, original, rec))
    if out.refused:
        out.message = "refused: nothing was changed"
        out.diff = ""
        return out
    if not restore:
        out.message = (
            f"nothing to revert: {kept} recorded file(s) hold their original bytes "
            "(their records are kept for a checkout where they are patched)"
        )
        return out
    if mode is not Mode.WRITE:
        out.message = "dry run: nothing was changed"
        return out
    for file, _, _, _, _ in restore:
        atomic.check_writable(file)
    with atomic.tree_lock(root):
        _replace_all([(file, current, original) for file, _, current, original, _ in restore])
        out.written.extend(rel for _, rel, _, _, _ in restore)
        # The files first: killed here, a record whose file holds its
        # original is harmless.
        for _, _, _, _, rec in restore:
            records.remove(rec)
        records.save()
        records.collect()
    # Report the sites of the restored files as they were and are now (the
    # restore is done: a file that cannot be analysed is just not reported).
    from gdn_backport import registry

    chosen = [p for p in registry.discover() if upstreams is None or p.info.upstream in upstreams]
    for file, _, current, _, _ in restore:
        for ps in chosen:
            try:
                was = Tree.of(file, root)
                was.overlay[file] = files.decode(file, current)
                sites_was = ps.scan(was)
                sites_now = ps.scan(Tree.of(file, root))
            except UsageError:
                continue
            out.changes.extend(SiteChange(s, _match(sites_now, s), True) for s in sites_was)
    out.message = f"restored {len(out.written)} file(s) to their original bytes"
    return out
