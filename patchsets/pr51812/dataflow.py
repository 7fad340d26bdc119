"""Path-sensitive row-provenance data flow over a function and its helpers (libcst).

The walker executes the function body abstractly: every local name maps to
the set of :class:`~gdn_backport.provenance.Val` it may hold. An ``if``
forks the environment and tags what each arm assigns with the arm's
condition, so a value set in the pure-spec fast path and a value set in the
mixed branch stay apart and are only ever combined with values from the same
arm. Conditions are normalised into atoms (``x is not None`` is ``x is
None`` negated, ``not c`` is ``c`` negated, ``a and b`` holds both), so
contradicting tests never combine; an arm that contradicts the path so far
is not walked, and after an early ``return``/``raise`` the other arm's
condition holds for the rest of the block. ``x is None`` narrows ``x`` in
each arm: a local staged as ``None`` only takes the arm where it is None.

Calls into helpers of the same tree (``self.method``, module functions,
functions imported from other modules of the tree, resolved by a
:class:`Resolver` and never executed) are followed when they can touch the
spec path: the helper is walked in a new *frame* with its parameters bound
to the caller's argument values (by position, keyword and default), so a
kernel call inside it sees the rows the caller selected. Frames nest up to
:data:`MAX_DEPTH` deep; recursion is cut.

Nothing here knows about vLLM besides the names the patchset gives: which
attributes are spec/non-spec token indices and state slots, which callees
are kernels (never followed). Every call is recorded with the values of its
arguments; :mod:`gdn_backport.analysis` decides which calls are kernels and
whether their rows line up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import libcst as cst

from gdn_backport.cst_nodes import code, dotted, index_select_parts, names_in, walk

from .config import Fields
from .provenance import (
    GATHERED,
    INVERT,
    NO_ASSUME,
    NONE_VAL,
    NULL_VAL,
    SPEC_PATH,
    Assume,
    Prov,
    Val,
    consistent,
    join,
)

Vals = frozenset[Val]
Env = dict[str, Vals]

# How many helper calls deep a spec path is followed (the entry is depth 0).
MAX_DEPTH = 4

# Methods and attributes that read shape or placement, never rows.
_META = frozenset(
    {
        "size", "dim", "numel", "stride", "item", "is_contiguous", "data_ptr",
        "element_size", "get_device", "tolist", "shape", "dtype", "device",
        "ndim", "is_cuda", "storage_offset", "nelement",
    }
)  # fmt: skip
# What code does with a tensor. A parameter only ever used with these is taken
# to be a per-token tensor; one with any other attribute (``layer.A_log``,
# ``metadata.spec_token_indx``) is an object holding weights or metadata.
TENSOR_ATTRS = _META | frozenset(
    {
        "T", "mT", "view", "reshape", "contiguous", "to", "float", "half", "bfloat16",
        "transpose", "split", "chunk", "unsqueeze", "squeeze", "permute", "flatten",
        "clone", "narrow", "index_select", "copy_", "fill_", "zero_", "index_copy_",
        "new_empty", "new_zeros", "new_ones", "sum", "mean", "sigmoid", "exp", "neg",
        "softmax", "unflatten", "expand", "repeat", "masked_fill", "type_as", "cuda",
        "cpu", "detach", "view_as", "reshape_as", "movedim", "select", "gather", "type",
        "is_floating_point", "any", "all", "max", "min", "abs", "sqrt", "pow", "mul",
        "add", "sub", "div", "unbind", "roll", "flip", "argmax", "long", "int", "bool",
        "index_copy", "index_fill_", "index_put_", "index_add_", "scatter_", "scatter",
        "masked_fill_", "masked_scatter_", "new_tensor", "new_full", "cumsum", "repeat_interleave",
    }
)  # fmt: skip
# Above this many alternatives a value is no longer worth tracking precisely.
_MAX_VALS = 256
# The condition of an arm no path takes (``x and not x``).
_NEVER: Assume = frozenset({("<never>", True), ("<never>", False)})


# --- where calls go: the resolver seam ------------------------------------------


@dataclass(frozen=True)
class Scope:
    """Where a function's calls resolve: its module and, for a method, its class."""

    module: str  # the resolver's key of the module (its path, or a pseudo name)
    cls: str | None = None  # qualname of the class holding the method
    receiver: str | None = None  # the parameter bound to the instance/class (self, cls)


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
        return self._objects() if self._objects is not None else _object_params(self.func)

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


