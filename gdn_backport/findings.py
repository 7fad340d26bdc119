"""What the CI integrations report per site: where it is, and its fix as text replacements.

SARIF (:mod:`gdn_backport.sarif`) and GitHub annotations
(:mod:`gdn_backport.github_annotations`) report the sites a run leaves ``affected``
or ``unknown``. Each becomes a :class:`Finding`:

- ``where``: the call the fix changes (the spec kernel's call, or the call
  of the first helper of a ``via`` chain; a builder's classifying call; the
  call whose arguments a runner guard extends),
  found where the fix's diff first changes a call of the site's function;
  a site whose fix changes no call (a runner guard that is a new
  statement), an ``unknown`` site and an affected one with no fix are
  placed at the site's own line (``at == "site"``: a layer site names its
  function's def line, a builder or runner site its classifying call or
  its route);
- ``fix``: the patchset's own rewrite (``apply --dry-run`` of that patchset
  alone, so every fix applies to the files as they are on disk), cut into
  replacements of original lines by new text, read from the unified diff's
  hunks. Nothing else knows the fix: a result never carries a rewrite the
  pipeline did not prove.

Lines are counted as Python and SARIF count them (LF, CRLF, CR end a line);
columns are 1-based Unicode code points, the end column exclusive.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport import files
from gdn_backport.errors import UsageError
from gdn_backport.site import Site, Status

if TYPE_CHECKING:
    from gdn_backport.pipeline import Outcome

# The statuses a CI integration reports (the others need nothing done).
REPORTED = (Status.UNKNOWN, Status.AFFECTED)


@dataclass(frozen=True)
class Span:
    """A text region: 1-based lines; 1-based code-point columns, the end
    one exclusive; ``end_line`` None: the whole of ``start_line``."""

    start_line: int
    start_column: int | None = None
    end_line: int | None = None
    end_column: int | None = None


@dataclass(frozen=True)
class Replacement:
    """Replace ``deleted`` (whole original lines; empty: insert before
    ``deleted.start_line``) of the file at ``path`` by ``inserted``."""

    path: str  # tree-relative, POSIX
    deleted: Span
    inserted: str


@dataclass(frozen=True)
class Step:
    """One function of a ``via`` chain: its def line when it is in the
    site's own file (helpers of other modules are named only)."""

    name: str
    line: int | None = None


@dataclass(frozen=True)
class Finding:
    site: Site
    where: Span
    # "call": the call the fix changes; "site": the site's own line (a layer
    # site's def line; a builder's classifying call; a runner's route).
    at: str
    fix: tuple[Replacement, ...] = ()
    strategy: str = ""
    # Why an affected site carries no fix ("" when it does, and for unknown).
    no_fix: str = ""
    chain: tuple[Step, ...] = ()


@dataclass(frozen=True)
class FixRun:
    """One patchset's ``apply --dry-run`` alone: its outcome, or why it
    could not run (a usage error's message)."""

    strategy: str
    outcome: Outcome | None = None
    error: str = ""


# -- the diff ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Change:
    """One run of ``-``/``+`` lines of a hunk; lines as ``str.splitlines``
    (what :func:`gdn_backport.pipeline.unified_diff` split) numbers them."""

    path: str
    start: int  # the first deleted line, or the line the insertion goes before
    deleted: tuple[str, ...]
    inserted: tuple[str, ...]


_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _changes(diff: str) -> list[_Change]:
    """The changes of a unified diff made by ``difflib.unified_diff``;
    ValueError when it is not one (a hunk's counts do not add up)."""
    lines = diff.splitlines(keepends=True)
    out: list[_Change] = []
    path = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            path = line[4:].rstrip("\r\n").removeprefix("b/")
            i += 1
            continue
        m = _HUNK.match(line)
        if not m:
            i += 1
            continue
        old_start, old_len = int(m[1]), int(m[2] if m[2] is not None else 1)
        new_len = int(m[4] if m[4] is not None else 1)
        # An empty old range names the line before it ("-5,0": after line 5).
        at = old_start if old_len else old_start + 1
        old_left, new_left = old_len, new_len
        deleted: list[str] = []
        inserted: list[str] = []
        start = at
        i += 1
        while old_left or new_left:
            if i >= len(lines):
                raise ValueError("a hunk ends before its counts")
            body = lines[i]
            kind, text = body[:1], body[1:]
            if kind == " " and old_left and new_left:
                if deleted or inserted:
                    out.append(_Change(path, start, tuple(deleted), tuple(inserted)))
                    deleted, inserted = [], []
                at += 1
                old_left -= 1
                new_left -= 1
            elif kind == "-" and old_left:
                if not (deleted or inserted):
                    start = at
                deleted.append(text)
                at += 1
                old_left -= 1
            elif kind == "+" and new_left:
                if not (deleted or inserted):
                    start = at
                inserted.append(text)
                new_left -= 1
            else:
                raise ValueError(f"unexpected hunk line {body!r}")
            i += 1
        if deleted or inserted:
            out.append(_Change(path, start, tuple(deleted), tuple(inserted)))
    return out


