"""What ``revert`` needs: each patched file's original bytes and checksums.

Kept inside the tree, in ``.gdn-backport/``: ``manifest.json`` maps a file's
tree-relative path to the sha256 of its original and of the bytes we wrote;
``originals/<path>`` holds the original bytes. A file is restored only while
it still holds exactly what we wrote, so a later local edit is never lost.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from gdn_backport import atomic
from gdn_backport.errors import UsageError

MANIFEST = "manifest.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Record:
    original_sha256: str
    patched_sha256: str
    strategy: str
    upstream: str
    tool_version: str


class Records:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / atomic.STATE_DIR
        self.entries: dict[str, Record] = {}
        manifest = self.state / MANIFEST
        if manifest.exists():
            try:
                raw = json.loads(manifest.read_text())
                self.entries = {k: Record(**v) for k, v in raw.items()}
            except (ValueError, TypeError) as exc:
                raise UsageError(f"{manifest}: unreadable record ({exc})") from exc

    def original_path(self, rel: str) -> Path:
        return self.state / "originals" / rel

    def add(self, rel: str, original: bytes, record: Record) -> None:
        """Keep the original; a second apply keeps the first original."""
        if rel in self.entries:
            first = self.entries[rel]
            record = Record(**{**asdict(record), "original_sha256": first.original_sha256})
        else:
            dest = self.original_path(rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_atomic(dest, original)
        self.entries[rel] = record

    def original(self, rel: str) -> bytes:
        data = self.original_path(rel).read_bytes()
        if sha256(data) != self.entries[rel].original_sha256:
            raise UsageError(f"{self.original_path(rel)}: stored original is corrupt")
        return data

    def drop(self, rel: str) -> None:
        self.entries.pop(rel, None)
        self.original_path(rel).unlink(missing_ok=True)

    def save(self) -> None:
        data = json.dumps({k: asdict(v) for k, v in sorted(self.entries.items())}, indent=2)
        self.state.mkdir(exist_ok=True)
        atomic.write_atomic(self.state / MANIFEST, (data + "\n").encode())
