"""``--installed``: the ``vllm`` this interpreter would import, patched in place.

Found with ``importlib.util.find_spec("vllm")``: for a top-level name that
only asks the path finders where the package is; nothing of vLLM runs. The
tree is the folder holding ``vllm/`` (site-packages, or the checkout of an
editable install); only ``vllm/`` below it is read.

The records of ``revert`` go to ``<site-packages>/.gdn-backport/``, beside
``vllm/``, not inside it: ``pip uninstall vllm`` removes the files its
RECORD lists and then the folders left empty, so a foreign folder inside
``vllm/`` would survive the uninstall and leave an empty ``vllm/`` that
``import vllm`` then finds as a namespace package. Beside it, nothing
imports ``.gdn-backport`` (not a module name), pip never looks at it, and it
goes away with the environment. After a reinstall or upgrade of vLLM the
files no longer hold what we wrote, and ``revert`` refuses rather than
restore another version's bytes.

Patching changes ``.py`` files whose bytecode caches may not be checked
against the source (``unchecked-hash`` pycs, as distributions and
reproducible builds write them): such a cache would keep running the old
code. The caches of every touched module are removed after a write.
"""

from __future__ import annotations

import glob
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gdn_backport import atomic, pipeline, registry
from gdn_backport.errors import UsageError
from gdn_backport.pipeline import Mode, Outcome, revert_tree
from gdn_backport.registry import Patchset
from gdn_backport.tree import relative

__all__ = [
    "InstalledVllm",
    "apply",
    "bytecode_caches",
    "caches_warning",
    "check_writable",
    "locate_vllm",
    "revert",
]


@dataclass(frozen=True)
class InstalledVllm:
    package: Path  # the folder ``import vllm`` loads

    @property
    def root(self) -> Path:
        """The tree: paths are reported as ``vllm/...`` relative to it."""
        return self.package.parent


def locate_vllm() -> InstalledVllm:
    """The importable ``vllm`` package, or UsageError (exit 2)."""
    where = f"vllm (for {sys.executable})"
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:
        raise UsageError(f"{where}: cannot locate the package ({exc})") from exc
    if spec is None:
        raise UsageError(f"{where}: not importable in this Python environment")
    locations = list(spec.submodule_search_locations or ())
    if not locations:
        raise UsageError(f"{where}: {spec.origin} is a module, not the vllm package")
    if len(locations) > 1 or spec.origin is None:
        found = ", ".join(locations)
        raise UsageError(f"{where}: a namespace package over {found}; no single tree to patch")
    return InstalledVllm(Path(locations[0]).resolve())


def apply(
    inst: InstalledVllm,
    strategy: str | None,
    mode: Mode,
    kernels: Sequence[Path] = (),
    chosen: Sequence[Patchset] | None = None,
) -> tuple[Outcome, list[tuple[Path, str]]]:
    """The patchsets' runs on ``vllm/`` (default all); the bytecode caches
    they removed."""

    def before_write(writing: list[tuple[Patchset, Outcome, list[tuple[Path, bytes]]]]) -> None:
        check_writable(inst.root, [file for _, _, staged in writing for file, _ in staged])

    results = pipeline.apply(
        inst.package,
        registry.selected(None) if chosen is None else chosen,
        strategy,
        mode,
        root=inst.root,
        within=inst.package.name,
        kernels=kernels,
        before_write=before_write,
    )
    out = pipeline.merged(results, inst.root)
    if out.written and not out.refused:
        out.message = (
            f"patched {len(out.written)} file(s); undo with `gdn-backport revert --installed`"
        )
    return out, _drop_caches(inst.root, out.written)


def revert(
    inst: InstalledVllm, mode: Mode, upstreams: frozenset[str] | None = None
) -> tuple[Outcome, list[tuple[Path, str]]]:
    out = revert_tree(
        inst.package, mode, root=inst.root, within=inst.package.name, upstreams=upstreams
    )
    return out, _drop_caches(inst.root, out.written)


def check_writable(root: Path, files: list[Path]) -> None:
    """Before any write: every file opens ``r+b`` (``os.access`` answers yes
    to root on a read-only mount), a file can be made beside it (the atomic
    rename), and the records and any bytecode caches to remove can be
    written. UsageError names the first that cannot."""
    for file in files:
        atomic.check_writable(file)
        for folder in sorted({cache.parent for cache in bytecode_caches(file)}):
            atomic.check_folder(folder, file)
    atomic.check_folder(root, root / atomic.STATE_DIR)


def bytecode_caches(source: Path) -> list[Path]:
    """Every ``<stem>.*.pyc`` of ``source``: where this interpreter writes it
    (``cache_from_source``, which honours ``PYTHONPYCACHEPREFIX``) and in the
    ``__pycache__`` beside it, for every interpreter and optimisation level."""
    folders = {Path(importlib.util.cache_from_source(str(source))).parent}
    folders.add(source.parent / "__pycache__")
    pattern = f"{glob.escape(source.stem)}.*.pyc"
    return sorted(p for folder in folders for p in folder.glob(pattern) if p.is_file())


def _drop_caches(root: Path, written: list[str]) -> list[tuple[Path, str]]:
    """Remove the caches of the written files: (cache, "" or why it stayed)."""
    done = []
    for rel in written:
        for cache in bytecode_caches(root / rel):
            try:
                cache.unlink()
                done.append((cache, ""))
            except OSError as exc:
                done.append((cache, exc.strerror or str(exc)))
    return done


def caches_warning(root: Path, dropped: list[tuple[Path, str]]) -> str:
    """One warning line after a write that met bytecode caches ("" if none)."""
    if not dropped:
        return ""

    def name(p: Path) -> str:
        return relative(p, root) if p.is_relative_to(root) else str(p)

    gone = [name(p) for p, why in dropped if not why]
    left = [f"{name(p)} ({why})" for p, why in dropped if why]
    text = "gdn-backport: warning: the bytecode caches of the changed module(s) were stale"
    if gone:
        text += f"; removed {', '.join(gone)}"
    if left:
        text += f"; could NOT remove {', '.join(left)}: delete them before running vLLM"
    return text
