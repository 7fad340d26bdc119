"""Statements: blocks, assignments, ``if`` forks and their merge, loops,
``try``, returns and local imports."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from gdn_backport.cst_nodes import dotted

from ..provenance import NONE_VAL, NULL_VAL, Assume, Prov, Val, consistent, join
from .expressions import is_container, sub_exprs
from .model import NEVER, Env, Terminated, Vals
from .row_order import INDEX_AUG, index_changed, overwritten
from .state import WalkerState


class Statements(WalkerState):
    """Statements walked in order; ``if``/loops/``try`` fork and merge the environment."""

    def _block(self, body: cst.BaseSuite | Sequence[cst.CSTNode], env: Env) -> None:
        stmts: Sequence[cst.CSTNode]
        if isinstance(body, cst.IndentedBlock):
            stmts = body.body
        elif isinstance(body, cst.SimpleStatementSuite):
            stmts = [body]
        else:
            stmts = body  # type: ignore[assignment]
        saved = self.path
        try:
            for stmt in stmts:
                self._statement(stmt, env)
        finally:
            # What an early return taught about the path holds to the end of
            # this block only.
            self.path = saved

    def _statement(self, stmt: cst.CSTNode, env: Env) -> None:
        # Gathers recorded from here on belong to this statement.
        self._stmt_gathers = len(self.flow.gathers)
        if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            self._stmt = stmt
            try:
                for small in stmt.body:
                    self._small(small, env)
            finally:
                self.flow.env_after[(self.frame, id(stmt))] = dict(env)
                self.flow.path_at[(self.frame, id(stmt))] = self.path
        elif isinstance(stmt, cst.If):
            self._if(stmt, env)
        elif isinstance(stmt, (cst.For, cst.While)):
            self._loop_stmt(stmt, env)
        elif isinstance(stmt, cst.With):
            self._stmt = stmt
            for item in stmt.items:
                vals = self.ev(item.item, env)
                if item.asname is not None:
                    self._bind_target(item.asname.name, item.item, vals, env)
            self._block(stmt.body, env)
        elif isinstance(stmt, cst.Try):
            self._try(stmt, env)
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            # A nested scope is analysed on its own; here it only binds a name.
            self._stmt = stmt
            env[stmt.name.value] = frozenset({self._define(stmt.name.value, None, stmt, Prov.NONE)})
        else:
            # match and other rare compound statements: fork conservatively.
            self._stmt = stmt
            for child in stmt.children:
                if isinstance(child, cst.BaseSuite):
                    self._block(child, env)

    def _small(self, small: cst.BaseSmallStatement, env: Env) -> None:
        if isinstance(small, cst.Assign):
            members: Vals | None = None
            if isinstance(small.value, cst.Lambda) and all(
                isinstance(t.target, cst.Name) for t in small.targets
            ):
                # ``pick = lambda t: ...``: its body runs where it is called.
                vals: Vals = frozenset({NONE_VAL})
            elif is_container(small.value) and len(small.targets) == 1:
                parts = [self.ev(e, env) for e in sub_exprs(small.value)]
                vals = self._combine(parts, join)
                members = self._cap({v for part in parts for v in part})
            else:
                vals = self.ev(small.value, env)
            for target in small.targets:
                self._bind_target(target.target, small.value, vals, env)
                if members is not None and isinstance(target.target, cst.Name):
                    self._members[len(self.flow.defs) - 1] = members
        elif isinstance(small, cst.AnnAssign):
            if small.value is not None:
                vals = self.ev(small.value, env)
                self._bind_target(small.target, small.value, vals, env)
        elif isinstance(small, cst.AugAssign):
            before = self.ev(small.target, env)
            if isinstance(small.operator, INDEX_AUG):
                before = index_changed(before)  # ``idx += 1``: another index
            vals = self._combine([before, self.ev(small.value, env)], join)
            if isinstance(small.target, cst.Name):
                self._assign_vals(env, small.target.value, None, vals)
        elif isinstance(small, cst.Expr):
            self.ev(small.value, env)
        elif isinstance(small, cst.Return):
            vals = self.ev(small.value, env) if small.value is not None else frozenset({NULL_VAL})
            self._returned(vals)
            raise Terminated
        elif isinstance(small, cst.Raise):
            if small.exc is not None:
                self.ev(small.exc, env)
            raise Terminated
        elif isinstance(small, cst.Assert):
            self.ev(small.test, env)
            # Past an assert its test holds (``assert x is not None``).
            self.path = consistent(self.path, self._atoms(small.test, True, env)) or self.path
            implied = self._narrow(small.test, True, env)
            if implied:
                self.path = consistent(self.path, implied) or self.path
        elif isinstance(small, (cst.Import, cst.ImportFrom)):
            self._local_import(small, env)

    def _returned(self, vals: Vals) -> None:
        """A helper returns ``vals`` on the current path."""
        for v in vals:
            a = consistent(v.assume, self.path)
            if a is not None:
                self.state.returns.append(Val(a, v.prov, v.defs, v.lead))

    def _local_import(self, node: cst.Import | cst.ImportFrom, env: Env) -> None:
        if isinstance(node.names, cst.ImportStar):
            return
        module = ""
        if isinstance(node, cst.ImportFrom):
            dots = "." * len(node.relative)
            module = dots + (dotted(node.module) or "" if node.module is not None else "")
        for alias in node.names:
            full = dotted(alias.name) or ""
            asname = alias.asname.name if alias.asname is not None else None
            local = asname.value if isinstance(asname, cst.Name) else full.split(".")[0]
            self.imports[local] = (
                f"{module}.{full}" if module and not module.endswith(".") else module + full
            )
            env.pop(local, None)

    def _bind_target(
        self,
        target: cst.BaseExpression,
        value: cst.BaseExpression,
        vals: Vals,
        env: Env,
    ) -> None:
        if isinstance(target, cst.Name):
            self._assign_vals(env, target.value, value, vals)
        elif isinstance(target, (cst.Tuple, cst.List)):
            elements = [e.value for e in target.elements]
            pairs = (
                [e.value for e in value.elements]
                if isinstance(value, (cst.Tuple, cst.List))
                and len(value.elements) == len(elements)
                and not any(isinstance(e, cst.StarredElement) for e in value.elements)
                else None
            )
            for i, element in enumerate(elements):
                if pairs is not None:
                    sub = pairs[i]
                    self._bind_target(element, sub, self.ev(sub, env), env)
                else:
                    self._bind_target(element, value, vals, env)
        elif isinstance(target, cst.StarredElement):
            self._bind_target(target.value, value, vals, env)
        else:
            # ``x[i] = ...`` / ``self.x = ...`` mutate, they bind no local.
            self.ev(target, env)
            if isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name):
                name = target.value.value
                if name in env:
                    env[name] = overwritten(env[name], [vals])

    def _if(self, stmt: cst.If, env: Env) -> None:
        self._stmt = stmt
        self.ev(stmt.test, env)
        arms: list[tuple[Assume, Env | None]] = []
        for truth, body in ((True, stmt.body), (False, stmt.orelse)):
            cond = self._atoms(stmt.test, truth, env)
            arm = dict(env)
            path = None if cond is NEVER else consistent(self.path, cond)
            implied = self._narrow(stmt.test, truth, arm) if path is not None else None
            path = consistent(path, implied) if path is not None and implied is not None else None
            if path is None:
                # An arm that contradicts the path so far is never taken.
                arms.append((cond, None))
                continue
            saved = self.path
            self.path = path
            try:
                if isinstance(body, cst.If):
                    self._if(body, arm)
                elif isinstance(body, cst.Else):
                    self._block(body.body, arm)
                elif body is not None:
                    self._block(body, arm)
                arms.append((cond, arm))
            except Terminated:
                arms.append((cond, None))
            finally:
                self.path = saved
        self._merge(env, arms)

    def _merge(self, env: Env, arms: list[tuple[Assume, Env | None]]) -> None:
        live = [(c, a) for c, a in arms if a is not None]
        if not live:
            raise Terminated
        if len(live) == 1:
            # Only one arm falls through: its condition holds from here on.
            cond, only = live[0]
            env.clear()
            env.update(only)
            self.path = consistent(self.path, cond) or self.path
            return
        names = set(env).union(*(a for _, a in live))
        for name in names:
            sets = [a.get(name, frozenset()) for _, a in live]
            if all(s == sets[0] for s in sets):
                env[name] = sets[0]
                continue
            merged: set[Val] = set()
            for (cond, _), vals in zip(live, sets, strict=True):
                for v in vals:
                    a = consistent(v.assume, cond)
                    if a is not None:
                        merged.add(Val(a, v.prov, v.defs, v.lead))
            env[name] = self._cap(merged)

    def _loop_stmt(self, stmt: cst.For | cst.While, env: Env) -> None:
        self._stmt = stmt
        self._loop += 1
        key = f"<loop {self.frame}.{self._loop}>"
        body_env = dict(env)
        if isinstance(stmt, cst.For):
            vals = self.ev(stmt.iter, env)
            self._bind_target(stmt.target, stmt.iter, vals, body_env)
        else:
            self.ev(stmt.test, env)
        saved = self.path
        try:
            self._block(stmt.body, body_env)
            arms: list[tuple[Assume, Env | None]] = [
                (frozenset({(key, True)}), body_env),
                (frozenset({(key, False)}), dict(env)),
            ]
        except Terminated:
            arms = [(frozenset({(key, False)}), dict(env))]
        finally:
            self.path = saved
        if stmt.orelse is not None:
            for _, arm in arms:
                if arm is not None:
                    self._block(stmt.orelse.body, arm)
        self._merge(env, arms)

    def _try(self, stmt: cst.Try, env: Env) -> None:
        self._stmt = stmt
        self._loop += 1
        key = f"<try {self.frame}.{self._loop}>"
        arms: list[tuple[Assume, Env | None]] = []
        body = dict(env)
        saved = self.path
        try:
            self._block(stmt.body, body)
            if stmt.orelse is not None:
                self._block(stmt.orelse.body, body)
            arms.append((frozenset({(key, True)}), body))
        except Terminated:
            arms.append((frozenset({(key, True)}), None))
        for handler in stmt.handlers:
            arm = dict(env)
            self.path = saved
            try:
                self._block(handler.body, arm)
                arms.append((frozenset({(key, False)}), arm))
            except Terminated:
                arms.append((frozenset({(key, False)}), None))
        self.path = saved
        self._merge(env, arms)
        if stmt.finalbody is not None:
            self._block(stmt.finalbody.body, env)
