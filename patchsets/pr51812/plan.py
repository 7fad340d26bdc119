"""pr51812's plan of a tree: analyse, rewrite, prove; nothing is written.

The tree's spec paths are analysed once (followed through helpers, in any
file); the strategy's codemod rewrites every file holding an affected site
from that analysis; the whole tree is analysed again with every rewrite in
place, and the plan goes through only if *every* site came out proven. An
``unknown`` site or a codemod refusal is a refusal of the plan (the
pipeline then writes nothing, of any patchset).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport import files
from gdn_backport.errors import Refusal, UsageError
from gdn_backport.pipeline import Mode, Outcome, Plan, SiteChange, Staged, conclude, unified_diff
from gdn_backport.result import Failure, Success, attempt
from gdn_backport.site import Site, Status
from gdn_backport.tree import Tree, relative

from .analysis import Walk
from .config import Patchset, config_for
from .scan import TreeScan, scan_tree_full, sites_of
from .sites import Key, TreeAnalysis

if TYPE_CHECKING:
    # libcst's codemod framework costs a cold run 0.2-0.3 s to import: only
    # a run that rewrites a file pays it (``_stage``).
    from .codemods.base import Rewrite, SiteCodemod

# A rewrite parses, regenerates and proves the whole module: about a minute
# per MiB on one CPU core (5 MiB took 9 minutes). The largest file of any vLLM
# release is 0.35 MiB. Above this size apply refuses with the reason instead
# of running for minutes; scan and --check read files of any size.
MAX_REWRITE_BYTES = 2 * 1024 * 1024


def _walks_into(analysis: TreeAnalysis, key: str) -> list[Walk]:
    """The walks of the tree's analysis that reach a site function of the
    module ``key`` (from entries anywhere in the tree)."""
    return [
        w
        for _, w in analysis.walks
        if any(c.select is not None and c.select.key[0] == key for c in w.calls)
    ]


def plan(tree: Tree, strategy: str, mode: Mode) -> Plan:
    patchset = config_for(tree)
    if strategy not in patchset.strategies:
        choices = ", ".join(patchset.strategies)
        raise UsageError(f"--strategy {strategy}: unknown (choose from {choices})")
    return _plan(tree, strategy, mode, patchset)


def _plan(tree: Tree, strategy: str, mode: Mode, patchset: Patchset) -> Plan:
    path, root = tree.path, tree.root
    out = Outcome(root)
    # The codemods plan from this analysis: no file is analysed twice.
    scanned = scan_tree_full(path, patchset, root, tree.overlay or None, tree)
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
            staged_one = _stage(rel, strategy, tree, scanned, out, patchset)
            if staged_one is not None:
                file, result, item = staged_one
                texts[file] = result.text
                rewritten |= result.sites
                staged.append(item)
    after = before
    if staged and not out.refused:
        after = _prove_tree(tree, patchset, texts, rewritten, out)
    for s in before:
        out.changes.append(SiteChange(s, _match(after, s), False))
    conclude(out, mode, bool(staged))
    if out.refused:
        staged, texts = [], {}
    return Plan(out, staged, strategy, texts)


def codemod_class(patchset: Patchset, strategy: str) -> type[SiteCodemod]:
    """The codemod class ``patchset.toml`` names for ``strategy``."""
    module, _, name = patchset.codemods[strategy].rpartition(".")
    cls: type[SiteCodemod] = getattr(importlib.import_module(module), name)
    return cls


def _stage(
    rel: str, strategy: str, tree: Tree, scanned: TreeScan, out: Outcome, patchset: Patchset
) -> tuple[Path, Rewrite, Staged] | None:
    """Rewrite one file with an affected site from the tree's analysis: (its
    tree path, the rewrite, what to write), or None with the refusal added
    to ``out``. The rewrite is proven with the whole tree, afterwards."""
    root = tree.root
    file = root / rel
    link = scanned.links.get(file)
    dest = file if link is None else _inside(link, root)
    if dest is None:
        why = f"is a symbolic link to {link} outside the tree; patch the target's own tree"
        out.refused.append((rel, why))
        return None
    disk = tree.read(file)
    text = tree.text(file)
    # An earlier patchset of this run rewrote the file: this layer starts there.
    original = files.encode(file, text, disk) if file in tree.overlay else disk
    if len(original) > MAX_REWRITE_BYTES:
        size, limit = len(original) / 2**20, MAX_REWRITE_BYTES / 2**20
        out.refused.append((rel, f"{size:.1f} MiB is too large to rewrite (limit {limit:.0f} MiB)"))
        return None
    index = scanned.analysis.index
    module = index.modules.get(rel)
    if module is None or module.text != text:
        raise UsageError(f"{file}: changed on disk while gdn-backport ran")
    codemod = codemod_class(patchset, strategy)(
        source=text,
        tree=root,
        path=file,
        patchset=index.patchset,
        walks=_walks_into(scanned.analysis, rel),
        module_key=rel,
    )
    # rewrite() is libcst's transform_module plus the sites it rewrote (the
    # proof needs them); attempt() reads its outcome as libcst's runner would.
    import libcst as cst

    tried = attempt(lambda: codemod.rewrite(cst.parse_module(text)), type(codemod).__name__)
    if isinstance(tried, Failure):
        out.refuse(rel, tried)
        return None
    result = tried.value if isinstance(tried, Success) else None
    if result is None or result.text == text:
        out.refused.append((rel, "the codemod found nothing to rewrite at an affected site"))
        return None
    try:
        # The file's own encoding (its PEP 263 declaration, its UTF-8
        # byte-order mark, which ``locate.decode`` strips to parse).
        data = files.encode(file, result.text, disk)
    except Refusal as exc:
        out.refused.append((rel, exc.reason))
        return None
    out.diff += unified_diff(rel, text, result.text)
    return file, result, (dest, relative(dest, root), original, data)


def _prove_tree(
    tree: Tree, patchset: Patchset, texts: dict[Path, str], rewritten: set[Key], out: Outcome
) -> list[Site]:
    """The proof, once for every rewrite: each rewritten file compiles, and
    the whole tree analysed again with every rewrite in place has each
    rewritten site aligned and no site left affected or unknown (a helper
    shared across files, a caller in another file). Refuses on ``out``
    otherwise; the sites after."""
    root = tree.root
    for file, text in texts.items():
        try:
            compile(files.parse_ast(file, text), str(file), "exec")
        except (SyntaxError, UsageError) as exc:
            out.refused.append((relative(file, root), f"the rewrite does not compile: {exc}"))
    if out.refused:
        return []
    # The run's walk and bytes again (the rewrites and the overlay override them).
    analysis = scan_tree_full(tree.path, patchset, root, {**tree.overlay, **texts}, tree).analysis
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


def apply_tree(
    path: Path,
    strategy: str = "gather",
    mode: Mode = Mode.WRITE,
    *,
    root: Path | None = None,
    within: str | None = None,
    kernels: Sequence[Path] = (),
) -> Outcome:
    """This patchset alone over the tree at ``path``, written by the pipeline."""
    from gdn_backport import pipeline

    from . import PATCHSET

    results = pipeline.apply(
        path, [PATCHSET], strategy, mode, root=root, within=within, kernels=kernels
    )
    return results[0][1]
