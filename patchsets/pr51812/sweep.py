"""Every call handed the spec token index or state slots, found by syntax alone.

The net under the data-flow analysis, trusting none of it. Over every scope
of a module (module level code, class bodies, functions, methods, nested
functions, lambdas) it taints, with ``ast`` and to a fixpoint per scope:

* a read of a spec index or spec state field of the patchset
  (``md.spec_state_indices_tensor``, ``getattr(md, "spec_token_indx")``,
  ``md["..."]``, ``md.get("...")``), and a parameter named like one (forks
  pass the index in);
* every name bound from an expression that holds a tainted value, by any
  statement (assignment, augmented, walrus, ``for`` and ``with`` targets,
  tuple unpacking, comprehensions); a container filled with one
  (``kw.update(...)``, ``kw[k] = ...``, ``xs.append(...)``); a lambda or a
  nested ``def`` that closes over one; an attribute one is stored in
  (``self._slots = ...``), wherever the module reads it back;

and reports each call that receives a tainted value at any depth of its
arguments (``**dict(...)``, ``**{...}``, ``*(...)``, a filled kwargs dict,
a nested call, a closure) or through its callee (a ``functools.partial``
that bound one, a tainted receiver). A callee that is a kernel of the
patchset under any name (import aliases, ``k = kernel``, ``k = mod.kernel``,
``getattr(mod, "kernel")``, ``functools.partial(kernel, ...)``, a dispatch
table ``KERNELS["spec"]``, a conditional expression, ``self._k = kernel``)
is always reported; other calls are left out only where they demonstrably
select rows or plumb metadata: the patchset's ``[benign]`` and
``[row_gather]`` names and its ``[sweep]`` lists (the data says which, this
module how).

What a call's result holds: a row selection or a benign kernel hands back
rows (tainted only if what it selects from is), a metadata read
(``.size()``, ``len()``, ``torch.arange``) nothing, plumbing (``.to()``,
``dict(...)``, ``partial(...)``) what it was handed, a kernel its outputs
(nothing). An unknown call hands back something *derived*: it may be the
kwargs a helper built, or a tensor it computed; a call receives it where it
is passed on in place (``k(**make(slots))``, ``k(x=pick(slots))``) or
unpacked (``k(**built)``), not where a local of it is an argument (the call
that made it is reported itself); a kernel's partial bound to one is run on it.

The sweep is flow-insensitive: a name is tainted wherever any of its
assignments is. Where the analysis traced such a plain name to other values
on every path (``slots`` reassigned the non-spec slots in another branch),
the caller takes the analysis's word: :attr:`Reach.plain` says which
arguments those are.

A kernel's own wrapper (a function named like the kernel) is the kernel:
its body is not swept, its callers are. Nothing here knows the bug: the
caller (:mod:`gdn_backport.sites`) checks every call found against what the
analysis accounted for.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from gdn_backport.cst_nodes import Span, ast_children, ast_fields, ast_walk, span

from .config import Patchset

MODULE = "<module>"
# Python's own containers and partial application: they hold what they are
# handed (``partial`` is matched by its short name, as ``functools.partial``).
_CONTAINERS = frozenset({"dict", "list", "tuple", "set", "frozenset", "partial"})
# Methods that put a value into the container they are called on.
_FILLS = frozenset({"update", "setdefault", "append", "extend", "insert", "__setitem__"})
# Methods that read a key of a mapping: ``md.get("spec_token_indx")`` reads the field.
_KEY_READS = frozenset({"get", "pop"})
# Modules whose functions take the tensor first: ``torch.index_select(x, ...)``.
_TENSOR_MODULES = frozenset({"torch", "F", "np"})
# A shape longer than this is cut: the message names the call and the field.
_SHAPE_MAX = 160

# How strongly a value holds the index or the slots.
_IS = 0  # it is the value, or a container or closure holding it
_DERIVED = 1  # the result of an unknown call handed it, in place
_DERIVED_LOCAL = 2  # such a result, read back from a local


@dataclass(frozen=True)
class Vocabulary:
    """What the sweep looks for and what it leaves out, from the patchset."""

    fields: frozenset[str]  # the spec token index and spec state slot fields
    kernels: frozenset[str]  # the kernels' short names (declared ones too)
    rows: frozenset[str]  # row selections and benign kernels: hand back rows
    plumbing: frozenset[str]  # move or view a value: hand back what they got
    metadata: frozenset[str]  # read a shape or a flag: hand back nothing

    @classmethod
    def of(cls, patchset: Patchset) -> Vocabulary:
        f = patchset.fields
        s = patchset.sweep
        gathers = {name.rsplit(".", 1)[-1] for name in patchset.row_gathers}
        return cls(
            fields=frozenset({*f.spec_index, *f.spec_state}),
            kernels=frozenset(k.short for k in patchset.kernels.values()),
            rows=frozenset({*patchset.benign, *gathers, *s.row_selection}),
            plumbing=s.plumbing,
            metadata=s.metadata,
        )

    def quiet(self, short: str | None) -> bool:
        """A callee of this short name is never reported (unless a kernel)."""
        return short is not None and (
            short in self.rows
            or short in self.plumbing
            or short in self.metadata
            or short in _CONTAINERS
            or short in _FILLS
            or short in _KEY_READS
        )


# An argument of a call: (its keyword, or None and its position from 0).
Argument = tuple[str | None, int]


@dataclass(frozen=True)
class Reach:
    """A call that receives the spec token index or state slots."""

    module: str  # the module's key (its tree-relative path)
    line: int
    col: int  # ``ast``'s column: UTF-8 bytes from the line's start, from 0
    end_line: int
    end_col: int
    function: str  # the enclosing ``def``'s qualname; ``<module>`` outside any
    occurrence: int  # how many earlier functions of the module share that qualname
    def_line: int  # that function's ``def`` line (the call's own line at module level)
    callee: str  # as written
    field: str  # the metadata field that reaches it
    source: str  # where the field is read: ``attn_metadata.spec_state_indices_tensor``
    shape: str  # through what: ``**dict(...) holding spec_state_indices_tensor``
    kernel: str | None  # the kernel of the patchset the callee is, under whatever name
    # When every argument that hands it the value is a plain name holding the
    # index or the slots themselves (``slots=slots``): those arguments, by
    # keyword or position. A flow-insensitive sweep cannot tell which of a
    # name's assignments reaches the call; the analysis can.
    plain: tuple[Argument, ...] | None = None

    @property
    def position(self) -> tuple[str, int, int, int, int]:
        """The module and the call's span: ``f(x)(y)`` and ``f(x)`` start alike."""
        return (self.module, self.line, self.col, self.end_line, self.end_col)

    @property
    def key(self) -> tuple[str, str, int]:
        """The function's key, as :mod:`gdn_backport.resolve` names functions."""
        return (self.module, self.function, self.occurrence)


