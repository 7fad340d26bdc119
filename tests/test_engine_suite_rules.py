"""Pass rules: they pass at the floor, fail on injected errors and are
inconclusive where the run could not show anything."""

from __future__ import annotations

from gdn_backport.engine_suite.recorder import StepRecord, describe_build
from gdn_backport.engine_suite.rules import AloneMatchRule, TaggedFloorRule
from gdn_backport.engine_suite.scoring import (
    Events,
    Evidence,
    RunRequest,
    attribute,
    score_tokens,
)

FLOOR = 3e-4


def stream(
    rid: str, n: int, role: str = "stream", tokens: tuple[int, ...] | None = None
) -> RunRequest:
    toks = tokens or tuple(range(200, 200 + n))
    return RunRequest(rid, (3, 4), toks, (-1.0,) * n, tuple(range(n)), role)


def floor_ref(
    requests: list[RunRequest], bump: dict[tuple[str, int], float] | None = None
) -> dict[str, list[float | None]]:
    # A small deterministic floor, and injected errors at chosen tokens.
    out: dict[str, list[float | None]] = {}
    for r in requests:
        out[r.id] = [
            -1.0 + FLOOR * (1 + (i % 3)) / 2 + (bump or {}).get((r.id, i), 0.0)
            for i in range(len(r.tokens))
        ]
    return out


def evidence(
    requests: list[RunRequest],
    ref: dict[str, list[float | None]],
    events: dict[str, Events],
    fit: bool | None = True,
    **kw: object,
) -> Evidence:
    scores = score_tokens(requests, ref, events)
    return Evidence(
        scores, {r.id: r for r in requests}, [], [], events, fit, "gates vary: test", **kw
    )  # type: ignore[arg-type]


def test_tagged_floor_fails_on_an_injected_misordered_error_and_passes_at_the_floor() -> None:
    requests = [stream("victim", 40), stream("calm", 40)]
    events = {"victim": Events(misordered_steps={10})}
    rule = TaggedFloorRule()
    ok = rule.evaluate(evidence(requests, floor_ref(requests), events))
    assert ok.result == "PASS", ok.reason
    bumped = floor_ref(requests, {("victim", i): 0.02 for i in range(10, 40)})
    bad = rule.evaluate(evidence(requests, bumped, events))
    assert bad.result == "FAIL" and "x the floor" in bad.reason


def test_a_hit_diluted_by_a_clean_tail_still_fails() -> None:
    requests = [stream("victim", 200), stream("calm", 60)]
    steps = set(range(10, 30))
    events = {"victim": Events(misordered_steps=steps)}
    bumped = floor_ref(requests, {("victim", i): 0.004 for i in steps})
    verdict = TaggedFloorRule().evaluate(evidence(requests, bumped, events))
    assert verdict.result == "FAIL" and verdict.reason.startswith("misordered mean 0.00")
    # Judged on the PR's measure alone it would have passed.
    alone = TaggedFloorRule(also_tags=()).evaluate(evidence(requests, bumped, events))
    assert alone.result == "PASS"


def test_tagged_floor_is_inconclusive_without_tagged_tokens_or_fit_gates() -> None:
    requests = [stream("a", 40), stream("b", 40)]
    rule = TaggedFloorRule()
    none = rule.evaluate(evidence(requests, floor_ref(requests), {}))
    assert none.result == "INCONCLUSIVE" and none.reason.startswith("0 tagged tokens")
    events = {"a": Events(misordered_steps={5})}
    flat = rule.evaluate(evidence(requests, floor_ref(requests), events, fit=False))
    assert flat.result == "INCONCLUSIVE" and flat.reason.startswith("model unfit")
    few = rule.evaluate(
        evidence(requests, floor_ref(requests), {"a": Events(misordered_steps={35})})
    )
    assert few.result == "INCONCLUSIVE" and "5 tagged tokens" in few.reason


