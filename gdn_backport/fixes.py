"""The patchsets the toolkit knows, and the seam each one plugs into.

A patchset is a file ``patchsets/<id>.toml`` (data: what its analysis looks
for, its trailer, its strategies) plus the module its ``engine`` key names.
That module provides, as :class:`Engine` says:

- ``scan_sites(path, root=None, kernels=())``: the patchset's sites below
  ``path`` of the tree at ``root``, each a :class:`gdn_backport.scan.Site`
  with ``patchset`` set;
- ``apply_tree(path, strategy, mode, *, root, before_write, within,
  kernels)``: plan, prove and (in WRITE mode) write the fix, returning an
  :class:`gdn_backport.engine.Outcome`; records carry the patchset's
  ``upstream``, which is how ``revert --patchset`` picks them.

Adding a third fix is a TOML file and one such module (with its codemods).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from gdn_backport.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    from gdn_backport.engine import BeforeWrite, Mode, Outcome
    from gdn_backport.scan import Site

DEFAULT_ENGINE = "gdn_backport.engine"


class Engine(Protocol):
    def scan_sites(
        self, path: Path, root: Path | None = None, kernels: Sequence[Path] = ()
    ) -> list[Site]: ...

    def apply_tree(
        self,
        path: Path,
        strategy: str = ...,
        mode: Mode = ...,
        *,
        root: Path | None = None,
        before_write: BeforeWrite | None = None,
        within: str | None = None,
        kernels: Sequence[Path] = (),
    ) -> Outcome: ...


@dataclass(frozen=True)
class Fix:
    id: str
    upstream: str
    title: str
    trailer: str
    summary: str
    strategies: tuple[str, ...]
    codemods: dict[str, str]
    engine_module: str
    where: str
    data: dict[str, Any] = field(compare=False, repr=False)

    @property
    def engine(self) -> Engine:
        return cast(Engine, importlib.import_module(self.engine_module))

    @property
    def number(self) -> str:
        return self.upstream.rsplit("#", 1)[-1]

    def describe(self, strategy: str) -> str:
        """``strategy (what it does)``: its codemod's ``DESCRIPTION`` (a module
        or a class, as ``[codemods]`` names it)."""
        target = self.codemods[strategy]
        try:
            owner: object = importlib.import_module(target)
        except ModuleNotFoundError:
            module, _, name = target.rpartition(".")
            owner = getattr(importlib.import_module(module), name)
        return f"{strategy} ({getattr(owner, 'DESCRIPTION', '')})"

    def strategy(self, asked: str | None) -> str:
        """The strategy to run: ``asked`` where this patchset has it, else
        its first (``--strategy kernel`` is pr51812's; pr51565 has one)."""
        return asked if asked in self.strategies else self.strategies[0]


def _files() -> list[str]:
    folder = resources.files("gdn_backport._patchsets")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def available() -> tuple[str, ...]:
    """Every shipped patchset id, oldest fix first (pr51812, then pr51565)."""
    order = {"pr51812": 0}
    return tuple(sorted(_files(), key=lambda n: (order.get(n, 1), n)))


@cache
def load_fix(name: str) -> Fix:
    where = f"patchsets/{name}.toml"
    if name not in _files():
        choices = ", ".join(available())
        raise UsageError(f"--patchset {name}: unknown (choose from {choices})")
    res = resources.files("gdn_backport._patchsets").joinpath(f"{name}.toml")
    try:
        data = tomllib.loads(res.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{where}: {exc}") from exc
    head: dict[str, str] = {}
    for key in ("id", "upstream", "title", "trailer", "summary"):
        value = data.get(key)
        if not isinstance(value, str) or not value:
            raise UsageError(f"{where}: key '{key}' must be a non-empty string")
        head[key] = value
    if head["id"] != name:
        raise UsageError(f"{where}: id '{head['id']}' is not the file's name")
    strategies = data.get("strategies")
    if not isinstance(strategies, list) or not strategies:
        raise UsageError(f"{where}: key 'strategies' must list at least one strategy")
    codemods = data.get("codemods")
    if not isinstance(codemods, dict) or set(codemods) != set(strategies):
        raise UsageError(f"{where}: table 'codemods' must name one codemod per strategy")
    engine = data.get("engine", DEFAULT_ENGINE)
    if not isinstance(engine, str) or not all(p.isidentifier() for p in engine.split(".")):
        raise UsageError(f"{where}: key 'engine' must be a dotted module name")
    return Fix(
        id=head["id"],
        upstream=head["upstream"],
        title=head["title"],
        trailer=head["trailer"],
        summary=head["summary"],
        strategies=tuple(str(s) for s in strategies),
        codemods={str(k): str(v) for k, v in codemods.items()},
        engine_module=engine,
        where=where,
        data=data,
    )


def selected(names: Sequence[str] | None) -> list[Fix]:
    """``--patchset`` (repeatable) as fixes, in :func:`available` order;
    none given: every patchset."""
    wanted = list(dict.fromkeys(names)) if names else list(available())
    fixes = [load_fix(n) for n in wanted]
    rank = {n: i for i, n in enumerate(available())}
    return sorted(fixes, key=lambda f: rank[f.id])


def by_upstream(upstream: str) -> Fix | None:
    """The patchset whose records carry ``upstream``."""
    return next((f for f in map(load_fix, available()) if f.upstream == upstream), None)
