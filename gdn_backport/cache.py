"""A content-addressed cache of analysis results, in the tool's cache folder.

An entry is named by the SHA-256 of everything its result depends on
(:func:`key`): the tool itself (its version and the bytes of every module
and data file it runs, :func:`fingerprint`), the namespace of the result,
the configuration it was computed with (the patchset's data and the fork's
kernel declarations, :func:`stable`), and the contents of the files it read
(their SHA-256). A changed file, configuration or tool is therefore a miss,
never a stale hit. Entries are JSON documents under
``<cache>/analysis/<2 hex>/<64 hex>.json`` (``<cache>``: ``sources.cache_dir()``,
``$GDN_BACKPORT_CACHE`` or ``~/.cache/gdn-backport``), written atomically.

The cache only ever saves time: an entry that cannot be read or parsed, or
that does not hold what the reader expects, is ignored (the result is
recomputed and the entry rewritten); a folder that cannot be made or written
is simply not used for the rest of the process. ``GDN_BACKPORT_NO_CACHE=1``
turns it off. Nothing is ever written into the tree being analysed.

Within one command (:func:`run`, which ``cli.main`` and ``pipeline.apply``
enter) every result is also kept in memory, cache on or off: the same
name, so the same contents, is analysed once per command (a proof
re-analysing the tree with one file rewritten analyses that file again,
the others not). What is kept is the entry's document, read back as a disk
hit would be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from gdn_backport import __version__

if TYPE_CHECKING:
    from gdn_backport.site import Site

T = TypeVar("T")

# Raised whenever the layout or meaning of an entry changes.
FORMAT = 1

_state = {"broken": False}

# The running command's results: name -> the entry's document as JSON text
# (what a disk entry holds: a reader never shares objects with another).
_memo: ContextVar[dict[str, str] | None] = ContextVar("gdn_backport_cache_memo", default=None)


def enabled() -> bool:
    return not _state["broken"] and os.environ.get("GDN_BACKPORT_NO_CACHE", "") in ("", "0")


def folder() -> Path:
    """``<cache>/analysis``; ``<cache>`` as ``sources.cache_dir()`` says
    (not imported: the release machinery costs a scan 30 ms)."""
    root = os.environ.get("GDN_BACKPORT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "gdn-backport") / "analysis"


def _tool_files() -> list[Path]:
    import gdn_backport

    roots = [Path(p) for p in gdn_backport.__path__]
    try:
        shipped = importlib.import_module("gdn_backport.patchsets")
        roots += [Path(p) for p in shipped.__path__]
    except ImportError:  # pragma: no cover - a broken install
        pass
    found: set[Path] = set()
    for root in roots:
        for suffix in ("*.py", "*.toml"):
            found.update(p for p in root.rglob(suffix) if "__pycache__" not in p.parts)
    return sorted(found)


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """The tool's version and the bytes of every file of it (its modules,
    the patchsets' modules and data): a changed tool, released or not, names
    other entries."""
    h = hashlib.sha256(f"gdn-backport {__version__} format {FORMAT}\0".encode())
    for file in _tool_files():
        try:
            data = file.read_bytes()
        except OSError:
            data = b"\0unreadable"
        h.update(file.name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def stable(value: object) -> object:
    """``value`` as a JSON-able structure that is the same in every process
    (sets sorted; dataclasses by field; enums by value; paths as strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "@": type(value).__qualname__,
            **{f.name: stable(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, enum.Enum):
        return stable(value.value)
    if isinstance(value, (set, frozenset)):
        return sorted((stable(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [stable(v) for v in value]
    if isinstance(value, dict):
        return sorted(
            ([stable(k), stable(v)] for k, v in value.items()),
            key=lambda kv: json.dumps(kv, sort_keys=True),
        )
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"no stable form for {type(value).__name__}")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key(namespace: str, *parts: object) -> str:
    """The entry's name: the tool, ``namespace`` and ``parts`` (made
    :func:`stable`), hashed."""
    doc = json.dumps([fingerprint(), namespace, stable(list(parts))], sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()


def _path(name: str) -> Path:
    return folder() / name[:2] / f"{name}.json"


def load(name: str) -> object | None:
    """The entry's document, or None (missing, unreadable, not JSON)."""
    if not enabled():
        return None
    try:
        with _path(name).open("rb") as fh:
            doc = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != name or "value" not in doc:
        return None
    value: object = doc["value"]
    return value


def stored(name: str) -> bool:
    """An entry is on disk under ``name`` (it may still not :func:`load`)."""
    return enabled() and _path(name).is_file()


def store(name: str, value: object) -> None:
    """Write the entry (atomically); a cache that cannot be written is not
    used again in this process."""
    if not enabled():
        return
    target = _path(name)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"key": name, "value": value}, fh)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, TypeError, ValueError):
        _state["broken"] = True


@contextlib.contextmanager
def run() -> Iterator[None]:
    """One command: within it, a result computed (or read from disk) once is
    read back from memory; entered again inside, the outer run's memory is
    used. Left, it is forgotten (a later command analyses afresh)."""
    if _memo.get() is not None:
        yield
        return
    token = _memo.set({})
    try:
        yield
    finally:
        _memo.reset(token)


def snapshot() -> dict[str, str]:
    """This command's results so far (a child's, for :mod:`gdn_backport.ahead`)."""
    return dict(_memo.get() or {})


def remember_all(entries: dict[str, str]) -> None:
    """Results another process of this command made: named by content, so
    each is what this one would compute (names it holds are kept)."""
    memo = _memo.get()
    if memo is not None:
        for name, doc in entries.items():
            memo.setdefault(name, doc)


def _remember(name: str, doc: object) -> None:
    memo = _memo.get()
    if memo is not None:
        with contextlib.suppress(TypeError, ValueError):
            memo[name] = json.dumps(doc)


def cached(
    name: str,
    compute: Callable[[], T],
    dump: Callable[[T], object],
    read: Callable[[object], T],
) -> T:
    """The result named ``name``: read back from this command's memory or
    the cache (``read`` of the stored document; any error there is a miss),
    else computed and stored (``dump`` makes it a JSON document; None: not
    stored, nor kept in memory)."""
    memo = _memo.get()
    kept = None if memo is None else memo.get(name)
    if kept is not None:
        try:
            return read(json.loads(kept))
        except Exception:  # pragma: no cover - a reader that rejects its own document
            pass
    doc = load(name)
    if doc is not None:
        try:
            value = read(doc)
        except Exception:  # a corrupt or foreign entry: recompute
            pass
        else:
            _remember(name, doc)
            return value
    value = compute()
    try:
        dumped = dump(value)
    except Exception:  # pragma: no cover - a result we cannot store
        return value
    if dumped is not None:  # None: this result must not be kept
        _remember(name, dumped)
        store(name, dumped)
    return value


def dump_sites(sites: Iterable[Site]) -> list[object]:
    return [
        [s.path, s.line, s.function, s.status.value, s.reason, s.via, s.target, s.patchset]
        for s in sites
    ]


def read_sites(doc: object) -> list[Site]:
    """Sites back from :func:`dump_sites` (ValueError or TypeError on anything
    else: the entry is ignored)."""
    from gdn_backport.site import Site, Status

    if not isinstance(doc, list):
        raise TypeError("not a list of sites")
    out = []
    for path, line, function, status, reason, via, target, patchset in doc:
        if not (
            isinstance(path, str)
            and type(line) is int
            and isinstance(function, str)
            and isinstance(reason, str)
            and isinstance(patchset, str)
            and (target is None or isinstance(target, str))
            and (via is None or (isinstance(via, list) and all(isinstance(v, str) for v in via)))
        ):
            raise TypeError("not a site")
        out.append(
            Site(
                path,
                line,
                function,
                Status(status),
                reason,
                None if via is None else tuple(via),
                target,
                patchset,
            )
        )
    return out
