"""Find and judge, by reading the code, how a tree classifies rows with no
prior state (vLLM PR #51565).

Two kinds of site:

**Builders.** A class method ``build`` that calls the split function
(``split_decodes_and_prefills``) and fills a GDN-family metadata field. Its
verdict comes from the split call:

- no ``treat_short_extends_as_decodes=False``: rows are classified by query
  length alone, a new request's one-token first chunk is a decode and reads
  its recycled slot unmasked: ``affected``;
- ``treat_short_extends_as_decodes=False`` on metadata whose
  ``is_prefilling`` was replaced by a value compared against a prior-state
  field (``seq_lens_cpu_upper_bound <= query_lens``, ...): ``fixed``;
- the same on the runner's own ``is_prefilling`` (every prompt chunk a
  prefill, as vLLM's Mamba builders do): ``not_affected``;
- ``decode_threshold=0``: no decodes at all, ``not_affected``;
- anything else, or a family builder with no split call: ``unknown``.

``fixed`` is said of an exact rule only: a conjunction of
``upper <= query_lens`` (or ``computed == 0``), optionally ``query_lens > 0``,
and ``is_prefilling`` of the split's own metadata, where the query lengths
are ``query_start_loc_cpu``'s difference and no operand carries arithmetic;
the threshold 1 (or the split's default); the rule's variable assigned once
and written after only by the gate (``&= m.is_prefilling``, zeros when it
is None), used nowhere else. A ``fixed`` or ``not_affected`` split's four
counts must reach the metadata as the split returned them (upstream's
trailing-padding correction aside). Anything else is ``unknown``.

A ``fixed`` or ``not_affected`` builder must also not count one-token rows
as decodes by length elsewhere in ``build`` (the spec branch of 0.10-0.17
did): such a count needs a later reset to 0 in the same block, else the
site is ``unknown``.

**Runners.** Where a step may replay a FULL decode CUDA graph for a batch
whose rows all have the decode length: V1's dispatch call of a real step
(``_determine_batch_execution_and_padding`` without ``force_uniform_decode``)
and V2's ``get_uniform_token_count``. The builder fills the graph's
persistent decode buffers only when it reports no prefill, so once it calls
a one-token row a prefill that replay runs on the previous step's buffers.
A runner is ``fixed`` when the route is closed to batches with a row that
has no computed tokens (our guard: ``force_uniform_decode=False if ...
num_computed_tokens_cpu ... == 0 ...``; for V2 a following ``if`` that sets
the count to None), ``affected`` when it is open and some builder of the
tree may call a one-token row a prefill (a half fix: 0.31.0-0.33.0 ship
it), ``unknown`` beside a builder the analysis cannot read, else
``not_affected`` (the builder calls every one-token row a decode, as the
route assumes).

Nothing here is a version lookup: a fork with the same code gets the same
verdict, and one that differs gets ``unknown`` rather than a guess.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gdn_backport.site import Status

from .config import Config

PATCHSET = "pr51565"


@dataclass(frozen=True)
class Finding:
    """A site as the analysis of one module sees it."""

    kind: str  # "builder", "runner_v1" or "runner_v2"
    function: str  # Class.method
    line: int
    status: Status
    reason: str
    # builder: may call a one-token row a prefill; runner: the route is guarded.
    reclassifies: bool = False
    guarded: bool = False


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _calls(node: ast.AST, name: str) -> Iterator[ast.Call]:
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and _name(n.func) == name:
            yield n


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _attrs(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name)
    }


def _methods(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef):
                    yield f"{cls.name}.{fn.name}", fn


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


# -- flow: which statements run before and after one -----------------------------

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
# Methods that change the array they are called on (besides torch's ``x.op_()``).
_IN_PLACE = frozenset(
    {"fill", "put", "itemset", "resize", "sort", "partition", "setflags", "setfield"}
)
# Functions that write their first argument (numpy's).
_WRITES_FIRST = frozenset({"copyto", "putmask", "place", "fill_diagonal", "put"})
_Level = tuple[list[ast.stmt], int]


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement blocks directly inside ``stmt`` (none for a nested scope)."""
    if isinstance(stmt, _SCOPES):
        return []
    out = [getattr(stmt, f, None) for f in ("body", "orelse", "finalbody")]
    out += [h.body for h in getattr(stmt, "handlers", [])]
    out += [c.body for c in getattr(stmt, "cases", [])]
    return [b for b in out if isinstance(b, list) and b]


def _path(block: list[ast.stmt], target: ast.stmt) -> list[_Level] | None:
    """Where ``target`` lies: (block, index) from its own block outwards."""
    for i, stmt in enumerate(block):
        if stmt is target:
            return [(block, i)]
        for inner in _blocks(stmt):
            found = _path(inner, target)
            if found is not None:
                return [*found, (block, i)]
    return None


def _root(node: ast.expr) -> str | None:
    """The name an attribute or subscript chain starts from (``x`` of ``x.a[0]``)."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _write(node: ast.AST, name: str) -> ast.AST | None:
    """The first node below ``node`` that may change what the local ``name``
    holds: a store or delete of it or of a part of it (``x = ``, ``x op=``,
    ``x[...] = ``, ``for x``), an in-place method (``x.fill_()``,
    ``x.fill()``), ``out=x``, numpy's ``copyto(x, ...)``."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name | ast.Attribute | ast.Subscript) and isinstance(
            n.ctx, ast.Store | ast.Del
        ):
            if (n.id if isinstance(n, ast.Name) else _root(n)) == name:
                return n
        elif isinstance(n, ast.Call):
            f = n.func
            if (
                isinstance(f, ast.Attribute)
                and _root(f.value) == name
                and (f.attr.endswith("_") or f.attr in _IN_PLACE)
            ):
                return n
            if any(k.arg == "out" and _root(k.value) == name for k in n.keywords):
                return n
            if _name(f) in _WRITES_FIRST and n.args and _root(n.args[0]) == name:
                return n
        elif isinstance(n, ast.Global | ast.Nonlocal) and name in n.names:
            return n
    return None


