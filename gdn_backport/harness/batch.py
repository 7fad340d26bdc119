"""A batch description: rows of kind spec / non-spec, in the order vLLM packs them.

This is the one input every other harness module works from: the metadata
synthesiser, the layer's inputs, the float64 reference and the scenarios.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Batch", "Row", "SlotMap"]


@dataclass(frozen=True)
class Row:
    """One request's rows in this step.

    ``spec`` rows carry 1 + draft tokens and read their state from the slot
    of the last accepted token (``num_accepted``, 1 .. num_spec + 1); non-spec
    rows are prefill chunks or one-token rows. ``request`` names the request
    across steps (same request, same state slots); default: the row index.
    """

    spec: bool
    query_len: int
    has_initial_state: bool = True
    num_accepted: int = 1
    request: int | None = None

    def describe(self) -> str:
        kind = "S" if self.spec else "N"
        extra = f"@{self.num_accepted}" if self.spec else ("" if self.has_initial_state else "*")
        return f"{kind}{self.query_len}{extra}"


@dataclass(frozen=True)
class Batch:
    rows: tuple[Row, ...]
    num_spec: int = 3

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a batch needs at least one row")
        for i, row in enumerate(self.rows):
            if row.query_len < 1:
                raise ValueError(f"row {i}: query_len must be >= 1")
            if row.spec:
                if row.query_len > self.num_spec + 1:
                    raise ValueError(
                        f"row {i}: a spec row has at most num_spec + 1 = "
                        f"{self.num_spec + 1} tokens, got {row.query_len}"
                    )
                if not 1 <= row.num_accepted <= self.num_spec + 1:
                    raise ValueError(f"row {i}: num_accepted must be in 1..{self.num_spec + 1}")
                if not row.has_initial_state:
                    raise ValueError(f"row {i}: a spec row always has a state")

    @property
    def num_tokens(self) -> int:
        return sum(r.query_len for r in self.rows)

    def request_ids(self) -> list[int]:
        return [i if r.request is None else r.request for i, r in enumerate(self.rows)]

    def token_ranges(self) -> list[range]:
        out, start = [], 0
        for row in self.rows:
            out.append(range(start, start + row.query_len))
            start += row.query_len
        return out

    def spec_token_indx(self) -> list[int]:
        return [
            t
            for row, rng in zip(self.rows, self.token_ranges(), strict=True)
            if row.spec
            for t in rng
        ]

    def non_spec_token_indx(self) -> list[int]:
        return [
            t
            for row, rng in zip(self.rows, self.token_ranges(), strict=True)
            if not row.spec
            for t in rng
        ]

    def describe(self) -> str:
        return "[" + ", ".join(r.describe() for r in self.rows) + "]"


@dataclass
class SlotMap:
    """State slots per request: a block of num_spec + 1 for spec requests, one
    for the others. Slot 0 is vLLM's null block and never handed out; a few
    slots are left free so writes outside the batch can be detected."""

    num_spec: int
    blocks: dict[int, list[int]] = field(default_factory=dict)
    num_slots: int = 0

    @classmethod
    def for_steps(cls, steps: list[Batch], spare: int = 3) -> SlotMap:
        num_spec = steps[0].num_spec
        kinds: dict[int, bool] = {}
        for batch in steps:
            for rid, row in zip(batch.request_ids(), batch.rows, strict=True):
                kinds[rid] = kinds.get(rid, False) or row.spec
        needed = sum(num_spec + 1 if spec else 1 for spec in kinds.values())
        total = 1 + needed + spare
        # Hand slots out back to front with spare slots between the first
        # blocks, so slot numbers differ from row and token numbers.
        order = list(range(total - 1, 0, -1))
        spares = set(order[1 : 1 + 2 * spare : 2])
        free = [s for s in order if s not in spares]
        smap = cls(num_spec=num_spec, num_slots=total)
        for rid in sorted(kinds):
            size = num_spec + 1 if kinds[rid] else 1
            smap.blocks[rid], free = free[:size], free[size:]
        return smap

    def used(self) -> set[int]:
        return {s for block in self.blocks.values() for s in block}
