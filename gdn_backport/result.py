"""What a step decided, as a value: ``Success(value)``, ``Skip(reason)`` or
``Failure(reason, traceback)``.

A plan calls codemods and the pipeline calls plans; neither catches
exceptions to steer. A codemod is run by libcst's own runner
(:func:`libcst.codemod.transform_module`, which never raises: it returns
``TransformSuccess`` / ``TransformSkip`` / ``TransformFailure``), and
:func:`of_transform` reads that as one of ours; any other step goes
through :func:`attempt`. We keep our own three types rather than libcst's
because a plan is not a codemod (its value is a plan, not code) and
because a user reads the reason: a ``TransformFailure`` holds the exception
object, ours the line the CLI prints.

A ``Failure`` is a refusal (``traceback`` None: the code is not a shape the
tool knows, it says why) or an internal error (``traceback`` set: a bug of
ours, never the user's input). Both refuse the plan and nothing is
written; the CLI prints one line either way, ``--json`` carries the
traceback and ``GDN_BACKPORT_TRACEBACK=1`` prints it on stderr.

:class:`~gdn_backport.errors.UsageError` that is not a
:class:`~gdn_backport.errors.Refusal` is not caught: it is bad input (a
strategy the patchset lacks, a file changed while we ran), which the CLI
reports with its own one line and exit 2, as before any plan.
"""

from __future__ import annotations

import os
import sys
import traceback as tb
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from gdn_backport.errors import Refusal, UsageError

if TYPE_CHECKING:
    from libcst.codemod import TransformResult

__all__ = [
    "TRACEBACK_ENV",
    "Failure",
    "Result",
    "Skip",
    "Success",
    "attempt",
    "internal",
    "of_transform",
    "show_tracebacks",
]

T = TypeVar("T")

# Set to 1: every internal error's traceback is printed on stderr after its line.
TRACEBACK_ENV = "GDN_BACKPORT_TRACEBACK"


@dataclass(frozen=True)
class Success(Generic[T]):
    value: T


@dataclass(frozen=True)
class Skip:
    """Nothing to do here, and why (libcst's ``SkipFile``)."""

    reason: str


@dataclass(frozen=True)
class Failure:
    """Refused: ``reason`` is the line a user reads; ``traceback`` is set
    only for an internal error."""

    reason: str
    traceback: str | None = None

    @property
    def internal(self) -> bool:
        return self.traceback is not None


Result = Success[T] | Skip | Failure


def _one_line(text: str) -> str:
    return " ".join(text.split())


def internal(exc: BaseException, what: str, trace: str | None = None) -> Failure:
    """An exception nobody planned for, inside ``what``: the refusal of the
    step that raised it, its traceback kept."""
    detail = _one_line(str(exc))
    name = type(exc).__name__
    return Failure(
        f"internal error in {what}: {name}{': ' + detail if detail else ''} (a bug of "
        f"gdn-backport, not of the tree; {TRACEBACK_ENV}=1 or --json shows where)",
        trace if trace is not None else "".join(tb.format_exception(exc)),
    )


def attempt(step: Callable[[], T], what: str) -> Success[T] | Skip | Failure:
    """``step()`` as a result: its value; ``SkipFile`` a skip; a
    :class:`Refusal` a refusal; any other exception (not a UsageError,
    which passes: see the module) an internal error of ``what``."""
    try:
        return Success(step())
    except Exception as exc:
        if _skip_file(exc):
            return Skip(str(exc))
        if isinstance(exc, Refusal):
            return Failure(exc.reason)
        if isinstance(exc, UsageError):
            raise
        return internal(exc, what)


def _skip_file(exc: Exception) -> bool:
    """``exc`` is libcst's ``SkipFile`` (only a codemod raises one, and
    importing libcst's codemod machinery costs a command that runs none
    of them 0.4 s: it is looked up only where it was imported)."""
    codemod = sys.modules.get("libcst.codemod")
    return codemod is not None and isinstance(exc, codemod.SkipFile)


def of_transform(result: TransformResult, what: str) -> Success[str] | Skip | Failure:
    """libcst's runner result for the codemod ``what`` as ours."""
    from libcst.codemod import TransformExit, TransformFailure, TransformSkip, TransformSuccess

    if isinstance(result, TransformSuccess):
        return Success(result.code)
    if isinstance(result, TransformSkip):
        return Skip(result.skip_description)
    if isinstance(result, TransformExit):
        # The runner caught ^C; the run stops as any other interrupted run.
        raise KeyboardInterrupt
    assert isinstance(result, TransformFailure)
    if isinstance(result.error, Refusal):
        return Failure(result.error.reason)
    if isinstance(result.error, UsageError):
        raise result.error
    return internal(result.error, what, result.traceback_str)


def show_tracebacks() -> bool:
    """Whether internal errors' tracebacks go to stderr too."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")
