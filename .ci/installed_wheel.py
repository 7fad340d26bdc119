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

if not resources.files("gdn_backport._matrix").joinpath("releases.toml").is_file():
    fail("package data gdn_backport._matrix/releases.toml is missing")

from gdn_backport import matrix, registry  # noqa: E402 (after the import checks)

# Every patchset folder of the checkout (the ids the noxfile passes) is a
# package of the wheel, with its data.
shipped = registry.available()
if sorted(shipped) != sorted(sys.argv[1:]) or not shipped:
    fail(f"patchsets found in the wheel: {shipped}, in the checkout: {sys.argv[1:]}")
for ps in registry.discover():
    where = Path(resources.files(ps.package).joinpath("patchset.toml").__fspath__())
    if site_packages not in where.resolve().parents:
        fail(f"patchset {ps.info.id} loads from {where}, not from the installed wheel")
    # Each patchset's codemods and plan import from the wheel.
    if not ps.codemods() or not ps.describe(ps.info.strategies[0]):
        fail(f"patchset {ps.info.id}: its codemods do not load")
    importlib.import_module(f"{ps.package}.plan")
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
    f" plugin {plugins[0].value}, patchsets {', '.join(shipped)},"
    f" {len(matrix.load().releases)} matrix releases, kernels ABI {kernels.ABI_VERSION}"
)
