"""A refused run leaves no trace; the records never get into git.

Exit 2 means nothing changed on disk: not the tree, not its records folder
(``.gdn-backport/``, its lock file included), not the git object store. And
the records folder's own ``.gitignore`` is always exactly ``*``: written
atomically, repaired by the next writing run when something (a full disk)
left it empty.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import git
import pytest

from gdn_backport import atomic
from tests.conftest import AFFECTED, FIXED, run
from tests.test_bad_inputs import WRAPPED
from tests.test_engine import SITE

REPO = Path(__file__).resolve().parents[1]

STATE = atomic.STATE_DIR


@pytest.fixture(autouse=True)
def _no_user_git_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def everything(root: Path) -> dict[str, bytes | str]:
    """Every path below ``root`` but ``.git``, the records folder and its
    lock file included: a file's bytes, ``"folder"``, or a link's target."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in [*dirnames, *sorted(filenames)]:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                out[rel] = "folder"
            else:
                out[rel] = path.read_bytes()
    return out


def one_line(err: str, *needles: str) -> None:
    assert err.count("\n") == 1 and err.startswith("gdn-backport: "), err
    for needle in needles:
        assert needle in err, (needle, err)


def make_repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.config("user.name", "Fork Maintainer")
    repo.git.config("user.email", "fork@example.invalid")
    repo.git.add("-A")
    repo.git.commit("-qm", "vllm tree")
    return repo


class _FullDisk(io.RawIOBase):
    """A file on a full disk: the first write lands half, then ENOSPC."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def write(self, data: Any) -> int:
        self.real.write(data[: len(data) // 2])
        self.real.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return int(self.real.fileno())

    def close(self) -> None:
        self.real.close()
        super().close()


def fill_disk(monkeypatch: pytest.MonkeyPatch, only: str = "") -> None:
    """From now on every file opened for writing in a records folder (whose
    name holds ``only``) is on a full disk (``Path.write_text`` and
    ``os.fdopen`` both open through ``io.open``), until ``monkeypatch`` is
    undone."""
    real_open = io.open

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(file, mode, *args, **kwargs)
        name = Path(os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else file)
        if set(mode) & set("wax+") and STATE in name.parts and only in name.name:
            return _FullDisk(fh)
        return fh

    monkeypatch.setattr(io, "open", open_)


def test_a_full_disk_leaves_no_records_folder_and_no_empty_gitignore(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    """D7: the first apply on a full disk is refused in one line and leaves
    no ``.gdn-backport/`` (it used to leave one whose ``.gitignore`` was
    empty, which no later run repaired: ``git add -A`` committed the records)."""
    repo = make_repo(affected_tree)
    before = everything(affected_tree)
    with pytest.MonkeyPatch.context() as mp:
        fill_disk(mp)
        code, out, err = run(capsys, "apply", str(affected_tree))
    assert code == 2, out
    one_line(err, str(affected_tree / STATE), "No space left on device")
    assert everything(affected_tree) == before
    # The disk has room again: the next run keeps its records out of git.
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    assert (affected_tree / STATE / ".gitignore").read_bytes() == b"*\n"
    repo.git.add("-A")
    assert repo.git.diff("--cached", "--name-only").splitlines() == [SITE.as_posix()]


@pytest.mark.parametrize("left", [b"", b"*", b"# edited\n", None], ids=repr)
def test_the_next_writing_run_repairs_the_gitignore(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, left: bytes | None
) -> None:
    """D7: a ``.gitignore`` that is empty (what a full disk left), partial,
    edited or missing holds exactly ``*`` after the next writing run, and
    ``git add -A`` then adds none of the records."""
    repo = make_repo(affected_tree)
    state = affected_tree / STATE
    state.mkdir()
    (state / "manifest.json").write_text('{"format": 2, "records": []}\n')
    if left is not None:
        (state / ".gitignore").write_bytes(left)
    code, _, err = run(capsys, "apply", str(affected_tree))
    assert code == 0, err
    assert (state / ".gitignore").read_bytes() == b"*\n"
    assert not list(state.glob(".*.tmp"))
    repo.git.add("-A")
    staged = repo.git.diff("--cached", "--name-only").splitlines()
    assert staged == [SITE.as_posix()]


# -- D24: a refusal touches nothing, the lock file and git's objects included -----------


def _unknown_site(root: Path) -> Path:
    """A module the analysis cannot prove: every apply of the tree refuses."""
    fork = root / "vllm" / "fork_layer.py"
    fork.write_text(WRAPPED)
    return fork


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gdn_backport", *argv],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("then", ["apply", "revert"])
def test_a_refused_run_leaves_the_records_folder_and_its_lock_as_they_were(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, then: str
) -> None:
    """D24: the tree was patched by an earlier run (another process); a run
    that refuses leaves every byte of ``.gdn-backport/`` as it was (it used
    to write its own pid into the lock file)."""
    assert _cli("apply", str(affected_tree)).returncode == 0
    if then == "apply":
        _unknown_site(affected_tree)
    else:
        (affected_tree / SITE).write_text(FIXED + "# my edit\n")
    before = everything(affected_tree)
    code, _, err = run(capsys, then, str(affected_tree))
    assert code == 2
    one_line(err, str(affected_tree))
    assert everything(affected_tree) == before


def _two_affected(root: Path) -> tuple[Path, Path]:
    first, second = root / "vllm" / "a_layer.py", root / "vllm" / "b_layer.py"
    first.parent.mkdir(parents=True, exist_ok=True)
    first.write_text(AFFECTED)
    second.write_text(AFFECTED)
    (root / "vllm" / "__init__.py").write_text("")
    return first, second


@pytest.mark.parametrize("earlier", [False, True], ids=["first-run", "earlier-records"])
@pytest.mark.parametrize("fails", ["rename", "manifest", "original"])
def test_a_write_refused_half_way_leaves_no_records_behind(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fails: str, earlier: bool
) -> None:
    """D24: the second rename fails (EROFS), or the disk is full for the
    manifest or a stored original: one line, exit 2, and the tree as it
    was, ``.gdn-backport/`` included: no folder made on a first run (it used
    to keep the originals, and a manifest of no records), the earlier
    records byte for byte."""
    tree = tmp_path / "tree"
    first, second = _two_affected(tree)
    if earlier:
        other = tree / "vllm" / "c_layer.py"
        other.write_text(AFFECTED)
        assert run(capsys, "apply", str(other))[0] == 0
    before = everything(tree)
    with pytest.MonkeyPatch.context() as mp:
        if fails == "rename":
            real_replace = os.replace

            def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
                if Path(dst) == second:
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
                real_replace(src, dst)

            mp.setattr(os, "replace", replace)
        else:
            original = hashlib.sha256(AFFECTED.encode()).hexdigest()
            fill_disk(mp, only="manifest" if fails == "manifest" else original)
        code, out, err = run(capsys, "apply", str(tree))
    assert code == 2, out
    one_line(err, str(second) if fails == "rename" else str(tree / STATE), "cannot write")
    assert everything(tree) == before
    # Nothing was lost either: the next run patches, and revert undoes it all.
    assert run(capsys, "apply", str(tree))[0] == 0
    assert first.read_text() == second.read_text() == FIXED
    assert run(capsys, "revert", str(tree))[0] == 0
    assert first.read_text() == second.read_text() == AFFECTED


def objects(repo: git.Repo) -> list[str]:
    """Every file of the repository's object store."""
    store = Path(repo.git_dir) / "objects"
    return sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file())


