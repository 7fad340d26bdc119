"""``apply --commit`` and ``--format-patch`` on real git repositories."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import git
import pytest

from gdn_backport import __version__, atomic, sources
from gdn_backport.patchsets.pr51812.plan import apply_tree
from tests.conftest import AFFECTED, FIXED, run
from tests.test_engine import SITE

BRANCH = "gdn-backport/pr51812"
TRAILER = "Backport-Of: vllm-project/vllm#51812"


@pytest.fixture(autouse=True)
def _no_user_git_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's ~/.gitconfig (signing, hooks path, identity) stays out."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def make_repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.config("user.name", "Fork Maintainer")
    repo.git.config("user.email", "fork@example.invalid")
    repo.git.add("-A")
    repo.git.commit("-qm", "vllm tree")
    return repo


@pytest.fixture
def repo(affected_tree: Path) -> git.Repo:
    (affected_tree / "vllm" / "_version.py").write_text("__version__ = version = '0.25.1'\n")
    return make_repo(affected_tree)


def state(repo: git.Repo) -> tuple[object, ...]:
    """Everything a refusal must leave as it was: files, index, refs, HEAD."""
    root = Path(repo.working_tree_dir or "")
    files = {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not {".git", atomic.STATE_DIR} & set(p.parts)
    }
    refs = sorted((r.path, r.commit.hexsha) for r in repo.refs)
    return (
        files,
        repo.git.ls_files("-s"),
        refs,
        repo.git.rev_parse("HEAD"),
        repo.head.reference.path,
    )


def test_commit_makes_a_branch_with_only_the_patched_file(
    capsys: pytest.CaptureFixture[str], repo: git.Repo
) -> None:
    root = Path(repo.working_tree_dir or "")
    main_sha = repo.head.commit.hexsha
    (root / "notes.txt").write_text("untracked, not ours")
    code, out, err = run(capsys, "apply", "--commit", str(root))
    assert (code, err) == (0, ""), err
    assert f"branch {BRANCH}: commit" in out and "undo: git checkout main" in out
    assert repo.active_branch.name == BRANCH
    head = repo.head.commit
    assert [p.hexsha for p in head.parents] == [main_sha]
    assert repo.heads.main.commit.hexsha == main_sha  # the user's branch is untouched
    assert list(head.stats.files) == [SITE.as_posix()]
    assert (root / SITE).read_text() == FIXED
    assert (head.tree / SITE.as_posix()).data_stream.read().decode() == FIXED
    # Clean afterwards; the records and the user's untracked file stay untracked.
    assert repo.git.status("--porcelain") == "?? notes.txt"
    assert not [p for p in repo.git.ls_files().splitlines() if p.startswith(".gdn-backport")]
    assert (root / ".gdn-backport" / "manifest.json").exists()
    # The message: subject naming the PR, the body, the trailer as last line.
    message = str(head.message)
    lines = message.rstrip("\n").splitlines()
    assert lines[0] == "Backport vLLM PR #51812: spec-decode gate rows (Gated DeltaNet)"
    assert lines[-1] == TRAILER
    for part in (
        "Strategy: gather (gate rows a/b gathered by the spec token index, as upstream)",
        f"Tool: gdn-backport {__version__}",
        "vLLM version: 0.25.1 (from vllm/_version.py)",
        f"  {SITE.as_posix()}",
        "    Layer._forward_core: affected -> fixed",
    ):
        assert part in lines, part


def test_trailer_is_a_git_trailer(capsys: pytest.CaptureFixture[str], repo: git.Repo) -> None:
    root = Path(repo.working_tree_dir or "")
    assert run(capsys, "apply", "--commit", str(root))[0] == 0
    value = repo.git.log("-1", "--format=%(trailers:key=Backport-Of,valueonly)")
    assert value.strip() == "vllm-project/vllm#51812"


def test_undo_with_git(capsys: pytest.CaptureFixture[str], repo: git.Repo) -> None:
    root = Path(repo.working_tree_dir or "")
    assert run(capsys, "apply", "--commit", str(root))[0] == 0
    repo.git.checkout("-")
    assert repo.active_branch.name == "main"
    assert (root / SITE).read_text() == AFFECTED
    repo.git.branch("-D", BRANCH)
    assert repo.git.status("--porcelain") == ""


def test_revert_on_the_branch_restores_the_work_tree(
    capsys: pytest.CaptureFixture[str], repo: git.Repo
) -> None:
    root = Path(repo.working_tree_dir or "")
    assert run(capsys, "apply", "--commit", str(root))[0] == 0
    assert run(capsys, "revert", str(root))[0] == 0
    assert (root / SITE).read_text() == AFFECTED
    # An uncommitted change on the branch: commit it, or `git checkout -- FILE`.
    assert repo.git.status("--porcelain") == f" M {SITE.as_posix()}"


def test_tree_in_a_subfolder_of_the_repo(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tree = tmp_path / "monorepo" / "third_party" / "vllm-fork"
    (tree / SITE).parent.mkdir(parents=True)
    (tree / SITE).write_text(AFFECTED)
    (tree / "vllm" / "__init__.py").write_text("")
    repo = make_repo(tmp_path / "monorepo")
    assert run(capsys, "apply", "--commit", str(tree))[0] == 0
    expected = f"third_party/vllm-fork/{SITE.as_posix()}"
    assert list(repo.head.commit.stats.files) == [expected]
    assert f"  {expected}" in repo.head.commit.message.splitlines()


def test_branch_option_and_detached_head(
    capsys: pytest.CaptureFixture[str], repo: git.Repo
) -> None:
    root = Path(repo.working_tree_dir or "")
    sha = repo.head.commit.hexsha
    repo.git.checkout("-q", "--detach")
    code, out, _ = run(capsys, "apply", "--commit", "--branch", "fix/gdn", str(root))
    assert code == 0
    assert repo.active_branch.name == "fix/gdn"
    assert repo.head.commit.parents[0].hexsha == sha
    assert f"undo: git checkout {sha}" in out


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("modified", "uncommitted changes (vllm/__init__.py)"),
        ("staged", "uncommitted changes (vllm/__init__.py)"),
        ("branch-exists", f"branch {BRANCH} already exists"),
        ("bad-branch", "not a valid branch name"),
    ],
)
def test_refusals_change_nothing(
    capsys: pytest.CaptureFixture[str], repo: git.Repo, setup: str, reason: str
) -> None:
    root = Path(repo.working_tree_dir or "")
    argv = ["apply", "--commit", str(root)]
    if setup in ("modified", "staged"):
        (root / "vllm" / "__init__.py").write_text("# local edit\n")
        if setup == "staged":
            repo.git.add("vllm/__init__.py")
    elif setup == "branch-exists":
        repo.git.branch(BRANCH)
    else:
        argv += ["--branch", "no..dots"]
    before = state(repo)
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and reason in err and str(root) in err
    assert state(repo) == before
    assert not (root / ".gdn-backport").exists()


def test_allow_dirty_commits_only_ours(capsys: pytest.CaptureFixture[str], repo: git.Repo) -> None:
    root = Path(repo.working_tree_dir or "")
    (root / "vllm" / "__init__.py").write_text("# staged edit\n")
    repo.git.add("vllm/__init__.py")
    (root / "vllm" / "_version.py").write_text("# unstaged edit\n")
    code, _, err = run(capsys, "apply", "--commit", "--allow-dirty", str(root))
    assert code == 0, err
    assert list(repo.head.commit.stats.files) == [SITE.as_posix()]
    # The user's changes are where they were: one staged, one not.
    assert sorted(repo.git.status("--porcelain").splitlines()) == [
        " M vllm/_version.py",
        "M  vllm/__init__.py",
    ]
    assert (root / "vllm" / "__init__.py").read_text() == "# staged edit\n"


@pytest.mark.parametrize("how", ["edited", "untracked", "ignored"])
def test_target_with_user_content_refused_even_with_allow_dirty(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, how: str
) -> None:
    root = tmp_path / "tree"
    (root / SITE).parent.mkdir(parents=True)
    (root / "README").write_text("fork\n")
    (root / "vllm" / "__init__.py").write_text("")
    target = root / SITE
    if how == "edited":
        target.write_text(AFFECTED)
        repo = make_repo(root)
        target.write_text("# my local change\n" + AFFECTED)
    else:
        if how == "ignored":
            (root / ".gitignore").write_text("vllm/\n")
        repo = make_repo(root)
        target.write_text(AFFECTED)
    before = state(repo)
    code, _, err = run(capsys, "apply", "--commit", "--allow-dirty", str(root))
    why = {"edited": "has uncommitted changes", "untracked": "not tracked", "ignored": "ignored"}
    assert code == 2 and err.count("\n") == 1
    assert f"{target.resolve()}: {why[how]}" in err
    assert state(repo) == before
    # Negative control: a plain apply does patch the same file.
    assert run(capsys, "apply", str(root))[0] == 0
    assert "a_spec" in target.read_text()


def test_not_a_git_tree_and_no_commit_yet(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    before = (affected_tree / SITE).read_bytes()
    code, _, err = run(capsys, "apply", "--commit", str(affected_tree))
    assert code == 2 and "not in a git work tree" in err and str(affected_tree) in err
    git.Repo.init(affected_tree)
    code, _, err = run(capsys, "apply", "--commit", str(affected_tree))
    assert code == 2 and "no commit yet" in err
    assert (affected_tree / SITE).read_bytes() == before
    assert not (affected_tree / ".gdn-backport").exists()


def test_no_identity_refused_before_any_write(
    capsys: pytest.CaptureFixture[str], repo: git.Repo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """git cannot make the commit (no user identity): found while the commit
    is prepared, before the engine writes."""
    with repo.config_writer() as cfg:
        cfg.remove_section("user")
        cfg.set_value("user", "useConfigOnly", "true")
    for var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "EMAIL"):
        monkeypatch.delenv(var, raising=False)
    before = state(repo)
    code, _, err = run(capsys, "apply", "--commit", str(repo.working_tree_dir))
    assert code == 2 and "git cannot make the commit" in err and err.count("\n") == 1
    assert state(repo) == before
    assert not (Path(repo.working_tree_dir or "") / ".gdn-backport" / "manifest.json").exists()


def test_git_failing_after_the_write_rolls_back(
    capsys: pytest.CaptureFixture[str], repo: git.Repo
) -> None:
    """Another git process holds the index lock when the branch is made: the
    files get their bytes back, no branch is left, and no records folder
    (D24: it used to keep a manifest of no records)."""
    root = Path(repo.working_tree_dir or "")
    before = state(repo)
    lock = Path(repo.git_dir) / "index.lock"
    lock.write_text("")
    code, _, err = run(capsys, "apply", "--commit", str(root))
    lock.unlink()
    assert code == 2 and "the files and branches are as before" in err
    assert state(repo) == before
    assert not (root / ".gdn-backport").exists()


def test_rollback_leaves_earlier_patches_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The rollback restores only this run's files: a file patched (and
    committed) by an earlier run keeps its fix, though its record is there."""
    root = tmp_path / "tree"
    earlier, ours = root / "vllm" / "a_layer.py", root / "vllm" / "b_layer.py"
    earlier.parent.mkdir(parents=True)
    earlier.write_text(AFFECTED)
    (root / "vllm" / "__init__.py").write_text("")
    ours.write_text(AFFECTED)
    assert apply_tree(earlier, root=root).written == ["vllm/a_layer.py"]
    repo = make_repo(root)
    before = state(repo)
    lock = Path(repo.git_dir) / "index.lock"
    lock.write_text("")
    code, _, err = run(capsys, "apply", "--commit", str(root))
    lock.unlink()
    assert code == 2 and "the files and branches are as before" in err
    assert state(repo) == before and earlier.read_text() == FIXED


