"""Strategy name -> codemod class, as the patchset names them."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from gdn_backport.codemods.base import SiteCodemod
from gdn_backport.errors import UsageError
from gdn_backport.patchset import load

CODEMODS = load().codemods


def codemod_class(strategy: str) -> type[SiteCodemod]:
    """The codemod class the patchset names for ``strategy``."""
    target = CODEMODS.get(strategy)
    if target is None:
        raise UsageError(f"--strategy {strategy}: no codemod in patchsets/pr51812.toml")
    module, _, name = target.rpartition(".")
    cls: type[SiteCodemod] = getattr(importlib.import_module(module), name)
    return cls


def describe(strategy: str) -> str:
    """``gather (what it does)``: the strategy and its codemod's DESCRIPTION."""
    return f"{strategy} ({codemod_class(strategy).DESCRIPTION})"


def codemod(
    strategy: str, source: str | None = None, tree: Path | None = None, **kwargs: Any
) -> SiteCodemod:
    """A fresh codemod instance for ``strategy`` (``gather``, ``kernel``);
    ``source``: the text of the module it will be given, ``tree``: the tree
    that module belongs to (the kernel strategy reads the tree's kernel);
    ``kwargs``: more of :class:`~gdn_backport.codemods.base.SiteCodemod`'s
    arguments (``path``, ``patchset``, ``entries``)."""
    return codemod_class(strategy)(source=source, tree=tree, **kwargs)
