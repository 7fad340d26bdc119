"""Checks run inside a fresh venv that holds only the built wheel (nox -s wheel).

Run from a folder outside the checkout, so nothing can come from the source
tree: every check below reads the installed distribution.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import sys
import sysconfig
from importlib import resources
from pathlib import Path

site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()


def fail(msg: str) -> None:
    sys.exit(f"installed wheel: {msg}")


for name in ("gdn_backport", "gdn_backport_kernels"):
    module = importlib.import_module(name)
    where = Path(module.__file__ or "").resolve()
    if site_packages not in where.parents:
        fail(f"{name} imported from {where}, not from the installed wheel")
    if not resources.files(name).joinpath("py.typed").is_file():
        fail(f"{name} has no py.typed")

for package, want in (("gdn_backport._patchsets", "pr51812.toml"),
                      ("gdn_backport._patchsets", "pr51565.toml"),
                      ("gdn_backport._matrix", "releases.toml")):  # fmt: skip
    if not resources.files(package).joinpath(want).is_file():
        fail(f"package data {package}/{want} is missing")

from gdn_backport import matrix
from gdn_backport.patchsets.pr51812 import config as patchset

ps = patchset.load("pr51812")
if not ps.strategies:
    fail("the patchset pr51812 loads with no strategies")
if fixes.available() != ("pr51812", "pr51565"):
    fail(f"patchsets found: {fixes.available()}")
for fix in map(fixes.load_fix, fixes.available()):
    # Each patchset's engine and codemods import from the wheel.
    if not hasattr(fix.engine, "apply_tree") or not fix.describe(fix.strategies[0]):
        fail(f"patchset {fix.id}: its engine {fix.engine_module} does not load")
if not matrix.load().releases:
    fail("matrix/releases.toml loads with no releases")

plugins = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "gdn_backport"]
if len(plugins) != 1:
    fail(f"entry point vllm.general_plugins:gdn_backport found {len(plugins)} times")
register = plugins[0].load()
register()  # vLLM is not installed here: the plugin must do nothing and raise nothing

kernels = importlib.import_module("gdn_backport_kernels")
missing = [n for n in kernels.__all__ if not hasattr(kernels, n)]
if missing or kernels.ABI_VERSION != 1:
    fail(f"gdn_backport_kernels: ABI {kernels.ABI_VERSION}, missing {missing}")

dist = md.distribution("gdn-backport")
site = Path(str(dist.locate_file(""))).resolve()
print(
    f"installed wheel ok: gdn-backport {dist.version} at {site},"
    f" plugin {plugins[0].value}, patchset strategies {list(ps.strategies)},"
    f" {len(matrix.load().releases)} matrix releases, kernels ABI {kernels.ABI_VERSION}"
)
