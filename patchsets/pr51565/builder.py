"""The tree's REAL ``GDNAttentionMetadataBuilder``, driven as its runner drives it (vLLM #51565).

The layer suite of the gate-rows fix synthesises the metadata
``_forward_core`` reads; this patchset's asks the tree's own builder for
it. The tree's ``vllm.v1.attention.backend``,
``vllm.v1.attention.backends.utils`` and
``vllm.v1.attention.backends.gdn_attn`` are loaded from source into the
harness's private tree (beside its GDN layer and kernels:
:meth:`~gdn_backport.harness.loader.LoadedTree.load_source`),
the builder is constructed by its own ``__init__`` from the harness's config
(:func:`~gdn_backport.harness.standins.vllm_config`: FULL cudagraphs off,
speculative decoding only where a scenario needs it), and each step's
``CommonAttentionMetadata`` is made the way the V1 runner makes it: rows
ordered by the tree's own ``reorder_batch_to_split_decodes_and_prefills``,
``seq_lens_cpu_upper_bound`` = num_computed + num_scheduled,
``is_prefilling`` = num_computed < num_prompt_tokens, one state block per
request in the block table. Which fields to fill is read from the tree's
dataclass (a required field without a rule here fails with its name).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gdn_backport.harness.layer import PREFIX
from gdn_backport.harness.loader import HarnessError, LoadedTree, load_tree
from gdn_backport.harness.standins import ConfigNode, is_stub, vllm_config

__all__ = [
    "Req",
    "StepPlan",
    "build_metadata",
    "classification",
    "common_metadata",
    "load_builder_tree",
    "make_builder",
    "plan_step",
    "runner_order",
    "supports_spec",
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
                loaded.load_source(name)
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


def _vllm_config(num_spec: int) -> ConfigNode:
    """The config the builder's ``__init__`` reads: the harness's, with the
    builder's sizes; a missing field names its path."""
    spec = (
        ConfigNode(
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
    return vllm_config(
        model_config={"max_model_len": 4096},
        speculative_config=spec,
        cache_config={"block_size": _BLOCK_SIZE},
        compilation_config={
            "cudagraph_mode": _CudagraphMode(),
            # Only sizes the persistent decode buffers (FULL graphs are off).
            "max_cudagraph_capture_size": 512,
            "max_capture_size": 512,  # its name before 0.11
            "cudagraph_capture_sizes": [],
            "full_cuda_graph": False,
        },
        scheduler_config=ConfigNode(
            "vllm_config.scheduler_config",
            max_num_seqs=_MAX_NUM_SEQS,
            max_num_batched_tokens=2048,
        ),
        parallel_config={
            "decode_context_parallel_size": 1,
            "prefill_context_parallel_size": 1,
            "tensor_parallel_size": 1,
        },
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
    loaded: LoadedTree,
    builder: Any,
    reqs: Sequence[Req],
    num_spec: int,
    device: torch.device,
    capture: bool = False,
) -> StepPlan:
    """One step of ``reqs`` as the runner hands it to the builder (a capture
    batch: in the order given, as the capture builder makes it)."""
    reqs = list(reqs) if capture else runner_order(loaded, builder, reqs)
    blocks, num_slots = _slot_blocks(reqs, num_spec + 1)
    common = common_metadata(loaded, reqs, blocks, device, capture=capture)
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


def build_metadata(loaded: LoadedTree, builder: Any, plan: StepPlan, capture: bool = False) -> Any:
    """The builder's metadata for ``plan`` (``capture``: through its
    ``build_for_cudagraph_capture`` where it has one)."""
    with loaded.active(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capture_fn = getattr(builder, "build_for_cudagraph_capture", None)
        if capture and callable(capture_fn):
            metadata = capture_fn(plan.common)
        else:
            metadata = builder.build(0, plan.common, **plan.build_kwargs)
    _check_no_stubs(loaded, metadata)
    return metadata
