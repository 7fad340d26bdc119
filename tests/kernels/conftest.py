"""Kernel tests run the real Triton kernels: on CUDA when there is a GPU, else
on CPU tensors under the Triton interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Decided before any kernel module is imported: triton reads the switch when a
# @triton.jit function is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The kernel package must import from this checkout on its own (no install,
# no gdn_backport), the way a patched vLLM tree imports it.
_KERNELS = str(Path(__file__).resolve().parents[2] / "kernels")
if _KERNELS not in sys.path:
    sys.path.insert(0, _KERNELS)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
