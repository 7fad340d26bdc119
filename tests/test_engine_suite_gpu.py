"""The engine suite on a real vLLM and GPU (skipped without both)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gdn_backport.engine_suite.suite import run_engine_suite


@pytest.mark.gpu
@pytest.mark.slow
def test_recipe_on_the_installed_vllm(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM installed")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    report = run_engine_suite(None, ["pr51812-recipe"], workdir=tmp_path, json=True)
    assert report.refusal is None
    (result,) = report.results
    # Whatever the verdict (it depends on the install being patched), the
    # run must have reached the layout and measured fit gates.
    assert result.builds > 0 and result.misordered > 0, result.reason
    assert result.gates.startswith("gates vary"), result.gates
