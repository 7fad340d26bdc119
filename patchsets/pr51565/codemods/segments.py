"""A codemod of the plan over the methods it rewrites, not the whole module.

libcst's parse, visit and code generation cost seconds for a runner module
(8,000 lines) whose one call the V1 guard changes. The plan's codemods read
nothing outside the methods named by their sites but the class each is in,
the module's text (:attr:`~.base.InTree.source`), the module's indentation
and newline (for the lines they write) and, for the imports they schedule,
the module's leading imports. So libcst gets a small module instead: a
first block indented as the module's first block is (libcst takes the
module's indentation from its first indented line), then each method, its
lines verbatim, under a header naming its class; the rewritten methods go
back in place of their lines, and the scheduled imports are added by
libcst's own :class:`~libcst.codemod.visitors.AddImportsVisitor` over the
module's head (its statements up to the first one that is not an import,
which stands in for the rest). ``tests/test_pr51565_segments.py`` holds the
result to be the whole module's, byte for byte.

A module this does not know how to cut (a method sharing a line with other
code, a first block it cannot place, ...) is run whole, as before.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import secrets
import traceback
from dataclasses import dataclass

import libcst as cst
from libcst.codemod import (
    SkipFile,
    SkipReason,
    TransformExit,
    TransformFailure,
    TransformResult,
    TransformSkip,
    TransformSuccess,
)
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor

from gdn_backport.codemod import run
from gdn_backport.result import Failure, Skip, Success, of_transform

from .base import FindingCodemod, InTree


@dataclass(frozen=True)
class _Segment:
    start: int  # first line (1-based): the first decorator's, else the def's
    end: int  # last line
    header: str  # the line put before it: its class, or what its indentation needs


@dataclass(frozen=True)
class _Cut:
    segments: tuple[_Segment, ...]
    lines: tuple[str, ...]  # the module's lines, each with its own line end
    newline: str
    indent: str
    head: int  # the module's head: lines [0, head) (0: none found)


def _lines(text: str) -> list[str]:
    # The line ends ast counts (\n, \r\n, \r), kept as written.
    return io.StringIO(text, newline="").readlines()


def _first_newline(text: str) -> str | None:
    for i, ch in enumerate(text):
        if ch == "\n":
            return "\n"
        if ch == "\r":
            return "\r\n" if text[i + 1 : i + 2] == "\n" else "\r"
    return None


def _first_line(node: ast.stmt) -> int:
    decorators: list[ast.expr] = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def _starts_line(node: ast.stmt, lines: list[str]) -> str | None:
    """The indentation of ``node``'s first line when ``node`` begins it
    (nothing but spaces and tabs before it), else None."""
    line = lines[_first_line(node) - 1]
    rest = line.lstrip(" \t")
    indent = line[: len(line) - len(rest)]
    if getattr(node, "decorator_list", []):
        return indent if rest.startswith("@") else None
    return indent if len(indent) == node.col_offset else None


def _first_indent(module: ast.Module, lines: list[str]) -> str | None:
    """The indentation of the module's first indented block (its first
    INDENT token: a top-level statement's first block on lines of its own);
    None where this cannot tell."""
    for stmt in module.body:
        if isinstance(stmt, ast.Match):
            return None  # its block starts at a ``case``, which ast does not place
        found: list[object] = [getattr(stmt, "body", None)]
        found += [h.body for h in getattr(stmt, "handlers", ())]
        found += [getattr(stmt, "orelse", None), getattr(stmt, "finalbody", None)]
        blocks: list[list[ast.stmt]] = [
            b for b in found if isinstance(b, list) and b and isinstance(b[0], ast.stmt)
        ]
        if not blocks:
            continue
        indent = _starts_line(blocks[0][0], lines)
        if indent:
            return indent
        if len(blocks) > 1:
            return None  # ``if x: y`` with an ``else:`` block: not worth placing
    return None


def _ends_line(node: ast.stmt, lines: list[str]) -> bool:
    """Nothing but a comment follows ``node`` on its last line."""
    assert node.end_lineno is not None and node.end_col_offset is not None
    rest = lines[node.end_lineno - 1].encode("utf-8", "surrogatepass")[node.end_col_offset :]
    rest = rest.strip(b" \t\r\n\f")
    return not rest or rest.startswith(b"#")


def _sites(module: ast.Module, quals: set[str]) -> list[tuple[str | None, ast.stmt]]:
    """The functions the codemod walks for ``quals``, in source order: a
    function not inside another (``Class.name`` by its innermost class, or
    ``name``), wherever blocks and classes put it (see
    :meth:`~.base.FindingCodemod.visit_FunctionDef`)."""
    found: list[tuple[str | None, ast.stmt]] = []

    def walk(body: list[ast.stmt], cls: str | None) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                if (f"{cls}.{stmt.name}" if cls else stmt.name) in quals:
                    found.append((cls, stmt))
                continue
            if isinstance(stmt, ast.ClassDef):
                walk(stmt.body, stmt.name)
                continue
            for name in ("body", "orelse", "finalbody"):
                block = getattr(stmt, name, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    walk(block, cls)
            for handler in getattr(stmt, "handlers", ()):
                walk(handler.body, cls)
            for case in getattr(stmt, "cases", ()):
                walk(case.body, cls)

    walk(module.body, None)
    return found


def _head(module: ast.Module) -> int:
    """Where the module's head ends (a line index): after its first
    statement and the imports that follow it alone on their lines, before
    the next statement's first line; 0 where there is none."""
    body = module.body
    i = 1
    while i < len(body) and isinstance(body[i], ast.Import | ast.ImportFrom):
        later = body[i + 1] if i + 1 < len(body) else None
        end = body[i].end_lineno
        assert end is not None
        alone = body[i].lineno > (body[i - 1].end_lineno or 0) and (
            later is None or _first_line(later) > end
        )
        if not alone:
            break
        i += 1
    if i >= len(body) or _first_line(body[i]) <= (body[i - 1].end_lineno or 0):
        return 0
    return _first_line(body[i]) - 1


