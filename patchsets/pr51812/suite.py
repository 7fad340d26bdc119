"""Run scenarios on a loaded tree against two oracles.

1. The float64 reference (:mod:`.reference`): per-token core output and the
   whole conv and SSM pools after each step, so every state the step wrote
   and every slot it must not touch are checked together.
2. Self-consistency: each request of a mixed batch run alone through the
   same method and kernels, from the same pools; its tokens' output and its
   slots must match the mixed run.

Besides the numbers: the gate tensors must come back unchanged, and where
the spec call of ``fused_sigmoid_gating_delta_rule_update`` is seen, its
gate rows are matched against the input to say which tokens' gates it got
(the diagnosis of vLLM #51812) and, in the pure-spec fast path, whether it
got the caller's tensors without a copy.

Tolerances (absolute; inputs are exactly representable in the activation
dtype and the reference rounds the conv output the way the kernels store
it, so what is left is the kernels' float32 arithmetic, the rounding of the
output to the activation dtype and the chunk kernels' half-precision
intermediates): float16 0.02, bfloat16 0.06 (3 more mantissa bits lost),
float32 0.005 (TF32 dot products on GPU). Outputs and states are O(1); the
misaligned-gate bug moves them by O(0.1-1), 10x and more above these.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gdn_backport.harness.batch import Batch, Row, SlotMap
from gdn_backport.harness.layer import (
    LayerReads,
    LayerShape,
    LayerTensors,
    activation_dtype,
    build_layer,
    forward_step,
    make_tensors,
    run_method,
    ssm_layout,
    step_inputs,
)
from gdn_backport.harness.loader import LoadedTree
from gdn_backport.harness.reference import max_abs_err, reference_step
from gdn_backport.harness.result import ScenarioResult, tolerance
from gdn_backport.harness.suite import SuiteError, SuiteReport, triton_problem
from gdn_backport.site import Site, Status

from .metadata import build_metadata, metadata_fields
from .scenarios import Scenario

__all__ = ["ScenarioResult", "SuiteRunner"]

_SPEC_KERNELS = (
    "fused_sigmoid_gating_delta_rule_update",
    "fused_recurrent_gated_delta_rule",
    # gdn-backport's own op (apply --strategy kernel): gathers the gates itself.
    "gated_delta_rule_spec_update",
)
_GATE_KERNELS = (_SPEC_KERNELS[0], _SPEC_KERNELS[2])


@dataclass
class _Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class _StepRun:
    out: torch.Tensor
    calls: list[_Call]


def _short(items: list[int], limit: int = 8) -> str:
    if len(items) <= limit:
        return "(" + ", ".join(map(str, items)) + ")"
    return "(" + ", ".join(map(str, items[:limit])) + f", ... {len(items)} in all)"


class SuiteRunner:
    """Runs scenarios on one loaded tree (see module docs)."""

    def __init__(
        self, loaded: LoadedTree, shape: LayerShape, device: torch.device, seed: int = 0
    ) -> None:
        self.loaded = loaded
        self.shape = shape
        self.device = device
        self.seed = seed
        self.fields = metadata_fields(loaded)
        self.layout = ssm_layout(loaded)
        # Read from the class's source once per runner, not once per step.
        assert loaded.layer_class is not None
        self.reads = LayerReads.of(loaded.layer_class, loaded.site.method)
        self.tolerance = tolerance(shape.dtype)

    # -- running the tree's method ------------------------------------------

    @contextlib.contextmanager
    def _spy(self) -> Iterator[list[_Call]]:
        assert self.loaded.module is not None
        namespace = self.loaded.module.__dict__
        calls: list[_Call] = []
        saved: dict[str, Callable[..., Any]] = {}
        for name in _SPEC_KERNELS:
            original = namespace.get(name)
            if not callable(original):
                continue
            saved[name] = original

            def spy(*args: Any, _name: str = name, _fn: Any = original, **kwargs: Any) -> Any:
                calls.append(_Call(_name, args, dict(kwargs)))
                return _fn(*args, **kwargs)

            namespace[name] = functools.wraps(original)(spy)
        try:
            yield calls
        finally:
            namespace.update(saved)

    def run_step(
        self,
        tensors: LayerTensors,
        batch: Batch,
        slots: SlotMap,
        qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> _StepRun:
        """One call of the tree's site method; mutates the pools in ``tensors``."""
        out = self.shape.output(batch.num_tokens, self.device)
        with self.loaded.active():
            layer = build_layer(self.loaded, self.shape, tensors, self.reads)
            metadata = build_metadata(self.loaded, batch, slots, self.device, self.fields)
            with forward_step(self.loaded, layer, metadata), self._spy() as calls:
                run_method(self.loaded, layer, self.shape, qkv, b, a, out)
        return _StepRun(out=out, calls=calls)

    # -- inputs ---------------------------------------------------------------

    def _inputs(
        self, batch: Batch, step: int, strided: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seed = self.seed * 1000 + 17 * step + 1
        return step_inputs(self.shape, batch.num_tokens, self.device, seed, strided)

    # -- oracles --------------------------------------------------------------

    def _self_consistency(
        self,
        before: LayerTensors,
        after: LayerTensors,
        batch: Batch,
        slots: SlotMap,
        run: _StepRun,
        qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> dict[str, float]:
        errs = {"alone_out": 0.0, "alone_conv": 0.0, "alone_ssm": 0.0}
        for rid, row, tokens in zip(
            batch.request_ids(), batch.rows, batch.token_ranges(), strict=True
        ):
            alone = before.clone_pools()
            single = Batch(rows=(Row(**{**row.__dict__, "request": rid}),), num_spec=batch.num_spec)
            idx = torch.tensor(list(tokens), device=self.device)
            solo = self.run_step(
                alone, single, slots, qkv[idx], a[idx].contiguous(), b[idx].contiguous()
            )
            own = torch.tensor(slots.blocks[rid], device=self.device, dtype=torch.long)
            errs["alone_out"] = max(
                errs["alone_out"], max_abs_err(run.out[idx], solo.out.to(torch.float64))
            )
            errs["alone_conv"] = max(
                errs["alone_conv"],
                max_abs_err(after.conv_pool[own], alone.conv_pool[own].to(torch.float64)),
            )
            errs["alone_ssm"] = max(
                errs["alone_ssm"],
                max_abs_err(after.ssm_pool[own], alone.ssm_pool[own].to(torch.float64)),
            )
        return errs

    def _diagnose(
        self, run: _StepRun, batch: Batch, a: torch.Tensor, notes: list[str], problems: list[str]
    ) -> None:
        """Which tokens' gates the spec kernel call got; zero-copy in the fast path."""
        spec = [
            c
            for c in run.calls
            if c.name in _GATE_KERNELS and c.kwargs.get("num_accepted_tokens") is not None
        ]
        if not spec or not isinstance(spec[0].kwargs.get("a"), torch.Tensor):
            return
        passed = spec[0].kwargs["a"]
        index = spec[0].kwargs.get("spec_token_indx")
        # Our op reads row index[t] for spec token t; vLLM's kernel row t.
        got = passed.index_select(0, index.long()) if isinstance(index, torch.Tensor) else passed
        expected = batch.spec_token_indx()
        # The kernel reads one gate row per spec token, from the top.
        rows = []
        for r in range(min(got.shape[0], len(expected))):
            match = (a == got[r]).all(dim=-1).nonzero().flatten().tolist()
            rows.append(match[0] if len(match) == 1 else -1)
        if rows != expected:
            problems.append(
                f"spec kernel read the gates of tokens {_short(rows)}, "
                f"the spec tokens are {_short(expected)}"
            )
        pure = all(row.spec for row in batch.rows)
        if pure:
            same = passed.data_ptr() == a.data_ptr() and index is None
            notes.append("zero-copy gates" if same else "gates copied")
            if not same:
                problems.append("pure-spec fast path copied the gates (upstream aliases them)")

    # -- a scenario -----------------------------------------------------------

    def run(self, scenario: Scenario, self_consistency: bool = True) -> ScenarioResult:
        slots = SlotMap.for_steps(list(scenario.steps))
        tensors = make_tensors(self.shape, slots.num_slots, self.layout, self.device, self.seed)
        errors: dict[str, float] = {}
        notes: list[str] = []
        problems: list[str] = []
        for step, batch in enumerate(scenario.steps):
            qkv, a, b = self._inputs(batch, step, scenario.strided_gates)
            # The pure-spec path convolves mixed_qkv in place (as in vLLM):
            # the oracles get a snapshot of the inputs.
            qkv_in, a_before, b_before = qkv.clone(), a.clone(), b.clone()
            before = tensors.clone_pools()
            expected = reference_step(self.shape, before, batch, slots, qkv, a, b)
            run = self.run_step(tensors, batch, slots, qkv, a, b)
            step_errs = {
                "ref_out": max_abs_err(run.out, expected.out),
                "ref_conv": max_abs_err(tensors.conv_pool, expected.conv_pool),
                "ref_ssm": max_abs_err(tensors.ssm_pool, expected.ssm_pool),
            }
            if self_consistency and len(batch.rows) > 1:
                step_errs |= self._self_consistency(
                    before, tensors, batch, slots, run, qkv_in, a_before, b_before
                )
            if not (torch.equal(a, a_before) and torch.equal(b, b_before)):
                problems.append(f"step {step}: the gate tensors were modified")
            self._diagnose(run, batch, a, notes, problems)
            for key, value in step_errs.items():
                errors[key] = max(errors.get(key, 0.0), value)
        worst = max(errors.values()) if errors else 0.0
        failed = [k for k, v in errors.items() if not v <= self.tolerance]
        if failed:
            problems.insert(
                0, "over tolerance: " + ", ".join(f"{k}={errors[k]:.3g}" for k in failed)
            )
        passed = not problems
        note = "; ".join(dict.fromkeys(problems + notes))
        return ScenarioResult(
            name=scenario.name,
            tag=scenario.tag,
            layout=scenario.layout(),
            max_abs_err=worst,
            tolerance=self.tolerance,
            passed=passed,
            note=note,
            errors=errors,
        )


class LayerSuite:
    """pr51812's mixed-batch scenarios on the tree's own GDN layer and kernels
    (:class:`gdn_backport.verify.Suite`)."""

    patches_layer = True

    @property
    def names(self) -> tuple[str, ...]:
        from .scenarios import EXTRA_SCENARIOS, SCENARIOS

        return tuple(s.name for s in (*SCENARIOS, *EXTRA_SCENARIOS))

    def run(
        self,
        tree: Path,
        device: str,
        names: Sequence[str] | None,
        *,
        seed: int,
        heads: tuple[int, int, int] | None,
        self_consistency: bool,
        patch: Callable[[types.ModuleType], object] | None,
        report: SuiteReport,
    ) -> list[ScenarioResult]:
        from gdn_backport.harness.layer import LayerShape
        from gdn_backport.harness.loader import HarnessError, load_tree

        from .scenarios import SCENARIOS, scenario

        dtype = activation_dtype(device)
        selected = SCENARIOS if names is None else tuple(scenario(n) for n in names)
        try:
            loaded = load_tree(Path(tree), device=device)
        except HarnessError as exc:
            raise SuiteError(str(exc)) from exc
        report.site = str(loaded.site)
        if patch is not None and loaded.module is not None:
            patch(loaded.module)
        problem = triton_problem()
        if problem:
            report.error = problem
            return []
        shape = LayerShape(dtype=dtype)
        if heads is not None:
            h, hv, dim = heads
            shape = LayerShape(
                num_k_heads=h, num_v_heads=hv, head_k_dim=dim, head_v_dim=dim, dtype=dtype
            )
        runner = SuiteRunner(loaded, shape, torch.device(device), seed=seed)
        rows: list[ScenarioResult] = []
        for item in selected:
            try:
                rows.append(runner.run(item, self_consistency=self_consistency))
            except HarnessError as exc:
                report.error = str(exc)
                return rows
            except Exception as exc:
                # The tree's own code raised on this batch: a failure, with why.
                rows.append(
                    ScenarioResult(
                        name=item.name,
                        tag=item.tag,
                        layout=item.layout(),
                        max_abs_err=float("inf"),
                        tolerance=runner.tolerance,
                        passed=False,
                        note=f"raised {type(exc).__name__}: {exc}"[:300],
                    )
                )
        return rows

    def cell_scenarios(self, device: str) -> Sequence[str]:
        """Every scenario on the GPU; the small CI set on the CPU interpreter."""
        from .scenarios import CI_SCENARIOS, SCENARIOS

        return tuple(s.name for s in SCENARIOS) if device == "cuda" else CI_SCENARIOS

    def expected_failures(
        self, names: Sequence[str], sites: Sequence[Site]
    ) -> tuple[frozenset[str], frozenset[str]]:
        from .scenarios import scenario

        if not any(s.status is Status.AFFECTED for s in sites):
            return frozenset(), frozenset()
        return frozenset(n for n in names if scenario(n).expect_unpatched == "fail"), frozenset()


LAYER_SUITE = LayerSuite()