def git_state(repo: git.Repo) -> tuple[object, ...]:
    """The index, refs and HEAD."""
    refs = sorted((r.path, r.commit.hexsha) for r in repo.refs)
    return (repo.git.ls_files("-s"), refs, repo.git.rev_parse("HEAD"))


def no_new_objects(repo: git.Repo, before: list[str]) -> None:
    new = sorted(set(objects(repo)) - set(before))
    assert not new, f"{len(new)} new git object(s): {new}"


def test_no_identity_leaves_no_git_object(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D24: git has no identity to commit with; found before any object is
    made (it used to store the blob and the tree, then fail on the commit)."""
    repo = make_repo(affected_tree)
    with repo.config_writer() as cfg:
        cfg.remove_section("user")
        cfg.set_value("user", "useConfigOnly", "true")
    for var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "EMAIL"):
        monkeypatch.delenv(var, raising=False)
    before, files, store = git_state(repo), everything(affected_tree), objects(repo)
    for argv in (["--commit"], ["--format-patch", str(affected_tree.parent / "fix.patch")]):
        code, _, err = run(capsys, "apply", *argv, str(affected_tree))
        assert code == 2
        one_line(err, str(affected_tree), "git cannot make the commit")
        no_new_objects(repo, store)
        assert git_state(repo) == before
        assert everything(affected_tree) == files
    assert not (affected_tree.parent / "fix.patch").exists()


@pytest.mark.network
@pytest.mark.slow
def test_a_refused_commit_of_two_patchsets_leaves_no_trace(
    capsys: pytest.CaptureFixture[str], release: Any, tmp_path: Path
) -> None:
    """D24: vLLM 0.25.1 as a fork's repository, the builder file (patchset
    pr51565) edited by the user, ``apply --commit --allow-dirty``: refused
    before anything is written (it used to patch and record the layer of
    pr51812, store 8 git objects, then refuse the builder)."""
    root = tmp_path / "vllm"
    shutil.copytree(release("0.25.1"), root, ignore=shutil.ignore_patterns(".gdn-backport-*"))
    repo = make_repo(root)
    builder = root / "vllm" / "v1" / "attention" / "backends" / "gdn_attn.py"
    builder.write_text(builder.read_text() + "\n# a local edit\n")
    before, files, store = git_state(repo), everything(root), objects(repo)
    code, out, err = run(capsys, "apply", "--commit", "--allow-dirty", str(root))
    assert code == 2, out
    one_line(err, str(builder), "has uncommitted changes")
    no_new_objects(repo, store)
    assert git_state(repo) == before
    assert everything(root) == files
