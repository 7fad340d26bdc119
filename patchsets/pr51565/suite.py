"""Scenarios on a tree's REAL ``GDNAttentionMetadataBuilder`` (vLLM #51565).

The other suite (:mod:`.suite`) synthesises the metadata ``_forward_core``
reads. This one asks the tree's own builder for it: the tree's
``vllm.v1.attention.backend``, ``vllm.v1.attention.backends.utils`` and
``vllm.v1.attention.backends.gdn_attn`` are loaded from source into a
private :class:`~.loader.LoadedTree` (beside its GDN layer and kernels),
the builder is constructed by its own ``__init__`` from a stand-in config
(FULL cudagraphs off, speculative decoding only where a scenario needs it),
and each step's ``CommonAttentionMetadata`` is made the way the V1 runner
makes it: rows ordered by the tree's own
``reorder_batch_to_split_decodes_and_prefills``, ``seq_lens_cpu_upper_bound``
= num_computed + num_scheduled, ``is_prefilling`` = num_computed <
num_prompt_tokens, one state block per request in the block table. Which
fields to fill is read from the tree's dataclass (a required field without a
rule here fails with its name). The builder's output then drives the
layer's ``_forward_core`` (:func:`.layer.run_method`).

The bug: a *new* request (num_computed 0) whose chunk is one token was
classified a decode by query length alone, and the decode kernels read its
state slot unconditionally, while slots are not zeroed when handed to a new
request. Oracle of the scenarios with a new request: its slot is filled with
large "previous owner" values; its output and the state it writes must equal
those of a run where the slot held zeros, and equal each other under two
different fillings; every other row's output and every other slot must be
unchanged versus the zeroed run. ``resumed_chunk_decode`` checks the other
side of the fix (a resumed one-token chunk stays a decode and reads its real
state: float64 reference of :mod:`.reference`), ``capture_dummy`` that the
cudagraph-capture batch is still all decodes.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gdn_backport.harness.batch import Batch, Row, SlotMap
from gdn_backport.harness.layer import (
    PREFIX,
    LayerReads,
    LayerShape,
    LayerTensors,
    build_layer,
    make_tensors,
    run_method,
    ssm_layout,
)
from gdn_backport.harness.loader import HarnessError, LoadedTree, load_tree
from gdn_backport.harness.reference import reference_step
from gdn_backport.harness.result import ScenarioResult, tolerance
from gdn_backport.harness.standins import _ConfigNode, is_stub
from gdn_backport.harness.suite import SuiteError, SuiteReport
from gdn_backport.site import Site, Status

__all__ = [
    "BUILDER_SCENARIOS",
    "BuilderRunner",
    "BuilderScenario",
    "Req",
    "load_builder_tree",
    "run_builder_suite",
]

# The tree's modules the builder needs, loaded from source (in this order:
# later ones import the earlier). A missing file is skipped (older layouts).
_BUILDER_MODULES = (
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends.utils",
    # Prefill checkpoints (0.33+): the builder calls its builder, which says
    # "none" unless mamba_cache_mode is "align".
    "vllm.model_executor.layers.mamba.checkpoint",
    "vllm.v1.attention.backends.gdn_attn",
)
_GDN_ATTN = _BUILDER_MODULES[-1]
_MAX_NUM_SEQS = 16
_BLOCK_SIZE = 16


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    """One request of a step, as the scheduler and the input batch see it.

    ``draft``: draft tokens scheduled for it (a spec row has
    ``num_scheduled == draft + 1``), -1 for none. ``fresh``: the request under
    test, whose state slot still holds a previous owner's values.
    """

    rid: int
    prompt_len: int
    num_computed: int
    num_scheduled: int
    draft: int = -1
    num_accepted: int = 1
    fresh: bool = False

    @property
    def spec(self) -> bool:
        return self.draft >= 0 and self.num_scheduled == self.draft + 1

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    def describe(self) -> str:
        if self.prompt_len == 0:
            kind = "dummy"
        else:
            kind = "S" if self.spec else ("new" if self.num_computed == 0 else "N")
        return f"{kind}{self.num_scheduled}({self.num_computed}/{self.prompt_len})"


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
# Loading the tree's builder
# --------------------------------------------------------------------------


def _load_source_module(loaded: LoadedTree, name: str) -> types.ModuleType | None:
    base = loaded.tree.joinpath(*name.split("."))
    path = base.with_suffix(".py")
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
        raise
    loaded.real.add(name)
    return module


# Helpers the builder path calls that the layer's stand-ins do not provide
# (the builder's modules run; the layer's only import names): the tree's
# own behaviour without pinned memory.
_SUPPLEMENTS: dict[str, dict[str, Any]] = {
    "vllm.utils.torch_utils": {"np_to_pinned_tensor": torch.from_numpy},
}


def _supplement(loaded: LoadedTree) -> None:
    for name, attrs in _SUPPLEMENTS.items():
        module = importlib.import_module(name)
        for attr, value in attrs.items():
            current = module.__dict__.get(attr)
            if current is None or is_stub(current):
                module.__dict__[attr] = value


def load_builder_tree(tree: Path, device: str = "cpu") -> LoadedTree:
    """:func:`.loader.load_tree`, plus the tree's own metadata builder modules
    in place of their stand-ins (see module docs). The GDN module's
    ``GDNAttentionMetadata`` is rebound to the real class, which its
    ``_forward_core`` asserts on."""
    loaded = load_tree(tree, device)
    standin = (loaded.module.__dict__ if loaded.module else {}).get("GDNAttentionMetadata")
    with loaded.active():
        _supplement(loaded)
        for name in _BUILDER_MODULES:
            try:
                _load_source_module(loaded, name)
            except Exception as exc:
                raise HarnessError(
                    f"{loaded.tree}: cannot import {name} from source with the harness "
                    f"stand-ins: {type(exc).__name__}: {exc}"
                ) from exc
        gdn_attn = sys.modules.get(_GDN_ATTN)
    if gdn_attn is None or not isinstance(
        getattr(gdn_attn, "GDNAttentionMetadataBuilder", None), type
    ):
        raise HarnessError(f"{loaded.tree}: no GDNAttentionMetadataBuilder in {_GDN_ATTN}")
    real_cls = gdn_attn.GDNAttentionMetadata
    for module in loaded.modules.values():
        if standin is not None and module.__dict__.get("GDNAttentionMetadata") is standin:
            module.__dict__["GDNAttentionMetadata"] = real_cls
    return loaded


class _CudagraphMode:
    """``compilation_config.cudagraph_mode``: NONE (FULL cudagraphs off)."""

    name = "NONE"

    def has_full_cudagraphs(self) -> bool:
        return False

    def has_piecewise_cudagraphs(self) -> bool:
        return False

    def __bool__(self) -> bool:
        return False


def _vllm_config(num_spec: int) -> _ConfigNode:
    """The config the builder's ``__init__`` reads; a missing field names its path."""
    model = "vllm_config.model_config"
    spec = (
        _ConfigNode(
            "vllm_config.speculative_config",
            num_speculative_tokens=num_spec,
            parallel_drafting=False,
            method="mtp",
            disable_padded_drafter_batch=False,
            use_eagle_block_drop=lambda: False,
        )
        if num_spec
        else None
    )
    return _ConfigNode(
        "vllm_config",
        additional_config={"gdn_prefill_backend": "triton"},
        model_config=_ConfigNode(
            model,
            hf_config=_ConfigNode(f"{model}.hf_config"),
            hf_text_config=_ConfigNode(f"{model}.hf_text_config"),
            max_model_len=4096,
        ),
        speculative_config=spec,
        cache_config=_ConfigNode(
            "vllm_config.cache_config", mamba_cache_mode="none", block_size=_BLOCK_SIZE
        ),
        compilation_config=_ConfigNode(
            "vllm_config.compilation_config",
            cudagraph_mode=_CudagraphMode(),
            # Only sizes the persistent decode buffers (FULL graphs are off).
            max_cudagraph_capture_size=512,
            max_capture_size=512,  # its name before 0.11
            cudagraph_capture_sizes=[],
            full_cuda_graph=False,
        ),
        scheduler_config=_ConfigNode(
            "vllm_config.scheduler_config",
            max_num_seqs=_MAX_NUM_SEQS,
            max_num_batched_tokens=2048,
        ),
        parallel_config=_ConfigNode(
            "vllm_config.parallel_config",
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
            tensor_parallel_size=1,
        ),
        use_v2_model_runner=False,
        num_hash_lookahead_tokens=0,
    )


