"""codemod.py: the base classes every patchset's codemods use, and run()."""

from __future__ import annotations

import libcst as cst
import pytest
from libcst.codemod import CodemodContext, SkipFile

from gdn_backport.codemod import Command, VisitorCommand, run
from gdn_backport.errors import Refusal, UsageError
from gdn_backport.result import Failure, Skip, Success


class _Rename(VisitorCommand):
    DESCRIPTION = "old -> new"

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        if updated_node.value == "refuse":
            raise Refusal("asked to refuse")
        if updated_node.value == "skip":
            raise SkipFile("nothing here")
        if updated_node.value == "usage":
            raise UsageError("bad input")
        if updated_node.value == "boom":
            raise RuntimeError("a bug")
        if updated_node.value == "old":
            return updated_node.with_changes(value="new")
        return updated_node


def _run(code: str) -> Success[str] | Skip | Failure:
    return run(_Rename(CodemodContext()), code)


def test_a_visitor_command_rewrites_and_keeps_the_formatting() -> None:
    got = _run("x = old  # keep\nold(  1 )\n")
    assert isinstance(got, Success)
    assert got.value == "x = new  # keep\nnew(  1 )\n"
    unchanged = _run("y = 1\n")
    assert isinstance(unchanged, Success) and unchanged.value == "y = 1\n"


def test_a_refusal_is_a_failure_with_its_reason_and_skip_a_skip() -> None:
    refused = _run("refuse\n")
    assert isinstance(refused, Failure) and refused.reason == "asked to refuse"
    skipped = _run("skip\n")
    assert isinstance(skipped, Skip) and skipped.reason == "nothing here"


def test_a_usage_error_propagates_and_a_bug_is_an_internal_failure() -> None:
    with pytest.raises(UsageError, match="bad input"):
        _run("usage\n")
    crashed = _run("boom\n")
    assert isinstance(crashed, Failure)
    assert "_Rename" in crashed.reason and crashed.traceback and "a bug" in crashed.traceback


def test_unparsable_code_is_a_failure_not_a_crash() -> None:
    got = _run("def (:\n")
    assert isinstance(got, Failure)


class _Upper(Command):
    DESCRIPTION = "every name upper-case"

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        class T(cst.CSTTransformer):
            def leave_Name(self, o: cst.Name, u: cst.Name) -> cst.Name:
                return u.with_changes(value=u.value.upper())

        return tree.visit(T())


def test_a_command_without_metadata_transforms_the_module_it_is_given() -> None:
    got = run(_Upper(CodemodContext()), "a = b\n")
    assert isinstance(got, Success) and got.value == "A = B\n"


def test_a_visitor_without_matcher_decorators_walks_with_the_plain_dispatch() -> None:
    """libcst's matcher dispatch runs at every node (60 % of a rewrite): a
    class with no matcher decorator walks without it, to the same result;
    one with a decorator keeps it."""
    import libcst.matchers as m

    class Plain(VisitorCommand):
        def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
            return (
                updated_node.with_changes(value="y") if updated_node.value == "x" else updated_node
            )

    class Decorated(VisitorCommand):
        @m.leave(m.Name("x"))
        def rename(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
            return updated_node.with_changes(value="y")

        @m.call_if_inside(m.Call())
        def leave_Integer(
            self, original_node: cst.Integer, updated_node: cst.Integer
        ) -> cst.Integer:
            return updated_node.with_changes(value="2")

    source = "x = f(x, 1) + 1\n"
    plain, decorated = Plain(CodemodContext()), Decorated(CodemodContext())
    assert "on_visit" in vars(plain) and "on_visit" not in vars(decorated)
    assert plain.transform_module_impl(cst.parse_module(source)).code == "y = f(y, 1) + 1\n"
    # The decorators still decide: the matcher and the call_if_inside constraint.
    assert decorated.transform_module_impl(cst.parse_module(source)).code == "y = f(y, 2) + 1\n"
