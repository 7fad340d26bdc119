"""Strategy name -> codemod class, as the patchset names them."""

from __future__ import annotations

import importlib

from libcst.codemod import Codemod

from gdn_backport.errors import UsageError
from gdn_backport.patchset import load

CODEMODS = load().codemods


def codemod(strategy: str, source: str | None = None) -> Codemod:
    """A fresh codemod instance for ``strategy`` (``gather``, ``kernel``);
    ``source``: the text of the module it will be given, if known."""
    target = CODEMODS.get(strategy)
    if target is None:
        raise UsageError(f"--strategy {strategy}: no codemod in patchsets/pr51812.toml")
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    instance: Codemod = cls(source=source)
    return instance
