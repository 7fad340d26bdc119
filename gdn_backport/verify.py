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

__all__ = ["ScenarioResult", "VerifyReport", "triton_problem", "verify_tree"]


@dataclass
class ScenarioResult:
    """One scenario's outcome: the worst error over its oracles (``errors``,
    by oracle) against the dtype's tolerance. Defined here, without torch,
    so that reports load where the suite cannot run (``matrix`` scans)."""

    name: str
    tag: str
    layout: str
    max_abs_err: float
    tolerance: float
    passed: bool
    note: str = ""
    errors: dict[str, float] = field(default_factory=dict)


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


# The first Triton that cannot run vLLM's FLA kernels: 3.9 removed block
# pointers (tl.make_block_ptr). pyproject's `kernels` extra pins triton below
# it; a test holds the two together.
TRITON_TOO_NEW = (3, 9)


def triton_problem() -> str:
    """Why the installed Triton cannot run vLLM's FLA kernels, or ""."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    from packaging.version import Version

    if Version(triton.__version__).release >= TRITON_TOO_NEW:
        bound = ".".join(map(str, TRITON_TOO_NEW))
        return (
            f"triton {triton.__version__} removed block pointers (tl.make_block_ptr), which "
            f"vLLM's FLA kernels use; install triton<{bound} (vLLM's releases pin 3.x <= 3.6)"
        )
    return ""


def _select(names: Iterable[str] | None) -> Sequence[object]:
    from gdn_backport.harness.scenarios import SCENARIOS, scenario

    if names is None:
        return SCENARIOS
    return [scenario(n) if isinstance(n, str) else n for n in names]


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
    """Run the suite on ``tree`` (a root holding ``vllm/``).

    ``scenarios``: names from :mod:`gdn_backport.harness.scenarios` (default:
    all of ``SCENARIOS``). ``heads``: (H, HV, K=V) of the layer, default the
    small CPU shape; e.g. (16, 64, 128) for a Qwen3.5 layer at TP=1. A tree
    the harness cannot load or drive gives a report with ``error`` set (exit
    code 2), never an exception. ``patch``: called with the loaded GDN module
    before the scenarios run (the runtime plugin's in-memory patch).
    ``patchsets``: whose suites run (default all): pr51812's mixed-batch
    scenarios on the layer, pr51565's on the tree's own metadata builder
    (:mod:`gdn_backport.harness.builder_suite`); ``scenarios`` may name
    either's.
    """
    if device.startswith("cpu"):
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    dtype = torch.float16 if device.startswith("cpu") else torch.bfloat16
    report = VerifyReport(
        tree=str(tree), site="", device=device, dtype=str(dtype).replace("torch.", "")
    )
    if device.startswith("cuda") and not torch.cuda.is_available():
        report.error = "device cuda requested but torch sees no CUDA device"
        return report
    from gdn_backport.harness.builder_suite import BUILDER_SCENARIOS

    names = None if scenarios is None else list(scenarios)
    builder_names = None if names is None else [n for n in names if n in BUILDER_SCENARIOS]
    layer_names = None if names is None else [n for n in names if n not in BUILDER_SCENARIOS]
    # ``patch`` is the plugin's in-memory patch of the layer: its suite only.
    default = {LAYER_PATCHSET} if patch is not None else {LAYER_PATCHSET, BUILDER_PATCHSET}
    want = set(patchsets) if patchsets else default
    if LAYER_PATCHSET in want and layer_names != []:
        _layer_rows(report, Path(tree), device, layer_names, self_consistency, seed, heads, patch)
    if BUILDER_PATCHSET in want and builder_names != [] and not report.error:
        _builder_rows(report, Path(tree), device, builder_names, seed, explicit=bool(patchsets))
    if not report.rows and not report.error and not report.skipped:
        report.error = "no scenario of the chosen patchsets was named"
    return report


def _layer_rows(
    report: VerifyReport,
    tree: Path,
    device: str,
    layer_names: Sequence[str] | None,
    self_consistency: bool,
    seed: int,
    heads: tuple[int, int, int] | None,
    patch: Callable[[types.ModuleType], object] | None,
) -> None:
    """pr51812's mixed-batch scenarios on the tree's GDN layer, into ``report``."""
    import torch

    from gdn_backport.harness.layer import LayerShape
    from gdn_backport.harness.loader import HarnessError, load_tree
    from gdn_backport.harness.suite import SuiteRunner

    dtype = torch.float16 if device.startswith("cpu") else torch.bfloat16
    try:
        selected = _select(layer_names)
        loaded = load_tree(Path(tree), device=device)
        report.site = str(loaded.site)
        if patch is not None and loaded.module is not None:
            patch(loaded.module)
        problem = triton_problem()
        if problem:
            report.error = problem
            return
        shape = LayerShape(dtype=dtype)
        if heads is not None:
            h, hv, dim = heads
            shape = LayerShape(
                num_k_heads=h, num_v_heads=hv, head_k_dim=dim, head_v_dim=dim, dtype=dtype
            )
        runner = SuiteRunner(loaded, shape, torch.device(device), seed=seed)
        for item in selected:
            try:
                result = runner.run(item, self_consistency=self_consistency)  # type: ignore[arg-type]
            except HarnessError:
                raise
            except Exception as exc:
                # The tree's own code raised on this batch: a failure, with why.
                report.rows.append(
                    ScenarioResult(
                        name=item.name,  # type: ignore[attr-defined]
                        tag=item.tag,  # type: ignore[attr-defined]
                        layout=item.layout(),  # type: ignore[attr-defined]
                        max_abs_err=float("inf"),
                        tolerance=runner.tolerance,
                        passed=False,
                        note=f"raised {type(exc).__name__}: {exc}"[:300],
                    )
                )
                continue
            report.rows.append(result)
    except (HarnessError, KeyError) as exc:
        report.error = str(exc)


LAYER_PATCHSET = "pr51812"
BUILDER_PATCHSET = "pr51565"


def _builder_rows(
    report: VerifyReport,
    tree: Path,
    device: str,
    names: Sequence[str] | None,
    seed: int,
    explicit: bool,
) -> None:
    """pr51565's scenarios on the tree's own builder, into ``report``. A tree
    without a GDN builder: an error when pr51565 was asked for by name, else
    a skip the report shows."""
    from gdn_backport.harness.builder_suite import run_builder_suite
    from gdn_backport.harness.loader import HarnessError

    try:
        rows = run_builder_suite(tree, device, names, seed=seed)
    except HarnessError as exc:
        if explicit or names:
            report.error = f"{BUILDER_PATCHSET}: {exc}"
        else:
            report.skipped.append(f"{BUILDER_PATCHSET}: {exc}")
        return
    report.rows += rows