def _plain(stmt: ast.stmt, name: str) -> ast.expr | None:
    """The value of ``name = value`` (or ``name: T = value``), else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        if isinstance(target, ast.Name) and target.id == name:
            return stmt.value
    if (
        isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and stmt.target.id == name
    ):
        return stmt.value
    return None


class _Flow:
    """One function's statements: the statement a node lies in, what runs
    before it (nearest first) and after it, and which assignment a name
    holds at a statement."""

    def __init__(self, fn: ast.FunctionDef) -> None:
        self.fn = fn
        self.params = _params(fn)
        self.parents = {c: p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}

    def stmt_of(self, node: ast.AST) -> ast.stmt | None:
        cur: ast.AST | None = node
        while cur is not None and cur is not self.fn:
            if isinstance(cur, ast.stmt):
                return cur
            cur = self.parents.get(cur)
        return None

    def path(self, stmt: ast.stmt) -> list[_Level] | None:
        return _path(self.fn.body, stmt)

    @staticmethod
    def loop(path: list[_Level]) -> ast.stmt | None:
        """The innermost loop the statement at ``path`` runs in."""
        return next((b[i] for b, i in path[1:] if isinstance(b[i], _LOOPS)), None)

    @staticmethod
    def before(path: list[_Level]) -> Iterator[ast.stmt]:
        for block, i in path:
            yield from reversed(block[:i])

    @staticmethod
    def after(path: list[_Level]) -> Iterator[ast.stmt]:
        for level, (block, i) in enumerate(path):
            yield from block[i + 1 :]
            if level + 1 < len(path):
                outer, j = path[level + 1]
                if getattr(outer[j], "handlers", None):  # a try: its other blocks may follow
                    for other in _blocks(outer[j]):
                        if other is not block:
                            yield from other

    def followed(self, name: str, stmt: ast.stmt) -> list[_Level] | str:
        """The path to ``stmt``, where ``name`` can be followed to it: else
        why not (no path, or a write of ``name`` in a loop around it)."""
        path = self.path(stmt)
        if path is None:
            return f"cannot follow {name} to line {stmt.lineno}"
        loop = self.loop(path)
        if loop is not None and _write(loop, name) is not None:
            return f"{name} is written in the loop at line {loop.lineno}"
        return path

    def reaching(self, name: str, stmt: ast.stmt) -> ast.stmt | str | None:
        """The ``name = value`` statement whose value ``name`` holds when
        ``stmt`` runs; None for a parameter nothing wrote before; else why
        the analysis cannot tell (another kind of write comes first, a
        write in a branch, a loop)."""
        path = self.followed(name, stmt)
        if isinstance(path, str):
            return path
        for s in self.before(path):
            if _write(s, name) is None:
                continue
            if _plain(s, name) is not None:
                return s
            return f"line {s.lineno} writes {name} in a way the analysis does not follow"
        if name in self.params:
            return None
        return f"{name} is not assigned before line {stmt.lineno}"

    def value(self, node: ast.expr, at: ast.stmt) -> tuple[ast.expr, ast.stmt] | None:
        """A name's assigned value (and its statement) where ``at`` reads it."""
        if not isinstance(node, ast.Name):
            return None
        found = self.reaching(node.id, at)
        if not isinstance(found, ast.stmt):
            return None
        value = _plain(found, node.id)
        assert value is not None
        return value, found


# -- builders ---------------------------------------------------------------------


@dataclass
class _Handed:
    """What the split call's metadata argument carries as ``is_prefilling``:
    ``value`` the expression it was replaced with (read at ``at``), None for
    the runner's own; ``meta`` the names the metadata goes by."""

    value: ast.expr | None
    at: ast.stmt
    meta: frozenset[str]


def _aliases(flow: _Flow, name: str, at: ast.stmt) -> frozenset[str]:
    """``name`` and the names it was assigned from (``m = common``)."""
    out = {name}
    while len(out) < 4:
        found = flow.value(ast.Name(id=name, ctx=ast.Load()), at)
        if found is None or not isinstance(found[0], ast.Name):
            break
        name, at = found[0].id, found[1]
        out.add(name)
    return frozenset(out)


def _handed(flow: _Flow, node: ast.expr, at: ast.stmt, depth: int = 0) -> _Handed | str:
    if depth > 4:
        return "the metadata handed to the split is replaced too many times to follow"
    if isinstance(node, ast.Call) and _name(node.func) == "replace":
        if isinstance(node.func, ast.Attribute):
            base: ast.expr = node.func.value
        elif node.args:
            base = node.args[0]
        else:
            return f"{ast.unparse(node)}: which metadata is replaced"
        value = _keyword(node, "is_prefilling")
        if value is None:
            return _handed(flow, base, at, depth + 1)
        if not isinstance(base, ast.Name):
            return f"{ast.unparse(base)}.replace(...): metadata that is not a name"
        return _Handed(value, at, _aliases(flow, base.id, at))
    if isinstance(node, ast.Name):
        found = flow.reaching(node.id, at)
        if isinstance(found, str):
            return found
        if found is None:  # a parameter: the metadata as the runner filled it
            return _Handed(None, at, frozenset({node.id}))
        value = _plain(found, node.id)
        assert value is not None
        return _handed(flow, value, found, depth + 1)
    return f"cannot tell which is_prefilling {ast.unparse(node)} carries"


