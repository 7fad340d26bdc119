"""What the package promises users in its metadata and README holds."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from gdn_backport import verify

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _extra(name: str) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][name]]
    return {r.name: r for r in reqs}


def test_the_kernels_extra_installs_only_a_triton_verify_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D10: ``pip install '.[kernels]'`` used to pick triton 3.9, which
    ``verify --device cpu`` then refused: the extra's range and
    ``triton_problem()``'s rule agree on every release around the bound."""
    spec: SpecifierSet = _extra("kernels")["triton"].specifier
    for version in ("3.0.0", "3.2.0", "3.6.0", "3.8.1", "3.9.0", "3.9.1", "3.10.0", "4.0.0"):
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
        accepted = verify.triton_problem() == ""
        assert accepted == (Version(version) in spec), f"triton {version}, extra {spec}"
    # One source of truth: the rule's bound is the extra's.
    bound = ".".join(map(str, verify.TRITON_TOO_NEW))
    assert f"<{bound}" in {str(s) for s in spec}