# -- positions ---------------------------------------------------------------------------

_TRUE_NEWLINE = ("\r\n", "\n", "\r")


class _Text:
    """A source text's lines as ``str.splitlines`` cuts them (the diff's
    numbering) and as Python and SARIF count them (only CR, LF and CRLF end
    a line: a form feed inside a line does not)."""

    def __init__(self, text: str) -> None:
        self.pieces = text.splitlines(keepends=True)
        self.lines = re.split(r"(?<=\r\n)|(?<=\n)|(?<=\r)(?!\n)", text)
        # splitlines piece (0-based) -> (real line, code-point column), both 1-based.
        self.starts: list[tuple[int, int]] = []
        line, col = 1, 1
        for piece in self.pieces:
            self.starts.append((line, col))
            if piece.endswith(_TRUE_NEWLINE):
                line, col = line + 1, 1
            else:
                col += len(piece)
        self.end = (line, col)

    def position(self, piece: int, offset: int = 0) -> tuple[int, int]:
        """(line, column) of ``offset`` code points into the 1-based ``piece``."""
        if piece - 1 >= len(self.starts):
            return (self.end[0], self.end[1] + offset)
        line, col = self.starts[piece - 1]
        return (line, col + offset)

    def column(self, line: int, utf8_offset: int) -> int:
        """The 1-based code-point column of an ``ast`` byte offset."""
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode("utf-8")[:utf8_offset].decode("utf-8", "replace")) + 1


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _functions(module: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function with its qualified name (``Class.method``, ``f.inner``)."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(module, "")
    return found


def _def_at(
    module: ast.Module, line: int
) -> tuple[str, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    for name, fn in _functions(module):
        if line in (fn.lineno, min([fn.lineno, *(d.lineno for d in fn.decorator_list)])):
            return name, fn
    return None


def _function_of(module: ast.Module, site: Site) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The site's function: the one defined at its line (a layer site
    names its def line), else the innermost one holding its line (a
    builder's classifying call, a runner's route)."""
    found = _def_at(module, site.line)
    if found is not None:
        return found[1]
    holding = [
        (name, fn)
        for name, fn in _functions(module)
        if fn.lineno <= site.line <= (fn.end_lineno or fn.lineno)
    ]
    named = [fn for name, fn in holding if name == site.function]
    if named:
        return named[-1]
    return max((fn for _, fn in holding), key=lambda fn: fn.lineno, default=None)


def _call_span(call: ast.Call, text: _Text) -> tuple[tuple[int, int], tuple[int, int]]:
    end_line = call.end_lineno or call.lineno
    end_col = call.end_col_offset if call.end_col_offset is not None else call.col_offset
    return (
        (call.lineno, text.column(call.lineno, call.col_offset)),
        (end_line, text.column(end_line, end_col)),
    )


def _innermost_call(
    fn: ast.AST, text: _Text, pos: tuple[int, int], insertion: bool
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The span of the innermost call of ``fn`` that ``pos`` lies in. A new
    line inserted at a call's first line goes before the call, not in it."""
    best: tuple[tuple[int, int], tuple[int, int]] | None = None
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        start, end = _call_span(node, text)
        inside = (start < pos if insertion else start <= pos) and pos < end
        if inside and (best is None or (start, _neg(end)) > (best[0], _neg(best[1]))):
            best = (start, end)
    return best


def _neg(p: tuple[int, int]) -> tuple[int, int]:
    return (-p[0], -p[1])


# -- findings ----------------------------------------------------------------------------


@dataclass
class _File:
    text: _Text | None = None
    module: ast.Module | None = None
    error: str = ""


@dataclass
class _Files:
    root: Path
    read: dict[str, _File] = field(default_factory=dict)

    def get(self, rel: str) -> _File:
        if rel not in self.read:
            path = self.root / rel
            try:
                text = files.decode(path, path.read_bytes())
                self.read[rel] = _File(_Text(text), files.parse_ast(path, text))
            except (OSError, UsageError) as exc:
                self.read[rel] = _File(error=str(exc))
        return self.read[rel]


def _owner(change: _Change, spans: Sequence[tuple[Site, int, int]]) -> Site | None:
    """The site whose function holds the change (an insertion right after
    a function's last line belongs to it)."""
    for site, start, end in spans:
        if site.path != change.path:
            continue
        if change.deleted and start <= change.start <= end:
            return site
        if not change.deleted and start <= change.start <= end + 1:
            return site
    return None


def _fixes_of(
    sites: Sequence[Site], run: FixRun, got: _Files
) -> tuple[dict[Site, list[_Change]], str]:
    """Each affected site's changes from its patchset's dry run, or why
    there are none. A change outside every site's function (an import the
    kernel strategy adds) goes with the first site of its file, or of the
    patchset when its file holds none."""
    out = run.outcome
    if out is None:
        return {}, f"the fix could not be computed ({run.error})"
    if out.refused:
        path, reason = out.refused[0]
        return {}, f"apply refuses this tree ({path}: {reason})"
    if not out.diff:
        return {}, f"the patchset's dry run wrote no diff ({out.message})"
    try:
        changes = _changes(out.diff)
    except ValueError as exc:
        return {}, f"the fix's diff could not be read ({exc})"
    spans: list[tuple[Site, int, int]] = []
    for s in sites:
        f = got.get(s.path)
        fn = _function_of(f.module, s) if f.module is not None else None
        if fn is not None:
            first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
            spans.append((s, first, fn.end_lineno or fn.lineno))
    owned: dict[Site, list[_Change]] = {s: [] for s in sites}
    for change in changes:
        site = _owner(change, spans)
        if site is None:
            same = [s for s in sites if s.path == change.path]
            site = same[0] if same else sites[0]
        owned[site].append(change)
    return owned, ""


def _replacement(change: _Change, text: _Text | None) -> Replacement:
    def at(piece: int) -> tuple[int, int]:
        return text.position(piece) if text is not None else (piece, 1)

    start = at(change.start)
    end = at(change.start + len(change.deleted))
    return Replacement(
        change.path, Span(start[0], start[1], end[0], end[1]), "".join(change.inserted)
    )


def _where(site: Site, changes: Sequence[_Change], got: _Files) -> tuple[Span, str]:
    """The call the first change of a call in the site's function touches,
    else the site's own line."""
    f = got.get(site.path)
    fn = _function_of(f.module, site) if f.module is not None else None
    if fn is not None and f.text is not None:
        for change in (c for c in changes if c.path == site.path):
            prefix = _common_prefix("".join(change.deleted), "".join(change.inserted))
            piece, offset = change.start, prefix
            # The prefix may cross line ends: find its piece.
            for line in change.deleted:
                if offset < len(line):
                    break
                offset -= len(line)
                piece += 1
            pos = f.text.position(piece, offset)
            span = _innermost_call(fn, f.text, pos, insertion=not change.deleted)
            if span is not None:
                (sl, sc), (el, ec) = span
                return Span(sl, sc, el, ec), "call"
    return Span(site.line), "site"


def _chain(site: Site, got: _Files) -> tuple[Step, ...]:
    if not site.via:
        return ()
    f = got.get(site.path)
    defs = dict(_functions(f.module)) if f.module is not None else {}
    return tuple(Step(name, defs[name].lineno if name in defs else None) for name in site.via)


def findings(root: Path, sites: Sequence[Site], runs: Mapping[str, FixRun]) -> list[Finding]:
    """A finding per ``affected`` and ``unknown`` site of ``sites`` (in their
    order); ``runs``: patchset id -> its dry run (a patchset missing there
    gets no fix)."""
    got = _Files(root)
    reported = [s for s in sites if s.status in REPORTED]
    by_patchset: dict[str, list[Site]] = {}
    for s in reported:
        if s.status is Status.AFFECTED:
            by_patchset.setdefault(s.patchset, []).append(s)
    owned: dict[Site, list[_Change]] = {}
    why: dict[str, str] = {}
    for ps, affected in by_patchset.items():
        run = runs.get(ps)
        if run is None:
            why[ps] = "no fix was asked for"
            continue
        got_changes, why[ps] = _fixes_of(affected, run, got)
        owned.update(got_changes)
    out = []
    for s in reported:
        changes = owned.get(s, [])
        where, at = _where(s, changes, got)
        run = runs.get(s.patchset)
        fix = tuple(_replacement(c, got.get(c.path).text) for c in changes)
        no_fix = ""
        if s.status is Status.AFFECTED and not fix:
            no_fix = why.get(s.patchset) or "the fix changes no line of this site's function"
        out.append(
            Finding(s, where, at, fix, run.strategy if run and fix else "", no_fix, _chain(s, got))
        )
    return out
