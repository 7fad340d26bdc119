"""Which function of the tree a call runs, found by reading, never by importing.

A :class:`TreeIndex` knows the modules of one tree it was asked about (each
read and parsed once, on demand): their functions and classes (with their
bases), their imports (relative ones too) and their dotted module names. It
resolves a call as the interpreter would, statically: ``self.m()``,
``cls.m()`` and ``super().m()`` to the method of the class or of its bases,
``f()`` to the module's own function, ``mod.f()`` or an imported ``f()`` to
the function of another module of the same tree. Files outside the tree are
never read, and nothing is executed.
"""

from __future__ import annotations

import ast
import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libcst as cst

from gdn_backport import files
from gdn_backport.errors import UsageError

from . import locate, segments
from .config import Patchset
from .dataflow import TENSOR_ATTRS, Callee, Resolver, Scope

_DECORATED = {"staticmethod": "staticmethod", "classmethod": "classmethod"}
# How many calls deep a helper handed nothing of the spec path (only the
# metadata, all rows) is searched for spec names before the walk decides
# whether to follow it. A helper handed spec rows, the index or the slots is
# followed whatever its code, so this only needs to see a helper that reads
# the metadata itself, or one that calls such a helper.
RELEVANCE_DEPTH = 2


@dataclass
class FunctionInfo:
    module: ModuleInfo
    qualname: str
    occurrence: int  # how many earlier functions of the module share qualname
    line: int  # the ``def`` line
    start: int  # first line, decorators included
    end: int
    col: int
    cls: str | None  # qualname of the class it is a method of
    kind: str  # function | method | staticmethod | classmethod
    node: ast.FunctionDef | ast.AsyncFunctionDef

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.module.key, self.qualname, self.occurrence)

    @property
    def receiver(self) -> str | None:
        if self.kind not in ("method", "classmethod"):
            return None
        args = [*self.node.args.posonlyargs, *self.node.args.args]
        return args[0].arg if args else None

    @property
    def scope(self) -> Scope:
        return Scope(self.module.key, self.cls, self.receiver)

    @property
    def text(self) -> str:
        return "".join(self.module.lines[self.start - 1 : self.end])

    def object_params(self) -> set[str]:
        """Parameters that are not tensors, read from ``ast`` (the rule of
        ``dataflow.object_params``): ``self``/``cls``, those annotated with
        something other than a Tensor, those used with a non-tensor attribute."""
        return set(_memo(self.node, "objects", self._object_params))

    def _object_params(self) -> frozenset[str]:
        args = self.node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        names = {a.arg for a in params}
        objects = {"self", "cls"} & names
        for a in params:
            if a.annotation is not None and "Tensor" not in ast.unparse(a.annotation):
                objects.add(a.arg)
        for node in _nodes(self.node):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in names
                and node.attr not in TENSOR_ATTRS
            ):
                objects.add(node.value.id)
        return frozenset(objects)

    def candidate(self) -> locate.Candidate:
        return locate.Candidate(
            self.qualname, self.occurrence, self.line, self.start, self.end, self.col
        )


@dataclass
class ClassInfo:
    qualname: str
    bases: list[str]  # as written (``Base``, ``mod.Base``)
    methods: dict[str, FunctionInfo] = field(default_factory=dict)


