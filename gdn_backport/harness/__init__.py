"""The mixed-batch regression harness: a tree's own GDN code, driven on CPU or GPU.

One job per module: :mod:`.loader` (the tree's GDN module and kernels from
source, stand-ins for the rest of vLLM), :mod:`.standins`,
:mod:`.interpreter` (Triton interpreter fixes for CPU runs),
:mod:`.triton_runtime` (compiled-Triton shims for GPU runs), :mod:`.batch`
(batch descriptions), :mod:`.metadata` (the metadata the method reads),
:mod:`.layer` (the layer object and its state pools), :mod:`.reference`
(float64 oracle), :mod:`.scenarios` and :mod:`.suite` (oracles, results).
:func:`gdn_backport.verify.verify_tree` is the entry point.
"""

from __future__ import annotations

from gdn_backport.harness.batch import Batch, Row, SlotMap
from gdn_backport.harness.loader import GdnSite, HarnessError, LoadedTree, find_gdn_sites, load_tree
from gdn_backport.harness.scenarios import EXTRA_SCENARIOS, SCENARIOS, Scenario, ci_scenarios
from gdn_backport.harness.suite import ScenarioResult, SuiteRunner

__all__ = [
    "EXTRA_SCENARIOS",
    "SCENARIOS",
    "Batch",
    "GdnSite",
    "HarnessError",
    "LoadedTree",
    "Row",
    "Scenario",
    "ScenarioResult",
    "SlotMap",
    "SuiteRunner",
    "ci_scenarios",
    "find_gdn_sites",
    "load_tree",
]
