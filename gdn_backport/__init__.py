"""gdn-backport: find, prove and backport fixes of vLLM's Gated DeltaNet layer in any vLLM tree.

The fixes are the patchset packages (:mod:`gdn_backport.registry`); the
command line is :func:`gdn_backport.cli.main`.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