@dataclass(frozen=True)
class _Taint:
    field: str  # the field it holds
    source: str  # where that field was read
    shape: str  # how it got here, in words
    level: int = _IS
    # The index or the slots themselves (a field read, a copy, a view), not
    # a container, a closure or a call's result holding them.
    direct: bool = True

    def via(self, shape: str, level: int | None = None, direct: bool | None = None) -> _Taint:
        if len(shape) > _SHAPE_MAX:
            shape = shape[: _SHAPE_MAX - 3] + "..."
        return _Taint(
            self.field,
            self.source,
            shape,
            self.level if level is None else level,
            self.direct if direct is None else direct,
        )


@dataclass
class _Scope:
    """One scope's names: what they hold, which name a kernel, which are closures."""

    taint: dict[str, _Taint] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)  # name -> the kernel it names
    closures: set[str] = field(default_factory=set)  # names bound to a lambda or a def
    lambdas: dict[str, ast.Lambda] = field(default_factory=dict)  # names bound to a lambda

    def inner(self, shadowed: Iterable[str]) -> _Scope:
        """A nested scope's start: the names it closes over, minus its own."""
        names = set(shadowed)
        return _Scope(
            {k: v for k, v in self.taint.items() if k not in names},
            {k: v for k, v in self.kernels.items() if k not in names},
            self.closures - names,
            {k: v for k, v in self.lambdas.items() if k not in names},
        )

    def lambda_called(self, call: ast.Call) -> ast.Lambda | None:
        """The lambda a call runs, if it is one of this scope's (or in place)."""
        func = call.func
        if isinstance(func, ast.Lambda):
            return func
        return self.lambdas.get(func.id) if isinstance(func, ast.Name) else None


