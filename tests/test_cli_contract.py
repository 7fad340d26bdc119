"""The command line's contract on edge inputs (user-trial defects D2, D3, D12,
and a refused ``--release`` run that left its copy behind)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run

SITE = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "content",
    [
        "just some notes, not Python\n",
        "def unrelated(x):\n    return x + 1\n",
        # A vLLM module without GDN code (the layer moved in a rebase).
        "from vllm.logger import init_logger\n\nlogger = init_logger(__name__)\n",
    ],
    ids=["text", "unrelated-py", "vllm-module-without-gdn"],
)
@pytest.mark.parametrize("argv", [["scan"], ["apply", "--check"], ["apply"]])
def test_a_gate_on_a_single_file_with_no_site_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, argv: list[str]
) -> None:
    """D2: a CI gate naming one file must not pass on a file that holds no
    GDN code: exit 2, one line naming the file, nothing written."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    file = tmp_path / "vllm" / "moved.py"
    file.write_text(content)
    before = _tree_bytes(tmp_path)
    code, _, err = run(capsys, *argv, str(file))
    assert code == 2
    assert err.strip().splitlines() == [
        f"gdn-backport: {file}: no site of pr51812, pr51565 in this file (no GDN spec path, "
        "metadata builder or runner route); name the file that holds one, or the tree"
    ]
    assert _tree_bytes(tmp_path) == before


def test_a_single_file_with_a_site_still_gates(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    code, out, _ = run(capsys, "apply", "--check", str(affected_tree / SITE))
    assert code == 1 and "check failed" in out


@pytest.mark.parametrize(
    ("argv", "want"),
    [(["apply", "--dry-run"], 0), (["apply", "--check"], 1), (["revert"], 0)],
)
def test_the_json_exit_code_is_the_process_exit_code(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, argv: list[str], want: int
) -> None:
    """D3: `--json`'s exit_code said 1 while the process exited 0."""
    code, out, _ = run(capsys, *argv, "--json", str(affected_tree))
    assert code == want
    assert json.loads(out)["exit_code"] == code


def test_a_refusal_under_json_prints_a_document(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """D12: `scan --json` printed nothing on a refusal, `apply --json` a document."""
    for argv in (["scan"], ["apply", "--dry-run"]):
        code, out, err = run(capsys, *argv, "--json", str(tmp_path / "missing"))
        assert code == 2 and len(err.strip().splitlines()) == 1
        doc = json.loads(out)
        assert doc["exit_code"] == 2 and "no such file or directory" in doc["error"]


@pytest.mark.network
def test_a_refused_release_apply_leaves_no_copy_behind(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apply --release 0.18.1` made ./vllm-0.18.1 and then refused pr51565
    (no stateless rule before 0.20): a refusal must change nothing on disk."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "apply", "--release", "0.18.1")
    assert code == 2 and "pr51565" in err
    assert list(tmp_path.iterdir()) == []
    empty = tmp_path / "work"
    empty.mkdir()
    code, _, _ = run(capsys, "apply", "--release", "0.18.1", "--workdir", str(empty))
    assert code == 2 and empty.is_dir() and list(empty.iterdir()) == []


@pytest.mark.network
def test_revert_reports_every_patchset_s_sites(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """D11: revert printed "restored 4 file(s)" with one table row (only one
    patchset's sites), and `revert --patchset pr51565` showed none."""
    from gdn_backport import sources

    root = sources.copy_release("0.25.1", tmp_path / "tree")
    assert run(capsys, "apply", str(root))[0] == 0
    code, out, _ = run(capsys, "revert", "--json", str(root))
    doc = json.loads(out)
    assert code == 0 and len(doc["written"]) == 4
    rows = {(s["patchset"], s["path"]) for s in doc["sites"]}
    assert {p for p, _ in rows} == {"pr51812", "pr51565"}
    assert {path for _, path in rows} >= set(doc["written"])
    assert run(capsys, "apply", "--patchset", "pr51565", str(root))[0] == 0
    code, out, _ = run(capsys, "revert", "--patchset", "pr51565", "--json", str(root))
    doc = json.loads(out)
    assert code == 0 and len(doc["written"]) == 3
    assert {s["patchset"] for s in doc["sites"]} == {"pr51565"} and len(doc["sites"]) == 3
