"""The toy codemod: ``toy_kernel(...)`` -> ``toy_kernel_fixed(...)``."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import SkipFile, VisitorBasedCodemodCommand


class RenameToyKernel(VisitorBasedCodemodCommand):
    DESCRIPTION = "call toy_kernel_fixed instead of toy_kernel"
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = (
        ("def f(x):\n    return toy_kernel(x)\n", "def f(x):\n    return toy_kernel_fixed(x)\n"),
    )
    UNCHANGED: ClassVar[tuple[str, ...]] = ("def f(x):\n    return toy_kernel_fixed(x)\n",)

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        new = super().transform_module_impl(tree)
        if new.deep_equals(tree):
            raise SkipFile("no toy_kernel call")
        return new

    @m.leave(m.Call(func=m.Name("toy_kernel")))
    def rename(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        return updated_node.with_changes(func=cst.Name("toy_kernel_fixed"))
