"""The walker's state: the frame being walked, definitions and their
versions, value sets (combined and capped), and the entry points each job
of the walker calls in another (declared here, implemented by the mixins
:class:`~.walker.FlowWalker` is made of)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import libcst as cst

from gdn_backport.cst_nodes import dotted, walk

from ..provenance import NO_ASSUME, NONE_VAL, NULL_VAL, Assume, Prov, Val, consistent, join
from .model import MAX_VALS, CallRecord, Def, Env, Flow, FrameState, Scope, Vals

if TYPE_CHECKING:
    from ..config import Fields
    from .calls import Resolver


class WalkerState:
    """What every job of the walker reads and writes (set up by
    :class:`~.walker.FlowWalker`), and the definitions and value sets they share."""

    fields: Fields
    row_gathers: frozenset[str]
    leading_one: frozenset[str]
    resolver: Resolver
    stop: Callable[[str], bool]
    flow: Flow
    version: dict[tuple[int, str], int]
    path: Assume
    _stmt: cst.CSTNode | None
    _loop: int
    _stmt_gathers: int
    _base_imports: dict[str, str]
    _state: FrameState | None
    instances: dict[str, Scope]
    _inlining: set[int]
    _members: dict[int, Vals]

    @property
    def state(self) -> FrameState:
        assert self._state is not None, "run() first"
        return self._state

    @property
    def imports(self) -> dict[str, str]:
        return self.state.imports

    @property
    def frame(self) -> int:
        return self.state.frame.id

    # -- definitions ------------------------------------------------------

    def _bump(self, name: str) -> None:
        key = (self.frame, name)
        self.version[key] = self.version.get(key, 0) + 1

    def _define(
        self,
        name: str,
        value: cst.BaseExpression | None,
        stmt: cst.CSTNode,
        prov: Prov,
        canon: str | None = None,
    ) -> Val:
        d = Def(len(self.flow.defs), name, stmt, value, frame=self.frame, canon=canon)
        self.flow.defs.append(d)
        self._bump(name)
        return Val(NO_ASSUME, prov, frozenset({d.id}))

    def _assign_vals(
        self, env: Env, name: str, value: cst.BaseExpression | None, vals: Vals
    ) -> None:
        assert self._stmt is not None
        d = Def(len(self.flow.defs), name, self._stmt, value, frame=self.frame)
        if value is not None:
            d.gather = self._find_gather(value, env)
            callee = dotted(value)
            if callee is not None and callee not in ("None", "True", "False"):
                d.alias_of = self._resolve(callee, env)
                d.canon = self._canon(value, env)
        self.flow.defs.append(d)
        self._bump(name)
        env[name] = frozenset(Val(v.assume, v.prov, v.defs | {d.id}, v.lead) for v in vals)

    def _find_gather(self, value: cst.BaseExpression, env: Env) -> cst.BaseExpression | None:
        """The outermost sub-expression of ``value`` that gathered spec rows.

        Evaluating ``value`` recorded every gather it performed; the first
        one met walking down from ``value`` is the outermost.
        """
        spec = {id(n) for n, p in self.flow.gathers[self._stmt_gathers :] if p is Prov.IDX_SPEC}
        if not spec:
            return None
        for node in walk(value, prune=cst.Lambda):
            if id(node) in spec:
                return node  # type: ignore[return-value]
        return None

    def _resolve(self, name: str, env: Env) -> str:
        """The dotted name a callee refers to, through imports and local aliases."""
        head, _, rest = name.partition(".")
        if head in env:
            aliases = {self.flow.defs[d].alias_of for v in env[head] for d in v.defs}
            if len(aliases) == 1 and None not in aliases:
                target = aliases.pop()
                assert target is not None
                return f"{target}.{rest}" if rest else target
            return name
        if head in self.imports:
            target = self.imports[head]
            return f"{target}.{rest}" if rest else target
        return name

    def _latest_defs(self, name: str, env: Env) -> set[int] | None:
        """The definitions of ``name`` that reach here (one per arm), or None
        when ``name`` holds nothing here or a value no definition made."""
        out = set()
        for v in env.get(name, ()):
            mine = [i for i in v.defs if self.flow.defs[i].name == name]
            if not mine:
                return None
            out.add(max(mine))
        return out or None

    def _starred_members(self, name: str, env: Env) -> Vals | None:
        """What ``*name``/``**name`` hands a call when every definition that
        reaches here is a container literal: its members, one value each."""
        defs = self._latest_defs(name, env)
        if defs is None or any(i not in self._members for i in defs):
            return None
        return self._cap({v for i in defs for v in self._members[i]})

    def _local_lambda(self, name: str, env: Env) -> cst.Lambda | None:
        """The lambda ``name`` holds here, if every reaching definition is one
        and the same lambda."""
        lams = {
            id(d.value): d.value
            for i in self._latest_defs(name, env) or ()
            if (d := self.flow.defs[i]).frame == self.frame
        }
        if len(lams) != 1:
            return None
        lam = next(iter(lams.values()))
        return lam if isinstance(lam, cst.Lambda) else None

    # -- value sets ------------------------------------------------------------

    def _combine(self, parts: Sequence[Vals], fn: Callable[[Iterable[Prov]], Prov]) -> Vals:
        """All consistent combinations of one value from each part."""
        parts = [p for p in parts if p not in (frozenset({NONE_VAL}), frozenset({NULL_VAL}))]
        if not parts:
            return frozenset({NONE_VAL})
        if len(parts) == 1 and fn is join:
            return parts[0]
        # Fold the parts one by one, dropping contradicting pairs as early as
        # possible (values of one arm only meet values of the same arm): the
        # product of the parts is far larger than what stays consistent.
        # A partial combination keeps the set of its rows' selections (join
        # and opaque depend on nothing else), so equal ones merge.
        # The leads of the row values combined: rows of two layouts (``[T,
        # H]`` with ``[1, T, H]``) make rows the analysis cannot name.
        Leads = frozenset[int | None]
        partial: set[tuple[Assume, frozenset[Prov], frozenset[int], Leads]] = {
            (NO_ASSUME, frozenset(), frozenset(), frozenset())
        }
        for part in parts:
            step: set[tuple[Assume, frozenset[Prov], frozenset[int], Leads]] = set()
            for assume, provs, defs, leads in partial:
                for v in part:
                    a = consistent(assume, v.assume)
                    if a is not None:
                        seen = leads | {v.lead} if v.prov.is_rows else leads
                        step.add((a, provs | {v.prov}, defs | v.defs, seen))
            if len(step) > MAX_VALS:
                return frozenset({Val(NO_ASSUME, Prov.CONFLICT)})
            partial = step
        out = set()
        for a, provs, defs, leads in partial:
            prov = fn(provs)
            known = {x for x in leads if x is not None}
            if len(known) > 1 and prov.is_rows:
                prov = Prov.CONFLICT
            # One known layout where every row value has it, else unknown.
            one = known.pop() if len(known) == 1 and None not in leads else None
            out.add(Val(a, prov, defs, one))
        return self._cap(out) if out else frozenset({NONE_VAL})

    @staticmethod
    def _cap(vals: set[Val]) -> Vals:
        if len(vals) > MAX_VALS:
            return frozenset({Val(NO_ASSUME, Prov.CONFLICT)})
        return frozenset(vals)

    # -- what one job calls in another ----------------------------------------

    def ev(self, node: cst.BaseExpression, env: Env) -> Vals:
        raise NotImplementedError  # expressions.Expressions

    def _block(self, body: cst.BaseSuite | Sequence[cst.CSTNode], env: Env) -> None:
        raise NotImplementedError  # statements.Statements

    def _returned(self, vals: Vals) -> None:
        raise NotImplementedError  # statements.Statements

    def _canon(self, node: cst.BaseExpression, env: Env, depth: int = 0) -> str:
        raise NotImplementedError  # conditions.Conditions

    def _atoms(self, test: cst.BaseExpression, truth: bool, env: Env) -> Assume:
        raise NotImplementedError  # conditions.Conditions

    def _narrow(self, test: cst.BaseExpression, truth: bool, env: Env) -> Assume | None:
        raise NotImplementedError  # conditions.Conditions

    def _field(self, attr: str) -> Prov | None:
        raise NotImplementedError  # expressions.Expressions

    def _inline_lambda(
        self,
        lam: cst.Lambda,
        env: Env,
        args: Sequence[tuple[str | None, cst.Arg, Vals]] | None = None,
    ) -> Vals:
        raise NotImplementedError  # expressions.Expressions

    def _follow(
        self,
        record: CallRecord,
        func: cst.BaseExpression,
        name: str | None,
        resolved: str | None,
        env: Env,
    ) -> Vals | None:
        raise NotImplementedError  # calls.CallFollowing
