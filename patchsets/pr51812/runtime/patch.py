"""Rewrite one live method in memory with the ``gather`` codemod and install it.

The same codemod as ``apply`` runs on the method's source (with its file's
imports around it, see :meth:`Source.context`); the rewrite is proven by the
codemod (re-analysed as aligned, compiled), compiled under a pseudo-file name
that says it is patched (``<gdn-backport:pr51812 vllm/.../x.py>``), analysed
once more as the function object it became, and only then put on the class.

Line numbers: the pseudo-file is the original file with the method replaced
by its rewrite, registered in :mod:`linecache`, so tracebacks and
``inspect.getsource`` show the code that runs. Lines above the first inserted
line keep their numbers in the original file; lines below move down by the
number of inserted lines (1 or 2 for the gather strategy).
"""

from __future__ import annotations
import __future__ as future

import ast
import linecache
import types
from typing import Any

import libcst as cst

from gdn_backport.site import Status

from ..codemods.base import Refusal
from ..codemods.gather_gates import GatherGatesCodemod
from ..config import Patchset, load
from ..runtime.live import MARKER, analyse_function, live_resolver, source_of, unwrap_descriptor

STRATEGY = "gather"
_FACTORY = "__gdn_backport_factory__"


def pseudo_file(patchset: Patchset, path: str) -> str:
    return f"<gdn-backport:{patchset.id} {path}>"


def _future_flags(code: types.CodeType) -> int:
    """The ``from __future__`` flags the original was compiled with (our own
    module's, e.g. ``annotations``, must not leak into the rewrite)."""
    flags = 0
    for name in future.all_feature_names:
        flag = getattr(future, name).compiler_flag
        if code.co_flags & flag:
            flags |= flag
    return flags


def _rewrite_source(
    fn: types.FunctionType, owner: type | None, patchset: Patchset
) -> tuple[list[str], int]:
    """The rewritten function's lines (indented as in its file) and the
    line of the original's first line in its file. Refusal if it cannot.
    The helpers it calls are followed as ``owner`` and its module hold them."""
    src = source_of(fn)
    text, header = src.context(owner.__name__ if owner is not None else None)
    resolver = live_resolver(fn, owner, patchset, "<module>")
    codemod = GatherGatesCodemod(source=text, patchset=patchset, resolver=resolver)
    try:
        result = codemod.rewrite(cst.parse_module(text))
    except Refusal:
        raise
    except Exception as exc:  # libcst parse errors and the like: same outcome
        raise Refusal(f"{type(exc).__name__}: {exc}") from exc
    if result is None:
        raise Refusal("the codemod found nothing to rewrite")
    # Analysing alone, the codemod proved its own rewrite.
    assert result.proven
    return result.text.splitlines(keepends=True)[header:], src.first


def _compile(
    fn: types.FunctionType, lines: list[str], first: int, filename: str
) -> types.FunctionType:
    """A new function from ``lines``, in ``fn``'s globals and closure."""
    indented = lines[0][:1] in (" ", "\t")
    tree = ast.parse(("if 1:\n" if indented else "") + "".join(lines))
    node = tree.body[0]
    if indented:
        assert isinstance(node, ast.If)
        node = node.body[0]
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    # Its first line (decorators included) is line 2 (1) of the parsed text.
    ast.increment_lineno(node, first - (2 if indented else 1))
    code = fn.__code__
    # A factory taking the free variables (``__class__`` for ``super()``)
    # gives the new function the original's closure cells' contents.
    factory = ast.FunctionDef(
        name=_FACTORY,
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(v) for v in code.co_freevars],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[node, ast.Return(ast.Name(node.name, ast.Load()))],
        decorator_list=[],
        returns=None,
        type_comment=None,
    )
    ast.copy_location(factory, node)
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    compiled = compile(module, filename, "exec", flags=_future_flags(code), dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(compiled, fn.__globals__, namespace)
    try:
        cells = [c.cell_contents for c in fn.__closure__ or ()]
    except ValueError as exc:
        raise Refusal("a closure variable of the method is not set yet") from exc
    new: types.FunctionType = namespace[_FACTORY](*cells)
    return new


def rewrite(
    fn: Any, path: str, patchset: Patchset | None = None, owner: type | None = None
) -> types.FunctionType:
    """The proven, compiled rewrite of ``fn`` (a method of ``owner``);
    Refusal when it cannot be."""
    patchset = patchset or load()
    original = unwrap_descriptor(fn)
    if not isinstance(original, types.FunctionType):
        raise Refusal(f"{original!r} is not a Python function")
    new_lines, first = _rewrite_source(original, owner, patchset)
    src = source_of(original)
    filename = pseudo_file(patchset, path)
    start = first - 1
    module_lines = [*src.module_lines[:start], *new_lines]
    module_lines += src.module_lines[start + len(src.lines) :]
    # mtime None: linecache.checkcache never drops it (there is no file).
    linecache.cache[filename] = (sum(map(len, module_lines)), None, module_lines, filename)
    new = _compile(original, new_lines, first, filename)
    status, reason = analyse_function(new, patchset, owner)
    if status not in (Status.FIXED, Status.NOT_AFFECTED):
        raise Refusal(f"the compiled rewrite does not prove aligned ({status}: {reason})")
    new.__qualname__ = original.__qualname__
    new.__defaults__ = original.__defaults__
    new.__kwdefaults__ = original.__kwdefaults__
    new.__dict__.update({k: v for k, v in vars(original).items() if k != MARKER})
    setattr(
        new,
        MARKER,
        {
            "upstream": patchset.upstream,
            "strategy": STRATEGY,
            "original": original,
            "file": filename,
        },
    )
    return new


def install(owner: type, name: str, new: types.FunctionType) -> None:
    """Put ``new`` on ``owner`` in the descriptor kind of what it replaces."""
    attr = owner.__dict__.get(name)
    if isinstance(attr, staticmethod):
        setattr(owner, name, staticmethod(new))
    elif isinstance(attr, classmethod):
        setattr(owner, name, classmethod(new))
    else:
        setattr(owner, name, new)


def restore(owner: type, name: str) -> bool:
    """Put the original back if our patch is in effect (tests, doctor)."""
    fn = unwrap_descriptor(owner.__dict__.get(name))
    mark = getattr(fn, MARKER, None)
    if not isinstance(mark, dict):
        return False
    install(owner, name, mark["original"])
    return True
