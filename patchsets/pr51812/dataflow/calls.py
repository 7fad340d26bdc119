"""Call following: the resolver seam (:class:`Resolver`, :class:`Callee`)
and the walker's job of entering a helper of the tree in a new frame, its
parameters bound to the caller's argument values."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Protocol

import libcst as cst

from gdn_backport.cst_nodes import code, dotted, walk

from ..provenance import NO_ASSUME, NONE_VAL, NULL_VAL, SPEC_PATH, Prov, Val
from .model import (
    MAX_DEPTH,
    TENSOR_ATTRS,
    CallRecord,
    Def,
    Env,
    Frame,
    FrameState,
    Scope,
    Terminated,
    Vals,
)
from .state import WalkerState

# --- where calls go: the resolver seam ------------------------------------------


class Callee:
    """A function of the tree a call resolves to, ready to be walked. Its
    libcst node and whether it can touch the spec path are worked out only
    when asked: most calls a walk resolves are never followed."""

    def __init__(
        self,
        key: tuple[str, str, int],
        load: Callable[[], cst.FunctionDef],
        imports: Mapping[str, str],
        scope: Scope,
        qualname: str,
        path: str | None,
        line: int,
        bound: bool,
        relevant: Callable[[], bool],
        objects: Callable[[], set[str]] | None = None,
    ) -> None:
        self.key = key  # (module, qualname, occurrence): identity
        self._load = load
        self.imports = imports  # its module's imports: local name -> dotted target
        self.scope = scope
        self.qualname = qualname  # Class.method / function, as scan prints it
        self.path = path  # its file, relative to the tree root
        self.line = line  # its ``def`` line
        self.bound = bound  # the first parameter takes the receiver (``self.m(...)``)
        self._relevant = relevant
        self._objects = objects

    @functools.cached_property
    def func(self) -> cst.FunctionDef:
        return self._load()

    @functools.cached_property
    def objects(self) -> set[str]:
        """Its parameters that hold objects, not tensors (see :func:`object_params`)."""
        return self._objects() if self._objects is not None else object_params(self.func)

    @functools.cached_property
    def relevant(self) -> bool:
        """Its code (or a helper's) names a spec field or a kernel."""
        return self._relevant()


class Resolver(Protocol):
    def resolve(self, scope: Scope, written: str, resolved: str) -> Callee | None:
        """The function a call resolves to, or None.

        ``written``: the callee as written (``self.helper``, ``helper``,
        ``mod.helper``, ``super().helper``); ``resolved``: the same with
        import aliases applied (``pkg.mod.helper``). Only called for names
        that are not locals of the calling function."""
        ...


class NoResolver:
    """No helper is ever followed (one function analysed on its own)."""

    def resolve(self, scope: Scope, written: str, resolved: str) -> Callee | None:
        return None


class CallFollowing(WalkerState):
    """Which calls are followed into the tree's helpers, and how a helper is entered."""

    def _objects_by_helpers(
        self, func: cst.FunctionDef, scope: Scope, only: set[str], depth: int = 0
    ) -> set[str]:
        """Which of the parameters ``only`` the function hands to a helper of
        the tree that uses them as objects (``_conv_buffer_view(layer)``
        reads ``layer.kv_cache``)."""
        found: set[str] = set()
        if depth >= 2 or not only:
            return found
        for node in walk(func.body):
            if not isinstance(node, cst.Call) or not any(
                isinstance(a.value, cst.Name) and a.value.value in only for a in node.args
            ):
                continue
            name = dotted(node.func)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            resolved = name
            if head in self._base_imports:
                target = self._base_imports[head]
                resolved = f"{target}.{rest}" if rest else target
            callee = self.resolver.resolve(scope, name, resolved)
            if callee is None:
                continue
            record = CallRecord(node, resolved, NO_ASSUME, [], any(a.star for a in node.args))
            record.args = [
                (a.keyword.value if a.keyword else None, a, frozenset()) for a in node.args
            ]
            bound = bind_params(callee, record)
            if not isinstance(bound, dict):
                continue
            passed = {
                p: arg.value.value
                for p, (arg, _) in bound.items()
                if arg is not None and isinstance(arg.value, cst.Name) and arg.value.value in only
            }
            if not passed:
                continue
            inner = set(callee.objects)
            inner |= self._objects_by_helpers(
                callee.func, callee.scope, set(passed) - inner, depth + 1
            )
            found |= {mine for theirs, mine in passed.items() if theirs in inner}
        return found

    def _follow(
        self,
        record: CallRecord,
        func: cst.BaseExpression,
        name: str | None,
        resolved: str | None,
        env: Env,
    ) -> Vals | None:
        """Walk the helper ``record`` calls, if it is one of the tree's and may
        touch the spec path; its return values, or None (not followed)."""
        written: str | None = name
        if written is None and isinstance(func, cst.Attribute):
            inner = func.value
            if (
                isinstance(inner, cst.Call)
                and isinstance(inner.func, cst.Name)
                and inner.func.value == "super"
            ):
                written = f"super().{func.attr.value}"
        if written is None or (resolved is None and not written.startswith("super()")):
            return None
        head, _, rest = written.partition(".")
        scope = self.state.scope
        if head in env and head != scope.receiver:
            # ``layer.method()`` where ``layer`` is the instance a caller up
            # the chain called a method of (passed on as a parameter).
            instance = self.instances.get(self._canon(cst.Name(head), env))
            if instance is None or instance.receiver is None or not rest or "." in rest:
                return None  # a local object's method: not resolvable statically
            scope, written = instance, f"{instance.receiver}.{rest}"
            resolved = written
        if self.stop(resolved or written):
            return None
        target = self.resolver.resolve(scope, written, resolved or written)
        if target is None:
            head_import = self.state.imports.get(written.partition(".")[0])
            if (
                head_import is not None
                and resolved is not None
                and "." in resolved
                and not resolved.startswith(("torch.", "numpy.", "triton.", "einops."))
            ):
                record.missing = resolved
            return None
        carries = any(v.prov in SPEC_PATH for _, _, vals in record.args for v in vals)
        if not (carries or target.relevant):
            return None  # cannot touch the spec path: its result joins its arguments
        if any(a.star == "*" for a in record.node.args):
            # Positions past a ``*args`` splat are unknowable: the call is
            # judged on what it is visibly handed, like any unknown callee.
            return None
        why = None
        if self.state.frame.depth + 1 > MAX_DEPTH:
            why = f"the call chain is deeper than {MAX_DEPTH} calls"
        elif any(f.key == target.key for f in self.flow.chain(self.frame)):
            why = "it calls itself (recursion)"
        bound = None if why else bind_params(target, record)
        if why is None and isinstance(bound, str):
            why = bound
        if why is not None or not isinstance(bound, dict):
            record.unfollowed = f"{target.qualname}: {why}"
            return None
        return self._enter(record, target, bound, env)

    def _enter(
        self,
        record: CallRecord,
        target: Callee,
        bound: dict[str, tuple[cst.Arg | None, cst.BaseExpression | None]],
        env: Env,
    ) -> Vals:
        caller = self.state
        frame = Frame(
            len(self.flow.frames),
            target.qualname,
            target.path,
            target.line,
            target.func,
            target.key,
            caller.frame.id,
            record,
            {p: arg for p, (arg, _) in bound.items() if arg is not None},
            caller.frame.depth + 1,
        )
        self.flow.frames.append(frame)
        record.entered = frame.id
        recorded = {id(arg): vals for _, arg, vals in record.args}
        # What the helper uses as an object is one, whatever the caller thought.
        objects = target.objects
        values: dict[str, tuple[Vals, str | None]] = {}
        if target.bound and target.scope.receiver is not None:
            owner = record.node.func
            receiver = owner.value if isinstance(owner, cst.Attribute) else None
            canon = (
                self._canon(receiver, env)
                if isinstance(receiver, (cst.Name, cst.Attribute))
                else None
            )
            values[target.scope.receiver] = (frozenset({NONE_VAL}), canon)
            if canon is not None:
                self.instances[canon] = target.scope
        for p, (arg, default) in bound.items():
            if arg is not None:
                canon = (
                    self._canon(arg.value, env)
                    if isinstance(arg.value, (cst.Name, cst.Attribute)) or plain_test(arg.value)
                    else None
                )
                vals = recorded[id(arg)]
                if p in objects:
                    vals = frozenset(Val(v.assume, Prov.NONE, v.defs) for v in vals)
                values[p] = (vals, canon)
            elif default is not None:
                is_none = isinstance(default, cst.Name) and default.value == "None"
                values[p] = (frozenset({NULL_VAL if is_none else NONE_VAL}), None)
            else:
                values[p] = (frozenset({NONE_VAL}), None)
        saved = (self._state, self._stmt, self._stmt_gathers)
        self._state = FrameState(frame, dict(target.imports), target.scope)
        new_env: Env = {}
        try:
            for p, (vals, canon) in values.items():
                d = Def(len(self.flow.defs), p, target.func, None, param=True, frame=frame.id)
                d.canon = canon
                self.flow.defs.append(d)
                self._bump(p)
                new_env[p] = frozenset(Val(v.assume, v.prov, v.defs | {d.id}, v.lead) for v in vals)
            # ``*args``/``**kwargs`` hold what no named parameter took: a
            # forwarding wrapper (``def w(**kw): return kernel(**kw)``) hands
            # the kernel the spec slots it was given, never nothing.
            taken = {id(arg) for arg, _ in bound.values() if arg is not None}
            params = target.func.params
            for star, positional in ((params.star_arg, True), (params.star_kwarg, False)):
                if not isinstance(star, cst.Param):
                    continue
                extra: set[Val] = set()
                for keyword, arg, vals in record.args:
                    if id(arg) in taken or (keyword is None and not arg.star) != positional:
                        continue
                    extra |= vals
                new_env[star.name.value] = self._cap(extra) if extra else frozenset({NONE_VAL})
            try:
                self._block(target.func.body, new_env)
                self._returned(frozenset({NULL_VAL}))  # falls off the end
            except Terminated:
                pass
            returns = self.state.returns
        finally:
            self._state, self._stmt, self._stmt_gathers = saved
        return self._cap(set(returns)) if returns else frozenset({NULL_VAL})


def bind_params(
    target: Callee, record: CallRecord
) -> dict[str, tuple[cst.Arg | None, cst.BaseExpression | None]] | str:
    """Helper parameter -> (the argument bound to it, its default), or why
    the call cannot be bound (too many positional arguments, an unknown
    keyword): Python would raise, so the helper is not what runs."""
    params = target.func.params
    positional = [*params.posonly_params, *params.params]
    if target.bound:
        if not positional:
            return "a method without a self parameter"
        positional = positional[1:]
    kwonly = list(params.kwonly_params)
    out: dict[str, tuple[cst.Arg | None, cst.BaseExpression | None]] = {
        p.name.value: (None, p.default) for p in [*positional, *kwonly]
    }
    index = 0
    for keyword, arg, _ in record.args:
        if arg.star:
            # ``**options``: the parameters it fills stay unknown objects.
            continue
        if keyword is None:
            if index >= len(positional):
                if isinstance(params.star_arg, cst.Param):
                    continue
                return f"positional argument {index + 1} is beyond its parameters"
            out[positional[index].name.value] = (arg, positional[index].default)
            index += 1
        elif keyword in out:
            out[keyword] = (arg, out[keyword][1])
        elif not isinstance(params.star_kwarg, cst.Param):
            return f"it has no parameter {keyword}"
    return out


def object_params(func: cst.FunctionDef) -> set[str]:
    """Parameters that are not tensors: ``self``/``cls``, those annotated with
    something other than a Tensor, and those used with a non-tensor attribute."""
    params = [*func.params.posonly_params, *func.params.params, *func.params.kwonly_params]
    names = {p.name.value for p in params}
    objects = {"self", "cls"} & names
    for p in params:
        if p.annotation is not None and "Tensor" not in code(p.annotation.annotation):
            objects.add(p.name.value)

    for node in walk(func.body):
        if (
            isinstance(node, cst.Attribute)
            and isinstance(node.value, cst.Name)
            and node.value.value in names
            and node.attr.value not in TENSOR_ATTRS
        ):
            objects.add(node.value.value)
    return objects


def plain_test(node: cst.BaseExpression) -> bool:
    """A condition of names, attributes and constants (``md.num_prefills == 0
    and md.num_decodes == 0``): handed to a helper, the parameter tests what
    the caller's own ``if`` on it tests. Calls and subscripts may give another
    value each time and are never named so."""
    if not isinstance(node, (cst.BooleanOperation, cst.Comparison, cst.UnaryOperation)):
        return False
    return not any(
        isinstance(n, (cst.Call, cst.Subscript, cst.NamedExpr, cst.Await, cst.Lambda))
        for n in walk(node)
    )
