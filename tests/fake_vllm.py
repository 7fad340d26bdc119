"""A fake vLLM install for the plugin and doctor tests (vLLM is not installable here).

A ``site`` folder to put on ``sys.path`` with: a ``vllm`` package whose
``vllm.plugins.load_general_plugins`` loads entry points as vLLM does (the
``VLLM_PLUGINS`` filter, import errors logged and swallowed, the functions
called without a guard), a GDN module shaped like upstream's
(``vllm/model_executor/layers/gdn.py``, the gather codemod's affected
example plus an ``__init__``), our plugin's entry point, and optionally a
"hardware plugin" (``vllm_fakehw``) that replaces ``Layer._forward_core``.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from tests.conftest import AFFECTED, FIXED

PLUGINS = """\
import logging
import os
from importlib.metadata import distributions

logger = logging.getLogger(__name__)
plugins_loaded = False
# Only the distributions of this fake site: the environment running the tests
# has gdn-backport itself installed, with its real entry point.
SITE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def entry_points(group):
    return [
        ep for dist in distributions(path=[SITE]) for ep in dist.entry_points if ep.group == group
    ]


def load_general_plugins():
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else allowed.split(",")
    loaded = {}
    for ep in entry_points(group="vllm.general_plugins"):
        if allowed is None or ep.name in allowed:
            try:
                loaded[ep.name] = ep.load()
            except Exception:
                logger.exception("Failed to load plugin %s", ep.name)
    for func in loaded.values():
        func()
"""

INIT = """\
    def __init__(self, prefix="model.layers.0.linear_attn"):
        self.prefix = prefix

"""


def layer_module(method_source: str) -> str:
    """A module with ``class Layer`` (``__init__`` + the example's method)."""
    head, _, body = method_source.partition("class Layer:\n")
    return f"{head}class Layer:\n{INIT}{body}"


def hw_function(method_source: str) -> str:
    """The example's ``_forward_core`` as a module-level function."""
    body = method_source.split("class Layer:\n", 1)[1]
    return textwrap.dedent(body)


def _dist(site: Path, name: str, entry: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{entry}\n")


def make_site(
    root: Path,
    gdn: str = AFFECTED,
    ours: bool = True,
    hardware: str | None = None,
) -> Path:
    """The fake install under ``root/site``; ``hardware``: the source of the
    method a fake hardware plugin puts on ``Layer`` (None: no such plugin)."""
    site = root / "site"
    pkg = site / "vllm"
    layers = pkg / "model_executor" / "layers"
    layers.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0.0+fake"\n')
    (pkg / "plugins").mkdir()
    (pkg / "plugins" / "__init__.py").write_text(PLUGINS)
    (pkg / "model_executor" / "__init__.py").write_text("")
    (layers / "__init__.py").write_text("")
    (layers / "gdn.py").write_text(layer_module(gdn))
    if ours:
        _dist(site, "gdn_backport_fake", "gdn_backport = gdn_backport.runtime.plugin:register")
    if hardware is not None:
        hw = site / "vllm_fakehw"
        hw.mkdir()
        (hw / "__init__.py").write_text(
            "def register():\n"
            "    from vllm.model_executor.layers import gdn\n"
            "    from vllm_fakehw.ops import _forward_core\n"
            "    gdn.Layer._forward_core = _forward_core\n"
        )
        (hw / "ops.py").write_text(hw_function(hardware))
        _dist(site, "vllm_fakehw", "fakehw = vllm_fakehw:register")
    return site


def forget_fake() -> None:
    """Drop the fake's modules and our import hook from this process."""
    from gdn_backport.patchsets.pr51565 import runtime as split_runtime
    from gdn_backport.patchsets.pr51812.runtime import plugin as layer
    from gdn_backport.runtime import hook, plugin

    hook.unwatch(layer.WATCH)
    hook.unwatch(split_runtime.WATCH)
    plugin.forget()
    for name in [n for n in sys.modules if n.split(".", 1)[0] in ("vllm", "vllm_fakehw")]:
        del sys.modules[name]


__all__ = ["AFFECTED", "FIXED", "forget_fake", "hw_function", "layer_module", "make_site"]
