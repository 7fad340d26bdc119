"""Every codemod's own examples: rewrites, unchanged inputs, refusals.

The codemods come from the registry (every patchset's ``[codemods]``
table), so a new patchset's are run with no edit here. Each runs as under
``python -m libcst.tool codemod``: built with its ``EXAMPLE_ARGS`` alone,
on the example's text alone (``tests/test_codemod_commands.py`` runs the
tool itself).
"""

from __future__ import annotations

import ast

import pytest
from libcst.codemod import (
    Codemod,
    CodemodCommand,
    TransformFailure,
    TransformSkip,
    TransformSuccess,
    transform_module,
)

from gdn_backport import registry

# Every patchset's codemod classes, by "<patchset>.<Class>".
CODEMODS = {
    f"{ps.info.id}.{cls.__name__}": cls
    for ps in registry.discover()
    for classes in ps.codemods().values()
    for cls in classes
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
    assert isinstance(result, TransformFailure), result
    assert reason in str(result.error)


def test_every_codemod_has_examples() -> None:
    """Every strategy of every patchset has codemods, and each is a libcst
    command that carries its description and every kind of example."""
    for ps in registry.discover():
        for strategy in ps.info.strategies:
            assert ps.codemods().get(strategy), f"{ps.info.id}: {strategy} has no codemod"
    assert {name.split(".")[0] for name in CODEMODS} == set(registry.available())
    for name, cls in CODEMODS.items():
        assert issubclass(cls, CodemodCommand), name
        assert cls.DESCRIPTION and cls.DESCRIPTION != CodemodCommand.DESCRIPTION, name
        assert cls.__doc__, f"{name} has no docstring"
        for kind in ("REWRITES", "UNCHANGED", "REFUSES"):
            assert getattr(cls, kind, ()), f"{name} has no {kind} examples"
