"""The ABI-stable op: ``gdn_backport::gated_delta_rule_spec_update_v1``.

The schema below is frozen (``tests/kernels/test_abi.py`` holds it): new
behaviour gets a ``_v2`` op beside it, never an edit here. The op mutates the
state pool in place and returns a fresh ``[T, HV, V]`` output; its fake
implementation only allocates that output, so it traces under
``torch.compile`` and records into CUDA graphs (no host syncs in the real one).
"""

from __future__ import annotations

import torch

from .spec_update import gated_delta_rule_spec_update_fwd

NAMESPACE = "gdn_backport"
OP_NAME = "gated_delta_rule_spec_update_v1"
SPEC_UPDATE_OP = f"{NAMESPACE}::{OP_NAME}"
SCHEMA = (
    "(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias, Tensor q, Tensor k, "
    "Tensor v, Tensor(a!) state, Tensor cu_seqlens, Tensor ssm_state_indices, "
    "Tensor? num_accepted_tokens, Tensor? spec_token_indx, int null_slot_id, "
    "float? scale, float softplus_beta, float softplus_threshold, "
    "bool use_qk_l2norm_in_kernel) -> Tensor"
)


def _impl(
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
) -> torch.Tensor:
    return gated_delta_rule_spec_update_fwd(
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
        null_slot_id=null_slot_id,
        scale=scale,
        softplus_beta=softplus_beta,
        softplus_threshold=softplus_threshold,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def _fake(
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
) -> torch.Tensor:
    return q.new_empty((q.shape[0], v.shape[1], v.shape[2]))


# A FRAGMENT library held for the process lifetime; CPU runs the same Triton
# kernel under TRITON_INTERPRET=1 (tests), CUDA is the product.
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]
_lib.define(OP_NAME + SCHEMA)  # type: ignore[no-untyped-call]
torch.library.impl(SPEC_UPDATE_OP, ("CPU", "CUDA"), _impl, lib=_lib)
torch.library.register_fake(SPEC_UPDATE_OP, _fake, lib=_lib)


def gated_delta_rule_spec_update_v1(
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
) -> torch.Tensor:
    """Typed call of the registered op (goes through the dispatcher)."""
    out: torch.Tensor = torch.ops.gdn_backport.gated_delta_rule_spec_update_v1(
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
        null_slot_id,
        scale,
        softplus_beta,
        softplus_threshold,
        use_qk_l2norm_in_kernel,
    )
    return out
