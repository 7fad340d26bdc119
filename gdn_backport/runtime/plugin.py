"""vLLM general plugin: fix the GDN spec path in memory, nothing on disk.

Registered as ``gdn_backport`` in the entry-point group
``vllm.general_plugins``; vLLM calls :func:`register` in every process it
starts (``VLLM_PLUGINS`` selects plugins by name). vLLM logs and swallows an
exception raised while *importing* a plugin, which would silently leave the
bug in place: this module imports nothing but the standard library, and
everything else is imported inside :func:`register`, where an exception
propagates through vLLM's call and stops the process.

What register() does:

* vLLM absent: nothing (no import of torch, libcst or our analysis).
* for every GDN module already imported, and for every one imported later
  (a post-import hook, see :mod:`.hook`: model modules are imported after the
  plugins load), each GDN method *in effect on its class* is analysed:
  ``affected`` -> rewritten with the ``gather`` codemod, proven, put on the
  class, one INFO line; ``fixed``/``not_affected`` -> left alone;
  ``unknown`` (or a rewrite that cannot be proven) -> one ERROR line, the
  original left in place.
* a hardware plugin loaded after this one may replace the method later: the
  check runs again, once per class, when the first layer is constructed (the
  model is built after every plugin of the process has loaded). A method
  replaced after that is not seen (``gdn-backport doctor`` shows what is live).
* patchset pr51565 (a new request's one-token chunk read as a decode) is not
  patched in memory: its fix spans the metadata builder and the model
  runner, which a process has built and captured graphs with before any
  layer runs. Each builder or runner module imported is analysed from its
  file (:mod:`gdn_backport.prior_state.analysis`, runner verdicts settled
  with the builders seen so far) and every affected or unknown site gets
  one ERROR line naming the fix: ``gdn-backport apply --installed
  --patchset pr51565``.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import types
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gdn_backport.patchset import Patchset
    from gdn_backport.runtime.live import LiveMethod

LOGGER = logging.getLogger("gdn_backport")
WATCH = "pr51812-patch"  # this plugin's post-import watch (see .hook)
WATCH_SPLIT = "pr51565-check"  # the watch that reports pr51565 sites
# Classes whose first construction re-checks them (at most once each), and
# those of them not constructed yet (class -> its module).
_WATCHED: weakref.WeakSet[type] = weakref.WeakSet()
_PENDING: weakref.WeakKeyDictionary[type, types.ModuleType] = weakref.WeakKeyDictionary()


def _ensure_visible() -> None:
    """vLLM configures its own ``vllm`` loggers only: without a handler of
    ours, INFO lines would go nowhere. Add one unless the application
    configured logging for us (a handler on our logger or on the root)."""
    if not LOGGER.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s"))
        LOGGER.addHandler(handler)
        if LOGGER.level == logging.NOTSET:
            LOGGER.setLevel(os.environ.get("GDN_BACKPORT_LOG_LEVEL", "INFO").upper())


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see module docs)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        LOGGER.debug("gdn-backport: vLLM is not importable here; nothing to do")
        return
    _ensure_visible()
    if importlib.util.find_spec("gdn_backport.runtime.probe") is not None:
        from gdn_backport.runtime import probe

        probe.install_from_env()

    from gdn_backport.patchset import load
    from gdn_backport.runtime import live

    patchset = load()
    _watch_imports(patchset)
    for module in live.gdn_modules(patchset):
        patch_module(module, patchset)
    _watch_split()


class _SplitReport:
    """pr51565's sites of the modules imported so far, each reported once."""

    def __init__(self) -> None:
        from gdn_backport.prior_state.config import load

        self.cfg = load()
        from gdn_backport.prior_state.engine import markers

        self.marks = markers(self.cfg)
        self.seen: dict[str, list[Any]] = {}
        self.reported: set[tuple[str, str, str]] = set()

    def accepts(self, spec: importlib.machinery.ModuleSpec) -> bool:
        origin = spec.origin or ""
        if not origin.endswith(".py"):
            return False
        try:
            with open(origin, "rb") as fh:
                data = fh.read()
        except OSError:
            return False
        return b"def " in data and any(m in data for m in self.marks)

    def module(self, module: types.ModuleType) -> None:
        import ast

        from gdn_backport.analysis import Status
        from gdn_backport.prior_state.analysis import analyse_module, settle

        origin = getattr(module, "__file__", None) or ""
        try:
            with open(origin, encoding="utf-8") as fh:
                text = fh.read()
            found = analyse_module(ast.parse(text), text, self.cfg)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            return
        if not found:
            return
        self.seen[module.__name__] = [(module.__name__, f) for f in found]
        pairs = [pair for pairs in self.seen.values() for pair in pairs]
        settled = settle([f for _, f in pairs])
        for (name, _), f in zip(pairs, settled, strict=True):
            key = (name, f.function, f.kind)
            if f.status in (Status.AFFECTED, Status.UNKNOWN) and key not in self.reported:
                self.reported.add(key)
                LOGGER.error(
                    "gdn-backport: %s.%s: %s for vLLM #51565 (%s); the plugin does not patch "
                    "this in memory: run `gdn-backport apply --installed --patchset pr51565`",
                    name,
                    f.function,
                    f.status.value,
                    f.reason,
                )


def _watch_split() -> None:
    import sys

    from gdn_backport.runtime import hook, live

    report = _SplitReport()
    hook.watch(
        WATCH_SPLIT,
        hook.Watch(
            names=lambda name: name.split(".", 1)[0].startswith(live.PREFIX),
            callback=report.module,
            accepts=report.accepts,
        ),
    )
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        ours = name.split(".", 1)[0].startswith(live.PREFIX)
        if ours and spec is not None and report.accepts(spec):
            report.module(module)


def _watch_imports(patchset: Patchset) -> None:
    """Patch every ``vllm*`` module (``vllm_ascend``, ``vllm_gaudi`` too) whose
    file names a spec-token field (``scan``'s own sieve) right after it runs."""
    from pathlib import Path

    from gdn_backport import locate
    from gdn_backport.runtime import hook, live

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
            names=lambda name: name.split(".", 1)[0].startswith(live.PREFIX),
            callback=lambda module: patch_module(module, patchset),
            accepts=accepts,
        ),
    )


def patch_module(module: types.ModuleType, patchset: Patchset | None = None) -> list[LiveMethod]:
    """Analyse the module's GDN methods as they are in effect, patch the
    affected ones; returns them as they are afterwards."""
    from gdn_backport.patchset import load
    from gdn_backport.runtime import live

    patchset = patchset or load()
    methods = live.live_methods(module, patchset)
    for method in methods:
        _handle(method, patchset)
        _recheck_on_init(method.owner, module, patchset)
    return live.live_methods(module, patchset)


def _handle(method: LiveMethod, patchset: Patchset) -> None:
    from gdn_backport.analysis import Status
    from gdn_backport.codemods.base import Refusal
    from gdn_backport.runtime import patch

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
    from gdn_backport.patchset import load

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
