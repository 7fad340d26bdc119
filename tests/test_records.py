"""The records of ``revert`` (``.gdn-backport/``): format, checks, follow the file.

Every path read from a record must stay inside the tree and pass through no
symbolic link (inside site-packages' ``vllm/`` with ``--installed``); hashes
are 64 hex digits; the stored original exists and has its hash. Anything
else: one line on stderr, exit 2, nothing written. A record follows the
bytes we wrote, so ``revert`` on a checkout where the file holds its
original leaves the record for the checkout where it is patched.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import git
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gdn_backport import atomic
from gdn_backport.cli import main
from gdn_backport.records import Records
from tests.conftest import AFFECTED, FIXED, run
from tests.test_engine import SITE

STATE = atomic.STATE_DIR


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root``, the records folder included."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != "lock"
    }


def one_line(err: str, *needles: str) -> None:
    assert err.count("\n") == 1 and err.startswith("gdn-backport: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def manifest(root: Path) -> object:
    return json.loads((root / STATE / "manifest.json").read_text())


def test_format_2_is_readable_and_content_addressed(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    doc = manifest(affected_tree)
    assert isinstance(doc, dict) and doc["format"] == 2
    [record] = doc["records"]
    assert record["path"] == SITE.as_posix()
    assert record["original_sha256"] == sha(AFFECTED.encode())
    assert record["patched_sha256"] == sha(FIXED.encode())
    assert record["strategy"] == "gather"
    stored = affected_tree / STATE / "originals" / record["original_sha256"]
    assert stored.read_bytes() == AFFECTED.encode()


def _format_1(root: Path, entries: dict[str, dict[str, str]], originals: dict[str, bytes]) -> None:
    """Records as gdn-backport wrote them before format 2."""
    state = root / STATE
    state.mkdir(exist_ok=True)
    (state / "manifest.json").write_text(json.dumps(entries))
    for rel, data in originals.items():
        dest = state / "originals" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)


def _entry(original: bytes, patched: bytes) -> dict[str, str]:
    return {
        "original_sha256": sha(original),
        "patched_sha256": sha(patched),
        "strategy": "gather",
        "upstream": "vllm-project/vllm#51812",
        "tool_version": "0.1.0",
    }


def test_format_1_records_still_revert(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    (affected_tree / SITE).write_text(FIXED)
    rel = SITE.as_posix()
    _format_1(
        affected_tree, {rel: _entry(AFFECTED.encode(), FIXED.encode())}, {rel: AFFECTED.encode()}
    )
    code, _, err = run(capsys, "revert", str(affected_tree))
    assert code == 0, err
    assert (affected_tree / SITE).read_text() == AFFECTED
    # Saved as format 2; the old layout's originals are gone.
    assert manifest(affected_tree) == {"format": 2, "records": []}
    assert not list((affected_tree / STATE / "originals").rglob("*"))


# -- bug 2: a record path out of the tree ------------------------------------------


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the tree whose bytes a forged record claims we wrote."""
    target = tmp_path / "victim" / "target.py"
    target.parent.mkdir()
    target.write_text(FIXED)
    return target


FORGED = b"# planted by a forged record\n"


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlinked-folder", "symlinked-file"])
def test_revert_never_follows_a_record_out_of_the_tree(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, victim: Path, fmt: int, how: str
) -> None:
    if how == "dotdot":
        rel = "../victim/target.py"
    elif how == "absolute":
        rel = str(victim)
    elif how == "symlinked-folder":
        (affected_tree / "vllm" / "escape").symlink_to(victim.parent, target_is_directory=True)
        rel = "vllm/escape/target.py"
    else:
        (affected_tree / "vllm" / "target.py").symlink_to(victim)
        rel = "vllm/target.py"
    state = affected_tree / STATE
    if fmt == 1:
        # Format 1 kept the original at originals/<path>: plant it where the
        # old code read it from.
        _format_1(affected_tree, {rel: _entry(FORGED, victim.read_bytes())}, {})
        where = Path(str(state / "originals") + "/" + rel) if not rel.startswith("/") else None
        if where is not None:
            where.parent.mkdir(parents=True, exist_ok=True)
            if not where.parent.is_symlink() and not where.is_symlink():
                where.write_bytes(FORGED)
    else:
        (state / "originals").mkdir(parents=True)
        (state / "originals" / sha(FORGED)).write_bytes(FORGED)
        entry = {"path": rel, **_entry(FORGED, victim.read_bytes())}
        (state / "manifest.json").write_text(json.dumps({"format": 2, "records": [entry]}))
    before = files(affected_tree)
    for argv in (["revert"], ["revert", "--dry-run"], ["apply"]):
        code, out, err = run(capsys, *argv, str(affected_tree))
        assert code == 2, (argv, out, err)
        one_line(err, str(state / "manifest.json"))
        assert victim.read_text() == FIXED
        assert files(affected_tree) == before


