"""gdn-backport: find, prove and backport vLLM PR #51812 in any vLLM tree."""

from __future__ import annotations

__all__ = ["UPSTREAM_PR", "__version__"]

__version__ = "0.1.0"
UPSTREAM_PR = "vllm-project/vllm#51812"