_Func = ast.FunctionDef | ast.AsyncFunctionDef
# One binding of a scope: the names, what they are bound from, and how
# ("assign", "for", "with", "fill", "lambda", "def"; "store": an attribute).
_Bind = tuple[list[str], ast.AST, str]


class _Module:
    """One module being swept."""

    def __init__(self, key: str, tree: ast.Module, text: str, vocab: Vocabulary) -> None:
        self.key = key
        self.vocab = vocab
        self.lines = text.splitlines()
        self.found: dict[Span, Reach] = {}
        self.occurrences: dict[str, int] = {}
        self.nodes: dict[int, list[ast.AST]] = {}  # the nodes of a closure, walked once
        # Attributes a function of the module stores the index or the slots in.
        self.stored: dict[str, _Taint] = {}
        # The calls of each function swept (its lambdas' too), by (qualname, occurrence).
        self.calls: dict[tuple[str, int], list[ast.Call]] = {}
        # A local name an import binds to a kernel (``import ... as k``, in
        # any scope), and ``self._spec = kernel`` anywhere in the module
        # (``x._spec(...)`` may run it): read from the text around each
        # mention of a kernel, cheaper than walking every function.
        self.imported: dict[str, str] = {}
        self.attrs: dict[str, str] = {}
        for name, _, end in _mentions(text, vocab.kernels):
            alias = _ALIAS.match(text, end)
            if alias is not None:
                self.imported[alias[1]] = name
        for name, start, _ in _mentions(text, {*vocab.kernels, *self.imported}):
            line = text.rfind("\n", 0, start) + 1
            bound = _ATTR_BIND.match(text, line, start)
            if bound is not None:
                self.attrs[bound["attr"]] = self.imported.get(name, name)

    # -- what an expression is -------------------------------------------------

    def kernel_of(self, node: ast.expr, scope: _Scope) -> str | None:
        """The kernel ``node`` names, if any, under any name or shape."""
        if isinstance(node, ast.Name):
            if node.id in scope.kernels:
                return scope.kernels[node.id]
            if node.id in self.vocab.kernels:
                return node.id
            return self.imported.get(node.id)
        if isinstance(node, ast.Attribute):
            if node.attr in self.vocab.kernels:
                return node.attr
            return self.attrs.get(node.attr)
        if isinstance(node, ast.Call):
            short = _short(node.func)
            if short == "getattr" and len(node.args) >= 2:
                name = _str(node.args[1])
                return name if name in self.vocab.kernels else None
            if short == "partial" and node.args:
                return self.kernel_of(node.args[0], scope)
            lam = scope.lambda_called(node)
            if lam is not None:  # ``make()`` where make = lambda: <a kernel>
                return self.kernel_of(lam.body, scope.inner(_params(lam.args)))
            return None
        if isinstance(node, ast.IfExp):
            return self.kernel_of(node.body, scope) or self.kernel_of(node.orelse, scope)
        if isinstance(node, ast.Lambda):
            # ``lambda *a, **kw: kernel(*a, **kw)``: a lambda that calls a
            # kernel is that kernel, to whoever calls the lambda.
            inner = scope.inner(_params(node.args))
            calls = (n for n in ast_walk(node.body) if isinstance(n, ast.Call))
            return next((k for c in calls if (k := self.kernel_of(c.func, inner))), None)
        if isinstance(node, ast.Subscript | ast.NamedExpr | ast.Starred):
            return self.kernel_of(node.value, scope)
        if isinstance(node, ast.Dict):
            return next((k for v in node.values if (k := self.kernel_of(v, scope))), None)
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return next((k for v in node.elts if (k := self.kernel_of(v, scope))), None)
        return None

    def reach(self, node: ast.expr, scope: _Scope) -> _Taint | None:
        """The tainted value ``node`` holds, and through what, if any."""
        fields = self.vocab.fields
        if isinstance(node, ast.Name):
            t = scope.taint.get(node.id)
            if t is None:
                return None
            return t.via(t.shape, _DERIVED_LOCAL if t.level != _IS else _IS)
        if isinstance(node, ast.Attribute):
            if node.attr in fields:
                text = _written(node)
                return _Taint(node.attr, text, text)
            if node.attr in self.vocab.metadata:
                return None
            stored = self.stored.get(node.attr)
            return stored if stored is not None else self.reach(node.value, scope)
        if isinstance(node, ast.Subscript):
            key = _str(node.slice)
            if key in fields:
                assert key is not None
                text = f"{_written(node.value)}[{key!r}]"
                return _Taint(key, text, text)
            # ``x[idx]`` picks rows of x: only what x holds comes back.
            return self.reach(node.value, scope)
        if isinstance(node, ast.Call):
            return self._result(node, scope)
        if isinstance(node, ast.Constant | ast.JoinedStr):
            return None
        if isinstance(node, ast.Compare) and all(
            isinstance(op, ast.Is | ast.IsNot) for op in node.ops
        ):
            return None  # ``x is None``: a flag, not the value
        if isinstance(node, ast.Lambda):
            return self._closure(node, scope)
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                t = self.reach(v, scope)
                if t is not None:
                    return t.via(f"{{{'**' if k is None else '...: '}{t.shape}}}", direct=False)
            return None
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            for e in node.elts:
                t = self.reach(e, scope)
                if t is not None:
                    open_, close = _DISPLAY[type(node)]
                    return t.via(f"{open_}{t.shape}{close}", direct=False)
            return None
        if isinstance(node, ast.Starred):
            t = self.reach(node.value, scope)
            return None if t is None else t.via(f"*{t.shape}", direct=False)
        if isinstance(node, ast.IfExp):
            return self.reach(node.body, scope) or self.reach(node.orelse, scope)
        for child in ast_children(node):
            if isinstance(child, ast.comprehension):
                child = child.iter
            if isinstance(child, ast.expr):
                t = self.reach(child, scope)
                if t is not None:
                    return t
        return None

    def _result(self, node: ast.Call, scope: _Scope) -> _Taint | None:
        """What a call's result holds (the module's docstring says which)."""
        vocab = self.vocab
        func = node.func
        short = _short(func)
        read = None
        if short == "getattr" and len(node.args) >= 2:
            read = _str(node.args[1])
        elif short in _KEY_READS and isinstance(func, ast.Attribute) and node.args:
            read = _str(node.args[0])
        if read is not None and read in vocab.fields:
            text = _written(node)
            return _Taint(read, text, text)
        if self.kernel_of(func, scope) is not None:
            return None  # a kernel hands back its outputs
        lam = scope.lambda_called(node)
        if lam is not None:  # a local lambda hands back what its body holds
            return self.reach(lam.body, scope.inner(_params(lam.args)))
        if short in vocab.metadata:
            return None
        if short in vocab.rows:
            if isinstance(func, ast.Attribute) and not (
                isinstance(func.value, ast.Name) and func.value.id in _TENSOR_MODULES
            ):
                return self.reach(func.value, scope)
            return self.reach(node.args[0], scope) if node.args else None
        if short in vocab.plumbing or short in _FILLS or short in _KEY_READS:
            # What it moves: its receiver (``x.to(dev)``), else its arguments.
            if isinstance(func, ast.Attribute):
                t = self.reach(func.value, scope)
                if t is not None:
                    return t
            return self._handed(node, scope, every=True)
        t = self._handed(node, scope, every=True)
        if t is None:
            return None
        name = _written(func)
        if short in _CONTAINERS:
            return t.via(f"{name}({t.shape})", direct=False)
        return t.via(f"{name}(...) handed {t.shape}", _DERIVED, direct=False)

    def _handed(self, node: ast.Call, scope: _Scope, every: bool) -> _Taint | None:
        """The first tainted value a call is handed (:meth:`_arguments`)."""
        return next((t for _, t, _ in self._arguments(node, scope, every)), None)

    def _arguments(
        self, node: ast.Call, scope: _Scope, every: bool
    ) -> Iterator[tuple[Argument, _Taint, bool]]:
        """The tainted values a call is handed, by an argument or its callee:
        (which argument, the value, whether it is a plain name holding the
        index or the slots themselves). ``every``: any tainted value (what its
        result may hold), else those the call receives (the module's docstring)."""
        for i, arg in enumerate(node.args):
            t = self.reach(arg, scope)
            star = isinstance(arg, ast.Starred)
            if t is not None and (every or t.level != _DERIVED_LOCAL or star):
                yield (None, -1 if star else i), t, not star and _plain(arg, t)
        for kw in node.keywords:
            t = self.reach(kw.value, scope)
            if t is not None and (every or t.level != _DERIVED_LOCAL or kw.arg is None):
                label = f"**{t.shape}" if kw.arg is None else f"{kw.arg}={t.shape}"
                plain = kw.arg is not None and _plain(kw.value, t)
                yield ("**" if kw.arg is None else kw.arg, -1), t.via(label), plain
        func = node.func
        if isinstance(func, ast.Lambda) or (
            isinstance(func, ast.Name) and func.id in scope.closures
        ):
            return  # a local lambda or def: its body's calls are swept themselves
        t = self.reach(func, scope)
        # A kernel bound to anything made of the index or the slots
        # (``partial(kernel, **make(slots))``) runs on it, however made.
        if t is not None and (every or t.level == _IS or self.kernel_of(func, scope)):
            what = "receiver" if isinstance(func, ast.Attribute) else "callee"
            yield ("<callee>", -1), t.via(f"its {what} {t.shape}"), False

    def _closure(self, node: _Func | ast.Lambda, scope: _Scope) -> _Taint | None:
        """What a lambda or a nested ``def`` closes over: a tainted name of the
        scope around it, or a field read on one of its names (what it reads
        of its own parameters and locals is swept in its own scope)."""
        nodes = self.nodes.get(id(node))
        if nodes is None:
            nodes = self.nodes[id(node)] = list(ast_walk(node))
        own = set(_params(node.args))
        own |= {n.id for n in nodes if isinstance(n, ast.Name) and _stores(n)}
        for n in nodes:
            t: _Taint | None = None
            if isinstance(n, ast.Name) and n.id not in own and not _stores(n):
                t = scope.taint.get(n.id)
            elif isinstance(n, ast.Attribute) and n.attr in self.vocab.fields:
                root = _root(n)
                if root is not None and root not in own:
                    text = _written(n)
                    t = _Taint(n.attr, text, text)
            if t is not None:
                what = "a lambda" if isinstance(node, ast.Lambda) else f"def {node.name}"
                return t.via(f"{what} closing over {t.shape}", direct=False)
        return None

    # -- scopes ----------------------------------------------------------------

    def scope(
        self,
        body: list[ast.stmt] | list[ast.expr],
        scope: _Scope,
        owner: tuple[str, int, int],
        prefix: str,
        cls: bool = False,
    ) -> None:
        """Sweep one scope: bind its names to a fixpoint, judge its calls
        (``owner``: the function they belong to, its occurrence and def line),
        then the scopes nested in it, with what they close over. ``cls``: a
        class body."""
        binds: list[_Bind] = []
        calls: list[ast.Call] = []
        nested: list[ast.AST] = []
        _collect(body, binds, calls, nested)
        inherited = set(scope.kernels)
        self._bind_all(binds, scope, owner[0] == MODULE)
        if cls:
            # What a class body binds to a kernel, its methods reach as ``self.NAME``.
            self.attrs.update({k: v for k, v in scope.kernels.items() if k not in inherited})
        self.calls.setdefault(owner[:2], []).extend(calls)
        for call in calls:
            self._judge(call, scope, owner)
        for node in nested:
            if isinstance(node, ast.Lambda):
                self.scope([node.body], self._enter(node.args, scope), owner, prefix)
            elif isinstance(node, ast.ClassDef):
                # Its body runs with this scope's names.
                self.scope(node.body, scope.inner(()), owner, f"{prefix}{node.name}.", True)
            elif isinstance(node, _Func):
                self._function(node, scope, prefix)

    def _bind_all(self, binds: list[_Bind], scope: _Scope, top: bool) -> None:
        """Bind a scope's names to a fixpoint: every bind once in source
        order, then again only those that read a name bound since."""
        # A def of the module or a class closes over no local: what it reads
        # of the module's names is swept in it.
        binds.sort(key=lambda b: (getattr(b[1], "lineno", 0), getattr(b[1], "col_offset", 0)))
        readers: dict[str, list[int]] | None = None
        todo = list(range(len(binds)))
        while todo:
            bound: set[str] = set()
            for i in todo:
                targets, value, how = binds[i]
                kernel = None
                if how in ("assign", "lambda") and isinstance(value, ast.expr):
                    kernel = self.kernel_of(value, scope)
                t = None if top and how == "def" else self._bound(value, how, scope)
                if how == "store":
                    # ``self._slots = md.spec_state_indices_tensor``: what
                    # another function reads back as ``self._slots``.
                    for attr in targets:
                        new = attr not in self.stored and attr not in self.vocab.fields
                        if t is not None and t.level == _IS and new:
                            self.stored[attr] = t.via(f"the attribute .{attr} = {t.shape}")
                    continue
                for name in targets:
                    if how in ("def", "lambda"):
                        scope.closures.add(name)
                    if isinstance(value, ast.Lambda):
                        scope.lambdas[name] = value
                    if kernel is not None and name not in scope.kernels:
                        scope.kernels[name] = kernel
                        bound.add(name)
                    if t is not None and name not in scope.taint:
                        # What a loop or a context manager hands its target
                        # is the value, whoever made it.
                        level = _IS if how in ("for", "with") else None
                        direct = t.direct and how != "fill"
                        scope.taint[name] = t.via(_named(name, how, t), level, direct)
                        bound.add(name)
            if not bound:
                return
            if readers is None:
                readers = {}
                for i, (_, value, _) in enumerate(binds):
                    for name in self._reads(value):
                        readers.setdefault(name, []).append(i)
            todo = sorted({i for name in bound for i in readers.get(name, ())})

    def _reads(self, node: ast.AST) -> set[str]:
        """The names an expression (or a def) reads."""
        if isinstance(node, _Func):
            nodes = self.nodes.get(id(node))
            if nodes is None:
                nodes = self.nodes[id(node)] = list(ast_walk(node))
            return {n.id for n in nodes if isinstance(n, ast.Name)}
        out = set()
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Name):
                out.add(n.id)
            else:
                stack.extend(ast_children(n))
        return out

    def _function(self, node: _Func, outer: _Scope, prefix: str) -> None:
        qual = f"{prefix}{node.name}"
        occurrence = self.occurrences.get(qual, 0)
        self.occurrences[qual] = occurrence + 1
        text = "\n".join(self.lines[node.lineno - 1 : node.end_lineno or node.lineno])
        skip = node.name in self.vocab.kernels  # the kernel's own wrapper
        # Whether its scope (:meth:`_enter`) would hold a tainted name, without
        # making it: copying the outer scope for each of a module's thousands
        # of functions made a huge module quadratic (issue 24 D14).
        params = _params(node.args)
        names = set(params)
        tainted = any(p in self.vocab.fields for p in params) or any(
            k not in names for k in outer.taint
        )
        if skip or not (
            tainted
            or any(f in text for f in self.vocab.fields)
            or any(f".{attr}" in text for attr in self.stored)
        ):
            # Nothing here can hold the index or the slots; its nested
            # functions still count for the occurrences of their names.
            nested = text.count("def ") > 1 or "class " in text
            for func, path in _functions_deep(node.body) if nested else ():
                inner = f"{qual}.{path}{func.name}"
                self.occurrences[inner] = self.occurrences.get(inner, 0) + 1
            return
        scope = self._enter(node.args, outer)
        self.scope(node.body, scope, (qual, occurrence, node.lineno), f"{qual}.")

    def _enter(self, args: ast.arguments, outer: _Scope) -> _Scope:
        """The scope of a function or a lambda: what it closes over, and its
        parameters named like a field (forks pass the index in)."""
        params = _params(args)
        scope = outer.inner(params)
        for p in params:
            if p in self.vocab.fields:
                scope.taint[p] = _Taint(p, f"parameter {p}", p)
        return scope

    def _bound(self, value: ast.AST, how: str, scope: _Scope) -> _Taint | None:
        if isinstance(value, _Func):
            return self._closure(value, scope)
        assert isinstance(value, ast.expr)
        return self.reach(value, scope)

    def _judge(self, call: ast.Call, scope: _Scope, owner: tuple[str, int, int]) -> None:
        kernel = self.kernel_of(call.func, scope)
        if kernel is None and self.vocab.quiet(_short(call.func)):
            return
        handed = list(self._arguments(call, scope, every=False))
        where = span(call)
        if not handed or where in self.found:
            return
        _, t, _ = handed[0]
        plain = tuple(label for label, _, p in handed) if all(p for _, _, p in handed) else None
        qual, occurrence, def_line = owner
        self.found[where] = Reach(
            self.key,
            *where,
            qual,
            occurrence,
            def_line or call.lineno,
            _written(call.func),
            t.field,
            t.source,
            t.shape,
            kernel,
            plain,
        )


