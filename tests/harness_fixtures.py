"""Fixtures for the harness and verify tests: release trees, patched copies,
an empty LoadedTree.

Release trees come from :func:`gdn_backport.sources.release_tree` (PyPI,
sha256-verified, cached under ``$GDN_BACKPORT_CACHE``); patched copies are
made by the product's own ``apply`` engine, with either strategy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gdn_backport import sources

if TYPE_CHECKING:
    from gdn_backport.harness.loader import LoadedTree

__all__ = ["fake_loaded", "interpreted", "patched_copy", "release_tree", "runnable"]


def interpreted() -> None:
    """CPU runs of the real kernels need the Triton interpreter (set before load)."""
    # Before anything imports triton: triton 3.6 reads it at import time.
    os.environ["TRITON_INTERPRET"] = "1"
    runnable()


def release_tree(version: str) -> Path:
    return sources.release_tree(version)


def patched_copy(version: str, dest: Path, strategy: str = "gather") -> Path:
    """A private copy of a release patched by ``gdn-backport apply``."""
    from gdn_backport.patchsets.pr51812.plan import apply_tree

    root = dest / f"vllm-{version}-{strategy}"
    if root.exists():
        return root
    staging = dest / f".staging-{version}-{strategy}"
    sources.copy_release(version, staging)
    outcome = apply_tree(staging, strategy)
    assert outcome.written and outcome.exit_code == 0, (outcome.message, outcome.refused)
    staging.rename(root)
    return root


def runnable() -> None:
    """Skip when the installed Triton cannot run vLLM's kernels at all."""
    from gdn_backport.verify import triton_problem

    problem = triton_problem()
    if problem:
        # CI installs a Triton that can (noxfile): there, never skip silently.
        if os.environ.get("GDN_BACKPORT_REQUIRE_TRITON") == "1":
            pytest.fail(problem)
        pytest.skip(problem)


def fake_loaded(root: Path, device: str = "cpu") -> LoadedTree:
    """A LoadedTree over ``root`` with nothing loaded (``torch.device("cuda")``
    is only a name: no GPU is needed until a tensor is made on it)."""
    from gdn_backport.harness.loader import GdnSite, LoadedTree
    from gdn_backport.harness.standins import HarnessContext

    site = GdnSite(path=root / "vllm" / "m.py", module="vllm.m", cls="Layer")
    return LoadedTree(tree=root, site=site, context=HarnessContext(root, device), interpreted=False)
