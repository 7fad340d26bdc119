"""``--installed``: a fake site-packages holding ``vllm/``, found by find_spec."""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import py_compile
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gdn_backport import atomic, installed
from gdn_backport.patchsets.pr51812.plan import apply_tree
from tests.conftest import AFFECTED, FIXED, run
from tests.test_bad_inputs import immutable

SITE = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"
MODULE = SITE.removesuffix(".py").replace("/", ".")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``site-packages`` with ``vllm/`` (one affected module) and its
    dist-info, first on ``sys.path``. The package's ``__init__`` raises:
    nothing here may import it."""
    root = tmp_path / "site-packages"
    (root / SITE).parent.mkdir(parents=True)
    (root / SITE).write_text(AFFECTED)
    (root / "vllm" / "__init__.py").write_text("raise ImportError('vllm was imported')\n")
    meta = root / "vllm-0.25.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.1\n")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.syspath_prepend(str(root))  # also invalidates the finders' caches
    return root


def files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and atomic.STATE_DIR not in p.parts
    }


def compile_all(source: Path) -> list[Path]:
    """The caches `import` and `compileall -o 0 -o 1 -o 2` write."""
    return [
        Path(str(py_compile.compile(str(source), optimize=level, doraise=True)))
        for level in (0, 1, 2)
    ]


def test_locate_without_importing(site: Path) -> None:
    found = installed.locate_vllm()
    assert found.package == (site / "vllm").resolve() and found.root == site.resolve()
    assert "vllm" not in sys.modules


def test_scan_installed(capsys: pytest.CaptureFixture[str], site: Path) -> None:
    code, out, _ = run(capsys, "scan", "--installed")
    assert code == 1
    lines = out.splitlines()
    assert lines[:2] == [
        f"tree: {site.resolve()}",
        "vllm version: 0.25.1 (from vllm-0.25.1.dist-info/METADATA)",
    ]
    assert f"{SITE}:2" in out and "affected" in out
    assert "vllm" not in sys.modules


def test_apply_and_revert_installed(capsys: pytest.CaptureFixture[str], site: Path) -> None:
    target = site / SITE
    original = target.read_bytes()
    caches = compile_all(target)
    code, out, err = run(capsys, "apply", "--installed")
    assert code == 0, err
    assert target.read_text() == FIXED
    assert not any(c.exists() for c in caches)
    [warning] = err.splitlines()
    assert warning.startswith("gdn-backport: warning: the bytecode caches")
    assert all(c.name in warning for c in caches)
    # The records sit beside vllm/, never inside it (pip uninstall vllm then
    # removes vllm/ whole); vllm/ holds no file it did not hold before.
    assert (site / atomic.STATE_DIR / "manifest.json").exists()
    assert not list((site / "vllm").rglob(f"*{atomic.STATE_DIR}*"))
    assert {p.name for p in (site / "vllm").rglob("*") if p.is_file()} == {
        "__init__.py",
        "gdn_linear_attn.py",
    }
    # Nothing to do the second time; no warning without caches.
    code, out, err = run(capsys, "apply", "--installed")
    assert (code, err) == (0, "") and "nothing to do" in out
    caches = compile_all(target)
    code, _, err = run(capsys, "revert", "--installed")
    assert code == 0
    assert target.read_bytes() == original
    assert not any(c.exists() for c in caches) and "bytecode caches" in err
    assert "vllm" not in sys.modules


def test_stale_unchecked_bytecode_would_run_the_old_code(
    capsys: pytest.CaptureFixture[str], site: Path
) -> None:
    """Why the caches go: an ``unchecked-hash`` pyc (distributions and
    reproducible builds write them) is never compared with its source."""
    (site / "vllm" / "__init__.py").write_text("")
    target = site / SITE

    def gathers_gates() -> bool:
        names = "m.Layer._forward_core.__code__.co_varnames"
        probe = f"import {MODULE} as m; print('a_spec' in {names})"
        env = {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip() == "True"

    unchecked = py_compile.PycInvalidationMode.UNCHECKED_HASH
    py_compile.compile(str(target), invalidation_mode=unchecked, doraise=True)
    # Negative control: the engine alone patches the source, the old code runs.
    apply_tree(site / "vllm", root=site)
    assert "a_spec" in target.read_text() and not gathers_gates()
    target.write_text(AFFECTED)
    (site / atomic.STATE_DIR).rename(site.parent / "old-records")
    py_compile.compile(str(target), invalidation_mode=unchecked, doraise=True)
    assert run(capsys, "apply", "--installed")[0] == 0
    assert gathers_gates()


def test_reinstall_then_apply_then_revert_restores_the_new_version(
    capsys: pytest.CaptureFixture[str], site: Path
) -> None:
    """pip reinstalls (or upgrades) vllm over a patched file: the old record
    is stale, and revert must give back the new version's bytes."""
    target = site / SITE
    assert run(capsys, "apply", "--installed")[0] == 0
    upgraded = "# vllm 0.25.2\n" + AFFECTED
    target.write_text(upgraded)
    assert run(capsys, "apply", "--installed")[0] == 0
    assert run(capsys, "revert", "--installed")[0] == 0
    assert target.read_text() == upgraded


