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
    """Each subject request (``roles``) must err, against the teacher-forced
    reference, no more than ``max_ratio`` times the floor of its alone runs
    (the same requests in a fresh engine); the other requests must stay at
    that floor too (collateral damage through stale buffers); and no FULL
    CUDA-graph replay may run on decode buffers its build did not fill.

    The subjects' tokens are compared with their alone runs, but only to
    report where they first differ: on a random-weight model the logits are
    nearly flat, so bf16 batch-vs-alone numerics flip greedy argmax ties and
    a correct engine differs from its alone run (0.25.1 on the H200: the
    full fix at output 0 with errors at the floor). The teacher-forced error
    scores each run on its own tokens and does not care which tie won."""

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
        # Observed directly, the mechanism needs no error to show: it fails
        # even where the workload missed what the errors would need (flat
        # gates, no recycled slot), since the replay itself read buffers
        # left from another step.
        stale = _stale_replays(ev.builds)
        missing = self._unreached(ev)
        if missing is not None:
            if stale is not None:
                return Verdict(FAIL, f"{stale} (and: {missing})")
            return Verdict(INCONCLUSIVE, missing)
        assert ev.alone_scores is not None and ev.alone is not None
        floor_agg = Aggregate.of(s.error for s in ev.alone_scores)
        floor = _floor(floor_agg, self.abs_floor)
        subjects = self._subjects(ev)
        by_request: dict[str, list[float]] = {}
        for s in ev.scores:
            by_request.setdefault(s.request, []).append(s.error)
        problems = [stale] if stale is not None else []
        high = _over(by_request, subjects, floor, self.max_ratio)
        problems += [f"{rid}: mean error {r:.1f}x the alone floor {floor:.3g}" for rid, r in high]
        if self.check_others:
            others = sorted(r.id for r in ev.requests.values() if r.role in self.other_roles)
            problems += [
                f"collateral: {rid} mean error {r:.1f}x the alone floor {floor:.3g}"
                for rid, r in _over(by_request, others, floor, self.max_ratio)
            ]
        info = _divergences(ev, subjects)
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            return Verdict(FAIL, "; ".join(problems[:3]) + more + info)
        worst = _worst_ratio(by_request, subjects, floor)
        return Verdict(
            PASS,
            f"{len(subjects)} subject request(s) within {self.max_ratio}x the alone floor "
            f"{floor_agg.mean:.3g} (n={floor_agg.count}; worst "
            f"{worst[0] if worst else '-'} {worst[1] if worst else math.nan:.1f}x), "
            f"no stale FULL replay" + info,
        )

    def _subjects(self, ev: Evidence) -> list[str]:
        return sorted(r.id for r in ev.requests.values() if r.role in self.roles)

    def _unreached(self, ev: Evidence) -> str | None:
        """Why the run cannot show what the scenario is about; None when it can."""
        gate = _gates(ev, self.require_gates)
        if gate is not None:
            return gate.reason
        subjects = self._subjects(ev)
        if not subjects:
            return f"no request with role {'/'.join(self.roles)}"
        if ev.alone is None or ev.alone_scores is None:
            return "no alone run of the subject requests"
        if self.first_chunk is not None:
            missed = [rid for rid in subjects if _first_chunk(ev.builds, rid) != self.first_chunk]
            if missed:
                what = (
                    "a prefix-cache hit leaving one token"
                    if self.first_chunk == "hit"
                    else ("a one-token first chunk with nothing computed")
                )
                return f"{missed[0]}: its first chunk was not {what}"
        if self.require_recycled:
            recycled = {rid for s in ev.steps for rid in s.recycled}
            if not recycled & set(subjects):
                return "no subject request got a recycled state slot"
        if self.require_uniform_step:
            uniform = {s.step for s in ev.steps if s.uniform_shape}
            reached = {b.step for b in ev.builds if set(b.new_rows) & set(subjects)}
            if not uniform & reached:
                return (
                    "no step held a new one-token row in a uniform decode batch "
                    "(no FULL-graph replay to test)"
                )
        count = len(ev.alone_scores)
        if count < self.min_alone:
            return f"{count} scored alone tokens (need {self.min_alone})"
        return None


def _stale_replays(builds: Sequence[BuildRecord]) -> str | None:
    """The FAIL reason when some FULL replay ran on buffers its build did
    not fill (one record per GDN KV-cache group: a step counts once)."""
    hit = [b for b in builds if b.stale_replay and any(r is not None for r in b.req_ids)]
    if not hit:
        return None
    steps = sorted({b.step for b in hit})
    rows = sorted({r for b in hit for r in b.req_ids if r is not None})
    new = sorted({r for b in hit for r in b.new_rows})
    listed = ", ".join(rows[:8]) + (f" (+{len(rows) - 8} more)" if len(rows) > 8 else "")
    return (
        "the runner replayed the FULL decode graph with persistent buffers the builder did "
        f"not fill: {len(steps)} step(s) ({', '.join(map(str, steps))}; {len(hit)} GDN builds), "
        f"new one-token rows {', '.join(new) or 'none'}, rows {listed}"
    )


def _divergences(ev: Evidence, subjects: Sequence[str]) -> str:
    """Where each subject's tokens first differ from its alone run, as
    information (see the class docstring for why it is not judged)."""
    assert ev.alone is not None
    found = []
    for rid in subjects:
        alone = ev.alone.get(rid)
        if alone is None:
            found.append(f"{rid} (no alone run)")
            continue
        div = _divergence(ev.requests[rid].tokens, alone.tokens)
        if div is not None:
            found.append(f"{rid} at output {div}")
    if not found:
        return "; tokens equal their alone runs"
    more = f" (+{len(found) - 4} more)" if len(found) > 4 else ""
    return (
        f"; tokens differ from alone (not judged: greedy ties on a random-weight model): "
        f"{', '.join(found[:4])}{more}"
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


def _over(
    by_request: dict[str, list[float]], ids: Sequence[str], floor: float, limit: float
) -> list[tuple[str, float]]:
    """The requests of ``ids`` whose mean error passes ``limit`` x ``floor``, worst first."""
    ratios = [
        (rid, (sum(v) / len(v)) / floor)
        for rid in ids
        if (v := by_request.get(rid)) and not math.isnan(floor)
    ]
    return sorted(((rid, r) for rid, r in ratios if r > limit), key=lambda p: -p[1])


def _worst_ratio(
    by_request: dict[str, list[float]], ids: Sequence[str], floor: float
) -> tuple[str, float] | None:
    ratios = [
        (rid, (sum(v) / len(v)) / floor)
        for rid in ids
        if (v := by_request.get(rid)) and not math.isnan(floor)
    ]
    return max(ratios, key=lambda p: p[1]) if ratios else None
