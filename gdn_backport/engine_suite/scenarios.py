"""The engine scenarios of every patchset, through the registry.

Each patchset declares its own (``Patchset.engine_scenarios()``: a tuple of
:class:`~gdn_backport.engine_suite.scenario.EngineScenario` whose
``patchset`` field says which fix it proves); this module only collects and
filters them, and names no patchset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gdn_backport import registry
from gdn_backport.engine_suite.scenario import EngineScenario

__all__ = ["collect", "patchsets"]


def _all() -> list[EngineScenario]:
    found: list[EngineScenario] = []
    for ps in registry.discover():
        mine = list(ps.engine_scenarios())
        wrong = [s.name for s in mine if s.patchset != ps.info.id]
        if wrong:
            raise ValueError(f"engine scenario {wrong[0]!r} of {ps.info.id} names another patchset")
        found.extend(mine)
    names = [s.name for s in found]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"engine scenario {dupes[0]!r} is declared twice")
    return found


def patchsets() -> list[str]:
    """The patchset ids that declare engine scenarios."""
    return sorted({s.patchset for s in _all()})


def collect(
    patchsets: Iterable[str] | None = None, names: Sequence[str] | None = None
) -> list[EngineScenario]:
    """The scenarios of ``patchsets`` (all when None), only ``names`` when
    given (ValueError naming an unknown one)."""
    chosen = [s for s in _all() if patchsets is None or s.patchset in set(patchsets)]
    if names:
        known = {s.name: s for s in chosen}
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(
                f"engine scenario {missing[0]!r}: unknown (choose from {', '.join(sorted(known))})"
            )
        chosen = [known[n] for n in names]
    return chosen