def _literal_field_defaults(path: Path, class_name: str) -> dict[str, Any]:
    """``name: T = <literal>`` defaults of a class in a tree file, bases (in
    the same file) first."""
    if not path.is_file():
        return {}
    classes = {
        node.name: node
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
    }
    found: dict[str, Any] = {}

    def visit(name: str, seen: set[str]) -> None:
        node = classes.get(name)
        if node is None or name in seen:
            return
        seen.add(name)
        for base in node.bases:
            if isinstance(base, ast.Name):
                visit(base.id, seen)
        for item in node.body:
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and item.value is not None
            ):
                with contextlib.suppress(ValueError, TypeError, SyntaxError, RecursionError):
                    found[item.target.id] = ast.literal_eval(item.value)

    visit(class_name, set())
    return found


def _kv_cache_spec(loaded: LoadedTree, gdn_attn: types.ModuleType, num_spec: int) -> Any:
    """A ``MambaSpec`` the builder's ``isinstance`` checks accept (the class as
    the gdn_attn module imported it: an auto-stub, subclassed into a plain
    class), holding the literal defaults of the tree's own ``MambaSpec``
    (features off: no prefill checkpoints) and the harness's block layout."""
    path = loaded.tree / "vllm" / "v1" / "kv_cache_interface.py"
    fields = _literal_field_defaults(path, "MambaSpec")
    fields.update(
        block_size=_BLOCK_SIZE,
        num_speculative_blocks=num_spec,
        mamba_cache_mode="none",
    )
    spec_cls = gdn_attn.__dict__.get("MambaSpec")
    if isinstance(spec_cls, type) and is_stub(spec_cls):
        cls = type("MambaSpec", (spec_cls,), {"__qualname__": "MambaSpec"})
        obj = cls()
        for key, value in fields.items():
            setattr(obj, key, value)
        return obj
    return types.SimpleNamespace(**fields)


