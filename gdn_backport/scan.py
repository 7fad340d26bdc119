"""``scan``: every GDN spec path in a tree with its status and the reason."""

from __future__ import annotations

import contextlib
import os
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gdn_backport import locate
from gdn_backport.analysis import Status, analyse
from gdn_backport.atomic import STATE_DIR
from gdn_backport.errors import UsageError
from gdn_backport.patchset import Patchset, load


@dataclass(frozen=True)
class Site:
    path: str  # relative to the tree root, POSIX separators
    line: int
    function: str
    status: Status
    reason: str
    # Where the file really is, when ``path`` reaches it through a symbolic
    # link (JSON ``"target"``, only then).
    target: str | None = None

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["status"] = self.status.value
        if self.target is None:
            del d["target"]
        return d


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


# The sites of recently analysed sources: (rel, id(patchset), text) ->
# (patchset, sites). A scan follows links into shared folders (a slim tree's
# links into the release cache), and one process scans, applies, checks and
# reverts the same files again: the analysis of unchanged text is reused.
_MEMO: OrderedDict[tuple[str, int, str], tuple[Patchset, list[Site]]] = OrderedDict()
_MEMO_SIZE = 64


def scan_text(rel: str, text: str, patchset: Patchset, where: Path | None = None) -> list[Site]:
    """The sites in one file's source; ``where`` names the file in errors."""
    key = (rel, id(patchset), text)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is patchset:
        _MEMO.move_to_end(key)
        return list(hit[1])
    sites = _scan_text(rel, text, patchset, where)
    _MEMO[key] = (patchset, sites)
    if len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return list(sites)


def _scan_text(rel: str, text: str, patchset: Patchset, where: Path | None) -> list[Site]:
    tree = locate.parse_ast(where or Path(rel), text)
    lines = text.splitlines(keepends=True)
    imports = locate.module_imports(tree)
    sites = []
    for cand in locate.candidates(tree, lines, patchset):
        func = locate.function_node(lines, cand)
        result = analyse(func, patchset, imports)
        if result is not None:
            sites.append(Site(rel, cand.line, cand.qualname, result.status, result.reason))
    return sites


def read_source(path: Path, patchset: Patchset) -> tuple[bytes, str | None]:
    """The file's bytes and text if it may hold a site, else ``(b"", None)``:
    a file that does not name both a spec-token and a spec state field is
    not read whole, decoded or parsed (:func:`locate.read_candidate`)."""
    try:
        data = locate.read_candidate(path, patchset)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
    if data is None:
        return b"", None
    return data, locate.decode(path, data)


def scan_file(path: Path, root: Path, patchset: Patchset, target: Path | None = None) -> list[Site]:
    """The sites of one file; ``target``: the real file, if ``path`` is a link."""
    _, text = read_source(path, patchset)
    if text is None:
        return []
    sites = scan_text(relative(path, root), text, patchset, path)
    return sites if target is None else [replace(s, target=str(target)) for s in sites]


def scan_walk(walked: locate.Walk, root: Path, patchset: Patchset) -> list[Site]:
    return [
        site
        for file in walked.files
        for site in scan_file(file, root, patchset, walked.links.get(file))
    ]


@dataclass
class TreeScan:
    root: Path
    sites: list[Site]
    # Temporaries an interrupted gdn-backport run left (reported, not removed).
    leftovers: list[Path]


def scan_tree_full(
    path: Path, patchset: Patchset | None = None, root: Path | None = None
) -> TreeScan:
    patchset = patchset or load()
    root = root or tree_root(path)
    walked = locate.walk(path)
    found = set(walked.leftovers) | set(locate.state_leftovers(root))
    if path.is_file():
        found.update(locate.leftovers_beside([path]))
    return TreeScan(root, scan_walk(walked, root, patchset), sorted(found))


def scan_tree(path: Path, patchset: Patchset | None = None) -> tuple[Path, list[Site]]:
    result = scan_tree_full(path, patchset)
    return result.root, result.sites