_DISPLAY: dict[type, tuple[str, str]] = {
    ast.List: ("[", "]"),
    ast.Tuple: ("(", ")"),
    ast.Set: ("{", "}"),
}
_ALIAS = re.compile(r"\s+as\s+(\w+)")
# ``<x>.<attr> = `` at a line's start, before a kernel's name on that line.
_ATTR_BIND = re.compile(r"[ \t]*[\w.]+\.(?P<attr>\w+)[ \t]*(?::[^=\n]*)?=(?!=)")


def _mentions(text: str, names: Iterable[str]) -> Iterator[tuple[str, int, int]]:
    """Each whole-word mention of one of ``names`` in ``text``: (name, start, end)."""
    for name in names:
        at = text.find(name)
        while at != -1:
            end = at + len(name)
            before = text[at - 1] if at else " "
            after = text[end] if end < len(text) else " "
            if not (before.isalnum() or before == "_" or after.isalnum() or after == "_"):
                yield name, at, end
            at = text.find(name, end)


def _params(args: ast.arguments) -> list[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    every += [a for a in (args.vararg, args.kwarg) if a is not None]
    return [a.arg for a in every]


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _short(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _str(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _written(node: ast.expr) -> str:
    """An expression as written, short: ``mod.kernel``, ``KERNELS['spec']``."""
    name = _dotted(node)
    if name is not None:
        return name
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _named(name: str, how: str, t: _Taint) -> str:
    """The shape of a local bound from ``t``."""
    if how == "fill":
        return f"{name} (filled with {t.shape})"
    if t.direct:
        return name
    return f"{name} = {t.shape}"


def _plain(arg: ast.expr, t: _Taint) -> bool:
    """``arg`` is a name holding the index or the slots themselves."""
    return (
        _dotted(arg) is not None
        and t.level == _IS
        and t.direct
        and not t.source.startswith("parameter ")
    )


def _stores(node: ast.Name) -> bool:
    return not isinstance(node.ctx, ast.Load)


def _root(node: ast.expr) -> str | None:
    """``md`` in ``md.x.y``, ``md.f()[0].x``."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _functions_deep(body: list[ast.stmt], path: str = "") -> Iterator[tuple[_Func, str]]:
    """Nested functions, each with its qualname's middle, in source order."""
    for node in _statements(body):
        if isinstance(node, _Func):
            yield node, path
            yield from _functions_deep(node.body, f"{path}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions_deep(node.body, f"{path}{node.name}.")


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A block's statements and those of the blocks inside it (not inside defs)."""
    for node in body:
        yield node
        if isinstance(node, _Func | ast.ClassDef):
            continue
        for name in ("body", "orelse", "finalbody"):
            sub = getattr(node, name, None)
            if isinstance(sub, list):
                yield from _statements([s for s in sub if isinstance(s, ast.stmt)])
        for h in getattr(node, "handlers", ()):
            yield from _statements(h.body)
        for case in getattr(node, "cases", ()):
            yield from _statements(case.body)


def _targets(node: ast.expr) -> list[str]:
    """The names a target binds (``a, (b, *c)``); the container of ``kw[k]``."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return [n for e in node.elts for n in _targets(e)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    if isinstance(node, ast.Subscript):
        return _targets(node.value)  # ``kw["x"] = v`` fills kw
    return []


_BINDS = (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)
# ``kw["x"] = v`` fills kw.
_FILL_TARGET: dict[type, str] = {ast.Subscript: "fill"}
_LOOPS = (ast.For, ast.AsyncFor, ast.comprehension)
_NOTED = frozenset(
    {
        ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.Assign,
        *_BINDS, *_LOOPS, ast.withitem, ast.Call,
    }
)  # fmt: skip


def _collect(
    body: list[ast.stmt] | list[ast.expr],
    binds: list[_Bind],
    calls: list[ast.Call],
    nested: list[ast.AST],
) -> None:
    """One pass over a scope's code: its bindings, its calls, its nested scopes
    in source order (whose bodies are not entered: what runs here of them is)."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind not in _NOTED:
            # ``ast_children``, inlined: most nodes pass here.
            for name in ast_fields(kind):
                value = getattr(node, name, None)
                if value.__class__ is list:
                    stack.extend(v for v in value if isinstance(v, ast.AST))
                elif isinstance(value, ast.AST):
                    stack.append(value)
            continue
        if isinstance(node, _Func):
            stack.extend([*node.decorator_list, *node.args.defaults])
            stack.extend(d for d in node.args.kw_defaults if d is not None)
            nested.append(node)
            binds.append(([node.name], node, "def"))
            continue
        if isinstance(node, ast.ClassDef):
            stack.extend([*node.decorator_list, *node.bases, *(k.value for k in node.keywords)])
            nested.append(node)
            continue
        if isinstance(node, ast.Lambda):
            stack.extend(node.args.defaults)
            nested.append(node)
            continue
        if isinstance(node, ast.Assign):
            for target, value in _pairs(node.targets, node.value):
                how = "lambda" if isinstance(value, ast.Lambda) else "assign"
                if isinstance(target, ast.Attribute):
                    binds.append(([target.attr], value, "store"))
                binds.append((_targets(target), value, _FILL_TARGET.get(type(target), how)))
        elif isinstance(node, _BINDS):
            if node.value is not None:
                if isinstance(node.target, ast.Attribute):
                    binds.append(([node.target.attr], node.value, "store"))
                binds.append((_targets(node.target), node.value, "assign"))
        elif isinstance(node, _LOOPS):
            binds.append((_targets(node.target), node.iter, "for"))
        elif isinstance(node, ast.withitem):
            if node.optional_vars is not None:
                binds.append((_targets(node.optional_vars), node.context_expr, "with"))
        elif isinstance(node, ast.Call):
            calls.append(node)
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _FILLS:
                names = _targets(func.value)
                values = [*node.args, *(k.value for k in node.keywords)]
                binds.extend((names, v, "fill") for v in values)
        stack.extend(ast_children(node))
    nested.sort(key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))


def _pairs(targets: list[ast.expr], value: ast.expr) -> Iterator[tuple[ast.expr, ast.expr]]:
    """(target, value) of an assignment, element by element where both
    sides are tuples of the same length (``slots, acc = x.s, x.acc``)."""
    for target in targets:
        if (
            isinstance(target, ast.Tuple | ast.List)
            and isinstance(value, ast.Tuple | ast.List)
            and len(target.elts) == len(value.elts)
            and not any(isinstance(e, ast.Starred) for e in [*target.elts, *value.elts])
        ):
            yield from _pairs_each(target.elts, value.elts)
        else:
            yield target, value


def _pairs_each(
    targets: list[ast.expr], values: list[ast.expr]
) -> Iterator[tuple[ast.expr, ast.expr]]:
    for target, value in zip(targets, values, strict=True):
        yield from _pairs([target], value)


@dataclass
class Swept:
    """A module swept: the calls found, and every call of the functions
    they are in (the code of each such function, lambdas included, not its
    nested functions), by the function's key."""

    reaches: list[Reach] = field(default_factory=list)
    calls: dict[tuple[str, str, int], list[ast.Call]] = field(default_factory=dict)


def sweep_module(key: str, tree: ast.Module, text: str, vocab: Vocabulary) -> Swept:
    """The calls of a module (``key``: its tree-relative path) that receive
    the spec token index or state slots, in source order."""
    if not any(f in text for f in vocab.fields):
        return Swept()
    module = _Module(key, tree, text, vocab)
    for _ in range(3):
        # Again when a function stored a value in an attribute that an
        # earlier one may read (a store in a store's value: a third pass).
        stored = len(module.stored)
        module.found, module.occurrences, module.calls = {}, {}, {}
        module.scope(tree.body, _Scope(), (MODULE, 0, 0), "")
        if len(module.stored) == stored:
            break
    reaches = sorted(module.found.values(), key=lambda r: (r.line, r.col))
    keys = {r.key for r in reaches}
    calls = {(key, *k): c for k, c in module.calls.items() if (key, *k) in keys}
    return Swept(reaches, calls)


def sweep(key: str, tree: ast.Module, text: str, vocab: Vocabulary) -> list[Reach]:
    """Every call of a module (``key``: its tree-relative path) that receives
    the spec token index or state slots, in source order."""
    return sweep_module(key, tree, text, vocab).reaches
