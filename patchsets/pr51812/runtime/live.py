"""What is running: the GDN methods in effect on imported classes, analysed.

A hardware plugin may replace a method at run time (vllm-ascend swaps
``_forward_core``, vllm-gaudi ``forward``), so the file on disk can be dead
code. Everything here looks at the function object the class holds *now*:
its source (``inspect`` on its code object, so a ``functools.wraps`` wrapper
is read as itself, not as what it wraps) is analysed with the module-level
imports of the file that defined it, exactly as ``scan`` analyses a file.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libcst as cst

from gdn_backport import files
from gdn_backport.errors import UsageError
from gdn_backport.runtime.hook import PREFIX
from gdn_backport.site import Site, Status

from .. import locate
from ..config import Patchset, load
from ..dataflow import Callee, Scope
from ..resolve import TreeIndex
from ..scan import scan_text, sites_of
from ..sites import analyse_modules

MARKER = "__gdn_backport__"


@dataclass(frozen=True)
class Source:
    """A live function's source, and what the analysis needs around it."""

    file: str  # as the code object names it (a real path or our pseudo-file)
    first: int  # line of its first decorator or ``def`` in ``file``
    lines: list[str]  # the function, indented as in the file
    module_lines: list[str]  # the whole file

    def context(self, owner: str | None = None) -> tuple[str, int]:
        """A small module: the file's imports, then the function; and how
        many lines come before the function in it. ``owner``: the class an
        indented method is put in (its ``self.`` calls then resolve)."""
        imports = files.module_imports(ast.parse("".join(self.module_lines)))
        header = [
            f"import {target} as {local}\n"
            for local, target in sorted(imports.items())
            if local.isidentifier() and all(p.isidentifier() for p in target.split("."))
        ]
        indented = self.lines[0][:1] in (" ", "\t")
        if indented:
            # Keeps the method's own indentation valid.
            header.append(f"class {owner}:\n" if owner else "if 1:\n")
        return "".join(header + self.lines), len(header)


@dataclass
class LiveMethod:
    """One GDN method as a class holds it now."""

    module: str  # the module whose class defines the method slot
    path: str  # that module's file relative to its package root (vllm/...)
    file: str  # that module's file
    owner: type  # the class in whose __dict__ the function sits
    name: str
    function: Callable[..., Any] | None
    where: str  # file:line of the function in effect
    status: Status
    reason: str

    @property
    def qualname(self) -> str:
        return f"{self.owner.__qualname__}.{self.name}"

    @property
    def location(self) -> str:
        """``path:line`` of the method in its module's file, or where the
        function in effect comes from when something replaced it."""
        code = getattr(self.function, "__code__", None)
        if isinstance(code, types.CodeType) and code.co_filename == self.file:
            return f"{self.path}:{code.co_firstlineno}"
        return f"{self.path}; in effect: {self.where}"

    @property
    def source_path(self) -> str:
        """The in-effect function's own file, as ``vllm.../x.py`` when its
        module is imported (a plugin's replacement lives in the plugin)."""
        code = getattr(self.function, "__code__", None)
        if isinstance(code, types.CodeType) and code.co_filename == self.file:
            return self.path
        module = sys.modules.get(getattr(self.function, "__module__", None) or "")
        if module is not None and getattr(module, "__file__", None):
            return rel_path(module)
        return code.co_filename if isinstance(code, types.CodeType) else self.path

    @property
    def ours(self) -> dict[str, Any] | None:
        """Our runtime patch's record when it is the function in effect."""
        mark = getattr(self.function, MARKER, None)
        return mark if isinstance(mark, dict) else None


def rel_path(module: types.ModuleType) -> str:
    """``vllm/.../x.py`` for module ``vllm....x`` (the path scan prints)."""
    file = getattr(module, "__file__", None) or ""
    base = module.__name__.replace(".", "/")
    return f"{base}/__init__.py" if file.endswith("__init__.py") else f"{base}.py"


