"""``apply`` and ``revert`` over a tree: plan everything, then write or nothing.

``apply`` analyses the tree (its spec paths followed through helpers, in
any file), runs the strategy's codemod on every file that holds an affected
site, analyses the whole tree again with every rewrite in place, and only
if *every* site came out proven does it write: originals go to the records
first, then each staged file replaces its original. An ``unknown`` site, a
codemod refusal, or a file that cannot be written stops the whole run
before anything changes (exit 2).
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import glob
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from gdn_backport import __version__, atomic, locate
from gdn_backport.analysis import Status, Walk
from gdn_backport.codemods import registry
from gdn_backport.codemods.base import Key, Rewrite
from gdn_backport.errors import Refusal, UsageError
from gdn_backport.patchset import Patchset, for_tree
from gdn_backport.records import Record, Records, sha256
from gdn_backport.scan import (
    Site,
    TreeScan,
    analyse_tree,
    relative,
    scan_tree_full,
    sites_of,
    tree_root,
)
from gdn_backport.sites import TreeAnalysis

# A rewrite parses, regenerates and proves the whole module: about a minute
# per MiB on one CPU core (5 MiB took 9 minutes). The largest file of any vLLM
# release is 0.35 MiB. Above this size apply refuses with the reason instead
# of running for minutes; scan and --check read files of any size.
MAX_REWRITE_BYTES = 2 * 1024 * 1024


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
            "refused": [{"path": p, "reason": r} for p, r in self.refused],
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


def _walks_into(analysis: TreeAnalysis, key: str) -> list[Walk]:
    """The walks of the tree's analysis that reach a site function of the
    module ``key`` (from entries anywhere in the tree)."""
    return [
        w
        for _, w in analysis.walks
        if any(c.select is not None and c.select.key[0] == key for c in w.calls)
    ]


# Called with the run so far and every (file, new bytes) once all files are
# proven and before anything is written (in WRITE and DRY_RUN mode); raising
# UsageError stops the run with nothing changed. git and --installed check
# their own preconditions on the exact files here.
BeforeWrite = Callable[[Outcome, list[tuple[Path, bytes]]], None]


def apply_tree(
    path: Path,
    strategy: str = "gather",
    mode: Mode = Mode.WRITE,
    *,
    root: Path | None = None,
    before_write: BeforeWrite | None = None,
    within: str | None = None,
    kernels: Sequence[Path] = (),
) -> Outcome:
    """``root``: the tree paths and records are relative to, when ``path``
    is a folder below it (``--installed``: site-packages for ``vllm/``);
    ``within``: the folder below ``root`` every record must name (``vllm``);
    ``kernels``: files declaring a fork's own kernels (``--kernels``)."""
    root = root or tree_root(path)
    patchset = for_tree(root, kernels)
    if strategy not in patchset.strategies or strategy not in registry.CODEMODS:
        choices = ", ".join(registry.CODEMODS)
        raise UsageError(f"--strategy {strategy}: unknown (choose from {choices})")
    # A writing run holds the tree's lock from its first read to its last
    # write: a second run waits, then plans on what the first one left.
    lock: contextlib.AbstractContextManager[None] = (
        atomic.tree_lock(root) if mode is Mode.WRITE else contextlib.nullcontext()
    )
    with lock:
        return _apply(path, strategy, mode, root, before_write, within, patchset)


