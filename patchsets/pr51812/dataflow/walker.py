"""The walker: its five jobs (:mod:`.statements`, :mod:`.expressions`,
:mod:`.calls`, :mod:`.conditions`, :mod:`.state`) in one object, and the
entry of a walk."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import libcst as cst

from ..config import Fields
from ..provenance import NO_ASSUME, NONE_VAL, Assume, Prov
from .calls import CallFollowing, NoResolver, Resolver, object_params
from .conditions import Conditions
from .expressions import Expressions
from .model import Env, Flow, Frame, FrameState, Scope, Terminated, Vals
from .statements import Statements


class FlowWalker(Statements, Expressions, CallFollowing, Conditions):
    """One walk: an entry function and the helpers it follows (:meth:`run`)."""

    def __init__(
        self,
        fields: Fields,
        imports: Mapping[str, str],
        resolver: Resolver | None = None,
        stop: Callable[[str], bool] = lambda name: False,
        row_gathers: frozenset[str] = frozenset(),
        leading_one: frozenset[str] = frozenset(),
    ) -> None:
        """``stop(callee)``: calls never followed (kernels, benign calls);
        ``row_gathers``: dotted names of functions called as ``f(x, index)``
        that select like ``x.index_select(0, index)``, ``x`` for None."""
        self.fields = fields
        self.row_gathers = row_gathers
        self.leading_one = leading_one
        self.resolver: Resolver = resolver or NoResolver()
        self.stop = stop
        self.flow = Flow()
        self.version: dict[tuple[int, str], int] = {}
        self.path: Assume = NO_ASSUME
        self._stmt: cst.CSTNode | None = None
        self._loop = 0
        self._stmt_gathers = 0
        self._base_imports = dict(imports)
        self._state: FrameState | None = None
        # The canonical name of an instance -> the scope of its class: what
        # ``self`` is in a method, wherever it is passed on.
        self.instances: dict[str, Scope] = {}
        # Lambdas being inlined (a lambda that calls itself is not followed).
        self._inlining: set[int] = set()
        # A container literal bound to a name (``kw = dict(a=a, ...)``) -> the
        # values it holds, each with its own rows: ``kernel(**kw)`` is handed
        # them, not their join.
        self._members: dict[int, Vals] = {}

    # -- entry -------------------------------------------------------------

    def run(
        self,
        func: cst.FunctionDef,
        scope: Scope | None = None,
        qualname: str = "",
        path: str | None = None,
        line: int = 0,
        key: tuple[str, str, int] | None = None,
        objects: set[str] | None = None,
    ) -> Flow:
        """Walk ``func`` as an entry: its tensor parameters hold every row of
        the step; ``objects``: its parameters known to hold objects instead
        (default: worked out here)."""
        qualname = qualname or func.name.value
        scope = scope or Scope("")
        frame = Frame(0, qualname, path, line, func, key or (scope.module, qualname, 0))
        self.flow.frames.append(frame)
        self._state = FrameState(frame, dict(self._base_imports), scope)
        env: Env = {}
        params = func.params
        if objects is None:
            objects = object_params(func)
            names = {p.name.value for p in [*params.posonly_params, *params.params]}
            names |= {p.name.value for p in params.kwonly_params}
            objects |= self._objects_by_helpers(
                func, scope, names - objects - {scope.receiver or ""}
            )
        for p in [*params.posonly_params, *params.params, *params.kwonly_params]:
            name = p.name.value
            # A per-token tensor argument of the layer holds every row of the
            # step; ``self`` and other objects hold none.
            # A parameter named like a metadata field carries that field.
            prov = self._field(name) or (Prov.NONE if name in objects else Prov.ALL)
            val = self._define(name, None, func, prov)
            self.flow.defs[-1].param = True
            self.flow.defs[-1].optional = isinstance(p.default, cst.Name) and (
                p.default.value == "None"
            )
            env[name] = frozenset({val})
            if name == scope.receiver:
                self.instances[self._canon(cst.Name(name), env)] = scope
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                env[star.name.value] = frozenset({NONE_VAL})
        with contextlib.suppress(Terminated):
            self._block(func.body, env)
        return self.flow
