"""``scan``: every GDN spec path in a tree with its status and the reason."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from gdn_backport import files
from gdn_backport.errors import UsageError
from gdn_backport.site import Site
from gdn_backport.tree import Tree, relative, tree_root

from . import ID as PATCHSET_ID
from . import locate
from .config import Patchset, for_tree
from .resolve import ModuleInfo, TreeIndex
from .sites import TreeAnalysis, analyse_modules


def sites_of(analysis: TreeAnalysis, links: dict[str, str] | None = None) -> list[Site]:
    """The analysis's sites; ``links``: tree path -> real file, for linked modules."""
    links = links or {}
    return [
        Site(
            key[0],
            analysis.lines[key],
            key[1],
            site.status,
            site.reason,
            tuple(site.via) if site.via else None,
            links.get(key[0]),
            PATCHSET_ID,
        )
        for key, site in analysis.sites.items()
    ]


def scan_text(rel: str, text: str, patchset: Patchset, where: Path | None = None) -> list[Site]:
    """The sites in one file's source alone; ``where`` names the file in errors."""
    index = TreeIndex(None, patchset)
    module = index.add_text(rel, text, where)
    return sites_of(analyse_modules(index, [module]))


def read_source(path: Path, patchset: Patchset) -> tuple[bytes, str | None]:
    """The file's bytes and text if it may hold a site, else ``(b"", None)``:
    a file that names no spec-token field is not read whole, decoded or
    parsed (:func:`locate.read_candidate`)."""
    try:
        data = locate.read_candidate(path, patchset)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
    if data is None:
        return b"", None
    return data, files.decode(path, data)


@dataclass
class TreeScan:
    """A tree analysed: the sites, and what else a run needs to know."""

    root: Path
    analysis: TreeAnalysis
    sites: list[Site]
    # Temporaries an interrupted gdn-backport run left (reported, not removed).
    leftovers: list[Path] = field(default_factory=list)
    # Files reached through a symbolic link -> their real path.
    links: dict[Path, Path] = field(default_factory=dict)


def scan_tree_full(
    path: Path,
    patchset: Patchset | None = None,
    root: Path | None = None,
    overrides: dict[Path, str] | None = None,
    tree: Tree | None = None,
) -> TreeScan:
    """Analyse the modules below ``path`` of the tree at ``root`` (default:
    the tree ``path`` names) with their helpers followed; ``overrides``:
    texts to analyse instead of files' contents (a rewrite being proven);
    ``tree``: the run's :class:`Tree` of ``path``, whose walk, bytes and
    texts are shared with the other patchsets of the run."""
    root = root or tree_root(path)
    patchset = patchset or for_tree(root)
    shared = tree if tree is not None and tree.path == path else None
    walked = shared.walk() if shared is not None else files.walk(path)
    index = TreeIndex(root, patchset, overrides)
    modules: list[ModuleInfo] = []
    # The sieve's name: all its rule reads (``locate.may_hold_site``).
    sieve = f"{patchset.id}.sieve:" + ",".join(m.decode() for m in locate.markers(patchset))
    for file in walked.files:
        text = (overrides or {}).get(file)
        if text is None and shared is not None:
            # The bytes read once for the run; the sieve's rule on them whole,
            # once per run (a plan's proof scans the tree again).
            kept = shared.kept(sieve, file, lambda data: locate.may_hold_site(data, patchset))
            text = shared.text(file) if kept else None
        elif text is None:
            _, text = read_source(file, patchset)
        elif not locate.may_hold_site(text.encode("utf-8"), patchset):
            text = None
        if text is not None:
            modules.append(index.add(file, text))
    analysis = analyse_modules(index, modules)
    links = {relative(p, root): str(t) for p, t in walked.links.items()}
    found = set(walked.leftovers) | set(files.state_leftovers(root))
    if path.is_file():
        found.update(files.leftovers_beside([path]))
    return TreeScan(root, analysis, sites_of(analysis, links), sorted(found), walked.links)


def analyse_tree(
    path: Path,
    patchset: Patchset | None = None,
    overrides: dict[Path, str] | None = None,
    root: Path | None = None,
) -> TreeAnalysis:
    return scan_tree_full(path, patchset, root, overrides).analysis


def scan_tree(
    path: Path, patchset: Patchset | None = None, overrides: dict[Path, str] | None = None
) -> tuple[Path, list[Site]]:
    result = scan_tree_full(path, patchset, overrides=overrides)
    return result.root, result.sites


def at_link(sites: list[Site], target: Path | None) -> list[Site]:
    """``sites`` marked as reached through a link to ``target``."""
    return sites if target is None else [replace(s, target=str(target)) for s in sites]
