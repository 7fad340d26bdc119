"""Fetching against a local index (file:// URLs): sha256, safe extraction, cache."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from gdn_backport import sources
from gdn_backport.errors import UsageError


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
    assert sources.release_tree("9.0") == tree


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
