"""``apply`` and ``revert`` over a tree: plan everything, then write or nothing.

``apply`` scans, runs the strategy's codemod on every file with an affected
site, and only if *every* file came out proven does it write: originals go
to the records first, then each staged file replaces its original. A file
with an ``unknown`` site, a codemod refusal, or a file that cannot be
written stops the whole run before anything changes (exit 2).
"""

from __future__ import annotations

import difflib
import enum
import glob
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.codemod import SkipFile

from gdn_backport import __version__, atomic, locate
from gdn_backport.analysis import Status
from gdn_backport.codemods import registry
from gdn_backport.codemods.base import Entry
from gdn_backport.errors import UsageError
from gdn_backport.patchset import Patchset, for_tree
from gdn_backport.records import Record, Records, sha256
from gdn_backport.scan import Site, analyse_tree, relative, sites_of, tree_root
from gdn_backport.sites import TreeAnalysis

# A rewrite parses, regenerates and proves the whole module: about a minute
# per MiB on one CPU core (5 MiB took 9 minutes). The largest file of any vLLM
# release is 0.35 MiB. Above this size apply refuses with the reason instead
# of running for minutes; scan and --check read files of any size.
MAX_REWRITE_BYTES = 2 * 1024 * 1024


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
        }


def _diff(rel: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{rel}", f"b/{rel}"
        )
    )


def _rewrite(
    strategy: str,
    path: Path,
    text: str,
    root: Path,
    patchset: Patchset,
    entries: list[Entry],
) -> str | None:
    """The rewritten source, None if nothing to do; UsageError on refusal.

    The same steps as ``libcst.codemod.transform_module``, minus a second
    code generation: the codemod hands back the text it proved.
    """
    codemod = registry.codemod(
        strategy, source=text, tree=root, path=path, patchset=patchset, entries=entries
    )
    try:
        new_tree = codemod.transform_module(cst.parse_module(text))
    except SkipFile:
        return None
    except Exception as exc:
        # Whatever went wrong inside the codemod, the file is not written.
        raise UsageError(f"{path}: refused: {exc}") from exc
    rewritten = getattr(codemod, "rewritten", None)
    return rewritten if isinstance(rewritten, str) else new_tree.code


# Called with the run so far and every (file, new bytes) once all files are
# proven and before anything is written (in WRITE and DRY_RUN mode); raising
# UsageError stops the run with nothing changed. git and --installed check
# their own preconditions on the exact files here.
BeforeWrite = Callable[[Outcome, list[tuple[Path, bytes]]], None]


def _entries(analysis: TreeAnalysis, rel: str) -> list[Entry]:
    """The entry functions whose walks reach a site function of ``rel``."""
    found: list[Entry] = []
    for fn, walk in analysis.walks:
        if any(c.select is not None and c.select.key[0] == rel for c in walk.calls):
            entry = (fn.module.path, fn.qualname, fn.occurrence)
            if entry not in found:
                found.append(entry)
    return found


