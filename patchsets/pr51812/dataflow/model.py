"""What a walk works with and what it records: value sets, scopes, the
records of definitions, calls and frames (:class:`Flow`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from ..provenance import Assume, Prov, Val

Vals = frozenset[Val]
Env = dict[str, Vals]

# How many helper calls deep a spec path is followed (the entry is depth 0).
MAX_DEPTH = 4

# Methods and attributes that read shape or placement, never rows.
META = frozenset(
    {
        "size", "dim", "numel", "stride", "item", "is_contiguous", "data_ptr",
        "element_size", "get_device", "tolist", "shape", "dtype", "device",
        "ndim", "is_cuda", "storage_offset", "nelement",
    }
)  # fmt: skip
# What code does with a tensor. A parameter only ever used with these is taken
# to be a per-token tensor; one with any other attribute (``layer.A_log``,
# ``metadata.spec_token_indx``) is an object holding weights or metadata.
TENSOR_ATTRS = META | frozenset(
    {
        "T", "mT", "view", "reshape", "contiguous", "to", "float", "half", "bfloat16",
        "transpose", "split", "chunk", "unsqueeze", "squeeze", "permute", "flatten",
        "clone", "narrow", "index_select", "copy_", "fill_", "zero_", "index_copy_",
        "new_empty", "new_zeros", "new_ones", "sum", "mean", "sigmoid", "exp", "neg",
        "softmax", "unflatten", "expand", "repeat", "masked_fill", "type_as", "cuda",
        "cpu", "detach", "view_as", "reshape_as", "movedim", "select", "gather", "type",
        "is_floating_point", "any", "all", "max", "min", "abs", "sqrt", "pow", "mul",
        "add", "sub", "div", "unbind", "roll", "flip", "argmax", "long", "int", "bool",
        "index_copy", "index_fill_", "index_put_", "index_add_", "scatter_", "scatter",
        "masked_fill_", "masked_scatter_", "new_tensor", "new_full", "cumsum", "repeat_interleave",
    }
)  # fmt: skip
# Above this many alternatives a value is no longer worth tracking precisely.
MAX_VALS = 256
# The condition of an arm no path takes (``x and not x``).
NEVER: Assume = frozenset({("<never>", True), ("<never>", False)})


@dataclass(frozen=True)
class Scope:
    """Where a function's calls resolve: its module and, for a method, its class."""

    module: str  # the resolver's key of the module (its path, or a pseudo name)
    cls: str | None = None  # qualname of the class holding the method
    receiver: str | None = None  # the parameter bound to the instance/class (self, cls)


# --- what the walk records ----------------------------------------------------------


@dataclass
class Def:
    """One assignment of a local name (in one frame)."""

    id: int
    name: str
    stmt: cst.CSTNode  # the statement line holding the assignment
    value: cst.BaseExpression | None  # the expression assigned to this name
    gather: cst.BaseExpression | None = None  # the spec gather inside value
    alias_of: str | None = None  # ``k = some.kernel``: the callee it names
    param: bool = False  # a parameter of the function
    optional: bool = False  # a parameter that defaults to None
    frame: int = 0
    # What the name stands for in conditions across assignments and frames
    # (``m = md.spec_sequence_masks`` reads as ``<md>.spec_sequence_masks``).
    canon: str | None = None


@dataclass
class CallRecord:
    node: cst.Call
    callee: str | None  # dotted name as written, aliases resolved
    path: Assume  # branch conditions under which the call runs
    args: list[tuple[str | None, cst.Arg, Vals]]  # (keyword, arg, values)
    starred: bool  # passes *args/**kwargs: binding unknowable
    frame: int = 0
    # The helper this call was followed into (its frame id), if it was.
    entered: int | None = None
    # A helper of the tree this call resolves to that was not followed, and why.
    unfollowed: str | None = None
    # The receiver values of ``x.method(...)`` (None for plain calls).
    owner: Vals | None = None
    # The dotted name of an imported function the tree given does not hold
    # (``myfork.spec_utils.gather_spec_rows`` with that module missing).
    missing: str | None = None


@dataclass
class Frame:
    """One walk of one function: the entry, or a helper entered from a call."""

    id: int
    qualname: str
    path: str | None
    line: int
    func: cst.FunctionDef
    key: tuple[str, str, int]
    parent: int | None = None  # the calling frame
    call: CallRecord | None = None  # the call (in ``parent``) that entered it
    # parameter -> the argument node of ``call`` it is bound to (absent: default)
    bindings: dict[str, cst.Arg] = field(default_factory=dict)
    depth: int = 0


@dataclass
class Flow:
    """What the walk learned about one entry function and its helpers."""

    defs: list[Def] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    gathers: list[tuple[cst.BaseExpression, Prov]] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    # Definitions whose rows were gathered by some index somewhere: evidence
    # that a parameter really is a per-token tensor.
    gathered_defs: set[int] = field(default_factory=set)
    # Selections by a token index along another axis than the tokens' (the
    # expression, its dim or None, the token axis of what it selected from).
    off_axis: list[tuple[cst.BaseExpression, int | None, int | None]] = field(default_factory=list)
    # Row tensors indexed along their token axis by a value the analysis
    # cannot name (``a[perm]``, ``a[md.row]``, also a dict's ``d[key]``):
    # their rows are kept (a dict lookup looks the same), but a spec call's
    # gate that came through one is judged unknown (``analysis``).
    unnamed_picks: list[cst.Subscript] = field(default_factory=list)
    # Row tensors cut to a prefix by a count that is no literal (``x[:n]``),
    # and identity indices (``torch.arange(n)``), with the count's canonical
    # name: read as every real token (the padding trim, ``[:num_actual_tokens]``),
    # which a spec call's gate may hold only where q/k/v came through the
    # same count (``analysis``).
    cuts: list[tuple[cst.BaseExpression, str]] = field(default_factory=list)
    # A token index in arithmetic with a value that is no literal (``idx +
    # off``, also a range's end ``start + count``), with its canonical name:
    # kept as the index, which a spec call's q/k/v and gates must then have
    # come through alike (``analysis``).
    shifts: list[tuple[cst.BinaryOperation, str]] = field(default_factory=list)
    # Environment right after each simple statement line, keyed by (frame,
    # id(statement)): the rewriter checks that an inserted line sees the
    # values the call sees.
    env_after: dict[tuple[int, int], Env] = field(default_factory=dict)
    # The branch conditions that hold at each of those lines.
    path_at: dict[tuple[int, int], Assume] = field(default_factory=dict)

    def chain(self, frame: int) -> list[Frame]:
        """The frames from the entry down to ``frame``."""
        out = []
        current: int | None = frame
        while current is not None:
            out.append(self.frames[current])
            current = self.frames[current].parent
        return out[::-1]


class Terminated(Exception):
    """Raised inside a block after ``return``/``raise``: the path ends there."""


@dataclass
class FrameState:
    frame: Frame
    imports: dict[str, str]
    scope: Scope
    returns: list[Val] = field(default_factory=list)