class ModuleInfo:
    """One module of the tree: its text, functions, classes and imports."""

    def __init__(
        self,
        key: str,
        text: str,
        path: Path | None,
        name: str | None,
        seeds: frozenset[str] = frozenset(),
    ) -> None:
        """``seeds``: the names that mark code worth a look (a huge module
        is read only around them: :mod:`.segments`)."""
        self.key = key
        self.seeds = seeds
        self._segments: segments.Segmented | None = None
        self.text = text
        self.path = path
        self.name = name  # dotted module name (``vllm.x.y``), None when unknown
        self.lines = text.splitlines(keepends=True)
        self.cst_module: cst.Module | None = None
        self._cst: dict[tuple[str, int], cst.FunctionDef] = {}
        self._tree: ast.Module | None = None

    # Parsed on first use: most modules an import reaches are only asked
    # whether they define a name, which their text answers first.
    @property
    def tree(self) -> ast.Module:
        if self._tree is None:
            self._segments = segments.read(self.text, self.seeds) if self.seeds else None
            tree = self._segments.tree() if self._segments is not None else None
            self._tree = tree or files.parse_ast(self.path or Path(self.key), self.text)
            self._index()
        return self._tree

    def want(self, name: str) -> None:
        """A module read in segments reads those binding ``name`` too (a
        helper another module imports, a base class)."""
        self.tree  # noqa: B018
        if self._segments is None or not self._segments.want(name):
            return
        tree = self._segments.tree()
        if tree is None:  # a statement that does not parse: the whole text
            self._segments = None
            tree = files.parse_ast(self.path or Path(self.key), self.text)
        self._tree = tree
        self._index()

    @functools.cached_property
    def imports(self) -> dict[str, str]:
        return files.module_imports(self.tree)

    @property
    def functions(self) -> list[FunctionInfo]:
        self.tree  # noqa: B018 - parses and indexes
        return self._functions

    @property
    def top(self) -> dict[str, FunctionInfo]:
        self.tree  # noqa: B018
        return self._top

    @property
    def classes(self) -> dict[str, ClassInfo]:
        self.tree  # noqa: B018
        return self._classes

    def defines(self, name: str) -> bool:
        """The text can define ``name`` (a def or class of that name)."""
        return f"def {name}" in self.text or f"class {name}" in self.text

    def _index(self) -> None:
        assert self._tree is not None
        self._functions: list[FunctionInfo] = []
        self._top: dict[str, FunctionInfo] = {}
        self._classes: dict[str, ClassInfo] = {}
        for entry in _memo(self._tree, "index", lambda: _raw_index(self._tree)):
            if entry[0] == "class":
                _, qual, bases = entry
                self._classes.setdefault(qual, ClassInfo(qual, list(bases)))
                continue
            _, qual, occurrence, node, cls_name, kind, top = entry
            fn = FunctionInfo(
                self,
                qual,
                occurrence,
                node.lineno,
                min([node.lineno, *(d.lineno for d in node.decorator_list)]),
                node.end_lineno or node.lineno,
                node.col_offset,
                cls_name,
                kind,
                node,
            )
            self._functions.append(fn)
            if cls_name is not None:
                self._classes[cls_name].methods[node.name] = fn  # the last one wins
            elif top:
                self._top[node.name] = fn

    def use_tree(self, module: cst.Module) -> None:
        """Hand out the functions of ``module`` (the text's own parse): a
        codemod's edits are keyed by the nodes of the tree it transforms."""
        self.cst_module = module
        self._cst = {(q, o): f for q, o, f in locate.index_functions(module)}

    def cst_function(self, fn: FunctionInfo) -> cst.FunctionDef:
        key = (fn.qualname, fn.occurrence)
        node = self._cst.get(key)
        if node is None:
            node = self._cst[key] = locate.function_node(self.lines, fn.candidate())
        return node

    def function(self, qualname: str, occurrence: int = 0) -> FunctionInfo | None:
        for fn in self.functions:
            if fn.qualname == qualname and fn.occurrence == occurrence:
                return fn
        return None


def _ast_dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _ast_dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


# ast-derived facts of a function, by its node: the parse of a text is cached
# (``files._parse``), so a second analysis of the same file in one process
# (apply: scan, rewrite, proof) reads them again for free.
_MEMO: OrderedDict[tuple[int, str], tuple[ast.AST, Any]] = OrderedDict()
_MEMO_SIZE = 8192


def _memo(node: ast.AST, kind: str, compute: Callable[[], Any]) -> Any:
    key = (id(node), kind)
    hit = _MEMO.get(key)
    if hit is not None and hit[0] is node:
        _MEMO.move_to_end(key)
        return hit[1]
    value = compute()
    _MEMO[key] = (node, value)  # the node is kept alive with its id
    if len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return value


def _nodes(fn: ast.AST) -> tuple[ast.AST, ...]:
    """``ast.walk`` of a function, made once (its parameters' uses, its
    callees and the calls handed its parameters are each read from it)."""
    return _memo(fn, "nodes", lambda: _walk(fn))  # type: ignore[no-any-return]


