"""Shared fixtures: small trees written here, real releases fetched from PyPI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gdn_backport import sources
from gdn_backport.cli import main
from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod

# The upstream-shaped example of the gather codemod: an affected site.
AFFECTED = GatherGatesCodemod.REWRITES[0][0]
FIXED = GatherGatesCodemod.REWRITES[0][1]


@pytest.fixture(autouse=True)
def _wide_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables wrap at the terminal's width (100 without one: report.py);
    tests look for whole cells in them, so they get a wide one."""
    monkeypatch.setenv("COLUMNS", "1000")


@pytest.fixture(autouse=True)
def _no_analysis_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test analyses afresh (a test that replaces a piece of the
    analysis must see it run); tests/test_cache.py turns the cache on."""
    monkeypatch.setenv("GDN_BACKPORT_NO_CACHE", "1")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The CLI in process: its exit code, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


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


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``fake(gdn=..., hardware=...)`` puts a fake vLLM install
    (tests/fake_vllm.py) on sys.path; its plugin loader honours
    ``VLLM_PLUGINS``, so the caller's environment is kept out."""
    from tests.fake_vllm import forget_fake, make_site

    def build(**kwargs: Any) -> Path:
        site = make_site(tmp_path, **kwargs)
        monkeypatch.syspath_prepend(str(site))
        return site

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    forget_fake()
    yield build
    forget_fake()
