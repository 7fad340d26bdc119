"""The guarded call site ``apply --strategy kernel`` writes (issue 14).

The emitted expression is reproduced here with the op's own wrapper standing
in for the tree's kernel in the fallback branch (it is upstream's kernel when
handed gathered gates and no index), so both branches can be compared on any
device: the guard must pick the op where it can serve and the fallback where
it cannot, log once, never sync, and trace whole under ``torch.compile``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gdn_backport_kernels import (
    gated_delta_rule_spec_update,
    gated_delta_rule_spec_update_naive,
    gather_token_rows,
    guard,
    use_spec_update,
)
from gdn_backport_kernels.guard import KERNEL_ENV
from tests.kernels.test_spec_update import Case, _wrapper_call, make_inputs


def _upstream(**call: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fixed spec path: the kernel on pre-gathered gates, no index."""
    return gated_delta_rule_spec_update(**{**call, "spec_token_indx": None})


def guarded(
    call: dict[str, Any], fallback: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _upstream
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expression the kernel codemod emits, with ``call``'s arguments."""
    rows = call["spec_token_indx"]
    plain = {k: v for k, v in call.items() if k not in ("spec_token_indx", "null_slot_id")}
    return (
        gated_delta_rule_spec_update(**call)
        if use_spec_update(**call)
        else fallback(
            **{
                **plain,
                "a": gather_token_rows(call["a"], rows),
                "b": gather_token_rows(call["b"], rows),
            },
            spec_token_indx=None,
            null_slot_id=call["null_slot_id"],
        )
    )


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "_warned", False)


def _inputs(device: str, **case: Any) -> dict[str, Any]:
    x = make_inputs(Case("guard", lens=(3, 2, 4), layout="interleaved", **case), device)
    x["state"] = torch.nan_to_num(x["state"])
    return x


def test_gather_token_rows_is_zero_copy_without_an_index(device: str) -> None:
    x = torch.arange(12.0, device=device).view(6, 2)
    assert gather_token_rows(x, None) is x
    rows = torch.tensor([4, 1], device=device, dtype=torch.int32)
    assert torch.equal(gather_token_rows(x, rows), x[[4, 1]])


def test_both_branches_give_the_same_result(
    device: str, monkeypatch: pytest.MonkeyPatch, fresh_warning: None
) -> None:
    # The op gathers the gates in-kernel, the fallback before the call: the
    # same values reach the same arithmetic, so results are bitwise equal.
    x = _inputs(device, gates="chunked")
    start = x["state"].clone()
    out, _ = guarded(_wrapper_call(x))
    op_state = x["state"].clone()
    monkeypatch.setenv(KERNEL_ENV, "off")
    x["state"].copy_(start)
    assert not use_spec_update(**_wrapper_call(x))
    fell_back, _ = guarded(_wrapper_call(x))
    assert torch.equal(fell_back, out)
    assert torch.equal(x["state"], op_state)


def test_unsupported_call_falls_back_and_warns_once(
    device: str, caplog: pytest.LogCaptureFixture, fresh_warning: None
) -> None:
    # K=320 is beyond the op's single K block: the wrapper would raise; the
    # guarded site runs the fallback (here the float64 reference) instead.
    x = _inputs(device, H=1, HV=2, K=320, V=8)
    call = _wrapper_call(x)
    with pytest.raises(ValueError, match="K=320"):
        gated_delta_rule_spec_update(**call)
    state = x["state"].clone()
    ref_out, ref_state = gated_delta_rule_spec_update_naive(
        **{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in x.items()},
        null_slot_id=0,
    )

    def reference(**c: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out, new_state = gated_delta_rule_spec_update_naive(
            c["A_log"], c["a"], c["b"], c["dt_bias"], c["q"][0], c["k"][0], c["v"][0],
            state, c["cu_seqlens"], c["ssm_state_indices"], c["num_accepted_tokens"],
            None, null_slot_id=c["null_slot_id"],
        )  # fmt: skip
        return out[None], new_state

    with caplog.at_level(logging.WARNING, logger="gdn_backport_kernels"):
        out, new_state = guarded(call, reference)
        guarded(call, reference)
    torch.testing.assert_close(out[0].cpu().double(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_state.cpu().double(), ref_state, atol=1e-4, rtol=1e-4)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert "K=320 exceeds 256" in warned[0] and "upstream" in warned[0]


def test_supported_call_does_not_warn(
    device: str, caplog: pytest.LogCaptureFixture, fresh_warning: None
) -> None:
    x = _inputs(device)
    with caplog.at_level(logging.WARNING, logger="gdn_backport_kernels"):
        assert use_spec_update(**_wrapper_call(x))
    assert caplog.records == []


@pytest.mark.parametrize("forced_off", [False, True], ids=["op", "fallback"])
def test_guarded_call_traces_whole_under_torch_compile(
    device: str, monkeypatch: pytest.MonkeyPatch, forced_off: bool, fresh_warning: None
) -> None:
    # aot_eager: no C++ toolchain; fullgraph: the guard must not break the
    # graph (no plan cache, no logging, no data pointers under tracing).
    if forced_off:
        monkeypatch.setenv(KERNEL_ENV, "off")
    x = _inputs(device, gates="chunked")
    start = x["state"].clone()

    def step(a: torch.Tensor, b: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        call = {**_wrapper_call(x), "a": a, "b": b, "initial_state": state}
        out, _ = guarded(call)
        return out * 2.0

    eager = step(x["a"], x["b"], x["state"])
    eager_state = x["state"].clone()
    x["state"].copy_(start)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x["a"], x["b"], x["state"]), eager)
    torch.testing.assert_close(x["state"], eager_state)


# -- GPU only: the guard while a CUDA graph captures, and under inductor -----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("forced_off", [False, True], ids=["op", "fallback"])
def test_gpu_guarded_call_captures_and_compiles(
    monkeypatch: pytest.MonkeyPatch, forced_off: bool, fresh_warning: None
) -> None:
    if forced_off:
        monkeypatch.setenv(KERNEL_ENV, "off")
    x = make_inputs(Case("g", (4,) * 8, H=4, HV=8, K=128, V=128, gates="chunked"), "cuda")
    x["state"] = torch.nan_to_num(x["state"])
    state0 = x["state"].clone()
    eager, _ = guarded(_wrapper_call(x))
    eager_state = x["state"].clone()

    # CUDA graph: the guard runs on the host while capturing (a sync would
    # raise here), the chosen branch is recorded and replayed.
    x["state"].copy_(state0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = guarded(_wrapper_call(x))
    x["state"].copy_(state0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager)
    torch.testing.assert_close(x["state"], eager_state)

    # torch.compile with inductor, whole graph.
    def step(a: torch.Tensor, b: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        out, _ = guarded({**_wrapper_call(x), "a": a, "b": b, "initial_state": state})
        return out * 1.0

    x["state"].copy_(state0)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(compiled(x["a"], x["b"], x["state"]), eager)
    torch.testing.assert_close(x["state"], eager_state)