def make_builder(loaded: LoadedTree, num_spec: int, device: torch.device) -> Any:
    """The tree's ``GDNAttentionMetadataBuilder``, built by its own ``__init__``."""
    gdn_attn = loaded.modules.get(_GDN_ATTN)
    assert gdn_attn is not None
    cls = gdn_attn.GDNAttentionMetadataBuilder
    with loaded.active():
        try:
            builder = cls(
                _kv_cache_spec(loaded, gdn_attn, num_spec), [PREFIX], _vllm_config(num_spec), device
            )
        except Exception as exc:
            raise HarnessError(
                f"{loaded.tree}: GDNAttentionMetadataBuilder.__init__ failed on the "
                f"harness config: {type(exc).__name__}: {exc}"
            ) from exc
    if getattr(builder, "use_full_cuda_graph", False):
        raise HarnessError(f"{loaded.tree}: the builder turned FULL cudagraphs on")
    return builder


# --------------------------------------------------------------------------
# The runner's CommonAttentionMetadata
# --------------------------------------------------------------------------


class _InputBatch:
    """What ``reorder_batch_to_split_decodes_and_prefills`` reads and swaps."""

    def __init__(self, reqs: Sequence[Req]) -> None:
        self.reqs = list(reqs)
        self.req_ids = [str(r.rid) for r in self.reqs]
        self.num_computed_tokens_cpu = np.array([r.num_computed for r in self.reqs])
        self.num_prompt_tokens = np.array([r.prompt_len for r in self.reqs])

    def swap_states(self, i: int, j: int) -> None:
        self.reqs[i], self.reqs[j] = self.reqs[j], self.reqs[i]
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        for arr in (self.num_computed_tokens_cpu, self.num_prompt_tokens):
            arr[[i, j]] = arr[[j, i]]


