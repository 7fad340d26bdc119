"""vLLM version of a tree: files and git tags, never an import of the tree."""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import git
import pytest

from gdn_backport import sources
from gdn_backport.cli import main
from gdn_backport.vllm_version import VllmVersion, detect, line, to_json

# setuptools-scm's file; the raise proves the file is read, never executed.
VERSION_PY = """raise SystemExit("executed!")
__version__ = version = '0.25.1'
__version_tuple__ = version_tuple = (0, 25, 1)
"""


@pytest.fixture(autouse=True)
def _no_user_git_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def _tree(root: Path) -> Path:
    (root / "vllm" / "model_executor").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    return root


def _commit_all(root: Path, tag: str | None = None) -> git.Repo:
    repo = git.Repo.init(root)
    repo.git.config("user.name", "T")
    repo.git.config("user.email", "t@example.invalid")
    repo.git.add("-A")
    repo.git.commit("-qm", "tree")
    if tag:
        repo.git.tag(tag)
    return repo


def test_version_py_is_parsed_not_run(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "vllm" / "_version.py").write_text(VERSION_PY)
    assert detect(root) == VllmVersion("0.25.1", "vllm/_version.py")
    # A path below the root (a folder, a file) finds the same tree.
    assert detect(root / "vllm" / "model_executor") == detect(root)
    assert detect(root / "vllm" / "__init__.py") == detect(root)
    assert line(detect(root)) == "vllm version: 0.25.1 (from vllm/_version.py)"


def test_older_version_py_order(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "vllm" / "_version.py").write_text("version = __version__ = '0.10.2'\n")
    assert detect(root) == VllmVersion("0.10.2", "vllm/_version.py")


def test_sdist_pkg_info(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.24.0\n\nbody\n")
    assert detect(root) == VllmVersion("0.24.0", "PKG-INFO")
    # Another project's PKG-INFO is not vLLM's version.
    (root / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: not-vllm\nVersion: 9.9\n")
    assert detect(root) is None


def test_dist_info_beside_installed_package(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "torch-2.13.0.dist-info").mkdir()
    (root / "torch-2.13.0.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.13.0\n")
    meta = root / "vllm-0.22.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.22.1\n")
    assert detect(root) == VllmVersion("0.22.1", "vllm-0.22.1.dist-info/METADATA")
    # The package's own _version.py wins: it is what gets imported.
    (root / "vllm" / "_version.py").write_text("__version__ = '0.22.1'\n")
    assert detect(root) == VllmVersion("0.22.1", "vllm/_version.py")


def test_git_tag_wins_over_a_stale_generated_file(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "vllm" / "_version.py").write_text("__version__ = '0.20.0'\n")  # last build's
    repo = _commit_all(root, tag="v0.25.1")
    assert detect(root) == VllmVersion("0.25.1", "git describe")
    (root / "vllm" / "x.py").write_text("")
    repo.git.add("-A")
    repo.git.commit("-qm", "fork change")
    found = detect(root)
    assert found is not None and found.version.startswith("0.25.1-1-g")
    # Tags that are not versions are not used.
    repo.git.tag("-d", "v0.25.1")
    repo.git.tag("prod")
    assert detect(root) == VllmVersion("0.20.0", "vllm/_version.py")


def test_git_repo_that_does_not_track_vllm_is_ignored(tmp_path: Path) -> None:
    """A virtualenv inside some project's repository: that repository's tags
    say nothing about the vllm installed in it."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "README").write_text("x")
    (project / ".gitignore").write_text(".venv/\n")
    _commit_all(project, tag="v9.0.0")
    site = _tree(project / ".venv" / "site-packages")
    meta = site / "vllm-0.25.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Name: vllm\nVersion: 0.25.1\n")
    assert detect(site) == VllmVersion("0.25.1", "vllm-0.25.1.dist-info/METADATA")


def test_unknown(tmp_path: Path) -> None:
    assert detect(tmp_path) is None
    assert detect(_tree(tmp_path)) is None
    assert line(None).startswith("vllm version: unknown")
    assert to_json(None) is None


def test_cli_prints_the_version(capsys: pytest.CaptureFixture[str], affected_tree: Path) -> None:
    (affected_tree / "vllm" / "_version.py").write_text(VERSION_PY)
    assert main(["scan", str(affected_tree)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"tree: {affected_tree}", "vllm version: 0.25.1 (from vllm/_version.py)"]
    assert main(["scan", str(affected_tree), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["vllm_version"] == {"version": "0.25.1", "source": "vllm/_version.py"}
    assert set(doc) == {"tree", "patchsets", "sites", "vllm_version", "leftovers"}
    assert main(["apply", "--dry-run", str(affected_tree), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["vllm_version"]["version"] == "0.25.1"
    assert {"tree", "sites", "diff", "refused", "written", "message", "exit_code"} <= set(doc)
    assert main(["apply", "--dry-run", str(affected_tree)]) == 0
    assert "vllm version: 0.25.1 (from vllm/_version.py)" in capsys.readouterr().out


@pytest.mark.network
@pytest.mark.parametrize("version", ["0.10.2", "0.18.0", "0.25.1", "0.33.0"])
def test_real_releases(release: object, version: str) -> None:
    tree = release(version)  # type: ignore[operator]
    assert detect(tree) == VllmVersion(version, "vllm/_version.py")


@pytest.mark.network
@pytest.mark.parametrize("has_version_py", [True, False], ids=["version-py", "pkg-info"])
def test_the_sdist_layout_one_folder_down(
    capsys: pytest.CaptureFixture[str], release: object, tmp_path: Path, has_version_py: bool
) -> None:
    """D17: PATH holds the unpacked sdist ``vllm-0.25.1/`` (vllm/ one folder
    down, the layout the README documents): the version comes from that
    tree's own files (its ``vllm/_version.py``, else the sdist's
    ``PKG-INFO``), named relative to PATH (it used to be "unknown")."""
    tree = release("0.25.1")  # type: ignore[operator]
    name, digest = (tree / ".gdn-backport-complete").read_text().split()
    archive = sources.cache_dir() / "dist" / name
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == digest
    path = tmp_path / "src"
    sdist = path / "vllm-0.25.1"
    shutil.copytree(tree / "vllm", sdist / "vllm")
    with tarfile.open(archive) as tar:
        member = tar.extractfile("vllm-0.25.1/PKG-INFO")
        assert member is not None
        (sdist / "PKG-INFO").write_bytes(member.read())
    if not has_version_py:
        (sdist / "vllm" / "_version.py").unlink()
    source = "vllm-0.25.1/vllm/_version.py" if has_version_py else "vllm-0.25.1/PKG-INFO"
    assert main(["scan", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[1] == f"vllm version: 0.25.1 (from {source})"
    assert main(["scan", str(path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["vllm_version"] == {"version": "0.25.1", "source": source}
    # Two unpacked releases side by side name no one version: none is guessed.
    _tree(path / "vllm-0.27.1")
    assert detect(path) is None
