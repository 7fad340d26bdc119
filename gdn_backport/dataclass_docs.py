"""No signature docstrings for the dataclasses a command's imports create.

``@dataclass`` gives a class without a docstring one made of its signature,
``str(inspect.signature(cls))``, at once. libcst's matchers (imported by
``libcst.codemod``, which every codemod needs) are hundreds of such classes:
those docstrings are a third of that import (about 0.09 s of each process
of a cold ``apply``, docs/decisions.md). Nothing reads them. CPython's main
branch makes them lazy (python/cpython#144387); :func:`skipped` gives the
same cost on the interpreters we run on: while it is active, the signature
dataclasses asks for is empty, and such a docstring is the class's name.

Only ``dataclasses``' own reference to ``inspect`` is replaced (nothing
else sees it), only in a process running its own command that reads a
tree (``cli.main``), and it is put back when the command ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any


class _NoSignature:
    def __str__(self) -> str:
        return ""


class _WithoutSignatures:
    """``inspect``, but for ``signature``: what dataclasses calls it for is
    the docstring alone (``cls.__name__ + str(inspect.signature(cls))``,
    on every version from 3.10), which then is the class's name."""

    def __getattr__(self, name: str) -> Any:
        return getattr(inspect, name)

    @staticmethod
    def signature(*args: object, **kwargs: object) -> _NoSignature:
        return _NoSignature()


@contextlib.contextmanager
def skipped() -> Iterator[None]:
    """Dataclasses made meanwhile get their name as their docstring. Where
    dataclasses holds no module-level ``inspect`` (an interpreter that
    imports it lazily: its docstrings are lazy already), nothing changes."""
    real = getattr(dataclasses, "inspect", None)
    if real is not inspect:
        yield
        return
    dataclasses.inspect = _WithoutSignatures()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dataclasses.inspect = real  # type: ignore[attr-defined]
