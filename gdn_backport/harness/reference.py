"""The float64 oracle: one GDN step, request by request, token by token.

For each request, in request order: causal conv1d over (its conv history,
its tokens) with SiLU, split into q / k / v, L2-normalised q and k (q scaled
by K^-1/2), gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and
``beta = sigmoid(b)``, and the gated delta rule

    S <- S * exp(g);  u = beta * (v - S^T k);  S <- S + k u^T;  o = S^T q

with ``S`` of shape (K, V) per value head (value head ``h`` reads key head
``h // (HV / H)``). The state pools are updated exactly where vLLM's step
writes them:

* a spec request (slot block ``blk``, ``n`` accepted tokens last step) reads
  conv history ``conv[blk[0], n-1 : n-1+W-1]`` and SSM state
  ``ssm[blk[n-1]]``; it writes ``conv[blk[0], :W-2+T]`` (the history shifted
  by one then its T raw inputs) and the state after token t into
  ``ssm[blk[t]]``;
* a non-spec request (slot ``s``) reads ``conv[s, :W-1]`` and ``ssm[s]``
  (zeros without initial state) and writes the last W-1 inputs into
  ``conv[s, :W-1]`` and its final state into ``ssm[s]``.

Every other slot and position keeps its value. The conv output is rounded to
the activation dtype, as the kernels store it; nothing else is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gdn_backport.harness.batch import Batch, SlotMap
from gdn_backport.harness.layer import LayerShape, LayerTensors

__all__ = ["ReferenceStep", "max_abs_err", "reference_step"]


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest absolute difference, in float64 (NaN anywhere: inf, which
    no tolerance passes; nothing to compare: 0)."""
    diff = (
        actual.detach().to(torch.float64) - expected.detach().to(actual.device, torch.float64)
    ).abs()
    if diff.numel() == 0:
        return 0.0
    worst = diff.max().item()
    return float("inf") if worst != worst else float(worst)


@dataclass
class ReferenceStep:
    out: torch.Tensor  # (T, HV, V) float64
    conv_pool: torch.Tensor  # float64, layout of LayerTensors.conv_pool
    ssm_pool: torch.Tensor  # float64, layout of LayerTensors.ssm_pool


def _to_kv(state: torch.Tensor, layout: str) -> torch.Tensor:
    """Pool layout (HV, V, K) or (HV, K, V) -> (HV, K, V)."""
    return state.transpose(-1, -2) if layout == "VK" else state


def _from_kv(state: torch.Tensor, layout: str) -> torch.Tensor:
    return state.transpose(-1, -2) if layout == "VK" else state


def reference_step(
    shape: LayerShape,
    tensors: LayerTensors,
    batch: Batch,
    slots: SlotMap,
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> ReferenceStep:
    """The expected output and pools after one step (``tensors`` are the
    pools *before* the step; they are not modified)."""
    f64 = torch.float64
    # On the pools' device: the float64 oracle runs beside the kernels on a
    # GPU rather than copying every pool to the host each step.
    dev = tensors.ssm_pool.device
    width, hk, hv = shape.conv_kernel, shape.num_k_heads, shape.num_v_heads
    kd, vd = shape.head_k_dim, shape.head_v_dim
    conv = tensors.conv_pool.detach().to(dev, f64).clone()
    ssm = tensors.ssm_pool.detach().to(dev, f64).clone()
    weight = tensors.conv_weight.detach().to(dev, f64).view(shape.conv_dim, width)
    bias = (
        tensors.conv_bias.detach().to(dev, f64)
        if tensors.conv_bias is not None
        else torch.zeros(shape.conv_dim, dtype=f64, device=dev)
    )
    decay = -torch.exp(tensors.A_log.detach().to(dev, f64))
    dt_bias = tensors.dt_bias.detach().to(dev, f64)
    x_all = mixed_qkv.detach().to(dev, f64)
    a_all, b_all = a.detach().to(dev, f64), b.detach().to(dev, f64)
    out = torch.zeros(batch.num_tokens, hv, vd, dtype=f64, device=dev)
    group = hv // hk

    for rid, row, tokens in zip(batch.request_ids(), batch.rows, batch.token_ranges(), strict=True):
        block = slots.blocks[rid]
        idx = torch.tensor(list(tokens), device=dev)
        x = x_all[idx]
        n_tok = row.query_len
        if row.spec:
            offset = row.num_accepted - 1
            history = conv[block[0], offset : offset + width - 1].clone()
            shifted = conv[block[0], offset + 1 : offset + width - 1].clone()
            conv[block[0], : width - 2 + n_tok] = torch.cat([shifted, x])
            state = _to_kv(ssm[block[offset]], tensors.ssm_layout).clone()
        else:
            if row.has_initial_state:
                history = conv[block[0], : width - 1].clone()
                state = _to_kv(ssm[block[0]], tensors.ssm_layout).clone()
            else:
                history = torch.zeros(width - 1, shape.conv_dim, dtype=f64, device=dev)
                state = torch.zeros(hv, kd, vd, dtype=f64, device=dev)
            conv[block[0], : width - 1] = torch.cat([history, x])[-(width - 1) :]
        full = torch.cat([history, x])  # (W-1+T, D)
        # windows[t, d, w] = full[t + w, d]
        y = (full.unfold(0, width, 1) * weight).sum(-1) + bias
        y = F.silu(y).to(shape.dtype).to(f64)
        q, k, v = torch.split(y, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
        q = F.normalize(q.reshape(n_tok, hk, kd), dim=-1, eps=1e-6) * kd**-0.5
        k = F.normalize(k.reshape(n_tok, hk, kd), dim=-1, eps=1e-6)
        v = v.reshape(n_tok, hv, vd)
        g = decay * F.softplus(a_all[idx] + dt_bias)  # (T, HV)
        beta = torch.sigmoid(b_all[idx])
        # Value head h reads key head h // group; all heads of a token at once.
        k = k.repeat_interleave(group, dim=1)
        q = q.repeat_interleave(group, dim=1)
        for t in range(n_tok):
            state = state * torch.exp(g[t])[:, None, None]
            u = beta[t, :, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
            state = state + k[t, :, :, None] * u[:, None, :]
            out[tokens[t]] = torch.einsum("hk,hkv->hv", q[t], state)
            if row.spec:
                ssm[block[t]] = _from_kv(state, tensors.ssm_layout)
        if not row.spec:
            ssm[block[0]] = _from_kv(state, tensors.ssm_layout)
    return ReferenceStep(out=out, conv_pool=conv, ssm_pool=ssm)
