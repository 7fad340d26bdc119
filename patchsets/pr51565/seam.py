"""pr51565 through the registry's seam (imports stay inside the methods)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gdn_backport.registry import Patchset

if TYPE_CHECKING:
    from gdn_backport.pipeline import Mode, Plan
    from gdn_backport.site import Site
    from gdn_backport.tree import Tree


class Pr51565(Patchset):
    def scan(self, tree: Tree) -> list[Site]:
        from .scan import scan

        return scan(tree)

    def plan(self, tree: Tree, strategy: str, mode: Mode) -> Plan:
        from .plan import plan

        return plan(tree, strategy, mode)

    def unaffected_by(self, changed: Mapping[Path, tuple[bytes, str]]) -> bool:
        from .plan import unaffected_by

        return unaffected_by(changed)

    def suite(self) -> Any:
        from .suite import BUILDER_SUITE

        return BUILDER_SUITE

    def doctor_rows(self, package: Path, root: Path) -> list[Any]:
        from .doctor import rows

        return rows(package, root)

    def doctor_hint(self) -> str:
        return (
            f"gdn-backport apply --installed --patchset {self.info.id}; the runtime plugin "
            "reports it but does not patch it"
        )

    def runtime_register(self) -> None:
        from .runtime import register

        register()

    def probe(self) -> Any:
        from .probe import SOURCE

        return SOURCE

    def engine_scenarios(self) -> Sequence[Any]:
        from .engine_scenarios import SCENARIOS

        return SCENARIOS
