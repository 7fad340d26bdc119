"""A layer object of the tree's own GDN class, holding real tensors.

The tree's class is instantiated without its ``__init__`` (which builds
projections, quantisation, configs); the attributes its ``_forward_core``
path reads are found in the source (``self.X`` reads in ``_forward_core`` and
in the methods it calls on ``self``) and each is given a value: weights
(``A_log``, ``dt_bias``, ``conv1d``), head sizes, and the state pools
``kv_cache`` in the release's layout (conv state ``(slots, state_len, dim)``,
SSM state ``(slots, HV, V, K)`` or ``(slots, HV, K, V)`` as the release's
``gated_delta_net_state_shape`` declares). Attributes of features the
harness runs switched off (prefix-caching checkpoints) are left unset, as on
a real layer without them; (cached) properties are computed on read. An
attribute without a rule fails with a message that names it.

Before 0.11.1 the site is ``_forward(hidden_states, output)``, which also
runs the input projections and the gated norm / output projection around
the core; :func:`run_method` stands in for those per step (see there).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import textwrap
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gdn_backport.harness.loader import HarnessError, LoadedTree

__all__ = [
    "PREFIX",
    "LayerReads",
    "LayerShape",
    "LayerTensors",
    "activation_dtype",
    "build_layer",
    "forward_step",
    "make_tensors",
    "run_method",
    "self_attributes",
    "ssm_layout",
    "step_inputs",
]

PREFIX = "model.layers.0.linear_attn"
# A rule's value for an attribute the real layer does not have on the
# harness's configuration (a feature switched off): it is not set.
_UNSET: Any = object()


@dataclass(frozen=True)
class LayerShape:
    """Sizes of the GDN layer under test (small on CPU, see the tests)."""

    num_k_heads: int = 2
    num_v_heads: int = 4
    head_k_dim: int = 16
    head_v_dim: int = 16
    conv_kernel: int = 4
    num_spec: int = 3
    dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_len(self) -> int:
        return self.conv_kernel - 1 + self.num_spec

    def output(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The core output buffer of one step, ``(T, HV, V)``, zeroed."""
        return torch.zeros(
            num_tokens, self.num_v_heads, self.head_v_dim, dtype=self.dtype, device=device
        )


def activation_dtype(device: str | torch.device) -> torch.dtype:
    """float16 on CPU (the FLA chunk kernels refuse float32, and Triton's
    interpreter computes bfloat16 arithmetic on raw bits), bfloat16 on CUDA."""
    return torch.float16 if str(device).startswith("cpu") else torch.bfloat16


