"""What ``revert`` needs: each patched file's original bytes and checksums.

Kept inside the tree, in ``.gdn-backport/``:

- ``manifest.json``: ``{"format": 2, "records": [{"path", "original_sha256",
  "patched_sha256", "strategy", "upstream", "tool_version"}, ...]}``, one
  record per file *and* per bytes we wrote;
- ``originals/<original_sha256>``: the original bytes.

A record follows the file we patched, not the checkout that is there now:
``revert`` restores a file only while it holds exactly the bytes of one of
its records (``patched_sha256``), so a later local edit is never lost, and
a file that holds its original (the base branch after ``apply --commit``,
a file reverted by other means) keeps its record for the checkout where it
is patched.

Nothing in the records is trusted: on load every path must be a relative
POSIX path below the tree (below ``within``, ``vllm`` for ``--installed``)
that passes through no symbolic link, every hash 64 lowercase hex digits,
every stored original present and of its hash. Anything else is a refusal
(UsageError, exit 2) before anything is written.

Format 1 (``{path: {original_sha256, ...}}`` with ``originals/<path>``) is
still read; the next write saves format 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path, PurePosixPath

from gdn_backport import atomic
from gdn_backport.errors import UsageError

MANIFEST = "manifest.json"
ORIGINALS = "originals"
FORMAT = 2
_SHA = re.compile(r"[0-9a-f]{64}")
_KEYS = frozenset(
    ("path", "original_sha256", "patched_sha256", "strategy", "upstream", "tool_version")
)
# What to do about a record that cannot be used, said once in every refusal.
_NEXT = "fix or restore .gdn-backport/, or delete it to forget every record"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Record:
    path: str  # relative to the tree, POSIX separators
    original_sha256: str
    patched_sha256: str  # the bytes we wrote
    strategy: str
    upstream: str
    tool_version: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.path, self.patched_sha256)


assert {f.name for f in fields(Record)} == _KEYS


def check_path(root: Path, rel: object, within: str | None = None) -> str:
    """``rel`` if it names a place inside ``root`` (and below ``within``)
    reached through no symbolic link; else UsageError (naming the tree).
    A missing file is fine here: ``revert`` says so for the file."""
    where = f"{root / atomic.STATE_DIR / MANIFEST}: record path {rel!r}"
    if not isinstance(rel, str) or not rel:
        raise UsageError(f"{where}: not a path; {_NEXT}")
    parts = rel.split("/")
    if (
        "\\" in rel
        or any(ord(c) < 32 or ord(c) == 127 for c in rel)  # NUL, newlines: no file of ours
        or PurePosixPath(rel).is_absolute()
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise UsageError(f"{where}: not a relative path inside the tree; {_NEXT}")
    if parts[0] == atomic.STATE_DIR:
        raise UsageError(f"{where}: inside the records folder; {_NEXT}")
    if within is not None and (len(parts) < 2 or parts[0] != within):
        raise UsageError(f"{where}: not inside {root / within}; {_NEXT}")
    here = root
    for i, part in enumerate(parts):
        here = here / part
        try:
            mode = os.lstat(here).st_mode
        except OSError:
            break  # missing from here on
        if stat.S_ISLNK(mode):
            raise UsageError(f"{where}: passes through the symbolic link {here}; {_NEXT}")
        if i == len(parts) - 1 and not stat.S_ISREG(mode):
            raise UsageError(f"{where}: {here} is not a regular file; {_NEXT}")
    return rel


def _real_folder(path: Path) -> bool:
    """``path`` is a folder, not a link to one (False if missing)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


