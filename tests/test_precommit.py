"""The pre-commit hooks (``.pre-commit-hooks.yaml``, ``gdn_backport/precommit.py``), issue 22.

The hook entry is tested in process on small trees; the hooks themselves
through the real ``pre-commit`` (the ``test`` extra) on a throwaway git
repository holding a copy of vLLM 0.25.1: ``pre-commit try-repo`` fails
there, and passes after ``gdn-backport apply``. pre-commit installs the
hook's environment from a snapshot of this checkout (every file git
tracks or would track, committed in a scratch repository: try-repo reads
commits, not the working tree), with libcst and GitPython from PyPI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gdn_backport import precommit
from tests.conftest import AFFECTED, FIXED, run

REPO = Path(__file__).resolve().parents[1]
SITE = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"


def _tree(root: Path, layer: str = AFFECTED) -> Path:
    (root / "vllm" / "model_executor").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "notes.py").write_text("NOTHING = 1\n")
    (root / "vllm" / "model_executor" / "gdn_linear_attn.py").write_text(layer)
    return root


def test_the_manifest_is_valid_for_pre_commit() -> None:
    from pre_commit.clientlib import load_manifest

    hooks = {h["id"]: h for h in load_manifest(str(REPO / ".pre-commit-hooks.yaml"))}
    assert set(hooks) == {"gdn-backport-check", "gdn-backport-scan"}
    check, scan = hooks["gdn-backport-check"], hooks["gdn-backport-scan"]
    assert check["entry"] == "python -m gdn_backport.precommit" and check["pass_filenames"]
    # One process gets every file: each tree is analysed once per commit.
    assert check["require_serial"] and check["types"] == ["python"]
    assert scan["entry"] == "gdn-backport scan" and scan["args"] == ["."]
    assert scan["pass_filenames"] is False and scan["always_run"]
    assert {check["language"], scan["language"]} == {"python"}


def test_a_changed_file_without_a_site_checks_its_tree(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pre-commit passes every changed .py: one that holds no site is no
    refusal (``apply --check FILE`` would exit 2); its tree is checked."""
    _tree(tmp_path / "fork")
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "apply", "--check", "fork/vllm/notes.py")[0] == 2
    assert precommit.main(["fork/vllm/notes.py"]) == 1
    out = capsys.readouterr().out
    assert "check failed: 1 affected site(s)" in out and "tree: fork" in out
    assert precommit.main(["--patchset", "pr51565", "fork/vllm/notes.py"]) == 0
    capsys.readouterr()
    assert run(capsys, "apply", "fork")[0] == 0
    assert precommit.main(["fork/vllm/notes.py", "fork/vllm/__init__.py"]) == 0


def test_files_outside_every_tree_are_no_concern(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tree(tmp_path / "fork")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "lint.py").write_text("print('x')\n")
    monkeypatch.chdir(tmp_path)
    assert precommit.main(["tools/lint.py"]) == 0
    assert precommit.main([]) == 0
    assert capsys.readouterr().out == ""
    # A plugin repository (no vllm/, its modules import vllm) is its own tree.
    plugin = tmp_path / "plugin-repo"
    (plugin / "tools").mkdir(parents=True)
    (plugin / "tools" / "lint.py").write_text("print('x')\n")
    (plugin / "layer.py").write_text("import vllm\n")
    monkeypatch.chdir(plugin)
    assert precommit.main(["tools/lint.py"]) == 0
    assert "tree: ." in capsys.readouterr().out


def test_each_tree_is_checked_once_and_the_worst_code_wins(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tree(tmp_path / "a")
    _tree(tmp_path / "b", FIXED)
    monkeypatch.chdir(tmp_path)
    files = ["b/vllm/notes.py", "a/vllm/notes.py", "a/vllm/__init__.py", "b/vllm/__init__.py"]
    assert precommit.trees_of([Path(f) for f in files], tmp_path) == [tmp_path / "b",
                                                                      tmp_path / "a"]  # fmt: skip
    assert precommit.main(files) == 1
    assert capsys.readouterr().out.count("tree: ") == 2
    assert precommit.main(files[:1]) == 0
    (tmp_path / "b" / "vllm" / "broken.py").write_text("def f(spec_token_indx:\n")
    assert precommit.main(files) == 2


def test_annotations_pass_through(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tree(tmp_path / "fork")
    monkeypatch.chdir(tmp_path)
    assert precommit.main(["--format", "github", "fork/vllm/notes.py"]) == 1
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("::error file=fork/vllm/model_executor/gdn_linear_attn.py,line=")


# -- the real pre-commit --------------------------------------------------------------


def _git(cwd: Path, *argv: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid",
         "-c", "commit.gpgsign=false", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout


def _snapshot(dest: Path) -> str:
    """This checkout as pre-commit would install it: its files (tracked, or
    new and not ignored) committed in ``dest``; the commit."""
    try:
        listed = _git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout: {exc}")
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "snapshot")
    return _git(dest, "rev-parse", "HEAD").strip()


def _try_repo(fork: Path, hooks: Path, ref: str, home: Path) -> tuple[int, str, float]:
    """``pre-commit try-repo HOOKS gdn-backport-check --all-files`` in the
    fork: exit code, output, the hook's own duration (pre-commit's -v)."""
    env = {**os.environ, "PRE_COMMIT_HOME": str(home), "PRE_COMMIT_COLOR": "never"}
    done = subprocess.run(
        [sys.executable, "-m", "pre_commit", "try-repo", str(hooks), "gdn-backport-check",
         "--ref", ref, "--all-files", "--verbose"],
        cwd=fork, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    m = re.search(r"- duration: ([\d.]+)s", out)
    assert m, out[-3000:]
    return done.returncode, out, float(m[1])


@pytest.mark.network
@pytest.mark.slow
def test_pre_commit_try_repo_fails_on_the_affected_release_and_passes_after_apply(
    capsys: pytest.CaptureFixture[str], release: Any, tmp_path: Path
) -> None:
    fork = tmp_path / "fork"
    shutil.copytree(release("0.25.1"), fork)
    _git(fork, "init", "-q")
    _git(fork, "add", "-A")
    _git(fork, "commit", "-q", "-m", "vllm 0.25.1")
    hooks = tmp_path / "hooks"
    ref = _snapshot(hooks)
    home = tmp_path / "pre-commit-home"

    code, out, took = _try_repo(fork, hooks, ref, home)
    assert code == 1, out[-3000:]
    assert re.search(r"gdn-backport apply --check\.+Failed", out), out[-3000:]
    assert "pr51812: check failed: 1 affected site(s)" in out
    assert "pr51565: check failed: 3 affected site(s)" in out
    first = took

    assert run(capsys, "apply", str(fork))[0] == 0
    code, out, took = _try_repo(fork, hooks, ref, home)
    assert code == 0, out[-3000:]
    assert re.search(r"gdn-backport apply --check\.+Passed", out), out[-3000:]
    capsys.readouterr()
    with capsys.disabled():
        # The hook's time on a release (docs/ci.md quotes it): pytest -s shows it.
        print(f"\ngdn-backport-check on vllm 0.25.1: {first:.2f} s affected, {took:.2f} s patched")
