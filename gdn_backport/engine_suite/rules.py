"""Pass rules as data: each scenario carries one, the suite applies it.

A rule returns PASS, FAIL or INCONCLUSIVE with a reason. INCONCLUSIVE means
the run could not show what the scenario is about (too few tokens reached
the bug's layout, flat gates, no recycled slot): the suite fails the run
with that reason, it never passes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gdn_backport.engine_suite.recorder import BuildRecord
from gdn_backport.engine_suite.scoring import Aggregate, Evidence, union

__all__ = ["AloneMatchRule", "PassRule", "TaggedFloorRule", "Verdict"]

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"


@dataclass(frozen=True)
class Verdict:
    result: str
    reason: str


class PassRule(Protocol):
    @property
    def kind(self) -> str: ...

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags whose errors the report shows as "tagged"."""

    @property
    def alone_roles(self) -> tuple[str, ...]:
        """Roles of the requests to run alone in a fresh engine (none: no alone run)."""

    def evaluate(self, ev: Evidence) -> Verdict: ...


def _gates(ev: Evidence, required: bool) -> Verdict | None:
    if required and ev.gates_fit is not True:
        return Verdict(INCONCLUSIVE, f"model unfit: {ev.gates_line}")
    return None


def _floor(agg: Aggregate, abs_floor: float) -> float:
    return max(agg.mean, abs_floor)


@dataclass(frozen=True)
class TaggedFloorRule:
    """Tokens the bug reaches must err no more than ``max_ratio`` times the
    clean tokens of the same run.

    Judged per tag group: ``tagged_tags`` (vLLM #51812's own measure, every
    token from a request's first misordered step on: the report's "tagged")
    and each of ``also_tags`` on its own (the misordered steps alone: where
    the model forgets fast, a long clean tail after a hit would otherwise
    dilute the hit). A group with fewer than ``min_tagged`` tokens is not
    judged; no group judged is inconclusive."""

    tagged_tags: tuple[str, ...] = ("misordered", "after")
    also_tags: tuple[tuple[str, ...], ...] = (("misordered",),)
    floor_tags: tuple[str, ...] = ("clean",)
    max_ratio: float = 3.0
    min_tagged: int = 16
    min_floor: int = 16
    # A floor below this counts as this: bf16 never agrees better, and a
    # near-zero floor would turn noise into a large ratio.
    abs_floor: float = 2e-4
    require_gates: bool = True
    kind: str = "tagged-floor"

    @property
    def tags(self) -> tuple[str, ...]:
        return self.tagged_tags

    @property
    def alone_roles(self) -> tuple[str, ...]:
        return ()

    def evaluate(self, ev: Evidence) -> Verdict:
        gate = _gates(ev, self.require_gates)
        if gate is not None:
            return gate
        floor = union(ev.scores, self.floor_tags)
        groups = [(g, union(ev.scores, g)) for g in (self.tagged_tags, *self.also_tags)]
        judged = [(g, agg) for g, agg in groups if agg.count >= self.min_tagged]
        if not judged:
            return Verdict(
                INCONCLUSIVE,
                f"{groups[0][1].count} tagged tokens (need {self.min_tagged}): the workload did "
                "not reach the layout often enough",
            )
        if floor.count < self.min_floor:
            return Verdict(INCONCLUSIVE, f"{floor.count} clean tokens (need {self.min_floor})")
        used = _floor(floor, self.abs_floor)

        def text(tags: tuple[str, ...], agg: Aggregate) -> str:
            return (
                f"{'+'.join(tags)} mean {agg.mean:.3g} (n={agg.count}, max {agg.max:.3g}) is "
                f"{agg.mean / used:.1f}x the floor {used:.3g} (clean mean {floor.mean:.3g}, "
                f"n={floor.count})"
            )

        for tags, agg in judged:
            if agg.mean / used > self.max_ratio:
                return Verdict(FAIL, f"{text(tags, agg)} (> {self.max_ratio}x)")
        return Verdict(PASS, f"{text(*judged[0])} (<= {self.max_ratio}x)")


