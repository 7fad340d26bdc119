"""Fetching against a local index (file:// URLs): sha256, safe extraction, cache."""

from __future__ import annotations

import errno
import hashlib
import http.client
import io
import json
import os
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

from gdn_backport import sources
from gdn_backport.errors import UsageError
from tests.conftest import run


def _sdist(path: Path, version: str, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Publish archives in a fake index; returns a function adding one."""
    releases: dict[str, list[dict[str, object]]] = {}
    doc = tmp_path / "index" / "vllm.json"
    doc.parent.mkdir()
    monkeypatch.setenv("GDN_BACKPORT_INDEX", doc.as_uri())
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GDN_BACKPORT_OFFLINE", raising=False)

    def publish(version: str, archive: Path, kind: str = "sdist", sha: str | None = None) -> None:
        digest = sha or hashlib.sha256(archive.read_bytes()).hexdigest()
        releases.setdefault(version, []).append(
            {
                "filename": archive.name,
                "packagetype": kind,
                "url": archive.as_uri(),
                "digests": {"sha256": digest},
            }
        )
        doc.write_text(json.dumps({"releases": releases}))

    return publish


def test_release_tree_extracts_only_the_package(tmp_path: Path, index) -> None:  # type: ignore[no-untyped-def]
    archive = _sdist(
        tmp_path / "vllm-9.0.0.tar.gz",
        "9.0.0",
        {
            "vllm-9.0.0/vllm/__init__.py": b"# ok\n",
            "vllm-9.0.0/vllm/a/b.py": b"x = 1\n",
            "vllm-9.0.0/tests/t.py": b"skip me\n",
            "vllm-9.0.0/setup.py": b"skip me\n",
        },
    )
    index("9.0.0", archive)
    tree = sources.release_tree("9.0.0")
    files = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.py"))
    assert files == ["vllm/__init__.py", "vllm/a/b.py"]
    # A second call is served from the cache, even offline.
    archive.unlink()
    assert sources.release_tree("9.0.0") == tree


def test_a_tree_another_process_finished_first_is_kept(
    tmp_path: Path, index, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Two processes (parallel test workers, two CI jobs on one cache) fetch
    the same release: the one that finishes second must not remove the
    first one's tree, which the first may be reading."""
    archive = _sdist(tmp_path / "vllm-9.0.5.tar.gz", "9.0.5", {"vllm-9.0.5/vllm/x.py": b"x\n"})
    index("9.0.5", archive)
    real = sources._extract_sdist
    root = sources.cache_dir() / "trees" / "9.0.5"

    def racing(archive: Path, into: Path, version: str) -> None:
        # The other process completes the same tree while this one extracts.
        other = root.parent / ".other"
        real(archive, other, version)
        (other / "vllm" / "in-use.txt").write_text("open by the other process\n")
        (other / sources._DONE).write_text("done\n")
        os.replace(other, root)
        real(archive, into, version)

    monkeypatch.setattr(sources, "_extract_sdist", racing)
    assert sources.release_tree("9.0.5") == root
    assert (root / "vllm" / "in-use.txt").exists()
    assert (root / "vllm" / "x.py").read_text() == "x\n"
    assert [p.name for p in root.parent.iterdir()] == ["9.0.5"]


def test_sha256_mismatch_is_refused(tmp_path: Path, index) -> None:  # type: ignore[no-untyped-def]
    archive = _sdist(tmp_path / "vllm-9.0.1.tar.gz", "9.0.1", {"vllm-9.0.1/vllm/x.py": b""})
    index("9.0.1", archive, sha="0" * 64)
    with pytest.raises(UsageError, match=r"sha256 .* does not match"):
        sources.release_tree("9.0.1")
    assert not list((Path(sources.cache_dir()) / "dist").glob("*.tar.gz"))


@pytest.mark.parametrize("evil", ["../evil.py", "/abs/evil.py", "vllm-9.0.2/vllm/../../evil.py"])
def test_path_escape_is_refused(tmp_path: Path, index, evil: str) -> None:  # type: ignore[no-untyped-def]
    archive = _sdist(
        tmp_path / "vllm-9.0.2.tar.gz", "9.0.2", {"vllm-9.0.2/vllm/x.py": b"", evil: b"pwned"}
    )
    index("9.0.2", archive)
    with pytest.raises(UsageError, match="escapes the extraction root"):
        sources.release_tree("9.0.2")
    assert not list(tmp_path.rglob("evil.py"))
    assert not (sources.cache_dir() / "trees" / "9.0.2").exists()


def test_wheel_only_release_reads_the_sources_out_of_the_wheel(tmp_path: Path, index) -> None:  # type: ignore[no-untyped-def]
    wheel = tmp_path / "vllm-9.1.0-cp38-abi3-manylinux_2_31_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm/__init__.py", "# from a wheel\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF")
        zf.writestr("vllm-9.1.0.dist-info/METADATA", "Name: vllm\n")
    index("9.1.0", wheel, kind="bdist_wheel")
    tree = sources.release_tree("9.1.0")
    assert sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()) == [
        ".gdn-backport-complete",
        "vllm/__init__.py",
    ]


