"""Path-sensitive row-provenance data flow over one function (libcst nodes).

The walker executes the function body abstractly: every local name maps to
the set of :class:`~gdn_backport.provenance.Val` it may hold. An ``if``
forks the environment and tags what each arm assigns with the arm's
condition, so a value set in the pure-spec fast path and a value set in the
mixed branch stay apart and are only ever combined with values from the same
arm (conditions are keyed by their normalised text and the versions of the
names they read, so a re-assigned name gives a new condition).

Nothing here knows about vLLM besides the names the patchset gives: which
attributes are spec/non-spec token indices and state slots. Every call is
recorded with the values of its arguments; :mod:`gdn_backport.analysis`
decides which calls are kernels and whether their rows line up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import libcst as cst

from gdn_backport.patchset import Fields
from gdn_backport.provenance import (
    GATHERED,
    INVERT,
    NO_ASSUME,
    NONE_VAL,
    Assume,
    Prov,
    Val,
    consistent,
    join,
)

Vals = frozenset[Val]
Env = dict[str, Vals]

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
_TENSOR_ATTRS = _META | frozenset(
    {
        "T", "mT", "view", "reshape", "contiguous", "to", "float", "half", "bfloat16",
        "transpose", "split", "chunk", "unsqueeze", "squeeze", "permute", "flatten",
        "clone", "narrow", "index_select", "copy_", "fill_", "zero_", "index_copy_",
        "new_empty", "new_zeros", "new_ones", "sum", "mean", "sigmoid", "exp", "neg",
        "softmax", "unflatten", "expand", "repeat", "masked_fill", "type_as", "cuda",
        "cpu", "detach", "view_as", "reshape_as", "movedim", "select", "gather", "type",
        "is_floating_point", "any", "all", "max", "min", "abs", "sqrt", "pow", "mul",
        "add", "sub", "div", "unbind", "roll", "flip", "argmax", "long", "int", "bool",
    }
)  # fmt: skip
# Above this many alternatives a value is no longer worth tracking precisely.
_MAX_VALS = 256
_EMPTY = cst.Module(body=[])


def code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


def dotted(node: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr.value}" if inner else None
    return None


@dataclass(frozen=True)
class IndexSelect:
    """The arguments of ``x.index_select(dim, index)`` / ``torch.index_select(x, dim, index)``."""

    base: cst.BaseExpression | None
    dim: cst.BaseExpression | None
    index: cst.BaseExpression | None
    torch_form: bool  # called as torch.index_select(x, ...)


def index_select_parts(
    call: cst.Call, torch_names: Sequence[str] = ("torch",)
) -> IndexSelect | None:
    """How an ``index_select`` call binds its arguments, None for other calls."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "index_select"):
        return None
    pos = [a.value for a in call.args if a.keyword is None and not a.star]
    kw = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    if dotted(func.value) in torch_names:
        return IndexSelect(
            pos[0] if pos else kw.get("input"),
            pos[1] if len(pos) > 1 else kw.get("dim"),
            pos[2] if len(pos) > 2 else kw.get("index"),
            True,
        )
    return IndexSelect(
        func.value,
        pos[0] if pos else kw.get("dim"),
        pos[1] if len(pos) > 1 else kw.get("index"),
        False,
    )


@dataclass
class Def:
    """One assignment of a local name."""

    id: int
    name: str
    stmt: cst.CSTNode  # the statement line holding the assignment
    value: cst.BaseExpression | None  # the expression assigned to this name
    gather: cst.BaseExpression | None = None  # the spec gather inside value
    alias_of: str | None = None  # ``k = some.kernel``: the callee it names
    param: bool = False  # a parameter of the function


@dataclass
class CallRecord:
    node: cst.Call
    callee: str | None  # dotted name as written, aliases resolved
    path: Assume  # branch conditions under which the call runs
    args: list[tuple[str | None, cst.Arg, Vals]]  # (keyword, arg, values)
    starred: bool  # passes *args/**kwargs: binding unknowable


@dataclass
class Flow:
    """What the walk learned about one function."""

    defs: list[Def] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    gathers: list[tuple[cst.BaseExpression, Prov]] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    # Definitions whose rows were gathered by some index somewhere: evidence
    # that a parameter really is a per-token tensor.
    gathered_defs: set[int] = field(default_factory=set)
    # Environment right after each simple statement line (keyed by id): the
    # rewriter checks that an inserted line sees the values the call sees.
    env_after: dict[int, Env] = field(default_factory=dict)


class _Terminated(Exception):
    """Raised inside a block after ``return``/``raise``: the path ends there."""


