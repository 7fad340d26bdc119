"""Every codemod of every patchset runs under the real ``python -m libcst.tool codemod``.

One run per codemod, in a subprocess, on three temporary files: its first
rewrite example comes out as the example says, a file with nothing to fix
is left alone, a file it refuses is left alone and counted as failed. From
the checkout the short name works (``.libcst.codemod.yaml``); anywhere,
``-x`` with the full name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gdn_backport import registry

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "gdn_backport.patchsets."

CODEMODS: dict[str, Any] = {
    f"{cls.__module__.removeprefix(PACKAGE)}.{cls.__name__}": cls
    for ps in registry.discover()
    for classes in ps.codemods().values()
    for cls in classes
}


def _tool(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "libcst.tool", "codemod", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _args(cls: Any) -> list[str]:
    """The examples' constructor arguments as the tool's options."""
    out: list[str] = []
    for key, value in getattr(cls, "EXAMPLE_ARGS", {}).items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def _files(tmp_path: Path, cls: Any) -> dict[str, Path]:
    texts = {
        "fix": cls.REWRITES[0][0],
        "leave": cls.UNCHANGED[0],
        "refuse": cls.REFUSES[0][0],
    }
    out = {}
    for name, text in texts.items():
        out[name] = tmp_path / f"{name}.py"
        out[name].write_text(text)
    return out


def _check(run: subprocess.CompletedProcess[str], cls: Any, files: dict[str, Path]) -> None:
    report = run.stdout + run.stderr
    assert run.returncode == 1, report  # the tool's code: a file failed (the refused one)
    assert " - Transformed 1 files successfully." in run.stderr, report
    assert " - Skipped 1 files." in run.stderr, report
    assert " - Failed to codemod 1 files." in run.stderr, report
    assert files["fix"].read_text() == cls.REWRITES[0][1]
    assert files["leave"].read_text() == cls.UNCHANGED[0]
    assert files["refuse"].read_text() == cls.REFUSES[0][0]
    assert cls.REFUSES[0][1] in run.stderr, report


@pytest.mark.parametrize("name", sorted(CODEMODS))
def test_the_libcst_tool_runs_it_from_the_checkout(name: str, tmp_path: Path) -> None:
    cls = CODEMODS[name]
    files = _files(tmp_path, cls)
    run = _tool(REPO, name, "-j", "1", *_args(cls), *map(str, files.values()))
    _check(run, cls, files)


@pytest.mark.parametrize("patchset", registry.available())
def test_the_libcst_tool_runs_it_anywhere_by_its_full_name(patchset: str, tmp_path: Path) -> None:
    cls = registry.get(patchset).codemods()[registry.get(patchset).info.strategies[0]][0]
    files = _files(tmp_path, cls)
    full = f"{cls.__module__}.{cls.__name__}"
    run = _tool(tmp_path, "-x", full, "--no-format", "-j", "1", *_args(cls),
                *map(str, files.values()))  # fmt: skip
    _check(run, cls, files)
