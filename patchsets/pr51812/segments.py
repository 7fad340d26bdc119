"""A huge module read by the top-level statements that can matter (issue 24 D14).

``ast.parse`` of a 10 MB module takes tens of seconds and 2 GB; the analysis
reads a handful of its functions. Above :data:`SEGMENT_CHARS` a module is
split at its top-level statements by one pass over its text (strings,
comments, brackets and backslash continuations tracked, so a ``def`` inside
a string or a call's arguments is no statement), and only the statements
that can matter are parsed:

* every import and compound statement at module level (``if``, ``try``,
  ``for``, ``with``, ...: they may bind the module's names);
* every statement that names a seed (a spec field, a kernel);
* to a fixpoint, every statement binding a name that a chosen one reads
  (its helpers, base classes, decorators, tables), every class defining a
  method of a name a chosen one reads, and every statement mentioning a
  module-level name a chosen one binds or an attribute it stores (the
  sweep's readers of a tainted name, the callers of a chosen function, and
  every other definition of the same name, so occurrences count alike).

Names the rest of the tree asks for later (``from big import helper``) are
added on demand (:meth:`Segmented.want`). What is parsed keeps its true
line numbers. A segment that does not parse, or a text the pass cannot
split (unbalanced brackets), is parsed whole (the syntax error is then the
file's, as for any module); a syntax error in a statement that is never
read is not seen (the file is not rewritten either: ``plan.MAX_REWRITE_BYTES``).
"""

from __future__ import annotations

import ast
import bisect
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

# Larger texts are read in segments: vLLM's largest module is 0.35 MiB; apply
# rewrites nothing above 2 MiB (``plan.MAX_REWRITE_BYTES``).
SEGMENT_CHARS = 2 * 1024 * 1024

# Comments and strings (their brackets, quotes and lines are not code).
_OPAQUE = re.compile(
    r"""
    \#[^\n]*
    | \"\"\"[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*\"\"\"
    | '''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''
    | "[^"\\\n]*(?:\\.[^"\\\n]*)*"
    | '[^'\\\n]*(?:\\.[^'\\\n]*)*'
    """,
    re.VERBOSE | re.DOTALL,
)
# A line starting at column 0 with a name or a decorator (no lookbehind: a
# pattern with a literal first character is searched for at C speed).
_LINE = re.compile(r"\n(?=[A-Za-z_@])")
# A line at column 0 that continues the statement before it.
_CLAUSE = re.compile(r"(?:else|elif|except|finally)\b")
_COMPOUND = re.compile(r"(?:import|from|if|try|for|while|with|match|async[ \t]+(?:for|with))\b")
_DEF = re.compile(r"^(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)", re.MULTILINE)
_METHOD = re.compile(r"^[ \t]+(?:async[ \t]+)?def[ \t]+(\w+)", re.MULTILINE)
_WORD = re.compile(r"\w+")


@dataclass
class _Split:
    """The text's top-level statements: where each starts, its first line,
    what it binds, which are always read, which define a method of a name."""

    starts: list[int]
    lines: list[int]
    binds: dict[str, list[int]] = field(default_factory=dict)
    methods: dict[str, list[int]] = field(default_factory=dict)
    always: list[int] = field(default_factory=list)


def _split(text: str) -> _Split | None:
    """The top-level statement starts of ``text``; None where the pass cannot
    tell them (brackets that do not balance)."""
    code = _OPAQUE.sub(lambda m: " " * (m.end() - m.start()), text)
    count = code.count
    starts = [0]
    depth, before = 0, 0
    for m in _LINE.finditer(code):
        at = m.end()
        if code[at - 2] == "\\" or (code[at - 2] == "\r" and code[at - 3] == "\\"):
            continue  # a backslash continuation
        depth += (count("(", before, at) + count("[", before, at) + count("{", before, at)) - (
            count(")", before, at) + count("]", before, at) + count("}", before, at)
        )
        before = at
        if depth < 0:
            return None
        if depth == 0:
            starts.append(at)
    opened = count("(") + count("[") + count("{")
    if opened != count(")") + count("]") + count("}"):
        return None
    kept = [0]
    decorating = code.startswith("@")
    for s in starts[1:]:
        if _CLAUSE.match(code, s):
            continue
        if decorating:
            # A decorator and what it decorates are one statement.
            decorating = code.startswith("@", s)
            continue
        kept.append(s)
        decorating = code.startswith("@", s)
    lines = []
    line, at = 1, 0
    for s in kept:
        line += text.count("\n", at, s)  # the text's: a string's lines count
        at = s
        lines.append(line)
    out = _Split(kept, lines)
    ends = [*kept[1:], len(code)]
    for i, (s, e) in enumerate(zip(kept, ends, strict=True)):
        defines = code.startswith(("@", "def", "async", "class"), s)
        head = _DEF.search(code, s, e) if defines else None
        if head is not None and (head.start() == s or code.startswith("@", s)):
            out.binds.setdefault(head[1], []).append(i)
        elif _COMPOUND.match(code, s):
            out.always.append(i)
        else:
            # An assignment or an expression: what its first line names.
            first = code.find("\n", s, e)
            for w in _WORD.findall(code, s, first if first != -1 else e):
                out.binds.setdefault(w, []).append(i)
    for m in _METHOD.finditer(code):
        out.methods.setdefault(m[1], []).append(bisect.bisect_right(kept, m.start()) - 1)
    return out