class Records:
    """The records of one tree; :meth:`save` writes them back."""

    def __init__(self, root: Path, within: str | None = None) -> None:
        self.root = root
        self.within = within
        self.state = root / atomic.STATE_DIR
        self.manifest = self.state / MANIFEST
        self.folder = self.state / ORIGINALS
        self._records: dict[tuple[str, str], Record] = {}
        # Format 1 kept an original at originals/<path>: where to read it.
        self._legacy: dict[str, Path] = {}
        # What this instance found and made: a run that ends with the records
        # it found (a refused write) leaves the folder as it was.
        self._found: bytes | None = None  # the manifest's bytes (None: no manifest)
        self._made: list[Path] = []  # folders and stored originals made here
        self._saved = False  # the manifest on disk is one this instance wrote
        self._load()
        self._loaded = dict(self._records)

    # -- loading and checking ------------------------------------------------------

    def _refuse(self, why: str) -> UsageError:
        return UsageError(f"{self.manifest}: {why}; {_NEXT}")

    def _load(self) -> None:
        try:
            mode = os.lstat(self.state).st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise UsageError(f"{self.state}: cannot read ({exc.strerror})") from exc
        if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
            raise UsageError(
                f"{self.state}: not a folder (a symbolic link?); gdn-backport keeps its "
                "records in a real folder of the tree: remove it"
            )
        try:
            mode = os.lstat(self.manifest).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            raise self._refuse("not a regular file")
        try:
            self._found = self.manifest.read_bytes()
            raw = json.loads(self._found)
        except OSError as exc:
            raise UsageError(f"{self.manifest}: cannot read ({exc.strerror})") from exc
        except ValueError as exc:
            raise self._refuse(f"unreadable record ({exc})") from exc
        if isinstance(raw, dict) and "format" in raw:
            if raw.get("format") != FORMAT or set(raw) != {"format", "records"}:
                raise self._refuse(f"unknown record format {raw.get('format')!r}")
            entries = raw["records"]
            if not isinstance(entries, list):
                raise self._refuse("'records' is not a list")
            for entry in entries:
                self._take(entry)
        elif isinstance(raw, dict):  # format 1
            for rel, entry in raw.items():
                if not isinstance(entry, dict) or "path" in entry:
                    raise self._refuse(f"record {rel!r} is not an object of format 1")
                record = self._take({"path": rel, **entry})
                self._legacy[record.original_sha256] = self.folder / record.path
        else:
            raise self._refuse("not a record object")
        if self._records and not _real_folder(self.folder):
            raise self._refuse(f"{self.folder} is missing or not a folder")
        for record in self._records.values():
            self.original(record)  # present, a regular file, of its hash

    def _take(self, entry: object) -> Record:
        if not isinstance(entry, dict) or set(entry) != _KEYS:
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise self._refuse(f"a record must have exactly the keys {sorted(_KEYS)}, not {keys}")
        for name in _KEYS:
            if not isinstance(entry[name], str):
                raise self._refuse(f"record field {name!r} is not a string")
        record = Record(**entry)
        check_path(self.root, record.path, self.within)
        for name in ("original_sha256", "patched_sha256"):
            if not _SHA.fullmatch(getattr(record, name)):
                raise self._refuse(
                    f"record of {record.path}: {name} is not 64 lowercase hex digits"
                )
        if record.original_sha256 == record.patched_sha256:
            raise self._refuse(f"record of {record.path}: original and patched hashes are equal")
        if record.key in self._records:
            raise self._refuse(f"two records of {record.path} with one patched hash")
        self._records[record.key] = record
        return record

    # -- queries ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Record]:
        return iter(sorted(self._records.values(), key=lambda r: r.key))

    def __len__(self) -> int:
        return len(self._records)

    def paths(self) -> list[str]:
        return sorted({r.path for r in self._records.values()})

    def for_path(self, rel: str) -> list[Record]:
        return [r for r in self if r.path == rel]

    def matching(self, rel: str, current_sha256: str) -> Record | None:
        """The record whose patched bytes ``rel`` holds now, if any."""
        return self._records.get((rel, current_sha256))

    def original_path(self, record: Record) -> Path:
        return self._legacy.get(record.original_sha256) or self.folder / record.original_sha256

    def original(self, record: Record) -> bytes:
        """The stored original, checked again: UsageError if missing or changed."""
        path = self.original_path(record)
        check = path.relative_to(self.folder).as_posix()
        # The stored original too: no link on the way (format 1 keeps folders).
        here = self.folder
        for part in check.split("/"):
            here = here / part
            try:
                mode = os.lstat(here).st_mode
            except OSError:
                raise UsageError(
                    f"{path}: the stored original of {record.path} is missing; "
                    f"revert cannot restore it ({_NEXT})"
                ) from None
            if stat.S_ISLNK(mode):
                raise UsageError(f"{path}: is a symbolic link, not a stored original; {_NEXT}")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{path}: not a regular file, not a stored original; {_NEXT}")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
        if sha256(data) != record.original_sha256:
            raise UsageError(
                f"{path}: the stored original of {record.path} is corrupt (its sha256 "
                f"differs from the record's); {_NEXT}"
            )
        return data

    # -- changes (the caller holds the tree lock) -----------------------------------

    def add(self, record: Record, original: bytes) -> Record | None:
        """Keep ``original`` and the record; the record it replaces (same file
        and same patched bytes, another original: the newer one wins), if any."""
        check_path(self.root, record.path, self.within)
        if sha256(original) != record.original_sha256:
            raise ValueError("the original's sha256 differs from the record's")
        dest = self.folder / record.original_sha256
        for folder in (self.state, self.folder):
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
                self._made.append(folder)
        if not (dest.is_file() and sha256(dest.read_bytes()) == record.original_sha256):
            new = not os.path.lexists(dest)
            try:
                atomic.write_atomic(dest, original)
            except (OSError, UsageError):
                self._undo()
                raise
            if new:
                self._made.append(dest)
        self._legacy.pop(record.original_sha256, None)
        replaced = self._records.get(record.key)
        self._records[record.key] = record
        return replaced

    def remove(self, record: Record) -> None:
        self._records.pop(record.key, None)

    def put_back(self, record: Record) -> None:
        self._records[record.key] = record

    def save(self) -> None:
        """Write the manifest (atomically) in format 2. Originals still named
        by the old layout are copied to their content address first. With
        the records it loaded (a failed write took its records back), the
        folder is put back as it was found instead: no manifest or original
        of this instance's is left."""
        if self._records == self._loaded:
            if self._saved:
                if self._found is None:
                    self.manifest.unlink(missing_ok=True)
                else:
                    atomic.write_atomic(self.manifest, self._found)
                self._saved = False
            self._undo()
            return
        for record in self._records.values():
            if record.original_sha256 in self._legacy:
                self.add(record, self.original(record))
        doc = {"format": FORMAT, "records": [asdict(r) for r in self]}
        self.state.mkdir(exist_ok=True)
        data = json.dumps(doc, indent=2) + "\n"
        try:
            # The records stay out of the user's git status (and commits):
            # every run that writes them mends a .gitignore a full disk left empty.
            atomic.ensure_gitignore(self.state)
            atomic.write_atomic(self.manifest, data.encode())
        except (OSError, UsageError):
            self._undo()
            raise
        self._saved = True

    def _undo(self) -> None:
        """Remove the stored originals and folders this instance made, while
        no manifest of its own names them."""
        if self._saved:
            return
        for path in reversed(self._made):
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                else:
                    path.unlink()
        self._made.clear()

    def collect(self) -> list[Path]:
        """Remove stored originals no record names (and format 1's folders);
        call after :meth:`save`, under the lock. Returns what was removed."""
        if not _real_folder(self.folder):
            return []
        keep = {self.original_path(r) for r in self._records.values()}
        removed = []
        for dirpath, dirnames, filenames in os.walk(self.folder, topdown=False):
            for name in filenames:
                path = Path(dirpath, name)
                if path not in keep:
                    path.unlink(missing_ok=True)
                    removed.append(path)
            for name in dirnames:
                sub = Path(dirpath, name)
                if sub.is_symlink():
                    continue
                with contextlib.suppress(OSError):
                    sub.rmdir()  # format 1's folders, once empty
        return removed
