"""``--format sarif|github`` of ``scan`` and ``apply --check/--dry-run``: the CLI's seam.

The run's sites come from the command as it runs today (its exit code and
stderr lines unchanged); each patchset with an affected site is then run
again alone as ``apply --dry-run`` for the fix it would write
(:mod:`gdn_backport.findings`), and the findings are printed as a SARIF log
(:mod:`gdn_backport.sarif`) or as GitHub workflow commands
(:mod:`gdn_backport.github_annotations`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport import findings, github_annotations, sarif
from gdn_backport.errors import UsageError
from gdn_backport.site import Site, Status

if TYPE_CHECKING:
    from gdn_backport.pipeline import Outcome
    from gdn_backport.registry import Patchset

FORMATS = ("sarif", "github")

# (patchset, its strategy) -> that patchset's outcome of `apply --dry-run` alone.
DryRun = Callable[["Patchset", str], "Outcome"]


def fix_runs(
    sites: Sequence[Site], chosen: Sequence[Patchset], strategy: str | None, dry_run: DryRun
) -> dict[str, findings.FixRun]:
    """The dry run of each chosen patchset with an affected site. Alone, so
    that each fix applies to the files as they are (a later patchset of a
    combined run plans on an earlier one's rewrite) and one patchset's
    refusal does not take the others' fixes away."""
    wanted = {s.patchset for s in sites if s.status is Status.AFFECTED}
    runs: dict[str, findings.FixRun] = {}
    for ps in chosen:
        if ps.info.id not in wanted:
            continue
        chosen_strategy = ps.strategy(strategy)
        try:
            runs[ps.info.id] = findings.FixRun(chosen_strategy, dry_run(ps, chosen_strategy))
        except UsageError as exc:
            runs[ps.info.id] = findings.FixRun(chosen_strategy, error=str(exc))
    return runs


def render(
    fmt: str,
    root: Path,
    sites: Sequence[Site],
    chosen: Sequence[Patchset],
    exit_code: int,
    dry_run: DryRun,
    strategy: str | None = None,
) -> str:
    found = findings.findings(root, sites, fix_runs(sites, chosen, strategy, dry_run))
    if fmt == "sarif":
        return json.dumps(sarif.document(root, found, chosen, exit_code), indent=2) + "\n"
    return "".join(line + "\n" for line in github_annotations.lines(found, root))