def test_already_fixed_makes_no_branch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "tree"
    (root / SITE).parent.mkdir(parents=True)
    (root / SITE).write_text(FIXED)
    (root / "vllm" / "__init__.py").write_text("")
    repo = make_repo(root)
    before = state(repo)
    patch = tmp_path / "fix.patch"
    code, out, _ = run(capsys, "apply", "--commit", "--format-patch", str(patch), str(root))
    assert code == 0 and "nothing to do" in out and "no commit made" in out
    assert state(repo) == before and not patch.exists()


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--commit", "--dry-run"], "not allowed with argument"),
        (["--format-patch", "x.patch", "--check"], "exclude each other"),
        (["--branch", "b"], "go with --commit"),
        (["--format-patch", "x.patch", "--branch", "b"], "--branch goes with --commit"),
    ],
)
def test_option_conflicts(
    capsys: pytest.CaptureFixture[str], repo: git.Repo, argv: list[str], reason: str
) -> None:
    before = state(repo)
    code, _, err = run(capsys, "apply", *argv, str(repo.working_tree_dir))
    assert code == 2 and reason in err
    assert state(repo) == before


def test_commit_needs_a_path(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "apply", "--commit", "--installed")
    assert code == 2 and "take a PATH in a git work tree" in err


def _git_am(tmp_path: Path, origin: Path, patch: Path) -> git.Repo:
    """A fresh clone of ``origin`` at its ``main``, the patch applied by ``git am``."""
    clone = git.Repo.clone_from(origin, tmp_path / "clone", branch="main")
    clone.git.config("user.name", "Other Maintainer")
    clone.git.config("user.email", "other@example.invalid")
    clone.git.am(str(patch))
    return clone