# --- what the walk records ----------------------------------------------------------


@dataclass
class Def:
    """One assignment of a local name (in one frame)."""

    id: int
    name: str
    stmt: cst.CSTNode  # the statement line holding the assignment
    value: cst.BaseExpression | None  # the expression assigned to this name
    gather: cst.BaseExpression | None = None  # the spec gather inside value
    alias_of: str | None = None  # ``k = some.kernel``: the callee it names
    param: bool = False  # a parameter of the function
    optional: bool = False  # a parameter that defaults to None
    frame: int = 0
    # What the name stands for in conditions across assignments and frames
    # (``m = md.spec_sequence_masks`` reads as ``<md>.spec_sequence_masks``).
    canon: str | None = None


@dataclass
class CallRecord:
    node: cst.Call
    callee: str | None  # dotted name as written, aliases resolved
    path: Assume  # branch conditions under which the call runs
    args: list[tuple[str | None, cst.Arg, Vals]]  # (keyword, arg, values)
    starred: bool  # passes *args/**kwargs: binding unknowable
    frame: int = 0
    # The helper this call was followed into (its frame id), if it was.
    entered: int | None = None
    # A helper of the tree this call resolves to that was not followed, and why.
    unfollowed: str | None = None
    # The receiver values of ``x.method(...)`` (None for plain calls).
    owner: Vals | None = None


@dataclass
class Frame:
    """One walk of one function: the entry, or a helper entered from a call."""

    id: int
    qualname: str
    path: str | None
    line: int
    func: cst.FunctionDef
    key: tuple[str, str, int]
    parent: int | None = None  # the calling frame
    call: CallRecord | None = None  # the call (in ``parent``) that entered it
    # parameter -> the argument node of ``call`` it is bound to (absent: default)
    bindings: dict[str, cst.Arg] = field(default_factory=dict)
    depth: int = 0


@dataclass
class Flow:
    """What the walk learned about one entry function and its helpers."""

    defs: list[Def] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    gathers: list[tuple[cst.BaseExpression, Prov]] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    # Definitions whose rows were gathered by some index somewhere: evidence
    # that a parameter really is a per-token tensor.
    gathered_defs: set[int] = field(default_factory=set)
    # Environment right after each simple statement line, keyed by (frame,
    # id(statement)): the rewriter checks that an inserted line sees the
    # values the call sees.
    env_after: dict[tuple[int, int], Env] = field(default_factory=dict)
    # The branch conditions that hold at each of those lines.
    path_at: dict[tuple[int, int], Assume] = field(default_factory=dict)

    def chain(self, frame: int) -> list[Frame]:
        """The frames from the entry down to ``frame``."""
        out = []
        current: int | None = frame
        while current is not None:
            out.append(self.frames[current])
            current = self.frames[current].parent
        return out[::-1]


class _Terminated(Exception):
    """Raised inside a block after ``return``/``raise``: the path ends there."""


@dataclass
class _FrameState:
    frame: Frame
    imports: dict[str, str]
    scope: Scope
    returns: list[Val] = field(default_factory=list)