@dataclass
class _Rule:
    """What the value handed as ``is_prefilling`` selects, as a conjunction."""

    meta: frozenset[str]  # the names the split's metadata goes by
    prior: bool = False  # a conjunct selects rows without prior state
    gate: bool = False  # a conjunct is is_prefilling (capture dummies stay decodes)
    bad: str = ""  # why it is not a conjunction this analysis can vouch for


def _is_int(x: ast.expr, value: int) -> bool:
    """``x`` is the integer literal ``value`` (not ``False``/``True``)."""
    return isinstance(x, ast.Constant) and type(x.value) is int and x.value == value


def _is_gate(node: ast.expr, meta: frozenset[str]) -> bool:
    """``m.is_prefilling`` of the split's own metadata."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "is_prefilling"
        and isinstance(node.value, ast.Name)
        and node.value.id in meta
    )


def _field(
    node: ast.expr, names: frozenset[str], flow: _Flow, at: ast.stmt, meta: frozenset[str]
) -> bool:
    """``node`` is the metadata's field (``m.f``, or a local assigned
    ``m.f`` that nothing wrote since): whole, no slice or arithmetic."""
    for _ in range(4):
        if isinstance(node, ast.Attribute):
            return node.attr in names and isinstance(node.value, ast.Name) and node.value.id in meta
        found = flow.value(node, at)
        if found is None:
            return False
        node, at = found
    return False


def _slice_of(node: ast.expr, lower: int | None, upper: int | None) -> ast.expr | None:
    """``x`` of ``x[lower:upper]`` (no step), else None."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)):
        return None
    sl = node.slice

    def bound(b: ast.expr | None, want: int | None) -> bool:
        if want is None:
            return b is None
        if want < 0:
            return (
                isinstance(b, ast.UnaryOp)
                and isinstance(b.op, ast.USub)
                and b.operand is not None
                and _is_int(b.operand, -want)
            ) or (b is not None and _is_int(b, want))
        return b is not None and _is_int(b, want)

    if sl.step is None and bound(sl.lower, lower) and bound(sl.upper, upper):
        return node.value
    return None


def _query_lens(node: ast.expr, flow: _Flow, at: ast.stmt, meta: frozenset[str]) -> bool:
    """``node`` is the rows' query lengths, derived from the metadata's
    ``query_start_loc_cpu`` in a way the analysis knows: ``q.diff()``,
    ``torch.diff(q)``, ``q[1:] - q[:-1]`` (or a local assigned one, nothing
    written since)."""
    names = frozenset({"query_start_loc_cpu"})
    for _ in range(4):
        if isinstance(node, ast.Call) and not node.keywords:
            if isinstance(node.func, ast.Attribute) and node.func.attr == "diff" and not node.args:
                return _field(node.func.value, names, flow, at, meta)
            if _name(node.func) == "diff" and len(node.args) == 1:
                return _field(node.args[0], names, flow, at, meta)
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            hi, lo = _slice_of(node.left, 1, None), _slice_of(node.right, None, -1)
            return (
                hi is not None
                and lo is not None
                and _field(hi, names, flow, at, meta)
                and _field(lo, names, flow, at, meta)
            )
        found = flow.value(node, at)
        if found is None:
            return False
        node, at = found
    return False


_MIRROR: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.Gt,
    ast.Gt: ast.Lt,
    ast.LtE: ast.GtE,
    ast.GtE: ast.LtE,
    ast.Eq: ast.Eq,
    ast.NotEq: ast.NotEq,
}


def _compare_kind(node: ast.Compare, flow: _Flow, at: ast.stmt, cfg: Config, rule: _Rule) -> str:
    """``prior`` (true on every one-token row without prior state, and the
    rule's reason to reclassify), ``positive`` (a query length above 0: true
    on every one-token row), else why the analysis cannot vouch for it.
    Operands are the fields and lengths themselves: no arithmetic, no other
    constant. ``upper <= 1`` is ``upper <= query_len`` on the only rows the
    rule decides (a threshold of 1: longer rows are prefills anyway)."""
    text = ast.unparse(node)
    if len(node.ops) != 1 or type(node.ops[0]) not in _MIRROR:
        return f"{text} is not a test the analysis can vouch for"
    left, op, right = node.left, node.ops[0], node.comparators[0]
    meta = rule.meta
    for a, o, b in ((left, type(op), right), (right, _MIRROR[type(op)], left)):
        if _field(a, cfg.seq_lens, flow, at, meta):
            if o in (ast.LtE, ast.Eq) and (_query_lens(b, flow, at, meta) or _is_int(b, 1)):
                return "prior"
        elif _field(a, cfg.computed, flow, at, meta):
            if (o in (ast.Eq, ast.LtE) and _is_int(b, 0)) or (o is ast.Lt and _is_int(b, 1)):
                return "prior"
        elif _query_lens(a, flow, at, meta) and (
            (o in (ast.Gt, ast.NotEq) and _is_int(b, 0)) or (o is ast.GtE and _is_int(b, 1))
        ):
            return "positive"
    lengths = "the rows' query lengths as the analysis derives them (query_start_loc_cpu's diff)"
    for a, o, b in ((left, type(op), right), (right, _MIRROR[type(op)], left)):
        if _field(a, cfg.seq_lens, flow, at, meta) and o in (ast.LtE, ast.Eq):
            return f"{text}: {ast.unparse(b)} is not {lengths}"
        positive = (o in (ast.Gt, ast.NotEq) and _is_int(b, 0)) or (o is ast.GtE and _is_int(b, 1))
        if positive and not _attrs(a) & cfg.prior_state:
            return f"{text}: {ast.unparse(a)} is not {lengths}"
    if _attrs(node) & cfg.prior_state:
        return f"{text} does not select exactly the rows without prior state"
    return f"{text} is not a test the analysis can vouch for"


