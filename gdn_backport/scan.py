"""``scan``: every GDN spec path in a tree with its status and the reason."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from gdn_backport import locate
from gdn_backport.analysis import Status
from gdn_backport.errors import UsageError
from gdn_backport.patchset import Patchset, for_tree
from gdn_backport.resolve import ModuleInfo, TreeIndex
from gdn_backport.sites import TreeAnalysis, analyse_modules


@dataclass(frozen=True)
class Site:
    path: str  # relative to the tree root, POSIX separators
    line: int
    function: str
    status: Status
    reason: str
    # The call chain from the entry to the kernel, when it goes through helpers.
    via: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["status"] = self.status.value
        if self.via is None:
            del d["via"]
        else:
            d["via"] = list(self.via)
        return d

    @property
    def chain(self) -> str:
        """``A._forward_core -> A.helper -> kernel`` (empty for a direct call)."""
        return " -> ".join(self.via) if self.via else ""


def tree_root(path: Path) -> Path:
    """The tree a PATH names: a directory, or the directory of a single file."""
    if not path.exists():
        if path.is_symlink():
            raise UsageError(f"{path}: symbolic link to nothing (a loop or a missing target)")
        raise UsageError(f"{path}: no such file or directory")
    if not (path.is_dir() or path.is_file()):
        raise UsageError(f"{path}: not a regular file or a directory")
    return path if path.is_dir() else path.parent


def relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def sites_of(analysis: TreeAnalysis) -> list[Site]:
    return [
        Site(
            key[0],
            analysis.lines[key],
            key[1],
            site.status,
            site.reason,
            tuple(site.via) if site.via else None,
        )
        for key, site in analysis.sites.items()
    ]


def scan_text(rel: str, text: str, patchset: Patchset, where: Path | None = None) -> list[Site]:
    """The sites in one file's source alone; ``where`` names the file in errors."""
    index = TreeIndex(None, patchset)
    module = index.add_text(rel, text, where)
    return sites_of(analyse_modules(index, [module]))


def read_source(path: Path, patchset: Patchset) -> tuple[bytes, str | None]:
    """The file's bytes, and its text if it may hold a site (else None)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
    if not locate.mentions_fields(data, patchset):
        return data, None
    return data, locate.decode(path, data)


def index_tree(
    path: Path,
    patchset: Patchset,
    overrides: dict[Path, str] | None = None,
    root: Path | None = None,
) -> tuple[TreeIndex, list[ModuleInfo]]:
    """The tree's index (rooted at ``root``, default the tree ``path``
    names), with the modules below ``path`` that may hold a site read in."""
    root = root or tree_root(path)
    index = TreeIndex(root, patchset, overrides)
    modules = []
    for file in locate.python_files(path):
        text = (overrides or {}).get(file)
        if text is None:
            _, text = read_source(file, patchset)
        elif not locate.mentions_fields(text.encode("utf-8"), patchset):
            text = None
        if text is not None:
            modules.append(index.add(file, text))
    return index, modules


def analyse_tree(
    path: Path,
    patchset: Patchset | None = None,
    overrides: dict[Path, str] | None = None,
    root: Path | None = None,
) -> TreeAnalysis:
    root = root or tree_root(path)
    patchset = patchset or for_tree(root)
    index, modules = index_tree(path, patchset, overrides, root)
    return analyse_modules(index, modules)


def scan_file(path: Path, root: Path, patchset: Patchset) -> list[Site]:
    """The sites of one file of the tree at ``root`` (its helpers followed)."""
    index = TreeIndex(root, patchset)
    _, text = read_source(path, patchset)
    if text is None:
        return []
    rel = relative(path, root)
    return [s for s in sites_of(analyse_modules(index, [index.add(path, text)])) if s.path == rel]


def scan_tree(
    path: Path, patchset: Patchset | None = None, overrides: dict[Path, str] | None = None
) -> tuple[Path, list[Site]]:
    root = tree_root(path)
    return root, sites_of(analyse_tree(path, patchset, overrides))
