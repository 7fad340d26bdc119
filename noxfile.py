"""nox sessions: tests, lint (and, from matrix/, one session per release cell)."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of torch lies on local disk here; a bare `torch` would pull a
# multi-GB CUDA build. Users bring their own torch: the package asks a range.
TORCH = os.environ.get("GDN_BACKPORT_TORCH", "torch==2.13.0")


def install(session: nox.Session, extra: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extra}]")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, codemod, real-release and CPU-interpreter kernel tests."""
    install(session, "test")
    session.run(
        "python",
        "-c",
        "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)",
    )
    session.run(
        "pytest",
        *session.posargs,
        env={"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")},
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and strict mypy on the packages."""
    install(session, "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "gdn_backport", "kernels/gdn_backport_kernels")
