"""A site: one place in a tree that a patchset's analysis found, with its verdict.

Every patchset reports its findings as :class:`Site` values; the CLI, the
matrix, ``doctor`` and the JSON contract read nothing else. ``path``,
``line``, ``function``, ``status`` and ``reason`` are the contract's fields
(DESIGN section 2); ``via``, ``target`` and ``patchset`` were added later
and keep their meaning.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass


class Status(str, enum.Enum):
    AFFECTED = "affected"
    FIXED = "fixed"
    NOT_AFFECTED = "not_affected"
    UNKNOWN = "unknown"


# Worst first: a site takes the status of its worst call, a tree of its worst site.
ORDER = (Status.UNKNOWN, Status.AFFECTED, Status.FIXED, Status.NOT_AFFECTED)


def worst(statuses: Iterable[Status]) -> Status | None:
    found = set(statuses)
    return next((s for s in ORDER if s in found), None)


@dataclass(frozen=True)
class Site:
    path: str  # relative to the tree root, POSIX separators
    line: int
    function: str
    status: Status
    reason: str
    # The call chain from the entry to the kernel, when it goes through helpers.
    via: tuple[str, ...] | None = None
    # Where the file really is, when ``path`` reaches it through a symbolic
    # link (JSON ``"target"``, only then).
    target: str | None = None
    # The patchset whose analysis found the site (its package's id).
    patchset: str = ""

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["status"] = self.status.value
        if self.via is None:
            del d["via"]
        else:
            d["via"] = list(self.via)
        if self.target is None:
            del d["target"]
        return d

    @property
    def chain(self) -> str:
        """``A._forward_core -> A.helper -> kernel`` (empty for a direct call)."""
        return " -> ".join(self.via) if self.via else ""