def step_inputs(
    shape: LayerShape, num_tokens: int, device: torch.device, seed: int, strided: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's ``(mixed_qkv, a, b)``, drawn in float64 from ``seed`` and
    cast. The gates are spread over the softplus/sigmoid range so that every
    token's gates differ visibly from its neighbours'; ``strided``: ``a`` and
    ``b`` left as the halves of one tensor, as the layer's projection makes them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, shape.conv_dim, generator=gen, dtype=torch.float64)
    ba = torch.randn(num_tokens, 2 * shape.num_v_heads, generator=gen, dtype=torch.float64) * 2.0
    qkv = qkv.to(shape.dtype).to(device)
    b, a = ba.to(shape.dtype).to(device).chunk(2, dim=-1)
    if not strided:
        b, a = b.contiguous(), a.contiguous()
    return qkv, a, b


def _function_ast(fn: Any) -> ast.FunctionDef | None:
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    return node if isinstance(node, ast.FunctionDef) else None


def _class_attribute(cls: type, name: str) -> Any:
    """``name`` as defined in the class body of ``cls`` or a base, else None
    (bases that are auto-stubs answer every name: they are not asked)."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def self_attributes(layer_class: type, method: str = "_forward_core") -> tuple[set[str], set[str]]:
    """``self.X`` reads that are not methods: (read by ``method`` itself,
    read by the methods it calls on ``self``, transitively)."""
    direct: set[str] = set()
    indirect: set[str] = set()
    todo, seen = [method], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = _function_ast(getattr(layer_class, name))
        if node is None:
            continue
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"
                and isinstance(sub.ctx, ast.Load)
            ):
                attr = _class_attribute(layer_class, sub.attr)
                if inspect.isfunction(attr):
                    todo.append(sub.attr)
                elif isinstance(attr, property | functools.cached_property):
                    # Computed on read from other attributes; if the path reads
                    # it, what it needs fails there with the attribute's name.
                    continue
                else:
                    (direct if name == method else indirect).add(sub.attr)
    return direct, indirect - direct


def ssm_layout(loaded: LoadedTree) -> str:
    """ "VK" or "KV": the order of the last two SSM state dims in this release,
    read from ``MambaStateShapeCalculator.gated_delta_net_state_shape``."""
    path = loaded.tree / "vllm" / "model_executor" / "layers" / "mamba" / "mamba_utils.py"
    if path.is_file():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name == "gated_delta_net_state_shape":
                for sub in ast.walk(node):
                    if (
                        isinstance(sub, ast.Assign)
                        and isinstance(sub.targets[0], ast.Name)
                        and sub.targets[0].id == "temporal_state_shape"
                    ):
                        text = ast.unparse(sub.value)
                        k, v = text.find("head_k_dim"), text.find("head_v_dim")
                        if k >= 0 and v >= 0:
                            return "VK" if v < k else "KV"
    raise HarnessError(
        f"{loaded.tree}: cannot read the SSM state layout from "
        "MambaStateShapeCalculator.gated_delta_net_state_shape"
    )


def _kv_cache_is_per_engine(layer_class: type, method: str) -> bool:
    """Older releases index ``self.kv_cache[forward_context.virtual_engine]``."""
    node = _function_ast(getattr(layer_class, method))
    assert node is not None
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Subscript)
            and isinstance(sub.value, ast.Attribute)
            and sub.value.attr == "kv_cache"
            and isinstance(sub.value.value, ast.Name)
            and sub.value.value.id == "self"
        ):
            return not isinstance(sub.slice, ast.Constant)
    return False


@dataclass
class LayerTensors:
    """The weights and the state pools (the pools are what the step mutates)."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    conv_weight: torch.Tensor  # (conv_dim, 1, width)
    conv_bias: torch.Tensor | None
    conv_pool: torch.Tensor  # (slots, state_len, conv_dim)
    ssm_pool: torch.Tensor  # (slots, HV, V, K) or (slots, HV, K, V)
    ssm_layout: str

    def clone_pools(self) -> LayerTensors:
        """The same weights with copies of the pools (what a step writes)."""
        return dataclasses.replace(
            self, conv_pool=self.conv_pool.clone(), ssm_pool=self.ssm_pool.clone()
        )


def make_tensors(
    shape: LayerShape, num_slots: int, layout: str, device: torch.device, seed: int
) -> LayerTensors:
    # Drawn on the device: the pools of a GPU-sized layer are tens of MB,
    # slow to draw on the host for every scenario.
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float32, device=device) * scale

    hv, k, v = shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    ssm_shape = (num_slots, hv, v, k) if layout == "VK" else (num_slots, hv, k, v)
    return LayerTensors(
        A_log=torch.log(torch.rand(hv, generator=gen, dtype=torch.float32, device=device) * 4 + 1),
        dt_bias=rand(hv, scale=0.5),
        conv_weight=rand(shape.conv_dim, 1, shape.conv_kernel, scale=0.5).to(shape.dtype),
        conv_bias=rand(shape.conv_dim, scale=0.1).to(shape.dtype),
        conv_pool=rand(num_slots, shape.conv_state_len, shape.conv_dim).to(shape.dtype),
        ssm_pool=rand(*ssm_shape, scale=0.3).to(shape.state_dtype),
        ssm_layout=layout,
    )


def _chunk_op(loaded: LoadedTree) -> Any:
    """What ``self.chunk_gated_delta_rule`` is in the release: an instance of
    its ``ChunkGatedDeltaRule`` op, else the FLA function the module imports."""
    assert loaded.module is not None
    globals_ = loaded.module.__dict__
    op_class = globals_.get("ChunkGatedDeltaRule")
    if isinstance(op_class, type):
        with loaded.active():
            return op_class()
    for name in ("fla_chunk_gated_delta_rule", "chunk_gated_delta_rule"):
        if callable(globals_.get(name)):
            return globals_[name]
    raise HarnessError(f"{loaded.site}: no chunk_gated_delta_rule op to give the layer")


@dataclass(frozen=True)
class LayerReads:
    """What a GDN class's ``_forward_core`` (or ``_forward``) path reads from
    ``self`` (from its source: see :func:`self_attributes`), and how it
    indexes ``self.kv_cache``."""

    direct: frozenset[str]
    indirect: frozenset[str]
    kv_cache_per_engine: bool

    @classmethod
    def of(cls, layer_class: type, method: str = "_forward_core") -> LayerReads:
        direct, indirect = self_attributes(layer_class, method)
        per_engine = _kv_cache_is_per_engine(layer_class, method)
        return cls(frozenset(direct), frozenset(indirect), per_engine)


def _attribute_rules(
    loaded: LoadedTree, shape: LayerShape, tensors: LayerTensors, per_engine: bool
) -> dict[str, Callable[[], Any]]:
    conv1d = types.SimpleNamespace(weight=tensors.conv_weight, bias=tensors.conv_bias)
    pools = (tensors.conv_pool, tensors.ssm_pool)
    return {
        "prefix": lambda: PREFIX,
        "kv_cache": lambda: [pools] if per_engine else pools,
        "conv1d": lambda: conv1d,
        "activation": lambda: "silu",
        "A_log": lambda: tensors.A_log,
        "dt_bias": lambda: tensors.dt_bias,
        "num_k_heads": lambda: shape.num_k_heads,
        "num_v_heads": lambda: shape.num_v_heads,
        "head_k_dim": lambda: shape.head_k_dim,
        "head_v_dim": lambda: shape.head_v_dim,
        "key_dim": lambda: shape.key_dim,
        "value_dim": lambda: shape.value_dim,
        "tp_size": lambda: 1,
        "tp_rank": lambda: 0,
        "num_spec": lambda: shape.num_spec,
        # vLLM's default (VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE).
        "enable_packed_recurrent_decode": lambda: True,
        "_prefill_kernels_warmed_up": lambda: True,
        "chunk_gated_delta_rule": lambda: _chunk_op(loaded),
        # Created by __init__ only for prefix-caching checkpoints (mamba_cache_mode
        # "align" with the FlashInfer prefill); read only on the branch where the
        # metadata's flashinfer_checkpoint_plan is set, which the harness leaves
        # None. Left unset, as on a real layer without the feature: a read
        # fails with the attribute's name.
        "_checkpoint_exporter": lambda: _UNSET,
        **{name: (lambda: _UNSET) for name in _PER_STEP},
    }


