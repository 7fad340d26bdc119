"""Every codemod's own examples: rewrites, unchanged inputs, refusals."""

from __future__ import annotations

import ast

import pytest
from libcst.codemod import (
    Codemod,
    TransformFailure,
    TransformSkip,
    TransformSuccess,
    transform_module,
)

from gdn_backport import registry

# Every patchset's codemod classes, by strategy.
CODEMODS = {
    name: cls
    for ps in registry.discover()
    for name, cls in ps.codemods().items()
    if isinstance(cls, type)
}


def _examples(kind: str) -> list[object]:
    return [
        pytest.param(name, example, id=f"{name}-{i}")
        for name, cls in CODEMODS.items()
        for i, example in enumerate(getattr(cls, kind, ()))
    ]


def _run(name: str, source: str) -> object:
    cls = CODEMODS[name]
    codemod: Codemod = cls(**getattr(cls, "EXAMPLE_ARGS", {}))
    return transform_module(codemod, source)


@pytest.mark.parametrize(("name", "example"), _examples("REWRITES"))
def test_rewrites(name: str, example: tuple[str, str]) -> None:
    before, after = example
    result = _run(name, before)
    assert isinstance(result, TransformSuccess), getattr(result, "error", result)
    assert result.code == after
    ast.parse(result.code)
    # Idempotent: the rewritten code is a fixed site and stays as it is.
    again = _run(name, after)
    assert isinstance(again, TransformSkip), getattr(again, "error", again)


@pytest.mark.parametrize(("name", "source"), _examples("UNCHANGED"))
def test_unchanged(name: str, source: str) -> None:
    result = _run(name, source)
    assert isinstance(result, TransformSkip), getattr(result, "error", result)


@pytest.mark.parametrize(("name", "example"), _examples("REFUSES"))
def test_refuses(name: str, example: tuple[str, str]) -> None:
    source, reason = example
    result = _run(name, source)
    assert isinstance(result, TransformFailure)
    assert reason in str(result.error)


def test_every_codemod_has_examples() -> None:
    for name, cls in CODEMODS.items():
        assert cls.DESCRIPTION, name
        assert getattr(cls, "REWRITES", ()), f"{name} has no REWRITES examples"
        assert getattr(cls, "UNCHANGED", ()), f"{name} has no UNCHANGED examples"
