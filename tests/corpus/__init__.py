"""The mutation corpus: fork-shaped variants of the real affected ``_forward_core``
(:mod:`.variants`) and what runs them through the CLI and prints the results
(:mod:`.runner`). Test-fixture code: it is not part of the shipped package.
``tests/test_corpus.py`` runs a CI subset; ``bench/bench_corpus.py`` all of it.
"""

from __future__ import annotations

from tests.corpus.runner import (
    CaseResult,
    counts_table,
    render,
    run_case,
    slim_tree,
    unpatched_fails,
)
from tests.corpus.variants import (
    FORK_KERNEL_DECLARATION,
    LAYOUTS,
    STRATEGIES,
    VARIANTS,
    CorpusError,
    Expect,
    Layout,
    Variant,
    layout,
    variant,
    variant_files,
    variant_source,
)

__all__ = [
    "FORK_KERNEL_DECLARATION",
    "LAYOUTS",
    "STRATEGIES",
    "VARIANTS",
    "CaseResult",
    "CorpusError",
    "Expect",
    "Layout",
    "Variant",
    "counts_table",
    "layout",
    "render",
    "run_case",
    "slim_tree",
    "unpatched_fails",
    "variant",
    "variant_files",
    "variant_source",
]
