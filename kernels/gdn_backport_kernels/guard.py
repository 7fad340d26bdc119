"""The guarded call site: run the op where it can serve, upstream's path elsewhere.

``apply --strategy kernel`` rewrites a spec call into

    (
        gated_delta_rule_spec_update(<args>, spec_token_indx=rows, null_slot_id=n)
        if use_spec_update(<args>, spec_token_indx=rows, null_slot_id=n)
        else fused_sigmoid_gating_delta_rule_update(
            <args, a=gather_token_rows(a, rows), b=gather_token_rows(b, rows)>
        )
    )

so a call the op cannot serve (a head size, dtype or layout a fork changed)
runs the tree's own kernel on gathered gates, which is upstream's fix (vLLM
PR #51812), instead of raising inside a model server. Both branches are
plain calls the analysis proves aligned in the rewritten file.
"""

from __future__ import annotations

import logging
import os

import torch

from .spec_update import (
    _call_problem,
    _flatten_call,
    _unsupported_reason,
    spec_update_supported,
)

# Set to "off" to run the fallback everywhere (an operator's escape hatch,
# and how the CPU suite drives the fallback branch of a patched tree).
KERNEL_ENV = "GDN_BACKPORT_KERNEL"

_log = logging.getLogger("gdn_backport_kernels")
_warned = False


def gather_token_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``x``'s rows ``index`` (``x.index_select(0, index)``), or ``x`` itself
    where ``index`` is None (the pure-speculative batch: zero-copy)."""
    return x if index is None else x.index_select(0, index)


def _traced_reason(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: torch.Tensor | None,
    inplace_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    spec_token_indx: torch.Tensor | None,
) -> str | None:
    """The checks alone, on metadata, uncached: what ``torch.compile`` traces
    (the eager path's plan cache keys on data pointers, which fake tensors
    do not have). Shape checks become the graph's guards."""
    problem = _call_problem(q, v, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices)
    if problem is not None:
        return problem
    fa, fb, fq, fk, fv, state, cu, idx = _flatten_call(
        a, b, q, k, v, initial_state, inplace_final_state, cu_seqlens, ssm_state_indices
    )
    return _unsupported_reason(
        A_log, fa, fb, dt_bias, fq, fk, fv, state, cu, idx, num_accepted_tokens, spec_token_indx
    )


def _warn_once(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    _log.warning(
        "gdn_backport_kernels: gated_delta_rule_spec_update cannot serve a call (%s); "
        "running the tree's own kernel on gathered gates instead (upstream's fix). "
        "Warned once per process.",
        reason,
    )


def use_spec_update(
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
) -> bool:
    """Whether the guarded call site runs the op (else its fallback branch).

    Takes exactly :func:`gated_delta_rule_spec_update`'s arguments. Host-side
    metadata only: never syncs, so it is safe while a CUDA graph captures;
    under ``torch.compile`` the checks are traced (no plan cache, no
    logging) and specialise the graph. The first fallback of an eager
    process logs one warning naming the reason. ``GDN_BACKPORT_KERNEL=off``
    sends every call to the fallback.
    """
    compiling = torch.compiler.is_compiling()
    reason: str | None
    if os.environ.get(KERNEL_ENV, "") == "off":
        reason = f"{KERNEL_ENV}=off"
    elif compiling:
        reason = _traced_reason(
            A_log, a, b, dt_bias, q, k, v, initial_state, inplace_final_state, cu_seqlens,
            ssm_state_indices, num_accepted_tokens, spec_token_indx,
        )  # fmt: skip
    else:
        ok, why = spec_update_supported(
            A_log, a, b, dt_bias, q, k, v, beta, threshold, scale, initial_state,
            inplace_final_state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
            use_qk_l2norm_in_kernel, spec_token_indx=spec_token_indx, null_slot_id=null_slot_id,
        )  # fmt: skip
        reason = None if ok else why
    if reason is None:
        return True
    if not compiling:
        _warn_once(reason)
    return False
