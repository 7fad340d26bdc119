"""The spec-update kernel against the float64 reference.

Every case draws fresh inputs from a fixed seed, poisons with NaN whatever the
kernel must not read or write (non-speculative gate rows, unused and
to-be-written state slots, the output buffer, padding columns of packed
views), runs the kernel and the reference, and compares outputs and the whole
state pool. On CPU the kernel runs under TRITON_INTERPRET=1 (conftest), so
shapes stay small.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from gdn_backport_kernels import (
    gated_delta_rule_spec_update,
    gated_delta_rule_spec_update_naive,
    spec_update,
    spec_update_supported,
)
from gdn_backport_kernels.spec_update import gated_delta_rule_spec_update_fwd

NAN = float("nan")
# (atol, rtol) per storage dtype of the compared tensor.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    lens: tuple[int, ...]  # speculative tokens per request
    H: int = 1
    HV: int = 2
    K: int = 32
    V: int = 32
    # Where the spec rows sit among all rows of a/b: "mixed" (non-spec first,
    # the bug's layout), "spec-first", "interleaved", "shuffled" (unsorted
    # index), "prod" (five requests, a non-spec chunk, one more request),
    # "pure" (index None), "arange" (explicit identity index).
    layout: str = "mixed"
    n_nonspec: int = 3
    dtype: torch.dtype = torch.float32  # q, k, v, a, b
    state_dtype: torch.dtype = torch.float32
    gates: str = "contiguous"  # "chunked" (ba.chunk views), "transposed"
    # "packed": strided views into one row buffer; "k-major": q/k/v whose
    # last dim is not contiguous (the launcher copies them)
    qkv: str = "contiguous"
    accepted: bool = True  # False: num_accepted_tokens=None (column 0)
    null_slot_id: int = 0
    invalid: str = ""  # "initial": request 0 skipped; "tokens": some writes
    index_dtype: torch.dtype = torch.int64
    cols: int | None = None  # index columns per request, default max(lens)
    flat_index: bool = False  # 1-D ssm_state_indices
    # Launch overrides (LaunchConfig); None: the launcher's choice.
    block_v: int | None = None
    preload: bool | None = None  # False: each token's loads after the last stores
    token_tile: int | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()  # scale, softplus_*, l2norm
    seed: int = 0


CASES = [
    Case("pr-layout-1-nonspec-then-3-spec", lens=(3,), n_nonspec=1),
    Case("prod-layout-5x4-spec-4-nonspec-1x4-spec", (4,) * 6, HV=2, layout="prod"),
    Case("mixed-varied-lengths", lens=(2, 4, 3)),
    Case("interleaved", lens=(3, 1, 4), layout="interleaved", n_nonspec=5),
    Case("shuffled-index", lens=(2, 3), layout="shuffled", n_nonspec=4),
    Case("spec-first", lens=(2, 3), layout="spec-first"),
    Case("pure-spec-index-none", lens=(4, 4), layout="pure"),
    Case("pure-spec-arange-int32", (2, 2), layout="arange", index_dtype=torch.int32),
    Case("mha-h2-hv2", lens=(2, 3), H=2, HV=2),
    Case("gqa-h1-hv3", lens=(2, 3), H=1, HV=3),
    Case("gqa-h2-hv6-int32", lens=(3,), H=2, HV=6, index_dtype=torch.int32),
    Case("bf16-state", lens=(2, 3), state_dtype=torch.bfloat16),
    Case("bf16-all", (4, 2), dtype=torch.bfloat16, state_dtype=torch.bfloat16),
    Case("fp16-qkv-fp32-state", lens=(3, 2), dtype=torch.float16),
    Case("awkward-k48-v40-bv16", lens=(3, 2), K=48, V=40, block_v=16),
    Case("k64-v64-bv16", lens=(2,), HV=2, K=64, V=64, block_v=16),
    Case("k128-v128", lens=(2, 1), H=1, HV=1, K=128, V=128),
    Case("k256-v256", lens=(2,), H=1, HV=1, K=256, V=256, dtype=torch.bfloat16),
    Case("chunked-ba-gates", lens=(3, 2), gates="chunked", dtype=torch.bfloat16),
    Case("transposed-gates", lens=(2, 3), gates="transposed", layout="interleaved"),
    Case("packed-qkv-views", lens=(3, 2), qkv="packed", gates="chunked"),
    Case("k-major-qkv-copied", lens=(3, 2), H=2, HV=4, qkv="k-major"),
    Case("invalid-initial-slot", lens=(3, 2), invalid="initial"),
    Case("invalid-token-slots", lens=(3, 4), invalid="tokens"),
    Case("pad-slot-era-slot0-valid", (3, 2, 2), null_slot_id=-1, invalid="tokens"),
    Case("pad-slot-era-skip", lens=(2, 3), null_slot_id=-1, invalid="initial"),
    Case("no-num-accepted", lens=(3, 2), accepted=False),
    Case("empty-request", lens=(2, 0, 3)),
    Case("long-request-two-tiles", lens=(11,), HV=2, K=16, V=16),
    Case("fewer-cols-than-tokens", lens=(4,), cols=2, HV=2),
    Case("decode-1d-indices", lens=(1, 1, 1), accepted=False, flat_index=True),
    Case(
        "softplus-beta2-threshold5-scale",
        lens=(3, 3),
        kwargs=(("softplus_beta", 2.0), ("softplus_threshold", 5.0), ("scale", 0.3)),
    ),
    Case("no-l2norm", lens=(2, 3), kwargs=(("use_qk_l2norm_in_kernel", False),)),
    Case("per-token-loads", lens=(3, 2), qkv="packed", preload=False),
    Case("per-token-loads-bf16-long", (2, 11), K=48, V=40, dtype=torch.bfloat16, preload=False),
    Case("tile4-packed-chunked", (3, 2, 4), qkv="packed", gates="chunked", token_tile=4),
    Case("tile3-bf16-long", (2, 11), K=48, V=40, dtype=torch.bfloat16, token_tile=3),
    Case("tile4-skips", (3, 4, 2), null_slot_id=-1, invalid="tokens", token_tile=4),
    Case("tile4-skipped-request", lens=(3, 2), invalid="initial", token_tile=4),
    Case("tile4-fewer-cols", lens=(4,), cols=2, HV=2, token_tile=4),
    Case("tile1-decode-style", lens=(3, 2), token_tile=1, block_v=8),
    # The small-batch launch: whole-request tiles (0) on [2, V] tiles.
    Case("small-batch-launch", lens=(3, 2, 4), K=48, V=40, block_v=2, token_tile=0),
    Case("tile2-of-4-cols", lens=(4, 3), token_tile=2, layout="shuffled", n_nonspec=4),
    Case("many-cols-no-slot-tile", lens=(3, 2), cols=20, HV=2),
    *(Case(f"random-{s}", lens=(), layout="interleaved", seed=s) for s in range(3)),
]


def _spec_rows(case: Case, lens: tuple[int, ...], g: torch.Generator) -> list[int]:
    """Row of a/b for every speculative token, in token order."""
    T, ns = sum(lens), case.n_nonspec
    if case.layout in ("pure", "arange", "spec-first"):
        return list(range(T))
    if case.layout == "mixed":
        return list(range(ns, ns + T))
    if case.layout == "prod":
        # Five spec requests, then a non-spec chunk, then the last request.
        head = sum(lens[:5])
        return list(range(head)) + list(range(head + ns, T + ns))
    picked = torch.randperm(T + ns, generator=g)[:T]
    if case.layout == "interleaved":
        picked = picked.sort().values
    return picked.tolist()


def make_inputs(case: Case, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + case.seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    lens = case.lens
    if not lens:  # random composition
        n = int(torch.randint(1, 5, (1,), generator=g))
        lens = tuple(torch.randint(1, 6, (n,), generator=g).tolist())
    H, HV, K, V, dt = case.H, case.HV, case.K, case.V, case.dtype
    N, T = len(lens), sum(lens)
    rows = _spec_rows(case, lens, g)
    T_all = T if case.layout in ("pure", "arange") else T + case.n_nonspec
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    if case.gates == "chunked":
        b, a = randn(T_all, 2 * HV, dtype=dt).chunk(2, dim=-1)
    elif case.gates == "transposed":
        a, b = randn(HV, T_all, dtype=dt).t(), randn(HV, T_all, dtype=dt).t()
    else:
        a, b = randn(T_all, HV, dtype=dt), randn(T_all, HV, dtype=dt)
    # Gate rows that belong to no spec token are poison: reading one is a bug.
    unused = torch.ones(T_all, dtype=torch.bool)
    unused[rows] = False
    a[unused] = NAN
    b[unused] = NAN

    if case.qkv == "packed":
        width = 2 * H * K + HV * V
        buf = torch.full((T, width + 5), NAN).to(dt)
        buf[:, :width] = randn(T, width, dtype=dt)
        q = buf[:, : H * K].unflatten(1, (H, K))
        k = buf[:, H * K : 2 * H * K].unflatten(1, (H, K))
        v = buf[:, 2 * H * K : width].unflatten(1, (HV, V))
    elif case.qkv == "k-major":
        q = randn(T, K, H, dtype=dt).transpose(1, 2)
        k = randn(T, K, H, dtype=dt).transpose(1, 2)
        v = randn(T, V, HV, dtype=dt).transpose(1, 2)
    else:
        q, k = randn(T, H, K, dtype=dt), randn(T, H, K, dtype=dt)
        v = randn(T, HV, V, dtype=dt)

    # Slots: distinct per (request, column); with null_slot_id=-1 slot 0 is a
    # real slot and must be used; unused slots stay NaN.
    C = case.cols or max(max(lens), 1)
    first = 0 if case.null_slot_id < 0 else case.null_slot_id + 1
    num_slots = first + N * C + 2
    slots = (first + torch.randperm(N * C, generator=g)).view(N, C)
    acc = torch.tensor([int(torch.randint(1, C + 1, (1,), generator=g)) for _ in lens])
    if not case.accepted:
        acc = torch.ones(N, dtype=torch.int64)
    state = torch.full((num_slots, HV, V, K), NAN, dtype=case.state_dtype)
    for n in range(N):
        state[slots[n, acc[n] - 1]] = randn(HV, V, K).to(case.state_dtype)
    pad = case.null_slot_id
    if case.invalid == "initial":
        slots[0, acc[0] - 1] = pad
    elif case.invalid == "tokens":
        # One written column per request (never the initial one) is skipped,
        # by the null id itself or by any smaller (negative) id.
        for n in range(N):
            cols = [c for c in range(min(lens[n], C)) if c != acc[n] - 1]
            if cols:
                slots[n, cols[n % len(cols)]] = pad if n % 2 else pad - 7
    ssm_state_indices = slots.to(torch.int32)
    if case.flat_index:
        ssm_state_indices = ssm_state_indices[:, 0]

    index: torch.Tensor | None = torch.tensor(rows, dtype=case.index_dtype)
    if case.layout == "pure":
        index = None

    def dev(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device)

    return dict(
        A_log=(randn(HV) * 0.5).to(device),
        a=dev(a),
        b=dev(b),
        dt_bias=(randn(HV) * 0.5).to(device),
        q=dev(q),
        k=dev(k),
        v=dev(v),
        state=dev(state),
        cu_seqlens=dev(cu),
        ssm_state_indices=dev(ssm_state_indices),
        num_accepted_tokens=dev(acc.to(torch.int32)) if case.accepted else None,
        spec_token_indx=dev(index),
    )


def _run_and_compare(case: Case, device: str) -> None:
    inputs = make_inputs(case, device)
    kwargs = dict(case.kwargs)
    ref_out, ref_state = gated_delta_rule_spec_update_naive(
        **{k: (v.cpu() if v is not None else None) for k, v in inputs.items()},
        null_slot_id=case.null_slot_id,
        **kwargs,
    )
    q, v = inputs["q"], inputs["v"]
    out = torch.full((q.shape[0], v.shape[1], v.shape[2]), NAN, dtype=q.dtype)
    out = out.to(device)
    got = gated_delta_rule_spec_update_fwd(
        *inputs.values(),
        null_slot_id=case.null_slot_id,
        out=out,
        block_v=case.block_v,
        preload=case.preload,
        token_tile=case.token_tile,
        **kwargs,
    )
    assert got is out
    # Every row is written: outputs of skipped requests are exact zeros.
    assert not out.isnan().any(), "an output row was left unwritten"
    torch.testing.assert_close(
        out.cpu().double(), ref_out, atol=TOL[q.dtype][0], rtol=TOL[q.dtype][1]
    )
    state = inputs["state"]
    atol, rtol = TOL[state.dtype]
    # NaN where the reference keeps NaN: untouched slots stayed untouched.
    torch.testing.assert_close(
        state.cpu().double(), ref_state, atol=atol, rtol=rtol, equal_nan=True
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_matches_reference(case: Case, device: str) -> None:
    _run_and_compare(case, device)


def test_skipped_request_writes_nothing(device: str) -> None:
    case = Case("skip", lens=(3, 2), invalid="initial")
    inputs = make_inputs(case, device)
    state = inputs["state"]
    before = state.clone()
    out = gated_delta_rule_spec_update_fwd(*inputs.values(), null_slot_id=0)
    assert torch.equal(out[:3].cpu(), torch.zeros_like(out[:3].cpu()))
    # Only request 1's slots changed.
    changed = (state != before) & ~(state.isnan() & before.isnan())
    changed_slots = set(changed.flatten(1).any(1).nonzero().flatten().tolist())
    assert changed_slots <= set(inputs["ssm_state_indices"][1].tolist())


def test_wrapper_mirrors_vllm_call(device: str) -> None:
    case = Case("wrapper", lens=(3, 2), layout="interleaved", gates="chunked")
    x = make_inputs(case, device)
    ref_out, ref_state = gated_delta_rule_spec_update_naive(
        **{k: (v.cpu() if v is not None else None) for k, v in x.items()},
        null_slot_id=0,
    )
    call = dict(
        A_log=x["A_log"],
        a=x["a"],
        b=x["b"],
        dt_bias=x["dt_bias"],
        q=x["q"][None],
        k=x["k"][None],
        v=x["v"][None],
        initial_state=x["state"],
        inplace_final_state=True,
        cu_seqlens=x["cu_seqlens"],
        ssm_state_indices=x["ssm_state_indices"],
        num_accepted_tokens=x["num_accepted_tokens"],
        use_qk_l2norm_in_kernel=True,
        spec_token_indx=x["spec_token_indx"],
        null_slot_id=0,
    )
    assert spec_update_supported(**call) == (True, "")
    out, final_state = gated_delta_rule_spec_update(**call)
    assert final_state is x["state"]
    assert out.shape == (1, *x["v"].shape)
    torch.testing.assert_close(out[0].cpu().double(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        final_state.cpu().double(), ref_state, atol=1e-4, rtol=1e-4, equal_nan=True
    )


def _wrapper_call(x: dict[str, Any]) -> dict[str, Any]:
    return dict(
        A_log=x["A_log"],
        a=x["a"],
        b=x["b"],
        dt_bias=x["dt_bias"],
        q=x["q"][None],
        k=x["k"][None],
        v=x["v"][None],
        initial_state=x["state"],
        inplace_final_state=True,
        cu_seqlens=x["cu_seqlens"],
        ssm_state_indices=x["ssm_state_indices"],
        num_accepted_tokens=x["num_accepted_tokens"],
        use_qk_l2norm_in_kernel=True,
        spec_token_indx=x["spec_token_indx"],
        null_slot_id=0,
    )


def test_eager_wrapper_skips_the_dispatcher_with_identical_results(device: str) -> None:
    # The eager wrapper launches from its cached plan; the op launches the
    # same kernel: outputs and states must be bitwise equal, call after call.
    x = make_inputs(Case("direct", lens=(3, 2, 4), layout="interleaved", gates="chunked"), device)
    x["state"] = torch.nan_to_num(x["state"])
    start = x["state"].clone()
    spec_update._PLANS.clear()
    for _ in range(2):  # the second call hits the cached plan
        x["state"].copy_(start)
        out, _ = gated_delta_rule_spec_update(**_wrapper_call(x))
        direct_state = x["state"].clone()
        x["state"].copy_(start)
        ref = torch.ops.gdn_backport.gated_delta_rule_spec_update_v1(*_op_args(x))
        assert torch.equal(out[0], ref)
        assert torch.equal(direct_state, x["state"])
    plans = [p for k, p in spec_update._PLANS.items() if k[0][0] == "wrapper"]
    assert len(plans) == 1 and not isinstance(plans[0], str) and plans[0].direct


def test_wrapper_under_a_dispatch_mode_goes_through_the_op(device: str) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = make_inputs(Case("mode", lens=(2, 1)), device)
    x["state"] = torch.nan_to_num(x["state"])
    with Log():
        gated_delta_rule_spec_update(**_wrapper_call(x))
    assert "gdn_backport.gated_delta_rule_spec_update_v1.default" in seen


def test_supported_verdicts_are_cached(device: str) -> None:
    x = make_inputs(Case("cached", lens=(2, 3), HV=4, H=2), device)
    call = _wrapper_call(x)
    spec_update._PLANS.clear()
    assert spec_update_supported(**call) == (True, "")
    assert len(spec_update._PLANS) == 1
    assert spec_update_supported(**call) == (True, "")
    assert len(spec_update._PLANS) == 1
    bad = {**call, "v": call["v"][..., :2, :]}  # HV=2 heads against the gates' 4
    first = spec_update_supported(**bad)
    assert not first[0] and "a, b: expected" in first[1], first
    assert spec_update_supported(**bad) == first
    with pytest.raises(ValueError, match="a, b"):
        gated_delta_rule_spec_update(**bad)


def test_wrapper_fixed_length_batch(device: str) -> None:
    # No cu_seqlens: q is [B, T, H, K], B requests of T tokens each.
    x = make_inputs(Case("fixed", lens=(2, 2), layout="pure"), device)
    ref_out, _ = gated_delta_rule_spec_update_naive(
        **{k: (v.cpu() if v is not None else None) for k, v in x.items()},
        null_slot_id=0,
    )
    out, _ = gated_delta_rule_spec_update(
        x["A_log"],
        x["a"],
        x["b"],
        x["dt_bias"],
        x["q"].view(2, 2, *x["q"].shape[1:]),
        x["k"].view(2, 2, *x["k"].shape[1:]),
        x["v"].view(2, 2, *x["v"].shape[1:]),
        initial_state=x["state"],
        ssm_state_indices=x["ssm_state_indices"],
        num_accepted_tokens=x["num_accepted_tokens"],
        use_qk_l2norm_in_kernel=True,
        spec_token_indx=None,
        null_slot_id=0,
    )
    assert out.shape == (2, 2, *x["v"].shape[1:])
    torch.testing.assert_close(out.flatten(0, 1).cpu().double(), ref_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(q=lambda t: t.to(torch.int32)), "q: expected dtype"),
        (dict(k=lambda t: t[..., :-1]), "q, k: expected equal"),
        (dict(v=lambda t: t.repeat(1, 1, 3, 1)[:, :, :5]), "HV=5 must be a multiple"),
        (dict(initial_state=lambda t: t.transpose(-1, -2)), "initial_state"),
        (dict(a=lambda t: t[:, :1]), "a, b: expected"),
        (dict(inplace_final_state=lambda t: False), "inplace_final_state"),
        (dict(ssm_state_indices=lambda t: None), "ssm_state_indices"),
    ],
    ids=["int-q", "k-shape", "hv-multiple", "state-layout", "a-heads", "copy", "slots"],
)
def test_unsupported_inputs_say_why(change: dict[str, Any], reason: str, device: str) -> None:
    x = make_inputs(Case("bad", lens=(2,), H=2, HV=4, layout="pure"), device)
    call: dict[str, Any] = dict(
        A_log=x["A_log"],
        a=x["a"],
        b=x["b"],
        dt_bias=x["dt_bias"],
        q=x["q"][None],
        k=x["k"][None],
        v=x["v"][None],
        initial_state=x["state"],
        inplace_final_state=True,
        cu_seqlens=x["cu_seqlens"],
        ssm_state_indices=x["ssm_state_indices"],
        spec_token_indx=None,
        null_slot_id=0,
    )
    for name, fn in change.items():
        call[name] = fn(call[name])
    ok, why = spec_update_supported(**call)
    assert not ok
    assert reason in why
    with pytest.raises(ValueError, match=reason.split(":")[0]):
        gated_delta_rule_spec_update(**call)


def _op_args(x: dict[str, Any]) -> tuple[Any, ...]:
    # null_slot_id, scale, softplus_beta, softplus_threshold, l2norm
    return (*x.values(), 0, None, 1.0, 20.0, True)


def test_op_matches_reference(device: str) -> None:
    case = Case("op", lens=(3, 2), layout="interleaved", gates="chunked")
    x = make_inputs(case, device)
    ref_out, ref_state = gated_delta_rule_spec_update_naive(
        **{k: (v.cpu() if v is not None else None) for k, v in x.items()},
        null_slot_id=0,
    )
    out = torch.ops.gdn_backport.gated_delta_rule_spec_update_v1(*_op_args(x))
    torch.testing.assert_close(out.cpu().double(), ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        x["state"].cpu().double(), ref_state, atol=1e-4, rtol=1e-4, equal_nan=True
    )


def test_opcheck(device: str) -> None:
    # No NaN poison here: opcheck compares runs, and NaN != NaN.
    x = make_inputs(Case("opcheck", lens=(2, 1), HV=2, K=16, V=16), device)
    x["a"] = torch.nan_to_num(x["a"])
    x["b"] = torch.nan_to_num(x["b"])
    x["state"] = torch.nan_to_num(x["state"])
    torch.library.opcheck(
        torch.ops.gdn_backport.gated_delta_rule_spec_update_v1.default, _op_args(x)
    )


def test_wrapper_traces_whole_under_torch_compile(device: str) -> None:
    # aot_eager: fake impl + functionalized in-place state update, no C++
    # toolchain needed; fullgraph proves the wrapper itself does not break.
    x = make_inputs(Case("compile", lens=(2, 1), layout="interleaved"), device)
    x["state"] = torch.nan_to_num(x["state"])
    start = x["state"].clone()

    def step(a: torch.Tensor, b: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        out, _ = gated_delta_rule_spec_update(
            x["A_log"],
            a,
            b,
            x["dt_bias"],
            x["q"][None],
            x["k"][None],
            x["v"][None],
            initial_state=state,
            cu_seqlens=x["cu_seqlens"],
            ssm_state_indices=x["ssm_state_indices"],
            num_accepted_tokens=x["num_accepted_tokens"],
            use_qk_l2norm_in_kernel=True,
            spec_token_indx=x["spec_token_indx"],
            null_slot_id=0,
        )
        return out * 2.0

    eager = step(x["a"], x["b"], x["state"])
    eager_state = x["state"].clone()
    x["state"].copy_(start)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x["a"], x["b"], x["state"]), eager)
    torch.testing.assert_close(x["state"], eager_state)


# -- GPU only: production shapes, torch.compile, CUDA graphs -----------------


@pytest.mark.parametrize(
    "case",
    [
        Case("h200-hv32-n64", (4,) * 64, H=16, HV=32, K=128, V=128, n_nonspec=40),
        Case("h200-hv48-n8-bf16", (4,) * 8, 16, 48, 128, 128, dtype=torch.bfloat16),
        Case("h200-k256", (2,) * 4, H=4, HV=8, K=256, V=256, layout="interleaved"),
        Case("h200-tile4-hv32", (4,) * 8, 16, 32, 128, 128, dtype=torch.bfloat16, token_tile=4),
        Case("h200-n1-hv16-8-tokens", (8,), 16, 16, 128, 128, dtype=torch.bfloat16),
        Case("h200-tile1-bv8", (4,) * 64, 16, 32, 128, 128, token_tile=1, block_v=8),
        Case("h200-loads-in-loop", (4,) * 8, 16, 32, 128, 128, preload=False, block_v=2),
        Case("h200-bf16-state-tile8", (8, 5, 8), 16, 32, 128, 128, state_dtype=torch.bfloat16),
    ],
    ids=lambda c: c.id,
)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_production_shapes(case: Case) -> None:
    _run_and_compare(case, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_torch_compile_and_cuda_graph() -> None:
    case = Case("graph", (4,) * 8, H=4, HV=8, K=128, V=128, gates="chunked")
    x = make_inputs(case, "cuda")
    x["state"] = torch.nan_to_num(x["state"])
    op = torch.ops.gdn_backport.gated_delta_rule_spec_update_v1
    state0 = x["state"].clone()
    eager = op(*_op_args(x))
    eager_state = x["state"].clone()

    # torch.compile: the op is opaque, its in-place state update survives.
    x["state"].copy_(state0)
    compiled = torch.compile(lambda *args: op(*args) * 1.0, fullgraph=True)
    torch.testing.assert_close(compiled(*_op_args(x)), eager)
    torch.testing.assert_close(x["state"], eager_state)

    # CUDA graph: capture once, replay from the same initial state.
    x["state"].copy_(state0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(*_op_args(x))  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = op(*_op_args(x))
    x["state"].copy_(state0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out, eager)
    torch.testing.assert_close(x["state"], eager_state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_direct_launch_respects_pointer_alignment() -> None:
    # Two calls with the same metadata but q/k/v 16-byte aligned, then not:
    # the kernel compiled for the first must not serve the second.
    case = Case("align", (4,) * 4, H=4, HV=8, K=128, V=128, dtype=torch.bfloat16)
    x = make_inputs(case, "cuda")
    x["state"] = torch.nan_to_num(x["state"])
    start = x["state"].clone()
    ref_out, ref_state = gated_delta_rule_spec_update_naive(
        **{k: (v.cpu() if v is not None else None) for k, v in x.items()}, null_slot_id=0
    )
    shifted = dict(x)
    for name in ("q", "k", "v"):
        buf = torch.empty(x[name].numel() + 1, dtype=x[name].dtype, device="cuda")
        shifted[name] = buf[1:].view_as(x[name]).copy_(x[name])
        assert shifted[name].data_ptr() % 16 != 0
    for inputs in (x, shifted, x):
        x["state"].copy_(start)
        out, _ = gated_delta_rule_spec_update(**_wrapper_call(inputs))
        torch.testing.assert_close(out[0].cpu().double(), ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(x["state"].cpu().double(), ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_wrapper_captured_in_a_cuda_graph_matches_eager() -> None:
    # Eager: the direct launch; captured: through the op. Same results.
    case = Case("wrapper-graph", (4,) * 8, H=4, HV=8, K=128, V=128, gates="chunked")
    x = make_inputs(case, "cuda")
    x["state"] = torch.nan_to_num(x["state"])
    state0 = x["state"].clone()
    eager, _ = gated_delta_rule_spec_update(**_wrapper_call(x))
    eager_state = x["state"].clone()
    x["state"].copy_(state0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = gated_delta_rule_spec_update(**_wrapper_call(x))
    x["state"].copy_(state0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert torch.equal(x["state"], eager_state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_repeated_eager_calls_launch_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    # After the first call compiled and cached the kernel, eager calls must
    # not go through Triton's JIT launch path (its binding and specialising
    # is the host time this saves).
    x = make_inputs(Case("direct-gpu", (4,) * 4, H=4, HV=8, K=128, V=128), "cuda")
    x["state"] = torch.nan_to_num(x["state"])
    gated_delta_rule_spec_update(**_wrapper_call(x))
    kernel = spec_update.gated_delta_rule_spec_update_fwd_kernel
    calls: list[int] = []
    run = kernel.run

    def counting_run(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counting_run)
    for _ in range(3):
        gated_delta_rule_spec_update(**_wrapper_call(x))
    torch.cuda.synchronize()
    assert calls == []
