"""pr51565's scenarios and oracle, on a tree's REAL ``GDNAttentionMetadataBuilder``.

Each scenario is one step of requests (:class:`~.builder.Req`) handed to the
tree's own builder the way its runner hands them (:mod:`.builder`), whose
metadata then drives the tree's own layer (:mod:`gdn_backport.harness`).

The bug: a *new* request (num_computed 0) whose chunk is one token was
classified a decode by query length alone, and the decode kernels read its
state slot unconditionally, while slots are not zeroed when handed to a new
request. Oracle of the scenarios with a new request: its slot is filled with
large "previous owner" values; its output and the state it writes must equal
those of a run where the slot held zeros, and equal each other under two
different fillings; every other row's output and every other slot must be
unchanged versus the zeroed run. ``resumed_chunk_decode`` checks the other
side of the fix (a resumed one-token chunk stays a decode and reads its real
state: the float64 reference of :mod:`gdn_backport.harness.reference`),
``capture_dummy`` that the cudagraph-capture batch is still all decodes.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Sequence
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
from gdn_backport.harness.loader import HarnessError, LoadedTree
from gdn_backport.harness.reference import max_abs_err, reference_step
from gdn_backport.harness.result import ScenarioResult, tolerance
from gdn_backport.harness.suite import SuiteError, SuiteReport
from gdn_backport.site import Site, Status

# The underscored three are unused here: tests/test_builder_suite.py reads
# them from this module, as before they moved to .builder.
from .builder import (  # noqa: F401
    Req,
    StepPlan,
    _check_no_stubs,
    _literal_field_defaults,
    _slot_blocks,
    build_metadata,
    classification,
    load_builder_tree,
    make_builder,
    plan_step,
    supports_spec,
)

__all__ = [
    "BUILDER_SCENARIOS",
    "BUILDER_SUITE",
    "BuilderRunner",
    "BuilderScenario",
    "Req",
    "load_builder_tree",
    "run_builder_suite",
]


@dataclass(frozen=True)
class BuilderScenario:
    name: str
    reqs: tuple[Req, ...]
    num_spec: int = 0  # speculative_config.num_speculative_tokens (0: off)
    kind: str = "fresh"  # "fresh" | "resumed" | "capture"
    doc: str = ""

    def layout(self) -> str:
        return "[" + ", ".join(r.describe() for r in self.reqs) + "]"


def _decode(rid: int) -> Req:
    return Req(rid, prompt_len=6, num_computed=9, num_scheduled=1)


BUILDER_SCENARIOS: dict[str, BuilderScenario] = {
    s.name: s
    for s in (
        BuilderScenario(
            "new_one_token",
            (Req(0, prompt_len=1, num_computed=0, num_scheduled=1, fresh=True),),
            doc="a lone new request whose prompt is one token",
        ),
        BuilderScenario(
            "decode_plus_new",
            (_decode(0), Req(1, prompt_len=1, num_computed=0, num_scheduled=1, fresh=True)),
            doc="a decode beside a new one-token request",
        ),
        BuilderScenario(
            "first_chunk_one_token",
            (Req(0, prompt_len=8, num_computed=0, num_scheduled=1, fresh=True),),
            doc="a first prompt chunk cut to one token",
        ),
        BuilderScenario(
            "decode_new_prefill",
            (
                _decode(0),
                Req(1, prompt_len=1, num_computed=0, num_scheduled=1, fresh=True),
                Req(2, prompt_len=8, num_computed=0, num_scheduled=8),
            ),
            doc="decode + new one-token request + new 8-token prefill",
        ),
        BuilderScenario(
            "spec_plus_new",
            (
                Req(0, prompt_len=6, num_computed=10, num_scheduled=4, draft=3, num_accepted=2),
                Req(1, prompt_len=5, num_computed=12, num_scheduled=4, draft=3, num_accepted=4),
                Req(2, prompt_len=1, num_computed=0, num_scheduled=1, fresh=True),
            ),
            num_spec=3,
            doc="two spec rows (3 draft tokens) and a new one-token request",
        ),
        BuilderScenario(
            "resumed_chunk_decode",
            (Req(0, prompt_len=9, num_computed=5, num_scheduled=1),),
            kind="resumed",
            doc="a resumed one-token prompt chunk: a decode from its real state",
        ),
        BuilderScenario(
            "capture_dummy",
            tuple(Req(i, prompt_len=0, num_computed=0, num_scheduled=1) for i in range(3)),
            kind="capture",
            doc="the cudagraph-capture dummy batch: every row a decode",
        ),
    )
}


# --------------------------------------------------------------------------
# Running and judging
# --------------------------------------------------------------------------


@dataclass
class _Run:
    out: torch.Tensor
    tensors: LayerTensors
    metadata: Any


class BuilderRunner:
    """Runs the builder scenarios on one tree (see module docs)."""

    def __init__(
        self,
        loaded: LoadedTree,
        device: torch.device,
        shape: LayerShape | None = None,
        seed: int = 0,
    ) -> None:
        self.loaded = loaded
        self.device = device
        self.base_shape = shape or LayerShape(dtype=activation_dtype(device))
        self.seed = seed
        self.layout = ssm_layout(loaded)
        assert loaded.layer_class is not None
        self.reads = LayerReads.of(loaded.layer_class, loaded.site.method)
        self.tolerance = tolerance(self.base_shape.dtype)
        self._builders: dict[int, Any] = {}

    def builder(self, num_spec: int) -> Any:
        if num_spec not in self._builders:
            self._builders[num_spec] = make_builder(self.loaded, num_spec, self.device)
        return self._builders[num_spec]

    def shape(self, scenario: BuilderScenario) -> LayerShape:
        return dataclasses.replace(self.base_shape, num_spec=scenario.num_spec)

    def plan(self, builder: Any, scenario: BuilderScenario) -> StepPlan:
        capture = scenario.kind == "capture"
        return plan_step(
            self.loaded, builder, scenario.reqs, scenario.num_spec, self.device, capture
        )

    # -- one call of the real builder and the real layer ----------------------

    def run(
        self,
        builder: Any,
        plan: StepPlan,
        shape: LayerShape,
        tensors: LayerTensors,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> _Run:
        """Builder, then the layer's method on its metadata; mutates ``tensors``."""
        qkv, a, b = (t.clone() for t in inputs)
        metadata = build_metadata(self.loaded, builder, plan)
        out = shape.output(plan.num_tokens, self.device)
        with self.loaded.active():
            layer = build_layer(self.loaded, shape, tensors, self.reads)
            with forward_step(self.loaded, layer, metadata):
                run_method(self.loaded, layer, shape, qkv, b, a, out)
        return _Run(out=out, tensors=tensors, metadata=metadata)

    def _inputs(
        self, shape: LayerShape, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return step_inputs(shape, num_tokens, self.device, self.seed * 1000 + 7)

    # -- scenarios --------------------------------------------------------------

    def run_scenario(self, scenario: BuilderScenario) -> ScenarioResult:
        try:
            if scenario.num_spec:
                builder = self.builder(scenario.num_spec)
                if not supports_spec(builder):
                    return self._result(
                        scenario, {}, [], ["skipped: the builder has no spec decode"], True
                    )
            else:
                builder = self.builder(0)
            if scenario.kind == "capture":
                return self._capture(scenario, builder)
            if scenario.kind == "resumed":
                return self._resumed(scenario, builder)
            return self._fresh(scenario, builder)
        except HarnessError as exc:
            return self._result(scenario, {}, [f"harness: {exc}"], [], False)
        except Exception as exc:
            # The tree's own code raised on this batch (0.17's builder asserts
            # on a one-token row beside spec rows): a failure, with why.
            return self._result(
                scenario, {}, [f"raised {type(exc).__name__}: {exc}"[:300]], [], False
            )

    def _result(
        self,
        scenario: BuilderScenario,
        errors: dict[str, float],
        problems: list[str],
        notes: list[str],
        passed: bool | None = None,
    ) -> ScenarioResult:
        failed = [k for k, v in errors.items() if not v <= self.tolerance]
        if failed:
            problems = [
                "over tolerance: " + ", ".join(f"{k}={errors[k]:.3g}" for k in failed),
                *problems,
            ]
        ok = not problems if passed is None else passed and not problems
        return ScenarioResult(
            name=scenario.name,
            tag="builder",
            layout=scenario.layout(),
            max_abs_err=max(errors.values()) if errors else 0.0,
            tolerance=self.tolerance,
            passed=ok,
            note="; ".join(dict.fromkeys(problems + notes)),
            errors=errors,
        )

    def _fresh(self, scenario: BuilderScenario, builder: Any) -> ScenarioResult:
        shape = self.shape(scenario)
        plan = self.plan(builder, scenario)
        base = make_tensors(shape, plan.num_slots, self.layout, self.device, self.seed)
        inputs = self._inputs(shape, plan.num_tokens)
        fresh = [r for r in plan.reqs if r.fresh]
        fresh_slots = sorted({s for r in fresh for s in plan.blocks[r.rid]})
        state_slots = [plan.blocks[r.rid][0] for r in fresh]
        fresh_tokens = [t for r in fresh for t in plan.token_range(r.rid)]
        other_tokens = [t for t in range(plan.num_tokens) if t not in set(fresh_tokens)]
        other_slots = [s for s in range(plan.num_slots) if s not in set(fresh_slots)]

        def filled(fill: Callable[[LayerTensors, list[int]], None]) -> _Run:
            tensors = base.clone_pools()
            fill(tensors, fresh_slots)
            return self.run(builder, plan, shape, tensors, inputs)

        gen = torch.Generator(device=self.device).manual_seed(self.seed + 51565)

        def zeros(t: LayerTensors, slots: list[int]) -> None:
            t.conv_pool[slots] = 0
            t.ssm_pool[slots] = 0

        def owner_a(t: LayerTensors, slots: list[int]) -> None:
            t.conv_pool[slots] = 50.0
            t.ssm_pool[slots] = (
                torch.randn(t.ssm_pool[slots].shape, generator=gen, device=self.device) * 50
            ).to(t.ssm_pool.dtype)

        def owner_b(t: LayerTensors, slots: list[int]) -> None:
            t.conv_pool[slots] = (
                torch.randn(t.conv_pool[slots].shape, generator=gen, device=self.device) * 40
            ).to(t.conv_pool.dtype)
            t.ssm_pool[slots] = -30.0

        zero, run_a, run_b = filled(zeros), filled(owner_a), filled(owner_b)
        ft = torch.tensor(fresh_tokens, dtype=torch.long, device=self.device)
        ot = torch.tensor(other_tokens, dtype=torch.long, device=self.device)
        fs = torch.tensor(state_slots, dtype=torch.long, device=self.device)
        os_ = torch.tensor(other_slots, dtype=torch.long, device=self.device)
        hist = shape.conv_kernel - 1
        errors: dict[str, float] = {}
        for label, run in (("owner_a", run_a), ("owner_b", run_b)):
            pairs = {
                "new_out": (run.out[ft], zero.out[ft]),
                # The conv state a non-spec row writes and reads: its first W-1
                # positions (those after are spec-decode room, not written here).
                "new_conv": (run.tensors.conv_pool[fs, :hist], zero.tensors.conv_pool[fs, :hist]),
                "new_ssm": (run.tensors.ssm_pool[fs], zero.tensors.ssm_pool[fs]),
                "others_out": (run.out[ot], zero.out[ot]),
                "others_conv": (run.tensors.conv_pool[os_], zero.tensors.conv_pool[os_]),
                "others_ssm": (run.tensors.ssm_pool[os_], zero.tensors.ssm_pool[os_]),
            }
            for key, (x, y) in pairs.items():
                errors[f"{key}_{label}"] = max_abs_err(x, y)
        errors["new_out_a_vs_b"] = max_abs_err(run_a.out[ft], run_b.out[ft])
        errors["new_ssm_a_vs_b"] = max_abs_err(
            run_a.tensors.ssm_pool[fs], run_b.tensors.ssm_pool[fs]
        )
        notes = [f"builder: {classification(zero.metadata)}"]
        problems: list[str] = []
        bad = [k for k, v in errors.items() if not v <= self.tolerance]
        if any(k.startswith("new_") for k in bad):
            problems.append(
                "the new request's output/state depends on its slot's previous owner "
                "(stale state read)"
            )
        if any(k.startswith("others_") for k in bad):
            problems.append("other rows changed with the new request's slot contents")
        return self._result(scenario, errors, problems, notes)

    def _resumed(self, scenario: BuilderScenario, builder: Any) -> ScenarioResult:
        shape = self.shape(scenario)
        plan = self.plan(builder, scenario)
        tensors = make_tensors(shape, plan.num_slots, self.layout, self.device, self.seed)
        before = tensors.clone_pools()
        inputs = self._inputs(shape, plan.num_tokens)
        run = self.run(builder, plan, shape, tensors, inputs)
        batch = Batch(
            rows=tuple(
                Row(spec=r.spec, query_len=r.num_scheduled, has_initial_state=True, request=r.rid)
                for r in plan.reqs
            ),
            num_spec=max(scenario.num_spec, 1),
        )
        slots = SlotMap(num_spec=batch.num_spec, blocks=plan.blocks, num_slots=plan.num_slots)
        qkv, a, b = inputs
        expected = reference_step(shape, before, batch, slots, qkv, a, b)
        errors = {
            "ref_out": max_abs_err(run.out, expected.out),
            "ref_conv": max_abs_err(tensors.conv_pool, expected.conv_pool),
            "ref_ssm": max_abs_err(tensors.ssm_pool, expected.ssm_pool),
        }
        problems: list[str] = []
        want = sum(1 for r in plan.reqs if not r.spec)
        if getattr(run.metadata, "num_decodes", None) != want:
            problems.append(
                f"the resumed one-token chunk is not a decode ({classification(run.metadata)})"
            )
        notes = [f"builder: {classification(run.metadata)}"]
        return self._result(scenario, errors, problems, notes)

    def _capture(self, scenario: BuilderScenario, builder: Any) -> ScenarioResult:
        plan = self.plan(builder, scenario)
        has_capture = callable(getattr(builder, "build_for_cudagraph_capture", None))
        metadata = build_metadata(self.loaded, builder, plan, capture=True)
        n = len(plan.reqs)
        problems: list[str] = []
        if getattr(metadata, "num_decodes", None) != n or getattr(metadata, "num_prefills", 0):
            problems.append(
                f"capture batch of {n} rows not all decodes ({classification(metadata)})"
            )
        how = "build_for_cudagraph_capture" if has_capture else "build (capture-style metadata)"
        return self._result(scenario, {}, problems, [f"{how}: {classification(metadata)}"])


def run_builder_suite(
    tree: Path,
    device: str = "cpu",
    scenarios: Sequence[str] | None = None,
    shape: LayerShape | None = None,
    seed: int = 0,
) -> list[ScenarioResult]:
    """Run the builder scenarios (all, or those named) on ``tree`` (a root
    holding ``vllm/``, or that ``vllm/`` package itself). On CPU,
    ``TRITON_INTERPRET=1`` is set here if absent (before the tree's kernels
    are loaded; triton must not yet be imported without it)."""
    names = list(scenarios) if scenarios is not None else list(BUILDER_SCENARIOS)
    unknown = [n for n in names if n not in BUILDER_SCENARIOS]
    if unknown:
        raise HarnessError(
            f"unknown builder scenario(s) {', '.join(unknown)}; "
            f"known: {', '.join(BUILDER_SCENARIOS)}"
        )
    if device.startswith("cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # load_tree takes the vllm/ package itself too (its root is the tree).
    loaded = load_builder_tree(Path(tree), device)
    runner = BuilderRunner(loaded, torch.device(device), shape=shape, seed=seed)
    return [runner.run_scenario(BUILDER_SCENARIOS[n]) for n in names]


class BuilderSuite:
    """pr51565's scenarios on the tree's own metadata builder, then its layer
    with the builder's metadata (:class:`gdn_backport.verify.Suite`)."""

    names = tuple(BUILDER_SCENARIOS)
    patches_layer = False

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
        try:
            return run_builder_suite(tree, device, names, seed=seed)
        except HarnessError as exc:
            raise SuiteError(str(exc)) from exc

    def cell_scenarios(self, device: str) -> Sequence[str]:
        return self.names

    def expected_failures(
        self, names: Sequence[str], sites: Sequence[Site]
    ) -> tuple[frozenset[str], frozenset[str]]:
        """Where a builder is affected: the scenarios that read a recycled slot
        wherever a builder classifies by length alone must fail (the others
        pass on every release: a mixed batch before 0.23 takes the masked
        prefill path, spec rows and resumed chunks are fine); either result is
        right for a new one-token row beside a real prefill (stale state from
        0.23, where decodes are split off mixed batches, not before) and
        beside spec rows (stale before 0.18, a prefill after)."""
        builder = any(s.status is Status.AFFECTED and s.reason.startswith("builder") for s in sites)
        if not builder:
            return frozenset(), frozenset()
        chosen = set(names)
        return MUST_FAIL & chosen, MAY_FAIL & chosen


MUST_FAIL = frozenset({"new_one_token", "decode_plus_new", "first_chunk_one_token"})
MAY_FAIL = frozenset({"decode_new_prefill", "spec_plus_new"})
BUILDER_SUITE = BuilderSuite()