def _conjuncts(
    node: ast.expr, flow: _Flow, at: ast.stmt, cfg: Config, rule: _Rule, depth: int = 0
) -> None:
    """Read ``node`` (evaluated at ``at``) as a conjunction of tests the
    analysis vouches for; anything else sets ``rule.bad``: a conjunct that
    is false on some one-token row without prior state keeps it a decode."""
    if rule.bad:
        return
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd):
        _conjuncts(node.left, flow, at, cfg, rule, depth)
        _conjuncts(node.right, flow, at, cfg, rule, depth)
    elif isinstance(node, ast.Compare):
        kind = _compare_kind(node, flow, at, cfg, rule)
        if kind == "prior":
            rule.prior = True
        elif kind != "positive":
            rule.bad = kind
    elif _is_gate(node, rule.meta):
        rule.gate = True
    elif isinstance(node, ast.Name) and depth < 4:
        found = flow.reaching(node.id, at)
        if not isinstance(found, ast.stmt):
            rule.bad = found or f"{node.id} is a parameter, not a test the analysis can read"
            return
        value = _plain(found, node.id)
        assert value is not None
        _conjuncts(value, flow, found, cfg, rule, depth + 1)
    else:
        rule.bad = f"{ast.unparse(node)} is not a test the analysis can vouch for"


def _gate_aug(stmt: ast.stmt, name: str, meta: frozenset[str]) -> bool:
    """``name &= m.is_prefilling``."""
    return (
        isinstance(stmt, ast.AugAssign)
        and isinstance(stmt.op, ast.BitAnd)
        and isinstance(stmt.target, ast.Name)
        and stmt.target.id == name
        and _is_gate(stmt.value, meta)
    )


def _gate_if(stmt: ast.stmt, name: str, meta: frozenset[str]) -> bool:
    """``if m.is_prefilling is not None: name &= m.is_prefilling`` with
    ``else: name = zeros_like(name)`` (no row reclassified: capture)."""
    if not (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare)):
        return False
    test = stmt.test
    if not (
        _is_gate(test.left, meta)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        return False
    if len(stmt.body) != 1 or not _gate_aug(stmt.body[0], name, meta) or len(stmt.orelse) != 1:
        return False
    zeros = _plain(stmt.orelse[0], name)
    return (
        isinstance(zeros, ast.Call)
        and _name(zeros.func) == "zeros_like"
        and not zeros.keywords
        and len(zeros.args) == 1
        and isinstance(zeros.args[0], ast.Name)
        and zeros.args[0].id == name
    )


def _rule_of(
    flow: _Flow, var: ast.Name, at: ast.stmt, rule: _Rule
) -> tuple[ast.expr, ast.stmt] | str:
    """The rule a local handed as ``is_prefilling`` holds at ``at``: its one
    assignment, then only the recognised gate (``&= m.is_prefilling``, or
    the ``if ... is not None`` / ``else`` zeros form); and no other use of
    the name anywhere in the function (an alias, a write after, ...)."""
    name = var.id
    path = flow.followed(name, at)
    if isinstance(path, str):
        return path
    allowed = {id(var)}
    for s in flow.before(path):
        if _write(s, name) is None:
            continue
        if _gate_aug(s, name, rule.meta) or _gate_if(s, name, rule.meta):
            rule.gate = True
            allowed |= {id(n) for n in ast.walk(s) if isinstance(n, ast.Name) and n.id == name}
            continue
        value = _plain(s, name)
        if value is None:
            return (
                f"line {s.lineno} writes {name}: not the rule's gate "
                "(&= is_prefilling, zeros when it is None)"
            )
        if isinstance(value, ast.Name):
            return f"{name} = {value.id}: an alias the analysis does not follow"
        if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(value)):
            return (
                f"line {s.lineno} sets {name} from its own value ({ast.unparse(value)}): "
                "not the rule's gate"
            )
        allowed |= {
            id(n)
            for n in ast.walk(s)
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
        }
        other = next(
            (
                n
                for n in ast.walk(flow.fn)
                if isinstance(n, ast.Name) and n.id == name and id(n) not in allowed
            ),
            None,
        )
        if other is not None:
            return f"{name} is also used at line {other.lineno}, beyond the rule and its gate"
        return value, s
    return f"{name} is not assigned before line {at.lineno}"