def _walk(node: ast.AST) -> tuple[ast.AST, ...]:
    """``tuple(ast.walk(node))``, the same nodes in the same order, without
    a generator per node (2-3 % of a cold pr51812 scan of vLLM 0.33.0)."""
    out = [node]
    at = 0
    while at < len(out):
        current = out[at]
        at += 1
        for name in current._fields:
            value = getattr(current, name, None)
            if isinstance(value, ast.AST):
                out.append(value)
            elif isinstance(value, list):
                out.extend(v for v in value if isinstance(v, ast.AST))
    return tuple(out)


_BLOCKS = ("body", "handlers", "orelse", "finalbody", "cases")


def _raw_index(tree: ast.Module | None) -> list[tuple[Any, ...]]:
    """Classes ("class", qualname, bases) and functions ("function", qualname,
    occurrence, node, class, kind, top-level) of a module, in source order."""
    out: list[tuple[Any, ...]] = []
    seen: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, cls: str | None) -> None:
        # Definitions sit only in statement lists, in this order of
        # ``_fields`` for every node that has them (as ``iter_child_nodes``
        # gives them), so occurrences count as before.
        for child in (c for f in _BLOCKS for c in getattr(node, f, ())):
            if isinstance(child, ast.ClassDef):
                qual = f"{prefix}{child.name}"
                out.append(("class", qual, tuple(b for b in map(_ast_dotted, child.bases) if b)))
                visit(child, f"{qual}.", qual)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}{child.name}"
                occurrence = seen.get(qual, 0)
                seen[qual] = occurrence + 1
                decorators = {_ast_dotted(d) for d in child.decorator_list}
                kind = "function"
                if cls is not None:
                    kind = next((v for k, v in _DECORATED.items() if k in decorators), "method")
                out.append(("function", qual, occurrence, child, cls, kind, not prefix))
                visit(child, f"{qual}.", None)
            elif isinstance(child, (ast.stmt, ast.ExceptHandler, ast.match_case)):
                visit(child, prefix, cls)

    if tree is not None:
        visit(tree, "", None)
    return out


def _callees(fn: ast.AST) -> tuple[str, ...]:
    """Every callee a function's code names, as written."""

    def compute() -> tuple[str, ...]:
        found = (ast_callee(n) for n in _nodes(fn) if isinstance(n, ast.Call))
        return tuple(w for w in found if w is not None)

    return _memo(fn, "callees", compute)  # type: ignore[no-any-return]


def ast_callee(call: ast.Call) -> str | None:
    """The callee of an ``ast`` call as ``resolve`` takes it written."""
    func = call.func
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "super"
    ):
        return f"super().{func.attr}"
    return _ast_dotted(func)


def _passes(call: ast.Call, names: set[str]) -> bool:
    values = [*call.args, *(k.value for k in call.keywords)]
    return any(isinstance(v, ast.Name) and v.id in names for v in values)


def _bound_names(
    callee: FunctionInfo, bound: bool, call: ast.Call, names: set[str]
) -> dict[str, str]:
    """callee parameter -> the caller's name in ``names`` passed to it."""
    args = callee.node.args
    positional = [a.arg for a in [*args.posonlyargs, *args.args]]
    if bound:
        positional = positional[1:]
    out: dict[str, str] = {}
    for i, value in enumerate(call.args):
        if isinstance(value, ast.Starred):
            break
        if i < len(positional) and isinstance(value, ast.Name) and value.id in names:
            out[positional[i]] = value.id
    for kw in call.keywords:
        if kw.arg is not None and isinstance(kw.value, ast.Name) and kw.value.id in names:
            out[kw.arg] = kw.value.id
    return out