def _new_row_evidence(
    run_tokens: tuple[int, ...],
    bump: float = 0.0,
    other_bump: float = 0.0,
    recycled: bool = True,
    dispatch: str | None = None,
    builder_class: str = "decode",
    fit: bool = True,
) -> Evidence:
    new = stream("n0", 12, role="new", tokens=run_tokens)
    others = [stream("o0", 30), stream("b0", 6, role="background")]
    requests = [new, *others]
    ref = floor_ref(
        requests, {("n0", i): bump for i in range(12)} | {("o0", i): other_bump for i in range(30)}
    )
    alone = stream("n0", 12, role="new")
    alone_scores = score_tokens([alone], floor_ref([alone]), {})
    # builder_class "prefill" is the half fix: the new row is a prefill, so
    # the builder leaves the FULL-graph decode buffers unfilled.
    counts = (0, 2, 0) if builder_class == "decode" else (0, 1, 1)
    build = describe_build(
        step=6,
        group=0,
        query_start_loc=[0, 1, 2],
        drafts=None,
        counts=counts,
        req_ids=["o0", "n0"],
        computed=[20, 0],
        full_graph=(True, 16),
        dispatch=dispatch,
    )
    step = StepRecord(
        6, {"o0": 1, "n0": 1}, {}, ["n0"], ["b0"], {"n0": [[0, "b0"]]} if recycled else {}, True
    )
    scores = score_tokens(requests, ref, attribute([build]))
    return Evidence(
        scores,
        {r.id: r for r in requests},
        [build],
        [step],
        {},
        fit,
        "gates vary",
        {"n0": alone},
        alone_scores,
    )


GOOD = tuple(range(200, 212))


def test_alone_match_passes_at_the_floor_and_fails_subject_errors_or_collateral() -> None:
    rule = AloneMatchRule(require_uniform_step=True)
    ok = rule.evaluate(_new_row_evidence(GOOD))
    assert ok.result == "PASS" and "tokens equal their alone runs" in ok.reason, ok.reason
    wrong = rule.evaluate(_new_row_evidence(GOOD, bump=0.3))
    assert wrong.result == "FAIL" and wrong.reason.startswith("n0: mean error"), wrong.reason
    collateral = rule.evaluate(_new_row_evidence(GOOD, other_bump=0.05))
    assert collateral.result == "FAIL" and collateral.reason.startswith("collateral: o0")


def test_tokens_that_differ_from_alone_at_the_floor_pass_and_say_where() -> None:
    # What the full fix did on the H200: a greedy tie flipped at output 0,
    # the teacher-forced errors at the floor. The old rule failed it.
    verdict = AloneMatchRule().evaluate(_new_row_evidence((999, *GOOD[1:])))
    assert verdict.result == "PASS", verdict.reason
    assert "tokens differ from alone (not judged: greedy ties" in verdict.reason
    assert "n0 at output 0" in verdict.reason


def test_a_stale_full_replay_fails_by_itself_even_at_the_floor() -> None:
    # The half fix under FULL_AND_PIECEWISE: the builder calls the new row a
    # prefill, the runner replays FULL by shape. Errors at the floor (a
    # model that happened not to show it) must not hide the mechanism.
    ev = _new_row_evidence(GOOD, dispatch="FULL", builder_class="prefill")
    assert ev.builds[0].stale_replay
    verdict = AloneMatchRule(require_uniform_step=True).evaluate(ev)
    assert verdict.result == "FAIL", verdict.reason
    assert verdict.reason.startswith(
        "the runner replayed the FULL decode graph with persistent buffers the builder did "
        "not fill: 1 step(s) (6; 1 GDN builds), new one-token rows n0, rows n0, o0"
    )
    # The same builds replayed piecewise fill nothing and need nothing.
    piecewise = _new_row_evidence(GOOD, dispatch="PIECEWISE", builder_class="prefill")
    assert AloneMatchRule().evaluate(piecewise).result == "PASS"


def test_a_stale_replay_fails_where_the_workload_was_otherwise_inconclusive() -> None:
    ev = _new_row_evidence(GOOD, dispatch="FULL", builder_class="prefill", recycled=False)
    verdict = AloneMatchRule().evaluate(ev)
    assert verdict.result == "FAIL" and "(and: no subject request got a recycled" in verdict.reason


def test_alone_match_is_inconclusive_without_a_recycled_slot() -> None:
    verdict = AloneMatchRule().evaluate(_new_row_evidence(GOOD, recycled=False))
    assert verdict.result == "INCONCLUSIVE" and "recycled" in verdict.reason
    flat = AloneMatchRule().evaluate(_new_row_evidence(GOOD, fit=False))
    assert flat.result == "INCONCLUSIVE" and flat.reason.startswith("model unfit")