def source_of(fn: Callable[..., Any]) -> Source:
    """The source of ``fn`` itself; OSError/TypeError when there is none."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        raise TypeError(f"{fn!r} is not a Python function")
    lines, first = inspect.getsourcelines(code)
    module_lines = linecache.getlines(code.co_filename, getattr(fn, "__globals__", None))
    return Source(code.co_filename, max(first, 1), lines, module_lines)


def unwrap_descriptor(attr: Any) -> Any:
    """The function under a staticmethod/classmethod, else ``attr``."""
    return attr.__func__ if isinstance(attr, staticmethod | classmethod) else attr


class LiveResolver:
    """Calls of a live function resolved on the objects they name now: the
    class's methods as it holds them (a plugin may have replaced one), the
    defining module's functions; never executed, only their source read."""

    def __init__(self, patchset: Patchset) -> None:
        self.names = patchset.names()
        # scope key -> (the class methods are looked up on, globals, receiver)
        self.scopes: dict[str, tuple[type | None, dict[str, Any], str | None]] = {}

    def register(self, key: str, owner: type | None, fn: Callable[..., Any]) -> None:
        code = getattr(fn, "__code__", None)
        params = code.co_varnames[: code.co_argcount] if isinstance(code, types.CodeType) else ()
        receiver = params[0] if owner is not None and params else None
        self.scopes[key] = (owner, getattr(fn, "__globals__", {}), receiver)

    def resolve(self, scope: Scope, written: str, resolved: str) -> Callee | None:
        known = self.scopes.get(scope.module)
        if known is None:
            return None
        owner, globals_, receiver = known
        head, _, rest = written.partition(".")
        target: Any = None
        bound = False
        if owner is not None and head == receiver and rest and "." not in rest:
            target = inspect.getattr_static(owner, rest, None)
            bound = not isinstance(target, staticmethod)
        elif written.startswith("super().") and owner is not None:
            for base in owner.__mro__[1:]:
                if written[8:] in base.__dict__:
                    target = base.__dict__[written[8:]]
                    bound = not isinstance(target, staticmethod)
                    break
        elif head not in ("super()",):
            target = globals_.get(head)
            for part in rest.split(".") if rest else ():
                target = (
                    getattr(target, part, None)
                    if isinstance(target, type | types.ModuleType)
                    else None
                )
            if isinstance(target, classmethod):
                bound = True
        fn = unwrap_descriptor(target)
        if not isinstance(fn, types.FunctionType):
            return None
        # The tree's own helpers only (vLLM and its plugins), as scan follows
        # only the files of the tree: a library's function is a callee.
        if not (fn.__module__ or "").split(".", 1)[0].startswith(PREFIX):
            return None
        try:
            src = source_of(fn)
            text, _ = src.context()
            module = cst.parse_module(text)
        except (OSError, TypeError, cst.ParserSyntaxError):
            return None
        node = _function_in(module)
        if node is None:
            return None
        key = f"<live {fn.__module__}.{fn.__qualname__}>"
        self.register(key, owner if bound else None, fn)
        receiver = self.scopes[key][2]
        scope = Scope(key, owner.__qualname__ if bound and owner else None, receiver)
        imports = files.module_imports(ast.parse("".join(src.module_lines)))
        relevant = any(name in text for name in self.names)
        return Callee(
            (key, fn.__qualname__, 0),
            lambda: node,
            imports,
            scope,
            fn.__qualname__,
            src.file,
            src.first,
            bound,
            lambda: relevant,
        )


def _function_in(module: cst.Module) -> cst.FunctionDef | None:
    """The function of a :meth:`Source.context` module."""
    for stmt in reversed(module.body):
        if isinstance(stmt, cst.FunctionDef):
            return stmt
        if isinstance(stmt, cst.If) and isinstance(stmt.body, cst.IndentedBlock):
            inner = stmt.body.body[0]
            if isinstance(inner, cst.FunctionDef):
                return inner
    return None


def analyse_function(
    fn: Any, patchset: Patchset | None = None, owner: type | None = None
) -> tuple[Status | None, str]:
    """(status, reason) of the function in effect (a method of ``owner``),
    its helpers followed as they are in effect; None: not a GDN spec path."""
    patchset = patchset or load()
    fn = unwrap_descriptor(fn)
    try:
        src = source_of(fn)
    except (OSError, TypeError) as exc:
        return Status.UNKNOWN, f"its source cannot be read ({exc})"
    text, _ = src.context(owner.__name__ if owner is not None else None)
    try:
        sites = live_sites(fn, text, src.file, patchset, owner)
    except UsageError as exc:
        return Status.UNKNOWN, f"its source cannot be analysed ({exc})"
    if not sites:
        return None, "not a GDN spec path"
    site = sites[0]
    return site.status, site.reason