def _padding_tail(stmt: ast.stmt, counts: list[str], flow: _Flow, meta: frozenset[str]) -> bool:
    """Upstream's trailing-padding correction after the split::

        if P:
            P -= int((query_lens[D:] == 0).sum())
            PT = int(query_start_loc_cpu[D + P]) - DT

    (``D, P, DT, PT``: the split's four counts): it takes zero-length rows
    off the prefills, never a row off to the decodes."""
    d, p, dt, pt = counts
    if not (
        isinstance(stmt, ast.If)
        and isinstance(stmt.test, ast.Name)
        and stmt.test.id == p
        and not stmt.orelse
        and len(stmt.body) == 2
    ):
        return False
    first, second = stmt.body
    if not (
        isinstance(first, ast.AugAssign)
        and isinstance(first.op, ast.Sub)
        and isinstance(first.target, ast.Name)
        and first.target.id == p
    ):
        return False
    v = first.value  # int((query_lens[D:] == 0).sum())
    if not (isinstance(v, ast.Call) and _name(v.func) == "int" and len(v.args) == 1):
        return False
    total = v.args[0]
    if not (
        isinstance(total, ast.Call)
        and isinstance(total.func, ast.Attribute)
        and total.func.attr == "sum"
        and not total.args
        and not total.keywords
    ):
        return False
    zero = total.func.value
    if not (
        isinstance(zero, ast.Compare)
        and len(zero.ops) == 1
        and isinstance(zero.ops[0], ast.Eq)
        and _is_int(zero.comparators[0], 0)
        and isinstance(zero.left, ast.Subscript)
        and isinstance(zero.left.slice, ast.Slice)
        and isinstance(zero.left.slice.lower, ast.Name)
        and zero.left.slice.lower.id == d
        and zero.left.slice.upper is None
        and zero.left.slice.step is None
        and _query_lens(zero.left.value, flow, first, meta)
    ):
        return False
    tokens = _plain(second, pt)  # int(query_start_loc_cpu[D + P]) - DT
    if not (
        isinstance(tokens, ast.BinOp)
        and isinstance(tokens.op, ast.Sub)
        and isinstance(tokens.right, ast.Name)
        and tokens.right.id == dt
        and isinstance(tokens.left, ast.Call)
        and _name(tokens.left.func) == "int"
        and len(tokens.left.args) == 1
        and isinstance(tokens.left.args[0], ast.Subscript)
    ):
        return False
    loc = tokens.left.args[0]
    index = loc.slice
    return (
        isinstance(index, ast.BinOp)
        and isinstance(index.op, ast.Add)
        and isinstance(index.left, ast.Name)
        and index.left.id == d
        and isinstance(index.right, ast.Name)
        and index.right.id == p
        and _field(loc.value, frozenset({"query_start_loc_cpu"}), flow, second, meta)
    )


def _counts_rewritten(flow: _Flow, call: ast.Call, meta: frozenset[str]) -> str:
    """Why the counts the split returns may not be what reaches the
    metadata (empty when they are): not unpacked into four names, or written
    again on a path after the split (other than upstream's padding tail)."""
    stmt = flow.stmt_of(call)
    whole = isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and stmt.value is call
    target = stmt.targets[0] if whole and isinstance(stmt, ast.Assign) else None
    if not (
        isinstance(stmt, ast.Assign)
        and isinstance(target, ast.Tuple | ast.List)
        and len(target.elts) == 4
        and all(isinstance(e, ast.Name) for e in target.elts)
    ):
        return "the split's counts are not unpacked into four names the analysis can follow"
    counts = [e.id for e in target.elts if isinstance(e, ast.Name)]
    path = flow.path(stmt)
    if path is None:
        return "cannot follow the split's counts"
    loop = flow.loop(path)
    if loop is not None:
        return f"the split runs in the loop at line {loop.lineno}: its counts cannot be followed"
    for later in flow.after(path):
        written = next((c for c in counts if _write(later, c) is not None), None)
        if written is None or _padding_tail(later, counts, flow, meta):
            continue
        return (
            f"line {later.lineno} writes {written} after the split: the counts the "
            "metadata gets are not the split's"
        )
    return ""


def _judge_split(flow: _Flow, call: ast.Call, cfg: Config) -> tuple[Status, str, bool]:
    status, reason, reclassifies, meta = _verdict_of_split(flow, call, cfg)
    if status in (Status.FIXED, Status.NOT_AFFECTED):
        why = _counts_rewritten(flow, call, meta)
        if why:
            return Status.UNKNOWN, why, False
    return status, reason, reclassifies


def _verdict_of_split(
    flow: _Flow, call: ast.Call, cfg: Config
) -> tuple[Status, str, bool, frozenset[str]]:
    """The split call's verdict, and the names its metadata goes by."""
    stmt = flow.stmt_of(call)
    if stmt is None:
        return Status.UNKNOWN, f"cannot place the {cfg.split} call", False, frozenset()
    first = call.args[0] if call.args else None
    meta = _aliases(flow, first.id, stmt) if isinstance(first, ast.Name) else frozenset[str]()
    threshold = _keyword(call, "decode_threshold")
    if threshold is None and len(call.args) > 1:
        threshold = call.args[1]
    if threshold is not None and _is_int(threshold, 0):
        return Status.NOT_AFFECTED, "decode_threshold=0: every row is a prefill", True, meta
    treat = _keyword(call, cfg.needs_param)
    if treat is None or (isinstance(treat, ast.Constant) and treat.value is True):
        return (
            Status.AFFECTED,
            f"{cfg.split} classifies by query length alone: a new request's one-token "
            "first chunk is a decode and reads its recycled state slot unmasked",
            False,
            meta,
        )
    if not (isinstance(treat, ast.Constant) and treat.value is False):
        return Status.UNKNOWN, f"{cfg.needs_param} is not a constant", False, meta
    # Omitted, the split's own default (1 in every vLLM).
    if threshold is not None and not _is_int(threshold, 1):
        return (
            Status.UNKNOWN,
            f"decode_threshold={ast.unparse(threshold)}: the analysis vouches for a "
            "threshold of 1 only (a longer row is not a decode the GDN kernels take)",
            False,
            meta,
        )
    if first is None:
        return Status.UNKNOWN, f"{cfg.split} gets its metadata by keyword", False, meta
    handed = _handed(flow, first, stmt)
    if isinstance(handed, str):
        return Status.UNKNOWN, handed, False, meta
    meta = meta | handed.meta
    if handed.value is None:
        return (
            Status.NOT_AFFECTED,
            "every prompt chunk is a prefill (the runner's is_prefilling)",
            True,
            meta,
        )
    rule = _Rule(handed.meta)
    if isinstance(handed.value, ast.Name):
        found = _rule_of(flow, handed.value, handed.at, rule)
        if isinstance(found, str):
            return Status.UNKNOWN, f"is_prefilling is replaced: {found}", False, meta
        value, at = found
    else:
        value, at = handed.value, handed.at
    _conjuncts(value, flow, at, cfg, rule)
    if rule.bad:
        return Status.UNKNOWN, f"is_prefilling is replaced: {rule.bad}", False, meta
    if rule.prior and rule.gate:
        return (
            Status.FIXED,
            "rows without prior state are prefills (is_prefilling replaced by a "
            "prior-state test gated on is_prefilling)",
            True,
            meta,
        )
    if rule.prior:
        return (
            Status.UNKNOWN,
            "the rule is not gated on is_prefilling: capture dummies (seq_len == "
            "query_len) become prefills, and the decode graph is captured without its "
            "buffers",
            False,
            meta,
        )
    if rule.gate:
        return (
            Status.NOT_AFFECTED,
            "every prompt chunk is a prefill (is_prefilling)",
            True,
            meta,
        )
    return (
        Status.UNKNOWN,
        "is_prefilling is replaced by a value that compares no prior-state field",
        False,
        meta,
    )


