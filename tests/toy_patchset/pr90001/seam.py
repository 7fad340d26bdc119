"""The toy through the seam: sites are the functions calling the toy kernel."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libcst.codemod import CodemodContext, TransformSuccess, transform_module

from gdn_backport.harness.result import ScenarioResult
from gdn_backport.pipeline import Mode, Outcome, Plan, SiteChange, conclude, unified_diff
from gdn_backport.registry import Patchset
from gdn_backport.site import Site, Status
from gdn_backport.tree import Tree


def _sites(tree: Tree, file: Path, text: str) -> list[Site]:
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef):
            names = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call)
                     and isinstance(c.func, ast.Name)}  # fmt: skip
            for name, status in (("toy_kernel", Status.AFFECTED),
                                 ("toy_kernel_fixed", Status.FIXED)):  # fmt: skip
                if name in names:
                    out.append(Site(tree.relative(file), node.lineno, node.name, status,
                                    f"calls {name}", patchset="pr90001"))  # fmt: skip
    return out


class Toy(Patchset):
    def scan(self, tree: Tree) -> list[Site]:
        return [
            s
            for file in tree.walk().files
            if b"toy_kernel" in tree.read(file)
            for s in _sites(tree, file, tree.text(file))
        ]

    def plan(self, tree: Tree, strategy: str, mode: Mode) -> Plan:
        from .codemod import RenameToyKernel

        out = Outcome(tree.root)
        staged, texts = [], {}
        for file in tree.walk().files:
            if b"toy_kernel" not in tree.read(file):
                continue
            text = tree.text(file)
            before = _sites(tree, file, text)
            result = transform_module(RenameToyKernel(CodemodContext()), text)
            new = result.code if isinstance(result, TransformSuccess) else text
            after = _sites(tree, file, new)
            out.changes += [SiteChange(b, a, False) for b, a in zip(before, after, strict=True)]
            if new != text:
                rel = tree.relative(file)
                staged.append((file, rel, tree.read(file), new.encode()))
                texts[file] = new
                out.diff += unified_diff(rel, text, new)
        conclude(out, mode, bool(staged))
        return Plan(out, staged, strategy, texts)

    def suite(self) -> Any:
        return ToySuite()


class ToySuite:
    names = ("toy_check",)
    patches_layer = False

    def run(
        self, tree: Path, device: str, names: Sequence[str] | None, **_: Any
    ) -> list[ScenarioResult]:
        left = [f for f in Path(tree).rglob("*.py") if "toy_kernel(" in f.read_text()]
        return [ScenarioResult("toy_check", "toy", "-", float(len(left)), 0.0, not left)]

    def cell_scenarios(self, device: str) -> Sequence[str]:
        return self.names

    def expected_failures(self, names: Sequence[str], sites: Sequence[Site]) -> Any:
        return frozenset(names), frozenset()
