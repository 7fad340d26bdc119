"""Which vLLM version a tree holds, read from files or git, never by importing it.

Importing ``vllm`` would run the target's code (and needs torch, a GPU
build...); the version is only shown to the user and written into commit
messages, never used to decide anything (the analysis decides by the code).

Where it comes from, first found wins, at the folder holding ``vllm/`` (the
path itself or above it; else the one folder below it that holds a ``vllm``
package, as an unpacked sdist ``PATH/vllm-X.Y.Z/vllm/`` does: several such
folders name no one version):

1. ``git describe --tags --match 'v[0-9]*'``, only when ``vllm/__init__.py``
   is tracked by that repository: a checkout's generated ``_version.py`` is
   whatever the last build wrote, the tag is what is checked out. (A
   virtualenv inside some other repository is not that repository's vLLM.)
2. ``vllm/_version.py``: written by setuptools-scm into sdists and wheels.
3. ``PKG-INFO`` at an sdist's root, or ``*.egg-info/PKG-INFO``.
4. ``vllm-*.dist-info/METADATA`` beside an installed ``vllm/``.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VllmVersion", "detect", "line", "to_json"]


@dataclass(frozen=True)
class VllmVersion:
    version: str
    # relative to the folder holding vllm/ (to the path given, when that is
    # one folder above it), or "git describe"
    source: str


def detect(path: Path) -> VllmVersion | None:
    """The version of the vLLM tree ``path`` is in (a root, a folder or a file)."""
    start = path if path.is_dir() else path.parent
    base, prefix = _package_root(start), ""
    if base is None:
        base = _one_folder_down(start)
        if base is None:
            return None
        prefix = f"{base.name}/"
    for probe in (_from_git, _from_version_py, _from_pkg_info, _from_dist_info):
        found = probe(base)
        if found is not None:
            if found.source == "git describe":
                return found
            return VllmVersion(found.version, prefix + found.source)
    return None


def line(found: VllmVersion | None) -> str:
    """The human output line."""
    if found is None:
        return "vllm version: unknown (no vllm/_version.py, PKG-INFO, dist-info or v* git tag)"
    return f"vllm version: {found.version} (from {found.source})"


def to_json(found: VllmVersion | None) -> dict[str, str] | None:
    return None if found is None else {"version": found.version, "source": found.source}


def _package_root(start: Path) -> Path | None:
    """``start`` or the nearest folder above it that holds a ``vllm/`` folder."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if (folder / "vllm").is_dir():
            return folder
    return None


def _one_folder_down(start: Path) -> Path | None:
    """The one folder in ``start`` that holds a ``vllm`` package, if exactly one does."""
    try:
        found = [
            entry
            for entry in sorted(start.resolve().iterdir())
            if entry.is_dir() and (entry / "vllm" / "__init__.py").is_file()
        ]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def _no_git(base: Path) -> bool:
    """Neither ``base`` nor a folder above it holds ``.git`` (a folder or a
    gitfile), and ``$GIT_DIR`` is unset: no repository to ask, so GitPython
    (0.1 s to import) is not imported. A bare repository is never the
    tree's: it is refused below as well."""
    if "GIT_DIR" in os.environ:
        return False
    folder = base.absolute()
    while True:
        if os.path.lexists(folder / ".git"):
            return False
        if folder.parent == folder:
            return True
        folder = folder.parent


def _from_git(base: Path) -> VllmVersion | None:
    if _no_git(base):
        return None
    import git

    try:
        repo = git.Repo(base, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None
    with repo:
        if repo.bare or repo.working_tree_dir is None:
            return None
        try:
            top = Path(repo.working_tree_dir).resolve()
            init = (base / "vllm" / "__init__.py").relative_to(top)
            repo.git.ls_files("--error-unmatch", "--", init.as_posix())
            described = repo.git.describe("--tags", "--match", "v[0-9]*")
        except (ValueError, git.GitCommandError):
            return None  # not tracked here, no commit, or no version tag
    return VllmVersion(described.removeprefix("v"), "git describe")


def _from_version_py(base: Path) -> VllmVersion | None:
    path = base / "vllm" / "_version.py"
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        # ``__version__ = version = '0.25.1'`` (setuptools-scm), either order.
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                found[target.id] = node.value.value
    value = found.get("__version__") or found.get("version")
    return VllmVersion(value, "vllm/_version.py") if value else None


def _from_pkg_info(base: Path) -> VllmVersion | None:
    return _from_metadata(base, [base / "PKG-INFO", *sorted(base.glob("*.egg-info/PKG-INFO"))])


def _from_dist_info(base: Path) -> VllmVersion | None:
    # Normalised folder names (PEP 491); the case an old installer wrote varies.
    return _from_metadata(base, sorted(base.glob("[vV][lL][lL][mM]-*.dist-info/METADATA")))


def _from_metadata(base: Path, files: list[Path]) -> VllmVersion | None:
    """The first core-metadata file (RFC 822 headers) naming ``vllm``."""
    for path in files:
        try:
            import email.parser  # 7 ms: only where the version is read from metadata

            meta = email.parser.BytesHeaderParser().parsebytes(path.read_bytes())
        except OSError:
            continue
        from packaging.utils import canonicalize_name

        if canonicalize_name(meta.get("Name", "")) == "vllm" and meta.get("Version"):
            return VllmVersion(str(meta["Version"]), path.relative_to(base).as_posix())
    return None