def live_resolver(fn: Any, owner: type | None, patchset: Patchset, key: str) -> LiveResolver:
    resolver = LiveResolver(patchset)
    resolver.register(key, owner, unwrap_descriptor(fn))
    return resolver


def live_sites(fn: Any, text: str, file: str, patchset: Patchset, owner: type | None) -> list[Site]:
    """The sites of a live function's :meth:`Source.context` module."""
    index = TreeIndex(None, patchset, fallback=live_resolver(fn, owner, patchset, file))
    module = index.add_text(file, text)
    return sites_of(analyse_modules(index, [module]))


def owner_of(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO whose ``__dict__`` holds ``name``."""
    return next((k for k in cls.__mro__ if name in k.__dict__), None)


def where(fn: Any) -> str:
    code = getattr(unwrap_descriptor(fn), "__code__", None)
    if not isinstance(code, types.CodeType):
        return repr(fn)
    return f"{code.co_filename}:{code.co_firstlineno}"


def mentions_fields(module: types.ModuleType, patchset: Patchset) -> bool:
    """The cheap sieve of ``scan``: the module's file names a spec field."""
    file = getattr(module, "__file__", None)
    if not file or not file.endswith(".py"):
        return False
    try:
        return locate.mentions_fields(Path(file).read_bytes(), patchset)
    except OSError:
        return False


def site_methods(module: types.ModuleType, patchset: Patchset) -> Iterator[tuple[type, str, bool]]:
    """(class, method, is a site in the file) of every GDN spec path ``scan``
    finds in the module's file, plus every function some plugin put on those
    classes at run time (defined in another file)."""
    file = getattr(module, "__file__", None)
    if not file:
        return
    try:
        text = files.decode(Path(file), Path(file).read_bytes())
        sites = scan_text(rel_path(module), text, patchset, Path(file))
    except (OSError, UsageError):
        return
    seen: set[tuple[int, str]] = set()
    for site in sites:
        parts = site.function.split(".")
        if len(parts) != 2:
            continue  # nested functions: not a method a plugin can replace
        cls = module.__dict__.get(parts[0])
        if isinstance(cls, type) and (id(cls), parts[1]) not in seen:
            seen.add((id(cls), parts[1]))
            yield cls, parts[1], True
    classes = {k for k, _ in seen}
    for cls in [c for c in module.__dict__.values() if isinstance(c, type)]:
        if id(cls) not in classes:
            continue
        for name, attr in list(vars(cls).items()):
            code = getattr(unwrap_descriptor(attr), "__code__", None)
            if (id(cls), name) in seen or not isinstance(code, types.CodeType):
                continue
            if code.co_filename != file:
                seen.add((id(cls), name))
                yield cls, name, False


def live_methods(module: types.ModuleType, patchset: Patchset | None = None) -> list[LiveMethod]:
    """Every GDN method of the module's classes, as it is in effect now."""
    patchset = patchset or load()
    out = []
    for cls, name, is_site in site_methods(module, patchset):
        owner = owner_of(cls, name) or cls
        attr = owner.__dict__.get(name)
        fn = unwrap_descriptor(attr)
        status, reason = analyse_function(fn, patchset, owner)
        if status is None:
            if not is_site:
                continue
            # The file's spec path was replaced by something we cannot
            # recognise: fail closed rather than report nothing.
            status = Status.UNKNOWN
            reason = f"replaced at run time by {where(fn)}, which is not recognisable ({reason})"
        out.append(
            LiveMethod(
                module.__name__,
                rel_path(module),
                getattr(module, "__file__", None) or "",
                owner,
                name,
                fn,
                where(fn),
                status,
                reason,
            )
        )
    return out


def gdn_modules(patchset: Patchset | None = None) -> list[types.ModuleType]:
    """The imported modules of vLLM (and ``vllm*`` plugins) that may hold a
    GDN spec path, by the cheap sieve."""
    patchset = patchset or load()
    return [
        m
        for name, m in list(sys.modules.items())
        if isinstance(m, types.ModuleType)
        and name.split(".", 1)[0].startswith(PREFIX)
        and mentions_fields(m, patchset)
    ]
