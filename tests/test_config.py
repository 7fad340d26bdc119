"""A fork's kernel declarations (``patchsets/pr51812/config.py``): what a
tree's ``.gdn-backport.toml``, its ``[tool.gdn-backport]`` and a
``--kernels FILE`` may hold. A key the loader does not know is a typo,
never a declaration that is not there (D9)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run
from tests.test_engine import snapshot

DECLARATION = (
    '[[kernel]]\nname = "fork_gdn"\nparams = ["q", "k", "v", "a", "b", "idx"]\n'
    'rows = ["q", "k", "v"]\ngates = ["a", "b"]\nstate_indices = "idx"\n'
)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("kernel = []\n[typo_section]\nfoo = 1\n", "typo_section"),
        ("kernels = []\n", "kernels"),
        ("sweep = 1\n" + DECLARATION, "sweep"),
    ],
)
@pytest.mark.parametrize("argv", [["scan"], ["apply", "--dry-run"], ["apply"]], ids=" ".join)
def test_an_unknown_key_of_gdn_backport_toml_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, text: str, key: str, argv: list[str]
) -> None:
    path = affected_tree / ".gdn-backport.toml"
    path.write_text(text)
    before = snapshot(affected_tree)
    code, out, err = run(capsys, *argv, str(affected_tree))
    assert (code, out) == (2, "")
    assert err == f"gdn-backport: {path}: unknown key '{key}'\n"
    assert snapshot(affected_tree) == before


@pytest.mark.parametrize("argv", [["scan"], ["apply", "--dry-run"]], ids=" ".join)
def test_an_unknown_key_under_tool_gdn_backport_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, argv: list[str]
) -> None:
    path = affected_tree / "pyproject.toml"
    path.write_text('[project]\nname = "fork"\n\n[tool.gdn-backport]\nkernal = 3\n')
    code, out, err = run(capsys, *argv, str(affected_tree))
    assert (code, out) == (2, "")
    assert err == f"gdn-backport: {path}: [tool.gdn-backport]: unknown key 'kernal'\n"


def test_an_unknown_key_of_a_kernels_file_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, tmp_path: Path
) -> None:
    path = tmp_path / "k.toml"
    path.write_text(DECLARATION + "[extra]\n")
    code, out, err = run(capsys, "scan", "--kernels", str(path), str(affected_tree))
    assert (code, out) == (2, "")
    assert err == f"gdn-backport: {path}: unknown key 'extra'\n"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (".gdn-backport.toml", ""),
        (".gdn-backport.toml", DECLARATION),
        (".gdn-backport.toml", DECLARATION.replace("[[kernel]]\n", "kernel = [{") + "}]"),
        ("pyproject.toml", '[project]\nname = "fork"\n[tool.ruff]\nline-length = 99\n'),
        ("pyproject.toml", "[tool.gdn-backport]\n"),
        ("pyproject.toml", DECLARATION.replace("[[kernel]]", "[[tool.gdn-backport.kernel]]")),
    ],
    ids=["empty", "kernel", "inline", "other-tools", "empty-table", "tool-kernel"],
)
def test_what_the_loaders_accept_still_loads(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, name: str, text: str
) -> None:
    if "{" in text:  # an inline table: one line, commas between its keys
        body = text[text.index("{") + 1 : text.rindex("}")].strip().splitlines()
        text = "kernel = [{" + ", ".join(body) + "}]\n"
    (affected_tree / name).write_text(text)
    code, _, err = run(capsys, "scan", str(affected_tree))
    assert (code, err) == (1, "")  # the affected site, found