def _cut(text: str, module: ast.Module, quals: set[str], marker: str, imports: bool) -> _Cut | None:
    lines = _lines(text)
    newline = _first_newline(text)
    indent = _first_indent(module, lines)
    if not lines or not text.endswith(("\n", "\r")) or newline is None or indent is None:
        return None
    head = _head(module)
    segments: list[_Segment] = []
    for cls, node in _sites(module, quals):
        own = _starts_line(node, lines)
        if own is None or not _ends_line(node, lines):
            return None
        if cls is not None:
            if not own:
                return None
            header = f"class {cls}:  # {marker}{newline}"
        else:
            header = f"if 1:  # {marker}{newline}" if own else f"# {marker}{newline}"
        assert node.end_lineno is not None
        start = _first_line(node)
        if segments and start <= segments[-1].end:
            return None
        segments.append(_Segment(start, node.end_lineno, header))
    if not segments or (imports and (head == 0 or head >= segments[0].start)):
        return None
    return _Cut(tuple(segments), tuple(lines), newline, indent, head)


def _transform(codemod: FindingCodemod, cut: _Cut, marker: str) -> str:
    """The module with ``codemod`` run over its methods (raises what the
    codemod raises)."""
    prelude = f"if 1:{cut.newline}{cut.indent}pass{cut.newline}"
    small = prelude + "".join(
        s.header + "".join(cut.lines[s.start - 1 : s.end]) for s in cut.segments
    )
    module = cst.parse_module(small)
    if (module.default_indent, module.default_newline) != (cut.indent, cut.newline):
        raise AssertionError("the methods' module does not read as the module's layout")
    new = codemod.transform_module_impl(module)
    out = _lines(new.code)
    marks = [i for i, line in enumerate(out) if marker in line]
    if len(marks) != len(cut.segments) or "".join(out[: marks[0]]) != prelude:
        raise AssertionError("the rewrite changed what stands around the methods")
    lines = list(cut.lines)
    for k in reversed(range(len(cut.segments))):
        seg = cut.segments[k]
        if out[marks[k]] != seg.header:
            raise AssertionError("the rewrite changed a method's header")
        stop = marks[k + 1] if k + 1 < len(marks) else len(out)
        lines[seg.start - 1 : seg.end] = out[marks[k] + 1 : stop]
    if RemoveImportsVisitor.CONTEXT_KEY in codemod.context.scratch:
        raise AssertionError("an import removal scheduled: the whole module would be needed")
    if AddImportsVisitor.CONTEXT_KEY not in codemod.context.scratch:
        return "".join(lines)
    if not codemod.IMPORTS:
        raise AssertionError(
            f"{type(codemod).__name__} scheduled an import but says IMPORTS = False"
        )
    # The statement after the head is the first the visitor does not read
    # as an import; a stand-in takes its place (and keeps its leading lines).
    stand_in = f"pass{cut.newline}"
    head = cst.parse_module("".join(lines[: cut.head]) + stand_in)
    added = AddImportsVisitor(codemod.context).transform_module_impl(head).code
    if not added.endswith(stand_in):
        raise AssertionError("the imports' stand-in statement moved")
    return added[: -len(stand_in)] + "".join(lines[cut.head :])


def run_on_methods(
    codemod: type[FindingCodemod], within: InTree, module: ast.Module
) -> Success[str] | Skip | Failure:
    """``codemod`` over the module ``within.source`` (parsed: ``module``) as
    libcst's runner gives it over the whole module."""
    text = within.source
    quals = {f.function for f in within.findings if f.kind == codemod.KIND}
    marker = f"gdn-backport-methods-{secrets.token_hex(8)}"
    while marker in text:
        marker = f"gdn-backport-methods-{secrets.token_hex(8)}"
    cut = _cut(text, module, quals, marker, codemod.IMPORTS) if quals else None
    inst = codemod(within=dataclasses.replace(within, module=module))
    if cut is None or inst.get_inherited_dependencies() or inst.should_allow_multiple_passes():
        return run(codemod(within=within), text)
    # What libcst's ``transform_module`` does with what the codemod raises.
    result: TransformResult
    try:
        result = TransformSuccess(
            code=_transform(inst, cut, marker), warning_messages=inst.context.warnings
        )
    except KeyboardInterrupt:
        result = TransformExit()
    except SkipFile as ex:
        result = TransformSkip(
            skip_description=str(ex),
            skip_reason=SkipReason.OTHER,
            warning_messages=inst.context.warnings,
        )
    except Exception as ex:
        result = TransformFailure(
            error=ex, traceback_str=traceback.format_exc(), warning_messages=inst.context.warnings
        )
    return of_transform(result, codemod.__name__)
