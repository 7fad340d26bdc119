"""Seeded weights that replace vLLM's dummy weights, so the bug can be seen.

vLLM's dummy loader fills every tensor uniformly in [-1e-3, 1e-3]: in the
Gated DeltaNet layer ``A_log``, ``dt_bias`` and the merged ``in_proj_ba``
rows are then all about 0, so the gates ``g = -exp(A_log) * softplus(a +
dt_bias)`` and ``beta = sigmoid(b)`` are the same for every token, and a
kernel reading another token's gate rows computes the same numbers: the bug
is invisible. These rules give every parameter kind a scale that keeps
activations O(1) while making the gates differ from token to token.

Each parameter draws from its own ``torch.Generator`` seeded from ``(seed,
namespace/name)``, so its values do not depend on the order parameters are
visited in, nor on which other parameters exist (the MTP draft model is
loaded by the same loader, under its own class name as namespace).

:func:`install` wraps ``DummyModelLoader.load_weights`` (vLLM 0.25.1:
``vllm/model_executor/model_loader/dummy_loader.py``): vLLM's own
initialisation runs, then ours over the whole model, before
``process_weights_after_loading``. The rules themselves import nothing heavy;
torch is imported where tensors are made.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "LOADER_CLASS",
    "LOADER_MODULE",
    "InitReport",
    "WeightRules",
    "initialize",
    "install",
    "kind_of",
    "seed_for",
]

LOADER_MODULE = "vllm.model_executor.model_loader.dummy_loader"
LOADER_CLASS = "DummyModelLoader"
_MARKER = "__gdn_backport_weights__"

# Norm classes whose weight is an offset from 1 (``x * (1 + w)``): Qwen3.5
# uses vLLM's GemmaRMSNorm (layernorm.py: ``weight.float() + 1.0``) for its
# layer norms and q/k norms; RMSNormGated (the GDN output norm) multiplies by
# ``w`` itself.
ZERO_CENTRED_NORMS = frozenset({"GemmaRMSNorm"})
# Projections that write into the residual stream: scaled down so the stream
# does not grow layer after layer.
RESIDUAL_OUTPUTS = ("out_proj.weight", "o_proj.weight", "down_proj.weight")


@dataclass(frozen=True)
class WeightRules:
    """Scales by parameter kind. ``gate_gain`` scales ``in_proj_ba`` (std of
    ``a`` and ``b`` per token for unit-RMS inputs); ``lm_gain`` the logits'
    std, peaked enough that greedy picks are stable yet chosen logprobs stay
    sensitive to small changes of the hidden state."""

    seed: int = 0
    gate_gain: float = 2.0
    lm_gain: float = 3.0
    embed_std: float = 1.0
    norm_jitter: float = 0.05
    residual_gain: float = 0.5
    a_range: tuple[float, float] = (1.0, 16.0)
    dt_range: tuple[float, float] = (1e-3, 1e-1)
    fallback_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("gate_gain", "lm_gain", "embed_std", "residual_gain", "fallback_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"weights: {name} = {getattr(self, name)!r}: expected > 0")
        if self.norm_jitter < 0:
            raise ValueError(f"weights: norm_jitter = {self.norm_jitter!r}: expected >= 0")
        for name in ("a_range", "dt_range"):
            lo, hi = getattr(self, name)
            if not 0 < lo < hi:
                raise ValueError(f"weights: {name} = {(lo, hi)!r}: expected 0 < low < high")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WeightRules:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"weights: {unknown[0]}: unknown key")
        values = dict(data)
        for name in ("a_range", "dt_range"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


@dataclass
class InitReport:
    """What one model's initialisation did."""

    namespace: str
    kinds: dict[str, int] = field(default_factory=dict)
    fallback: list[str] = field(default_factory=list)  # names no rule knew

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "kinds": self.kinds, "fallback": self.fallback[:20]}


def seed_for(seed: int, name: str) -> int:
    """A generator seed for one parameter: stable across processes and runs."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def kind_of(name: str, classes: Sequence[str], ndim: int) -> str:
    """The rule a parameter gets, from its full name, the class names of its
    module's MRO (most derived first) and its number of dimensions."""
    if name.endswith("A_log"):
        return "A_log"
    if name.endswith("dt_bias"):
        return "dt_bias"
    if name.endswith("in_proj_ba.weight"):
        return "gate_proj"
    if name.endswith("conv1d.weight"):
        return "conv1d"
    # ParallelLMHead derives from VocabParallelEmbedding: the head first.
    if "lm_head" in name:
        return "lm_head"
    if "embed_tokens" in name or "VocabParallelEmbedding" in classes:
        return "embedding"
    if name.endswith(".bias") or name == "bias":
        return "bias"
    if any(c in ZERO_CENTRED_NORMS for c in classes):
        return "norm_zero"
    if classes and "Norm" in classes[0]:
        return "norm_unit"
    if name.endswith(RESIDUAL_OUTPUTS):
        return "residual_out"
    if ndim == 2:
        return "linear"
    return "fallback"


