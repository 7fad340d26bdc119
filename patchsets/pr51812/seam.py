"""pr51812 through the registry's seam (imports stay inside the methods: the
CLI imports every patchset to print its help)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gdn_backport.registry import Patchset

if TYPE_CHECKING:
    from gdn_backport.ahead import Prepare
    from gdn_backport.pipeline import Mode, Plan
    from gdn_backport.site import Site
    from gdn_backport.tree import Tree


class Pr51812(Patchset):
    def scan(self, tree: Tree) -> list[Site]:
        from gdn_backport import cache

        patchset, name = self._scan_name(tree)
        if name is None:
            sites, note, _ = _scan(tree, patchset)
        else:
            sites, note = cache.cached(
                name,
                lambda: _scan(tree, patchset),
                lambda found: None if found[2] else [cache.dump_sites(found[0]), found[1]],
                _read_scan,
            )[:2]
        if note:
            tree.notes.append(note)
        return sites

    def prepare(self, tree: Tree) -> Prepare | None:
        from gdn_backport import cache

        name = self._scan_name(tree)[1]
        if name is not None and cache.stored(name):
            # The scan will be read from the cache: nothing to parse, and a
            # child parsing anyway is what the run would wait for.
            return None
        from .preparse import prepare

        return prepare(tree)

    def _scan_name(self, tree: Tree) -> tuple[Any, str | None]:
        """The patchset's data for ``tree`` and the analysis cache's name
        for its scan (None: the cache is off, or no name can be made)."""
        from gdn_backport import cache

        from .config import config_for

        patchset = config_for(tree)
        return patchset, _scan_key(self.info.id, tree, patchset) if cache.enabled() else None

    def plan(self, tree: Tree, strategy: str, mode: Mode) -> Plan:
        from .plan import plan

        return plan(tree, strategy, mode)

    def suite(self) -> Any:
        from .suite import LAYER_SUITE

        return LAYER_SUITE

    def engine_scenarios(self) -> Sequence[Any]:
        from .engine_scenarios import SCENARIOS

        return SCENARIOS

    def doctor_rows(self, package: Path, root: Path) -> list[Any]:
        from .runtime.doctor import rows

        return rows(package, root)

    def doctor_hint(self) -> str:
        return "gdn-backport apply, or the runtime plugin: VLLM_PLUGINS=gdn_backport"

    def runtime_register(self) -> None:
        from .runtime.plugin import register

        register()

    def probe(self) -> Any:
        from .probe import SOURCE

        return SOURCE


def _scan(tree: Tree, patchset: Any) -> tuple[list[Site], str | None, bool]:
    """The sites, the note for a tree without any (what the sweep found and
    how each call was accounted for), and whether the analysis read a module
    outside the tree's walk (such a result is not cached: its key does not
    name that file)."""
    from .scan import scan_tree_full

    result = scan_tree_full(tree.path, patchset, tree.root, tree.overlay or None, tree)
    swept = result.analysis.swept
    note = None
    if swept and not result.sites:
        # The sweep found calls handed the spec index or slots, and the
        # analysis accounted for each: say which, so "nothing" is an answer.
        calls = ", ".join(f"{r.callee} ({r.module}:{r.line}, {how})" for r, how in swept)
        note = (
            f"; {len(swept)} call(s) handed the spec token index or state slots, each "
            f"accounted for: {calls}"
        )
    return result.sites, note, _outside(tree, result.analysis.index.modules.values())


def _outside(tree: Tree, modules: Iterable[Any]) -> bool:
    """Some of ``modules`` is a file outside the tree's walk. A module is
    named as the walk names it but where the analysis reached it another way
    (a link, a path outside the root): only then are real paths compared (a
    ``realpath`` of each of thousands of files cost a tenth of a scan)."""
    files = _root_walk(tree).files
    walked = set(files)
    real: set[str] | None = None
    for m in modules:
        if m.path is None or m.path in walked:
            continue
        if real is None:
            real = {os.path.realpath(p) for p in files}
        if os.path.realpath(m.path) not in real:
            return True
    return False


def _root_walk(tree: Tree) -> Any:
    from gdn_backport import files

    return tree.walk() if tree.path == tree.root else files.walk(tree.root)


def _scan_key(pid: str, tree: Tree, patchset: Any) -> str | None:
    """The analysis cache's name for this scan: every file of the tree (its
    path and the digest of its bytes; the analysis follows helpers anywhere
    in it), the run's overlay, the paths, links and the patchset's data with
    the fork's kernels. None when it cannot be made (an unreadable file: the
    scan itself reports it)."""
    from gdn_backport import cache

    try:
        listing = tree.listing(tree.root)
        below = [tree.relative(f) for f in tree.walk().files] if tree.path != tree.root else None
        packages = []
        folder = tree.root
        while (folder / "__init__.py").is_file() and folder.parent != folder:
            packages.append(folder.name)  # a module's name climbs through these
            folder = folder.parent
        overlay = sorted(
            (str(p), cache.digest(t.encode("utf-8", "surrogatepass")))
            for p, t in tree.overlay.items()
        )
        links = sorted((str(p), str(t)) for p, t in tree.walk().links.items())
        return cache.key(
            f"{pid}.scan",
            str(tree.root),
            str(tree.path),
            tree.path.is_file(),
            below,
            packages,
            listing,
            overlay,
            links,
            cache.stable(patchset),
        )
    except Exception:
        return None


def _read_scan(doc: object) -> tuple[list[Site], str | None, bool]:
    from gdn_backport import cache

    assert isinstance(doc, list) and len(doc) == 2
    sites, note = doc
    assert note is None or isinstance(note, str)
    return cache.read_sites(sites), note, False
