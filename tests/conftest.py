"""Shared fixtures: small trees written here, real releases fetched from PyPI."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_backport import sources
from gdn_backport.codemods.gather_gates import GatherGatesCodemod

# The upstream-shaped example of the gather codemod: an affected site.
AFFECTED = GatherGatesCodemod.REWRITES[0][0]
FIXED = GatherGatesCodemod.REWRITES[0][1]


@pytest.fixture
def affected_tree(tmp_path: Path) -> Path:
    """A tiny vLLM-like tree with one affected and one unrelated file."""
    root = tmp_path / "tree"
    gdn = root / "vllm" / "model_executor" / "layers" / "mamba"
    gdn.mkdir(parents=True)
    (gdn / "gdn_linear_attn.py").write_text(AFFECTED)
    (root / "vllm" / "__init__.py").write_text("# a fork's tree\n")
    return root


@pytest.fixture(scope="session")
def release() -> object:
    """``release("0.25.1")``: the cached, verified tree of a real release."""

    def get(version: str) -> Path:
        return sources.release_tree(version)

    return get
