"""noxfile.py: one session per matrix cell, the same cells as gdn_backport.matrix.

The noxfile restates the strategy rule (it loads without the package), so
this test holds the two to the same cells, ids and tags.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gdn_backport import matrix, sources
from tests.harness_fixtures import runnable

ROOT = Path(__file__).resolve().parent.parent
nox = pytest.importorskip("nox")
NOX_NO_VENV = [sys.executable, "-m", "nox", "--no-venv", "-f", str(ROOT / "noxfile.py"),
               "-s", "cell(0.28.0-none)"]  # fmt: skip


@functools.cache
def _noxfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_gdn_noxfile", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nox(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_one_param_per_cell_with_the_cell_id() -> None:
    params = _noxfile()._cells()
    ids = [p.id for p in params]
    want = matrix.cells(matrix.load(), include_wheel_only=True)
    assert ids == [c.id for c in want]
    assert [tuple(p.args) for p in params] == [(c.target, c.strategy) for c in want]
    by_id = {p.id: p for p in params}
    assert by_id["0.25.1-gather"].tags == ["cells", "gpu", "pr51812", "affected", "gather"]
    assert by_id["0.28.0-none"].tags == ["cells", "gpu", "pr51812", "fixed", "none"]
    assert by_id["0.25.1-reclassify"].tags == [
        "cells", "gpu", "pr51565", "pr51565-affected", "reclassify"
    ]  # fmt: skip
    # wheel_only releases (500 MB wheels) run only when named.
    assert by_id["0.15.0-none"].tags == ["wheel-only"]


def test_nox_lists_every_cell_with_a_one_line_docstring() -> None:
    listed = _nox("-l")
    assert listed.returncode == 0, listed.stderr
    out = listed.stdout
    assert "* tests -> " in out and "* lint -> " in out
    cells = [line for line in out.splitlines() if line.startswith("- cell(")]
    assert len(cells) == len(matrix.cells(matrix.load(), include_wheel_only=True))
    tagged = "- cell(0.25.1-gather) [cells,gpu,pr51812,affected,gather] -> "
    assert any(line.startswith(tagged) for line in cells)
    assert "- matrix [gpu] -> " in out
    described = [line for line in out.splitlines() if line.startswith(("* ", "- "))]
    assert all(" -> " in line for line in described)
    noxfile = _noxfile()
    for fn in (noxfile.tests, noxfile.lint, noxfile.cell, noxfile.matrix):
        assert fn.__doc__ and "\n" not in fn.__doc__.strip()


def test_cells_are_not_default_and_json_listing_feeds_ci() -> None:
    listed = _nox("--json", "-l", "-t", "affected")
    assert listed.returncode == 0, listed.stderr
    sessions = json.loads(listed.stdout)
    names = [s["session"] for s in sessions]
    assert "cell(0.25.1-kernel)" in names and "cell(0.28.0-none)" not in names
    affected = [c for c in matrix.cells(matrix.load()) if c.strategy in ("gather", "kernel")]
    assert len(names) == len(affected)
    assert {s["name"] for s in sessions} == {"cell"}
    assert sessions[0]["call_spec"] == {"target": "0.18.0", "strategy": "gather"}
    default = json.loads(_nox("--json", "-l").stdout)
    assert [s["session"] for s in default] == ["tests", "lint", "wheel"]


def test_wants_cuda() -> None:
    wants = _noxfile()._wants_cuda
    assert wants(["--device", "cuda"]) and wants(["--device=cuda"])
    assert not wants(["--device", "cpu"]) and not wants([])


@pytest.mark.network
@pytest.mark.slow
def test_cell_session_runs_without_a_venv(tmp_path: Path) -> None:
    """`nox --no-venv -s "cell(...)"` (air-gapped runners): offline, this interpreter."""
    runnable()
    sources.release_tree("0.28.0")  # in the cache before going offline
    results = tmp_path / "results"
    env = {**os.environ, "GDN_BACKPORT_OFFLINE": "1"}
    run = subprocess.run(
        [
            *NOX_NO_VENV,
            "--",
            "--device",
            "cpu",
            "--scenario",
            "pr_layout",
            "--results",
            str(results),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert "no virtualenv: using the packages of" in log
    # Versions first, then the cell.
    assert log.index("torch") < log.index("[1/1] 0.28.0 none")
    assert "(offline)" in log
    doc = json.loads((results / "summary.json").read_text())
    assert [c["result"] for c in doc["cells"]] == ["ok"]
    assert (results / "0.28.0-none.xml").exists()
    # Asking for a GPU where there is none skips the session cleanly.
    import torch

    if not torch.cuda.is_available():
        skip = subprocess.run(
            [*NOX_NO_VENV, "--", "--device", "cuda"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert skip.returncode == 0 and "torch sees no CUDA device" in skip.stderr + skip.stdout
