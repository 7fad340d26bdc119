"""Gated delta rule, speculative-verify update, with gate rows gathered in kernel.

One launch serves the speculative rows of a mixed batch: for each request
``n`` (tokens ``cu_seqlens[n]:cu_seqlens[n+1]`` of the gathered ``q``/``k``/
``v``) it loads the state slot of the last accepted token, then for every
token ``t``, in order,

    g    = -exp(A_log) * softplus(a[row] + dt_bias)   (beta/threshold form)
    beta = sigmoid(b[row])
    q, k = l2norm(q), l2norm(k)                       (eps 1e-6, optional)
    h    = h * exp(g)
    h    = h + outer(beta * (v - h k), k)
    o    = h (scale * q)

and writes ``o`` and the per-token state ``h`` into slot
``ssm_state_indices[n, t]``. ``row`` is ``spec_token_indx[cu_seqlens[n] + t]``:
``a`` and ``b`` are the *ungathered* gate tensors of the whole batch, which is
what makes this op correct by construction where vLLM 0.18.0-0.27.1 read the
first T_spec rows (vLLM PR #51812). With ``spec_token_indx=None`` the row is
the token's own position (the pure-speculative batch).

Supported:

- state pool ``[num_slots, HV, V, K]`` (FLA layout, ``h[v, k]``), any slot
  stride, inner dims contiguous; fp32, bf16 or fp16, updated in place;
  arithmetic is fp32 whatever the storage type.
- ``q``/``k`` ``[T, H, K]``, ``v`` ``[T, HV, V]`` in fp32/bf16/fp16, any token
  and head strides (last dim contiguous, else copied); GQA with ``HV % H == 0``.
- ``K <= 256`` (one K block, masked: 64, 128, 256 and odd sizes), any ``V``.
- ``a``/``b`` ``[T_all, HV]`` with any strides (``ba.chunk(2, dim=-1)`` views).
- slot indices ``<= null_slot_id`` are skipped like vLLM does: releases
  0.20.0 and later skip ``<= 0`` (``NULL_BLOCK_ID``, pass ``null_slot_id=0``),
  0.18.0-0.19.1 skip ``< 0`` (``PAD_SLOT_ID``, slot 0 is real: pass
  ``null_slot_id=-1``). A request whose initial slot is skipped gets zero
  outputs and writes no state (vLLM leaves its outputs unwritten); a skipped
  per-token slot only skips that state write. An initial column
  ``num_accepted_tokens[n] - 1`` outside the index row counts as skipped, and
  a token beyond the row's ``C`` columns writes no state.

Device-side preconditions (not checked: checking would sync the host):
``cu_seqlens`` non-decreasing within ``q``'s rows, every token index in
``[0, T_all)``, every valid slot in ``[0, num_slots)``, distinct slots per
written token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_INDEX_NAMES = frozenset(
    ("cu_seqlens", "ssm_state_indices", "num_accepted_tokens", "spec_token_indx")
)
# One K block keeps the whole key row in registers; 256 is the largest head
# size vLLM's GDN models use, and [BV, 256] fp32 tiles still fit.
MAX_HEAD_K = 256
# Tokens per unrolled tile: every token of a tile is loaded before the tile's
# recurrence runs; longer requests loop over several tiles.
MAX_NT = 8


@triton.jit
def _append(items, x):  # type: ignore[no-untyped-def]
    """``items`` with ``x`` appended (Triton's frontend has no starred tuples)."""
    return items + (x,)  # noqa: RUF005


@triton.jit  # type: ignore[untyped-decorator]
def _load_token(  # type: ignore[no-untyped-def]
    t, T, bos, i_h, i_hv, o_k, o_v, m_k, m_v, b_A, b_dt_bias,
    a, b, q, k, v, spec_token_indx, p_slots, scale, softplus_beta, softplus_threshold,
    null_slot_id, num_idx_cols,
    stride_a_t, stride_a_h, stride_b_t, stride_b_h, stride_q_t, stride_q_h,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_idx_t,
    USE_QK_L2NORM: tl.constexpr, HAS_TOKEN_INDEX: tl.constexpr,
):  # fmt: skip
    """Everything token ``t`` of a request needs: (live, q, k, v, decay, beta, slot).

    Masked past the request's ``T`` tokens (zeros, the null slot): such a token
    computes garbage that is never stored.
    """
    m_t = t < T
    i_t = bos + t
    if HAS_TOKEN_INDEX:
        i_row = tl.load(spec_token_indx + i_t, mask=m_t, other=0).to(tl.int64)
    else:
        i_row = i_t
    b_a = tl.load(a + i_row * stride_a_t + i_hv * stride_a_h, mask=m_t, other=0)
    b_b = tl.load(b + i_row * stride_b_t + i_hv * stride_b_h, mask=m_t, other=0)
    b_slot = tl.load(
        p_slots + t * stride_idx_t, mask=m_t & (t < num_idx_cols), other=null_slot_id
    ).to(tl.int64)
    b_q = tl.load(q + i_t * stride_q_t + i_h * stride_q_h + o_k, mask=m_k & m_t, other=0)
    b_k = tl.load(k + i_t * stride_k_t + i_h * stride_k_h + o_k, mask=m_k & m_t, other=0)
    b_v = tl.load(v + i_t * stride_v_t + i_hv * stride_v_h + o_v, mask=m_v & m_t, other=0)
    b_q = b_q.to(tl.float32)
    b_k = b_k.to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * scale
    b_x = b_a.to(tl.float32) + b_dt_bias
    b_bx = softplus_beta * b_x
    b_softplus = tl.where(
        b_bx <= softplus_threshold, tl.log(1.0 + tl.exp(b_bx)) / softplus_beta, b_x
    )
    b_decay = tl.exp(b_A * b_softplus)
    b_beta = tl.sigmoid(b_b.to(tl.float32))
    # A tl.tuple, not a bare tuple: the interpreter nests it into tuples too.
    return tl.tuple([m_t, b_q, b_k, b_v.to(tl.float32), b_decay, b_beta, b_slot])


@triton.jit  # type: ignore[untyped-decorator]
def _store_token(  # type: ignore[no-untyped-def]
    b_h, b_o, m_t, b_slot, b_live, t, bos, i_hv, o_k, o_v, m_v, m_h, o, h, null_slot_id,
    stride_o_t, stride_o_h, stride_h_n, V: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    """Store token ``t``'s output row and, into its own slot, its state."""
    b_o = tl.where(b_live, b_o, 0.0)
    p_o = o + (bos + t) * stride_o_t + i_hv * stride_o_h + o_v
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v & m_t)
    # Every token's state goes to its own slot (int64 offsets: pools exceed
    # 2**31 elements), so a later step can resume from any accepted token.
    # Scalar branches, not `tile & scalar` masks: uniform per program on the
    # GPU, and the Triton interpreter mis-types such mixed masks.
    if b_live & m_t & (b_slot > null_slot_id):
        p_ht = h + b_slot * stride_h_n + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h)


