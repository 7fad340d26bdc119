"""What every patchset's codemods build on, and how a plan runs one.

A codemod is a libcst :class:`~libcst.codemod.CodemodCommand`, one class per
module, carrying ``DESCRIPTION`` and its examples (``REWRITES`` before/after,
``UNCHANGED``, ``REFUSES`` source/reason; ``EXAMPLE_ARGS`` the constructor
arguments they run with). ``tests/test_codemods.py`` runs every example of
every patchset's codemods, and ``python -m libcst.tool codemod`` runs each
of them on files: ``<id>.codemods.<module>.<Class>`` from the checkout
(``.libcst.codemod.yaml`` at its root), ``-x
gdn_backport.patchsets.<id>.codemods.<module>.<Class>`` anywhere else, with
``--no-format`` (they keep the file's own formatting; a formatter would
reformat the whole file).

A codemod fails closed by raising :class:`~gdn_backport.errors.Refusal`
(the runner makes it a ``TransformFailure``) and says "nothing here" with
``SkipFile``; it never rewrites partway.
"""

from __future__ import annotations

from libcst import CSTTransformer, Module
from libcst.codemod import (
    Codemod,
    CodemodCommand,
    CodemodContext,
    ContextAwareTransformer,
    transform_module,
)

from gdn_backport.result import Failure, Skip, Success, of_transform

__all__ = ["Command", "VisitorCommand", "run"]


class _NoWrapper(Codemod):
    """``Codemod.transform_module`` without the ``MetadataWrapper`` where the
    codemod declares no metadata: the wrapper deep-copies the module, which
    costs more than parsing it (1.6 s against 1.2 s for vLLM 0.27.1's
    7,928-line ``gpu_model_runner.py``)."""

    def transform_module(self, tree: Module) -> Module:
        if self.get_inherited_dependencies():
            return super().transform_module(tree)
        return self.transform_module_impl(tree)


class Command(CodemodCommand, _NoWrapper):
    """A ``CodemodCommand`` (its imports scheduled with ``AddImportsVisitor``
    run after :meth:`transform_module_impl`, as libcst does) that reads no
    metadata unless it declares some."""

    def _instantiate_and_run(self, transform: type[Codemod], tree: Module) -> Module:
        # libcst runs the scheduled ``AddImportsVisitor`` through its
        # ``MetadataWrapper`` too, though it reads no metadata: the same
        # deep copy of the whole module, skipped the same way.
        inst = transform(self.context)
        if not inst.get_inherited_dependencies() and not inst.should_allow_multiple_passes():
            return inst.transform_module_impl(tree)
        return inst.transform_module(tree)


class VisitorCommand(ContextAwareTransformer, Command):
    """:class:`Command` as a visitor: ``transform_module_impl`` visits the
    module with ``self`` (``leave_*`` methods and ``@m.leave`` matchers)."""

    def __init__(self, context: CodemodContext) -> None:
        super().__init__(context)
        # A class with no matcher decorator (``@m.visit``, ``@m.leave``,
        # ``@m.call_if_inside``, ...): libcst's matcher dispatch, evaluated at
        # every node, then decides nothing and calls the plain transformer's
        # (60 % of a rewrite's time); call that directly. Where libcst keeps
        # its matchers otherwise, its own dispatch stays.
        if not any(getattr(self, f, True) for f in _MATCHERS):
            for name in _DISPATCH:
                setattr(self, name, getattr(CSTTransformer, name).__get__(self))


# MatcherDecoratableTransformer's own record of the decorators it found.
_MATCHERS = ("_matchers", "_extra_visit_funcs", "_extra_leave_funcs")
_DISPATCH = ("on_visit", "on_leave", "on_visit_attribute", "on_leave_attribute")


def run(codemod: Codemod, code: str) -> Success[str] | Skip | Failure:
    """``codemod`` over ``code`` through libcst's runner, as a result."""
    return of_transform(transform_module(codemod, code), type(codemod).__name__)