def _length_counts(fn: ast.FunctionDef, count: str) -> list[int]:
    """Lines where ``count`` (the decode count) is set from a ``== 1`` test
    of query lengths and no later statement of the same block sets it to 0
    under a condition: one-token rows counted as decodes by length alone."""
    bad: list[int] = []
    for block in ast.walk(fn):
        for field_name in ("body", "orelse"):
            stmts = getattr(block, field_name, None)
            if not isinstance(stmts, list):
                continue
            for i, stmt in enumerate(stmts):
                if not (
                    isinstance(stmt, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == count for t in stmt.targets)
                    and any(
                        isinstance(c, ast.Compare)
                        and any(isinstance(op, ast.Eq) for op in c.ops)
                        and any(
                            isinstance(x, ast.Constant) and x.value == 1
                            for x in [c.left, *c.comparators]
                        )
                        for c in ast.walk(stmt.value)
                    )
                ):
                    continue
                reset = any(
                    isinstance(later, ast.If)
                    and any(
                        isinstance(a, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == count for t in a.targets)
                        and isinstance(a.value, ast.Constant)
                        and a.value.value == 0
                        for a in ast.walk(later)
                    )
                    for later in stmts[i + 1 :]
                )
                if not reset:
                    bad.append(stmt.lineno)
    return bad


def _split_target(fn: ast.FunctionDef, call: ast.Call) -> ast.Assign | None:
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and n.value is call:
            return n
    return None


def _builder(qual: str, fn: ast.FunctionDef, cfg: Config, family: bool = False) -> Finding | None:
    """``family``: known to be a GDN builder whatever fields it names (a
    function put on ``GDN...MetadataBuilder`` as its ``build``)."""
    keywords = {k.arg for n in ast.walk(fn) if isinstance(n, ast.Call) for k in n.keywords}
    if not family and not (_attrs(fn) | keywords) & cfg.family:
        return None
    calls = list(_calls(fn, cfg.split))
    if not calls:
        return Finding(
            "builder",
            qual,
            fn.lineno,
            Status.UNKNOWN,
            f"fills GDN metadata without {cfg.split}: cannot tell how a new one-token "
            "row is classified",
        )
    worst: tuple[Status, str, bool, int] | None = None
    order = {Status.UNKNOWN: 0, Status.AFFECTED: 1, Status.FIXED: 2, Status.NOT_AFFECTED: 3}
    flow = _Flow(fn)
    for call in calls:
        status, reason, reclassifies = _judge_split(flow, call, cfg)
        if status in (Status.FIXED, Status.NOT_AFFECTED):
            target = _split_target(fn, call)
            names = (
                target.targets[0].elts
                if target is not None and isinstance(target.targets[0], ast.Tuple)
                else []
            )
            count = names[0].id if names and isinstance(names[0], ast.Name) else "num_decodes"
            lines = _length_counts(fn, count)
            if lines:
                status = Status.UNKNOWN
                reason = (
                    f"line {lines[0]} counts one-token rows as decodes by length "
                    f"({count}) with no reset: a new one-token row there reads stale state"
                )
                reclassifies = False
        if worst is None or order[status] < order[worst[0]]:
            worst = (status, reason, reclassifies, call.lineno)
    assert worst is not None
    return Finding("builder", qual, worst[3], worst[0], worst[1], reclassifies=worst[2])


# -- runners ----------------------------------------------------------------------


def _v1_calls(qual: str, fn: ast.FunctionDef, cfg: Config) -> Iterator[Finding]:
    for call in _calls(fn, cfg.v1_dispatch):
        if not (isinstance(call.func, ast.Attribute) and _name(call.func.value) == "self"):
            continue
        force = _keyword(call, cfg.v1_force)
        if force is None:
            yield Finding(
                "runner_v1",
                qual,
                call.lineno,
                Status.AFFECTED,
                "FULL decode route open",
                guarded=False,
            )
        elif "num_computed_tokens" in " ".join(_attrs(force)):
            ok = (
                isinstance(force, ast.IfExp)
                and isinstance(force.body, ast.Constant)
                and force.body.value is False
                and isinstance(force.orelse, ast.Constant)
                and force.orelse.value is None
                and _any_without_computed(force.test)
            )
            yield Finding(
                "runner_v1",
                qual,
                call.lineno,
                Status.FIXED if ok else Status.UNKNOWN,
                "no FULL decode graph for a batch with a row that has no computed tokens"
                if ok
                else f"{cfg.v1_force}={ast.unparse(force)}: a guard the analysis cannot "
                "vouch for (expected: False when any row has no computed tokens, else None)",
                guarded=ok,
            )
        # Any other force_uniform_decode: capture and dummy runs, not a step.


