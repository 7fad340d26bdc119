"""Conditions: a branch test as atoms (so contradicting arms never combine),
the canonical name of what a test reads, and ``x is None`` narrowing."""

from __future__ import annotations

import libcst as cst

from gdn_backport.cst_nodes import code, names_in

from ..provenance import NO_ASSUME, Assume, Prov, Val, consistent
from .model import NEVER, Env
from .state import WalkerState


class Conditions(WalkerState):
    """Branch tests as atoms, canonical names, None-narrowing."""

    def _canon(self, node: cst.BaseExpression, env: Env, depth: int = 0) -> str:
        """A name for ``node`` that is the same wherever it means the same value.

        A local assigned once from a name or attribute chain stands for that
        chain, and a helper's parameter for the caller's argument, so
        ``m = md.spec_sequence_masks; if m is None`` and a helper's
        ``if md.spec_sequence_masks is not None`` test the same thing.
        """
        if isinstance(node, cst.Name):
            if node.value in ("None", "True", "False"):
                return node.value
            latest = self._latest_defs(node.value, env)
            if latest is not None and len(latest) == 1 and depth < 8:
                d = self.flow.defs[latest.pop()]
                if d.canon is not None:
                    return d.canon
                return f"{d.frame}:{node.value}#{d.id}"
            return f"{self.frame}:{node.value}@{self.version.get((self.frame, node.value), 0)}"
        if isinstance(node, cst.Attribute):
            return f"{self._canon(node.value, env, depth + 1)}.{node.attr.value}"
        if isinstance(node, cst.BooleanOperation):
            # ``(a and b)`` and ``b and a`` test what ``a and b`` tests: the
            # arms of an IfExp must meet the if statement that chose the rows.
            op = type(node.operator)
            operands: list[cst.BaseExpression] = [node]
            while any(isinstance(o, cst.BooleanOperation) and isinstance(o.operator, op)
                      for o in operands):  # fmt: skip
                operands = [
                    part
                    for o in operands
                    for part in (
                        (o.left, o.right)
                        if isinstance(o, cst.BooleanOperation) and isinstance(o.operator, op)
                        else (o,)
                    )
                ]
            parts = sorted(self._canon(o, env, depth + 1) for o in operands)
            return f"{op.__name__.lower()}({', '.join(parts)})"
        if getattr(node, "lpar", None):
            node = node.with_changes(lpar=[], rpar=[])
        names = sorted({n.value for n in names_in(node)})
        versions = ",".join(f"{n}@{self.version.get((self.frame, n), 0)}" for n in names)
        return f"{self.frame}:{''.join(code(node).split())}|{versions}"

    def _atoms(self, test: cst.BaseExpression, truth: bool, env: Env) -> Assume:
        """What holds on the arm of ``test`` that is ``truth``, as atoms."""
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            return self._atoms(test.expression, not truth, env)
        if isinstance(test, cst.BooleanOperation):
            both = (isinstance(test.operator, cst.And) and truth) or (
                isinstance(test.operator, cst.Or) and not truth
            )
            if both:
                left = self._atoms(test.left, truth, env)
                right = self._atoms(test.right, truth, env)
                if left is NEVER or right is NEVER:
                    return NEVER
                # The compound's own atom too: the other arm negates it.
                whole = frozenset({(self._canon(test, env), truth)})
                merged = consistent(left, right, whole)
                # ``x and not x``: an arm no path takes.
                return merged if merged is not None else NEVER
        subject = none_test(test)
        if subject is not None:
            expr, is_none = subject
            return frozenset({(f"{self._canon(expr, env)} is None", truth == is_none)})
        return frozenset({(self._canon(test, env), truth)})

    def _narrow(self, test: cst.BaseExpression, truth: bool, env: Env) -> Assume | None:
        """Narrow a local tested against None on one arm. Returns what the
        arm then implies (the conditions every value left shares: ``x is
        None`` where x is None only on the no-spec path implies that path),
        or None if the arm cannot be taken (``x = None; if x is not None``)."""
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            return self._narrow(test.expression, not truth, env)
        if isinstance(test, cst.BooleanOperation):
            if (isinstance(test.operator, cst.And) and truth) or (
                isinstance(test.operator, cst.Or) and not truth
            ):
                left = self._narrow(test.left, truth, env)
                right = self._narrow(test.right, truth, env) if left is not None else None
                return consistent(left, right) if left is not None and right is not None else None
            return NO_ASSUME
        subject = none_test(test)
        if subject is None or not isinstance(subject[0], cst.Name):
            return NO_ASSUME
        name = subject[0].value
        vals = env.get(name)
        if not vals:
            return NO_ASSUME
        if truth == subject[1]:
            keep = frozenset(v for v in vals if self._maybe_none(v))
        else:
            keep = frozenset(v for v in vals if v.prov is not Prov.NULL)
        if not keep:
            return None
        env[name] = keep
        return frozenset.intersection(*(v.assume for v in keep))

    def _maybe_none(self, v: Val) -> bool:
        """Whether a value can be None: the constant, objects and metadata
        fields can; rows a tensor op produced or a tensor argument of the
        entry cannot, unless that argument defaults to None."""
        if v.prov in (Prov.SPEC, Prov.NONSPEC, Prov.IDX_ALL):
            return False
        if v.prov is Prov.ALL:
            return any(self.flow.defs[d].optional for d in v.defs)
        return True


def none_test(test: cst.BaseExpression) -> tuple[cst.BaseExpression, bool] | None:
    """(x, True) for ``x is None``/``x == None``, (x, False) for the negations."""
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return None
    target = test.comparisons[0]
    right = target.comparator
    if not (isinstance(right, cst.Name) and right.value == "None"):
        return None
    op = target.operator
    if isinstance(op, (cst.Is, cst.Equal)):
        return test.left, True
    if isinstance(op, (cst.IsNot, cst.NotEqual)):
        return test.left, False
    return None