def _module_name(path: Path) -> str | None:
    """``a.b.c`` for ``.../a/b/c.py`` where ``a`` and ``b`` are packages."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.append(folder.name)
        if folder.parent == folder:
            break
        folder = folder.parent
    return ".".join(reversed(parts)) or None


class TreeIndex:
    """The modules of one tree, resolved into each other on demand."""

    def __init__(
        self,
        root: Path | None,
        patchset: Patchset,
        overrides: Mapping[Path, str] | None = None,
        fallback: Resolver | None = None,
    ) -> None:
        """``fallback``: asked for the calls the tree's files do not resolve
        (the live objects of a running process, for the runtime plugin)."""
        self.root = root
        self.fallback = fallback
        self.patchset = patchset
        self.overrides = {p.resolve(): t for p, t in (overrides or {}).items()}
        self.modules: dict[str, ModuleInfo] = {}
        self._by_path: dict[Path, ModuleInfo | None] = {}
        self._names = patchset.names()
        self._seeds = self._names | frozenset(m.decode() for m in locate.markers(patchset))
        # function -> (relevant, the call depth that was searched)
        self._relevant: dict[tuple[str, str, int], tuple[bool, int]] = {}
        self._named: dict[tuple[str, str], ModuleInfo | None] = {}

    # -- modules ----------------------------------------------------------------

    def key_of(self, path: Path) -> str:
        if self.root is not None:
            try:
                return path.relative_to(self.root).as_posix()
            except ValueError:
                pass
        return path.as_posix()

    def add(self, path: Path, text: str) -> ModuleInfo:
        """A module of the tree, with this text (scan reads the file itself)."""
        key = path.resolve()
        cached = self._by_path.get(key)
        if cached is not None and cached.text == text:
            return cached
        text = self.overrides.get(key, text)
        module = ModuleInfo(self.key_of(path), text, path, _module_name(path), self._seeds)
        self.modules[module.key] = module
        self._by_path[key] = module
        return module

    def add_text(self, key: str, text: str, where: Path | None = None) -> ModuleInfo:
        """A module known only by its text (one file's source, no tree)."""
        module = ModuleInfo(key, text, where, None, self._seeds)
        module.path = None
        self.modules[key] = module
        return module

    def _load(self, path: Path) -> ModuleInfo | None:
        """A module the analysis reaches through an import; None if it is not
        a readable, parseable file inside the tree."""
        if not self.overrides and not os.path.isfile(path):
            # Most paths an import tries are not files (``x.py`` of a package):
            # no ``resolve`` (an lstat per folder) for them (an override may
            # be a file not yet on disk: then every path is resolved).
            return None
        real = path.resolve()
        if real in self._by_path:
            return self._by_path[real]
        module: ModuleInfo | None = None
        # Inside the tree as written (a module in a linked folder is one of
        # the tree's, as scan walks it), never above it.
        inside = self.root is not None and Path(os.path.abspath(path)).is_relative_to(
            Path(os.path.abspath(self.root))
        )
        if inside and (real in self.overrides or path.is_file()):
            try:
                text = self.overrides.get(real)
                if text is None:
                    data = path.read_bytes()
                    text = files.decode(path, data)
                module = ModuleInfo(self.key_of(path), text, path, _module_name(path), self._seeds)
                self.modules[module.key] = module
            except (OSError, UsageError):
                module = None  # a helper we cannot read is not followed
        self._by_path[real] = module
        return module

    def module_at(self, path: Path) -> ModuleInfo | None:
        """The module of the tree in file ``path`` (read on first use)."""
        return self._load(path)

    def module_named(self, target: str, near: ModuleInfo) -> ModuleInfo | None:
        """The module ``target`` (``a.b``, or relative ``.b``/``..b``) names,
        imported from ``near``."""
        key = (near.key, target)
        if key not in self._named:
            self._named[key] = self._module_named(target, near)
        return self._named[key]

    def _module_named(self, target: str, near: ModuleInfo) -> ModuleInfo | None:
        if near.path is None:
            return None
        level = len(target) - len(target.lstrip("."))
        parts = [p for p in target.lstrip(".").split(".") if p]
        folder = near.path.parent
        if level:
            # ``from .x import f``: x beside this module; each further dot one folder up.
            for _ in range(level - 1):
                folder = folder.parent
        elif near.name is not None:
            # Absolute: from the folder holding the top package.
            up = len(near.name.split(".")) - (0 if near.path.name == "__init__.py" else 1)
            for _ in range(up):
                folder = folder.parent
        if not parts:
            return self._load(folder / "__init__.py")
        stem = folder.joinpath(*parts)
        for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
            module = self._load(candidate)
            if module is not None:
                return module
        return None

    # -- calls ------------------------------------------------------------------

    def resolve(self, scope: Scope, written: str, resolved: str) -> Callee | None:
        found = self.resolve_info(scope, written, resolved)
        if found is None:
            if self.fallback is not None:
                return self.fallback.resolve(scope, written, resolved)
            return None
        fn, bound = found
        return Callee(
            fn.key,
            lambda: fn.module.cst_function(fn),
            fn.module.imports,
            fn.scope,
            fn.qualname,
            fn.module.key,
            fn.line,
            bound,
            lambda: self.relevant(fn),
            fn.object_params,
        )

    def resolve_info(
        self, scope: Scope, written: str, resolved: str
    ) -> tuple[FunctionInfo, bool] | None:
        """(the function, whether its first parameter takes the receiver)."""
        module = self.modules.get(scope.module)
        if module is None:
            return None
        if written.startswith("super()."):
            if scope.cls is None:
                return None
            cls = module.classes.get(scope.cls)
            if cls is None:
                return None
            for base in self._bases(module, cls):
                fn = self._method(base, written.split(".", 1)[1], set())
                if fn is not None:
                    return fn, fn.kind != "staticmethod"
            return None
        parts = written.split(".")
        if scope.receiver and scope.cls and len(parts) == 2 and parts[0] == scope.receiver:
            cls = module.classes.get(scope.cls)
            fn = self._method((module, cls), parts[1], set()) if cls else None
            return (fn, fn.kind != "staticmethod") if fn is not None else None
        module.want(parts[0])
        if len(parts) == 1 and written == resolved:
            fn = module.top.get(written)
            return (fn, False) if fn is not None else None
        if len(parts) == 2 and parts[0] in module.classes and written == resolved:
            fn = module.classes[parts[0]].methods.get(parts[1])
            return (fn, fn.kind == "classmethod") if fn is not None else None
        return self._imported(module, resolved)

    def _imported(self, module: ModuleInfo, resolved: str) -> tuple[FunctionInfo, bool] | None:
        level = len(resolved) - len(resolved.lstrip("."))
        parts = resolved.lstrip(".").split(".")
        for i in range(len(parts) - 1, -1, -1):
            target = "." * level + ".".join(parts[:i])
            if not target:
                continue
            other = self.module_named(target, module)
            if other is None:
                continue
            rest = parts[i:]
            if not other.defines(rest[0]):
                return None
            other.want(rest[0])
            if len(rest) == 1:
                fn = other.top.get(rest[0])
                return (fn, False) if fn is not None else None
            if len(rest) == 2 and rest[0] in other.classes:
                fn = other.classes[rest[0]].methods.get(rest[1])
                return (fn, fn.kind == "classmethod") if fn is not None else None
            return None
        return None

    def _bases(
        self, module: ModuleInfo, cls: ClassInfo
    ) -> Iterator[tuple[ModuleInfo, ClassInfo | None]]:
        for written in cls.bases:
            found = self._class(module, written)
            if found is not None:
                yield found

    def _class(self, module: ModuleInfo, written: str) -> tuple[ModuleInfo, ClassInfo] | None:
        module.want(written.partition(".")[0])
        if written in module.classes:
            return module, module.classes[written]
        head, _, rest = written.partition(".")
        target = module.imports.get(head)
        if target is None:
            return None
        dotted = f"{target}.{rest}" if rest else target
        level = len(dotted) - len(dotted.lstrip("."))
        parts = dotted.lstrip(".").split(".")
        other = self.module_named("." * level + ".".join(parts[:-1]), module)
        if other is not None and other.defines(parts[-1]):
            other.want(parts[-1])
        if other is not None and other.defines(parts[-1]) and parts[-1] in other.classes:
            return other, other.classes[parts[-1]]
        return None

    def _method(
        self,
        where: tuple[ModuleInfo, ClassInfo | None],
        name: str,
        seen: set[tuple[str, str]],
    ) -> FunctionInfo | None:
        """``name`` looked up on a class and then its bases (depth first)."""
        module, cls = where
        if cls is None or (module.key, cls.qualname) in seen or len(seen) > 16:
            return None
        seen.add((module.key, cls.qualname))
        if name in cls.methods:
            return cls.methods[name]
        for base in self._bases(module, cls):
            fn = self._method(base, name, seen)
            if fn is not None:
                return fn
        return None

    def calls(self, fn: FunctionInfo, only: frozenset[str] | None = None) -> Iterator[FunctionInfo]:
        """The tree's functions ``fn``'s code calls (read from ``ast``;
        local rebindings ignored: an over-approximation); ``only``: just
        the calls of functions so named."""
        imports = fn.module.imports
        for written in _callees(fn.node):
            if only is not None and written.rsplit(".", 1)[-1] not in only:
                continue
            head, _, rest = written.partition(".")
            resolved = written
            if head in imports and not written.startswith("super()"):
                resolved = f"{imports[head]}.{rest}" if rest else imports[head]
            found = self.resolve_info(fn.scope, written, resolved)
            if found is not None and found[0] is not fn:
                yield found[0]
            elif found is None and "." in written and head not in imports:
                # ``layer.method()`` on an instance handed in: any method of
                # that name in the modules read so far may be the one
                # (for relevance only; the walk resolves the instance).
                attr = written.rsplit(".", 1)[1]
                for module in list(self.modules.values()):
                    for cls in module.classes.values():
                        method = cls.methods.get(attr)
                        if method is not None and method is not fn:
                            yield method

    def relevant(self, fn: FunctionInfo, budget: int = RELEVANCE_DEPTH) -> bool:
        """``fn``'s code names a spec field or a kernel, or calls a function
        of the tree that does, within ``budget`` calls (the walk follows
        :data:`~gdn_backport.dataflow.MAX_DEPTH` deep; looking further keeps
        a helper past that depth from being skipped silently)."""
        key = fn.key
        known = self._relevant.get(key)
        if known is not None and (known[0] or known[1] >= budget):
            return known[0]
        self._relevant[key] = (False, budget)  # cuts cycles
        found = any(name in fn.text for name in self._names)
        if not found and budget > 0:
            found = any(self.relevant(callee, budget - 1) for callee in self.calls(fn))
        self._relevant[key] = (found, budget)
        return found

    def entry_objects(
        self, fn: FunctionInfo, only: set[str] | None = None, depth: int = 0
    ) -> set[str]:
        """The parameters of ``fn`` that hold objects: its own reading (see
        :meth:`FunctionInfo.object_params`), and those it hands to a helper
        of the tree that uses them as objects (``_conv_buffer_view(layer)``
        reads ``layer.kv_cache``), from ``ast``, two helpers deep."""
        objects = fn.object_params()
        if only is None:
            args = fn.node.args
            only = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        only = only - objects - {fn.receiver or ""}
        if depth >= 2 or not only:
            return objects
        imports = fn.module.imports
        for node in _nodes(fn.node):
            if not (isinstance(node, ast.Call) and _passes(node, only)):
                continue
            written = ast_callee(node)
            if written is None:
                continue
            head, _, rest = written.partition(".")
            resolved = written
            if head in imports:
                resolved = f"{imports[head]}.{rest}" if rest else imports[head]
            found = self.resolve_info(fn.scope, written, resolved)
            if found is None:
                continue
            callee, bound = found
            passed = _bound_names(callee, bound, node, only)
            if passed:
                inner = self.entry_objects(callee, set(passed), depth + 1)
                objects |= {mine for theirs, mine in passed.items() if theirs in inner}
        return objects

    def candidates(self, module: ModuleInfo) -> list[FunctionInfo]:
        """Functions whose code names a spec-token field: where spec paths start."""
        fields = (*self.patchset.fields.spec_index, *self.patchset.fields.spec_state)
        # A function named like a kernel is that kernel's own wrapper: its
        # callers are the spec paths.
        kernels = self.patchset.kernels
        # Constructors and other dunders run no spec step.
        return [
            fn
            for fn in module.functions
            if fn.node.name not in kernels
            and not fn.node.name.startswith("__")
            and any(f in fn.text for f in fields)
        ]