def test_format_patch_alone_changes_nothing_and_applies_with_git_am(
    capsys: pytest.CaptureFixture[str], repo: git.Repo, tmp_path: Path
) -> None:
    root = Path(repo.working_tree_dir or "")
    before = state(repo)
    patch = tmp_path / "out" / "0001-gdn.patch"
    patch.parent.mkdir()
    code, out, err = run(capsys, "apply", "--format-patch", str(patch), str(root))
    assert (code, err) == (0, ""), err
    assert "the tree and its branches were not changed" in out
    assert state(repo) == before
    text = patch.read_text()
    assert text.startswith("From ") and "Subject: [PATCH] Backport vLLM PR #51812" in text
    clone = _git_am(tmp_path, root, patch)
    applied = Path(clone.working_tree_dir or "") / SITE
    assert applied.read_text() == FIXED
    assert str(clone.head.commit.message).rstrip("\n").splitlines()[-1] == TRAILER
    assert clone.head.commit.author.name == "Fork Maintainer"


def test_commit_and_format_patch_is_the_branch_commit(
    capsys: pytest.CaptureFixture[str], repo: git.Repo, tmp_path: Path
) -> None:
    root = Path(repo.working_tree_dir or "")
    patch = tmp_path / "fix.patch"
    code, out, _ = run(capsys, "apply", "--commit", "--format-patch", str(patch), str(root))
    assert code == 0 and f"patch: {patch}" in out
    mine = repo.git.format_patch("-1", "--stdout", BRANCH)
    assert patch.read_text().rstrip("\n") == mine.rstrip("\n")
    clone = _git_am(tmp_path, root, patch)
    assert clone.head.commit.tree == repo.head.commit.tree