def apply_tree(
    path: Path,
    strategy: str = "gather",
    mode: Mode = Mode.WRITE,
    *,
    root: Path | None = None,
    before_write: BeforeWrite | None = None,
    kernels: Sequence[Path] = (),
) -> Outcome:
    """``root``: the tree paths and records are relative to, when ``path``
    is a folder below it (``--installed``: site-packages for ``vllm/``);
    ``kernels``: files declaring a fork's own kernels (``--kernels``)."""
    root = root or tree_root(path)
    patchset = for_tree(root, kernels)
    if strategy not in patchset.strategies or strategy not in registry.CODEMODS:
        choices = ", ".join(registry.CODEMODS)
        raise UsageError(f"--strategy {strategy}: unknown (choose from {choices})")
    out = Outcome(root)
    analysis = analyse_tree(path, patchset, root=root)
    before = sites_of(analysis)
    by_file: dict[str, list[Site]] = {}
    for s in before:
        by_file.setdefault(s.path, []).append(s)
    staged: list[tuple[Path, str, bytes, bytes]] = []  # (file, rel, original, new)
    todo: list[str] = []
    for rel, sites in by_file.items():
        unknown = [s for s in sites if s.status is Status.UNKNOWN]
        if unknown:
            chain = f" ({unknown[0].chain})" if unknown[0].via else ""
            out.refused.append((rel, f"{unknown[0].function}{chain}: {unknown[0].reason}"))
        elif any(s.status is Status.AFFECTED for s in sites):
            todo.append(rel)
    if mode is not Mode.CHECK and not out.refused:
        for rel in todo:
            file = root / rel
            original = file.read_bytes()
            if len(original) > MAX_REWRITE_BYTES:
                size, limit = len(original) / 2**20, MAX_REWRITE_BYTES / 2**20
                out.refused.append(
                    (rel, f"{size:.1f} MiB is too large to rewrite (limit {limit:.0f} MiB)")
                )
                continue
            text = locate.decode(file, original)
            try:
                new = _rewrite(strategy, file, text, root, patchset, _entries(analysis, rel))
            except UsageError as exc:
                out.refused.append((rel, str(exc).split(": refused: ", 1)[-1]))
                continue
            if new is None or new == text:
                raise UsageError(
                    f"{file}: the codemod found nothing to rewrite at an affected site"
                )
            out.diff += _diff(rel, text, new)
            # Keep a UTF-8 byte-order mark (``locate.decode`` strips it to parse).
            bom = locate.BOM if original.startswith(locate.BOM) else b""
            staged.append((file, rel, original, bom + new.encode("utf-8")))
    after_sites = before
    if staged and not out.refused:
        after_sites = _prove_tree(path, root, patchset, staged, out)
    for s in before:
        out.changes.append(SiteChange(s, _match(after_sites, s), False))
    if before_write is not None and staged and not out.refused and mode is not Mode.CHECK:
        before_write(out, [(file, new) for file, _, _, new in staged])
    if out.refused:
        # Fail closed: one file we cannot prove stops every write.
        out.diff = ""
        out.message = "refused: nothing was changed"
    elif not staged:
        out.message = "nothing to do: no affected site"
    elif mode is Mode.DRY_RUN:
        out.message = "dry run: nothing was changed"
    elif mode is Mode.WRITE:
        _write(root, staged, strategy, patchset.upstream, out)
        for c in out.changes:
            c.changed = c.site.path in out.written and c.rewritten.status is not c.site.status
    return out


def _prove_tree(
    path: Path,
    root: Path,
    patchset: Patchset,
    staged: list[tuple[Path, str, bytes, bytes]],
    out: Outcome,
) -> list[Site]:
    """The whole tree analysed again with every rewrite in place: no site may
    be left affected or unknown (a helper shared across files, a caller in
    another file). Refuses on ``out`` otherwise; the sites after."""
    overrides = {file: locate.decode(file, new) for file, _, _, new in staged}
    after = sites_of(analyse_tree(path, patchset, overrides, root=root))
    for s in after:
        if s.status in (Status.AFFECTED, Status.UNKNOWN):
            chain = f" ({s.chain})" if s.via else ""
            why = f"after the rewrite still {s.status.value}: {s.reason}"
            out.refused.append((s.path, f"{s.function}{chain}: {why}"))
    return after


def _match(after: list[Site], site: Site) -> Site:
    """The same function in the rewritten file (lines may have moved)."""
    same = [s for s in after if s.function == site.function]
    return min(same, key=lambda s: abs(s.line - site.line)) if same else site