def _apply(
    path: Path,
    strategy: str,
    mode: Mode,
    root: Path,
    before_write: BeforeWrite | None,
    within: str | None,
    patchset: Patchset,
) -> Outcome:
    out = Outcome(root)
    # The codemods plan from this analysis: no file is analysed twice.
    scanned = scan_tree_full(path, patchset, root)
    before = scanned.sites
    by_file: dict[str, list[Site]] = {}
    for s in before:
        by_file.setdefault(s.path, []).append(s)
    todo: list[str] = []
    for rel, sites in by_file.items():
        unknown = [s for s in sites if s.status is Status.UNKNOWN]
        if unknown:
            chain = f" ({unknown[0].chain})" if unknown[0].via else ""
            out.refused.append((rel, f"{unknown[0].function}{chain}: {unknown[0].reason}"))
        elif any(s.status is Status.AFFECTED for s in sites):
            todo.append(rel)
    staged: list[Staged] = []
    texts: dict[Path, str] = {}  # tree path -> rewritten text
    rewritten: set[Key] = set()  # the site functions the codemods changed
    if mode is not Mode.CHECK and not out.refused:
        for rel in todo:
            staged_one = _stage(rel, strategy, root, scanned, out)
            if staged_one is not None:
                file, result, item = staged_one
                texts[file] = result.text
                rewritten |= result.sites
                staged.append(item)
    after = before
    if staged and not out.refused:
        after = _prove_tree(path, root, patchset, texts, rewritten, out)
    for s in before:
        out.changes.append(SiteChange(s, _match(after, s), False))
    if before_write is not None and staged and not out.refused and mode is not Mode.CHECK:
        before_write(out, [(file, new) for file, _, _, new in staged])
    if conclude(out, mode, bool(staged)):
        write_staged(root, staged, strategy, patchset.upstream, out, within)
        changed = {relative(file, root) for file in texts}
        for c in out.changes:
            c.changed = c.site.path in changed and c.rewritten.status is not c.site.status
    _leftovers(out, scanned.leftovers, mode)
    return out


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


def _stage(
    rel: str, strategy: str, root: Path, scanned: TreeScan, out: Outcome
) -> tuple[Path, Rewrite, Staged] | None:
    """Rewrite one file with an affected site from the tree's analysis: (its
    tree path, the rewrite, what to write), or None with the refusal added
    to ``out``. The rewrite is proven with the whole tree, afterwards."""
    file = root / rel
    link = scanned.links.get(file)
    dest = file if link is None else _inside(link, root)
    if dest is None:
        why = f"is a symbolic link to {link} outside the tree; patch the target's own tree"
        out.refused.append((rel, why))
        return None
    original = file.read_bytes()
    if len(original) > MAX_REWRITE_BYTES:
        size, limit = len(original) / 2**20, MAX_REWRITE_BYTES / 2**20
        out.refused.append((rel, f"{size:.1f} MiB is too large to rewrite (limit {limit:.0f} MiB)"))
        return None
    text = locate.decode(file, original)
    index = scanned.analysis.index
    module = index.modules.get(rel)
    if module is None or module.text != text:
        raise UsageError(f"{file}: changed on disk while gdn-backport ran")
    codemod = registry.codemod(
        strategy,
        source=text,
        tree=root,
        path=file,
        patchset=index.patchset,
        walks=_walks_into(scanned.analysis, rel),
        module_key=rel,
    )
    try:
        result = codemod.rewrite(cst.parse_module(text))
    except Refusal as exc:
        out.refused.append((rel, exc.reason))
        return None
    except Exception as exc:
        # Whatever went wrong inside the codemod, the file is not written.
        out.refused.append((rel, str(exc)))
        return None
    if result is None or result.text == text:
        raise UsageError(f"{file}: the codemod found nothing to rewrite at an affected site")
    try:
        # The file's own encoding (its PEP 263 declaration, its UTF-8
        # byte-order mark, which ``locate.decode`` strips to parse).
        data = locate.encode(file, result.text, original)
    except Refusal as exc:
        out.refused.append((rel, exc.reason))
        return None
    out.diff += unified_diff(rel, text, result.text)
    return file, result, (dest, relative(dest, root), original, data)


def _prove_tree(
    path: Path,
    root: Path,
    patchset: Patchset,
    texts: dict[Path, str],
    rewritten: set[Key],
    out: Outcome,
) -> list[Site]:
    """The proof, once for every rewrite: each rewritten file compiles, and
    the whole tree analysed again with every rewrite in place has each
    rewritten site aligned and no site left affected or unknown (a helper
    shared across files, a caller in another file). Refuses on ``out``
    otherwise; the sites after."""
    for file, text in texts.items():
        try:
            compile(locate.parse_ast(file, text), str(file), "exec")
        except (SyntaxError, UsageError) as exc:
            out.refused.append((relative(file, root), f"the rewrite does not compile: {exc}"))
    if out.refused:
        return []
    analysis = analyse_tree(path, patchset, texts, root=root)
    for key in sorted(rewritten):
        site = analysis.sites.get(key)
        if site is None:
            out.refused.append(
                (key[0], f"{key[1]}: the rewritten site disappeared from the analysis")
            )
    after = sites_of(analysis)
    for key, s in zip(analysis.sites, after, strict=True):
        if s.status in (Status.AFFECTED, Status.UNKNOWN):
            chain = f" ({s.chain})" if s.via else ""
            if key in rewritten:
                why = f"the rewrite does not prove aligned ({s.status.value}: {s.reason})"
            else:
                why = f"after the rewrite still {s.status.value}: {s.reason}"
            out.refused.append((s.path, f"{s.function}{chain}: {why}"))
    return after


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