@pytest.mark.parametrize("how", ["immutable", "simulated"])
def test_read_only_file(
    capsys: pytest.CaptureFixture[str], site: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Root writes through mode bits: a real immutable file, or the EACCES
    that the ``r+b`` open meets on a file root cannot write."""
    target = (site / SITE).resolve()
    before = files(site)
    ctx: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if how == "simulated":
        real_open = Path.open

        def open_(self: Path, mode: str = "r", *args: object, **kwargs: object) -> object:
            if self == target and "+" in mode:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real_open(self, mode, *args, **kwargs)  # type: ignore[call-overload]

        monkeypatch.setattr(Path, "open", open_)
    else:
        ctx = immutable(target)
    with ctx:
        code, out, err = run(capsys, "apply", "--installed")
    assert (code, out) == (2, "")
    assert err == f"gdn-backport: {target}: cannot write (Operation not permitted)\n" or (
        err == f"gdn-backport: {target}: cannot write (Permission denied)\n"
    )
    assert files(site) == before
    assert not (site / atomic.STATE_DIR).exists()


@pytest.mark.parametrize("folder", ["site-packages", "__pycache__"])
def test_read_only_records_or_cache_folder(
    capsys: pytest.CaptureFixture[str], site: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """The records folder (site-packages) or the caches to remove cannot be
    written (EROFS): refused before the first write, naming the file."""
    target = site / SITE
    caches = compile_all(target)
    denied = (site if folder == "site-packages" else caches[0].parent).resolve()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: object, **kwargs: object) -> tuple[int, str]:
        if Path(str(kwargs.get("dir"))).resolve() == denied:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(denied))
        return real_mkstemp(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    before = files(site)
    code, _, err = run(capsys, "apply", "--installed")
    assert code == 2 and err.count("\n") == 1
    assert f"cannot write in {denied} (Read-only file system)" in err
    assert files(site) == before and all(c.exists() for c in caches)
    assert not (site / atomic.STATE_DIR).exists()


def test_not_importable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "vllm").exists()])
    importlib.invalidate_caches()
    for argv in (["scan"], ["apply"], ["revert"], ["verify"]):
        code, out, err = run(capsys, *argv, "--installed")
        assert (code, out) == (2, "")
        assert err.startswith("gdn-backport: vllm (for ") and "not importable" in err
        assert err.count("\n") == 1


def test_namespace_package_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b"):
        (tmp_path / name / "vllm").mkdir(parents=True)
        monkeypatch.syspath_prepend(str(tmp_path / name))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    code, _, err = run(capsys, "scan", "--installed")
    assert code == 2 and "namespace package" in err


def test_verify_installed_runs_on_site_packages(
    capsys: pytest.CaptureFixture[str], site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gdn_backport import verify

    seen: list[Path] = []

    def fake(tree: Path, **kwargs: object) -> verify.VerifyReport:
        seen.append(tree)
        return verify.VerifyReport(str(tree), "", "cpu", "float16", error="stop here")

    monkeypatch.setattr(verify, "verify_tree", fake)
    assert run(capsys, "verify", "--installed")[0] == 2
    assert seen == [site.resolve()]