def runner_order(loaded: LoadedTree, builder: Any, reqs: Sequence[Req]) -> list[Req]:
    """The rows in the order the tree's runner puts them (its own reorder
    function, with the builder's ``reorder_batch_threshold``)."""
    utils = loaded.modules.get("vllm.v1.attention.backends.utils")
    reorder = getattr(utils, "reorder_batch_to_split_decodes_and_prefills", None)
    threshold = getattr(builder, "reorder_batch_threshold", None)
    if not callable(reorder) or threshold is None:
        return list(reqs)
    batch = _InputBatch(reqs)
    scheduled = types.SimpleNamespace(
        num_scheduled_tokens={str(r.rid): r.num_scheduled for r in reqs}
    )
    with loaded.active():
        reorder(batch, scheduled, decode_threshold=threshold)
    return batch.reqs


@dataclass
class StepPlan:
    """One step: rows in runner order, their state blocks, the builder's inputs."""

    reqs: list[Req]
    blocks: dict[int, list[int]]
    num_slots: int
    common: Any
    build_kwargs: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_scheduled for r in self.reqs)

    def token_range(self, rid: int) -> range:
        start = 0
        for r in self.reqs:
            if r.rid == rid:
                return range(start, start + r.num_scheduled)
            start += r.num_scheduled
        raise KeyError(rid)


def _slot_blocks(
    reqs: Sequence[Req], width: int, spare: int = 3
) -> tuple[dict[int, list[int]], int]:
    """A block of ``width`` slots per request, handed out back to front with
    spares between the first blocks (slot 0 is the null block)."""
    total = 1 + width * len(reqs) + spare
    order = list(range(total - 1, 0, -1))
    spares = set(order[1 : 1 + 2 * spare : 2])
    free = [s for s in order if s not in spares]
    blocks: dict[int, list[int]] = {}
    for r in sorted(reqs, key=lambda r: r.rid):
        blocks[r.rid], free = free[:width], free[width:]
    return blocks, total