def test_installed_records_stay_inside_vllm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --installed, a record naming site-packages/other/x.py (inside
    the records' root, outside vllm/) is refused."""
    import sys

    site = tmp_path / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    other = site / "other" / "x.py"
    other.parent.mkdir()
    other.write_text(FIXED)
    _format_1(site, {"other/x.py": _entry(FORGED, FIXED.encode())}, {"other/x.py": FORGED})
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.syspath_prepend(str(site))
    code, _, err = run(capsys, "revert", "--installed")
    assert code == 2
    one_line(err, "other/x.py", "not inside")
    assert other.read_text() == FIXED


# -- bug 3: a stored original that is gone or changed -------------------------------


@pytest.mark.parametrize("damage", ["deleted", "changed", "folder-deleted"])
def test_damaged_stored_original_is_a_one_line_refusal(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, damage: str
) -> None:
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    originals = affected_tree / STATE / "originals"
    stored = [p for p in originals.rglob("*") if p.is_file()]
    assert stored
    if damage == "deleted":
        for p in stored:
            p.unlink()
    elif damage == "changed":
        for p in stored:
            p.write_bytes(b"not the original\n")
    else:
        shutil.rmtree(originals)
    before = files(affected_tree)
    code, out, err = run(capsys, "revert", str(affected_tree))
    assert code == 2 and not out.strip().endswith("original bytes")
    one_line(err, "stored original" if damage != "folder-deleted" else "originals")
    assert files(affected_tree) == before
    assert (affected_tree / SITE).read_text() == FIXED


# -- records follow the patched file -----------------------------------------------------


@pytest.fixture(autouse=True)
def _no_user_git_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def test_revert_on_the_base_branch_keeps_the_record_for_the_fix_branch(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    repo = git.Repo.init(affected_tree, initial_branch="main")
    repo.git.config("user.name", "Fork Maintainer")
    repo.git.config("user.email", "fork@example.invalid")
    repo.git.add("-A")
    repo.git.commit("-qm", "vllm tree")
    assert run(capsys, "apply", "--commit", str(affected_tree))[0] == 0
    repo.git.checkout("-q", "main")
    assert (affected_tree / SITE).read_text() == AFFECTED
    code, out, _ = run(capsys, "revert", str(affected_tree))
    assert code == 0 and "nothing to revert" in out and "records are kept" in out
    repo.git.checkout("-q", "gdn-backport/pr51812")
    assert (affected_tree / SITE).read_text() == FIXED
    code, out, _ = run(capsys, "revert", str(affected_tree))
    assert code == 0 and "restored 1 file(s)" in out
    assert (affected_tree / SITE).read_text() == AFFECTED


def test_two_originals_of_one_file_each_come_back(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    """Two checkouts with different originals of the same file, each patched:
    revert restores whichever is there."""
    target = affected_tree / SITE
    other = "# the other branch's version\n" + AFFECTED
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    patched_one = target.read_bytes()
    target.write_text(other)  # "checkout" of the other branch
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    patched_two = target.read_bytes()
    assert len(Records(affected_tree)) == 2
    target.write_bytes(patched_one)
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert target.read_text() == AFFECTED
    target.write_bytes(patched_two)
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert target.read_text() == other


# -- a property over corrupted records ----------------------------------------------------

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
HEX = "0123456789abcdef"
some_sha = st.text(HEX, min_size=64, max_size=64)
bad_sha = st.one_of(
    st.text(HEX, min_size=0, max_size=63),
    st.text(HEX.upper(), min_size=64, max_size=64),
    st.text(min_size=64, max_size=64),
    st.integers(),
    st.none(),
)
bad_path = st.sampled_from(
    [
        "../victim/target.py",
        "vllm/../../victim/target.py",
        "VICTIM_ABS",
        "vllm/escape/target.py",
        "vllm/linked.py",
        "vllm\\model.py",
        "",
        "./vllm/x.py",
        "vllm//x.py",
        ".gdn-backport/manifest.json",
        "vllm",
        "vllm/missing.py",
    ]
) | st.text(max_size=30)


@st.composite
def corruption(draw: st.DrawFn) -> list[tuple[str, object]]:
    ops = st.one_of(
        st.tuples(st.just("path"), bad_path),
        st.tuples(st.sampled_from(["original_sha256", "patched_sha256"]), bad_sha | some_sha),
        st.tuples(st.just("drop-key"), st.sampled_from(["path", "strategy", "patched_sha256"])),
        st.tuples(st.just("extra-key"), st.text(max_size=8)),
        st.tuples(st.just("type"), st.sampled_from(["strategy", "path", "upstream"])),
        st.tuples(st.just("original"), st.sampled_from(["delete", "change", "link", "extra"])),
        st.tuples(st.just("garbage"), st.binary(max_size=40)),
        st.tuples(st.just("shape"), st.sampled_from(["list", "number", "string", "null"])),
        st.tuples(st.just("format"), st.sampled_from([1, 3, "2", None])),
        st.tuples(st.just("duplicate"), st.just(None)),
        st.tuples(st.just("records-folder"), st.sampled_from(["link", "file"])),
    )
    return draw(st.lists(ops, min_size=1, max_size=3))


@contextlib.contextmanager
def _tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def _corrupt(root: Path, victim: Path, ops: list[tuple[str, object]]) -> None:
    state = root / STATE
    path = state / "manifest.json"
    doc = json.loads(path.read_text())
    record = doc["records"][0]
    raw: bytes | None = None
    for op, arg in ops:
        if op == "path":
            record["path"] = str(victim) if arg == "VICTIM_ABS" else arg
        elif op in ("original_sha256", "patched_sha256"):
            record[op] = arg
        elif op == "drop-key":
            record.pop(str(arg), None)
        elif op == "extra-key":
            record[f"x{arg}"] = "1"
        elif op == "type":
            record[str(arg)] = 7
        elif op == "original":
            folder = state / "originals"
            if folder.is_symlink() or not folder.is_dir():
                continue
            stored = [p for p in folder.iterdir() if p.is_file()]
            for p in stored:
                if arg == "delete":
                    p.unlink()
                elif arg == "change":
                    p.write_bytes(b"changed\n")
                elif arg == "link":
                    p.unlink()
                    p.symlink_to(victim)
                else:
                    (state / "originals" / ("0" * 64)).write_bytes(b"extra\n")
        elif op == "garbage":
            raw = bytes(arg) if isinstance(arg, bytes) else b""
        elif op == "shape":
            raw = json.dumps(
                {"list": [], "number": 3, "string": "x", "null": None}[str(arg)]
            ).encode()
        elif op == "format":
            doc["format"] = arg
        elif op == "duplicate":
            doc["records"].append(dict(record))
        elif op == "records-folder":
            folder = state / "originals"
            if folder.is_symlink() or folder.is_file():
                folder.unlink()
            else:
                shutil.rmtree(folder)
            if arg == "link":
                (state / "originals").symlink_to(victim.parent, target_is_directory=True)
            else:
                (state / "originals").write_text("not a folder\n")
    path.write_bytes(raw if raw is not None else json.dumps(doc).encode())


def _cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


@SETTINGS
@given(corruption())
# Found by this test in session 6: a record path holding a newline made the
# refusal two lines (control characters are now refused as paths).
@example(ops=[("path", "\n")])
def test_corrupted_records_refuse_cleanly_or_restore(ops: list[tuple[str, object]]) -> None:
    """Whatever is done to the records: revert (and a later apply) end in a
    one-line exit 2 with nothing written, or exit 0 with the file holding
    exactly its original or its patched bytes; nothing outside the tree
    is ever written."""
    with _tmp() as tmp:
        root = tmp / "tree"
        (root / SITE).parent.mkdir(parents=True)
        (root / SITE).write_text(AFFECTED)
        (root / "vllm" / "__init__.py").write_text("")
        victim = tmp / "victim" / "target.py"
        victim.parent.mkdir()
        assert _cli("apply", str(root))[0] == 0
        victim.write_bytes((root / SITE).read_bytes())  # what a forged record would claim
        (root / "vllm" / "escape").symlink_to(victim.parent, target_is_directory=True)
        (root / "vllm" / "linked.py").symlink_to(victim)
        _corrupt(root, victim, ops)
        outside = files(victim.parent)
        for argv in (["revert"], ["apply"]):
            before = files(root)
            code, err = _cli(*argv, str(root))
            assert files(victim.parent) == outside, argv
            assert code in (0, 2), (argv, err)
            if code == 2:
                assert err.count("\n") == 1 and err.startswith("gdn-backport: "), err
                assert files(root) == before, argv
            else:
                assert (root / SITE).read_text() in (AFFECTED, FIXED)


def test_a_file_left_patched_by_a_failed_rollback_keeps_its_record(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files; the second rename fails, and so does putting the first one
    back: the first stays patched, so its record must stay (issue 13: the
    rollback dropped the records after the fact, so a patched file could be
    left with none). revert then restores it."""
    import errno
    import os

    tree = tmp_path / "tree"
    first, second = tree / "vllm" / "a_layer.py", tree / "vllm" / "b_layer.py"
    first.parent.mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    first.write_text(AFFECTED)
    second.write_text(AFFECTED)
    real_replace = os.replace
    calls: list[Path] = []

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        calls.append(Path(dst))
        if Path(dst) == second or (Path(dst) == first and calls.count(first) == 2):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run(capsys, "apply", str(tree))
    monkeypatch.undo()
    assert code == 2 and err.count("\n") == 1
    assert f"{first} keeps the new bytes" in err
    assert (first.read_text(), second.read_text()) == (FIXED, AFFECTED)
    records = Records(tree)
    rec = records.matching("vllm/a_layer.py", sha(FIXED.encode()))
    assert rec is not None and records.original(rec) == AFFECTED.encode()
    assert records.matching("vllm/b_layer.py", sha(FIXED.encode())) is None
    code, out, _ = run(capsys, "revert", str(tree))
    assert code == 0 and "restored 1 file(s)" in out
    assert first.read_text() == second.read_text() == AFFECTED
