"""Results worth keeping across runs and variants: reference scores and alone
runs, on disk, one JSON file per key.

A reference score depends only on the model (shape, weights, seed) and the
token sequence; an alone run on the model, its engine configuration and its
requests. Neither runs code that the patchsets change (no speculative
decoding; one-token rows with zeroed fresh slots), so one cache serves every
variant of the installed vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["JsonCache", "key"]


def key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class JsonCache:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, k: str) -> Path:
        return self.folder / k[:2] / f"{k}.json"

    def get(self, k: str) -> Any | None:
        with contextlib.suppress(OSError, json.JSONDecodeError):
            return json.loads(self._path(k).read_text(encoding="utf-8"))
        return None

    def put(self, k: str, value: Any) -> None:
        path = self._path(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(value), encoding="utf-8")
        tmp.replace(path)
