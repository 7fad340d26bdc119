"""pr51565 at run time: reported, not patched in memory.

Its fix spans the metadata builder and the model runner, which a process has
built (and captured CUDA graphs with) before any layer runs, so the general
plugin does not rewrite them in memory. Each builder or runner module a
vLLM process imports is analysed from its file (:mod:`.analysis`, runner
verdicts settled with the builders seen so far) and every affected or
unknown site gets one ERROR line naming the fix.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

from gdn_backport.runtime.plugin import LOGGER

from . import PATCHSET

WATCH = "pr51565-check"  # the watch that reports this patchset's sites


def register() -> None:
    import sys

    from gdn_backport.runtime import hook

    report = _SplitReport()
    hook.watch(
        WATCH,
        hook.Watch(
            names=lambda name: name.split(".", 1)[0].startswith(hook.PREFIX),
            callback=report.module,
            accepts=report.accepts,
        ),
    )
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        ours = name.split(".", 1)[0].startswith(hook.PREFIX)
        if ours and spec is not None and report.accepts(spec):
            report.module(module)


class _SplitReport:
    """pr51565's sites of the modules imported so far, each reported once."""

    def __init__(self) -> None:
        from .config import load

        self.cfg = load()
        from .plan import markers

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

        from gdn_backport.site import Status

        from .analysis import analyse_module, settle

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
                    "gdn-backport: %s.%s: %s for vLLM #%s (%s); the plugin does not patch "
                    "this in memory: run `gdn-backport apply --installed --patchset %s` "
                    "(a read-only image: apply it where the image is built)",
                    name,
                    f.function,
                    f.status.value,
                    PATCHSET.info.number,
                    f.reason,
                    PATCHSET.info.id,
                )
