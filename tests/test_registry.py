"""The registry: patchsets are folders, found, never named by the core."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gdn_backport.patchsets
from gdn_backport import registry
from gdn_backport.errors import UsageError
from gdn_backport.matrix import model
from tests.conftest import run

REPO = Path(__file__).resolve().parent.parent
TOY = Path(__file__).resolve().parent / "toy_patchset"


def test_the_shipped_patchsets_are_found_in_order() -> None:
    assert registry.available() == ("pr51812", "pr51565")
    for ps in registry.discover():
        assert ps.package == f"gdn_backport.patchsets.{ps.info.id}"
        assert (REPO / "patchsets" / ps.info.id / "patchset.toml").is_file()
    assert registry.owner_of("kernel") is registry.get("pr51812")
    with pytest.raises(UsageError, match="--patchset nope: unknown"):
        registry.get("nope")


def _words(path: Path) -> set[str]:
    return set(re.findall(r"\bpr\d{5}\b", path.read_text(encoding="utf-8", errors="replace")))


def test_no_patchset_id_outside_its_package() -> None:
    """The core, the build, CI, the matrix's data and the kernels know no
    patchset: a third fix is a folder, not an edit across the tree."""
    ids = set(registry.available())
    places = [REPO / "noxfile.py", REPO / "setup.py", REPO / "pyproject.toml"]
    for folder in ("gdn_backport", ".ci", "matrix", "kernels"):
        places += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in
                   (".py", ".toml", ".sh", "")]  # fmt: skip
    found = {str(p.relative_to(REPO)): _words(p) & ids for p in places if p.is_file()}
    assert {p: w for p, w in found.items() if w} == {}
    for ps in registry.discover():
        others = ids - {ps.info.id}
        mine = REPO / "patchsets" / ps.info.id
        leaks = {str(p.relative_to(REPO)): _words(p) & others for p in mine.rglob("*.py")}
        assert {p: w for p, w in leaks.items() if w} == {}, "a patchset names another"


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The toy patchset's folder added beside the shipped ones; a tree that
    calls its kernel."""
    folder = tmp_path / "patchsets"
    shutil.copytree(TOY / "pr90001", folder / "pr90001")
    monkeypatch.setattr(gdn_backport.patchsets, "__path__",
                        [*gdn_backport.patchsets.__path__, str(folder)])  # fmt: skip
    registry.discover.cache_clear()
    model.load.cache_clear()
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "toy.py").write_text("def f(x):\n    return toy_kernel(x)\n")
    yield tree
    for name in [n for n in sys.modules if n.startswith("gdn_backport.patchsets.pr90001")]:
        del sys.modules[name]
    monkeypatch.undo()
    registry.discover.cache_clear()
    model.load.cache_clear()


def test_a_third_patchset_is_a_folder(toy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert registry.available() == ("pr51812", "pr51565", "pr90001")
    code, out, err = run(capsys, "scan", str(toy))
    assert code == 1 and "pr90001" in out and "calls toy_kernel" in out, out + err
    code, out, _ = run(capsys, "apply", "--patchset", "pr90001", str(toy))
    assert code == 0 and "toy_kernel_fixed" in out
    assert "toy_kernel_fixed(x)" in (toy / "vllm" / "toy.py").read_text()
    code, out, _ = run(capsys, "scan", "--patchset", "pr90001", str(toy))
    assert code == 0 and "fixed" in out
    code, out, _ = run(capsys, "verify", "--patchset", "pr90001", str(toy))
    assert code == 0 and "toy_check" in out
    code, _, _ = run(capsys, "revert", "--patchset", "pr90001", str(toy))
    assert code == 0 and "toy_kernel(x)" in (toy / "vllm" / "toy.py").read_text()
    # Its strategy is one of apply's, and the matrix knows its cells.
    code, out, _ = run(capsys, "apply", "--help")
    assert code == 0 and "pr90001: rename" in " ".join(out.split())
    assert "rename" in model.all_strategies()


def test_a_broken_patchset_folder_is_one_line(
    toy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "patchsets" / "pr90001" / "patchset.toml"
    toml.write_text(toml.read_text().replace('id = "pr90001"', 'id = "pr90002"'))
    for name in [n for n in sys.modules if n.startswith("gdn_backport.patchsets.pr90001")]:
        del sys.modules[name]
    registry.discover.cache_clear()
    code, _, err = run(capsys, "scan", str(toy))
    assert code == 2
    assert err.strip().splitlines() == [
        "gdn-backport: patchsets/pr90001/patchset.toml: id 'pr90002' is not the name of its "
        "folder (pr90001)"
    ]
