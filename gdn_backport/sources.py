"""vLLM releases from PyPI: index lookup, verified download, safe extraction.

Everything lands in one cache (``$GDN_BACKPORT_CACHE`` or
``~/.cache/gdn-backport``) shared by every command: ``dist/`` holds the
downloaded archives, ``trees/<version>/`` the extracted ``vllm/`` package.
An archive is used only after its sha256 matches the digest that the index
publishes; extraction refuses members that would land outside the target.
"""

from __future__ import annotations

import hashlib
import http.client
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

from gdn_backport import atomic
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


def _cache_folder(*parts: str) -> Path:
    """``cache_dir() / parts``, made if missing. UsageError naming the cache
    and the real reason when it cannot be used (a file where it should be,
    no permission): not to be mistaken for the network's failure."""
    root = cache_dir()
    folder = root.joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Every use writes in it: find out now, not half-way.
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".gdn-backport.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise _unusable(root, exc) from exc
    return folder


def _unusable(root: Path, exc: OSError) -> UsageError:
    why = "not a folder" if root.exists() and not root.is_dir() else exc.strerror or str(exc)
    return UsageError(
        f"{root}: cannot use it as gdn-backport's release cache ({why}); "
        "set GDN_BACKPORT_CACHE to a folder you can write"
    )


def index_url() -> str:
    """PyPI's JSON API for vllm; ``$GDN_BACKPORT_INDEX`` points elsewhere
    (a mirror, or a ``file://`` document in tests)."""
    return os.environ.get("GDN_BACKPORT_INDEX", DEFAULT_INDEX)


def _index() -> dict[str, object]:
    cached = cache_dir() / "index" / "vllm.json"
    url = index_url()
    offline = os.environ.get("GDN_BACKPORT_OFFLINE") == "1"
    if not offline:
        _cache_folder("index")
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            if not cached.exists():
                raise UsageError(f"{url}: cannot reach the index ({exc})") from exc
        else:
            try:
                _atomic_bytes(cached, data)
            except OSError as exc:
                raise _unusable(cache_dir(), exc) from exc
    if not cached.exists():
        raise UsageError(f"{cached}: offline and no cached index")
    loaded: dict[str, object] = json.loads(cached.read_bytes())
    return loaded


def _same(listed: str, wanted: Version) -> bool:
    try:
        return Version(listed) == wanted
    except InvalidVersion:
        return False


def check_spelling(version: str) -> str:
    """``version`` if it is spelled as the index lists releases (a
    normalised version: 0.25.1, 0.9.0.1); else UsageError, with the
    spelling that is where there is one. Needs no network."""
    try:
        normal = str(Version(version))
    except InvalidVersion:
        normal = None
    if normal == version:
        return version
    hint = f" (did you mean {normal}?)" if normal else " (a release is X.Y.Z, e.g. 0.25.1)"
    raise UsageError(f"vllm {version!r}: not a version as the index lists releases{hint}")


def _near(version: str, listed: list[str]) -> list[str]:
    """The listed releases ``version`` comes close to (0.25 -> 0.25.1 and
    0.25.0), newest first: only for the message, never to choose one."""
    wanted = Version(version)
    near = []
    for name in listed:
        try:
            got = Version(name)
        except InvalidVersion:
            continue
        if got == wanted or got.release[: len(wanted.release)] == wanted.release:
            near.append(got)
    return [str(v) for v in sorted(near, reverse=True)[:3]]


def artifact(version: str) -> Artifact:
    """The archive to fetch for ``version``, a release exactly as the index
    lists it: the sdist, else a wheel."""
    check_spelling(version)
    url = index_url()
    releases = _index().get("releases")
    if not isinstance(releases, dict):
        raise UsageError(f"{url}: no 'releases' in the index document")
    listed = version if version in releases else None
    files = releases.get(listed) if listed is not None else None
    if not files:
        near = _near(version, [str(v) for v in releases])
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise UsageError(f"vllm {version}: no such release on the index{hint}")
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


