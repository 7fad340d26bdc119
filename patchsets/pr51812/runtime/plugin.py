"""pr51812 in memory: the GDN spec path of every vLLM process fixed on its class.

Called by the general plugin (:mod:`gdn_backport.runtime.plugin`). For every
GDN module already imported, and for every one imported later (a post-import
hook, see :mod:`gdn_backport.runtime.hook`: model modules are imported after
the plugins load), each GDN method *in effect on its class* is analysed:
``affected`` -> rewritten with the ``gather`` codemod, proven, put on the
class, one INFO line; ``fixed``/``not_affected`` -> left alone; ``unknown``
(or a rewrite that cannot be proven) -> one ERROR line, the original left in
place. A hardware plugin loaded after this one may replace the method later:
the check runs again, once per class, when the first layer is constructed
(the model is built after every plugin of the process has loaded). A method
replaced after that is not seen (``gdn-backport doctor`` shows what is live).
"""

from __future__ import annotations

import importlib.machinery
import logging
import types
import weakref
from typing import TYPE_CHECKING, Any

from gdn_backport.runtime.plugin import LOGGER

if TYPE_CHECKING:
    from ..config import Patchset
    from .live import LiveMethod

WATCH = "pr51812-patch"  # this patchset's post-import watch (see gdn_backport.runtime.hook)
# Classes whose first construction re-checks them (at most once each), and
# those of them not constructed yet (class -> its module).
_WATCHED: weakref.WeakSet[type] = weakref.WeakSet()
_PENDING: weakref.WeakKeyDictionary[type, types.ModuleType] = weakref.WeakKeyDictionary()


def register() -> None:
    from ..config import load
    from . import live

    patchset = load()
    _watch_imports(patchset)
    for module in live.gdn_modules(patchset):
        patch_module(module, patchset)


def _watch_imports(patchset: Patchset) -> None:
    """Patch every ``vllm*`` module (``vllm_ascend``, ``vllm_gaudi`` too) whose
    file names a spec-token field (``scan``'s own sieve) right after it runs."""
    from pathlib import Path

    from gdn_backport.runtime import hook

    from .. import locate

    def accepts(spec: importlib.machinery.ModuleSpec) -> bool:
        origin = spec.origin or ""
        if not origin.endswith(".py"):
            return False
        try:
            return locate.mentions_fields(Path(origin).read_bytes(), patchset)
        except OSError:
            return False

    hook.watch(
        WATCH,
        hook.Watch(
            names=lambda name: name.split(".", 1)[0].startswith(hook.PREFIX),
            callback=lambda module: patch_module(module, patchset),
            accepts=accepts,
        ),
    )


def patch_module(module: types.ModuleType, patchset: Patchset | None = None) -> list[LiveMethod]:
    """Analyse the module's GDN methods as they are in effect, patch the
    affected ones; returns them as they are afterwards."""
    from ..config import load
    from . import live

    patchset = patchset or load()
    methods = live.live_methods(module, patchset)
    for method in methods:
        _handle(method, patchset)
        _recheck_on_init(method.owner, module, patchset)
    return live.live_methods(module, patchset)


def _handle(method: LiveMethod, patchset: Patchset) -> None:
    from gdn_backport.site import Status

    from ..codemods.base import Refusal
    from . import patch

    what = f"{method.qualname} ({method.location})"
    if method.ours is not None:
        LOGGER.debug("gdn-backport: %s: our patch is in effect", what)
        return
    if method.status is Status.UNKNOWN:
        LOGGER.error(
            "gdn-backport: %s: unknown: %s; left as it is, the bug may be live",
            what,
            method.reason,
        )
        return
    if method.status is not Status.AFFECTED:
        level = logging.INFO if method.status is Status.FIXED else logging.DEBUG
        LOGGER.log(level, "gdn-backport: %s: %s, left as it is", what, method.status.value)
        return
    try:
        new = patch.rewrite(method.function, method.source_path, patchset, method.owner)
    except Refusal as exc:
        LOGGER.error(
            "gdn-backport: %s: affected, and the rewrite was refused: %s; left as it is, "
            "the bug is live",
            what,
            exc,
        )
        return
    patch.install(method.owner, method.name, new)
    LOGGER.info(
        "gdn-backport: patched %s: affected -> fixed (vLLM PR #%s, %s)",
        what,
        patchset.upstream.rsplit("#", 1)[-1],
        patch.STRATEGY,
    )


def settle() -> None:
    """Run now the checks the first construction of each GDN class would run
    (``doctor`` shows what a server would have in effect)."""
    from ..config import load

    for cls, module in list(_PENDING.items()):
        if _PENDING.pop(cls, None) is not None:
            patch_module(module, load())


def _recheck_on_init(cls: type, module: types.ModuleType, patchset: Patchset) -> None:
    """Check the class once more when its first instance is built: plugins
    loaded after this one may have replaced a method by then."""
    import functools

    init = cls.__dict__.get("__init__")
    if init is None or cls in _WATCHED:
        return
    _WATCHED.add(cls)
    _PENDING[cls] = module

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if cls.__dict__.get("__init__") is __init__:
            cls.__init__ = init  # type: ignore[misc]  # one check per class
            if _PENDING.pop(cls, None) is not None:
                patch_module(module, patchset)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