@functools.lru_cache(maxsize=4)
def _split_cached(text: str) -> _Split | None:
    return _split(text)


class Segmented:
    """The statements of a huge module read so far, and their ``ast``."""

    def __init__(self, text: str, split: _Split, seeds: Iterable[str]) -> None:
        self.text = text
        self.split = split
        self.chosen: set[int] = set()
        self._parsed: dict[int, list[ast.stmt]] = {}
        self._mentioned: set[str] = set()
        self._read: set[str] = set()
        self.failed = False
        # Seeds are looked for as the analysis looks for them: anywhere in
        # the text (``non_spec_state_indices_tensor`` names a spec field).
        self._add([*split.always, *self._mentioning(set(seeds), words=False)])

    def tree(self) -> ast.Module | None:
        """The chosen statements in source order; None where one does not
        parse (the caller parses the whole text)."""
        if self.failed:
            return None
        body = [s for i in sorted(self.chosen) for s in self._parsed[i]]
        return ast.Module(body=body, type_ignores=[])

    def want(self, name: str) -> bool:
        """Read the statements binding ``name`` too; whether any was added."""
        before = len(self.chosen)
        self._add([*self.split.binds.get(name, ()), *self.split.methods.get(name, ())])
        return len(self.chosen) != before

    def _segment(self, i: int) -> str:
        starts = self.split.starts
        end = starts[i + 1] if i + 1 < len(starts) else len(self.text)
        return self.text[starts[i] : end]

    def _mentioning(self, names: set[str], words: bool = True) -> Iterator[int]:
        """The statements whose text holds one of ``names`` (as a word)."""
        names -= self._mentioned
        self._mentioned |= names
        text, starts = self.text, self.split.starts
        for name in names:
            at = text.find(name)
            while at != -1:
                end = at + len(name)
                if not words or not (_word(text, at - 1) or _word(text, end)):
                    yield bisect.bisect_right(starts, at) - 1
                at = text.find(name, end)

    def _add(self, todo: Iterable[int]) -> None:
        queue = [i for i in dict.fromkeys(todo) if i not in self.chosen]
        while queue and not self.failed:
            new: list[int] = []
            reads: set[str] = set()
            binds: set[str] = set()
            for i in queue:
                if i in self.chosen:
                    continue
                self.chosen.add(i)
                try:
                    module = ast.parse(self._segment(i))
                except (SyntaxError, ValueError):
                    self.failed = True
                    return
                ast.increment_lineno(module, self.split.lines[i] - 1)
                self._parsed[i] = module.body
                new.append(i)
                r, b = _names(module.body)
                reads |= r
                binds |= b
            reads -= self._read
            self._read |= reads
            found = [j for n in reads for j in self.split.binds.get(n, ())]
            found += [j for n in reads for j in self.split.methods.get(n, ())]
            found += self._mentioning(binds)
            queue = [j for j in dict.fromkeys(found) if j not in self.chosen]


def _word(text: str, at: int) -> bool:
    """The character at ``at`` can be part of a name."""
    return 0 <= at < len(text) and (text[at].isalnum() or text[at] == "_")


def _names(body: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """What statements read (names, attributes) and bind at module level
    (names; attributes stored anywhere in them)."""
    reads: set[str] = set()
    binds: set[str] = set()
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Name):
            reads.add(node.id)
        elif isinstance(node, ast.Attribute):
            reads.add(node.attr)
            if not isinstance(node.ctx, ast.Load):
                binds.add(node.attr)
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            binds.add(node.name)
            continue
        if isinstance(node, ast.Lambda | ast.comprehension):
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            binds.add(node.id)
        elif isinstance(node, ast.alias):
            binds.add((node.asname or node.name).split(".")[0])
        stack.extend(ast.iter_child_nodes(node))
    return reads, binds


def read(text: str, seeds: Iterable[str]) -> Segmented | None:
    """``text`` read in segments, or None where it is small or cannot be split."""
    if len(text) <= SEGMENT_CHARS:
        return None
    split = _split_cached(text)
    if split is None or len(split.starts) < 2:
        return None
    segmented = Segmented(text, split, seeds)
    return None if segmented.failed else segmented