def _fan_in(shape: Sequence[int]) -> int:
    # vLLM's linear weights are [out, in]; conv1d is [channels, 1, kernel].
    return int(shape[-1]) if len(shape) >= 2 else 1


def values_for(
    kind: str, shape: Sequence[int], generator: torch.Generator, rules: WeightRules
) -> torch.Tensor:
    """Float32 values of one parameter of ``kind`` (on the CPU)."""
    import torch

    size = tuple(int(s) for s in shape)

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(size, generator=generator, dtype=torch.float32) * std + mean

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(size, generator=generator, dtype=torch.float32) * (hi - lo) + lo

    fan = math.sqrt(_fan_in(size))
    if kind == "A_log":
        return torch.log(uniform(*rules.a_range))
    if kind == "dt_bias":
        lo, hi = rules.dt_range
        dt = torch.exp(uniform(math.log(lo), math.log(hi)))
        # softplus(dt_bias) == dt: the inverse softplus, log(expm1(dt)).
        return torch.log(torch.expm1(dt))
    if kind == "gate_proj":
        return normal(rules.gate_gain / fan)
    if kind == "lm_head":
        return normal(rules.lm_gain / fan)
    if kind == "embedding":
        return normal(rules.embed_std)
    if kind == "norm_zero":
        return normal(rules.norm_jitter)
    if kind == "norm_unit":
        return normal(rules.norm_jitter, mean=1.0)
    if kind == "bias":
        return torch.zeros(size, dtype=torch.float32)
    if kind == "residual_out":
        return normal(rules.residual_gain / fan)
    if kind in ("linear", "conv1d"):
        return normal(1.0 / fan)
    return normal(rules.fallback_std)


def _named_parameters(model: Any) -> Iterable[tuple[str, list[str], Any]]:
    """``(full name, MRO class names of its module, parameter)``, each
    parameter once (a tied parameter under its first name)."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        classes = [c.__name__ for c in type(module).__mro__]
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{module_name}.{pname}" if module_name else pname), classes, param


def initialize(model: Any, rules: WeightRules, namespace: str | None = None) -> InitReport:
    """Overwrite every floating-point parameter of ``model`` by the rules."""
    report = InitReport(namespace or type(model).__name__)
    if not callable(getattr(model, "named_modules", None)):
        return report  # not a torch module: nothing to initialise
    import torch

    with torch.no_grad():
        for name, classes, param in _named_parameters(model):
            if not torch.is_floating_point(param) or param.device.type == "meta":
                continue
            kind = kind_of(name, classes, param.dim())
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed_for(rules.seed, f"{report.namespace}/{name}"))
            param.data.copy_(values_for(kind, param.shape, generator, rules).to(param.dtype))
            report.kinds[kind] = report.kinds.get(kind, 0) + 1
            if kind == "fallback":
                report.fallback.append(name)
    return report


REPORTS: list[InitReport] = []


def install(rules: WeightRules, loader_cls: Any = None) -> Callable[[], None]:
    """Make the dummy loader finish with :func:`initialize`; returns an undo.

    ``loader_cls`` defaults to vLLM's ``DummyModelLoader`` (imported here,
    in the engine process, before the LLM is built)."""
    if loader_cls is None:
        import importlib

        loader_cls = getattr(importlib.import_module(LOADER_MODULE), LOADER_CLASS)
    assert loader_cls is not None
    own = loader_cls.__dict__.get("load_weights")
    original = loader_cls.load_weights
    if getattr(original, _MARKER, False):
        original = original.__wrapped__

    @functools.wraps(original, updated=())
    def load_weights(self: Any, model: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, model, model_config, *args, **kwargs)
        REPORTS.append(initialize(model, rules))
        return result

    setattr(load_weights, _MARKER, True)
    loader_cls.load_weights = load_weights

    def undo() -> None:
        if own is None:
            delattr(loader_cls, "load_weights")
        else:
            loader_cls.load_weights = own

    return undo
