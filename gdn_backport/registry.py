"""The patchsets, found rather than listed: the seam every fix plugs into.

A patchset is a package below :mod:`gdn_backport.patchsets` (the repository's
``patchsets/<id>/`` folder) holding its ``patchset.toml``, its analysis, its
codemods, its suites and its matrix expectations, and exposing one object,
``PATCHSET``, an instance of :class:`Patchset`. The CLI, ``verify``, the
matrix, ``doctor`` and the runtime plugin loop over :func:`discover`; none
of them names a patchset. Adding a fix is adding a folder.

Importing a patchset package must stay cheap (the CLI imports every one to
print its help): heavy imports belong inside its methods.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gdn_backport import tomlfile
from gdn_backport.errors import UsageError

if TYPE_CHECKING:
    from libcst.codemod import CodemodCommand

    from gdn_backport.ahead import Prepare
    from gdn_backport.pipeline import Mode, Plan
    from gdn_backport.site import Site
    from gdn_backport.tree import Tree

PACKAGE = "gdn_backport.patchsets"
FILE = "patchset.toml"


@dataclass(frozen=True)
class Info:
    """The head of a ``patchset.toml``: what the fix is, as users see it."""

    id: str
    upstream: str  # owner/repo#number: records carry it, revert --patchset picks by it
    title: str
    trailer: str  # the commit trailer, ``Backport-Of: ...``
    summary: str  # the commit subject after "Backport vLLM PR #N: "
    strategies: tuple[str, ...]  # the first is the default
    order: int  # where it runs and prints among the patchsets (lower first)
    where: str  # the file, for messages
    data: dict[str, Any] = field(compare=False, repr=False)

    @property
    def number(self) -> str:
        return self.upstream.rsplit("#", 1)[-1]


def parse_info(data: dict[str, Any], where: str, name: str) -> Info:
    head = {key: tomlfile.text(data, key, where) for key in
            ("id", "upstream", "title", "trailer", "summary")}  # fmt: skip
    if head["id"] != name:
        raise UsageError(f"{where}: id '{head['id']}' is not the name of its folder ({name})")
    strategies = tomlfile.identifiers(data, "strategies", where, allow_empty=False)
    return Info(
        **head,
        strategies=strategies,
        order=tomlfile.get(data, "order", int, where, default=100),
        where=where,
        data=data,
    )


class Patchset:
    """What a patchset package provides (its ``PATCHSET``). The defaults say
    "nothing of that kind": a patchset with no suite, no engine scenarios,
    no doctor rows and no runtime patch still scans, plans and writes."""

    def __init__(self, package: str) -> None:
        self.package = package
        name = package.rpartition(".")[2]
        where = f"patchsets/{name}/{FILE}"
        self.info = parse_info(tomlfile.load(resources.files(package).joinpath(FILE), where),
                               where, name)  # fmt: skip

    def __repr__(self) -> str:
        return f"<patchset {self.info.id}>"

    # -- strategies ---------------------------------------------------------
    def strategy(self, asked: str | None) -> str:
        """The strategy to run: ``asked`` where this patchset has it, else its
        default (``--strategy kernel`` is one patchset's; the others use theirs)."""
        return asked if asked in self.info.strategies else self.info.strategies[0]

    def codemods(self) -> dict[str, tuple[type[CodemodCommand], ...]]:
        """Strategy -> its codemods, in the order they run: libcst
        ``CodemodCommand`` classes carrying their ``DESCRIPTION`` and
        examples, as the ``[codemods]`` table of ``patchset.toml`` names them
        (a dotted ``module.Class``, or a list of them)."""
        from libcst.codemod import CodemodCommand

        where = f"{self.info.where}: codemods"
        table = tomlfile.get(self.info.data, "codemods", dict, self.info.where, default={})
        out: dict[str, tuple[type[CodemodCommand], ...]] = {}
        for strategy, targets in table.items():
            names = targets if isinstance(targets, list) else [targets]
            if not names or not all(tomlfile.dotted(t) and "." in t for t in names):
                raise UsageError(f"{where}: {strategy} must be a dotted module.Class or a list")
            classes = []
            for target in names:
                module, _, name = target.rpartition(".")
                cls = getattr(importlib.import_module(module), name, None)
                if not (isinstance(cls, type) and issubclass(cls, CodemodCommand)):
                    raise UsageError(f"{where}: {target} is not a libcst CodemodCommand class")
                classes.append(cls)
            out[strategy] = tuple(classes)
        return out

    def describe(self, strategy: str) -> str:
        """``strategy (what it does)``, from its codemods' ``DESCRIPTION``."""
        what = "; ".join(c.DESCRIPTION for c in self.codemods().get(strategy, ()) if c.DESCRIPTION)
        return f"{strategy} ({what})" if what else strategy

    # -- the rewriter -------------------------------------------------------
    def scan(self, tree: Tree) -> list[Site]:
        """The sites below ``tree.path``, each with ``patchset`` set."""
        raise NotImplementedError

    def plan(self, tree: Tree, strategy: str, mode: Mode) -> Plan:
        """Analyse, rewrite and prove the fix over ``tree`` (reading its
        overlay); nothing is written (:mod:`gdn_backport.pipeline` writes)."""
        raise NotImplementedError

    def prepare(self, tree: Tree) -> Prepare | None:
        """Work a forked child may do ahead for this patchset's own scan or
        plan of ``tree`` (:mod:`gdn_backport.ahead`), or None. It offers
        values with ``put(key, value)``; the run takes one (``ahead.offered``)
        in place of computing it, so a key must name the computation's whole
        input (a text, not a path) and the value be what the run computes
        from it. The default: nothing."""
        return None

    def unaffected_by(self, changed: Mapping[Path, tuple[bytes, str]]) -> bool:
        """This patchset's plan is the same whether each of ``changed`` holds
        its bytes on disk or the new text (an earlier patchset's rewrite):
        True only where that is certain (``pipeline`` then keeps a plan made
        ahead, on the tree as the run found it). The default: not known."""
        return False

    # -- proofs -------------------------------------------------------------
    def suite(self) -> Any:
        """The harness suite ``verify`` runs (:class:`gdn_backport.verify.Suite`), or None."""
        return None

    def engine_scenarios(self) -> Sequence[Any]:
        """The real-engine scenarios of ``verify --engine``."""
        return ()

    # -- the environment ----------------------------------------------------
    def doctor_rows(self, package: Path, root: Path) -> list[Any]:
        """``doctor``'s rows for the vLLM package at ``package``."""
        return []

    def doctor_hint(self) -> str:
        """How to fix an affected row, for ``doctor``'s verdict."""
        return f"gdn-backport apply --patchset {self.info.id}"

    def runtime_register(self) -> None:
        """Called in every vLLM process by the general plugin."""

    def probe(self) -> Any:
        """What the reachability probe counts for this patchset in each GDN
        metadata build (:class:`gdn_backport.runtime.probe.ProbeSource`), or None."""
        return None


@cache
def discover() -> tuple[Patchset, ...]:
    """Every patchset package, in ``order`` (then id)."""
    package = importlib.import_module(PACKAGE)
    found: list[Patchset] = []
    for mod in pkgutil.iter_modules(package.__path__):
        if not mod.ispkg:
            continue
        obj = getattr(importlib.import_module(f"{PACKAGE}.{mod.name}"), "PATCHSET", None)
        if not isinstance(obj, Patchset):
            raise UsageError(f"patchsets/{mod.name}: no PATCHSET (a registry.Patchset) in it")
        found.append(obj)
    ids = [p.info.id for p in found]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise UsageError(f"patchsets: id {dup[0]} defined twice")
    strategies = [s for p in found for s in p.info.strategies]
    clash = sorted({s for s in strategies if strategies.count(s) > 1})
    if clash:
        raise UsageError(f"patchsets: strategy '{clash[0]}' belongs to two patchsets")
    return tuple(sorted(found, key=lambda p: (p.info.order, p.info.id)))


def available() -> tuple[str, ...]:
    return tuple(p.info.id for p in discover())


def get(name: str) -> Patchset:
    for p in discover():
        if p.info.id == name:
            return p
    raise UsageError(f"--patchset {name}: unknown (choose from {', '.join(available())})")


def selected(names: Sequence[str] | None) -> list[Patchset]:
    """``--patchset`` (repeatable) as patchsets in registry order; none given: all."""
    if not names:
        return list(discover())
    wanted = {get(n).info.id for n in names}
    return [p for p in discover() if p.info.id in wanted]


def by_upstream(upstream: str) -> Patchset | None:
    """The patchset whose records carry ``upstream``."""
    return next((p for p in discover() if p.info.upstream == upstream), None)


def owner_of(strategy: str) -> Patchset | None:
    """The patchset a strategy belongs to."""
    return next((p for p in discover() if strategy in p.info.strategies), None)