class FlowWalker:
    def __init__(
        self,
        fields: Fields,
        imports: Mapping[str, str],
        resolver: Resolver | None = None,
        stop: Callable[[str], bool] = lambda name: False,
        row_gathers: frozenset[str] = frozenset(),
    ) -> None:
        """``stop(callee)``: calls never followed (kernels, benign calls);
        ``row_gathers``: dotted names of functions called as ``f(x, index)``
        that select like ``x.index_select(0, index)``, ``x`` for None."""
        self.fields = fields
        self.row_gathers = row_gathers
        self.resolver: Resolver = resolver or NoResolver()
        self.stop = stop
        self.flow = Flow()
        self.version: dict[tuple[int, str], int] = {}
        self.path: Assume = NO_ASSUME
        self._stmt: cst.CSTNode | None = None
        self._loop = 0
        self._stmt_gathers = 0
        self._base_imports = dict(imports)
        self._state: _FrameState | None = None
        # The canonical name of an instance -> the scope of its class: what
        # ``self`` is in a method, wherever it is passed on.
        self.instances: dict[str, Scope] = {}
        # Lambdas being inlined (a lambda that calls itself is not followed).
        self._inlining: set[int] = set()
        # A container literal bound to a name (``kw = dict(a=a, ...)``) -> the
        # values it holds, each with its own rows: ``kernel(**kw)`` is handed
        # them, not their join.
        self._members: dict[int, Vals] = {}

    @property
    def state(self) -> _FrameState:
        assert self._state is not None, "run() first"
        return self._state

    @property
    def imports(self) -> dict[str, str]:
        return self.state.imports

    @property
    def frame(self) -> int:
        return self.state.frame.id

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
        self._state = _FrameState(frame, dict(self._base_imports), scope)
        env: Env = {}
        params = func.params
        if objects is None:
            objects = _object_params(func)
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
        with contextlib.suppress(_Terminated):
            self._block(func.body, env)
        return self.flow

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
            bound = _bind_params(callee, record)
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
        env[name] = frozenset(Val(v.assume, v.prov, v.defs | {d.id}) for v in vals)

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

    def _index_select_args(
        self, call: cst.Call
    ) -> tuple[cst.BaseExpression | None, cst.BaseExpression | None]:
        parts = index_select_parts(call, ("torch", *self._torch_aliases()))
        return (parts.base, parts.index) if parts else (None, None)

    def _torch_aliases(self) -> list[str]:
        return [k for k, v in self.imports.items() if v == "torch"]

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

    # -- conditions ---------------------------------------------------------

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
                if left is _NEVER or right is _NEVER:
                    return _NEVER
                # The compound's own atom too: the other arm negates it.
                whole = frozenset({(self._canon(test, env), truth)})
                merged = consistent(left, right, whole)
                # ``x and not x``: an arm no path takes.
                return merged if merged is not None else _NEVER
        subject = _none_test(test)
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
        subject = _none_test(test)
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

    # -- statements -------------------------------------------------------

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
            elif _is_container(small.value) and len(small.targets) == 1:
                parts = [self.ev(e, env) for e in _sub_exprs(small.value)]
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
            vals = self._combine([self.ev(small.target, env), self.ev(small.value, env)], join)
            if isinstance(small.target, cst.Name):
                self._assign_vals(env, small.target.value, None, vals)
        elif isinstance(small, cst.Expr):
            self.ev(small.value, env)
        elif isinstance(small, cst.Return):
            vals = self.ev(small.value, env) if small.value is not None else frozenset({NULL_VAL})
            self._returned(vals)
            raise _Terminated
        elif isinstance(small, cst.Raise):
            if small.exc is not None:
                self.ev(small.exc, env)
            raise _Terminated
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
                self.state.returns.append(Val(a, v.prov, v.defs))

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

    def _if(self, stmt: cst.If, env: Env) -> None:
        self._stmt = stmt
        self.ev(stmt.test, env)
        arms: list[tuple[Assume, Env | None]] = []
        for truth, body in ((True, stmt.body), (False, stmt.orelse)):
            cond = self._atoms(stmt.test, truth, env)
            arm = dict(env)
            path = None if cond is _NEVER else consistent(self.path, cond)
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
            except _Terminated:
                arms.append((cond, None))
            finally:
                self.path = saved
        self._merge(env, arms)

    def _merge(self, env: Env, arms: list[tuple[Assume, Env | None]]) -> None:
        live = [(c, a) for c, a in arms if a is not None]
        if not live:
            raise _Terminated
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
                        merged.add(Val(a, v.prov, v.defs))
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
        except _Terminated:
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
        except _Terminated:
            arms.append((frozenset({(key, True)}), None))
        for handler in stmt.handlers:
            arm = dict(env)
            self.path = saved
            try:
                self._block(handler.body, arm)
                arms.append((frozenset({(key, False)}), arm))
            except _Terminated:
                arms.append((frozenset({(key, False)}), None))
        self.path = saved
        self._merge(env, arms)
        if stmt.finalbody is not None:
            self._block(stmt.finalbody.body, env)

    # -- expressions ------------------------------------------------------

    def ev(self, node: cst.BaseExpression, env: Env) -> Vals:
        if isinstance(node, cst.Name):
            if node.value == "None":
                return frozenset({NULL_VAL})
            return env.get(node.value, frozenset({NONE_VAL}))
        if isinstance(node, cst.Attribute):
            return self._attribute(node, env)
        if isinstance(node, cst.Subscript):
            return self._subscript(node, env)
        if isinstance(node, cst.Call):
            return self._call(node, env)
        if isinstance(node, cst.UnaryOperation):
            vals = self.ev(node.expression, env)
            if isinstance(node.operator, cst.BitInvert):
                return frozenset(Val(v.assume, INVERT.get(v.prov, v.prov), v.defs) for v in vals)
            return vals
        if isinstance(node, cst.IfExp):
            self.ev(node.test, env)
            out: set[Val] = set()
            for truth, arm in ((True, node.body), (False, node.orelse)):
                cond = self._atoms(node.test, truth, env)
                if cond is _NEVER or consistent(self.path, cond) is None:
                    continue
                narrowed = dict(env)
                if self._narrow(node.test, truth, narrowed) is None:
                    continue
                for v in self.ev(arm, narrowed):
                    a = consistent(v.assume, cond)
                    if a is not None:
                        out.add(Val(a, v.prov, v.defs))
            return self._cap(out) if out else frozenset({NONE_VAL})
        if isinstance(node, cst.Lambda):
            # Handed on (a callback, a graph capture): what its body calls is
            # judged here, with parameters whose rows nobody knows.
            self._inline_lambda(node, env)
            return frozenset({NONE_VAL})
        if isinstance(node, (cst.BaseString, cst.Integer, cst.Float)):
            return frozenset({NONE_VAL})
        if isinstance(node, (cst.GeneratorExp, cst.ListComp, cst.SetComp)):
            return self._comprehension(node, node.elt, env)
        if isinstance(node, cst.DictComp):
            return self._comprehension(node, node.value, env)
        if isinstance(node, cst.NamedExpr):
            vals = self.ev(node.value, env)
            if isinstance(node.target, cst.Name):
                self._assign_vals(env, node.target.value, node.value, vals)
            return vals
        return self._combine([self.ev(c, env) for c in _sub_exprs(node)], join)

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

    def _inline_lambda(
        self,
        lam: cst.Lambda,
        env: Env,
        args: Sequence[tuple[str | None, cst.Arg, Vals]] | None = None,
    ) -> Vals:
        """Evaluate ``lam``'s body where it is called, its parameters bound to
        the call's arguments (free names read as they are here, as Python's
        closures do); ``*rest``/``**rest`` hold what no named parameter took.
        Without a call, or with one that cannot be bound, the parameters hold
        rows of unknown selection: never "all rows"."""
        unknown = frozenset({Val(NO_ASSUME, Prov.CONFLICT)})
        if id(lam) in self._inlining:
            return unknown
        params = lam.params
        positional = [p.name.value for p in (*params.posonly_params, *params.params)]
        named = {*positional, *(p.name.value for p in params.kwonly_params)}
        bound: dict[str, Vals] = {}
        extra_pos: set[Val] = set()
        extra_kw: set[Val] = set()
        ok = args is not None
        index = 0
        for keyword, arg, vals in args or ():
            if arg.star:
                # ``f(*xs)``/``f(**kw)``: which parameter gets what is unknown.
                (extra_pos if arg.star == "*" else extra_kw).update(vals)
                ok = ok and isinstance(params.star_arg if arg.star == "*" else params.star_kwarg,
                                       cst.Param)  # fmt: skip
            elif keyword is None:
                if index < len(positional):
                    bound[positional[index]] = vals
                    index += 1
                else:
                    extra_pos.update(vals)
                    ok = ok and isinstance(params.star_arg, cst.Param)
            elif keyword in named:
                bound[keyword] = vals
            else:
                extra_kw.update(vals)
                ok = ok and isinstance(params.star_kwarg, cst.Param)
        inner = dict(env)
        for star, extra in ((params.star_arg, extra_pos), (params.star_kwarg, extra_kw)):
            if isinstance(star, cst.Param):
                inner[star.name.value] = self._cap(extra) if ok and extra else unknown
        for p in (*params.posonly_params, *params.params, *params.kwonly_params):
            name = p.name.value
            if ok and name in bound:
                inner[name] = bound[name]
            elif ok and p.default is not None:
                inner[name] = self.ev(p.default, env)
            else:
                inner[name] = unknown
        self._inlining.add(id(lam))
        try:
            return self.ev(lam.body, inner)
        finally:
            self._inlining.discard(id(lam))

    def _comprehension(
        self,
        node: cst.GeneratorExp | cst.ListComp | cst.SetComp | cst.DictComp,
        elt: cst.BaseExpression,
        env: Env,
    ) -> Vals:
        inner = dict(env)
        parts = []
        comp: cst.CompFor | None = node.for_in
        while comp is not None:
            it = self.ev(comp.iter, inner)
            parts.append(it)
            for n in names_in(comp.target):
                inner[n.value] = frozenset({NONE_VAL})
            for cond in comp.ifs:
                self.ev(cond.test, inner)
            comp = comp.inner_for_in
        parts.append(self.ev(elt, inner))
        return self._combine(parts, join)

    def _attribute(self, node: cst.Attribute, env: Env) -> Vals:
        attr = node.attr.value
        base = self.ev(node.value, env)
        if attr in _META:
            return frozenset({NONE_VAL})
        field_prov = self._field(attr)
        if field_prov is not None:
            return frozenset(Val(v.assume, field_prov, v.defs) for v in base)
        if attr not in TENSOR_ATTRS:
            # ``layer.conv1d``, ``md.num_prefills``: what an object holds, not rows.
            return frozenset({NONE_VAL})
        return base

    def _field(self, attr: str) -> Prov | None:
        f = self.fields
        if attr in f.spec_index:
            return Prov.IDX_SPEC
        if attr in f.non_spec_index:
            return Prov.IDX_NONSPEC
        if attr in f.spec_state:
            return Prov.STATE_SPEC
        if attr in f.non_spec_state:
            return Prov.STATE_NONSPEC
        return None

    def _slice_vals(self, element: cst.SubscriptElement, env: Env) -> Vals:
        s = element.slice
        if isinstance(s, cst.Index):
            return self.ev(s.value, env)
        assert isinstance(s, cst.Slice)
        parts = [self.ev(p, env) for p in (s.lower, s.upper, s.step) if p is not None]
        return self._combine(parts, join)

    def _select(self, base: Val, index: Prov) -> Prov:
        """Rows left after indexing ``base`` by a value of provenance ``index``."""
        if index in GATHERED:
            if base.prov is Prov.ALL:
                return GATHERED[index]
            if base.prov.is_rows:
                return Prov.CONFLICT  # a second selection: not the upstream shape
            return base.prov
        if index is Prov.IDX_ALL:
            return base.prov  # ``x[torch.arange(n)]``: every row, in order
        if index.is_rows or index is Prov.CONFLICT:
            # A per-token mask we cannot name: rows selected unknowably.
            return Prov.CONFLICT if base.prov.is_rows else base.prov
        return base.prov

    def _subscript(self, node: cst.Subscript, env: Env) -> Vals:
        base = self.ev(node.value, env)
        index = self._combine([self._slice_vals(e, env) for e in node.slice], join)
        result: set[Val] = set()
        for b in base:
            for i in index:
                a = consistent(b.assume, i.assume)
                if a is not None:
                    prov = self._select(b, i.prov)
                    result.add(Val(a, prov, b.defs | i.defs))
                    if i.prov in GATHERED and b.prov is Prov.ALL:
                        self.flow.gathers.append((node, i.prov))
                        self.flow.gathered_defs |= b.defs
        return self._cap(result)

    def _call(self, node: cst.Call, env: Env) -> Vals:
        func = node.func
        lam = func if isinstance(func, cst.Lambda) else None
        if isinstance(func, cst.Name):
            lam = self._local_lambda(func.value, env)
        elif not isinstance(func, (cst.Attribute, cst.Lambda)):
            # ``fns[i](...)``, ``make()(...)``: what picks the callee runs too.
            self.ev(func, env)
        arg_vals: list[tuple[str | None, cst.Arg, Vals]] = []
        for arg in node.args:
            kw = arg.keyword.value if arg.keyword is not None else None
            vals = self.ev(arg.value, env)
            if arg.star and isinstance(arg.value, cst.Name):
                vals = self._starred_members(arg.value.value, env) or vals
            arg_vals.append((kw, arg, vals))
            if isinstance(arg.value, cst.Name):
                handed = self._local_lambda(arg.value.value, env)
                if handed is not None:
                    self._inline_lambda(handed, env)
        starred = any(a.star for a in node.args)
        if lam is not None:
            # The call is recorded as any call is (a lambda handed the spec
            # slots is judged as a callee), and its body runs here.
            name = func.value if isinstance(func, cst.Name) else None
            self.flow.calls.append(CallRecord(node, name, self.path, arg_vals, starred, self.frame))
            return self._inline_lambda(lam, env, arg_vals)
        name = dotted(func)
        callee = self._resolve(name, env) if name else None
        record = CallRecord(node, callee, self.path, arg_vals, starred, self.frame)
        self.flow.calls.append(record)
        base, index = self._index_select_args(node)
        none_keeps_all = False
        if base is None and callee in self.row_gathers:
            base, index = _bind_row_gather(node)
            none_keeps_all = True
        if base is not None and index is not None:
            bvals, ivals = self.ev(base, env), self.ev(index, env)
            result: set[Val] = set()
            for b in bvals:
                for i in ivals:
                    a = consistent(b.assume, i.assume)
                    if a is not None:
                        prov = self._select(b, i.prov)
                        if none_keeps_all and i.prov is Prov.NULL:
                            pass  # index None: x itself
                        elif i.prov in (Prov.NONE, Prov.NULL) and b.prov.is_rows:
                            # Rows picked by an index of unknown origin (a
                            # helper's result, ``getattr(md, "...")``): which
                            # rows is unknown, not "all of them".
                            prov = Prov.CONFLICT
                        result.add(Val(a, prov, b.defs | i.defs))
                        if i.prov in GATHERED and b.prov is Prov.ALL:
                            self.flow.gathers.append((node, i.prov))
                            self.flow.gathered_defs |= b.defs
            return self._cap(result)
        if callee is not None and _is_arange(callee):
            # An identity index: ``x.index_select(0, torch.arange(n))`` keeps
            # every row (a prefix, read as the kernel reads its first rows).
            return frozenset({Val(NO_ASSUME, Prov.IDX_ALL)})
        followed = self._follow(record, func, name, callee, env)
        if followed is not None:
            return followed
        if isinstance(func, cst.Attribute):
            if func.attr.value in _META:
                self.ev(func.value, env)
                return frozenset({NONE_VAL})
            owner = self.ev(func.value, env)
            record.owner = owner
            if any(v.prov not in (Prov.NONE, Prov.NULL) for v in owner):
                # A method of a tensor (``x.contiguous()``, ``idx.to(...)``)
                # keeps the tensor's rows whatever its arguments.
                return owner
        parts = [vals for _, _, vals in arg_vals]
        return self._combine(parts, _opaque) if parts else frozenset({NONE_VAL})

    # -- following helpers -------------------------------------------------------

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
        bound = None if why else _bind_params(target, record)
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
                    if isinstance(arg.value, (cst.Name, cst.Attribute)) or _plain_test(arg.value)
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
        self._state = _FrameState(frame, dict(target.imports), target.scope)
        new_env: Env = {}
        try:
            for p, (vals, canon) in values.items():
                d = Def(len(self.flow.defs), p, target.func, None, param=True, frame=frame.id)
                d.canon = canon
                self.flow.defs.append(d)
                self._bump(p)
                new_env[p] = frozenset(Val(v.assume, v.prov, v.defs | {d.id}) for v in vals)
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
            except _Terminated:
                pass
            returns = self.state.returns
        finally:
            self._state, self._stmt, self._stmt_gathers = saved
        return self._cap(set(returns)) if returns else frozenset({NULL_VAL})

    # -- helpers ------------------------------------------------------------

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
        # and _opaque depend on nothing else), so equal ones merge.
        partial: set[tuple[Assume, frozenset[Prov], frozenset[int]]] = {
            (NO_ASSUME, frozenset(), frozenset())
        }
        for part in parts:
            step: set[tuple[Assume, frozenset[Prov], frozenset[int]]] = set()
            for assume, provs, defs in partial:
                for v in part:
                    a = consistent(assume, v.assume)
                    if a is not None:
                        step.add((a, provs | {v.prov}, defs | v.defs))
            if len(step) > _MAX_VALS:
                return frozenset({Val(NO_ASSUME, Prov.CONFLICT)})
            partial = step
        out = {Val(a, fn(provs), defs) for a, provs, defs in partial}
        return self._cap(out) if out else frozenset({NONE_VAL})

    @staticmethod
    def _cap(vals: set[Val]) -> Vals:
        if len(vals) > _MAX_VALS:
            return frozenset({Val(NO_ASSUME, Prov.CONFLICT)})
        return frozenset(vals)


