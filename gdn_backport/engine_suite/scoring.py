"""Token-level errors against the teacher-forced reference, attributed to the
engine steps that caused them. Pure Python: no torch, no vLLM.

Every output token of a run has its chosen logprob ``lp_run``; the reference
engine (no speculative decoding, no prefix cache) scores the same token
sequence with prompt logprobs, ``lp_ref``; the error is ``|lp_run -
lp_ref|``. Each token gets one tag, the first that applies:

``misordered``
    produced by a step in which a build displaced this request's spec rows
    (non-spec tokens before them: an affected spec kernel read other tokens'
    gate rows for them);
``after``
    a later token of a request hit earlier: its recurrent state is corrupted
    from then on;
``new_row``
    a token of a request whose first chunk was one token with nothing
    computed and that the builder classified a decode (its recycled state
    slot read unmasked), or that ran in a FULL-graph replay whose decode
    buffers the build did not fill (stale buffers);
``stale``
    a token of another request, from the first stale FULL replay its row
    took part in (collateral damage through stale buffers);
``first``
    the token sampled right after the request's prompt: computed by the
    same prefill path as the reference, so it is kept out of the floor;
``clean``
    everything else: the numerical floor of this engine against the
    reference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gdn_backport.engine_suite.recorder import BuildRecord, StepRecord

__all__ = [
    "TAGS",
    "Aggregate",
    "Events",
    "Evidence",
    "RunRequest",
    "TokenScore",
    "aggregate",
    "attribute",
    "post_mixed",
    "score_tokens",
    "worst",
]

TAGS = ("misordered", "after", "new_row", "stale", "first", "clean")


@dataclass(frozen=True)
class RunRequest:
    """One request of a run as the driver reported it."""

    id: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    steps: tuple[int, ...]
    role: str = "stream"

    @classmethod
    def from_json(cls, rid: str, data: Mapping[str, Any]) -> RunRequest:
        return cls(
            id=rid,
            prompt=tuple(data["prompt"]),
            tokens=tuple(data["tokens"]),
            logprobs=tuple(data["logprobs"]),
            steps=tuple(data["steps"]),
            role=str(data.get("role", "stream")),
        )


@dataclass(frozen=True)
class TokenScore:
    request: str
    index: int  # position among the request's output tokens
    step: int
    token: int
    lp_run: float
    lp_ref: float
    tag: str

    @property
    def error(self) -> float:
        return abs(self.lp_run - self.lp_ref)

    def to_json(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "index": self.index,
            "step": self.step,
            "token": self.token,
            "lp_run": self.lp_run,
            "lp_ref": self.lp_ref,
            "error": self.error,
            "tag": self.tag,
        }


@dataclass
class Events:
    """What the builds did to one request."""

    misordered_steps: set[int] = field(default_factory=set)
    new_row: str | None = None  # "decode", "stale" or None: how its first chunk ran
    new_row_class: str | None = None  # the builder's class for its one-token first chunk
    first_stale: int | None = None

    @property
    def first_misordered(self) -> int | None:
        return min(self.misordered_steps) if self.misordered_steps else None


def attribute(builds: Iterable[BuildRecord]) -> dict[str, Events]:
    """Per request, the steps that hurt it."""
    events: dict[str, Events] = {}
    for build in builds:
        for rid in build.displaced:
            events.setdefault(rid, Events()).misordered_steps.add(build.step)
        for rid, klass in build.new_rows.items():
            ev = events.setdefault(rid, Events())
            ev.new_row_class = ev.new_row_class or klass
            if klass == "decode":
                ev.new_row = ev.new_row or "decode"
            elif build.stale_replay:
                ev.new_row = ev.new_row or "stale"
        if build.stale_replay:
            for row_id in build.req_ids:
                if row_id is None or row_id in build.new_rows:
                    continue
                ev = events.setdefault(row_id, Events())
                if ev.first_stale is None or build.step < ev.first_stale:
                    ev.first_stale = build.step
    return events


def _tag(index: int, step: int, ev: Events | None) -> str:
    if ev is not None:
        if step in ev.misordered_steps:
            return "misordered"
        first = ev.first_misordered
        if first is not None and step > first:
            return "after"
        if ev.new_row is not None:
            return "new_row"
        if ev.first_stale is not None and step >= ev.first_stale:
            return "stale"
    return "first" if index == 0 else "clean"


def score_tokens(
    requests: Iterable[RunRequest],
    reference: Mapping[str, Sequence[float | None]],
    events: Mapping[str, Events],
) -> list[TokenScore]:
    """Every token that has both logprobs, tagged. ``reference[rid][i]`` is
    the reference logprob of output token ``i``."""
    out = []
    for req in requests:
        ref = reference.get(req.id)
        if ref is None:
            continue
        ev = events.get(req.id)
        for i, (token, lp, step) in enumerate(
            zip(req.tokens, req.logprobs, req.steps, strict=False)
        ):
            if i >= len(ref) or lp is None or ref[i] is None:
                continue
            ref_lp = ref[i]
            assert ref_lp is not None
            out.append(
                TokenScore(req.id, i, step, token, float(lp), float(ref_lp), _tag(i, step, ev))
            )
    return out


@dataclass(frozen=True)
class Aggregate:
    count: int
    mean: float
    max: float
    p99: float

    @classmethod
    def of(cls, errors: Iterable[float]) -> Aggregate:
        values = sorted(errors)
        if not values:
            return cls(0, math.nan, math.nan, math.nan)
        # Nearest rank: the smallest value with at least 99% at or below it.
        rank = max(math.ceil(0.99 * len(values)) - 1, 0)
        return cls(len(values), sum(values) / len(values), values[-1], values[rank])

    def to_json(self) -> dict[str, Any]:
        def clean(v: float) -> float | None:
            return None if math.isnan(v) else v

        return {
            "count": self.count,
            "mean": clean(self.mean),
            "max": clean(self.max),
            "p99": clean(self.p99),
        }


def aggregate(scores: Iterable[TokenScore], tags: Sequence[str] = TAGS) -> dict[str, Aggregate]:
    """Per tag, and ``tagged``-style unions are the caller's (:func:`union`)."""
    by_tag: dict[str, list[float]] = {t: [] for t in tags}
    for s in scores:
        if s.tag in by_tag:
            by_tag[s.tag].append(s.error)
    return {t: Aggregate.of(v) for t, v in by_tag.items()}


