"""The shared harness: a tree's own GDN code, driven on CPU or GPU.

One job per module: :mod:`.loader` (the tree's modules and kernels from
source, stand-ins for the rest of vLLM), :mod:`.standins`,
:mod:`.interpreter` (Triton interpreter fixes for CPU runs),
:mod:`.triton_runtime` (compiled-Triton shims for GPU runs), :mod:`.batch`
(batch descriptions), :mod:`.layer` (the layer object and its state pools),
:mod:`.reference` (the float64 oracle), :mod:`.result` (a scenario's
outcome). The patchsets' suites are built on these; :func:`gdn_backport.verify.verify_tree`
runs them.
"""

from __future__ import annotations

from gdn_backport.harness.batch import Batch, Row, SlotMap
from gdn_backport.harness.loader import GdnSite, HarnessError, LoadedTree, find_gdn_sites, load_tree
from gdn_backport.harness.result import ScenarioResult

__all__ = [
    "Batch",
    "GdnSite",
    "HarnessError",
    "LoadedTree",
    "Row",
    "ScenarioResult",
    "SlotMap",
    "find_gdn_sites",
    "load_tree",
]