class FlowWalker:
    def __init__(self, fields: Fields, imports: dict[str, str]) -> None:
        self.fields = fields
        self.imports = imports  # local alias -> imported dotted name
        self.flow = Flow()
        self.version: dict[str, int] = {}
        self.path: Assume = NO_ASSUME
        self._stmt: cst.CSTNode | None = None
        self._loop = 0
        self._stmt_gathers = 0

    # -- entry -------------------------------------------------------------

    def run(self, func: cst.FunctionDef) -> Flow:
        env: Env = {}
        params = func.params
        objects = _object_params(func)
        for p in [*params.posonly_params, *params.params, *params.kwonly_params]:
            name = p.name.value
            self.flow.params.append(name)
            # A per-token tensor argument of the layer holds every row of the
            # step; ``self`` and other objects hold none.
            # A parameter named like a metadata field carries that field.
            prov = self._field(name) or (Prov.NONE if name in objects else Prov.ALL)
            val = self._define(name, None, func, prov)
            self.flow.defs[-1].param = True
            env[name] = frozenset({val})
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                env[star.name.value] = frozenset({NONE_VAL})
        with contextlib.suppress(_Terminated):
            self._block(func.body, env)
        return self.flow

    # -- definitions ------------------------------------------------------

    def _define(
        self,
        name: str,
        value: cst.BaseExpression | None,
        stmt: cst.CSTNode,
        prov: Prov,
    ) -> Val:
        d = Def(len(self.flow.defs), name, stmt, value)
        self.flow.defs.append(d)
        self.version[name] = self.version.get(name, 0) + 1
        return Val(NO_ASSUME, prov, frozenset({d.id}))

    def _assign_vals(
        self, env: Env, name: str, value: cst.BaseExpression | None, vals: Vals
    ) -> None:
        assert self._stmt is not None
        d = Def(len(self.flow.defs), name, self._stmt, value)
        if value is not None:
            d.gather = self._find_gather(value, env)
            callee = dotted(value)
            if callee is not None:
                d.alias_of = self._resolve(callee, env)
        self.flow.defs.append(d)
        self.version[name] = self.version.get(name, 0) + 1
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

    # -- statements -------------------------------------------------------

    def _block(self, body: cst.BaseSuite | Sequence[cst.CSTNode], env: Env) -> None:
        stmts: Sequence[cst.CSTNode]
        if isinstance(body, cst.IndentedBlock):
            stmts = body.body
        elif isinstance(body, cst.SimpleStatementSuite):
            stmts = [body]
        else:
            stmts = body  # type: ignore[assignment]
        for stmt in stmts:
            self._statement(stmt, env)

    def _statement(self, stmt: cst.CSTNode, env: Env) -> None:
        self._env = env
        # Gathers recorded from here on belong to this statement.
        self._stmt_gathers = len(self.flow.gathers)
        if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            self._stmt = stmt
            try:
                for small in stmt.body:
                    self._small(small, env)
            finally:
                self.flow.env_after[id(stmt)] = dict(env)
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
            vals = self.ev(small.value, env)
            for target in small.targets:
                self._bind_target(target.target, small.value, vals, env)
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
        elif isinstance(small, (cst.Return, cst.Raise)):
            value = small.value if isinstance(small, cst.Return) else small.exc
            if value is not None:
                self.ev(value, env)
            raise _Terminated
        elif isinstance(small, cst.Assert):
            self.ev(small.test, env)
        elif isinstance(small, (cst.Import, cst.ImportFrom)):
            self._local_import(small, env)

    def _local_import(self, node: cst.Import | cst.ImportFrom, env: Env) -> None:
        if isinstance(node.names, cst.ImportStar):
            return
        module = ""
        if isinstance(node, cst.ImportFrom) and node.module is not None:
            module = dotted(node.module) or ""
        for alias in node.names:
            full = dotted(alias.name) or ""
            asname = alias.asname.name if alias.asname is not None else None
            local = asname.value if isinstance(asname, cst.Name) else full.split(".")[0]
            self.imports[local] = f"{module}.{full}" if module else full
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
        key = self._cond_key(stmt.test)
        arms: list[tuple[bool, Env | None]] = []
        for truth, body in ((True, stmt.body), (False, stmt.orelse)):
            arm = dict(env)
            saved = self.path
            self.path = consistent(self.path, frozenset({(key, truth)})) or self.path
            try:
                if isinstance(body, cst.If):
                    self._if(body, arm)
                elif isinstance(body, cst.Else):
                    self._block(body.body, arm)
                elif body is not None:
                    self._block(body, arm)
                arms.append((truth, arm))
            except _Terminated:
                arms.append((truth, None))
            finally:
                self.path = saved
        self._merge(env, key, arms)

    def _merge(self, env: Env, key: str, arms: list[tuple[bool, Env | None]]) -> None:
        live = [(t, a) for t, a in arms if a is not None]
        if not live:
            raise _Terminated
        names = set(env).union(*(a for _, a in live))
        for name in names:
            sets = [a.get(name, frozenset()) for _, a in live]
            if all(s == sets[0] for s in sets):
                env[name] = sets[0]
                continue
            merged: set[Val] = set()
            for (truth, _), vals in zip(live, sets, strict=True):
                for v in vals:
                    a = consistent(v.assume, frozenset({(key, truth)}))
                    if a is not None:
                        merged.add(Val(a, v.prov, v.defs))
            env[name] = self._cap(merged)

    def _loop_stmt(self, stmt: cst.For | cst.While, env: Env) -> None:
        self._stmt = stmt
        self._loop += 1
        key = f"<loop {self._loop}>"
        body_env = dict(env)
        if isinstance(stmt, cst.For):
            vals = self.ev(stmt.iter, env)
            self._bind_target(stmt.target, stmt.iter, vals, body_env)
        else:
            self.ev(stmt.test, env)
        try:
            self._block(stmt.body, body_env)
            arms: list[tuple[bool, Env | None]] = [(True, body_env), (False, dict(env))]
        except _Terminated:
            arms = [(False, dict(env))]
        if stmt.orelse is not None:
            for _, arm in arms:
                if arm is not None:
                    self._block(stmt.orelse.body, arm)
        self._merge(env, key, arms)

    def _try(self, stmt: cst.Try, env: Env) -> None:
        self._stmt = stmt
        arms: list[tuple[bool, Env | None]] = []
        body = dict(env)
        try:
            self._block(stmt.body, body)
            if stmt.orelse is not None:
                self._block(stmt.orelse.body, body)
            arms.append((True, body))
        except _Terminated:
            arms.append((True, None))
        for i, handler in enumerate(stmt.handlers):
            arm = dict(env)
            try:
                self._block(handler.body, arm)
                arms.append((False, arm))
            except _Terminated:
                arms.append((False, None))
            del i
        self._loop += 1
        self._merge(env, f"<try {self._loop}>", arms)
        if stmt.finalbody is not None:
            self._block(stmt.finalbody.body, env)

    def _cond_key(self, test: cst.BaseExpression) -> str:
        names = sorted({n.value for n in _names_in(test)}, key=lambda n: n)
        versions = ",".join(f"{n}@{self.version.get(n, 0)}" for n in names)
        return "".join(code(test).split()) + "|" + versions

    # -- expressions ------------------------------------------------------

    def ev(self, node: cst.BaseExpression, env: Env) -> Vals:
        self._env = env
        if isinstance(node, cst.Name):
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
            key = self._cond_key(node.test)
            out: set[Val] = set()
            for truth, arm in ((True, node.body), (False, node.orelse)):
                for v in self.ev(arm, env):
                    a = consistent(v.assume, frozenset({(key, truth)}))
                    if a is not None:
                        out.add(Val(a, v.prov, v.defs))
            return self._cap(out)
        if isinstance(node, (cst.Lambda, cst.BaseString, cst.Integer, cst.Float)):
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
            for n in _names_in(comp.target):
                inner[n.value] = frozenset({NONE_VAL})
            for cond in comp.ifs:
                self.ev(cond.test, inner)
            comp = comp.inner_for_in
        parts.append(self.ev(elt, inner))
        self._env = env
        return self._combine(parts, join)

    def _attribute(self, node: cst.Attribute, env: Env) -> Vals:
        attr = node.attr.value
        base = self.ev(node.value, env)
        if attr in _META:
            return frozenset({NONE_VAL})
        field_prov = self._field(attr)
        if field_prov is not None:
            return frozenset(Val(v.assume, field_prov, v.defs) for v in base)
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
        if index.is_rows or index is Prov.CONFLICT:
            # A per-token mask we cannot name: rows selected unknowably.
            return Prov.CONFLICT if base.prov.is_rows else base.prov
        return base.prov

    def _subscript(self, node: cst.Subscript, env: Env) -> Vals:
        base = self.ev(node.value, env)
        index = self._combine([self._slice_vals(e, env) for e in node.slice], join)
        self._env = env
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
        arg_vals: list[tuple[str | None, cst.Arg, Vals]] = []
        for arg in node.args:
            kw = arg.keyword.value if arg.keyword is not None else None
            arg_vals.append((kw, arg, self.ev(arg.value, env)))
        self._env = env
        starred = any(a.star for a in node.args)
        name = dotted(func)
        callee = self._resolve(name, env) if name else None
        self.flow.calls.append(CallRecord(node, callee, self.path, arg_vals, starred))
        base, index = self._index_select_args(node)
        if base is not None and index is not None:
            bvals, ivals = self.ev(base, env), self.ev(index, env)
            self._env = env
            result: set[Val] = set()
            for b in bvals:
                for i in ivals:
                    a = consistent(b.assume, i.assume)
                    if a is not None:
                        prov = self._select(b, i.prov)
                        if i.prov is Prov.NONE and b.prov.is_rows:
                            # Rows picked by an index of unknown origin (a
                            # helper's result, ``getattr(md, "...")``): which
                            # rows is unknown, not "all of them".
                            prov = Prov.CONFLICT
                        result.add(Val(a, prov, b.defs | i.defs))
                        if i.prov in GATHERED and b.prov is Prov.ALL:
                            self.flow.gathers.append((node, i.prov))
                            self.flow.gathered_defs |= b.defs
            return self._cap(result)
        if isinstance(func, cst.Attribute):
            if func.attr.value in _META:
                self.ev(func.value, env)
                return frozenset({NONE_VAL})
            owner = self.ev(func.value, env)
            self._env = env
            if any(v.prov is not Prov.NONE for v in owner):
                # A method of a tensor (``x.contiguous()``, ``idx.to(...)``)
                # keeps the tensor's rows whatever its arguments.
                return owner
        parts = [vals for _, _, vals in arg_vals]
        return self._combine(parts, join) if parts else frozenset({NONE_VAL})

    # -- helpers ------------------------------------------------------------

    def _combine(self, parts: Sequence[Vals], fn: Callable[[Iterable[Prov]], Prov]) -> Vals:
        """All consistent combinations of one value from each part."""
        parts = [p for p in parts if p != frozenset({NONE_VAL})]
        if not parts:
            return frozenset({NONE_VAL})
        if len(parts) == 1:
            return parts[0]
        total = 1
        for p in parts:
            total *= len(p)
        if total > _MAX_VALS:
            return frozenset({Val(NO_ASSUME, Prov.CONFLICT)})
        out: set[Val] = set()
        for combo in itertools.product(*parts):
            a = consistent(*(v.assume for v in combo))
            if a is None:
                continue
            defs = frozenset().union(*(v.defs for v in combo))
            out.add(Val(a, fn(v.prov for v in combo), defs))
        return self._cap(out) if out else frozenset({NONE_VAL})

    @staticmethod
    def _cap(vals: set[Val]) -> Vals:
        if len(vals) > _MAX_VALS:
            return frozenset({Val(NO_ASSUME, Prov.CONFLICT)})
        return frozenset(vals)


