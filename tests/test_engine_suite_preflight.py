"""Refusals: exit 2 and one line on stderr, through the command line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gdn_backport.engine_suite import cli
from tests.engine_fake_vllm import make_site


def refuse(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    pythonpath: Path,
    tmp_path: Path,
) -> str:
    monkeypatch.setenv("PYTHONPATH", str(pythonpath))
    code = cli.main(["--scenario", "pr51812-recipe", "--workdir", str(tmp_path / "w")])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_no_vllm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert refuse(capsys, monkeypatch, tmp_path / "nothing", tmp_path) == (
        "gdn-backport: vllm: no vLLM importable in this Python"
    )


def test_registry_without_the_mtp_class(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    site = make_site(tmp_path, classes=("Qwen3_5ForConditionalGeneration",))
    line = refuse(capsys, monkeypatch, site, tmp_path)
    assert line == (
        f"gdn-backport: {site / 'vllm'}: the model registry "
        "(model_executor/models/registry.py) lacks Qwen3_5MTP"
    )


def test_no_cuda(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a CUDA device")
    line = refuse(capsys, monkeypatch, make_site(tmp_path), tmp_path)
    assert line.startswith("gdn-backport: ") and line.endswith(
        "sees no CUDA device (the engine suite needs a GPU)"
    )
