"""Expressions: the row provenance of names, attributes, subscripts, calls
(row gathers among them), lambdas and comprehensions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import libcst as cst

from gdn_backport.cst_nodes import dotted, index_select_parts, names_in

from ..provenance import (
    GATHERED,
    INVERT,
    NO_ASSUME,
    NONE_VAL,
    NULL_VAL,
    Prov,
    Val,
    consistent,
    join,
)
from .model import META, NEVER, TENSOR_ATTRS, CallRecord, Env, Vals
from .row_order import (
    INDEX_ARITHMETIC,
    INDEX_KEEPS,
    NUMBERS,
    TOKEN_INDEX,
    index_changed,
    method_rows,
    overwritten,
    subscript_rows,
    trim,
    unnamed_pick,
)
from .state import WalkerState


class Expressions(WalkerState):
    """The values (row provenance) of an expression, recording every call."""

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
                return frozenset(
                    Val(v.assume, INVERT.get(v.prov, v.prov), v.defs, v.lead) for v in vals
                )
            return index_changed(vals) if isinstance(node.operator, cst.Minus) else vals
        if (
            isinstance(node, cst.BinaryOperation)
            and isinstance(node.operator, INDEX_ARITHMETIC)
            and isinstance(node.left, NUMBERS) != isinstance(node.right, NUMBERS)
        ):
            # ``idx + 1``, ``idx * 2`` select other rows than ``idx`` (rows in
            # arithmetic stay rows). A start plus a count (``spec_token_start
            # + m.num_spec_decode_tokens``) is the end of a range, not an index.
            sides = [
                index_changed(self.ev(node.left, env)),
                index_changed(self.ev(node.right, env)),
            ]
            return self._combine(sides, join)
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, INDEX_ARITHMETIC):
            sides = [self.ev(node.left, env), self.ev(node.right, env)]
            if any(v.prov in TOKEN_INDEX for vals in sides for v in vals):
                self.flow.shifts.append((node, self._canon(node, env)))
            return self._combine(sides, join)
        if isinstance(node, cst.IfExp):
            self.ev(node.test, env)
            out: set[Val] = set()
            for truth, arm in ((True, node.body), (False, node.orelse)):
                cond = self._atoms(node.test, truth, env)
                if cond is NEVER or consistent(self.path, cond) is None:
                    continue
                narrowed = dict(env)
                if self._narrow(node.test, truth, narrowed) is None:
                    continue
                for v in self.ev(arm, narrowed):
                    a = consistent(v.assume, cond)
                    if a is not None:
                        out.add(Val(a, v.prov, v.defs, v.lead))
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
        return self._combine([self.ev(c, env) for c in sub_exprs(node)], join)

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
                # An element carries the rows its container's values carry
                # (a tuple of tensors): bound to nothing, a gather inside
                # the comprehension was lost and its result read as clean.
                inner[n.value] = it
            for cond in comp.ifs:
                self.ev(cond.test, inner)
            comp = comp.inner_for_in
        parts.append(self.ev(elt, inner))
        return self._combine(parts, join)

    def _attribute(self, node: cst.Attribute, env: Env) -> Vals:
        attr = node.attr.value
        base = self.ev(node.value, env)
        if attr in META:
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

    def _select(self, base: Val, index: Prov, dim: int | None = 0) -> Prov:
        """Rows left after indexing ``base`` by a value of provenance ``index``
        along ``dim`` (None: a dimension the analysis cannot tell)."""
        if index in GATHERED and base.prov.is_rows and off_axis(base, dim):
            # Along another axis than the tokens' (``[T, H]`` by dim 1, or
            # ``[1, T, H]`` by dim 0): not a selection of token rows.
            return Prov.CONFLICT
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

    def _gather(
        self,
        node: cst.Subscript | cst.Call,
        bases: Vals,
        indexes: Vals,
        dim: int | None,
        *,
        drops_lead: bool = False,
        unknown_index: bool = False,
        none_keeps_all: bool = False,
    ) -> Vals:
        """The rows ``bases`` indexed by ``indexes`` along ``dim`` hold, the
        one rule of ``x[idx]``, ``x.index_select(d, idx)`` and the row
        gathers; each token gather of every row is noted on the flow.

        ``drops_lead``: ``x[0]``, which takes a ``[1, T, H]`` tensor's lead
        dim away. ``unknown_index``: a call's index of unknown origin (a
        helper's result, ``getattr(md, "...")``) picks rows nobody can name,
        never "all of them", where an unknown subscript (``x[0]``, ``x[:n]``)
        keeps them; ``none_keeps_all``: a row gather handed None returns
        ``x`` itself."""
        result: set[Val] = set()
        for b in bases:
            for i in indexes:
                a = consistent(b.assume, i.assume)
                if a is None:
                    continue
                prov = self._select(b, i.prov, dim)
                lead = b.lead
                if i.prov in GATHERED and b.prov.is_rows:
                    if off_axis(b, dim):
                        self.flow.off_axis.append((node, dim, b.lead))
                    elif lead is None:
                        lead = dim  # a token gather along dim d: the axis is d
                elif drops_lead and lead is not None and lead > 0:
                    lead -= 1
                if (
                    unknown_index
                    and i.prov in (Prov.NONE, Prov.NULL)
                    and b.prov.is_rows
                    and not (none_keeps_all and i.prov is Prov.NULL)
                ):
                    prov = Prov.CONFLICT
                result.add(Val(a, prov, b.defs | i.defs, lead))
                if i.prov in GATHERED and b.prov is Prov.ALL and prov in GATHERED.values():
                    self.flow.gathers.append((node, i.prov))
                    self.flow.gathered_defs |= b.defs
        return self._cap(result)

    def _subscript(self, node: cst.Subscript, env: Env) -> Vals:
        base = self.ev(node.value, env)
        elements = [self._slice_vals(e, env) for e in node.slice]
        index = self._combine(elements, join)
        # The dimension the index selects along: that of the one element
        # carrying an index (``g[:, spec_token_indx]``: dim 1); unknown past
        # an ``...`` or with several.
        carrying = [
            p for p, vals in enumerate(elements) if any(v.prov is not Prov.NONE for v in vals)
        ]
        ellipsis = any(
            isinstance(e.slice, cst.Index) and isinstance(e.slice.value, cst.Ellipsis)
            for e in node.slice
        )
        dim = carrying[0] if len(carrying) == 1 and not ellipsis else None
        if unnamed_pick(base, node.slice, elements):
            self.flow.unnamed_picks.append(node)
        if trim(node.slice) and any(v.prov.is_rows for v in base):
            bound = node.slice[0].slice
            assert isinstance(bound, cst.Slice) and bound.upper is not None
            self.flow.cuts.append((node, self._canon(bound.upper, env)))
        base = subscript_rows(base, node.slice)
        # ``x[0]`` of a ``[1, T, H]`` tensor: its ``[T, H]``.
        first = node.slice[0].slice if len(node.slice) == 1 else None
        drops_lead = (
            isinstance(first, cst.Index)
            and isinstance(first.value, cst.Integer)
            and first.value.value == "0"
        )
        return self._gather(node, base, index, dim, drops_lead=drops_lead)

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
        base, index, dim = self._index_select_args(node)
        none_keeps_all = False
        if base is None and callee in self.row_gathers:
            base, index = bind_row_gather(node)
            dim, none_keeps_all = 0, True
        if base is not None and index is not None:
            bvals, ivals = self.ev(base, env), self.ev(index, env)
            return self._gather(
                node, bvals, ivals, dim, unknown_index=True, none_keeps_all=none_keeps_all
            )
        if callee is not None and is_arange(callee):
            # An identity index: ``x.index_select(0, torch.arange(n))`` keeps
            # every row (a prefix, read as the kernel reads its first rows).
            if node.args:
                count = node.args[0].value if len(node.args) == 1 else node
                self.flow.cuts.append((node, self._canon(count, env)))
            return frozenset({Val(NO_ASSUME, Prov.IDX_ALL)})
        followed = self._follow(record, func, name, callee, env)
        if followed is not None:
            return followed
        if isinstance(func, cst.Attribute):
            if func.attr.value in META:
                self.ev(func.value, env)
                return frozenset({NONE_VAL})
            owner = self.ev(func.value, env)
            record.owner = owner
            if any(v.prov not in (Prov.NONE, Prov.NULL) for v in owner):
                # A method of a tensor (``x.contiguous()``, ``idx.to(...)``)
                # keeps the tensor's rows, but where it reorders, mixes or
                # drops them (:mod:`.row_order`), and their token axis but
                # where it adds or drops a dimension before it.
                method = func.attr.value
                if method.endswith("_") and isinstance(func.value, cst.Name):
                    # ``x.copy_(v)``, ``idx.add_(1)``: ``x`` itself now holds what was written.
                    name = func.value.value
                    if name in env:
                        env[name] = overwritten(env[name], [vals for _, _, vals in arg_vals])
                return relayout(method_rows(owner, method, list(node.args)), method, node)
        parts = [vals for _, _, vals in arg_vals]
        if callee is not None and callee.startswith("torch.") and parts and not starred:
            # ``torch.flip(x, [0])`` as ``x.flip([0])``; ``torch.zeros_like(idx)``
            # is no longer the index.
            short = callee.rsplit(".", 1)[-1]
            first = method_rows(parts[0], short, list(node.args[1:]))
            kept = short in INDEX_KEEPS
            parts = [first, *(p if kept else index_changed(p) for p in parts[1:])]
        out = self._combine(parts, opaque) if parts else frozenset({NONE_VAL})
        if callee is not None and callee.rsplit(".", 1)[-1] in self.leading_one:
            # ``g, beta = fused_gdn_gating(...)``: ``[1, T, H]`` each.
            out = frozenset(Val(v.assume, v.prov, v.defs, 1) if v.prov.is_rows else v for v in out)
        return out

    def _index_select_args(
        self, call: cst.Call
    ) -> tuple[cst.BaseExpression | None, cst.BaseExpression | None, int | None]:
        """``x``, ``index`` and ``dim`` (None: not a literal) of ``index_select``."""
        parts = index_select_parts(call, ("torch", *self._torch_aliases()))
        if parts is None:
            return None, None, None
        return parts.base, parts.index, literal_dim(parts.dim)

    def _torch_aliases(self) -> list[str]:
        return [k for k, v in self.imports.items() if v == "torch"]


def off_axis(base: Val, dim: int | None) -> bool:
    """A token index applied along ``dim`` of ``base`` misses its token axis:
    known to be elsewhere. Where the axis is unknown (an entry's parameter,
    an unknown function's result) the gather itself says where it is."""
    return base.lead is not None and dim != base.lead


def literal_dim(node: cst.BaseExpression | None) -> int | None:
    """A dimension written as a non-negative integer literal, else None."""
    if isinstance(node, cst.Integer):
        return int(node.value, 0)
    return None


def relayout(vals: Vals, method: str, call: cst.Call) -> Vals:
    """The token axis of ``x.method(...)``'s rows: ``unsqueeze(d)`` with ``d``
    at or before the axis moves it one on, ``squeeze(d)`` before it one back,
    ``squeeze()`` to dim 0 (a ``[1, T, H]`` tensor's ``[T, H]``); any other
    method keeps it (a view, a copy, a cast)."""
    if method not in ("unsqueeze", "squeeze", "unsqueeze_", "squeeze_"):
        return vals
    args = [a.value for a in call.args if not a.star]
    dim = literal_dim(args[0]) if args else None
    out = set()
    for v in vals:
        lead = v.lead
        if lead is None:
            out.add(v)  # unknown stays unknown
            continue
        if method.startswith("unsqueeze"):
            if dim is None:
                v = Val(v.assume, Prov.CONFLICT if v.prov.is_rows else v.prov, v.defs, lead)
            elif dim <= lead:
                lead += 1
        elif not args:
            lead = 0
        elif dim is None:
            v = Val(v.assume, Prov.CONFLICT if v.prov.is_rows else v.prov, v.defs, lead)
        elif dim < lead:
            lead -= 1
        out.add(Val(v.assume, v.prov, v.defs, lead))
    return frozenset(out)


def opaque(provs: Iterable[Prov]) -> Prov:
    """The rows an unknown call returns: those of its row arguments; but rows
    handed in together with a gathering index come back selected we cannot
    say how (``my_gather(a, idx)``), never as all rows."""
    provs = list(provs)
    if any(p in GATHERED for p in provs) and any(p.is_rows for p in provs):
        return Prov.CONFLICT
    return join(provs)


def bind_row_gather(
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


def is_arange(callee: str) -> bool:
    return callee in ("torch.arange", "numpy.arange")


def is_container(node: cst.BaseExpression) -> bool:
    """A literal list, tuple, set or dict, or ``dict(...)``."""
    if isinstance(node, (cst.List, cst.Tuple, cst.Set, cst.Dict)):
        return True
    return isinstance(node, cst.Call) and dotted(node.func) == "dict"


def sub_exprs(node: cst.CSTNode) -> list[cst.BaseExpression]:
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
