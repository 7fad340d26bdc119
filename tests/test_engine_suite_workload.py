"""Workloads: seeded prompts, arrivals and roles as data."""

from __future__ import annotations

import pytest

from gdn_backport.engine_suite import workload as wl
from gdn_backport.engine_suite.model import ModelShape

VOCAB = ModelShape().prompt_token_range


def test_prompts_are_seeded_and_in_range() -> None:
    a = wl.prompt_tokens(0, "p0", 500, VOCAB)
    assert a == wl.prompt_tokens(0, "p0", 500, VOCAB)
    assert a != wl.prompt_tokens(1, "p0", 500, VOCAB)
    assert a != wl.prompt_tokens(0, "p1", 500, VOCAB)
    assert all(VOCAB[0] <= t < VOCAB[1] for t in a)


def test_pr_recipe() -> None:
    w = wl.pr_recipe(0, VOCAB)
    assert [len(r.prompt) for r in w.requests] == [120, 64]
    assert all(r.arrival == 0 and r.max_tokens == 64 for r in w.requests)


def test_misorder_rich_keeps_streams_decoding_while_requests_reach_the_limit() -> None:
    w = wl.misorder_rich(0, VOCAB, max_model_len=128, num_spec=2, finishers=6, gap=2)
    finishers = [r for r in w.requests if r.id.startswith("f")]
    assert [r.arrival for r in finishers] == [1, 3, 5, 7, 9, 11]
    assert all(128 - 26 <= len(r.prompt) < 128 and r.max_tokens >= 128 for r in finishers)
    shorts = [r for r in w.requests if r.id.startswith("t")]
    assert shorts and all(2 <= len(r.prompt) <= 3 for r in shorts)
    assert all(r.max_tokens >= 128 for r in w.requests if r.id.startswith("d"))


def test_one_token_arrivals_follow_the_background() -> None:
    w = wl.one_token_arrivals(0, VOCAB, others=2, background=3, new=2, second_wave=1)
    new = w.by_role("new")
    assert [r.id for r in new] == ["n0", "n1", "w0"]
    assert all(len(r.prompt) == 1 for r in new)
    assert [r.after for r in new] == ["b2", "b2", "n0"] and all(r.arrival == 1 for r in new)
    assert {r.id for r in w.by_role("background")} == {"b0", "b1", "b2"}
    # Background rows sit between the others in the batch order.
    assert [r.id for r in w.requests][:4] == ["o0", "b0", "o1", "b1"]


def test_prefix_hit_refers_to_its_source() -> None:
    w = wl.prefix_hit(0, VOCAB)
    hit = w.by_role("prefix_hit")[0]
    assert (hit.prefix_of, hit.prefix_blocks, len(hit.prompt)) == ("src", 0, 1)


def test_json_roundtrip() -> None:
    for w in (wl.pr_recipe(0, VOCAB), wl.prefix_hit(0, VOCAB), wl.one_token_arrivals(0, VOCAB)):
        assert wl.Workload.from_json(w.to_json()) == w


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: wl.Request("a", (), 4), "prompt: empty"),
        (lambda: wl.Request("a", (5,), 0), "max_tokens = 0"),
        (lambda: wl.Request("a", (5,), 4, role="victim"), "role = 'victim'"),
        (lambda: wl.Workload("w", (wl.Request("a", (5,), 1), wl.Request("a", (6,), 1))), "twice"),
        (lambda: wl.Workload("w", (wl.Request("a", (5,), 1, after="z"),)), "after = 'z': unknown"),
    ],
)
def test_bad_requests_are_refused(build: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()  # type: ignore[operator]
