"""The metadata a tree's ``_forward_core`` reads, synthesised from a batch.

Which fields to provide is found by reading the code, not from a table per
release: every attribute read on the metadata variable of ``_forward_core``,
and on the parameter it is bound to in each callee that receives it (the
tree's own methods and kernels, e.g. ``causal_conv1d_fn(metadata=...)``).

Each field's value follows the tree's metadata builder
(``GDNAttentionMetadataBuilder.build``): when spec rows are present every
non-spec row is a prefill (from 0.18.0 the builder reclassifies one-token
non-spec rows so, making num_decodes and num_spec_decodes mutually
exclusive; before, such a row was a decode, and the harness, building the
later form for every release, does not drive that older decode-beside-spec
branch), the pure-spec fast path uses ``arange`` indices, and without spec
rows one-token rows sort first and are decodes.
``chunk_indices``/``chunk_offsets`` describe the cu_seqlens the chunk kernel
gets: ``prefill_query_start_loc`` where the method reads it, else
``non_spec_query_start_loc``. Fields of features the harness runs switched
off (ROCm AITER prefill, prefix-caching checkpoints: ``FEATURE_OFF_FIELDS``)
are None, their default in the tree's dataclass. A field without a rule here
fails with a message that names it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gdn_backport.harness.batch import Batch, SlotMap
from gdn_backport.harness.loader import HarnessError, LoadedTree

__all__ = ["FEATURE_OFF_FIELDS", "MetadataPlan", "build_metadata", "metadata_fields"]


# --------------------------------------------------------------------------
# Static analysis: which fields are read
# --------------------------------------------------------------------------


def _parse_function(fn: Any) -> ast.FunctionDef | None:
    fn = inspect.unwrap(fn)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None  # type: ignore[return-value]


def _metadata_names(fn: ast.FunctionDef) -> set[str]:
    """Variables of ``_forward_core`` holding the metadata object."""
    names = {"attn_metadata"}
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Name)
            and "Metadata" in ast.unparse(node.args[1])
        ):
            names.add(node.args[0].id)
    return names


def _reads(fn: ast.FunctionDef, names: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in names and isinstance(node.ctx, ast.Load):
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in names
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            found.add(node.args[1].value)
    return found


def _param_bound(
    callee: ast.FunctionDef, call: ast.Call, names: set[str], method: bool
) -> str | None:
    params = [a.arg for a in callee.args.args]
    if method and params:
        params = params[1:]
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Name) and arg.id in names and i < len(params):
            return params[i]
    for kw in call.keywords:
        if isinstance(kw.value, ast.Name) and kw.value.id in names and kw.arg:
            return kw.arg
    return None


def _collect(
    fn: ast.FunctionDef,
    names: set[str],
    resolve: Callable[[ast.expr], tuple[Any, bool] | None],
    seen: set[int],
) -> set[str]:
    fields = _reads(fn, names)
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        target = resolve(node.func)
        if target is None:
            continue
        obj, method = target
        if id(obj) in seen:
            continue
        callee = _parse_function(obj)
        if callee is None:
            continue
        param = _param_bound(callee, node, names, method)
        if param is None:
            continue
        seen.add(id(obj))
        fields |= _collect(callee, {param}, resolve, seen)
    return fields


def metadata_fields(loaded: LoadedTree) -> frozenset[str]:
    """Every metadata field the tree's ``_forward_core`` (``_forward``) path reads."""
    assert loaded.layer_class is not None and loaded.module is not None
    layer_class, module = loaded.layer_class, loaded.module
    core = _parse_function(getattr(layer_class, loaded.site.method))
    if core is None:
        raise HarnessError(f"{loaded.site}: cannot read the source of {loaded.site.method}")

    def resolve(func: ast.expr) -> tuple[Any, bool] | None:
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "self"
        ):
            obj = getattr(layer_class, func.attr, None)
            return (obj, True) if inspect.isfunction(obj) else None
        if isinstance(func, ast.Name):
            obj = module.__dict__.get(func.id)
            return (obj, False) if inspect.isfunction(obj) else None
        return None

    return frozenset(_collect(core, _metadata_names(core), resolve, set()))


# --------------------------------------------------------------------------
# Synthesis: the values
# --------------------------------------------------------------------------


