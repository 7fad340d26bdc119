"""Which tensor operations keep a value's token rows, in order.

The analysis follows row selections through tensor methods and arithmetic
(``x.contiguous()``, ``a_spec.float()``). Some operations take the rows
apart instead: they reorder them (``flip``, ``roll``, ``sort``), mix them
(``cumsum``, ``mean`` along the token axis), or keep only some of them
(``narrow``). Their result holds rows nobody can name (``CONFLICT``), so a
spec call fed one is ``unknown``, never ``fixed``: a gate gathered and then
flipped is misaligned however its gather was written.

A token *index* (``spec_token_indx``) is held to a stricter rule: any
change to its values changes which rows it selects (``idx + 1``,
``idx.flip(0)``, ``torch.zeros_like(idx)``, ``idx[:1]``), so it stays the
spec index only through casts, moves and views.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import libcst as cst

from ..provenance import Prov, Val
from .model import Vals

# Token indices (1-D): what selects which rows.
TOKEN_INDEX = frozenset({Prov.IDX_SPEC, Prov.IDX_NONSPEC})

# What an index keeps its selection through: casts, device moves, copies,
# views of its one dimension (and the in-place buffer writes of the
# builders, which the analysis does not model).
INDEX_KEEPS = frozenset(
    {
        "to", "long", "int", "cuda", "cpu", "contiguous", "clone", "detach", "view",
        "view_as", "reshape", "flatten", "squeeze", "unsqueeze", "type", "type_as",
        "copy_", "fill_", "pin_memory", "numel", "size", "dim", "tolist", "item",
        "nonzero", "argwhere", "bool",
    }
)  # fmt: skip

# Methods that reorder, mix or drop rows along the dimension they are given:
# method -> (the dim argument's position, its keyword, whether leaving it
# out reorders too: ``roll`` without dims rolls the flattened tensor, ``sort``
# sorts the last dim).
ALONG = {
    "flip": (0, "dims", True),
    "roll": (1, "dims", True),
    "cumsum": (0, "dim", True),
    "cumprod": (0, "dim", True),
    "cummax": (0, "dim", True),
    "cummin": (0, "dim", True),
    "logcumsumexp": (0, "dim", True),
    "narrow": (0, "dim", True),
    "sort": (0, "dim", False),
    "argsort": (0, "dim", False),
    "repeat_interleave": (1, "dim", True),
    "gather": (0, "dim", True),
    "take_along_dim": (1, "dim", True),
    # Reductions: without a dim they leave no rows at all (a scalar).
    "mean": (0, "dim", False),
    "sum": (0, "dim", False),
    "nansum": (0, "dim", False),
    "nanmean": (0, "dim", False),
    "prod": (0, "dim", False),
    "amax": (0, "dim", False),
    "amin": (0, "dim", False),
    "max": (0, "dim", False),
    "min": (0, "dim", False),
    "median": (0, "dim", False),
    "nanmedian": (0, "dim", False),
    "std": (0, "dim", False),
    "var": (0, "dim", False),
    "logsumexp": (0, "dim", False),
    "topk": (1, "dim", False),
    "kthvalue": (1, "dim", False),
}
# Whatever their arguments: a permutation, a row subset, a flattening.
ALWAYS = frozenset({"msort", "take", "masked_select", "unique", "unique_consecutive", "tile"})

# Arithmetic on an index makes another index.
INDEX_ARITHMETIC = (
    cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.FloorDivide, cst.Modulo,
    cst.Power, cst.LeftShift, cst.RightShift, cst.MatrixMultiply,
)  # fmt: skip


INDEX_AUG = (
    cst.AddAssign, cst.SubtractAssign, cst.MultiplyAssign, cst.DivideAssign,
    cst.FloorDivideAssign, cst.ModuloAssign, cst.PowerAssign, cst.LeftShiftAssign,
    cst.RightShiftAssign, cst.MatrixMultiplyAssign,
)  # fmt: skip


def _literal_ints(node: cst.BaseExpression) -> list[int] | None:
    """``0``, ``-1``, ``(0, 1)``, ``[0]`` as ints; None for anything else."""
    if isinstance(node, cst.Integer):
        return [int(node.value, 0)]
    if (
        isinstance(node, cst.UnaryOperation)
        and isinstance(node.operator, cst.Minus)
        and isinstance(node.expression, cst.Integer)
    ):
        return [-int(node.expression.value, 0)]
    if isinstance(node, (cst.Tuple, cst.List)):
        out: list[int] = []
        for e in node.elements:
            if isinstance(e, cst.StarredElement):
                return None
            got = _literal_ints(e.value)
            if got is None:
                return None
            out += got
        return out
    return None


def _dims(args: list[cst.Arg], position: int, keyword: str) -> list[int] | bool | None:
    """The literal dims a call names (False: it names none; None: not literal)."""
    for arg in args:
        if arg.keyword is not None and arg.keyword.value == keyword:
            return _literal_ints(arg.value)
    positional = [a for a in args if a.keyword is None]
    if any(a.star for a in args):
        return None
    if len(positional) > position:
        return _literal_ints(positional[position].value)
    return False


def _touches(dims: list[int] | bool | None, lead: int | None, default: bool) -> bool:
    """Whether dims (as :func:`_dims` gives them) include the token axis."""
    if dims is False:
        return default
    if not isinstance(dims, list):
        return True
    axis = 0 if lead is None else lead
    # A negative dim counts from the end: the rows a spec call reads (q/k/v,
    # the gates) have dims after the token axis, so ``-1`` is not it.
    return any(d == axis for d in dims)


def method_rows(vals: Vals, method: str, args: list[cst.Arg]) -> Vals:
    """``vals`` after ``x.method(*args)``: rows taken apart where it
    reorders, mixes or drops them along the token axis; a token index
    changed by anything but a cast, a move or a view."""
    out: set[Val] = set()
    changed = False
    for v in vals:
        broken = False
        if v.prov in TOKEN_INDEX:
            broken = method not in INDEX_KEEPS
        elif v.prov.is_rows:
            if method in ALWAYS:
                broken = True
            elif method in ALONG:
                position, keyword, default = ALONG[method]
                broken = _touches(_dims(args, position, keyword), v.lead, default)
        if broken:
            changed = True
            v = unnamed(v)
        out.add(v)
    return frozenset(out) if changed else vals


def unnamed(v: Val) -> Val:
    """``v`` holding rows nobody can name."""
    return Val(v.assume, Prov.CONFLICT, v.defs, v.lead)


# The rows a gather selects (as opposed to every row of the step).
GATHERED_ROWS = frozenset({Prov.SPEC, Prov.NONSPEC})


def overwritten(held: Vals, written: Iterable[Vals]) -> Vals:
    """A name after a write into it (``x[...] = y``, ``x.copy_(y)``,
    ``x.add_(y)``): a token index is another index, and gathered rows (the
    spec or the non-spec rows) written over with rows that can only be of
    another named selection (every row, the other selection) are a mix
    nobody can name. Kept: writes of what holds no rows (a constant,
    weights, a mask) or may hold the same rows; rows nobody can name (a
    buffer filled sequence by sequence from slices of its own rows, vLLM's
    CPU spec path, writes such slices); every row's buffer written (the
    output scattered back by the spec index, ``out.index_copy_(0, idx, y)``)."""
    held = index_changed(held)
    rows = {w.prov for vals in written for w in vals if w.prov.is_rows}
    if not rows:
        return held
    return frozenset(
        unnamed(v) if v.prov in GATHERED_ROWS and v.prov not in rows else v for v in held
    )


def index_changed(vals: Vals) -> Vals:
    """A token index whose entries changed (``idx + 1``, ``-idx``, ``idx[:1]``,
    ``idx[0] = 0``, ``idx.add_(1)``) selects rows nobody can name."""
    if not any(v.prov in TOKEN_INDEX for v in vals):
        return vals
    return frozenset(unnamed(v) if v.prov in TOKEN_INDEX else v for v in vals)


NUMBERS = (cst.Integer, cst.Float)


def whole(element: cst.SubscriptElement) -> bool:
    """``:``, ``...`` or ``None`` in a subscript: every entry along it."""
    s = element.slice
    if isinstance(s, cst.Slice):
        return s.lower is None and s.upper is None and s.step is None
    value = s.value if isinstance(s, cst.Index) else None
    return isinstance(value, cst.Ellipsis) or (
        isinstance(value, cst.Name) and value.value == "None"
    )


def trim(elements: Sequence[cst.SubscriptElement]) -> bool:
    """``idx[:n]`` with ``n`` no literal: the index cut to the step's real
    tokens (``spec_token_masks[:num_actual_tokens]``), its selection kept."""
    if len(elements) != 1 or not isinstance(elements[0].slice, cst.Slice):
        return False
    s = elements[0].slice
    return (
        s.lower is None
        and s.step is None
        and s.upper is not None
        and not isinstance(s.upper, NUMBERS)
    )


def _literal_cut(element: cst.BaseSlice) -> bool:
    """``1:``, ``2:n``, ``::2``: a cut by a number, which no step's row
    count is (``x[num_decode_tokens:]``, the prefills after the decodes, and
    ``x[0:n]`` keep their rows)."""
    if not isinstance(element, cst.Slice):
        return False
    lower, step = element.lower, element.step
    if isinstance(lower, NUMBERS) and lower.evaluated_value != 0:
        return True
    return isinstance(step, NUMBERS) and step.evaluated_value != 1


def unnamed_pick(
    base: Vals, elements: Sequence[cst.SubscriptElement], picks: Sequence[Vals]
) -> bool:
    """``base[elements]`` indexes rows along their token axis by a value the
    analysis cannot name: no slice, no literal (``x[0]`` takes a ``[1, T,
    H]`` tensor's lead away), no ``None`` or ``...``, and no index it knows
    (``a[perm]``, ``a[md.row]``; a dict's ``d[key]`` looks the same)."""
    for v in base:
        axis = 0 if v.lead is None else v.lead
        if not v.prov.is_rows or axis >= len(elements):
            continue
        s = elements[axis].slice
        if not isinstance(s, cst.Index):
            continue
        value = s.value
        if isinstance(value, cst.UnaryOperation) and isinstance(value.operator, cst.Minus):
            value = value.expression
        if isinstance(value, (cst.Integer, cst.Ellipsis)) or (
            isinstance(value, cst.Name) and value.value in ("None", "True", "False")
        ):
            continue
        if all(p.prov in (Prov.NONE, Prov.NULL) for p in picks[axis]):
            return True
    return False


def subscript_rows(base: Vals, elements: Sequence[cst.SubscriptElement]) -> Vals:
    """``base[elements]`` before its gather: rows cut by a number along their
    token axis (``a[1:]``, ``a[::2]``), and a token index cut other than
    to the step's tokens (``idx[:1]``, ``idx[1:]``, ``idx[perm]``), hold
    rows nobody can name."""
    if any(_literal_cut(e.slice) for e in elements):
        out = set()
        for v in base:
            axis = 0 if v.lead is None else v.lead
            if v.prov.is_rows and axis < len(elements) and _literal_cut(elements[axis].slice):
                v = unnamed(v)
            out.add(v)
        base = frozenset(out)
    if not all(whole(e) for e in elements) and not trim(elements):
        base = index_changed(base)
    return base