def _v2_calls(qual: str, fn: ast.FunctionDef, cfg: Config) -> Iterator[Finding]:
    for block in ast.walk(fn):
        stmts = getattr(block, "body", None)
        if not isinstance(stmts, list):
            continue
        for i, stmt in enumerate(stmts):
            if not (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Call)
                and _name(stmt.value.func) == cfg.v2_shape_only
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                continue
            target = stmt.targets[0].id
            guards = [
                later
                for later in stmts[i + 1 :]
                if isinstance(later, ast.If)
                and "num_computed_tokens" in " ".join(_attrs(later.test))
            ]
            guarded = any(
                _any_without_computed(later.test)
                and not later.orelse
                and any(
                    isinstance(a, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == target for t in a.targets)
                    and isinstance(a.value, ast.Constant)
                    and a.value.value is None
                    for a in later.body
                )
                for later in guards
            )
            status = Status.FIXED if guarded else Status.UNKNOWN if guards else Status.AFFECTED
            reason = {
                Status.FIXED: "no FULL decode graph for a batch with a row that has no "
                "computed tokens",
                Status.UNKNOWN: f"a guard of {target} the analysis cannot vouch for "
                "(expected: None when any request has no computed tokens)",
                Status.AFFECTED: "FULL decode route open",
            }[status]
            yield Finding("runner_v2", qual, stmt.lineno, status, reason, guarded=guarded)


def _zero_test(node: ast.AST) -> bool:
    """A comparison that holds for a count of computed tokens of 0 and only
    then: ``c == 0``, ``c <= 0``, ``c < 1`` (or mirrored), ``0 in counts``."""
    if not isinstance(node, ast.Compare) or len(node.ops) != 1:
        return False
    left, op, right = node.left, node.ops[0], node.comparators[0]
    const = _is_int
    if isinstance(op, ast.In):
        return const(left, 0)
    if const(right, 0):
        return isinstance(op, ast.Eq | ast.LtE)
    if const(right, 1):
        return isinstance(op, ast.Lt)
    if const(left, 0):
        return isinstance(op, ast.Eq | ast.GtE)
    if const(left, 1):
        return isinstance(op, ast.Gt)
    return False


def _any_without_computed(test: ast.expr) -> bool:
    """``test`` is true when some row has no computed tokens: an ``or``/``and``
    whose part is ``(counts == 0).any()``, ``np.any(counts == 0)``,
    ``any(r.num_computed_tokens == 0 for r in ...)`` or ``0 in counts``, with
    no negation on the way."""
    if isinstance(test, ast.BoolOp):
        parts = [_any_without_computed(v) for v in test.values]
        if isinstance(test.op, ast.Or):
            return any(parts)  # more batches off the route: never less safe
        # ``and``: besides the test, only ``count is not None`` may narrow it.
        others = [v for v, ok in zip(test.values, parts, strict=True) if not ok]
        return any(parts) and all(
            isinstance(v, ast.Compare)
            and isinstance(v.ops[0], ast.IsNot)
            and isinstance(v.comparators[0], ast.Constant)
            and v.comparators[0].value is None
            for v in others
        )
    if isinstance(test, ast.Call) and _name(test.func) == "bool" and len(test.args) == 1:
        return _any_without_computed(test.args[0])
    if isinstance(test, ast.Compare):
        return (
            isinstance(test.ops[0], ast.In)
            and _zero_test(test)
            and _every_count(test.comparators[0])
        )
    if isinstance(test, ast.Call) and _name(test.func) == "any":
        inner: list[ast.AST] = list(test.args)
        if isinstance(test.func, ast.Attribute):
            inner.append(test.func.value)
        for arg in inner:
            generated = isinstance(arg, ast.GeneratorExp)
            if generated:
                assert isinstance(arg, ast.GeneratorExp)
                arg = arg.elt
            if not _zero_test(arg) or "num_computed_tokens" not in " ".join(_attrs(arg)):
                continue
            assert isinstance(arg, ast.Compare)
            constant_left = _is_int(arg.left, 0) or _is_int(arg.left, 1)
            counts = arg.comparators[0] if constant_left else arg.left
            if generated or _every_count(counts):
                return True
    return False


def _every_count(node: ast.expr) -> bool:
    """The computed-token counts of every row of the step: the field whole,
    or cut to the requests (``counts[:num_reqs]``); a cut by a number
    (``counts[:0]``, ``counts[1:]``) or an index leaves rows out."""
    if isinstance(node, ast.Subscript):
        cut = node.slice
        if not isinstance(cut, ast.Slice) or cut.step is not None:
            return False
        if cut.lower is not None and not _is_int(cut.lower, 0):
            return False
        if cut.upper is None or isinstance(cut.upper, ast.Constant):
            return cut.upper is None and _every_count(node.value)
        return _every_count(node.value)
    return "num_computed_tokens" in " ".join(_attrs(node)) and isinstance(
        node, (ast.Attribute, ast.Name)
    )


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """Class methods (``Class.method``), then module functions (``name``)."""
    yield from _methods(tree)
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            yield fn.name, fn


