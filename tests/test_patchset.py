"""patchsets/pr51812/patchset.toml: loading and validation."""

from __future__ import annotations

import copy
import errno
import os
from pathlib import Path
from typing import Any

import pytest

from gdn_backport.errors import UsageError
from gdn_backport.patchsets.pr51812.config import load, parse
from tests.conftest import run
from tests.test_engine import SITE


def test_shipped_patchset() -> None:
    ps = load()
    assert ps.upstream == "vllm-project/vllm#51812"
    assert ps.trailer == "Backport-Of: vllm-project/vllm#51812"
    fused = ps.kernels["fused_sigmoid_gating_delta_rule_update"]
    # b before a in the layer's signature, a before b in the kernel's: the
    # positional order is the kernel's own.
    assert fused.params[:3] == ("A_log", "a", "b") and fused.fix_target
    assert "spec_token_indx" in ps.fields.spec_index


def _raw() -> dict[str, object]:
    import sys
    from importlib import resources

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    text = resources.files("gdn_backport.patchsets.pr51812").joinpath("patchset.toml").read_text()
    return tomllib.loads(text)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("fields"), "missing key 'fields'"),
        (lambda d: d["kernel"][0].pop("gates"), "kernel\\[0\\]: missing key 'gates'"),
        (lambda d: d["kernel"][0].__setitem__("rows", ["q k"]), "must list identifiers"),
        (lambda d: d["kernel"].append(copy.deepcopy(d["kernel"][0])), "defined twice"),
    ],
)
def test_bad_patchset_names_file_and_key(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = _raw()
    mutate(data)
    with pytest.raises(UsageError, match=f"pr51812/patchset.toml: .*{message}"):
        parse(data, "patchsets/pr51812/patchset.toml")


def test_row_gather_table() -> None:
    assert load().row_gathers == {"gdn_backport_kernels.gather_token_rows"}
    data = _raw()
    data["row_gather"] = {"names": ["x y"], "params": ["x", "index"]}  # type: ignore[index]
    with pytest.raises(UsageError, match="row_gather: key 'names' must list dotted names"):
        parse(data, "patchsets/pr51812/patchset.toml")
    data["row_gather"] = {"names": ["m.f"], "params": ["index", "x"]}  # type: ignore[index]
    with pytest.raises(UsageError, match="row_gather: params must be"):
        parse(data, "patchsets/pr51812/patchset.toml")


# -- a fork's declarations that are not readable files (D22) -------------------------------


def _bad(root: Path, kind: str, name: str = ".gdn-backport.toml") -> Path:
    """Something of a declaration's name that is not a readable regular file."""
    path = root / name
    if kind == "folder":
        path.mkdir()
        (path / "kernel.toml").write_text("[[kernel]]\n")
    elif kind == "dangling-link":
        path.symlink_to(root / "gone.toml")
    elif kind == "link-to-folder":
        (root / "decl").mkdir()
        path.symlink_to(root / "decl", target_is_directory=True)
    else:
        os.mkfifo(path)
    return path


KINDS = {
    "folder": "a folder, not a TOML file of kernel declarations",
    "dangling-link": "a symbolic link to nothing",
    "link-to-folder": "a folder, not a TOML file of kernel declarations",
    "fifo": "not a regular file",
}


@pytest.mark.parametrize("name", [".gdn-backport.toml", "pyproject.toml"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_declaration_that_is_no_regular_file_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, kind: str, name: str
) -> None:
    """D22: a ``.gdn-backport.toml`` (or ``pyproject.toml``) at the tree root
    that is a folder, a dangling link or a FIFO was silently ignored (the
    fork's kernels undeclared, and a FIFO would hang the read); every other
    bad declaration is refused: so is this, naming it, exit 2."""
    path = _bad(affected_tree, kind, name)
    for argv in (["scan"], ["apply", "--check"], ["apply", "--dry-run"], ["apply"]):
        code, out, err = run(capsys, *argv, str(affected_tree))
        assert (code, out) == (2, ""), argv
        assert err == f"gdn-backport: {path}: {KINDS[kind]}\n", argv
    assert "a_spec" not in (affected_tree / SITE).read_text()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_kernels_option_that_is_no_regular_file_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, tmp_path: Path, kind: str
) -> None:
    """D22: ``--kernels FILE`` naming a folder said "no such file"; a
    dangling link, a FIFO: each one line naming it, exit 2."""
    path = _bad(tmp_path, kind, "kernels.toml")
    code, out, err = run(capsys, "scan", "--kernels", str(path), str(affected_tree))
    assert (code, out) == (2, "")
    assert err == f"gdn-backport: {path}: {KINDS[kind]}\n"


def test_an_unreadable_declaration_is_refused(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D22: one that cannot be read (its mode, as another user): named, exit 2."""
    path = affected_tree / ".gdn-backport.toml"
    path.write_text("[[kernel]]\n")
    real = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    code, out, err = run(capsys, "scan", str(affected_tree))
    assert (code, out) == (2, "")
    assert err == f"gdn-backport: {path}: cannot read (Permission denied)\n"