def _opaque(provs: Iterable[Prov]) -> Prov:
    """The rows an unknown call returns: those of its row arguments; but rows
    handed in together with a gathering index come back selected we cannot
    say how (``my_gather(a, idx)``), never as all rows."""
    provs = list(provs)
    if any(p in GATHERED for p in provs) and any(p.is_rows for p in provs):
        return Prov.CONFLICT
    return join(provs)


def _bind_row_gather(
    call: cst.Call,
) -> tuple[cst.BaseExpression | None, cst.BaseExpression | None]:
    """``x`` and ``index`` of a row-gather call ``f(x, index)``."""
    if any(a.star for a in call.args):
        return None, None
    pos = [a.value for a in call.args if a.keyword is None]
    kw = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    x = pos[0] if pos else kw.get("x")
    index = pos[1] if len(pos) > 1 else kw.get("index")
    return x, index


def _is_arange(callee: str) -> bool:
    return callee in ("torch.arange", "numpy.arange")


def _none_test(test: cst.BaseExpression) -> tuple[cst.BaseExpression, bool] | None:
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


def _bind_params(
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


def _object_params(func: cst.FunctionDef) -> set[str]:
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


def _plain_test(node: cst.BaseExpression) -> bool:
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


def _is_container(node: cst.BaseExpression) -> bool:
    """A literal list, tuple, set or dict, or ``dict(...)``."""
    if isinstance(node, (cst.List, cst.Tuple, cst.Set, cst.Dict)):
        return True
    return isinstance(node, cst.Call) and dotted(node.func) == "dict"


def _sub_exprs(node: cst.CSTNode) -> list[cst.BaseExpression]:
    """The direct sub-expressions of an expression node (operands, elements)."""
    out: list[cst.BaseExpression] = []
    for child in node.children:
        if isinstance(child, cst.BaseExpression):
            out.append(child)
        elif isinstance(child, (cst.Element, cst.StarredElement)):
            out.append(child.value)
        elif isinstance(child, (cst.DictElement,)):
            out.extend([child.key, child.value])
        elif isinstance(child, cst.FormattedStringExpression):
            out.append(child.expression)
        elif isinstance(child, cst.ComparisonTarget):
            out.append(child.comparator)
        elif isinstance(child, cst.Arg):
            out.append(child.value)
    return out