def union(scores: Iterable[TokenScore], tags: Iterable[str]) -> Aggregate:
    wanted = set(tags)
    return Aggregate.of(s.error for s in scores if s.tag in wanted)


def worst(scores: Iterable[TokenScore], n: int = 10) -> list[TokenScore]:
    return sorted(scores, key=lambda s: s.error, reverse=True)[:n]


def post_mixed(scores: Iterable[TokenScore], events: Mapping[str, Events]) -> Aggregate:
    """vLLM #51812's table: every token of a request from its first
    misordered step on (that step included), pooled over requests."""
    chosen = []
    for s in scores:
        ev = events.get(s.request)
        first = ev.first_misordered if ev is not None else None
        if first is not None and s.step >= first:
            chosen.append(s.error)
    return Aggregate.of(chosen)


@dataclass
class Evidence:
    """Everything a pass rule may look at for one scenario run."""

    scores: list[TokenScore]
    requests: dict[str, RunRequest]
    builds: list[BuildRecord]
    steps: list[StepRecord]
    events: dict[str, Events]
    gates_fit: bool | None
    gates_line: str
    # The subject requests run alone in a fresh engine: their tokens and
    # their token scores against the same reference.
    alone: dict[str, RunRequest] | None = None
    alone_scores: list[TokenScore] | None = None
