"""``python -m gdn_backport.engine_suite`` and ``gdn-backport verify --engine``."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_backport.cli import main as gdn_main
from gdn_backport.engine_suite.cli import main


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list", "--patchset", "pr51565"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == [
        "pr51565-eager",
        "pr51565-full-graphs",
        "pr51565-piecewise",
        "pr51565-prefix-hit",
    ]


def test_verify_engine_delegates(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing"))
    monkeypatch.chdir(tmp_path)
    assert gdn_main(["verify", "--engine", "--installed", "--patchset", "pr51812"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "gdn-backport: vllm: no vLLM importable in this Python\n"
    assert gdn_main(["verify", "--engine", str(tmp_path)]) == 2
    assert "use --installed" in capsys.readouterr().err


def test_unknown_scenario(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--scenario", "nope", "--workdir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("gdn-backport: engine scenario 'nope': unknown")
