"""pr51812 through the registry's seam (imports stay inside the methods: the
CLI imports every patchset to print its help)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gdn_backport.registry import Patchset

if TYPE_CHECKING:
    from gdn_backport.pipeline import Mode, Plan
    from gdn_backport.site import Site
    from gdn_backport.tree import Tree


class Pr51812(Patchset):
    def scan(self, tree: Tree) -> list[Site]:
        from .plan import config_for
        from .scan import scan_tree_full

        result = scan_tree_full(tree.path, config_for(tree), tree.root, tree.overlay or None)
        swept = result.analysis.swept
        if swept and not result.sites:
            # The sweep found calls handed the spec index or slots, and the
            # analysis accounted for each: say which, so "nothing" is an answer.
            calls = ", ".join(f"{r.callee} ({r.module}:{r.line}, {how})" for r, how in swept)
            tree.notes.append(
                f"; {len(swept)} call(s) handed the spec token index or state slots, each "
                f"accounted for: {calls}"
            )
        return result.sites

    def plan(self, tree: Tree, strategy: str, mode: Mode) -> Plan:
        from .plan import plan

        return plan(tree, strategy, mode)

    def suite(self) -> Any:
        from .suite import LAYER_SUITE

        return LAYER_SUITE

    def engine_scenarios(self) -> Sequence[Any]:
        from .engine_scenarios import SCENARIOS

        return SCENARIOS

    def doctor_rows(self, package: Path, root: Path) -> list[Any]:
        from .runtime.doctor import rows

        return rows(package, root)

    def doctor_hint(self) -> str:
        return "gdn-backport apply, or the runtime plugin: VLLM_PLUGINS=gdn_backport"

    def runtime_register(self) -> None:
        from .runtime.plugin import register

        register()

    def probe(self) -> Any:
        from .probe import SOURCE

        return SOURCE
