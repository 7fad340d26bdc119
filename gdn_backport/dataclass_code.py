"""Compiled once: the methods ``@dataclass`` writes as source, for a command's imports.

``@dataclass`` writes each class's ``__init__``, ``__repr__``, ``__eq__``
(and more) as Python source and compiles it (``exec``) at every import:
libcst's node classes are 600-odd such functions, 0.1 s of each cold
process before any tree is read (docs/decisions.md). :func:`cached` keeps
the code objects compiled from those sources in files beside this
package's bytecode (``__pycache__``, named by the interpreter's cache tag
and optimisation level, as a ``.pyc`` is; one file per top-level package
the classes belong to, so ``--help`` reads no libcst's), and runs a source
seen before from its code object. ``exec`` of ``compile(source)`` with the
flags ``exec(source)`` would use is ``exec(source)``: each class is the
class it would be.

Only ``dataclasses``' own name ``exec`` is replaced (a module global, which
its functions find before the builtin; nothing else sees it), only in a
process running its own command (``cli.main``), and it is removed when the
command ends. The files are trusted as the bytecode beside them is (the
interpreter runs that too); they are written only where bytecode is
(``sys.dont_write_bytecode`` off) and can be, whole or not at all, and one
that does not load is no cache.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib.util
import marshal
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# A file's first bytes: ours, and the interpreter's bytecode version (a
# code object marshalled by another one does not load).
_MAGIC = b"gdn-backport dataclass code 1\n" + importlib.util.MAGIC_NUMBER
# A file past this many sources is rewritten with one run's only.
_LIMIT = 8192

Store = dict[str, types.CodeType]


def store_path(package: str) -> Path | None:
    """Where the compiled sources of ``package``'s dataclasses live: beside
    this package's bytecode (``sys.pycache_prefix`` and ``-O`` as for a
    ``.pyc``); None where the interpreter keeps no bytecode cache."""
    name = Path(__file__).with_name(f"dataclass-code.{package}.py")
    try:
        return Path(importlib.util.cache_from_source(str(name))).with_suffix(".marshal")
    except NotImplementedError:  # sys.implementation.cache_tag is None
        return None


def load(path: Path) -> Store:
    """The sources and their code objects in ``path``; empty where it is
    missing, foreign, from another interpreter or damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    if not data.startswith(_MAGIC):
        return {}
    try:
        store = marshal.loads(memoryview(data)[len(_MAGIC) :])
    except (EOFError, ValueError, TypeError):
        return {}
    if not isinstance(store, dict) or not all(
        type(k) is str and type(v) is types.CodeType for k, v in store.items()
    ):
        return {}
    return store


def save(path: Path, store: Store) -> None:
    """Add ``store`` to the file (what another process wrote meanwhile is
    kept), written whole (``atomic.write_atomic``: a reader sees the old
    file or the new one, with this package's mode bits, as a ``.pyc``
    has its source's); nothing where it cannot be."""
    from gdn_backport import atomic
    from gdn_backport.errors import UsageError

    merged = {**load(path), **store}
    if len(merged) > _LIMIT:
        merged = store
    with contextlib.suppress(OSError, UsageError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_atomic(path, _MAGIC + marshal.dumps(merged), like=Path(__file__))


class _Stores:
    """Each top-level package's file, read when its first class is made."""

    def __init__(self, where: Callable[[str], Path | None]) -> None:
        self._where = where
        self.loaded: dict[str, Store] = {}
        self.new: dict[str, Store] = {}  # compiled this run, not yet written
        self._hooked = False

    def code(self, source: str, package: str) -> types.CodeType:
        store = self.loaded.get(package)
        if store is None:
            path = self._where(package)
            store = self.loaded[package] = load(path) if path is not None else {}
        code = store.get(source)
        if code is None:
            # The flags exec() takes from its caller, dataclasses: no
            # ``from __future__`` (this module's are not inherited).
            code = store[source] = compile(source, "<string>", "exec", dont_inherit=True)
            self.new.setdefault(package, {})[source] = code
            if not self._hooked:
                self._hooked = True
                from gdn_backport import ahead

                # A forked child ends without the command's finally.
                ahead.at_child_exit(self.keep)
        return code

    def keep(self) -> None:
        """Write what was compiled anew (where bytecode is written)."""
        new, self.new = self.new, {}
        if sys.dont_write_bytecode:
            return
        for package, store in new.items():
            path = self._where(package)
            if path is not None:
                save(path, store)

    def unhook(self) -> None:
        if self._hooked:
            from gdn_backport import ahead

            ahead.at_child_exit(self.keep, remove=True)


def _exec_from(stores: _Stores) -> Any:
    def exec_(source: Any, globals: Any = None, locals: Any = None, /, **kwargs: Any) -> None:
        if globals is None:
            # exec() with no namespace runs in its caller's: dataclasses'.
            frame = sys._getframe(1)
            globals = frame.f_globals
            locals = frame.f_locals if locals is None else locals
        if type(source) is str:
            package = str(globals.get("__name__") or "").partition(".")[0]
            package = package if package.isidentifier() else "_"
            source = stores.code(source, package)
        builtins.exec(source, globals, locals, **kwargs)

    return exec_


@contextlib.contextmanager
def cached(where: Callable[[str], Path | None] = store_path) -> Iterator[_Stores]:
    """Dataclasses made meanwhile run their methods from the code objects
    of ``where(package)`` (default :func:`store_path`) where their source is
    there; the sources compiled anew are added to the files at the end."""
    stores = _Stores(where)
    if "exec" in vars(dataclasses):
        yield stores  # one already active: nothing changes
        return
    dataclasses.exec = _exec_from(stores)  # type: ignore[attr-defined]
    try:
        yield stores
    finally:
        del dataclasses.exec  # type: ignore[attr-defined]
        stores.unhook()
        stores.keep()
