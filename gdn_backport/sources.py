"""vLLM releases from PyPI: index lookup, verified download, safe extraction.

Everything lands in one cache (``$GDN_BACKPORT_CACHE`` or
``~/.cache/gdn-backport``) shared by every command: ``dist/`` holds the
downloaded archives, ``trees/<version>/`` the extracted ``vllm/`` package.
An archive is used only after its sha256 matches the digest that the index
publishes; extraction refuses members that would land outside the target.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urljoin

from packaging.version import InvalidVersion, Version

from gdn_backport.errors import UsageError

DEFAULT_INDEX = "https://pypi.org/pypi/vllm/json"
# Wheels only exist for a few releases (0.15.x); vLLM's Python sources are the
# same in every platform wheel, so any one of them serves.
_WHEEL_SUFFIX = "manylinux_2_31_x86_64.whl"
_DONE = ".gdn-backport-complete"


@dataclass(frozen=True)
class Artifact:
    version: str
    filename: str
    url: str
    sha256: str
    kind: str  # "sdist" or "wheel"


def cache_dir() -> Path:
    root = os.environ.get("GDN_BACKPORT_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "gdn-backport"


def index_url() -> str:
    """PyPI's JSON API for vllm; ``$GDN_BACKPORT_INDEX`` points elsewhere
    (a mirror, or a ``file://`` document in tests)."""
    return os.environ.get("GDN_BACKPORT_INDEX", DEFAULT_INDEX)


def _index() -> dict[str, object]:
    cached = cache_dir() / "index" / "vllm.json"
    url = index_url()
    offline = os.environ.get("GDN_BACKPORT_OFFLINE") == "1"
    if not offline:
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                data = resp.read()
            cached.parent.mkdir(parents=True, exist_ok=True)
            _atomic_bytes(cached, data)
        except OSError as exc:
            if not cached.exists():
                raise UsageError(f"{url}: cannot reach the index ({exc})") from exc
    if not cached.exists():
        raise UsageError(f"{cached}: offline and no cached index")
    loaded: dict[str, object] = json.loads(cached.read_bytes())
    return loaded


def _same(listed: str, wanted: Version) -> bool:
    try:
        return Version(listed) == wanted
    except InvalidVersion:
        return False


def artifact(version: str) -> Artifact:
    """The archive to fetch for ``version``: the sdist, else a wheel."""
    try:
        wanted = Version(version)
    except InvalidVersion as exc:
        raise UsageError(f"{version}: not a version number") from exc
    url = index_url()
    releases = _index().get("releases")
    if not isinstance(releases, dict):
        raise UsageError(f"{url}: no 'releases' in the index document")
    listed = next((v for v in releases if _same(v, wanted)), None)
    files = releases.get(listed) if listed is not None else None
    if not files:
        raise UsageError(f"vllm {version}: no such release on the index")
    live = [f for f in files if not f.get("yanked")] or files
    sdists = [f for f in live if f.get("packagetype") == "sdist"]
    wheels = [f for f in live if f.get("filename", "").endswith(_WHEEL_SUFFIX)]
    if sdists:
        chosen, kind = sdists[0], "sdist"
    elif wheels:
        chosen, kind = wheels[0], "wheel"
    else:
        raise UsageError(f"vllm {version}: neither an sdist nor an x86_64 wheel")
    return Artifact(
        version=str(listed),
        filename=chosen["filename"],
        url=urljoin(url, chosen["url"]),
        sha256=chosen["digests"]["sha256"],
        kind=kind,
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def download(art: Artifact) -> Path:
    """The archive in the cache, downloaded if missing, sha256 verified."""
    dest = cache_dir() / "dist" / art.filename
    if dest.exists() and _sha256(dest) == art.sha256:
        return dest
    if os.environ.get("GDN_BACKPORT_OFFLINE") == "1":
        raise UsageError(f"{dest}: offline and not in the cache")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{art.filename}.")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(art.url, timeout=600) as resp:
            shutil.copyfileobj(resp, out, 1 << 20)
        got = _sha256(Path(tmp))
        if got != art.sha256:
            raise UsageError(
                f"{art.filename}: sha256 {got} does not match the index's {art.sha256}"
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def _member_target(name: str, prefix: str) -> PurePosixPath | None:
    """Where an archive member goes below the tree root, or None to skip it.

    Only members under ``<prefix>vllm/`` are kept; an absolute name or one
    with ``..`` is refused outright, since it could only be an attack.
    """
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise UsageError(f"{name}: archive member escapes the extraction root")
    parts = path.parts[len(PurePosixPath(prefix).parts) :] if prefix else path.parts
    if not parts or parts[0] != "vllm":
        return None
    return PurePosixPath(*parts)


def _extract_sdist(archive: Path, into: Path, version: str) -> None:
    prefix = f"vllm-{version}"
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            target = _member_target(member.name, prefix)
            if target is None or member.isdir():
                continue
            if not member.isfile():
                # Links and devices are never needed to read Python sources.
                continue
            dest = into / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            with src, dest.open("wb") as out:
                shutil.copyfileobj(src, out)


def _extract_wheel(archive: Path, into: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            target = _member_target(info.filename, "")
            if target is None or info.is_dir() or not info.filename.endswith(".py"):
                continue
            dest = into / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out)


def release_tree(version: str) -> Path:
    """The extracted ``vllm/`` sources of a release: a root holding ``vllm/``.

    The tree is extracted once into the cache; callers that patch it must
    copy it first (see :func:`copy_release`).
    """
    try:
        wanted = Version(version)
    except InvalidVersion as exc:
        raise UsageError(f"{version}: not a version number") from exc
    # A completed extraction was verified when it was made: no index needed.
    trees = cache_dir() / "trees"
    if trees.is_dir():
        for cached in trees.iterdir():
            if _same(cached.name, wanted) and (cached / _DONE).exists():
                return cached
    art = artifact(version)
    root = cache_dir() / "trees" / art.version
    archive = download(art)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{art.version}."))
    try:
        if art.kind == "sdist":
            _extract_sdist(archive, staging, art.version)
        else:
            _extract_wheel(archive, staging)
        (staging / _DONE).write_text(f"{art.filename} {art.sha256}\n")
        if root.exists():
            shutil.rmtree(root)
        os.replace(staging, root)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return root


def copy_release(version: str, dest: Path) -> Path:
    """A private, writable copy of a release tree at ``dest``."""
    shutil.copytree(release_tree(version), dest, ignore=shutil.ignore_patterns(_DONE))
    return dest