def test_unknown_release_and_bad_version(index) -> None:  # type: ignore[no-untyped-def]
    (Path(sources.index_url().removeprefix("file://"))).write_text('{"releases": {}}')
    with pytest.raises(UsageError, match="no such release"):
        sources.release_tree("1.2.3")
    with pytest.raises(UsageError, match="not a version"):
        sources.release_tree("latest")


# -- the network and the cache failing (issue D9, D13, D25) -------------------------------


class _Response(io.BytesIO):
    """An HTTP response whose body stops after ``upto`` bytes: with
    ``fail``, that read raises it (a reset connection); else it ends early."""

    def __init__(self, data: bytes, upto: int, fail: BaseException | None) -> None:
        super().__init__(data[:upto])
        self.fail = fail

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        if not chunk and self.fail is not None:
            raise self.fail
        return chunk


def _cut_downloads(monkeypatch: pytest.MonkeyPatch, fail: BaseException | None) -> None:
    """Archives (not the index) come through a connection cut half-way."""
    real = urllib.request.urlopen

    def urlopen(url: str, *args: object, **kwargs: object) -> object:
        if not url.endswith(".tar.gz"):
            return real(url, *args, **kwargs)  # type: ignore[arg-type]
        data = Path(url.removeprefix("file://")).read_bytes()
        return _Response(data, len(data) // 2, fail)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


def _cache_files() -> list[str]:
    cache = sources.cache_dir()
    return sorted(
        p.relative_to(cache).as_posix()
        for p in cache.rglob("*")
        if p.is_file() and "index" not in p.parts
    )


@pytest.mark.parametrize(
    "fail",
    [
        ConnectionResetError(104, "Connection reset by peer"),
        http.client.IncompleteRead(b"x" * 10, 90),
        TimeoutError("timed out"),
    ],
    ids=["reset", "incomplete", "timeout"],
)
def test_a_download_cut_mid_way_is_one_line_and_leaves_nothing(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    index,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
    fail: BaseException,
) -> None:
    """D9: the connection fails half-way through the sdist: one line naming
    the URL, the release and the reason, exit 2, no partial file in the
    cache (it used to be a raw traceback, exit 1)."""
    archive = _sdist(tmp_path / "vllm-9.0.3.tar.gz", "9.0.3", {"vllm-9.0.3/vllm/x.py": b"x" * 999})
    index("9.0.3", archive)
    _cut_downloads(monkeypatch, fail)
    for argv in (["fetch", "9.0.3"], ["scan", "--release", "9.0.3"]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, ""), err
        assert err.count("\n") == 1, err
        assert err.startswith(f"gdn-backport: {archive.as_uri()}: cannot download vllm 9.0.3 (")
        assert _cache_files() == []


def test_a_truncated_download_fails_its_sha256_and_leaves_nothing(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    index,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D9: the body ends early without an error: the sha256 check refuses
    it in one line, and nothing is kept for a later run to trust."""
    archive = _sdist(tmp_path / "vllm-9.0.4.tar.gz", "9.0.4", {"vllm-9.0.4/vllm/x.py": b"x" * 999})
    index("9.0.4", archive)
    _cut_downloads(monkeypatch, None)
    code, out, err = run(capsys, "fetch", "9.0.4")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and archive.name in err and "does not match" in err, err
    assert _cache_files() == []


def test_a_cache_that_is_a_file_is_named_not_the_network(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    index,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D13: ``GDN_BACKPORT_CACHE`` names a file: one line naming the cache
    and why, exit 2 (it used to say "cannot reach the index")."""
    archive = _sdist(tmp_path / "vllm-9.0.5.tar.gz", "9.0.5", {"vllm-9.0.5/vllm/x.py": b""})
    index("9.0.5", archive)
    cache = tmp_path / "a-file"
    cache.write_text("not a cache\n")
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(cache))
    for argv in (["fetch", "9.0.5"], ["scan", "--release", "9.0.5"]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, "")
        assert err == (
            f"gdn-backport: {cache}: cannot use it as gdn-backport's release cache (not a "
            "folder); set GDN_BACKPORT_CACHE to a folder you can write\n"
        )
    assert cache.read_text() == "not a cache\n"


def test_a_cache_folder_without_write_permission_is_named(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    index,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D13: a cache folder no file can be made in (its owner is another
    user; as root, the refusal is simulated where the file is made): the
    cache and "Permission denied", not the index."""
    archive = _sdist(tmp_path / "vllm-9.0.6.tar.gz", "9.0.6", {"vllm-9.0.6/vllm/x.py": b""})
    index("9.0.6", archive)
    cache = sources.cache_dir()
    (cache / "index").mkdir(parents=True)
    real = tempfile.mkstemp

    def mkstemp(*args: object, **kwargs: object) -> tuple[int, str]:
        if cache in Path(str(kwargs.get("dir"))).parents:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    code, out, err = run(capsys, "fetch", "9.0.6")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"gdn-backport: {cache}: cannot use it"), err
    assert "(Permission denied)" in err and "index" not in err


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        ("v0.25.1", "did you mean 0.25.1?"),
        (" 0.25.1", "did you mean 0.25.1?"),
        ("0.25.1 ", "did you mean 0.25.1?"),
        ("0.25.01", "did you mean 0.25.1?"),
        ("latest", "a release is X.Y.Z, e.g. 0.25.1"),
        ("", "a release is X.Y.Z, e.g. 0.25.1"),
    ],
)
def test_an_ill_formed_release_is_refused_without_the_network(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    given: str,
    hint: str,
) -> None:
    """D25: a release is spelled exactly as the index lists it; anything
    else is one line, exit 2, before any network access or copy (``v0.25.1``
    and `` 0.25.1`` used to be taken for 0.25.1)."""

    def no_network(*args: object, **kwargs: object) -> object:
        raise AssertionError("the index was asked")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.chdir(tmp_path)
    for argv in (
        ["fetch", given],
        ["scan", "--release", given],
        ["apply", "--release", given, "--dry-run"],
        ["apply", "--release", given],
        ["revert", "--release", given],
    ):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert err == (
            f"gdn-backport: vllm {given!r}: not a version as the index lists releases ({hint})\n"
        ), argv
    assert list(tmp_path.iterdir()) == []


def test_a_release_the_index_does_not_list_is_refused_with_the_near_misses(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    index,  # type: ignore[no-untyped-def]
) -> None:
    """D25: ``--release 9.1`` is not 9.1.0 (it used to fetch 9.1.0 without a
    word): refused, naming the releases it comes close to, newest first."""
    for version in ("9.1.0", "9.1.1", "9.2.0"):
        name = f"vllm-{version}"
        index(version, _sdist(tmp_path / f"{name}.tar.gz", version, {f"{name}/vllm/x.py": b""}))
    for given, hint in (
        ("9.1", "; did you mean 9.1.1 or 9.1.0?"),
        ("9.1.0.0", "; did you mean 9.1.0?"),
        ("9.3.0", ""),
    ):
        code, out, err = run(capsys, "fetch", given)
        assert (code, out) == (2, ""), given
        assert err == f"gdn-backport: vllm {given}: no such release on the index{hint}\n"
    assert not (sources.cache_dir() / "trees").exists()
    assert run(capsys, "fetch", "9.1.1")[0] == 0