@triton.jit(do_not_specialize=["null_slot_id", "num_idx_cols"])  # type: ignore[untyped-decorator]
def gated_delta_rule_spec_update_fwd_kernel(  # type: ignore[no-untyped-def]
    A_log,
    a,
    b,
    dt_bias,
    q,
    k,
    v,
    o,
    h,
    cu_seqlens,
    ssm_state_indices,
    num_accepted_tokens,
    spec_token_indx,
    scale,
    softplus_beta,
    softplus_threshold,
    null_slot_id,
    num_idx_cols,
    H,
    HV,
    stride_a_t,
    stride_a_h,
    stride_b_t,
    stride_b_h,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_h_n,
    stride_idx_n,
    stride_idx_t,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NT: tl.constexpr,
    C_TILE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    HAS_TOKEN_INDEX: tl.constexpr,
    IS_SPEC_DECODING: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_v[:, None] & m_k[None, :]
    p_slots = ssm_state_indices + i_n.to(tl.int64) * stride_idx_n

    # The initial slot. With every index column in one C_TILE-wide load, the
    # column is picked in registers: the state load then waits for one memory
    # round trip (num_accepted_tokens and the index row in parallel), not two.
    if IS_SPEC_DECODING:
        i_c0 = tl.load(num_accepted_tokens + i_n).to(tl.int64) - 1
    else:
        i_c0 = tl.full([], 0, dtype=tl.int64)
    m_c0 = (i_c0 >= 0) & (i_c0 < num_idx_cols)
    if C_TILE > 0:
        o_c = tl.arange(0, C_TILE)
        b_row = tl.load(p_slots + o_c * stride_idx_t, mask=o_c < num_idx_cols, other=0)
        b_slot0 = tl.sum(tl.where(o_c == i_c0, b_row.to(tl.int64), 0))
        b_slot0 = tl.where(m_c0, b_slot0, null_slot_id)
    else:
        b_slot0 = tl.load(p_slots + i_c0 * stride_idx_t, mask=m_c0, other=null_slot_id)
        b_slot0 = b_slot0.to(tl.int64)
    # A skipped request still runs its token loop, but reads and writes no
    # state and stores zero outputs (deterministic, unlike vLLM's garbage).
    b_live = b_slot0 > null_slot_id
    # This program's [BV, BK] tile of one slot of h[slot, hv, v, k].
    b_h = tl.zeros([BV, BK], dtype=tl.float32)
    if b_live:
        p_h0 = h + b_slot0 * stride_h_n + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
        b_h = tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)

    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    b_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)

    # `while`, not `for ... in range(0, T, NT)`: Triton 3.6's interpreter turns
    # a tensor range bound into a Python int with int(ndarray), which NumPy
    # 2.4+ rejects for the 1-element arrays it holds scalars in.
    i_s = tl.zeros([], dtype=tl.int64)
    while i_s < T:
        # PRELOAD: every load of the tile's NT tokens is issued before the
        # recurrence, so the serial chain below waits on no memory (a load
        # placed after a store cannot be hoisted above it: they may alias).
        toks = tl.tuple([])
        if PRELOAD:
            for j in tl.static_range(NT):
                toks = _append(
                    toks,
                    _load_token(
                        i_s + j, T, bos, i_h, i_hv, o_k, o_v, m_k, m_v, b_A, b_dt_bias,
                        a, b, q, k, v, spec_token_indx, p_slots,
                        scale, softplus_beta, softplus_threshold, null_slot_id, num_idx_cols,
                        stride_a_t, stride_a_h, stride_b_t, stride_b_h, stride_q_t, stride_q_h,
                        stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_idx_t,
                        USE_QK_L2NORM, HAS_TOKEN_INDEX,
                    ),
                )  # fmt: skip
        for j in tl.static_range(NT):
            if PRELOAD:
                m_t, b_q, b_k, b_v, b_decay, b_beta, b_slot = toks[j]
            else:
                m_t, b_q, b_k, b_v, b_decay, b_beta, b_slot = _load_token(
                    i_s + j, T, bos, i_h, i_hv, o_k, o_v, m_k, m_v, b_A, b_dt_bias,
                    a, b, q, k, v, spec_token_indx, p_slots,
                    scale, softplus_beta, softplus_threshold, null_slot_id, num_idx_cols,
                    stride_a_t, stride_a_h, stride_b_t, stride_b_h, stride_q_t, stride_q_h,
                    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_idx_t,
                    USE_QK_L2NORM, HAS_TOKEN_INDEX,
                )  # fmt: skip
            # o from the state before the update (h q and h k reduce side
            # by side; the updated state is not waited for):
            #   o = (d h + delta k) q = d (h q) + delta (k q)
            b_hk = tl.sum(b_h * b_k[None, :], 1)
            b_hq = tl.sum(b_h * b_q[None, :], 1)
            b_kq = tl.sum(b_k * b_q)
            b_delta = (b_v - b_decay * b_hk) * b_beta
            b_h = b_h * b_decay + b_delta[:, None] * b_k[None, :]
            b_o = b_decay * b_hq + b_delta * b_kq
            _store_token(
                b_h, b_o, m_t, b_slot, b_live, i_s + j, bos, i_hv, o_k, o_v, m_v, m_h,
                o, h, null_slot_id, stride_o_t, stride_o_h, stride_h_n, V, K,
            )  # fmt: skip
        i_s += NT


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass
class LaunchConfig:
    """How one call is launched; every field may be overridden (sweeps, tests).

    ``block_v``: value rows per program ([BV, K] state tile); ``num_warps``;
    ``token_tile``: tokens per unrolled tile (NT; 0: the index row's C
    columns, at most ``MAX_NT``); ``preload``: load every
    token of a tile before its recurrence (else inside it, after the previous
    token's stores).
    """

    block_v: int
    num_warps: int
    token_tile: int
    preload: bool


