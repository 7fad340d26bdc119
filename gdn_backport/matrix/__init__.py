"""The version matrix (``matrix/releases.toml``) and its cells, one job per module:

* :mod:`.model`: the data (releases, fork trees, :func:`load`) and the cells
  (one target with one patchset's strategy: every strategy of a patchset
  where it expects the release affected, its ``unaffected`` cells
  elsewhere), selected by id, release or tree;
* :mod:`.check`: the scan-only check of every release against what the
  matrix expects, and the ``--roundtrip`` of a patched copy
  (``gdn-backport matrix check``);
* :mod:`.runner`: running cells in this process: fetch, scan, verify
  unpatched, patch a copy, scan and verify again (``gdn-backport matrix run``,
  the noxfile);
* :mod:`.results`: progress, summary table, JSON, Markdown, JUnit XML;
* :mod:`.export`: the cells as CI documents, GitHub Actions or Buildkite
  (``gdn-backport matrix export``).

The names below are the package's API; the modules hold the rest.
"""

from __future__ import annotations

from gdn_backport.matrix.check import (
    Found,
    Result,
    check_sites,
    render,
    roundtrip,
    run,
    scan_release,
)
from gdn_backport.matrix.model import (
    GPU_HEADS,
    WHERE,
    Cell,
    Expectation,
    Matrix,
    Release,
    Tree,
    adhoc_tree,
    all_strategies,
    cells,
    load,
    parse,
)
from gdn_backport.matrix.results import (
    ProgressLine,
    environment,
    environment_line,
    junit_xml,
    render_cells,
    render_markdown,
    write_results,
)
from gdn_backport.matrix.runner import (
    CellResult,
    CellRunner,
    Check,
    RunOptions,
    Verified,
    default_scenarios,
    exit_code,
    parse_heads,
    resolve_device,
    run_cells,
)

__all__ = [
    "GPU_HEADS",
    "WHERE",
    "Cell",
    "CellResult",
    "CellRunner",
    "Check",
    "Expectation",
    "Found",
    "Matrix",
    "ProgressLine",
    "Release",
    "Result",
    "RunOptions",
    "Tree",
    "Verified",
    "adhoc_tree",
    "all_strategies",
    "cells",
    "check_sites",
    "default_scenarios",
    "environment",
    "environment_line",
    "exit_code",
    "junit_xml",
    "load",
    "parse",
    "parse_heads",
    "render",
    "render_cells",
    "render_markdown",
    "resolve_device",
    "roundtrip",
    "run",
    "run_cells",
    "scan_release",
    "write_results",
]