def _replace_all(files: list[tuple[Path, bytes, bytes]]) -> None:
    """Replace each ``(file, current, new)`` atomically, all or none.

    Every new file is staged (written and fsync'ed beside its original)
    before the first rename. If a rename fails (EROFS, EACCES, EPERM on an
    immutable file), the files already replaced get their ``current`` bytes
    back, so a run leaves either every file new or every file as it was.
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
                for undo, old in reversed(done):
                    atomic.write_atomic(undo, old)
                raise UsageError(f"{file}: cannot write ({exc.strerror})") from exc
            done.append((file, current))
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)


def _write(
    root: Path,
    staged: list[tuple[Path, str, bytes, bytes]],
    strategy: str,
    upstream: str,
    out: Outcome,
) -> None:
    for file, _, _, _ in staged:
        atomic.check_writable(file)
    with atomic.tree_lock(root):
        records = Records(root)
        for _, rel, original, _ in staged:
            # The file was replaced since we patched it (a reinstall, an
            # upgrade, a checkout): its bytes now are the original to keep,
            # or revert would put another version's file back.
            rec = records.entries.get(rel)
            if rec is not None and sha256(original) != rec.patched_sha256:
                records.drop(rel)
        before = dict(records.entries)
        # The records go first: a process killed between the renames below
        # leaves each file whole (old or new) and revert able to undo it.
        try:
            for _, rel, original, new in staged:
                records.add(
                    rel,
                    original,
                    Record(sha256(original), sha256(new), strategy, upstream, __version__),
                )
            records.save()
        except OSError as exc:
            why = f"cannot keep the originals ({exc.strerror})"
            raise UsageError(f"{records.state}: {why}") from exc
        try:
            _replace_all([(file, original, new) for file, _, original, new in staged])
        except UsageError:
            # Nothing was written: forget this run's records again.
            for _, rel, _, _ in staged:
                if rel not in before:
                    records.drop(rel)
            records.entries = before
            records.save()
            raise
        out.written.extend(relative(file, root) for file, _, _, _ in staged)
    out.message = f"patched {len(out.written)} file(s); undo with `gdn-backport revert`"


def revert_tree(path: Path, mode: Mode = Mode.WRITE, *, root: Path | None = None) -> Outcome:
    root = root or tree_root(path)
    out = Outcome(root)
    records = Records(root)
    only = relative(path, root) if path.is_file() else None
    wanted = [r for r in sorted(records.entries) if only is None or r == only]
    if not wanted:
        out.message = "nothing to revert: no gdn-backport record in this tree"
        return out
    restore: list[tuple[Path, str, bytes, bytes]] = []
    for rel in wanted:
        file = root / rel
        rec = records.entries[rel]
        if not file.exists():
            out.refused.append((rel, "patched file is gone"))
            continue
        current = file.read_bytes()
        if sha256(current) == rec.original_sha256:
            continue  # already the original (reverted by other means)
        if sha256(current) != rec.patched_sha256:
            out.refused.append((rel, "changed since gdn-backport patched it; not restoring"))
            continue
        original = records.original(rel)
        out.diff += _diff(rel, current.decode("utf-8"), original.decode("utf-8"))
        restore.append((file, rel, current, original))
    if out.refused:
        out.message = "refused: nothing was changed"
        out.diff = ""
        return out
    if mode is not Mode.WRITE:
        out.message = "dry run: nothing was changed"
        return out
    for file, _, _, _ in restore:
        atomic.check_writable(file)
    with atomic.tree_lock(root):
        _replace_all([(file, current, original) for file, _, current, original in restore])
        out.written.extend(rel for _, rel, _, _ in restore)
        for rel in wanted:
            records.drop(rel)
        records.save()
    # Report the sites of the restored files as they were and are now (the
    # restore is done: a file that cannot be analysed is just not reported).
    patchset = for_tree(root)
    for file, _, current, _ in restore:
        try:
            was = {file: locate.decode(file, current)}
            sites_was = sites_of(analyse_tree(file, patchset, was, root=root))
            sites_now = sites_of(analyse_tree(file, patchset, root=root))
        except UsageError:
            continue
        out.changes.extend(SiteChange(s, _match(sites_now, s), True) for s in sites_was)
    out.message = f"restored {len(out.written)} file(s) to their original bytes"
    return out