def build_layer(
    loaded: LoadedTree,
    shape: LayerShape,
    tensors: LayerTensors,
    reads: LayerReads | None = None,
) -> nn.Module:
    """An instance of the tree's GDN class whose site method can run
    (``reads``: :meth:`LayerReads.of` the class, when the caller keeps it)."""
    cls: Any = loaded.layer_class
    assert cls is not None
    layer = cls.__new__(cls)
    if isinstance(layer, nn.Module):
        nn.Module.__init__(layer)
    if reads is None:
        reads = LayerReads.of(cls, loaded.site.method)
    rules = _attribute_rules(loaded, shape, tensors, reads.kv_cache_per_engine)
    direct, indirect = reads.direct, reads.indirect
    missing = sorted(direct - set(rules))
    if missing:
        raise HarnessError(
            f"{loaded.site}: reads self.{', self.'.join(missing)}, which "
            "the harness does not know how to provide"
        )
    # Attributes only other methods read (warm-up, other platforms) get a
    # value where a rule exists; if such a path runs, its AttributeError names it.
    for name in sorted(direct | (indirect & set(rules))):
        value = rules[name]()
        if value is not _UNSET:
            object.__setattr__(layer, name, value)
    return layer  # type: ignore[no-any-return]


@contextlib.contextmanager
def forward_step(loaded: LoadedTree, layer: nn.Module, metadata: Any) -> Iterator[None]:
    """Around one call of the site's method (the tree active): ``metadata``
    as the forward context's, no autograd, and the noise of small shapes
    hushed (the tree's wrappers' shape heuristics, NumPy overflow in
    masked-off interpreter lanes)."""
    with (
        loaded.context.forward({PREFIX: metadata}, {PREFIX: layer}),
        torch.no_grad(),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# What _forward (before 0.11.1) reads around the core: set by run_method for
# each step, since they carry that step's inputs.
_PER_STEP = (
    "in_proj",
    "in_proj_qkvz",
    "in_proj_ba",
    "projection_size_qkvz",
    "projection_size_ba",
    "norm",
    "out_proj",
)


def run_method(
    loaded: LoadedTree,
    layer: nn.Module,
    shape: LayerShape,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One call of the site's method on one step's inputs; the core output
    (``(T, HV, V)``) lands in ``out``.

    ``_forward_core(mixed_qkv, b, a, out)`` is called as it is. For
    ``_forward(hidden_states, output)`` the layer's projections are stand-ins
    for this step: ``fix_query_key_value_ordering`` returns the step's q, k,
    v (views of ``mixed_qkv``, which the method concatenates back into the
    same rows), a zero ``z`` and the step's ``b`` and ``a``; ``norm`` and
    ``out_proj`` pass the core output through into ``output``, a view of
    ``out``. What the GDN core computes is then exactly what
    ``_forward_core`` of later releases computes from the same inputs.
    """
    if loaded.site.method == "_forward_core":
        layer._forward_core(mixed_qkv, b, a, out)  # type: ignore[operator]
        return
    tokens, hk, hv = mixed_qkv.shape[0], shape.num_k_heads, shape.num_v_heads
    q, k, v = torch.split(mixed_qkv, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
    value = v.view(tokens, hv, shape.head_v_dim)
    parts = (
        q.view(tokens, hk, shape.head_k_dim),
        k.view(tokens, hk, shape.head_k_dim),
        value,
        torch.zeros_like(value),
        b,
        a,
    )
    qkvz, ba = 2 * shape.key_dim + 2 * shape.value_dim, 2 * hv

    def projection(width: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, None]]:
        return lambda x: (x.new_zeros(x.shape[0], width), None)

    step = {
        "fix_query_key_value_ordering": lambda mixed_qkvz, mixed_ba: parts,
        "projection_size_qkvz": qkvz,
        "projection_size_ba": ba,
        "in_proj": projection(qkvz + ba),
        "in_proj_qkvz": projection(qkvz),
        "in_proj_ba": projection(ba),
        "norm": lambda x, z: x,
        "out_proj": lambda x: (x, None),
    }
    for name, value_ in step.items():
        object.__setattr__(layer, name, value_)
    hidden_states = mixed_qkv.new_zeros(tokens, 1)
    layer._forward(hidden_states, out.view(tokens, hv * shape.head_v_dim))  # type: ignore[operator]
