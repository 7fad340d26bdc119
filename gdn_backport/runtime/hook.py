"""Post-import callbacks: run code right after chosen modules execute.

vLLM loads general plugins early (engine args, engine core, each worker)
and imports model modules and the attention backends later, when the model
is resolved. One finder at the front of ``sys.meta_path`` serves every
*watch* of this process (the plugin's GDN patch, the probe's builder wrap):
for a module name a watch selects, it asks the finders after it for the
spec and, when the watch also accepts the spec, wraps its loader so the
callbacks run right after the module's code, before anyone can use its
classes. Anything a callback raises propagates out of the import: loud,
never swallowed (a callback that must not break the import catches itself).

Standard library only: the probe imports this module where nothing heavy
may be imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Callback = Callable[[types.ModuleType], object]
# The module names worth a look: vLLM and its hardware plugins (vllm_ascend, ...).
PREFIX = "vllm"


@dataclass(frozen=True)
class Watch:
    names: Callable[[str], bool]  # which module names to look at (cheap)
    callback: Callback
    accepts: Callable[[importlib.machinery.ModuleSpec], bool] | None = None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callbacks: list[Callback]) -> None:
        self._inner = inner
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_code, is_package, resource readers: the real loader's.
        return getattr(self._inner, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it, wraps their loader."""

    def __init__(self) -> None:
        self.watches: dict[str, Watch] = {}
        # Another wrapping finder may ask every finder but itself, this one
        # included, while we ask it: answer None for a name being resolved.
        # Imports of one name are serialised by importlib's module lock.
        self._busy: set[str] = set()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        selected = [w for w in self.watches.values() if w.names(fullname)]
        if not selected or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = self._find_later(fullname, path, target)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        callbacks = [w.callback for w in selected if w.accepts is None or w.accepts(spec)]
        if callbacks:
            spec.loader = _Loader(spec.loader, callbacks)
        return spec

    def _find_later(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        finders = list(sys.meta_path)
        later = finders[finders.index(self) + 1 :] if self in finders else finders
        for finder in later:
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = (
                find(fullname, path, target) if find is not None else None
            )
            if spec is not None:
                return spec
        return None


def installed() -> PostImportFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, PostImportFinder)), None)


def watching(key: str) -> bool:
    finder = installed()
    return finder is not None and key in finder.watches


def watch(key: str, spec: Watch) -> PostImportFinder:
    """Add (or replace) the watch ``key``; one finder per process."""
    finder = installed()
    if finder is None:
        finder = PostImportFinder()
        sys.meta_path.insert(0, finder)
    finder.watches[key] = spec
    return finder


def unwatch(key: str) -> bool:
    """Drop the watch ``key``; the finder goes when no watch is left."""
    finder = installed()
    if finder is None or finder.watches.pop(key, None) is None:
        return False
    if not finder.watches:
        sys.meta_path.remove(finder)
    return True
