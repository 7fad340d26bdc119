"""Source files of a tree: walked, read and decoded as Python reads them.

Every patchset reads a tree through these: the walk follows symbolic links
(a linked module is never missed) and skips the records folder; a file is
decoded by its PEP 263 declaration; a candidate file is read in chunks and
kept only when it names one of a patchset's markers and defines a function,
so a huge unrelated file costs one pass and is never parsed. Nothing of the
target is imported or executed.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import functools
import io
import os
import re
import stat
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from gdn_backport.atomic import STATE_DIR
from gdn_backport.errors import Refusal, UsageError

BOM = b"\xef\xbb\xbf"
SKIP_DIRS = frozenset({".git", STATE_DIR, "__pycache__", ".nox", ".venv", "node_modules"})


# What a killed run of ours can leave: ``atomic.stage``'s temporary beside a
# module (``.<name>.py.<8 random>.tmp``), and in the records folder the
# temporaries of the manifest and of the originals, and the writability probe.
_LEFTOVER = re.compile(r"^\.(?P<name>.+\.py)\.[a-z0-9_]{8}\.tmp$")
_STATE_LEFTOVER = re.compile(r"^\.(.+\.[a-z0-9_]{8}\.tmp|gdn-backport\.[a-z0-9_]{8}\.probe)$")
# Bytes read at a time by the sieve of :func:`read_candidate`.
CHUNK = 1 << 20


@dataclass
class Walk:
    """Every ``*.py`` below a root, symbolic links followed.

    ``files``: the paths as they appear inside the tree (a linked file or a
    file in a linked folder keeps the link's path), each real file once;
    ``links``: for the files reached through a link, the real path;
    ``leftovers``: temporaries of an interrupted gdn-backport run (never
    below a link).
    """

    root: Path
    files: list[Path] = field(default_factory=list)
    links: dict[Path, Path] = field(default_factory=dict)
    leftovers: list[Path] = field(default_factory=list)


# ``Path(entry.path)`` parses the whole path again: a tenth of a cached
# rescan of 3,000 files. A child built from its folder's parsed parts is the
# same path (CPython's own ``Path.iterdir`` builds it so); where an
# interpreter has no such method, the plain join.
_CHILD = getattr(Path, "_make_child_relpath", None)


def _child(folder: Path, name: str) -> Path:
    if _CHILD is not None:
        child: Path = _CHILD(folder, name)
        return child
    return folder / name


def walk(root: Path) -> Walk:
    """Walk ``root`` (or take ``root`` itself, a single file).

    Only regular files: reading a FIFO (or a device) named ``*.py`` would
    block forever. Directory entries carry their type, so a tree of 3,000
    files costs no ``stat`` per file. Links are followed, after the real
    folders (so a file reached both ways keeps its real path); a folder is
    walked once by its resolved path (link loops end there), and a link to
    a folder that holds the tree itself is not walked (it would walk the
    tree's parents).

    Never a silent miss: a ``*.py`` that is a link to nothing or a loop of
    links, one that is not a regular file (a FIFO, a device), and a folder
    that cannot be listed are a UsageError naming it (skipped, the module
    would be missing from the scan and ``apply`` would write a half fix).
    What is no module is still skipped: a dangling or looping link of
    another name, the :data:`SKIP_DIRS` folders.
    """
    out = Walk(root)
    if root.is_file():
        out.files.append(root)
        if root.is_symlink():
            out.links[root] = Path(os.path.realpath(root))
        return out
    top = os.path.realpath(root)
    seen_dirs: set[str] = set()
    seen_files: set[str] = set()
    pending: list[tuple[Path, str]] = []  # linked folders (path, real), walked last

    def add(path: Path, real: str, linked: bool) -> None:
        if real in seen_files:
            return
        seen_files.add(real)
        out.files.append(path)
        if linked:
            out.links[path] = Path(real)

    def visit(folder: Path, real_dir: str, linked: bool) -> None:
        # Real paths are built, not resolved: a real folder's real path is its
        # parent's plus its name; only a link costs a ``realpath``.
        if real_dir in seen_dirs:
            return
        seen_dirs.add(real_dir)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            # os.walk skips it: its modules would be missing from the scan.
            raise UsageError(f"{folder}: cannot read ({exc.strerror})") from exc
        folders = []
        names = {e.name for e in entries}
        for entry in entries:
            if entry.is_symlink():
                try:
                    st = os.stat(entry.path)
                except OSError as exc:
                    if entry.name.endswith(".py"):
                        _refuse_link(_child(folder, entry.name), exc)
                    continue  # not a module: a dangling or looping link of another name
                if stat.S_ISDIR(st.st_mode):
                    real = os.path.realpath(entry.path)
                    # A link to a folder holding the tree would walk its parents.
                    if entry.name not in SKIP_DIRS and not _holds(real, top):
                        pending.append((Path(entry.path), real))
                elif entry.name.endswith(".py"):
                    if not stat.S_ISREG(st.st_mode):
                        raise UsageError(f"{_child(folder, entry.name)}: not a regular file")
                    add(_child(folder, entry.name), os.path.realpath(entry.path), True)
            elif entry.is_dir(follow_symlinks=False):
                if entry.name not in SKIP_DIRS:
                    folders.append(entry)
                elif entry.name == STATE_DIR and not linked:
                    out.leftovers.extend(_state_leftovers(Path(entry.path)))
            elif entry.is_file(follow_symlinks=False):
                if entry.name.endswith(".py"):
                    add(_child(folder, entry.name), os.path.join(real_dir, entry.name), linked)
                elif not linked:
                    m = _LEFTOVER.match(entry.name)
                    if m and m["name"] in names:
                        out.leftovers.append(Path(entry.path))
            elif entry.name.endswith(".py"):
                # A FIFO or a device: reading it would block, skipping it misses a module.
                raise UsageError(f"{_child(folder, entry.name)}: not a regular file")
        for sub in folders:
            visit(_child(folder, sub.name), os.path.join(real_dir, sub.name), linked)

    visit(root, top, False)
    while pending:
        folder, real = pending.pop(0)
        visit(folder, real, True)
    return out


def _refuse_link(path: Path, exc: OSError) -> NoReturn:
    """A ``*.py`` link ``os.stat`` could not follow: why, as one line."""
    if exc.errno == errno.ELOOP:
        raise UsageError(f"{path}: a loop of symbolic links") from exc
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        try:
            target = os.readlink(path)
        except OSError:
            raise UsageError(f"{path}: symbolic link to nothing") from exc
        raise UsageError(
            f"{path}: symbolic link to nothing (its target {target} does not exist)"
        ) from exc
    raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc


def _holds(folder: str, path: str) -> bool:
    """``folder`` is ``path`` or one of its parents (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _state_leftovers(state: Path) -> list[Path]:
    """Temporaries in a records folder (and its ``originals/``), links not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(state):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        found += [Path(dirpath, f) for f in sorted(filenames) if _STATE_LEFTOVER.match(f)]
    return found


def leftovers_beside(files: Iterable[Path]) -> list[Path]:
    """Temporaries of an interrupted write beside each of ``files``."""
    found = []
    for file in files:
        with contextlib.suppress(OSError):
            for entry in os.scandir(file.parent):
                m = _LEFTOVER.match(entry.name)
                if m and m["name"] == file.name and entry.is_file(follow_symlinks=False):
                    found.append(Path(entry.path))
    return sorted(found)


def state_leftovers(root: Path) -> list[Path]:
    """Temporaries in ``root``'s records folder (none if it is not a real folder)."""
    state = root / STATE_DIR
    return [] if state.is_symlink() or not state.is_dir() else _state_leftovers(state)


def python_files(root: Path) -> Iterator[Path]:
    """Every ``*.py`` below ``root`` (or ``root`` itself): :func:`walk`'s files."""
    yield from walk(root).files


def read_marked(path: Path, markers: Sequence[bytes]) -> bytes | None:
    """The file's bytes if they name one of ``markers`` and define a function
    (``def ``: a site is a function), else None. Read in chunks (``CHUNK``,
    overlapping by a marker's length): a large file that fails the rule
    costs one pass and is never kept whole; one that passes is read whole,
    whatever its size."""
    overlap = max(len(m) for m in (*markers, b"def ")) - 1
    with path.open("rb") as fh:
        chunk = fh.read(CHUNK)
        if len(chunk) < CHUNK:  # the common case: the whole file in one read
            return chunk if b"def " in chunk and any(m in chunk for m in markers) else None
        named = defines = False
        tail = b""
        while chunk:
            window = tail + chunk
            named = named or any(m in window for m in markers)
            defines = defines or b"def " in window
            if named and defines:
                fh.seek(0)
                return fh.read()
            tail = window[-overlap:]
            chunk = fh.read(CHUNK)
    return None


def source_encoding(path: Path, data: bytes) -> str:
    """The encoding Python reads ``data`` with (PEP 263, as ``tokenize.open``):
    ``utf-8-sig`` with a byte-order mark, the coding declaration of the first
    two lines, else UTF-8. UsageError for a declaration Python rejects."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        if "unknown encoding" in str(exc) or "encoding problem" in str(exc):
            raise UsageError(f"{path}: bad coding declaration ({exc.msg})") from exc
        return "utf-8"  # undecodable first lines: reported by decode()
    if encoding != "utf-8-sig" and "# x".encode(encoding, "replace") != b"# x":
        # Python reads the declaration in ASCII bytes: the codec must agree.
        raise UsageError(f"{path}: bad coding declaration ({encoding} is not ASCII-compatible)")
    return encoding


def decode(path: Path, data: bytes) -> str:
    """The source text, decoded as Python would (:func:`source_encoding`);
    a UTF-8 byte-order mark is dropped (ast and libcst refuse it) and put
    back by :func:`encode`."""
    if b"\0" in data:
        raise UsageError(f"{path}: binary data (NUL bytes), not Python source")
    encoding = source_encoding(path, data)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        what = "UTF-8" if encoding.startswith("utf-8") else f"{encoding} (its coding declaration)"
        raise UsageError(f"{path}: not valid {what} ({exc.reason} at byte {exc.start})") from exc


def encode(path: Path, text: str, like: bytes) -> bytes:
    """``text`` in the encoding of the file whose bytes are ``like`` (its
    declaration, its byte-order mark); UsageError if a character of ``text``
    does not exist in that encoding."""
    encoding = source_encoding(path, like)
    try:
        return text.encode(encoding)
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise Refusal(
            f"the rewrite holds {bad!r}, which the file's encoding "
            f"{encoding} cannot hold; nothing was written",
            path,
        ) from exc


@functools.lru_cache(maxsize=64)
def _parse(text: str) -> ast.Module:
    # apply parses a text twice: the scan, then the proof's compile.
    return ast.parse(text)


def parse_ast(path: Path, text: str) -> ast.Module:
    try:
        return _parse(text)
    except SyntaxError as exc:
        raise UsageError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from exc
    except ValueError as exc:  # e.g. NUL bytes inside the source
        raise UsageError(f"{path}: cannot parse: {exc}") from exc


def module_imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> imported dotted name, for imports outside functions."""
    out: dict[str, str] = {}

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    out[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom):
                # Relative imports keep their dots (``.helpers.f``): the
                # resolver finds them beside the importing module.
                module = "." * node.level + (node.module or "")
                for a in node.names:
                    out[a.asname or a.name] = (
                        f"{module}.{a.name}" if module and node.module else module + a.name
                    )
            elif isinstance(node, (ast.If, ast.Try)):
                for block in (node.body, node.orelse, getattr(node, "finalbody", [])):
                    walk(block)
                for h in getattr(node, "handlers", []):
                    walk(h.body)

    walk(tree.body)
    return out