def test_format_patch_bad_destination(
    capsys: pytest.CaptureFixture[str],
    repo: git.Repo,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = state(repo)
    code, _, err = run(
        capsys, "apply", "--format-patch", str(tmp_path / "no" / "x.patch"), str(root_of(repo))
    )
    assert code == 2 and "no folder" in err
    code, _, err = run(capsys, "apply", "--format-patch", str(tmp_path), str(root_of(repo)))
    assert code == 2 and "is a folder" in err
    # A folder where no file can be made (EROFS), found before the commit.
    real_mkstemp = tempfile.mkstemp
    denied = tmp_path / "ro"
    denied.mkdir()

    def mkstemp(*args: object, **kwargs: object) -> tuple[int, str]:
        if Path(str(kwargs.get("dir"))) == denied:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(denied))
        return real_mkstemp(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    argv = ["apply", "--commit", "--format-patch", str(denied / "x.patch"), str(root_of(repo))]
    code, _, err = run(capsys, *argv)
    assert code == 2 and "Read-only file system" in err and str(denied / "x.patch") in err
    assert state(repo) == before


def root_of(repo: git.Repo) -> Path:
    return Path(repo.working_tree_dir or "")


@pytest.mark.network
@pytest.mark.slow
def test_real_release_commit_patch_and_git_am(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """vLLM 0.25.1 as a fork's repository: one commit per patchset, each
    touching only its own files and carrying its own trailer; the series
    applies with ``git am`` to a fresh clone, which then scans fixed."""
    root = sources.copy_release("0.25.1", tmp_path / "vllm")
    repo = make_repo(root)
    base = repo.head.commit
    layer = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
    split = [
        "vllm/v1/attention/backends/gdn_attn.py",
        "vllm/v1/worker/gpu/model_runner.py",
        "vllm/v1/worker/gpu_model_runner.py",
    ]
    patch = tmp_path / "fix.patch"
    code, out, err = run(capsys, "apply", "--commit", "--format-patch", str(patch), str(root))
    assert (code, err) == (0, ""), err
    assert repo.active_branch.name == "gdn-backport/pr51812+pr51565"
    first, second = repo.head.commit.parents[0], repo.head.commit
    assert first.parents[0] == base
    assert list(first.stats.files) == [layer]
    assert sorted(second.stats.files) == split
    assert first.message.rstrip().endswith("Backport-Of: vllm-project/vllm#51812")
    assert second.message.rstrip().endswith("Backport-Of: vllm-project/vllm#51565")
    assert "vLLM version: 0.25.1 (from vllm/_version.py)" in first.message
    assert "QwenGatedDeltaNetAttention._forward_core: affected -> fixed" in first.message
    assert "GDNAttentionMetadataBuilder.build: affected -> fixed" in second.message
    assert "GPUModelRunner.execute_model: affected -> fixed" in second.message
    assert "_forward_core" not in second.message
    assert repo.git.status("--porcelain") == ""
    # git am on a fresh clone of the unpatched tree
    shutil.rmtree(root / ".gdn-backport")
    clone = _git_am(tmp_path, root, patch)
    clone_root = Path(clone.working_tree_dir or "")
    assert clone.head.commit.tree == repo.head.commit.tree
    code, out, _ = run(capsys, "scan", str(clone_root))
    assert code == 0 and " affected " not in out and "fixed" in out
