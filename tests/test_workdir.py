"""``apply/revert --release X --workdir DIR``: the copy that is patched, checked.

A workdir must not exist, be empty, or be a copy this tool made of the same
release (its marker: ``.gdn-backport/workdir.json`` with the release and the
sha256 of the archive the cache extracted it from). It is never the release
cache, inside it, or around it. Anything else: exit 2 with the reason, and
nothing is copied or written. The cache itself is never patched, not even
as a PATH.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gdn_backport import atomic, sources
from tests.conftest import AFFECTED, FIXED, run
from tests.test_engine import SITE

DIGEST = "d" * 64


def files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A release cache holding one small "release" 0.25.1 (as extracted)."""
    root = tmp_path / "cache"
    tree = root / "trees" / "0.25.1"
    (tree / SITE).parent.mkdir(parents=True)
    (tree / SITE).write_text(AFFECTED)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / ".gdn-backport-complete").write_text(f"vllm-0.25.1.tar.gz {DIGEST}\n")
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(root))
    monkeypatch.setenv("GDN_BACKPORT_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return root


def test_a_new_workdir_is_made_marked_patched_and_reverted(
    capsys: pytest.CaptureFixture[str], cache: Path
) -> None:
    before = files(cache)
    code, out, err = run(capsys, "apply", "--release", "0.25.1")
    work = Path("vllm-0.25.1")
    assert code == 0 and err == "copied vllm 0.25.1 to vllm-0.25.1\n", err
    assert "undo with `gdn-backport revert vllm-0.25.1`" in out
    assert (work / SITE).read_text() == FIXED
    marker = json.loads((work / atomic.STATE_DIR / "workdir.json").read_text())
    assert marker["release"] == "0.25.1" and marker["sha256"] == DIGEST
    # The same workdir again: recognised, already fixed.
    code, out, err = run(capsys, "apply", "--release", "0.25.1")
    assert (code, err) == (0, "") and "nothing to do" in out
    code, out, _ = run(capsys, "revert", "--release", "0.25.1")
    assert code == 0 and "restored 1 file(s)" in out
    assert (work / SITE).read_text() == AFFECTED
    assert files(cache) == before
    assert not list(Path().glob(".vllm-0.25.1.partial-*"))


def test_an_empty_folder_is_filled(capsys: pytest.CaptureFixture[str], cache: Path) -> None:
    Path("empty").mkdir()
    code, _, err = run(capsys, "apply", "--release", "0.25.1", "--workdir", "empty")
    assert code == 0, err
    assert (Path("empty") / SITE).read_text() == FIXED


def _marked(folder: Path, release: str, digest: str) -> None:
    (folder / SITE).parent.mkdir(parents=True)
    (folder / SITE).write_text(AFFECTED)
    (folder / "vllm" / "__init__.py").write_text("")
    state = folder / atomic.STATE_DIR
    state.mkdir()
    stamp = {"format": 1, "release": release, "archive": "x", "sha256": digest}
    (state / "workdir.json").write_text(json.dumps(stamp))


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("unrelated", "not empty and not a copy of vllm 0.25.1 made by gdn-backport"),
        ("unmarked-copy", "not empty and not a copy of vllm 0.25.1 made by gdn-backport"),
        ("other-release", "a copy of vllm 0.21.0 made by gdn-backport, not of 0.25.1"),
        ("other-archive", "from another archive"),
        ("a-file", "not a folder"),
    ],
)
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_workdir_that_is_not_ours_is_refused(
    capsys: pytest.CaptureFixture[str], cache: Path, kind: str, reason: str, command: str
) -> None:
    """Issue 13: an existing folder was used as it was and the run said
    'nothing to do: no affected site' (exit 0)."""
    work = Path("wd")
    if kind == "unrelated":
        (work / "src").mkdir(parents=True)
        (work / "src" / "main.py").write_text("print('my project')\n")
    elif kind == "unmarked-copy":
        (work / SITE).parent.mkdir(parents=True)
        (work / SITE).write_text(AFFECTED)
        (work / "vllm" / "__init__.py").write_text("")
    elif kind == "other-release":
        work.mkdir()
        _marked(work, "0.21.0", DIGEST)
    elif kind == "other-archive":
        work.mkdir()
        _marked(work, "0.25.1", "e" * 64)
    else:
        work.write_text("a file\n")
    before = files(Path())
    code, out, err = run(capsys, command, "--release", "0.25.1", "--workdir", str(work))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"gdn-backport: {work}: ") and reason in err
    assert files(Path()) == before


@pytest.mark.parametrize("where", ["the-cache", "a-release-in-it", "inside", "holding-it"])
@pytest.mark.parametrize("command", ["apply", "revert"])
def test_the_workdir_is_never_the_cache(
    capsys: pytest.CaptureFixture[str], cache: Path, tmp_path: Path, where: str, command: str
) -> None:
    """Issue 13: a workdir that was the cache patched it (every later scan
    --release read `fixed`); one inside it copied the tree into itself."""
    work = {
        "the-cache": cache,
        "a-release-in-it": cache / "trees" / "0.25.1",
        "inside": cache / "trees" / "0.25.1" / "vllm" / "copy",
        "holding-it": tmp_path,
    }[where]
    before = files(cache)
    code, out, err = run(capsys, command, "--release", "0.25.1", "--workdir", str(work))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "gdn-backport's release cache" in err
    assert files(cache) == before and not (cache / "trees" / "0.25.1" / "vllm" / "copy").exists()
    code, _, _ = run(capsys, "apply", "--check", "--release", "0.25.1")
    assert code == 1  # the cache still holds the affected release


@pytest.mark.parametrize("argv", [["apply"], ["revert"], ["apply", "--commit"]], ids=" ".join)
def test_a_path_in_the_cache_is_never_written(
    capsys: pytest.CaptureFixture[str], cache: Path, argv: list[str]
) -> None:
    before = files(cache)
    code, _, err = run(capsys, *argv, str(cache / "trees" / "0.25.1"))
    assert code == 2 and "gdn-backport's release cache" in err and err.count("\n") == 1
    assert files(cache) == before
    # Reading it is fine.
    assert run(capsys, "apply", "--check", str(cache / "trees" / "0.25.1"))[0] == 1


@pytest.mark.parametrize("dry", [True, False])
def test_revert_with_no_workdir_copies_nothing(
    capsys: pytest.CaptureFixture[str], cache: Path, dry: bool
) -> None:
    """Issue 13: `revert --release X --dry-run` copied the whole release first."""
    argv = ["revert", "--release", "0.25.1", *(["--dry-run"] if dry else [])]
    code, out, err = run(capsys, *argv)
    assert (code, err) == (0, "")
    assert "nothing to revert: vllm-0.25.1 does not exist" in out
    assert list(Path().iterdir()) == []


def test_workdir_needs_release(capsys: pytest.CaptureFixture[str], cache: Path) -> None:
    Path("t").mkdir()
    code, _, err = run(capsys, "apply", "--workdir", "x", "t")
    assert code == 2 and "--workdir goes with --release" in err


def test_a_killed_copy_is_never_taken_for_a_workdir(
    capsys: pytest.CaptureFixture[str], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy is made beside the workdir and renamed once complete."""
    real = sources._fill

    def fill(tree: Path, dest: Path, stamp: dict[str, str]) -> None:
        assert dest.name.startswith(".vllm-0.25.1.partial-")
        real(tree, dest, stamp)
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(sources, "_fill", fill)
    code, _, err = run(capsys, "apply", "--release", "0.25.1")
    assert code == 2 and "cannot make the copy (No space left on device)" in err
    assert list(Path().iterdir()) == []