def _installed_builds(tree: ast.Module) -> dict[str, str]:
    """Module functions put on a class as its ``build`` (a plugin replacing
    ``GDNAttentionMetadataBuilder.build``, wrapped or not), anywhere in the
    module: function name -> the class expression it is put on (one
    function put on two classes: the last in ``ast.walk``'s order)."""
    found: list[tuple[tuple[int, tuple[int, ...]], str, str]] = []
    for path, node in _assign_statements(tree, ()):
        for target in node.targets:
            if isinstance(target, ast.Attribute) and target.attr == "build":
                value: ast.expr = node.value
                while isinstance(value, ast.Call):  # wraps(original)(fn), decorators
                    value = value.args[-1] if value.args else value.func
                if isinstance(value, ast.Name):
                    # ``ast.walk`` is breadth-first: by depth, then by path.
                    found.append(((len(path), path), value.id, ast.unparse(target.value)))
    found.sort(key=lambda item: item[0])
    return {name: on for _, name, on in found}


def _assign_statements(
    node: ast.AST, path: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], ast.Assign]]:
    """Every ``=`` statement below ``node`` with its path (child indices, as
    ``ast.iter_child_nodes`` counts them). Statements live only in blocks:
    walking them, not every expression node, finds the same assignments as
    ``ast.walk`` at a fraction of its cost."""
    for i, child in enumerate(ast.iter_child_nodes(node)):
        if isinstance(child, ast.Assign):
            yield (*path, i), child
        elif isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
            yield from _assign_statements(child, (*path, i))


def _source_lines(text: str) -> list[str]:
    """The lines ast counts (split at ``\n``, ``\r\n``, ``\r``), each as
    Python reads its identifiers (NFKC: a non-ASCII letter may spell an
    ASCII name)."""
    lines = re.split(r"\r\n|\r|\n", text)
    if text.isascii():
        return lines
    return [unicodedata.normalize("NFKC", line) for line in lines]


def _names_in(lines: list[str], fn: ast.FunctionDef, name: str) -> bool:
    """``name`` is written in ``fn``'s lines (:func:`_source_lines`): a call
    of ``name`` inside needs it (a cheap test before walking every node)."""
    start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    end = fn.end_lineno or len(lines)
    return any(name in line for line in lines[start - 1 : end])


def analyse_module(tree: ast.Module, text: str, cfg: Config) -> list[Finding]:
    """The builders and runner routes of one module (runner verdicts are
    settled by :func:`settle`, which knows the tree's builders)."""
    out: list[Finding] = []
    v1 = cfg.v1_dispatch in text and any(fn.name == cfg.v1_uniform for _, fn in _methods(tree))
    v2 = cfg.v2_shape_only in text
    installed = _installed_builds(tree)
    # A class's own ``build`` where the module classifies with the split
    # function; any function a module installs as some class's ``build``.
    has_split = cfg.split in text
    lines = _source_lines(text) if v1 else None
    for qual, fn in _functions(tree):
        if (has_split and fn.name == "build" and "." in qual) or fn.name in installed:
            on = installed.get(fn.name, "") if "." not in qual else ""
            found = _builder(qual, fn, cfg, family="GDN" in on or "KDA" in on)
            if found is not None:
                out.append(found)
        if "." not in qual:
            continue
        if lines is not None and _names_in(lines, fn, cfg.v1_dispatch):
            out.extend(_v1_calls(qual, fn, cfg))
        if v2 and "scheduler_output" in _params(fn):
            out.extend(_v2_calls(qual, fn, cfg))
    return out


def settle(findings: list[Finding], places: Sequence[str] | None = None) -> list[Finding]:
    """Runner verdicts from the tree's builders: an open FULL decode route is
    a bug where some builder may call a one-token row a prefill, and part of
    the fix where a builder is affected (its fix would make the route a half
    fix: the fix changes it, so it is reported affected, never "not affected
    and rewritten"). Where neither holds, the route is safe only if every
    builder calls every one-token row a decode: beside a builder the analysis
    cannot read (``unknown``) that is not known, and the route is unknown
    too. A guarded route is safe whatever the builders do. ``places``: where
    each finding lies (``FILE:LINE``), for the reasons."""
    reclassifies = any(f.kind == "builder" and f.reclassifies for f in findings)
    to_fix = any(f.kind == "builder" and f.status is Status.AFFECTED for f in findings)
    unread = next(
        (
            (i, f)
            for i, f in enumerate(findings)
            if f.kind == "builder" and f.status is Status.UNKNOWN
        ),
        None,
    )
    out = []
    for f in findings:
        if f.kind != "builder" and not f.guarded:
            if reclassifies:
                f = Finding(
                    f.kind,
                    f.function,
                    f.line,
                    Status.AFFECTED,
                    "a batch whose rows all have the decode length replays the FULL decode "
                    "graph on the previous step's buffers when the builder calls a row "
                    "without prior state a prefill (half fix)",
                )
            elif to_fix:
                f = Finding(
                    f.kind,
                    f.function,
                    f.line,
                    Status.AFFECTED,
                    "the FULL decode route replays the decode graph for any batch whose rows "
                    "all have the decode length; the builder's fix calls a new one-token row "
                    "a prefill, so this route must take the guard with it",
                )
            elif unread is not None:
                i, b = unread
                where = places[i] if places is not None else f"line {b.line}"
                f = Finding(
                    f.kind,
                    f.function,
                    f.line,
                    Status.UNKNOWN,
                    "the FULL decode route is safe only if every builder calls every "
                    f"one-token row a decode; it depends on the builder at {where} "
                    f"({b.function}), which the analysis cannot read",
                )
            else:
                f = Finding(
                    f.kind,
                    f.function,
                    f.line,
                    Status.NOT_AFFECTED,
                    "the builder calls every one-token row a decode, as the FULL decode "
                    "route assumes",
                )
        out.append(f)
    return out
