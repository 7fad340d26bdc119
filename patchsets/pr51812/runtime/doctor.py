"""pr51812's ``doctor`` rows: the GDN methods *in effect on their classes*.

Every module ``scan`` finds a spec path in is imported (after vLLM's general
plugins were loaded, so a hardware plugin's replacement or our own runtime
patch is what gets looked at), and each method in effect is analysed
(:mod:`.live`). A module that cannot be imported here is reported from its
file on disk, marked not in effect.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from gdn_backport.doctor import Row, on_disk
from gdn_backport.site import Site
from gdn_backport.tree import Tree

from .. import ID
from ..config import load
from ..scan import scan_tree_full
from . import live


def rows(package: Path, root: Path) -> list[Row]:
    patchset = load()
    sites = scan_tree_full(package, patchset, Tree.of(package).root).sites
    by_module: dict[str, list[Site]] = {}
    for s in sites:
        name = "vllm." + s.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        by_module.setdefault(name, []).append(s)
    out: list[Row] = []
    modules = []
    for name, found in by_module.items():
        try:
            modules.append(importlib.import_module(name))
        except Exception as exc:
            why = f"not importable here ({type(exc).__name__}: {exc})"[:120]
            for s in found:
                rel = f"vllm/{s.path}"
                out.append(
                    Row(
                        s.function,
                        name,
                        rel,
                        why,
                        s.status.value,
                        s.reason,
                        False,
                        on_disk(root, rel),
                        in_effect=False,
                        patchset=ID,
                    )
                )
    # Plugins' own GDN modules (vllm_ascend, ...) that loading them imported.
    modules += [m for m in live.gdn_modules(patchset) if m.__name__ not in by_module]
    _settle()
    for module in modules:
        for method in live.live_methods(module, patchset):
            out.append(
                Row(
                    method.qualname,
                    method.module,
                    method.path,
                    method.where.removeprefix(f"{root}/"),
                    method.status.value,
                    method.reason,
                    method.ours is not None,
                    on_disk(root, method.path),
                    patchset=ID,
                )
            )
    return out


def _settle() -> None:
    """What the first layer construction does in a server: our plugin, if
    loaded, checks the methods in effect again (a plugin loaded after it may
    have replaced one)."""
    from gdn_backport.runtime import hook

    from . import plugin

    if hook.watching(plugin.WATCH):
        plugin.settle()
