"""Build attribution: hand-made host tensors, and fake builder/runner classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gdn_backport.engine_suite import recorder as rec
from gdn_backport.engine_suite.recorder import Recorder, describe_build
from gdn_backport.runtime import probe


def starts(*lens: int) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def test_the_pr_layout_displaces_every_spec_row_after_the_one_token_row() -> None:
    # vLLM #51812: one non-spec token, then three spec rows of 1 + 2 tokens.
    b = describe_build(
        step=7,
        group=0,
        query_start_loc=starts(1, 3, 3, 3),
        drafts=[-1, 2, 2, 2],
        counts=(3, 0, 1),
        req_ids=["a", "b", "c", "d"],
        computed=[126, 60, 70, 80],
    )
    assert b.mixed and b.misordered
    assert b.displaced == {"b": 1, "c": 1, "d": 1}
    assert b.row_class == ["prefill", "spec", "spec", "spec"]
    assert b.new_rows == {}


def test_spec_rows_first_are_not_misordered() -> None:
    b = describe_build(
        step=1,
        group=0,
        query_start_loc=starts(3, 3, 40),
        drafts=[2, 2, -1],
        counts=(2, 0, 1),
        req_ids=["a", "b", "c"],
        computed=[9, 9, 0],
    )
    assert b.mixed and not b.misordered and b.displaced == {}
    # A spec row behind a two-row non-spec block: shifted by both blocks' tokens.
    b = describe_build(
        step=1,
        group=0,
        query_start_loc=starts(3, 1, 2, 3),
        drafts=[2, -1, -1, 2],
        counts=(2, 0, 2),
        req_ids=["a", "b", "c", "d"],
        computed=[9, 9, 9, 9],
    )
    assert b.misordered and b.displaced == {"d": 3}


def test_pure_spec_and_padding() -> None:
    b = describe_build(
        step=2,
        group=1,
        query_start_loc=starts(3, 3, 0, 0),
        drafts=[2, 2, -1, -1],
        counts=(2, 0, 0),
        req_ids=["a", "b"],
        computed=[5, 5],
        full_graph=(True, 48),
        dispatch="FULL",
    )
    assert not b.mixed and not b.misordered
    assert b.req_ids == ["a", "b", None, None] and b.row_class[2:] == ["pad", "pad"]
    assert b.full_buffers is True and not b.stale_replay


def test_new_one_token_rows_as_the_builder_classified_them() -> None:
    # Unpatched split: every one-token row of a non-spec batch is a decode.
    b = describe_build(
        step=3,
        group=0,
        query_start_loc=starts(1, 1, 1),
        drafts=None,
        counts=(0, 3, 0),
        req_ids=["o0", "n0", "n1"],
        computed=[30, 0, 0],
        full_graph=(True, 48),
        dispatch="FULL",
    )
    assert b.new_rows == {"n0": "decode", "n1": "decode"} and b.full_buffers and not b.stale_replay
    # A fixed builder calls them prefills and fills no decode buffers; the
    # runner still replaying FULL by shape is a stale replay.
    b = describe_build(
        step=3,
        group=0,
        query_start_loc=starts(1, 1, 1),
        drafts=None,
        counts=(0, 1, 2),
        req_ids=["o0", "n0", "n1"],
        computed=[30, 0, 0],
        full_graph=(True, 48),
        dispatch="FULL",
    )
    assert b.new_rows == {"n0": "prefill", "n1": "prefill"}
    assert b.full_buffers is False and b.stale_replay
    # Beside spec rows 0.25.1 reclassifies one-token rows as prefills.
    b = describe_build(
        step=3,
        group=0,
        query_start_loc=starts(3, 1),
        drafts=[2, -1],
        counts=(1, 0, 1),
        req_ids=["s", "n"],
        computed=[40, 0],
    )
    assert b.new_rows == {"n": "prefill"}


# -- the wrappers, on fake vLLM classes -------------------------------------


class Meta:
    def __init__(self, n_spec: int, decodes: int, prefills: int) -> None:
        self.num_spec_decodes, self.num_decodes, self.num_prefills = n_spec, decodes, prefills


class Builder:
    use_full_cuda_graph = True
    decode_cudagraph_max_bs = 32

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        num_accepted_tokens: Any = None,
        num_decode_draft_tokens_cpu: Any = None,
        fast_build: bool = False,
    ) -> Meta:
        drafts = num_decode_draft_tokens_cpu
        if drafts is not None and any(d >= 0 for d in drafts):
            return Meta(sum(d >= 0 for d in drafts), 0, sum(d < 0 for d in drafts))
        return Meta(0, len(common_attn_metadata.query_start_loc_cpu) - 1, 0)

    def build_for_cudagraph_capture(self, m: Any) -> Meta:
        return self.build(0, m, None, [0])


class Mode:
    name = "PIECEWISE"


class Runner:
    uniform_decode_query_len = 3

    def __init__(self, builder: Builder) -> None:
        self.builder = builder
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0, num_computed_tokens_cpu=[])
        self.compilation_config = SimpleNamespace(static_forward_context={})
        self.kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=Mode())]
        )

    def _determine_batch_execution_and_padding(self, *a: Any) -> tuple[Mode, None]:
        return Mode(), None

    def execute_model(self, out: Any) -> str:
        rows = out.rows
        self.input_batch = SimpleNamespace(
            req_ids=[r for r, _, _ in rows],
            num_reqs=len(rows),
            num_computed_tokens_cpu=[c for _, _, c in rows],
        )
        self._determine_batch_execution_and_padding()
        lens = [out.num_scheduled_tokens[r] for r, _, _ in rows]
        drafts = [d for _, d, _ in rows]
        meta = SimpleNamespace(query_start_loc_cpu=starts(*lens))
        # positional, as build_for_cudagraph_capture calls it, and by keyword
        self.builder.build(0, meta, None, drafts)
        self.builder.build(
            common_prefix_len=0, common_attn_metadata=meta, num_decode_draft_tokens_cpu=drafts
        )
        return "model output"


def _out(
    rows: list[tuple[str, int, int]],
    lens: dict[str, int],
    new: dict[str, list[int]] | None = None,
    finished: tuple[str, ...] = (),
) -> Any:
    return SimpleNamespace(
        rows=rows,
        num_scheduled_tokens=lens,
        scheduled_spec_decode_tokens={r: [0] * d for r, d, _ in rows if d >= 0},
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in (new or {}).items()
        ],
        finished_req_ids=set(finished),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
    )


@pytest.fixture
def wired() -> Any:
    class B(Builder):
        pass

    class R(Runner):
        pass

    recorder = Recorder()
    seen: list[Any] = []
    recorder.on_first_step.append(seen.append)
    undo = rec.install(recorder, B, R)
    yield recorder, B, R, seen
    undo()
    assert "build" not in B.__dict__ and "execute_model" not in R.__dict__


def test_builds_are_attributed_to_steps_and_rows(wired: Any) -> None:
    recorder, B, R, seen = wired
    runner = R(B())
    # Outside a driver step (profiling) and during capture: counted only.
    runner.builder.build(0, SimpleNamespace(query_start_loc_cpu=[0, 1]))
    runner.builder.build_for_cudagraph_capture(SimpleNamespace(query_start_loc_cpu=[0, 1]))
    assert recorder.other_builds == {"capture": 1, "other": 1} and not recorder.builds
    recorder.step = 0
    assert (
        runner.execute_model(
            _out([("p0", -1, 0), ("p1", -1, 0)], {"p0": 120, "p1": 64}, {"p0": [1], "p1": [2]})
        )
        == "model output"
    )
    recorder.step = 9
    runner.execute_model(
        _out([("p0", -1, 126), ("p1", 2, 70)], {"p0": 1, "p1": 3}, finished=("x",))
    )
    assert seen == [runner]
    assert [(b.step, b.group) for b in recorder.builds] == [(0, 0), (0, 1), (9, 0), (9, 1)]
    last = recorder.builds[-1]
    assert last.req_ids == ["p0", "p1"] and last.misordered and last.displaced == {"p1": 1}
    assert last.dispatch == "PIECEWISE"
    steps = recorder.steps
    assert (
        [s.step for s in steps] == [0, 9]
        and steps[1].finished == ["x"]
        and steps[0].new == ["p0", "p1"]
    )
    assert steps[1].spec == {"p1": 2} and steps[1].builds == 2 and not steps[1].uniform_shape
    assert recorder.tokens() is None  # the step is over
    assert recorder.to_json()["builds"][3]["displaced"] == {"p1": 1}


def test_recycled_blocks_name_their_previous_owner(wired: Any) -> None:
    recorder, B, R, _ = wired
    runner = R(B())
    recorder.step = 0
    runner.execute_model(_out([("b0", -1, 0)], {"b0": 5}, {"b0": [4]}))
    recorder.step = 6
    runner.execute_model(_out([("n0", -1, 0)], {"n0": 1}, {"n0": [4]}, finished=("b0",)))
    assert recorder.steps[1].recycled == {"n0": [[0, "b0"]]}
    # A block another group had before is recycled too (one pool).
    out = _out([("n1", -1, 0)], {"n1": 1})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="n1", block_ids=([9], [4]))]
    recorder.step = 7
    runner.execute_model(out)
    assert recorder.steps[2].recycled == {"n1": [[1, "n0"]]}
    assert [b.new_rows for b in recorder.builds if b.step == 6] == [{"n0": "decode"}] * 2


def test_recorder_failures_never_reach_vllm(wired: Any) -> None:
    recorder, B, R, _ = wired
    runner = R(B())
    recorder.step = 1
    out = _out([("a", -1, 3)], {"a": 1})
    out.num_scheduled_tokens = None  # the recorder's step record cannot be made
    with pytest.raises(TypeError):  # the runner's own error passes through
        runner.execute_model(out)
    assert recorder.errors and recorder.errors[0].startswith("step:")


def test_coexists_with_the_probe(wired: Any) -> None:
    recorder, B, R, _ = wired
    counter = probe.Probe(every=0)
    assert probe.wrap_builder(B, counter)
    runner = R(B())
    recorder.step = 4
    runner.execute_model(_out([("p0", -1, 126), ("p1", 2, 70)], {"p0": 1, "p1": 3}))
    assert counter.counts().spec_not_prefix == 2 and counter.counts().builds == 2
    assert len(recorder.builds) == 2 and all(b.misordered for b in recorder.builds)
    assert probe.unwrap_builder(B)