@dataclass(frozen=True)
class AloneMatchRule:
    """Each subject request (``roles``) must produce the tokens it produces
    alone in a fresh engine, with errors at the floor of those alone runs;
    the other requests' errors must stay at that floor too (collateral
    damage through stale buffers)."""

    roles: tuple[str, ...] = ("new",)
    max_ratio: float = 3.0
    check_others: bool = True
    other_roles: tuple[str, ...] = ("stream", "background")
    require_recycled: bool = True
    # How each subject's first chunk must have reached the builder: "fresh"
    # (one token, nothing computed: a brand-new request) or "hit" (one token
    # after a prefix-cache hit); None: not checked.
    first_chunk: str | None = "fresh"
    # The runner would replay a FULL decode graph: some step holding a
    # subject's one-token first chunk had the uniform decode shape.
    require_uniform_step: bool = False
    min_alone: int = 8
    abs_floor: float = 2e-4
    require_gates: bool = True
    kind: str = "alone-match"

    @property
    def tags(self) -> tuple[str, ...]:
        return ("new_row", "stale")

    @property
    def alone_roles(self) -> tuple[str, ...]:
        return self.roles

    def evaluate(self, ev: Evidence) -> Verdict:
        gate = _gates(ev, self.require_gates)
        if gate is not None:
            return gate
        subjects = sorted(r.id for r in ev.requests.values() if r.role in self.roles)
        if not subjects:
            return Verdict(INCONCLUSIVE, f"no request with role {'/'.join(self.roles)}")
        if ev.alone is None or ev.alone_scores is None:
            return Verdict(INCONCLUSIVE, "no alone run of the subject requests")
        if self.first_chunk is not None:
            missed = [rid for rid in subjects if _first_chunk(ev.builds, rid) != self.first_chunk]
            if missed:
                what = (
                    "a prefix-cache hit leaving one token"
                    if self.first_chunk == "hit"
                    else ("a one-token first chunk with nothing computed")
                )
                return Verdict(INCONCLUSIVE, f"{missed[0]}: its first chunk was not {what}")
        if self.require_recycled:
            recycled = {rid for s in ev.steps for rid in s.recycled}
            if not recycled & set(subjects):
                return Verdict(INCONCLUSIVE, "no subject request got a recycled state slot")
        if self.require_uniform_step:
            uniform = {s.step for s in ev.steps if s.uniform_shape}
            reached = {b.step for b in ev.builds if set(b.new_rows) & set(subjects)}
            if not uniform & reached:
                return Verdict(
                    INCONCLUSIVE,
                    "no step held a new one-token row in a uniform decode batch "
                    "(no FULL-graph replay to test)",
                )
        floor_agg = Aggregate.of(s.error for s in ev.alone_scores)
        if floor_agg.count < self.min_alone:
            return Verdict(
                INCONCLUSIVE, f"{floor_agg.count} scored alone tokens (need {self.min_alone})"
            )
        floor = _floor(floor_agg, self.abs_floor)
        problems = []
        for rid in subjects:
            alone = ev.alone.get(rid)
            run = ev.requests[rid]
            if alone is None:
                problems.append(f"{rid}: no alone run")
                continue
            div = _divergence(run.tokens, alone.tokens)
            if div is not None:
                problems.append(f"{rid}: tokens differ from alone at output {div}")
        by_request: dict[str, list[float]] = {}
        for s in ev.scores:
            by_request.setdefault(s.request, []).append(s.error)
        worst_subject = _worst_ratio(by_request, subjects, floor)
        if worst_subject is not None and worst_subject[1] > self.max_ratio:
            problems.append(
                f"{worst_subject[0]}: mean error {worst_subject[1]:.1f}x the alone floor"
            )
        if self.check_others:
            others = sorted(r.id for r in ev.requests.values() if r.role in self.other_roles)
            worst_other = _worst_ratio(by_request, others, floor)
            if worst_other is not None and worst_other[1] > self.max_ratio:
                problems.append(
                    f"collateral: {worst_other[0]} mean error {worst_other[1]:.1f}x the alone floor"
                )
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            return Verdict(FAIL, "; ".join(problems[:3]) + more)
        return Verdict(
            PASS,
            f"{len(subjects)} subject requests match their alone runs, errors within "
            f"{self.max_ratio}x the alone floor {floor_agg.mean:.3g}",
        )


def _first_chunk(builds: Sequence[BuildRecord], rid: str) -> str | None:
    """ "fresh", "hit" or "other": how the request's first row looked."""
    for b in builds:
        if rid in b.req_ids:
            row = b.req_ids.index(rid)
            if b.query_lens[row] != 1 or b.computed is None:
                return "other"
            return "fresh" if b.computed[row] == 0 else "hit"
    return None


def _divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _worst_ratio(
    by_request: dict[str, list[float]], ids: Sequence[str], floor: float
) -> tuple[str, float] | None:
    ratios = [
        (rid, (sum(v) / len(v)) / floor)
        for rid in ids
        if (v := by_request.get(rid)) and not math.isnan(floor)
    ]
    return max(ratios, key=lambda p: p[1]) if ratios else None
