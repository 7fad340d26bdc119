"""Where pr51812's analysis looks: candidate files and functions.

A file is a candidate when it names a spec-token field (index or state
slots) and defines a function (:func:`may_hold_site`); ``ast`` then names
the functions whose source mentions one; only those are parsed with libcst
and walked (:mod:`.sites`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from gdn_backport import ahead, files
from gdn_backport.cst_nodes import children_of
from gdn_backport.errors import UsageError

from .config import Patchset


@dataclass(frozen=True)
class Candidate:
    qualname: str  # Class.method, outer.inner
    occurrence: int  # how many earlier functions in the file share qualname
    line: int  # the ``def`` line
    start: int  # first line of the function, decorators included
    end: int
    col: int


def markers(patchset: Patchset) -> tuple[bytes, ...]:
    """The sieve's rule: a file names a spec-token field (index or state
    slots) and defines a function (a site is one). A caller that only gathers
    by the index and a helper in another file that only reads the slots are
    both looked at, so neither is missed."""
    f = patchset.fields
    return _markers(frozenset({*f.spec_index, *f.spec_state}))


@functools.lru_cache(maxsize=8)
def _markers(names: frozenset[str]) -> tuple[bytes, ...]:
    # A name holding another (``spec_state_indices_tensor``) marks nothing more.
    kept = {n for n in names if not any(o != n and o in n for o in names)}
    return tuple(name.encode() for name in sorted(kept))


def may_hold_site(data: bytes, patchset: Patchset) -> bool:
    """``data`` may hold a site: a file that fails this cannot."""
    if b"def " not in data:
        return False
    marks = markers(patchset)
    # What every marker holds, looked for first: most files have none, and
    # one pass then answers for all the markers (the same answer).
    shared = _shared(marks)
    return (not shared or shared in data) and any(m in data for m in marks)


@functools.lru_cache(maxsize=8)
def _shared(marks: tuple[bytes, ...]) -> bytes:
    """The longest run of bytes every one of ``marks`` holds (``spec_``)."""
    if not marks:
        return b""
    first = min(marks, key=len)
    for size in range(len(first), 0, -1):
        for at in range(len(first) - size + 1):
            part = first[at : at + size]
            if all(part in m for m in marks):
                return part
    return b""


def mentions_fields(data: bytes, patchset: Patchset) -> bool:
    """The bytes name a spec-token field, index or state slots (the sieve)."""
    return may_hold_site(data, patchset)


def read_candidate(path: Path, patchset: Patchset) -> bytes | None:
    """The file's bytes if it may hold a site (:func:`may_hold_site`), else
    None, without keeping a large file that fails the rule
    (:func:`gdn_backport.files.read_marked`)."""
    return files.read_marked(path, markers(patchset))


def function_node(lines: list[str], cand: Candidate) -> cst.FunctionDef:
    """The candidate parsed on its own with libcst.

    An indented method is wrapped in ``if 1:`` so its own indentation stays
    valid; parsing one function instead of the whole file keeps scan fast.
    """
    node = _function_parse(*function_text(lines, cand))
    if node is None:
        raise UsageError(f"line {cand.line}: expected a function definition")
    return node


def function_text(lines: list[str], cand: Candidate) -> tuple[str, bool]:
    """What :func:`function_node` parses: the candidate's text, and whether
    it is indented."""
    text = "".join(lines[cand.start - 1 : cand.end])
    if not text.endswith("\n"):
        text += "\n"
    return text, bool(cand.col)


def feed_key(text: str, indented: bool) -> str:
    """The name of a function's parse among the values a forked child
    offers (:mod:`gdn_backport.ahead`): its whole input."""
    return f"pr51812.function\0{int(indented)}\0{text}"


@functools.lru_cache(maxsize=256)
def _function_parse(text: str, indented: bool) -> cst.FunctionDef | None:
    # libcst nodes are immutable: the same function's text parses once per
    # process (an apply analyses its tree three times: scan, rewrite, proof).
    # A child running beside may have parsed it already (:mod:`.preparse`).
    fed = ahead.offered(feed_key(text, indented))
    if isinstance(fed, cst.FunctionDef):
        return fed
    return parse_function(text, indented)


def parse_function(text: str, indented: bool) -> cst.FunctionDef | None:
    """The function ``text`` defines, parsed with libcst (None: it is no
    function definition)."""
    if indented:
        module = cst.parse_module("if 1:\n" + text)
        wrapper = module.body[0]
        assert isinstance(wrapper, cst.If) and isinstance(wrapper.body, cst.IndentedBlock)
        node = wrapper.body.body[0]
    else:
        node = cst.parse_module(text).body[0]
    return node if isinstance(node, cst.FunctionDef) else None


BLOCKS = (
    cst.BaseSuite,
    cst.BaseCompoundStatement,
    cst.Else,
    cst.ExceptHandler,
    cst.ExceptStarHandler,
    cst.Finally,
    cst.MatchCase,
)


def index_functions(module: cst.Module) -> list[tuple[str, int, cst.FunctionDef]]:
    """(qualname, occurrence, node) of every function, in source order; the
    same names and order as :func:`candidates` gives from ``ast``."""
    found: list[tuple[str, int, cst.FunctionDef]] = []
    seen: dict[str, int] = {}

    def visit(node: cst.CSTNode, prefix: str) -> None:
        for child in children_of(node):
            if isinstance(child, cst.ClassDef):
                visit(child, f"{prefix}{child.name.value}.")
            elif isinstance(child, cst.FunctionDef):
                qual = f"{prefix}{child.name.value}"
                occurrence = seen.get(qual, 0)
                seen[qual] = occurrence + 1
                found.append((qual, occurrence, child))
                visit(child, f"{qual}.")
            elif isinstance(child, BLOCKS):
                visit(child, prefix)

    visit(module, "")
    return found