_FIELDS: dict[type, tuple[str, ...]] = {}


def walk(node: cst.CSTNode, prune: type | tuple[type, ...] = ()) -> Iterator[cst.CSTNode]:
    """Every node below ``node`` (itself first), depth first, source order.

    Reads the dataclass fields directly: libcst's own visitor traversal
    rebuilds each node it passes, which made analysis several times slower.
    Nodes of a ``prune`` type are yielded but not entered.
    """
    stack: list[cst.CSTNode] = [node]
    while stack:
        current = stack.pop()
        yield current
        if prune and isinstance(current, prune):
            continue
        children = list(children_of(current))
        stack.extend(reversed(children))


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
            and node.attr.value not in _TENSOR_ATTRS
        ):
            objects.add(node.value.value)
    return objects


def _names_in(node: cst.CSTNode) -> list[cst.Name]:
    """Names read in ``node``: not an attribute's ``.attr``, not ``kw=`` keys."""
    nodes = list(walk(node))
    labels = {id(n.attr) for n in nodes if isinstance(n, cst.Attribute)}
    labels |= {id(n.keyword) for n in nodes if isinstance(n, cst.Arg) and n.keyword}
    return [n for n in nodes if isinstance(n, cst.Name) and id(n) not in labels]


# Fields that hold only layout (whitespace, comments, punctuation): about two
# thirds of a module's nodes, and nothing the analysis reads. Operators stay.
_LAYOUT_FIELDS = frozenset(
    {
        "newline", "first_line", "last_line", "empty_lines", "trailing_whitespace",
        "leading_lines", "lines_after_decorators", "header", "footer", "comment",
        "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace",
        "comma", "semicolon", "colon", "dot", "equal",
    }
)  # fmt: skip


def children_of(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """The node's children that carry code (layout-only fields skipped)."""
    kind = type(node)
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(
            f.name
            for f in dataclasses.fields(node)
            if f.name not in _LAYOUT_FIELDS and not f.name.startswith("whitespace")
        )
    for name in names:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, cst.CSTNode))


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