@dataclass
class MetadataPlan:
    """The builder's view of one batch: counts, index lists, CPU tensors."""

    batch: Batch
    slots: SlotMap
    device: torch.device
    fields: frozenset[str]

    def __post_init__(self) -> None:
        rows, ids = self.batch.rows, self.batch.request_ids()
        self.spec_rows = [i for i, r in enumerate(rows) if r.spec]
        self.non_spec_rows = [i for i, r in enumerate(rows) if not r.spec]
        self.num_spec_decodes = len(self.spec_rows)
        lens = [r.query_len for r in rows]
        if self.num_spec_decodes:
            self.num_decodes = 0
            self.num_prefills = len(self.non_spec_rows)
        else:
            leading = 0
            while leading < len(rows) and lens[leading] == 1:
                leading += 1
            if any(n == 1 for n in lens[leading:]):
                raise HarnessError(
                    f"batch {self.batch.describe()}: without spec rows vLLM sorts "
                    "one-token rows (decodes) first; reorder the rows"
                )
            for i in range(leading):
                if not rows[i].has_initial_state:
                    raise HarnessError(
                        f"batch {self.batch.describe()}: row {i} is a one-token row "
                        "without state, which vLLM classifies as a decode (vLLM "
                        "#51562, another bug); not modelled here"
                    )
            self.num_decodes = leading
            self.num_prefills = len(rows) - leading
        self.num_decode_tokens = self.num_decodes
        self.num_prefill_tokens = sum(lens[i] for i in self.non_spec_rows) - self.num_decode_tokens
        self.num_spec_decode_tokens = sum(lens[i] for i in self.spec_rows)
        self.pure_spec = self.num_spec_decodes > 0 and self.num_prefills == 0
        self.spec_blocks = [self.slots.blocks[ids[i]] for i in self.spec_rows]
        self.non_spec_slots = [self.slots.blocks[ids[i]][0] for i in self.non_spec_rows]
        self.spec_lens = [lens[i] for i in self.spec_rows]
        self.non_spec_lens = [lens[i] for i in self.non_spec_rows]

    def tensor(self, data: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @staticmethod
    def cumsum(lens: list[int]) -> list[int]:
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return out

    @property
    def split_non_spec(self) -> bool:
        return self.num_spec_decodes == 0 and self.num_decodes > 0 and self.num_prefills > 0

    def prefill_cu_seqlens(self) -> list[int]:
        cu = self.cumsum(self.non_spec_lens)
        if "prefill_query_start_loc" in self.fields and self.split_non_spec:
            return [c - self.num_decode_tokens for c in cu[self.num_decodes :]]
        return cu


def _has_spec(p: MetadataPlan) -> bool:
    return p.num_spec_decodes > 0


def _spec_token_indx(p: MetadataPlan) -> torch.Tensor | None:
    if not _has_spec(p):
        return None
    if p.pure_spec:
        return torch.arange(p.num_spec_decode_tokens, dtype=torch.int32, device=p.device)
    return p.tensor(p.batch.spec_token_indx(), torch.int64)


def _spec_token_masks(p: MetadataPlan) -> torch.Tensor | None:
    """Before 0.11.1 (``_forward``): True at the tokens of spec rows."""
    if not _has_spec(p):
        return None
    spec = set(p.batch.spec_token_indx())
    return p.tensor([t in spec for t in range(p.batch.num_tokens)], torch.bool)


def _non_spec_token_indx(p: MetadataPlan) -> torch.Tensor | None:
    if not _has_spec(p):
        return None
    if p.pure_spec:
        return torch.empty(0, dtype=torch.int32, device=p.device)
    return p.tensor(p.batch.non_spec_token_indx(), torch.int64)


def _spec_state_indices(p: MetadataPlan) -> torch.Tensor | None:
    return p.tensor(p.spec_blocks, torch.int32) if _has_spec(p) else None


def _non_spec_state_indices(p: MetadataPlan) -> torch.Tensor | None:
    if p.pure_spec:
        return None
    return p.tensor(p.non_spec_slots, torch.int32)


def _spec_qsl(p: MetadataPlan) -> torch.Tensor | None:
    return p.tensor(p.cumsum(p.spec_lens), torch.int32) if _has_spec(p) else None


def _non_spec_qsl(p: MetadataPlan) -> torch.Tensor | None:
    if p.pure_spec:
        return None
    return p.tensor(p.cumsum(p.non_spec_lens), torch.int32)


def _spec_sequence_masks(p: MetadataPlan) -> torch.Tensor | None:
    if not _has_spec(p):
        return None
    return p.tensor([True] * p.num_spec_decodes, torch.bool)


def _num_accepted(p: MetadataPlan) -> torch.Tensor | None:
    if not _has_spec(p):
        return None
    return p.tensor([p.batch.rows[i].num_accepted for i in p.spec_rows], torch.int32)


def _has_initial_state(p: MetadataPlan) -> torch.Tensor | None:
    if p.num_prefills == 0:
        return None
    return p.tensor([p.batch.rows[i].has_initial_state for i in p.non_spec_rows], torch.bool)


def _prefill_qsl(p: MetadataPlan) -> torch.Tensor | None:
    if p.num_prefills == 0:
        return None
    return p.tensor(p.prefill_cu_seqlens(), torch.int32)


def _prefill_state_indices(p: MetadataPlan) -> torch.Tensor | None:
    if p.num_prefills == 0:
        return None
    return p.tensor(p.non_spec_slots[p.num_decodes if p.split_non_spec else 0 :], torch.int32)


def _prefill_has_initial_state(p: MetadataPlan) -> torch.Tensor | None:
    flags = _has_initial_state(p)
    if flags is None:
        return None
    return flags[p.num_decodes :] if p.split_non_spec else flags


def _chunk_meta(loaded: LoadedTree, p: MetadataPlan, which: str) -> torch.Tensor | None:
    if p.num_prefills == 0:
        return None
    index = _fla_module(loaded, "index")
    utils = _fla_module(loaded, "utils")
    chunk_size = getattr(utils, "FLA_CHUNK_SIZE", 64)
    fn = getattr(index, f"prepare_chunk_{which}")
    cu = torch.tensor(p.prefill_cu_seqlens(), dtype=torch.int32)
    with loaded.active():
        value: torch.Tensor = fn(cu, chunk_size)
    return value.to(p.device)


def _fla_module(loaded: LoadedTree, leaf: str) -> Any:
    for name, module in loaded.modules.items():
        if name.endswith(f".ops.{leaf}") and ("fla" in name or "flash_linear_attention" in name):
            return module
    raise HarnessError(f"{loaded.tree}: no FLA ops module '{leaf}' among the loaded kernels")


def _conv_meta(loaded: LoadedTree, p: MetadataPlan) -> tuple[Any, Any, Any]:
    if p.num_prefills == 0:
        return None, None, None
    with loaded.active():
        import importlib

        utils = importlib.import_module("vllm.v1.attention.backends.utils")
        helper = getattr(utils, "compute_causal_conv1d_metadata", None)
        if helper is None or not callable(helper) or isinstance(helper, type):
            raise HarnessError(
                f"{loaded.tree}: the method reads conv1d metadata (nums_dict ...) but the "
                "tree has no compute_causal_conv1d_metadata to build it"
            )
        cu = torch.tensor(p.cumsum(p.non_spec_lens), dtype=torch.int32)
        return tuple(_call_conv_helper(loaded, helper, cu, p.device))


def _call_conv_helper(
    loaded: LoadedTree, helper: Callable[..., Any], cu_cpu: torch.Tensor, device: torch.device
) -> Any:
    """Call the tree's ``compute_causal_conv1d_metadata`` the way its signature asks.

    Newer trees take the CPU ``query_start_loc`` and a keyword-only ``device``
    (no device-to-host sync); older ones take the ``query_start_loc`` on the
    device and derive the device from it. Which one is read from the helper's
    own parameters, not from the release number.
    """
    params = list(inspect.signature(helper).parameters.values())
    positional = [q for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    required_other = [
        q.name
        for q in params
        if q.default is q.empty
        and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
        and q.name != "device"
        and (not positional or q is not positional[0])
    ]
    if not positional or required_other:
        problem = (
            f"also requires {', '.join(required_other)}"
            if positional
            else "takes no positional query_start_loc"
        )
        raise HarnessError(
            f"{loaded.tree}: compute_causal_conv1d_metadata{inspect.signature(helper)} "
            f"{problem}; the harness passes query_start_loc and, where taken, device="
        )
    if "device" in {q.name for q in params}:
        return helper(cu_cpu, device=device)
    return helper(cu_cpu.to(device))


_SIMPLE: dict[str, Callable[[MetadataPlan], Any]] = {
    "num_prefills": lambda p: p.num_prefills,
    "num_prefill_tokens": lambda p: p.num_prefill_tokens,
    "num_decodes": lambda p: p.num_decodes,
    "num_decode_tokens": lambda p: p.num_decode_tokens,
    "num_spec_decodes": lambda p: p.num_spec_decodes,
    "num_spec_decode_tokens": lambda p: p.num_spec_decode_tokens,
    "num_actual_tokens": lambda p: p.batch.num_tokens,
    "has_initial_state": _has_initial_state,
    "spec_query_start_loc": _spec_qsl,
    "non_spec_query_start_loc": _non_spec_qsl,
    "spec_state_indices_tensor": _spec_state_indices,
    "non_spec_state_indices_tensor": _non_spec_state_indices,
    "spec_sequence_masks": _spec_sequence_masks,
    "spec_token_indx": _spec_token_indx,
    "spec_token_masks": _spec_token_masks,
    "non_spec_token_indx": _non_spec_token_indx,
    "num_accepted_tokens": _num_accepted,
    "prefill_query_start_loc": _prefill_qsl,
    "prefill_state_indices": _prefill_state_indices,
    "prefill_has_initial_state": _prefill_has_initial_state,
}
_CONV_FIELDS = ("nums_dict", "batch_ptr", "token_chunk_offset_ptr")
_CHUNK_FIELDS = {"chunk_indices": "indices", "chunk_offsets": "offsets"}
# Fields of features the harness runs with switched off: the tree's builder
# leaves them at their ``None`` default then, and ``_forward_core`` only uses
# them on that feature's branch (or passes them on to an op that ignores them
# on the Triton/FLA path). Each must be declared ``= None`` in the tree's
# GDNAttentionMetadata, else the harness refuses (see _check_feature_off).
FEATURE_OFF_FIELDS: dict[str, str] = {
    # Built only for the ROCm AITER FlyDSL prefill backend; the harness runs
    # the Triton/FLA prefill (gdn_prefill_backend "triton", no AITER), whose
    # forward_native drops it.
    "aiter_prefill_metadata": "ROCm AITER FlyDSL prefill",
    # Prefix-caching checkpoints of mamba_cache_mode "align" (the harness's
    # config says "none"); the plan exists only for the FlashInfer prefill.
    # With the plan None, _forward_core takes the plain chunk-kernel branch.
    "checkpoint": "mamba prefix-caching checkpoints (mamba_cache_mode 'align')",
    "flashinfer_checkpoint_plan": "FlashInfer prefill checkpoints",
}
KNOWN_FIELDS = (
    frozenset(_SIMPLE)
    | frozenset(_CONV_FIELDS)
    | frozenset(_CHUNK_FIELDS)
    | frozenset(FEATURE_OFF_FIELDS)
)


@functools.lru_cache(maxsize=64)
def _metadata_defaults(tree: Path) -> dict[str, str]:
    """``field -> default source`` of the tree's own GDNAttentionMetadata dataclass."""
    path = tree / "vllm" / "v1" / "attention" / "backends" / "gdn_attn.py"
    if not path.is_file():
        return {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef) and node.name == "GDNAttentionMetadata":
            return {
                item.target.id: ast.unparse(item.value) if item.value is not None else ""
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
    return {}


def _check_feature_off(loaded: LoadedTree, fields: frozenset[str]) -> None:
    wanted = sorted(fields & set(FEATURE_OFF_FIELDS))
    if not wanted:
        return
    defaults = _metadata_defaults(loaded.tree)
    bad = [name for name in wanted if defaults.get(name) != "None"]
    if bad:
        raise HarnessError(
            f"{loaded.site}: reads metadata field(s) {', '.join(bad)}, which "
            "the harness leaves None (feature off: "
            + "; ".join(FEATURE_OFF_FIELDS[n] for n in bad)
            + "), but the tree's GDNAttentionMetadata does not declare them '= None'"
        )


def build_metadata(
    loaded: LoadedTree, batch: Batch, slots: SlotMap, device: torch.device, fields: frozenset[str]
) -> Any:
    """An instance of the tree's metadata class (as imported by the GDN module)
    holding exactly ``fields``, valued for ``batch``."""
    unknown = sorted(fields - KNOWN_FIELDS)
    if unknown:
        raise HarnessError(
            f"{loaded.site}: reads metadata field(s) {', '.join(unknown)} "
            "that the harness does not know how to synthesise"
        )
    _check_feature_off(loaded, fields)
    plan = MetadataPlan(batch=batch, slots=slots, device=device, fields=fields)
    values: dict[str, Any] = {}
    for name in sorted(fields):
        if name in FEATURE_OFF_FIELDS:
            values[name] = None
        elif name in _SIMPLE:
            values[name] = _SIMPLE[name](plan)
        elif name in _CHUNK_FIELDS:
            values[name] = _chunk_meta(loaded, plan, _CHUNK_FIELDS[name])
    if fields & set(_CONV_FIELDS):
        conv = dict(zip(_CONV_FIELDS, _conv_meta(loaded, plan), strict=True))
        values.update({k: v for k, v in conv.items() if k in fields})
    assert loaded.module is not None
    cls = loaded.module.__dict__.get("GDNAttentionMetadata")
    if cls is None:
        raise HarnessError(f"{loaded.site}: the GDN module does not import GDNAttentionMetadata")
    return cls(**values)