def _cut(art: Artifact, exc: BaseException) -> UsageError:
    """The download of ``art`` failed on the network: why, in one line."""
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
    why = " ".join(str(reason).split()) or type(exc).__name__
    return UsageError(
        f"{art.url}: cannot download vllm {art.version} ({why}); nothing was kept, run again"
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
    _cache_folder("dist")
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{art.filename}.")
    try:
        with os.fdopen(fd, "wb") as out:
            # The network's failures and the cache's are told apart: each
            # names its own place.
            try:
                resp = urllib.request.urlopen(art.url, timeout=600)
            except (OSError, http.client.HTTPException) as exc:
                raise _cut(art, exc) from exc
            with resp:
                while True:
                    try:
                        chunk = resp.read(1 << 20)
                    except (OSError, http.client.HTTPException) as exc:
                        raise _cut(art, exc) from exc
                    if not chunk:
                        break
                    try:
                        out.write(chunk)
                    except OSError as exc:
                        raise UsageError(
                            f"{dest}: cannot write in the release cache ({exc.strerror}); "
                            "nothing was kept"
                        ) from exc
        got = _sha256(Path(tmp))
        if got != art.sha256:
            raise UsageError(
                f"{art.filename}: sha256 {got} does not match the index's {art.sha256} "
                "(a cut or altered download; nothing was kept)"
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
    check_spelling(version)
    # A completed extraction was verified when it was made: no index needed.
    cached = cache_dir() / "trees" / version
    if cached.is_dir() and (cached / _DONE).exists():
        return cached
    art = artifact(version)
    root = cache_dir() / "trees" / art.version
    archive = download(art)
    _cache_folder("trees")
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{art.version}."))
    try:
        if art.kind == "sdist":
            _extract_sdist(archive, staging, art.version)
        else:
            _extract_wheel(archive, staging)
        (staging / _DONE).write_text(f"{art.filename} {art.sha256}\n")
        if (root / _DONE).exists():
            # Another process (a parallel test worker, a second CI job on
            # the same cache) finished first: its tree is as good as ours,
            # and removing it would pull it from under that process.
            return root
        if root.exists():
            shutil.rmtree(root)
        os.replace(staging, root)
    except OSError as exc:
        if (root / _DONE).exists():
            # The other process won the rename between our check and ours.
            return root
        raise UsageError(
            f"{root}: cannot extract vllm {art.version} into the release cache "
            f"({exc.strerror}); nothing was kept"
        ) from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return root


# A copy of a release made for ``apply/revert --release`` carries this marker
# (in its records folder): the release and the sha256 of the archive it was
# extracted from, as the cache's completion marker says.
WORKDIR_MARKER = "workdir.json"
_STATE = ".gdn-backport"


def _stamp(tree: Path) -> dict[str, str]:
    archive, digest = [*(tree / _DONE).read_text().split(), "", ""][:2]
    return {"release": tree.name, "archive": archive, "sha256": digest}


def check_outside_cache(path: Path, what: str = "") -> None:
    """UsageError if ``path`` is the release cache, lies inside it, or
    holds it: gdn-backport never writes there (resolved paths compared)."""
    cache = cache_dir().resolve()
    where = path.resolve()
    if where == cache or cache in where.parents:
        raise UsageError(
            f"{path}: inside gdn-backport's release cache ({cache}), which is never "
            f"patched; {what or 'patch a copy: apply --release X.Y.Z --workdir DIR'}"
        )
    if where in cache.parents:
        raise UsageError(
            f"{path}: holds gdn-backport's release cache ({cache}); "
            f"{what or 'pass a folder that does not'}"
        )


def workdir(version: str, work: Path, *, create: bool = True) -> Path | None:
    """The private copy of a release that ``apply/revert --release`` patch.

    ``work`` is made (a copy of the cached tree and the marker) if it does
    not exist or is an empty folder; an existing one is used only if its
    marker says it is a copy of this release from the same archive. It is
    never the cache, inside it, or around it. With ``create`` False nothing
    is copied: None if there is no copy yet (``revert``: nothing to revert).
    """
    tree = release_tree(version)
    stamp = _stamp(tree)
    other = "pass another --workdir, or remove this one"
    check_outside_cache(work, "pass a --workdir outside it")
    if os.path.lexists(work):
        if not work.is_dir():
            raise UsageError(f"{work}: not a folder; --workdir takes a new or an empty folder")
        marker = work / _STATE / WORKDIR_MARKER
        if marker.is_file() and not marker.is_symlink():
            try:
                found = json.loads(marker.read_text())
            except (OSError, ValueError):
                found = None
            if not isinstance(found, dict) or not isinstance(found.get("release"), str):
                raise UsageError(f"{marker}: unreadable; {other}")
            if not _same(found["release"], Version(stamp["release"])):
                raise UsageError(
                    f"{work}: a copy of vllm {found['release']} made by gdn-backport, "
                    f"not of {stamp['release']}; {other}"
                )
            if found.get("sha256") != stamp["sha256"]:
                raise UsageError(
                    f"{work}: a copy of vllm {stamp['release']} from another archive "
                    f"(sha256 {found.get('sha256')}, the cache has {stamp['sha256']}); {other}"
                )
            return work
        if any(work.iterdir()):
            raise UsageError(
                f"{work}: not empty and not a copy of vllm {stamp['release']} made by "
                f"gdn-backport (no {_STATE}/{WORKDIR_MARKER}); pass a new or an empty "
                "--workdir"
            )
        if not create:
            return None
        _fill(tree, work, stamp)
        return work
    if not create:
        return None
    if not work.parent.is_dir():
        raise UsageError(f"{work}: no folder {work.parent} to make it in")
    # Copied beside it, then renamed: a killed copy never looks like a workdir.
    partial = Path(tempfile.mkdtemp(dir=work.parent, prefix=f".{work.name}.partial-"))
    try:
        _fill(tree, partial, stamp)
        os.rename(partial, work)
    except OSError as exc:
        raise UsageError(f"{work}: cannot make the copy ({exc.strerror})") from exc
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return work


def _fill(tree: Path, dest: Path, stamp: dict[str, str]) -> None:
    shutil.copytree(tree, dest, ignore=shutil.ignore_patterns(_DONE), dirs_exist_ok=True)
    state = dest / _STATE
    state.mkdir(exist_ok=True)
    atomic.ensure_gitignore(state)
    marker = {"format": 1, "made_by": "gdn-backport", **stamp}
    (state / WORKDIR_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def copy_release(version: str, dest: Path) -> Path:
    """A private, writable copy of a release tree at ``dest``."""
    shutil.copytree(release_tree(version), dest, ignore=shutil.ignore_patterns(_DONE))
    return dest
