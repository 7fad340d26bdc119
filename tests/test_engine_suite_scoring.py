"""Tags, aggregates and vLLM #51812's table, on hand-made token streams."""

from __future__ import annotations

import math

import pytest

from gdn_backport.engine_suite.recorder import describe_build
from gdn_backport.engine_suite.scoring import (
    Aggregate,
    Events,
    RunRequest,
    aggregate,
    attribute,
    post_mixed,
    score_tokens,
    worst,
)


def req(
    rid: str, n: int, first_step: int = 0, role: str = "stream", lp: float = -1.0
) -> RunRequest:
    return RunRequest(
        rid,
        (5, 6),
        tuple(range(100, 100 + n)),
        (lp,) * n,
        tuple(range(first_step, first_step + n)),
        role,
    )


def test_tags_follow_the_events() -> None:
    events = {
        "hit": Events(misordered_steps={3, 6}),
        "new": Events(new_row="decode", new_row_class="decode"),
        "side": Events(first_stale=2),
    }
    requests = [req("hit", 8), req("new", 4, first_step=1), req("side", 4), req("calm", 3)]
    ref = {r.id: [-1.0] * len(r.tokens) for r in requests}
    tags = {(s.request, s.index): s.tag for s in score_tokens(requests, ref, events)}
    assert [tags[("hit", i)] for i in range(8)] == [
        "first",
        "clean",
        "clean",
        "misordered",
        "after",
        "after",
        "misordered",
        "after",
    ]
    assert {tags[("new", i)] for i in range(4)} == {"new_row"}
    assert [tags[("side", i)] for i in range(4)] == ["first", "clean", "stale", "stale"]
    assert [tags[("calm", i)] for i in range(3)] == ["first", "clean", "clean"]


def test_tokens_without_both_logprobs_are_left_out() -> None:
    r = RunRequest("a", (1,), (7, 8, 9), (-1.0, None, -1.5), (0, 1, 2))
    scores = score_tokens([r], {"a": [-1.25, -2.0]}, {})
    assert [(s.index, s.error) for s in scores] == [(0, 0.25)]
    assert score_tokens([r], {}, {}) == []


def test_attribute_reads_the_builds() -> None:
    misordered = describe_build(
        step=4,
        group=0,
        query_start_loc=[0, 1, 4],
        drafts=[-1, 2],
        counts=(1, 0, 1),
        req_ids=["a", "b"],
        computed=[126, 50],
    )
    new = describe_build(
        step=6,
        group=0,
        query_start_loc=[0, 1, 2],
        drafts=None,
        counts=(0, 2, 0),
        req_ids=["o", "n"],
        computed=[20, 0],
    )
    stale = describe_build(
        step=8,
        group=0,
        query_start_loc=[0, 1, 2],
        drafts=None,
        counts=(0, 1, 1),
        req_ids=["o", "m"],
        computed=[22, 0],
        full_graph=(True, 16),
        dispatch="FULL",
    )
    events = attribute([misordered, misordered, new, stale])
    assert (events["b"].misordered_steps == {4} and "a" not in events) or not events[
        "a"
    ].misordered_steps
    assert events["n"].new_row == "decode" and events["n"].new_row_class == "decode"
    assert events["m"].new_row == "stale" and events["m"].new_row_class == "prefill"
    assert events["o"].first_stale == 8


def test_aggregates() -> None:
    agg = Aggregate.of([0.0] * 99 + [1.0])
    assert (agg.count, agg.mean, agg.max, agg.p99) == (100, 0.01, 1.0, 0.0)
    assert Aggregate.of([0.1, 0.2, 0.9]).p99 == 0.9
    empty = Aggregate.of([])
    assert empty.count == 0 and math.isnan(empty.mean) and empty.to_json()["mean"] is None
    requests = [req("hit", 6, lp=-1.1), req("calm", 6)]
    ref = {r.id: [-1.0] * 6 for r in requests}
    scores = score_tokens(requests, ref, {"hit": Events(misordered_steps={2})})
    by_tag = aggregate(scores)
    assert by_tag["misordered"].count == 1 and by_tag["after"].count == 3
    assert by_tag["misordered"].mean == pytest.approx(0.1)
    assert by_tag["clean"].count == 6 and by_tag["first"].count == 2
    top = worst(scores, 2)
    assert [s.request for s in top] == ["hit", "hit"] and top[0].error == pytest.approx(0.1)


def test_post_mixed_pools_every_token_from_the_first_misordered_step() -> None:
    requests = [req("a", 6, lp=-1.2), req("b", 6)]
    ref = {r.id: [-1.0] * 6 for r in requests}
    events = {"a": Events(misordered_steps={3, 5})}
    agg = post_mixed(score_tokens(requests, ref, events), events)
    assert agg.count == 3 and agg.mean == pytest.approx(0.2) and agg.max == pytest.approx(0.2)
