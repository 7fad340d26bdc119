"""``scan``: every GDN spec path in a tree with its status and the reason."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from gdn_backport import locate
from gdn_backport.analysis import Status, analyse
from gdn_backport.errors import UsageError
from gdn_backport.patchset import Patchset, load


@dataclass(frozen=True)
class Site:
    path: str  # relative to the tree root, POSIX separators
    line: int
    function: str
    status: Status
    reason: str

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["status"] = self.status.value
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


def relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def scan_text(rel: str, text: str, patchset: Patchset, where: Path | None = None) -> list[Site]:
    """The sites in one file's source; ``where`` names the file in errors."""
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
    """The file's bytes, and its text if it may hold a site (else None)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
    if not locate.mentions_fields(data, patchset):
        return data, None
    return data, locate.decode(path, data)


def scan_file(path: Path, root: Path, patchset: Patchset) -> list[Site]:
    _, text = read_source(path, patchset)
    return [] if text is None else scan_text(relative(path, root), text, patchset, path)


def scan_tree(path: Path, patchset: Patchset | None = None) -> tuple[Path, list[Site]]:
    patchset = patchset or load()
    root = tree_root(path)
    sites: list[Site] = []
    for file in locate.python_files(path):
        sites.extend(scan_file(file, root, patchset))
    return root, sites
