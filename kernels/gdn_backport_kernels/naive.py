"""Float64 PyTorch reference of the speculative-verify gated delta rule update.

Same arguments and semantics as the op (see ``spec_update``'s module
docstring), written as a plain loop per request and per token. It is the
oracle of the kernel tests, not a fast path.
"""

from __future__ import annotations

import torch


def gated_delta_rule_spec_update_naive(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(out, new_state)``, both float64; inputs are left untouched.

    ``out`` is ``[T, HV, V]`` (zero for skipped requests); ``new_state`` is a
    float64 copy of ``state`` with every written slot replaced.
    """
    f64 = torch.float64
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    scale = K**-0.5 if scale is None else scale
    out = torch.zeros(T, HV, V, dtype=f64, device=q.device)
    new_state = state.to(f64)  # a copy: the caller's pool stays as it was
    slots = ssm_state_indices.reshape(ssm_state_indices.shape[0], -1).tolist()
    cu = cu_seqlens.tolist()
    rows = spec_token_indx.tolist() if spec_token_indx is not None else None
    A = -torch.exp(A_log.reshape(HV).to(f64))
    dt_bias64 = dt_bias.reshape(HV).to(f64)

    def slot_at(n: int, col: int) -> int | None:
        ok = 0 <= col < len(slots[n]) and slots[n][col] > null_slot_id
        return int(slots[n][col]) if ok else None

    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        col0 = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
        slot0 = slot_at(n, col0)
        if slot0 is None:
            continue  # skipped request: zero outputs, no state written
        h = state[slot0].to(f64)  # [HV, V, K], as it was before this call
        for t in range(eos - bos):
            i = bos + t
            row = rows[i] if rows is not None else i
            x = a[row].to(f64) + dt_bias64
            bx = softplus_beta * x
            softplus = torch.where(
                bx <= softplus_threshold, torch.log1p(torch.exp(bx)) / softplus_beta, x
            )
            decay = torch.exp(A * softplus)  # exp(g), [HV]
            beta = torch.sigmoid(b[row].to(f64))  # [HV]
            # GQA: value head hv reads query/key head hv // (HV // H).
            qt = q[i].to(f64).repeat_interleave(HV // H, dim=0)  # [HV, K]
            kt = k[i].to(f64).repeat_interleave(HV // H, dim=0)
            if use_qk_l2norm_in_kernel:
                qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
            qt = qt * scale
            h = h * decay[:, None, None]
            delta = (v[i].to(f64) - torch.einsum("hvk,hk->hv", h, kt)) * beta[:, None]
            h = h + delta[:, :, None] * kt[:, None, :]
            out[i] = torch.einsum("hvk,hk->hv", h, qt)
            slot = slot_at(n, t)
            if slot is not None:
                new_state[slot] = h
    return out, new_state
