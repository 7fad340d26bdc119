"""What a PATH names, and one run's reading of it.

:func:`tree_root` and :func:`check_vllm_tree` decide what a command works on
(a usage error otherwise); :class:`Tree` is handed to every patchset of a
run: the walk, the bytes and the parse of each file are made once and
shared, and the texts an earlier patchset of the same run rewrote
(``overlay``) are what a later one reads.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport import files
from gdn_backport.atomic import STATE_DIR
from gdn_backport.errors import UsageError

if TYPE_CHECKING:
    from gdn_backport.context import Vllm


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
    for file in files.python_files(path):
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


@dataclass
class Tree:
    """One run's view of a tree: ``path`` (what PATH names) below ``root``
    (what paths and records are relative to); ``kernels``: ``--kernels``
    files; ``within``: the folder below ``root`` every record must name
    (``vllm`` with ``--installed``); ``vllm``: the vLLM a plugin's tree is
    read against for what it lacks (:mod:`gdn_backport.context`)."""

    root: Path
    path: Path
    kernels: tuple[Path, ...] = ()
    within: str | None = None
    vllm: Vllm | None = None
    # Texts an earlier patchset of this run rewrote: later ones read these.
    overlay: dict[Path, str] = field(default_factory=dict)
    # What a patchset's scan looked at and accounted for without finding a
    # site (human output only: "no site found, though these calls ...").
    notes: list[str] = field(default_factory=list)
    _walk: files.Walk | None = field(default=None, repr=False)
    _data: dict[Path, bytes] = field(default_factory=dict, repr=False)
    _texts: dict[Path, str] = field(default_factory=dict, repr=False)
    _listings: dict[Path, str] = field(default_factory=dict, repr=False)
    _kept: dict[tuple[str, Path], bool] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        path: Path,
        root: Path | None = None,
        kernels: Sequence[Path] = (),
        within: str | None = None,
        vllm: Vllm | None = None,
    ) -> Tree:
        return cls(root or tree_root(path), path, tuple(kernels), within, vllm)

    def walk(self) -> files.Walk:
        """Every ``*.py`` below ``path`` (walked once per run)."""
        if self._walk is None:
            self._walk = files.walk(self.path)
        return self._walk

    def read(self, file: Path) -> bytes:
        """The file's bytes on disk, read once (UsageError if unreadable)."""
        data = self._data.get(file)
        if data is None:
            try:
                # Unbuffered: one read of the whole file, no buffer object
                # (a scan reads every file of the tree once).
                with open(file, "rb", buffering=0) as fh:
                    data = self._data[file] = fh.read()
            except OSError as exc:
                raise UsageError(f"{file}: cannot read ({exc.strerror})") from exc
        return data

    def kept(self, sieve: str, file: Path, keep: Callable[[bytes], bool]) -> bool:
        """Whether ``keep`` holds for the file's bytes on disk, asked once
        per run and ``sieve``: a name for the rule and all it depends on (a
        plan's proof sieves the tree again; the bytes are the run's, read
        once)."""
        found = self._kept.get((sieve, file))
        if found is None:
            found = self._kept[sieve, file] = keep(self.read(file))
        return found

    def text(self, file: Path) -> str:
        """The file's source text: the overlay's, else decoded once."""
        if file in self.overlay:
            return self.overlay[file]
        text = self._texts.get(file)
        if text is None:
            text = self._texts[file] = files.decode(file, self.read(file))
        return text

    def parse(self, file: Path) -> ast.Module:
        """The file's ``ast`` (one parse per text per process)."""
        return files.parse_ast(file, self.text(file))

    def relative(self, file: Path) -> str:
        return relative(file, self.root)

    def listing(self, folder: Path | None = None) -> str:
        """One digest of every ``*.py`` below ``folder`` (default ``path``):
        each file's path in the tree and the SHA-256 of its bytes, in walk
        order (the analysis cache's name for "these files, these
        contents"); made once per folder and run. UsageError if a file
        cannot be read."""
        import hashlib

        folder = self.path if folder is None else folder
        found = self._listings.get(folder)
        if found is None:
            walked = self.walk() if folder == self.path else files.walk(folder)
            h = hashlib.sha256()
            root = str(self.root).rstrip(os.sep) + os.sep
            for file in walked.files:
                name = str(file)
                name = name[len(root) :] if name.startswith(root) else os.path.relpath(name, root)
                h.update(name.encode("utf-8", "surrogateescape") + b"\0")
                h.update(hashlib.sha256(self.read(file)).digest())
            found = self._listings[folder] = h.hexdigest()
        return found

    def leftovers(self) -> list[Path]:
        """Temporaries an interrupted run of ours left in the tree."""
        found = set(self.walk().leftovers) | set(files.state_leftovers(self.root))
        if self.path.is_file():
            found.update(files.leftovers_beside([self.path]))
        return sorted(found)