def common_metadata(
    loaded: LoadedTree,
    reqs: Sequence[Req],
    blocks: dict[int, list[int]],
    device: torch.device,
    capture: bool = False,
) -> Any:
    """The tree's ``CommonAttentionMetadata`` for these rows, filled the way
    its V1 runner fills it (``_build_attention_metadata``); only the fields
    the tree's dataclass declares are given."""
    backend = loaded.modules.get("vllm.v1.attention.backend")
    utils = loaded.modules.get("vllm.v1.attention.backends.utils")
    cls = getattr(backend, "CommonAttentionMetadata", None) or getattr(
        utils, "CommonAttentionMetadata", None
    )
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise HarnessError(f"{loaded.tree}: no CommonAttentionMetadata dataclass")
    i32 = torch.int32
    qlens = [r.num_scheduled for r in reqs]
    computed = torch.tensor([r.num_computed for r in reqs], dtype=i32)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=i32)
    seq_lens = computed + torch.tensor(qlens, dtype=i32)
    # The capture dummy batch: num_computed 0 == num_prompt 0, so no row is prefilling.
    prefilling = torch.tensor([r.prefilling for r in reqs], dtype=torch.bool)
    positions = torch.cat(
        [torch.arange(r.num_computed, r.num_computed + r.num_scheduled) for r in reqs]
    )
    table = torch.tensor([blocks[r.rid] for r in reqs], dtype=i32)
    num_tokens = sum(qlens)
    values: dict[str, Any] = {
        "query_start_loc": qsl.to(device),
        "query_start_loc_cpu": qsl,
        "seq_lens": seq_lens.to(device),
        "seq_lens_cpu": seq_lens,
        "_seq_lens_cpu": seq_lens,
        "num_computed_tokens_cpu": computed,
        "_num_computed_tokens_cpu": computed,
        "seq_lens_cpu_upper_bound": seq_lens,
        "num_reqs": len(reqs),
        "num_actual_tokens": num_tokens,
        "max_query_len": max(qlens),
        "max_seq_len": 4096 if capture else int(seq_lens.max()),
        "block_table_tensor": table.to(device),
        # Attention layers' KV slots; the mamba path does not read them.
        "slot_mapping": torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        "causal": True,
        "is_prefilling": prefilling,
        "positions": positions.to(device),
    }
    kwargs: dict[str, Any] = {}
    missing: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = values[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    if missing:
        raise HarnessError(
            f"{loaded.tree}: CommonAttentionMetadata requires {', '.join(missing)}, "
            "which the harness does not know how to fill"
        )
    return cls(**kwargs)


def _build_params(builder: Any) -> set[str]:
    return set(inspect.signature(builder.build).parameters)


def supports_spec(builder: Any) -> bool:
    return "num_decode_draft_tokens_cpu" in _build_params(builder) and bool(
        getattr(builder, "use_spec_decode", False)
    )


def plan_step(
    loaded: LoadedTree, builder: Any, scenario: BuilderScenario, device: torch.device
) -> StepPlan:
    reqs = (
        list(scenario.reqs)
        if scenario.kind == "capture"
        else runner_order(loaded, builder, scenario.reqs)
    )
    blocks, num_slots = _slot_blocks(reqs, scenario.num_spec + 1)
    common = common_metadata(loaded, reqs, blocks, device, capture=scenario.kind == "capture")
    kwargs: dict[str, Any] = {}
    if getattr(builder, "use_spec_decode", False):
        params = _build_params(builder)
        # The runner's buffers: accepted counts per row, and the draft count of
        # each row scheduled as 1 + its drafts (-1 for the others).
        if "num_accepted_tokens" in params:
            kwargs["num_accepted_tokens"] = torch.tensor(
                [r.num_accepted for r in reqs], dtype=torch.int32, device=device
            )
        if "num_decode_draft_tokens_cpu" in params:
            kwargs["num_decode_draft_tokens_cpu"] = torch.tensor(
                [r.draft if r.spec else -1 for r in reqs], dtype=torch.int32
            )
    return StepPlan(reqs, blocks, num_slots, common, kwargs)


def _check_no_stubs(loaded: LoadedTree, metadata: Any) -> None:
    """A field valued by an auto-stub means the builder called a helper the
    harness did not load from source: refuse rather than run on it."""
    if not dataclasses.is_dataclass(metadata):
        raise HarnessError(f"{loaded.tree}: the builder returned {type(metadata).__name__}")
    stubbed = [
        f.name for f in dataclasses.fields(metadata) if is_stub(getattr(metadata, f.name, None))
    ]
    if stubbed:
        raise HarnessError(
            f"{loaded.tree}: the builder's metadata field(s) {', '.join(stubbed)} came "
            "from auto-stubbed helpers (not loaded from the tree)"
        )


def classification(metadata: Any) -> str:
    keys = ("num_decodes", "num_prefills", "num_spec_decodes")
    short = {"num_decodes": "decodes", "num_prefills": "prefills", "num_spec_decodes": "spec"}
    return " ".join(f"{short[k]}={getattr(metadata, k, '?')}" for k in keys)


# --------------------------------------------------------------------------
# Running and judging
# --------------------------------------------------------------------------


def _max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (
        actual.detach().to(torch.float64) - expected.detach().to(actual.device, torch.float64)
    ).abs()
    if diff.numel() == 0:
        return 0.0
    worst = diff.max().item()
    return float("inf") if worst != worst else float(worst)


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
        # The dtypes verify_tree uses (the chunk kernels refuse float32).
        dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
        self.base_shape = shape or LayerShape(dtype=dtype)
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

    # -- one call of the real builder and the real layer ----------------------

    def build(self, builder: Any, plan: StepPlan, capture: bool = False) -> Any:
        with self.loaded.active(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            capture_fn = getattr(builder, "build_for_cudagraph_capture", None)
            if capture and callable(capture_fn):
                metadata = capture_fn(plan.common)
            else:
                metadata = builder.build(0, plan.common, **plan.build_kwargs)
        _check_no_stubs(self.loaded, metadata)
        return metadata

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
        metadata = self.build(builder, plan)
        out = torch.zeros(
            plan.num_tokens,
            shape.num_v_heads,
            shape.head_v_dim,
            dtype=shape.dtype,
            device=self.device,
        )
        with self.loaded.active():
            layer = build_layer(self.loaded, shape, tensors, self.reads)
            with (
                self.loaded.context.forward({PREFIX: metadata}, {PREFIX: layer}),
                torch.no_grad(),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore", UserWarning)
                warnings.simplefilter("ignore", RuntimeWarning)
                run_method(self.loaded, layer, shape, qkv, b, a, out)
        return _Run(out=out, tensors=tensors, metadata=metadata)

    def _inputs(
        self, shape: LayerShape, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + 7)
        qkv = torch.randn(num_tokens, shape.conv_dim, generator=gen, dtype=torch.float64)
        ba = torch.randn(num_tokens, 2 * shape.num_v_heads, generator=gen, dtype=torch.float64) * 2
        b, a = ba.to(shape.dtype).to(self.device).chunk(2, dim=-1)
        return qkv.to(shape.dtype).to(self.device), a.contiguous(), b.contiguous()

    @staticmethod
    def _clone(t: LayerTensors) -> LayerTensors:
        return dataclasses.replace(t, conv_pool=t.conv_pool.clone(), ssm_pool=t.ssm_pool.clone())

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
        plan = plan_step(self.loaded, builder, scenario, self.device)
        base = make_tensors(shape, plan.num_slots, self.layout, self.device, self.seed)
        inputs = self._inputs(shape, plan.num_tokens)
        fresh = [r for r in plan.reqs if r.fresh]
        fresh_slots = sorted({s for r in fresh for s in plan.blocks[r.rid]})
        state_slots = [plan.blocks[r.rid][0] for r in fresh]
        fresh_tokens = [t for r in fresh for t in plan.token_range(r.rid)]
        other_tokens = [t for t in range(plan.num_tokens) if t not in set(fresh_tokens)]
        other_slots = [s for s in range(plan.num_slots) if s not in set(fresh_slots)]

        def filled(fill: Callable[[LayerTensors, list[int]], None]) -> _Run:
            tensors = self._clone(base)
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
                errors[f"{key}_{label}"] = _max_err(x, y)
        errors["new_out_a_vs_b"] = _max_err(run_a.out[ft], run_b.out[ft])
        errors["new_ssm_a_vs_b"] = _max_err(run_a.tensors.ssm_pool[fs], run_b.tensors.ssm_pool[fs])
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
        plan = plan_step(self.loaded, builder, scenario, self.device)
        tensors = make_tensors(shape, plan.num_slots, self.layout, self.device, self.seed)
        before = self._clone(tensors)
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
            "ref_out": _max_err(run.out, expected.out),
            "ref_conv": _max_err(tensors.conv_pool, expected.conv_pool),
            "ref_ssm": _max_err(tensors.ssm_pool, expected.ssm_pool),
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
        plan = plan_step(self.loaded, builder, scenario, self.device)
        has_capture = callable(getattr(builder, "build_for_cudagraph_capture", None))
        metadata = self.build(builder, plan, capture=True)
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
    tree = Path(tree)
    if not (tree / "vllm").is_dir() and tree.name == "vllm" and (tree / "__init__.py").is_file():
        tree = tree.parent  # the vllm/ package itself was given: its root
    if device.startswith("cpu"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    loaded = load_builder_tree(tree, device)
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
