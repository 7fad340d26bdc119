"""``scan``: every GDN spec path in a tree with its status and the reason."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gdn_backport import locate
from gdn_backport.analysis import Status
from gdn_backport.atomic import STATE_DIR
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
    # Where the file really is, when ``path`` reaches it through a symbolic
    # link (JSON ``"target"``, only then).
    target: str | None = None
    # The patchset whose analysis found the site (patchsets/<id>.toml).
    patchset: str = "pr51812"

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["status"] = self.status.value
        if self.via is None:
            del d["via"]
        else:
            d["via"] = list(self.via)
        if self.target is None:
            del d["target"]
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


# A vLLM plugin that carries its own GDN layer (vllm-ascend) holds no vllm/
# package, but its modules import vLLM.
_IMPORTS_VLLM = re.compile(rb"(?m)^[ \t]*(?:from|import)[ \t]+vllm\b")


def _package(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def check_vllm_tree(path: Path, *, records: bool = False) -> None:
    """UsageError unless PATH can hold vLLM's code: one file (taken as it
    is), a folder holding a ``vllm`` package (``vllm/__init__.py``, at its
    top or one folder down as in an unpacked sdist), the ``vllm`` package
    itself, or a folder with Python files that import vllm (a plugin).
    ``records``: a folder holding gdn-backport's records is accepted too
    (``revert`` of a single file's folder)."""
    tree_root(path)  # missing, a dangling link, not a file or folder
    if path.is_file():
        return
    if (path.name == "vllm" and _package(path)) or _package(path / "vllm"):
        return
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if entry.is_dir() and _package(Path(entry.path) / "vllm"):
                return
    if records and (path / STATE_DIR / "manifest.json").is_file():
        return
    for file in locate.python_files(path):
        with contextlib.suppress(OSError):
            if _IMPORTS_VLLM.search(file.read_bytes()):
                return
    raise UsageError(
        f"{path}: no vllm package under this path (looked for vllm/__init__.py in it or one "
        "folder down, for it being the vllm package, and for Python files that import vllm); "
        "pass the folder that holds vllm/"
    )


def relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


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
    return data, locate.decode(path, data)


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
) -> TreeScan:
    """Analyse the modules below ``path`` of the tree at ``root`` (default:
    the tree ``path`` names) with their helpers followed; ``overrides``:
    texts to analyse instead of files' contents (a rewrite being proven)."""
    root = root or tree_root(path)
    patchset = patchset or for_tree(root)
    walked = locate.walk(path)
    index = TreeIndex(root, patchset, overrides)
    modules: list[ModuleInfo] = []
    for file in walked.files:
        text = (overrides or {}).get(file)
        if text is None:
            _, text = read_source(file, patchset)
        elif not locate.may_hold_site(text.encode("utf-8"), patchset):
            text = None
        if text is not None:
            modules.append(index.add(file, text))
    analysis = analyse_modules(index, modules)
    links = {relative(p, root): str(t) for p, t in walked.links.items()}
    found = set(walked.leftovers) | set(locate.state_leftovers(root))
    if path.is_file():
        found.update(locate.leftovers_beside([path]))
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
