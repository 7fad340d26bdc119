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
from typing import Any

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_INDEX_NAMES = frozenset(
    ("cu_seqlens", "ssm_state_indices", "num_accepted_tokens", "spec_token_indx")
)
# One K block keeps the whole key row in registers; 256 is the largest head
# size vLLM's GDN models use, and [BV, 256] fp32 tiles still fit.
MAX_HEAD_K = 256
# Gates and slots of up to BT tokens are gathered as one tile before the serial
# token loop; longer requests loop over several tiles.
MAX_BT = 8


@triton.jit  # type: ignore[untyped-decorator]
def _token_step(  # type: ignore[no-untyped-def]
    b_h, i_j, i_t, o_t, o_k, o_v, m_k, m_v, m_h,
    b_decay, b_beta, b_slots, b_qs, b_ks, b_vs, b_live, i_h, i_hv,
    q, k, v, o, h, scale, null_slot_id,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_h_n,
    V: tl.constexpr, K: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    PRELOAD_QKV: tl.constexpr, STREAM_STORES: tl.constexpr,
):  # fmt: skip
    """One token of one request: update the [BV, BK] state tile, store o and h."""
    # Pick token i_j out of the tiles (a BT-wide select, no memory).
    m_j = o_t == i_j
    b_decay_t = tl.sum(tl.where(m_j, b_decay, 0.0))
    b_beta_t = tl.sum(tl.where(m_j, b_beta, 0.0))
    b_slot_t = tl.sum(tl.where(m_j, b_slots, 0))
    if PRELOAD_QKV:
        b_q = tl.sum(tl.where(m_j[:, None], b_qs, 0.0), 0)
        b_k = tl.sum(tl.where(m_j[:, None], b_ks, 0.0), 0)
        b_v = tl.sum(tl.where(m_j[:, None], b_vs, 0.0), 0)
    else:
        p_q = q + i_t * stride_q_t + i_h * stride_q_h + o_k
        p_k = k + i_t * stride_k_t + i_h * stride_k_h + o_k
        p_v = v + i_t * stride_v_t + i_hv * stride_v_h + o_v
        b_q = tl.load(p_q, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v, other=0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale

    b_h *= b_decay_t
    b_v = (b_v - tl.sum(b_h * b_k[None, :], 1)) * b_beta_t
    b_h += b_v[:, None] * b_k[None, :]
    b_o = tl.sum(b_h * b_q[None, :], 1)
    b_o = tl.where(b_live, b_o, 0.0)

    p_o = o + i_t * stride_o_t + i_hv * stride_o_h + o_v
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
    # Every token's state goes to its own slot (int64 offsets: pools exceed
    # 2**31 elements), so a later step can resume from any accepted token.
    if b_live & (b_slot_t > null_slot_id):
        p_ht = h + b_slot_t * stride_h_n + i_hv * V * K
        p_ht = p_ht + o_v[:, None] * K + o_k[None, :]
        if STREAM_STORES:
            # Per-token states are read back at the earliest in the next
            # step: keep them from evicting this step's inputs from L2.
            tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h, cache_modifier=".cs")
        else:
            tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h)
    return b_h


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
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    HAS_TOKEN_INDEX: tl.constexpr,
    IS_SPEC_DECODING: tl.constexpr,
    PRELOAD_QKV: tl.constexpr,
    STREAM_STORES: tl.constexpr,
    FOR_LOOP: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)

    # Initial slot first: the state tile is the largest load, so it is issued
    # before anything else the token loop needs.
    if IS_SPEC_DECODING:
        i_c0 = tl.load(num_accepted_tokens + i_n).to(tl.int64) - 1
    else:
        i_c0 = tl.full([], 0, dtype=tl.int64)
    m_c0 = (i_c0 >= 0) & (i_c0 < num_idx_cols)
    p_slot0 = ssm_state_indices + i_n.to(tl.int64) * stride_idx_n + i_c0 * stride_idx_t
    b_slot0 = tl.load(p_slot0, mask=m_c0, other=null_slot_id).to(tl.int64)
    # A skipped request still runs its token loop, but reads and writes no
    # state and stores zero outputs (deterministic, unlike vLLM's garbage).
    b_live = b_slot0 > null_slot_id

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_v[:, None] & m_k[None, :]
    # This program's [BV, BK] tile of one slot of h[slot, hv, v, k]. Written
    # out at each use rather than kept as an offset tile: a tile live across
    # the token loop costs ~100 registers (sm_90, BV=32: 244 against 128).
    p_h = h + i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    # Scalar branches, not `tile & scalar` masks: uniform per program on the
    # GPU, and the Triton interpreter mis-types such mixed masks.
    b_h = tl.zeros([BV, BK], dtype=tl.float32)
    if b_live:
        b_h = tl.load(p_h + b_slot0 * stride_h_n, mask=m_h, other=0.0)
        b_h = b_h.to(tl.float32)

    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = eos - bos

    b_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)
    o_t = tl.arange(0, BT)
    p_slots = ssm_state_indices + i_n.to(tl.int64) * stride_idx_n
    # `while`, not `for ... in range(0, T, BT)`: Triton 3.6's interpreter turns
    # a tensor range bound into a Python int with int(ndarray), which NumPy
    # 2.4+ rejects for the 1-element arrays it holds scalars in; a loop
    # condition only needs bool(). Same for the token loop below. On sm_90
    # both forms compile to the same PTX (Triton 3.6 and 3.9).
    i_s = tl.zeros([], dtype=tl.int64)
    while i_s < T:
        # Gather everything token-indexed for up to BT tokens as tiles, off the
        # serial chain: gate rows (by spec_token_indx), their gates, slots and,
        # with PRELOAD_QKV, the q/k/v rows with their norms. The token loop
        # below then only computes and stores.
        o_ts = i_s + o_t
        m_t = o_ts < T
        if HAS_TOKEN_INDEX:
            b_row = tl.load(spec_token_indx + bos + o_ts, mask=m_t, other=0)
            b_row = b_row.to(tl.int64)
        else:
            b_row = bos + o_ts
        b_a = tl.load(a + b_row * stride_a_t + i_hv * stride_a_h, mask=m_t, other=0)
        b_b = tl.load(b + b_row * stride_b_t + i_hv * stride_b_h, mask=m_t, other=0)
        b_x = b_a.to(tl.float32) + b_dt_bias
        b_bx = softplus_beta * b_x
        b_softplus = tl.where(
            b_bx <= softplus_threshold, tl.log(1.0 + tl.exp(b_bx)) / softplus_beta, b_x
        )
        b_decay = tl.exp(b_A * b_softplus)
        b_beta = tl.sigmoid(b_b.to(tl.float32))
        b_slots = tl.load(
            p_slots + o_ts * stride_idx_t,
            mask=m_t & (o_ts < num_idx_cols),
            other=null_slot_id,
        ).to(tl.int64)
        # Placeholders when q/k/v are loaded per token (never read then).
        b_qs, b_ks, b_vs = b_decay, b_decay, b_decay
        if PRELOAD_QKV:
            o_tok = bos + o_ts
            m_tk = m_t[:, None] & m_k[None, :]
            p_q = q + o_tok[:, None] * stride_q_t + i_h * stride_q_h + o_k[None, :]
            p_k = k + o_tok[:, None] * stride_k_t + i_h * stride_k_h + o_k[None, :]
            p_v = v + o_tok[:, None] * stride_v_t + i_hv * stride_v_h + o_v[None, :]
            b_qs = tl.load(p_q, mask=m_tk, other=0).to(tl.float32)
            b_ks = tl.load(p_k, mask=m_tk, other=0).to(tl.float32)
            b_vs = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0)
            b_vs = b_vs.to(tl.float32)
            if USE_QK_L2NORM:
                b_qs = b_qs * tl.rsqrt(tl.sum(b_qs * b_qs, 1) + 1e-6)[:, None]
                b_ks = b_ks * tl.rsqrt(tl.sum(b_ks * b_ks, 1) + 1e-6)[:, None]
            b_qs = b_qs * scale

        n_j = tl.minimum(T - i_s, BT)
        if FOR_LOOP:
            # A counted loop lets Triton software-pipeline the per-token
            # loads (num_stages); the interpreter needs the `while` below.
            for i_j in range(0, n_j):
                b_h = _token_step(
                    b_h, i_j, bos + i_s + i_j, o_t, o_k, o_v, m_k, m_v, m_h,
                    b_decay, b_beta, b_slots, b_qs, b_ks, b_vs, b_live, i_h, i_hv,
                    q, k, v, o, h, scale, null_slot_id,
                    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                    stride_o_t, stride_o_h, stride_h_n,
                    V, K, USE_QK_L2NORM, PRELOAD_QKV, STREAM_STORES,
                )  # fmt: skip
        else:
            i_j = tl.zeros([], dtype=tl.int64)
            while i_j < n_j:
                b_h = _token_step(
                    b_h, i_j, bos + i_s + i_j, o_t, o_k, o_v, m_k, m_v, m_h,
                    b_decay, b_beta, b_slots, b_qs, b_ks, b_vs, b_live, i_h, i_hv,
                    q, k, v, o, h, scale, null_slot_id,
                    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                    stride_o_t, stride_o_h, stride_h_n,
                    V, K, USE_QK_L2NORM, PRELOAD_QKV, STREAM_STORES,
                )  # fmt: skip
                i_j += 1
        i_s += BT


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pick_block_v(rows: int, V: int, BK: int, device: torch.device) -> int:
    """V block for ``rows`` = N x HV (request, value head) pairs.

    Measured on an H200 (bench/sweep_spec_update.py, K=V=128, CUDA graphs):
    [8, 128] tiles on one warp reach 87-92 % of the copy-bandwidth roofline at
    N >= 64 against 70-75 % for [32, 128] tiles on four warps (vLLM's launch
    shape): more, smaller programs hide the serial token chain's latency, and
    the K reductions stay inside one warp. Up to 512 rows (N=8 at HV=64) the
    batch is latency-bound and [4, 128] tiles are 3-13 % faster still; above,
    they lose 1-5 %.
    """
    if device.type != "cuda":
        # The interpreter runs programs one by one: on CPU, fewest programs win.
        return max(16, min(int(triton.next_power_of_2(V)), 4096 // BK))
    per_thread = 16 if rows <= 512 else 32
    return max(4, min(int(triton.next_power_of_2(V)), per_thread * 32 // BK))


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


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


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
    preload_qkv: bool | None = None,
    stream_stores: bool = False,
    for_loop: bool | None = None,
) -> torch.Tensor:
    """Launch the kernel on op-level (flattened) arguments; returns ``out``.

    Shapes: ``q``/``k`` ``[T, H, K]``, ``v`` ``[T, HV, V]``, ``a``/``b``
    ``[T_all, HV]``, ``state`` ``[num_slots, HV, V, K]`` (updated in place),
    ``cu_seqlens`` ``[N + 1]``, ``ssm_state_indices`` ``[N, C]`` or ``[N]``,
    ``num_accepted_tokens`` ``[N]``, ``spec_token_indx`` ``[T]``. ``out``
    (``[T, HV, V]``, contiguous last dim), ``block_v``, ``num_warps`` and
    ``preload_qkv`` (False: load q/k/v inside the token loop) are for tests and
    benchmarks. Host-side checks only: safe under CUDA-graph capture.
    """
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
        raise ValueError(reason)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    N = cu_seqlens.numel() - 1
    if out is None:
        out = q.new_empty(T, HV, V)
    elif out.shape != (T, HV, V) or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out: expected [{T}, {HV}, {V}] on {q.device}")
    if N == 0 or T == 0:
        return out
    if ssm_state_indices.dim() == 1:
        ssm_state_indices = ssm_state_indices[:, None]
    if scale is None:
        scale = K**-0.5

    BK = triton.next_power_of_2(K)
    BV = block_v or _pick_block_v(N * HV, V, BK, q.device)
    num_idx_cols = ssm_state_indices.shape[1]
    BT = min(triton.next_power_of_2(max(num_idx_cols, 2)), MAX_BT)
    if preload_qkv is None:
        preload_qkv = False
    if num_warps is None:
        # About 32 fp32 state elements per thread (see _pick_block_v).
        num_warps = max(1, min(8, BV * BK // 1024))

    grid = (triton.cdiv(V, BV), N * HV)
    kernel: Any = gated_delta_rule_spec_update_fwd_kernel
    kernel[grid](
        A_log.contiguous(),
        a,
        b,
        dt_bias.contiguous(),
        q,
        k,
        v,
        out,
        state,
        cu_seqlens.contiguous(),
        ssm_state_indices,
        num_accepted_tokens.contiguous() if num_accepted_tokens is not None else None,
        spec_token_indx.contiguous() if spec_token_indx is not None else None,
        float(scale),
        float(softplus_beta),
        float(softplus_threshold),
        int(null_slot_id),
        num_idx_cols,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        state.stride(0),
        ssm_state_indices.stride(0),
        ssm_state_indices.stride(1),
        H=H,
        HV=HV,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        BT=BT,
        USE_QK_L2NORM=bool(use_qk_l2norm_in_kernel),
        HAS_TOKEN_INDEX=spec_token_indx is not None,
        IS_SPEC_DECODING=num_accepted_tokens is not None,
        PRELOAD_QKV=preload_qkv,
        STREAM_STORES=stream_stores,
        FOR_LOOP=(not _interpreting()) if for_loop is None else for_loop,
        num_warps=num_warps,
    )
    return out


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
    if initial_state is None:
        raise ValueError("initial_state: expected the state pool, got None")
    if not inplace_final_state:
        raise ValueError("inplace_final_state: only True is supported")
    if ssm_state_indices is None:
        raise ValueError("ssm_state_indices: expected a tensor, got None")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, v: expected [B, T, H, K] and [B, T, HV, V], got {tuple(q.shape)}, {tuple(v.shape)}"
        )
    B, T = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    elif B != 1:
        raise ValueError(f"q: batch size must be 1 with cu_seqlens, got {B}")
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
    Host-side metadata only; never syncs.
    """
    try:
        flat = _flatten_call(
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
    except ValueError as e:
        return False, str(e)
    fa, fb, fq, fk, fv, state, cu, idx = flat
    reason = _unsupported_reason(
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
    )
    return (False, reason) if reason is not None else (True, "")


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
    """
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
