"""vLLM general plugin: every patchset's run-time part, nothing on disk.

Registered as ``gdn_backport`` in the entry-point group
``vllm.general_plugins``; vLLM calls :func:`register` in every process it
starts (``VLLM_PLUGINS`` selects plugins by name). vLLM logs and swallows an
exception raised while *importing* a plugin, which would silently leave the
bug in place: this module imports nothing but the standard library, and
everything else is imported inside :func:`register`, where an exception
propagates through vLLM's call and stops the process.

What register() does: nothing when vLLM is absent (no import of torch,
libcst or our analysis); else the reachability probe when asked for
(``GDN_BACKPORT_PROBE=1``, :mod:`.probe`), then each patchset's
``runtime_register`` (:mod:`gdn_backport.registry`): a patchset fixes its
code in memory where it can (the GDN layer's spec path) and reports, one
ERROR line each, what it cannot.
"""

from __future__ import annotations

import logging
import os

LOGGER = logging.getLogger("gdn_backport")
_REGISTERED: list[str] = []


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
    from gdn_backport import registry
    from gdn_backport.runtime import probe

    probe.install_from_env()
    for ps in registry.discover():
        ps.runtime_register()
        if ps.info.id not in _REGISTERED:
            _REGISTERED.append(ps.info.id)


def loaded() -> bool:
    """Whether :func:`register` ran in this process."""
    return bool(_REGISTERED)


def forget() -> None:
    """Forget that :func:`register` ran (tests drop a fake vLLM this way)."""
    _REGISTERED.clear()