def _inside(real: Path, root: Path) -> Path | None:
    """``real`` (a resolved path) as ``root / <path with no link below root>``,
    or None when it lies outside the tree."""
    try:
        rel = real.relative_to(os.path.realpath(root))
    except ValueError:
        return None
    return root / rel


def _match(after: list[Site], site: Site) -> Site:
    """The same function in the rewritten file (lines may have moved)."""
    same = [s for s in after if s.function == site.function and s.path == site.path]
    return min(same, key=lambda s: abs(s.line - site.line)) if same else site


def _text(path: Path, data: bytes) -> str:
    """Source text for a diff; undecodable bytes shown escaped, never an error."""
    try:
        return locate.decode(path, data)
    except UsageError:
        return data.decode("utf-8", "backslashreplace")


def _replace_all(files: list[tuple[Path, bytes, bytes]]) -> None:
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
        for file, current, new in files:
            if file.read_bytes() != current:
                raise UsageError(f"{file}: changed on disk while gdn-backport ran")
            # A run killed between staging and renaming left its temporary
            # beside the file (the file itself whole); we hold the lock now.
            for stale in file.parent.glob(f".{glob.escape(file.name)}.*.tmp"):
                stale.unlink(missing_ok=True)
            temps.append((atomic.stage(file, new), file))
        for (tmp, file), (_, current, _) in zip(temps, files, strict=True):
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


def write_staged(
    root: Path,
    staged: list[Staged],
    strategy: str,
    upstream: str,
    out: Outcome,
    within: str | None = None,
) -> None:
    for file, _, _, _ in staged:
        atomic.check_writable(file)
    with atomic.tree_lock(root):
        records = Records(root, within)
        # The records go first: a process killed between the renames below
        # leaves each file whole (old or new) and revert able to undo it. A
        # record is keyed by the bytes we write, so earlier records (another
        # branch's patched file, a file since replaced by a reinstall) stay.
        added: list[tuple[Record, Record | None]] = []
        try:
            for _, rel, original, new in staged:
                rec = Record(rel, sha256(original), sha256(new), strategy, upstream, __version__)
                added.append((rec, records.add(rec, original)))
            records.save()
        except OSError as exc:
            why = f"cannot keep the originals ({exc.strerror})"
            raise UsageError(f"{records.state}: {why}") from exc
        try:
            _replace_all([(file, original, new) for file, _, original, new in staged])
        except UsageError:
            _forget(records, added, staged)
            raise
        records.collect()
        out.written.extend(relative(file, root) for file, _, _, _ in staged)
    undo = shlex.join(["gdn-backport", "revert", str(root)])
    out.message = f"patched {len(out.written)} file(s); undo with `{undo}`"


def _forget(
    records: Records, added: list[tuple[Record, Record | None]], staged: list[Staged]
) -> None:
    """After a failed write: drop this run's record of each file that holds
    its original bytes again (a file left with the new bytes keeps its
    record, whatever else fails), put back what a record replaced."""
    for (rec, replaced), (file, _, original, _) in zip(added, staged, strict=True):
        try:
            back = file.read_bytes() == original
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
    found += locate.state_leftovers(root) + locate.leftovers_beside(root / r for r in wanted)
    if not wanted:
        out.message = "nothing to revert: no gdn-backport record in this tree"
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
    patchset = for_tree(root)
    for file, _, current, _, _ in restore:
        try:
            was = {file: locate.decode(file, current)}
            sites_was = sites_of(analyse_tree(file, patchset, was, root=root))
            sites_now = sites_of(analyse_tree(file, patchset, root=root))
        except UsageError:
            continue
        out.changes.extend(SiteChange(s, _match(sites_now, s), True) for s in sites_was)
    out.message = f"restored {len(out.written)} file(s) to their original bytes"
    return out
