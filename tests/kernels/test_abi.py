"""Golden test of the kernel package's contract.

A change here is an ABI break: never edit these strings to make a test pass.
New behaviour gets a new ``_v2`` op (and, for a changed public name, a new
ABI_VERSION) beside the frozen ones.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gdn_backport_kernels
from gdn_backport_kernels import (
    gated_delta_rule_spec_update,
    gather_token_rows,
    spec_update_supported,
    use_spec_update,
)

SCHEMA_V1 = (
    "gdn_backport::gated_delta_rule_spec_update_v1("
    "Tensor A_log, Tensor a, Tensor b, Tensor dt_bias, Tensor q, Tensor k, "
    "Tensor v, Tensor(a!) state, Tensor cu_seqlens, Tensor ssm_state_indices, "
    "Tensor? num_accepted_tokens, Tensor? spec_token_indx, int null_slot_id, "
    "float? scale, float softplus_beta, float softplus_threshold, "
    "bool use_qk_l2norm_in_kernel) -> Tensor"
)
ALL_V1 = [
    "ABI_VERSION",
    "SPEC_UPDATE_OP",
    "gated_delta_rule_spec_update",
    "gated_delta_rule_spec_update_naive",
    "gated_delta_rule_spec_update_v1",
    "spec_update_supported",
]
# Added in ABI 1 for the guarded call site (issue 14): patched trees import
# them, so they are frozen like the rest.
ADDED_V1 = ["gather_token_rows", "use_spec_update"]
# vLLM's fused_sigmoid_gating_delta_rule_update order (is_kda aside), then
# our two required keyword-only arguments.
WRAPPER_V1 = (
    "A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0, scale=None, "
    "initial_state=None, inplace_final_state=True, cu_seqlens=None, "
    "ssm_state_indices=None, num_accepted_tokens=None, "
    "use_qk_l2norm_in_kernel=False, *, spec_token_indx, null_slot_id"
)


def _all_order(name: str) -> tuple[bool, str]:
    """Ruff's ``__all__`` order: constants first, then the rest."""
    return (not name.isupper(), name)


def _params(fn: Callable[..., Any]) -> str:
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in out:
            out.append("*")
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def test_abi_version() -> None:
    assert gdn_backport_kernels.ABI_VERSION == 1
    assert type(gdn_backport_kernels.ABI_VERSION) is int


def test_public_names() -> None:
    # Names are only ever added: every released one stays.
    assert gdn_backport_kernels.__all__ == sorted(ALL_V1 + ADDED_V1, key=_all_order)
    for name in ALL_V1 + ADDED_V1:
        assert hasattr(gdn_backport_kernels, name), name
    assert SCHEMA_V1.split("(")[0] == gdn_backport_kernels.SPEC_UPDATE_OP


def test_op_schema_is_frozen() -> None:
    op = torch.ops.gdn_backport.gated_delta_rule_spec_update_v1.default
    assert str(op._schema) == SCHEMA_V1


def test_wrapper_signature_is_frozen() -> None:
    assert _params(gated_delta_rule_spec_update) == WRAPPER_V1
    # The capability check and the call-site guard take exactly the
    # wrapper's arguments.
    assert _params(spec_update_supported) == WRAPPER_V1
    assert _params(use_spec_update) == WRAPPER_V1
    assert _params(gather_token_rows) == "x, index"


def test_imports_alone_without_gpu_or_tool() -> None:
    # A fresh interpreter: no gdn_backport (blocked), no GPU, no interpreter
    # mode; importing must register the op and compile nothing.
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "gdn_backport" or name.startswith("gdn_backport."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import torch, gdn_backport_kernels
from gdn_backport_kernels import spec_update
k = spec_update.gated_delta_rule_spec_update_fwd_kernel
assert gdn_backport_kernels.ABI_VERSION == 1
assert torch.ops.gdn_backport.gated_delta_rule_spec_update_v1.default
assert not getattr(k, "device_caches", {}), "a kernel was compiled on import"
assert "gdn_backport" not in sys.modules
"""
    kernels = Path(__file__).resolve().parents[2] / "kernels"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(kernels), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
