"""The abstract values of the data-flow analysis: which token rows a tensor holds.

A GDN layer gets every token of the step in one packed batch. The spec path
must feed its recurrent kernel the *same rows* in q/k/v and in the gates; the
bug is a kernel call whose q rows were gathered by the spec token index while
its gate rows were not. So the one fact the analysis tracks per value is its
row selection (:class:`Prov`), together with the branch conditions under
which the value holds (``assume``) and the definitions it came from (``defs``,
which the rewriter uses to find where the spec rows were gathered).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Prov(enum.Enum):
    NONE = "none"  # not a per-token tensor (weights, metadata, scalars)
    NULL = "null"  # the constant None (a local "staged" before it is set)
    ALL = "all"  # every token row of the step, in batch order
    SPEC = "spec"  # the rows of the speculative tokens
    NONSPEC = "nonspec"  # the rows of the other tokens
    IDX_SPEC = "idx_spec"  # an index/mask/range selecting the spec tokens
    IDX_NONSPEC = "idx_nonspec"
    IDX_ALL = "idx_all"  # an identity index (``torch.arange``): selects every row
    STATE_SPEC = "state_spec"  # state-slot indices of the spec requests
    STATE_NONSPEC = "state_nonspec"
    CONFLICT = "conflict"  # mixes row selections: cannot be reasoned about

    # Members are singletons: hashed by identity, not by name in Python (the
    # analysis hashes values holding them some 70,000 times a scan).
    __hash__ = object.__hash__

    @property
    def is_rows(self) -> bool:
        return self in _ROWS


_ROWS = {Prov.ALL, Prov.SPEC, Prov.NONSPEC}
_INDEX = {Prov.IDX_SPEC, Prov.IDX_NONSPEC, Prov.IDX_ALL, Prov.STATE_SPEC, Prov.STATE_NONSPEC}
# Values of the spec path: its index, its state slots, the rows it gathered.
# A helper handed one of these is followed into (it may gather, or call the
# kernel); others only when their code (or a close helper's) names the path.
SPEC_PATH = frozenset({Prov.IDX_SPEC, Prov.STATE_SPEC, Prov.SPEC})

# Complement of an index: ``~spec_token_masks`` selects the non-spec tokens.
INVERT = {Prov.IDX_SPEC: Prov.IDX_NONSPEC, Prov.IDX_NONSPEC: Prov.IDX_SPEC}
GATHERED = {Prov.IDX_SPEC: Prov.SPEC, Prov.IDX_NONSPEC: Prov.NONSPEC}


def join(provs: Iterable[Prov]) -> Prov:
    """The row selection of a value computed from values of these selections.

    Row tensors dominate indices (an op taking rows and an index returns
    rows); two different row selections, or two different indices, conflict.
    """
    rows: set[Prov] = set()
    index: set[Prov] = set()
    for p in provs:
        if p is Prov.CONFLICT:
            return Prov.CONFLICT
        if p in _ROWS:
            rows.add(p)
        elif p in _INDEX:
            index.add(p)
    if rows:
        return rows.pop() if len(rows) == 1 else Prov.CONFLICT
    if index:
        return index.pop() if len(index) == 1 else Prov.CONFLICT
    return Prov.NONE


Assume = frozenset[tuple[str, bool]]
NO_ASSUME: Assume = frozenset()


# Whether an assumption holds no key both ways, by assumption (a walk meets
# the same few sets tens of thousands of times).
_SOUND: dict[Assume, bool] = {}


def consistent(*assumes: Assume) -> Assume | None:
    """The union of branch assumptions, or None if two of them contradict.

    The hottest function of the analysis: sets are joined pairwise, looking
    up each key's opposite in the other set instead of rebuilding a dict."""
    out: Assume | None = None
    for assume in assumes:
        if not assume or assume is out:
            continue
        if out is None:
            sound = _SOUND.get(assume)
            if sound is None:
                sound = _SOUND[assume] = len({key for key, _ in assume}) == len(assume)
            if not sound:
                return None  # an arm no path takes (``x and not x``)
            out = assume
            continue
        if assume <= out:
            continue
        for key, truth in assume:
            if (key, not truth) in out:
                return None
        out = out | assume
    return NO_ASSUME if out is None else out


@dataclass(frozen=True)
class Val:
    """One possible value of a name: its rows, under which branches, from where."""

    assume: Assume
    prov: Prov
    defs: frozenset[int] = frozenset()
    # For row tensors: how many dimensions come before the token axis (0 for
    # ``[T, H]``, 1 for ``[1, T, H]``, as ``fused_gdn_gating`` returns), where
    # the analysis knows it (None: not known, as for an entry's parameters or
    # what an unknown function returns). Where known, a gather selects token
    # rows only along that axis.
    lead: int | None = None


NONE_VAL = Val(NO_ASSUME, Prov.NONE)
NULL_VAL = Val(NO_ASSUME, Prov.NULL)
