"""``gdn-backport verify``: the mixed-batch regression suite against one tree.

Loads the tree's own GDN ``_forward_core`` and kernels (see
:mod:`gdn_backport.harness`), runs the scenarios and reports, per scenario,
the largest absolute error against the oracles and whether it passed.

On ``device="cpu"`` the Triton kernels run under Triton's interpreter:
:func:`verify_tree` sets ``TRITON_INTERPRET=1`` before anything imports the
tree's kernels (``triton.jit`` reads it when a kernel is defined), so call
it before importing vLLM kernels yourself in the same process. CPU runs use
float16 activations: the FLA chunk kernels refuse float32 and Triton's
interpreter computes bfloat16 arithmetic on raw bits. CUDA runs use bfloat16.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gdn_backport import registry
from gdn_backport.harness.result import ScenarioResult
from gdn_backport.harness.suite import TRITON_TOO_NEW, Suite, SuiteError, triton_problem

# The suites' contract lives in the harness (harness/suite.py: the suites
# import it from there, not from here); it is named here for verify's callers.
__all__ = [
    "TRITON_TOO_NEW",
    "ScenarioResult",
    "Suite",
    "SuiteError",
    "VerifyReport",
    "triton_problem",
    "verify_tree",
]


@dataclass
class VerifyReport:
    tree: str
    site: str
    device: str
    dtype: str
    rows: list[ScenarioResult] = field(default_factory=list)
    error: str = ""  # the harness could not drive the tree: why
    # A suite not run on this tree (all patchsets asked, and the tree lacks
    # what that suite drives): "patchset: why".
    skipped: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.error and bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def exit_code(self) -> int:
        """0 all passed, 1 a scenario failed, 2 the tree could not be driven."""
        if self.error:
            return 2
        return 0 if self.passed else 1

    def to_json(self) -> str:
        doc = asdict(self)
        doc["passed"] = self.passed
        doc["exit_code"] = self.exit_code
        return json.dumps(doc, indent=2, default=float)

    def table(self) -> str:
        head = f"{self.tree}\n  site: {self.site or '-'}  device: {self.device} ({self.dtype})"
        if self.error:
            return f"{head}\n  error: {self.error}"
        lines = [head, f"  {'scenario':<22} {'result':<6} {'max_abs_err':>11} {'tol':>7}  note"]
        for r in self.rows:
            result = "PASS" if r.passed else "FAIL"
            lines.append(
                f"  {r.name:<22} {result:<6} {r.max_abs_err:>11.3g} {r.tolerance:>7.3g}  {r.note}"
            )
        lines += [f"  skipped {why}" for why in self.skipped]
        return "\n".join(lines)


def verify_tree(
    tree: Path,
    device: str = "cpu",
    scenarios: Iterable[str] | None = None,
    self_consistency: bool = True,
    seed: int = 0,
    heads: tuple[int, int, int] | None = None,
    patch: Callable[[types.ModuleType], object] | None = None,
    patchsets: Sequence[str] | None = None,
) -> VerifyReport:
    """Run the chosen patchsets' suites on ``tree`` (a root holding ``vllm/``).

    ``scenarios``: names from any suite (default: each suite's own set);
    ``heads``: (H, HV, K=V) of the layer, default the small CPU shape, e.g.
    (16, 64, 128) for a Qwen3.5 layer at TP=1. A tree a suite cannot load or
    drive gives a report with ``error`` set (exit code 2) when that suite was
    asked for (by patchset or scenario), else a skip the report shows; never
    an exception. ``patch``: called with the loaded GDN module before the
    scenarios run (the runtime plugin's in-memory patch): then only suites
    that prove a patched layer run, unless ``patchsets`` says otherwise.
    """
    if device.startswith("cpu"):
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from gdn_backport.harness.layer import activation_dtype

    dtype = activation_dtype(device)
    report = VerifyReport(
        tree=str(tree), site="", device=device, dtype=str(dtype).replace("torch.", "")
    )
    if device.startswith("cuda") and not torch.cuda.is_available():
        report.error = "device cuda requested but torch sees no CUDA device"
        return report
    names = None if scenarios is None else list(scenarios)
    suites = [(p, p.suite()) for p in registry.selected(patchsets)]
    suites = [(p, s) for p, s in suites if s is not None]
    if patch is not None and not patchsets:
        suites = [(p, s) for p, s in suites if s.patches_layer]
    known = {n for _, s in suites for n in s.names}
    unknown = [n for n in names or () if n not in known]
    if unknown:
        report.error = (
            f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
        return report
    for ps, suite in suites:
        mine = None if names is None else [n for n in names if n in suite.names]
        if mine == []:
            continue
        try:
            report.rows += suite.run(
                Path(tree),
                device,
                mine,
                seed=seed,
                heads=heads,
                self_consistency=self_consistency,
                patch=patch,
                report=report,
            )
        except SuiteError as exc:
            if patchsets or mine:
                report.error = f"{ps.info.id}: {exc}" if len(suites) > 1 else str(exc)
                return report
            report.skipped.append(f"{ps.info.id}: {exc}")
        if report.error:
            return report
    if not report.rows and not report.error:
        # Nothing could be driven: the skips say why, and it is an error.
        report.error = "; ".join(report.skipped) or "no scenario of the chosen patchsets was named"
    return report
