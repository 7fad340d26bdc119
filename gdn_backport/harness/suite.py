"""What a patchset's suite is to ``verify``, and what it may need to know.

``verify`` reaches every suite through the registry (``Patchset.suite()``),
so a suite imports its contract from here, never from
:mod:`gdn_backport.verify`: the dependency runs one way (verify -> the
registry -> the suites -> the harness). Torch-free, like :mod:`.result`.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from gdn_backport.harness.result import ScenarioResult
from gdn_backport.site import Site

__all__ = ["TRITON_TOO_NEW", "Suite", "SuiteError", "SuiteReport", "triton_problem"]


class SuiteError(Exception):
    """A suite cannot drive this tree (its code is missing or not loadable):
    the reason, for the report."""


class SuiteReport(Protocol):
    """What a suite may fill in of ``verify``'s report while it runs."""

    site: str  # the layer it drove ("path:line Class.method")
    error: str  # the tree could not be driven: why (the rows so far stand)


class Suite(Protocol):
    """What a patchset's suite offers ``verify`` (:meth:`registry.Patchset.suite`)."""

    # Every scenario name it knows (``--scenario`` picks among all suites').
    names: tuple[str, ...]
    # Whether a ``patch`` of the loaded layer module (the runtime plugin's
    # in-memory rewrite) is what this suite proves.
    patches_layer: bool

    def run(
        self,
        tree: Path,
        device: str,
        names: Sequence[str] | None,
        *,
        seed: int,
        heads: tuple[int, int, int] | None,
        self_consistency: bool,
        patch: Callable[[types.ModuleType], object] | None,
        report: SuiteReport,
    ) -> list[ScenarioResult]:
        """The rows of ``names`` (None: the suite's default set); SuiteError
        when the tree lacks what it drives. ``report.site`` may be set."""
        ...

    def cell_scenarios(self, device: str) -> Sequence[str]:
        """What a matrix cell runs on ``device``."""
        ...

    def expected_failures(
        self, names: Sequence[str], sites: Sequence[Site]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Of ``names``, those that must fail on a tree with these (its own
        patchset's, unpatched) sites, and those that may: the mutation check."""
        ...


# The first Triton that cannot run vLLM's FLA kernels: 3.9 removed block
# pointers (tl.make_block_ptr). pyproject's `kernels` extra pins triton below
# it; a test holds the two together.
TRITON_TOO_NEW = (3, 9)


def triton_problem() -> str:
    """Why the installed Triton cannot run vLLM's FLA kernels, or ""."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    from packaging.version import Version

    if Version(triton.__version__).release >= TRITON_TOO_NEW:
        bound = ".".join(map(str, TRITON_TOO_NEW))
        return (
            f"triton {triton.__version__} removed block pointers (tl.make_block_ptr), which "
            f"vLLM's FLA kernels use; install triton<{bound} (vLLM's releases pin 3.x <= 3.6)"
        )
    return ""
