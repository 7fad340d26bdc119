"""The engine scenarios of every patchset, found by ``pkgutil``.

Each module here declares ``SCENARIOS``, a tuple of
:class:`~gdn_backport.engine_suite.scenario.EngineScenario` whose
``patchset`` field says which fix it proves. This package only collects and
filters them; it names no patchset (the lead will move each module into its
patchset's package, and :func:`collect` will follow the registry there).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Sequence

from gdn_backport.engine_suite.scenario import EngineScenario

__all__ = ["collect", "patchsets"]


def _all() -> list[EngineScenario]:
    found: list[EngineScenario] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found.extend(getattr(module, "SCENARIOS", ()))
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