def _pick_config(
    N: int, HV: int, C: int, V: int, BK: int, device: torch.device, **override: Any
) -> LaunchConfig:
    """The launch for ``N`` requests x ``HV`` heads (``C`` index columns).

    Measured on an H200 (bench/sweep_spec_update.py, bench_spec_update.py,
    K=V=128, CUDA graphs; NOTES.md, "Issue 14"): one-warp programs on
    [8, 128] state tiles reach 84-93 % of the copy-bandwidth roofline at
    N >= 64, HV >= 32, where vLLM's [32, 128] four-warp tiles reach 70-80 %
    (session 2: more, smaller programs hide the serial token chain). Up to
    512 (request, head) pairs [4, 128] tiles are faster still. One token per
    tile: unrolled tiles of 2-8 tokens with every load issued first need
    120-255 registers against 62 (BV=4), and from N=8 on the lost occupancy
    costs more than the hidden load latency gains (0.49-0.88x); only the
    smallest batches gain (below).
    """
    if device.type != "cuda":
        # The interpreter runs programs one by one: on CPU, fewest programs win.
        bv = max(16, min(int(triton.next_power_of_2(V)), 4096 // BK))
        cfg = LaunchConfig(block_v=bv, num_warps=0, token_tile=1, preload=True)
    elif N * HV <= 16:
        # A handful of (request, head) pairs: every program fits in one wave
        # even at a whole request's registers, so the load latency, not the
        # occupancy, is the cost. Whole-request tiles with every load issued
        # first, on [2, K] tiles (more programs in flight). H200, graph
        # replays, N=1, HV=16, 2/4/8 tokens: 8.4/9.3/11.3 us against
        # 9.3/11.4/16.2 for the session-3 launch (bf16 state, 4 tokens: 9.6
        # against 11.4). At HV=32 the gain is not steady (fp32 state, 4
        # tokens: 10.6 against 12.5; bf16: 13.6 against 11.8), at HV=48/64
        # it turns into a loss. bench/results/h200_bench_spec_update_s4_n1.txt,
        # h200_sweep_s4b.txt, h200_bench_spec_update_s4_bf16.txt.
        cfg = LaunchConfig(block_v=2, num_warps=0, token_tile=0, preload=True)
    else:
        per_thread = 16 if N * HV <= 512 else 32
        bv = max(4, min(int(triton.next_power_of_2(V)), per_thread * 32 // BK))
        cfg = LaunchConfig(block_v=bv, num_warps=0, token_tile=1, preload=True)
    for name, value in override.items():
        if value is not None:
            setattr(cfg, name, value)
    if cfg.token_tile <= 0:
        # Whole requests (up to MAX_NT tokens) per tile.
        cfg.token_tile = max(1, min(C, MAX_NT))
    if not cfg.num_warps:
        # About 16-32 fp32 state elements per thread (see above).
        cfg.num_warps = max(1, min(8, cfg.block_v * BK // 1024))
    return cfg


def _unsupported_reason(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    spec_token_indx: torch.Tensor | None,
) -> str | None:
    """Why the kernel cannot serve these (flattened, op-level) arguments."""
    tensors: dict[str, torch.Tensor | None] = {
        "A_log": A_log,
        "a": a,
        "b": b,
        "dt_bias": dt_bias,
        "q": q,
        "k": k,
        "v": v,
        "initial_state": state,
        "cu_seqlens": cu_seqlens,
        "ssm_state_indices": ssm_state_indices,
        "num_accepted_tokens": num_accepted_tokens,
        "spec_token_indx": spec_token_indx,
    }
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != q.device:
            return f"{name}: expected device {q.device}, got {t.device}"
        want = _INDEX_DTYPES if name in _INDEX_NAMES else _FLOAT_DTYPES
        if t.dtype not in want:
            return f"{name}: expected dtype in {want}, got {t.dtype}"
    if q.device.type == "cpu" and not _interpreting():
        return "CPU tensors need TRITON_INTERPRET=1 (set before import)"
    if q.device.type not in ("cpu", "cuda"):
        return f"q: expected a CUDA (or interpreted CPU) device, got {q.device}"
    if q.dim() != 3 or k.shape != q.shape:
        return f"q, k: expected equal [T, H, K], got {tuple(q.shape)}, {tuple(k.shape)}"
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        return f"v: expected [T={T}, HV, V], got {tuple(v.shape)}"
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        return f"v: HV={HV} must be a multiple of H={H}"
    if K > MAX_HEAD_K:
        return f"q: head size K={K} exceeds {MAX_HEAD_K}"
    if a.dim() != 2 or a.shape[1] != HV or b.shape != a.shape:
        got = f"{tuple(a.shape)}, {tuple(b.shape)}"
        return f"a, b: expected equal [T_all, HV={HV}], got {got}"
    if A_log.numel() != HV or dt_bias.numel() != HV:
        return f"A_log, dt_bias: expected {HV} elements each"
    if state.dim() != 4 or tuple(state.shape[1:]) != (HV, V, K):
        got = str(tuple(state.shape))
        return f"initial_state: expected [num_slots, {HV}, {V}, {K}], got {got}"
    if state.stride()[1:] != (V * K, K, 1):
        got = str(state.stride())
        return f"initial_state: inner dims [HV, V, K] must be contiguous, got {got}"
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        return f"cu_seqlens: expected [N + 1], got {tuple(cu_seqlens.shape)}"
    N = cu_seqlens.numel() - 1
    if ssm_state_indices.dim() not in (1, 2) or ssm_state_indices.shape[0] < N:
        got = str(tuple(ssm_state_indices.shape))
        return f"ssm_state_indices: expected [>= N={N}] or [>= N, C], got {got}"
    if num_accepted_tokens is not None and (
        num_accepted_tokens.dim() != 1 or num_accepted_tokens.numel() < N
    ):
        got = str(tuple(num_accepted_tokens.shape))
        return f"num_accepted_tokens: expected [>= N={N}], got {got}"
    if spec_token_indx is not None and (spec_token_indx.dim() != 1 or spec_token_indx.numel() < T):
        return f"spec_token_indx: expected [>= T={T}], got {tuple(spec_token_indx.shape)}"
    return None


def _launched_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of ``x`` as launched: a last dim that is not contiguous is
    copied first (``.contiguous()``, row-major)."""
    if x.stride(-1) == 1:
        return tuple(x.stride())
    strides, step = [], 1
    for size in reversed(x.shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class _Plan:
    """Everything about one launch that the arguments' metadata decides.

    Cached per metadata key (dtypes, shapes, strides, devices, pointer
    alignment, scalars), so a repeated call skips the checks and the launch
    decisions; on CUDA it also holds Triton's compiled kernel after the first
    launch, which later launches call directly (no argument binding and
    specialisation, no per-pointer driver query).
    """

    __slots__ = ("compiled", "constexprs", "device", "direct", "grid", "num_warps",
                 "out_shape", "scalars", "tail")  # fmt: skip

    def __init__(
        self,
        grid: tuple[int, int, int],
        scalars: tuple[Any, ...],
        constexprs: dict[str, Any],
        num_warps: int,
        out_shape: tuple[int, ...],
        device: int,
        direct: bool,
    ) -> None:
        self.grid = grid
        self.scalars = scalars
        self.constexprs = constexprs
        self.num_warps = num_warps
        self.out_shape = out_shape
        self.device = device
        # Arguments after the pointers, in the kernel's order (constexpr
        # slots included: Triton's launcher takes and skips them).
        self.tail = (*scalars, *constexprs.values())
        # Launchable on the caller's tensors as they are (no copies: q/k/v
        # last dims and the 1-D tensors contiguous; cu_seqlens given).
        self.direct = direct
        self.compiled: Any = None


# Plans by metadata key; bounded (a server sees one key per batch shape).
_PLANS: dict[tuple[Any, ...], _Plan | str] = {}
_MAX_PLANS = 4096


def _key(
    tensors: tuple[torch.Tensor | None, ...], *scalars: Any
) -> tuple[tuple[Any, ...], list[int | None]]:
    """Metadata key of a call (everything the checks and launch decisions read,
    and each pointer's 16-byte alignment, which Triton specialises on) and the
    tensors' data pointers."""
    ptrs = [None if t is None else t.data_ptr() for t in tensors]
    metas = [None if t is None else (t.dtype, t.shape, t.stride(), t.get_device()) for t in tensors]
    aligned = [None if p is None else p & 15 for p in ptrs]
    return (scalars, tuple(metas), tuple(aligned)), ptrs


def _make_plan(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    spec_token_indx: torch.Tensor | None,
    null_slot_id: int,
    scale: float | None,
    softplus_beta: float,
    softplus_threshold: float,
    use_qk_l2norm_in_kernel: bool,
    *,
    out_shape: tuple[int, ...] | None = None,
    override: dict[str, Any] | None = None,
) -> _Plan | str:
    """The plan for op-level (flattened) arguments, or why there is none."""
    reason = _unsupported_reason(
        A_log,
        a,
        b,
        dt_bias,
        q,
        k,
        v,
        state,
        cu_seqlens,
        ssm_state_indices,
        num_accepted_tokens,
        spec_token_indx,
    )
    if reason is not None:
        return reason
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu_seqlens.numel() - 1
    if ssm_state_indices.dim() == 1:
        idx_strides: tuple[int, ...] = (ssm_state_indices.stride(0), 1)
        C = 1
    else:
        idx_strides = ssm_state_indices.stride()
        C = ssm_state_indices.shape[1]
    BK = triton.next_power_of_2(K)
    cfg = _pick_config(N, HV, C, V, BK, q.device, **(override or {}))
    NT = cfg.token_tile
    # The output is allocated [.., T, HV, V] contiguous: strides follow.
    o_strides = (HV * V, V)
    q_strides, k_strides, v_strides = (_launched_strides(x) for x in (q, k, v))
    scalars = (
        float(K**-0.5 if scale is None else scale),
        float(softplus_beta),
        float(softplus_threshold),
        int(null_slot_id),
        C,
        H,
        HV,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        *q_strides[:2],
        *k_strides[:2],
        *v_strides[:2],
        *o_strides,
        state.stride(0),
        *idx_strides,
    )
    constexprs = dict(
        K=K,
        V=V,
        BK=BK,
        BV=cfg.block_v,
        NT=NT,
        C_TILE=int(triton.next_power_of_2(C)) if C <= 16 else 0,
        USE_QK_L2NORM=bool(use_qk_l2norm_in_kernel),
        HAS_TOKEN_INDEX=spec_token_indx is not None,
        IS_SPEC_DECODING=num_accepted_tokens is not None,
        PRELOAD=cfg.preload,
    )
    one_d = [cu_seqlens, A_log, dt_bias, num_accepted_tokens, spec_token_indx]
    direct = all(x.stride(-1) == 1 for x in (q, k, v)) and all(
        x is None or x.is_contiguous() for x in one_d
    )
    return _Plan(
        grid=(triton.cdiv(V, cfg.block_v), N * HV, 1),
        scalars=scalars,
        constexprs=constexprs,
        num_warps=cfg.num_warps,
        out_shape=out_shape if out_shape is not None else (T, HV, V),
        device=q.get_device(),
        direct=direct,
    )


def _hooked(hook: Any) -> bool:
    # Triton 3.6 keeps launch hooks in HookChain objects (never None).
    return hook is not None and bool(getattr(hook, "calls", True))


def _no_launch_hooks() -> bool:
    """No launch hook (a profiler's) is installed: the direct launch, which
    passes none, loses nothing."""
    rt = knobs.runtime
    return not _hooked(rt.launch_enter_hook) and not _hooked(rt.launch_exit_hook)


def _launch(
    plan: _Plan,
    tensors: tuple[torch.Tensor | None, ...],
    ptrs: list[int | None],
) -> None:
    """Launch ``plan``. ``tensors``: the kernel's 13 pointer arguments in its
    order, ``ptrs`` their data pointers."""
    compiled = plan.compiled
    out_ptr = ptrs[7]
    aligned_out = out_ptr is not None and out_ptr & 15 == 0
    if (
        compiled is not None
        and aligned_out
        and _no_launch_hooks()
        and torch._C._cuda_getDevice() == plan.device
    ):
        # Triton's own launch minus its per-call work (binding, specialising,
        # a driver query per pointer): the specialisation this kernel was
        # compiled for is part of the plan's key.
        compiled.run(
            *plan.grid,
            torch._C._cuda_getCurrentRawStream(plan.device),
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *ptrs,
            *plan.tail,
        )
        return
    prepared = list(tensors)
    for i in (4, 5, 6):  # q, k, v: last dim contiguous
        t = prepared[i]
        if t is not None and t.stride(-1) != 1:
            prepared[i] = t.contiguous()
    for i in (0, 3, 9, 11, 12):  # A_log, dt_bias and the 1-D metadata
        t = prepared[i]
        if t is not None:
            prepared[i] = t.contiguous()
    kernel: Any = gated_delta_rule_spec_update_fwd_kernel
    grid, nw = plan.grid, plan.num_warps
    result = kernel[grid](*prepared, *plan.scalars, **plan.constexprs, num_warps=nw)
    same = all(p is t for p, t in zip(prepared, tensors, strict=True))
    if plan.direct and plan.device >= 0 and result is not None and same and aligned_out:
        result._init_handles()
        plan.compiled = result


def _plan_for(
    key: tuple[Any, ...],
    flat: tuple[Any, ...],
    out_shape: tuple[int, ...] | None,
    override: dict[str, Any] | None = None,
) -> _Plan | str:
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(*flat, out_shape=out_shape, override=override)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def gated_delta_rule_spec_update_fwd(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    spec_token_indx: torch.Tensor | None,
    *,
    null_slot_id: int,
    scale: float | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    use_qk_l2norm_in_kernel: bool = True,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    token_tile: int | None = None,
    preload: bool | None = None,
) -> torch.Tensor:
    """Launch the kernel on op-level (flattened) arguments; returns ``out``.

    Shapes: ``q``/``k`` ``[T, H, K]``, ``v`` ``[T, HV, V]``, ``a``/``b``
    ``[T_all, HV]``, ``state`` ``[num_slots, HV, V, K]`` (updated in place),
    ``cu_seqlens`` ``[N + 1]``, ``ssm_state_indices`` ``[N, C]`` or ``[N]``,
    ``num_accepted_tokens`` ``[N]``, ``spec_token_indx`` ``[T]``. ``out``
    (``[T, HV, V]``, contiguous) and the launch overrides (see
    :class:`LaunchConfig`) are for tests and benchmarks. Host-side checks
    only: safe under CUDA-graph capture.
    """
    override = dict(block_v=block_v, num_warps=num_warps, token_tile=token_tile, preload=preload)
    scalars = (null_slot_id, scale, softplus_beta, softplus_threshold, use_qk_l2norm_in_kernel)
    tensors = (A_log, a, b, dt_bias, q, k, v, state, cu_seqlens, ssm_state_indices,
               num_accepted_tokens, spec_token_indx)  # fmt: skip
    key, ptrs = _key(tensors, "op", *scalars, *override.values())
    plan = _plan_for(key, (*tensors, *scalars), None, override)
    if isinstance(plan, str):
        raise ValueError(plan)
    if out is None:
        out = q.new_empty(plan.out_shape)
    elif out.shape != plan.out_shape or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"out: expected contiguous {list(plan.out_shape)} on {q.device}")
    if plan.grid[1] == 0 or q.shape[0] == 0:
        return out
    ptr_tensors = (A_log, a, b, dt_bias, q, k, v, out, state, cu_seqlens,
                   ssm_state_indices, num_accepted_tokens, spec_token_indx)  # fmt: skip
    ptrs.insert(7, out.data_ptr())
    _launch(plan, ptr_tensors, ptrs)
    return out


def _call_problem(
    q: torch.Tensor,
    v: torch.Tensor,
    initial_state: torch.Tensor | None,
    inplace_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
) -> str | None:
    """Why vLLM's call convention cannot be mapped onto the op, if it cannot."""
    if initial_state is None:
        return "initial_state: expected the state pool, got None"
    if not inplace_final_state:
        return "inplace_final_state: only True is supported"
    if ssm_state_indices is None:
        return "ssm_state_indices: expected a tensor, got None"
    if q.dim() != 4 or v.dim() != 4:
        return (
            f"q, v: expected [B, T, H, K] and [B, T, HV, V], got {tuple(q.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens is not None and q.shape[0] != 1:
        return f"q: batch size must be 1 with cu_seqlens, got {q.shape[0]}"
    return None


def _flatten_call(
    a: torch.Tensor,
    b: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: torch.Tensor | None,
    inplace_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Map vLLM's ``[B, T, ...]`` call convention onto the op's flat one."""
    problem = _call_problem(q, v, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices)
    if problem is not None:
        raise ValueError(problem)
    assert initial_state is not None and ssm_state_indices is not None
    B, T = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    # Gates may come as [B, T, HV]; rows are what the kernel indexes.
    return (
        a.flatten(0, -2) if a.dim() > 2 else a,
        b.flatten(0, -2) if b.dim() > 2 else b,
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        initial_state,
        cu_seqlens,
        ssm_state_indices,
    )


def _wrapper_plan(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float,
    threshold: float,
    scale: float | None,
    initial_state: torch.Tensor | None,
    inplace_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    spec_token_indx: torch.Tensor | None,
    null_slot_id: int,
) -> tuple[_Plan | str, list[int | None]]:
    """The cached plan of a wrapper-level call (or why it cannot be served),
    and the tensors' data pointers."""
    tensors = (A_log, a, b, dt_bias, q, k, v, initial_state, cu_seqlens, ssm_state_indices,
               num_accepted_tokens, spec_token_indx)  # fmt: skip
    key, ptrs = _key(tensors, "wrapper", null_slot_id, scale, beta, threshold,
                     use_qk_l2norm_in_kernel, inplace_final_state)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is not None:
        return plan, ptrs
    try:
        fa, fb, fq, fk, fv, state, cu, idx = _flatten_call(
            a, b, q, k, v, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices
        )
    except ValueError as e:
        return str(e), ptrs
    flat = (A_log, fa, fb, dt_bias, fq, fk, fv, state, cu, idx, num_accepted_tokens,
            spec_token_indx, null_slot_id, scale, beta, threshold,
            use_qk_l2norm_in_kernel)  # fmt: skip
    made = _plan_for(key, flat, (q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
    if isinstance(made, _Plan) and cu_seqlens is None:
        # The fixed-length form builds cu_seqlens per call: not direct.
        made.direct = False
    return made, ptrs


def spec_update_supported(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    inplace_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    spec_token_indx: torch.Tensor | None,
    null_slot_id: int,
) -> tuple[bool, str]:
    """``(ok, reason)`` for a call to :func:`gated_delta_rule_spec_update`.

    Takes exactly the wrapper's arguments, so a call site can ask first and
    fall back to the gathered-gate upstream path when ``ok`` is False.
    Host-side metadata only, never syncs; the verdict is cached with the
    call's launch plan, so asking again for a known shape is a dict lookup.
    """
    plan, _ = _wrapper_plan(
        A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state,
        inplace_final_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
        use_qk_l2norm_in_kernel, spec_token_indx, null_slot_id,
    )  # fmt: skip
    return (False, plan) if isinstance(plan, str) else (True, "")


def _may_skip_dispatcher(q: torch.Tensor, state: torch.Tensor | None) -> bool:
    """Whether this call may launch directly instead of through the op.

    Only eager calls on plain tensors: torch.compile tracing, CUDA-graph
    capture, tensor subclasses (fake, functional) and active torch function
    or dispatch modes all see the registered op.
    """
    return (
        not torch.compiler.is_compiling()
        and type(q) is torch.Tensor
        and type(state) is torch.Tensor
        and not torch._C._is_torch_function_mode_enabled()
        and torch._C._len_torch_dispatch_stack() == 0
        and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
    )


def gated_delta_rule_spec_update(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    inplace_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    spec_token_indx: torch.Tensor | None,
    null_slot_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for vLLM's ``fused_sigmoid_gating_delta_rule_update`` spec call.

    The positional order and keywords are vLLM's (``is_kda`` aside), plus two
    required keyword-only arguments, so a call site is rewritten by renaming
    the function and adding them:

    - ``spec_token_indx``: ``[T_spec]`` int32/int64, the row of ``a``/``b``
      holding each speculative token (vLLM's ``spec_token_indx``), or None when
      ``a``/``b`` rows already line up with ``q`` (pure-speculative batch).
    - ``null_slot_id``: slot indices ``<=`` it are skipped; match the tree's
      kernel: ``0`` where it skips ``state_idx <= 0`` (vLLM 0.20.0 on),
      ``-1`` where it skips ``state_idx < 0`` (0.18.0-0.19.1).

    Shapes: ``A_log``, ``dt_bias`` ``[HV]``; ``a``, ``b`` ``[T_all, HV]``
    *ungathered* (any strides); ``q``, ``k`` ``[1, T_spec, H, K]``; ``v``
    ``[1, T_spec, HV, V]``; ``initial_state`` ``[num_slots, HV, V, K]``,
    updated in place; ``cu_seqlens`` ``[N + 1]``; ``ssm_state_indices``
    ``[N, C]``; ``num_accepted_tokens`` ``[N]`` or None (column 0). Without
    ``cu_seqlens``, ``q`` is ``[B, T, H, K]``: B requests of T tokens.
    ``beta``/``threshold`` are the softplus parameters, ``scale`` defaults to
    ``K ** -0.5``. Only ``inplace_final_state=True`` is supported.

    Returns ``(out, initial_state)`` with ``out`` ``[B, T, HV, V]`` in
    ``q.dtype``, like vLLM's function. Raises ``ValueError`` naming the
    argument for inputs :func:`spec_update_supported` rejects.

    An eager call on plain tensors launches the kernel directly from a plan
    cached per argument metadata (the same launch the op makes); traced,
    compiled and graph-captured calls go through the registered op.
    """
    if _may_skip_dispatcher(q, initial_state):
        plan, ptrs = _wrapper_plan(
            A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state,
            inplace_final_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
            use_qk_l2norm_in_kernel, spec_token_indx, null_slot_id,
        )  # fmt: skip
        if isinstance(plan, str):
            raise ValueError(plan)
        if plan.direct:
            assert initial_state is not None and ssm_state_indices is not None
            result = q.new_empty(plan.out_shape)
            if plan.grid[1] and q.shape[1]:
                tensors = (A_log, a, b, dt_bias, q, k, v, result, initial_state, cu_seqlens,
                           ssm_state_indices, num_accepted_tokens, spec_token_indx)  # fmt: skip
                ptrs.insert(7, result.data_ptr())
                _launch(plan, tensors, ptrs)
            return result, initial_state
    fa, fb, fq, fk, fv, state, cu, idx = _flatten_call(
        a,
        b,
        q,
        k,
        v,
        initial_state,
        inplace_final_state,
        cu_seqlens,
        ssm_state_indices,
    )
    # Through the dispatcher (torch.compile sees one opaque op). The package
    # __init__ imports .op, which registered it before any call can get here.
    op = torch.ops.gdn_backport.gated_delta_rule_spec_update_v1.default
    out: torch.Tensor = op(
        A_log,
        fa,
        fb,
        dt_bias,
        fq,
        fk,
        fv,
        state,
        cu,
        idx,
        num_accepted_tokens,
        spec_token_indx,
        null_slot_id,
        scale,
        beta,
        threshold,
        use_qk_l2norm_in_kernel,
    )
    return out.view(q.shape[0], q.shape[1], *out.shape[1:]), state
