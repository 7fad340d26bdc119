"""Do the gates really differ from token to token? Measured on real forwards.

A model whose gates are flat hides the bug (a kernel reading another token's
gate rows computes the same numbers), so every engine run reports its gate
variation and a scenario whose model is unfit is inconclusive, never passed.

The meter sits on each Gated DeltaNet layer *object*: an instance attribute
``_forward_core`` that records the gate inputs and calls the class's method
as the class holds it at call time. vLLM 0.25.1 reaches the layer through
``forward_context.no_compile_layers[name]._forward_core(...)`` from its
custom op ``qwen_gdn_attention_core`` (a splitting op, run eagerly even with
piecewise CUDA graphs), so instance lookup finds the meter; the class itself
is untouched, so whatever patch is live there (a file rewrite or our
in-memory plugin) is what runs and what ``doctor`` sees. FULL-graph replays
run no Python and are not measured; prefills and mixed steps are.

Per observation, on the device (no synchronisation until :meth:`summary`):
``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``, their
std over tokens (mean over heads) and their mean absolute change from one
token to the next (what a one-row shift of the gate rows changes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GateMeter", "GateThresholds", "find_gdn_layers", "gate_stats", "verdict"]

_INSTANCE_MARK = "__gdn_backport_gate_meter__"
STAT_NAMES = ("beta_std", "g_std", "beta_step", "g_step")


@dataclass(frozen=True)
class GateThresholds:
    """The least variation (min over layers) a model must show to be fit."""

    min_beta_std: float = 0.05
    min_g_std: float = 0.05


def find_gdn_layers(layers: Mapping[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet layers among a runner's static forward context:
    objects with a ``_forward_core`` method and ``A_log``/``dt_bias``."""
    return {
        name: layer
        for name, layer in layers.items()
        if callable(getattr(type(layer), "_forward_core", None))
        and hasattr(layer, "A_log")
        and hasattr(layer, "dt_bias")
    }


class GateMeter:
    """Gate statistics of the layers it is attached to.

    ``tokens()``: how many real tokens the current forward has, or None when
    the forward is not part of a real engine step (warm-up, profiling,
    capture): those are not measured."""

    def __init__(self, tokens: Callable[[], int | None], max_per_layer: int = 32) -> None:
        self.tokens = tokens
        self.max_per_layer = max_per_layer
        self._stats: dict[str, list[Any]] = {}

    def attach(self, layers: Mapping[str, Any]) -> int:
        """Put the meter on each GDN layer object; returns how many."""
        found = find_gdn_layers(layers)
        for name, layer in found.items():
            if getattr(layer.__dict__.get("_forward_core"), _INSTANCE_MARK, False):
                continue
            layer._forward_core = self._wrapper(name, layer)
            self._stats.setdefault(name, [])
        return len(found)

    def _wrapper(self, name: str, layer: Any) -> Callable[..., Any]:
        def _forward_core(*args: Any, **kwargs: Any) -> Any:
            b = kwargs.get("b", args[1] if len(args) > 1 else None)
            a = kwargs.get("a", args[2] if len(args) > 2 else None)
            try:
                self.observe(name, layer, b, a)
            except Exception:  # a meter must never break the forward
                self._stats.setdefault("__errors__", []).append(None)
            # The class's method as it is now: a patch applied later counts.
            return type(layer)._forward_core(layer, *args, **kwargs)

        setattr(_forward_core, _INSTANCE_MARK, True)
        return _forward_core

    def observe(self, name: str, layer: Any, b: Any, a: Any) -> None:
        stats = self._stats.setdefault(name, [])
        if b is None or a is None or len(stats) >= self.max_per_layer:
            return
        n = self.tokens()
        if n is None or n < 2:
            return
        if not hasattr(b, "float"):
            # Host rows (lists): the same statistics without torch.
            stats.append(gate_stats(b[:n], a[:n], layer.A_log, layer.dt_bias))
            return
        import torch
        import torch.nn.functional as F

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        with torch.no_grad():
            beta = torch.sigmoid(b[:n].float())
            g = -torch.exp(layer.A_log.float()) * F.softplus(a[:n].float() + layer.dt_bias.float())
            stats.append(
                torch.stack(
                    [
                        beta.std(0).mean(),
                        g.std(0).mean(),
                        (beta[1:] - beta[:-1]).abs().mean(),
                        (g[1:] - g[:-1]).abs().mean(),
                    ]
                )
            )

    def summary(self) -> dict[str, Any]:
        """JSON: per layer the mean of each statistic, and the minimum over
        layers (the model is as fit as its flattest layer)."""
        layers: dict[str, dict[str, float]] = {}
        for name, stats in self._stats.items():
            if name == "__errors__" or not stats:
                continue
            rows = [_floats(s) for s in stats]
            means = [sum(col) / len(col) for col in zip(*rows, strict=True)]
            layers[name] = {k: round(v, 6) for k, v in zip(STAT_NAMES, means, strict=True)}
            layers[name]["n"] = len(stats)
        out: dict[str, Any] = {
            "measured": bool(layers),
            "layers": layers,
            "observations": sum(int(v["n"]) for v in layers.values()),
            "errors": len(self._stats.get("__errors__", [])),
        }
        for key in STAT_NAMES:
            out[key] = min((v[key] for v in layers.values()), default=None)
        return out


def _floats(stat: Any) -> list[float]:
    tolist = getattr(stat, "tolist", None)
    return [float(v) for v in (tolist() if tolist is not None else stat)]


def _std(values: Sequence[float]) -> float:
    # torch.std's default: the unbiased estimator.
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))


def gate_stats(
    b: Sequence[Sequence[float]],
    a: Sequence[Sequence[float]],
    A_log: Sequence[float],
    dt_bias: Sequence[float],
) -> list[float]:
    """The meter's four statistics from host rows (tokens x heads), in pure
    Python: the reference of the torch path, and what a host-only engine
    (the CPU test fakes) reports."""
    heads = range(len(A_log))
    beta = [[1.0 / (1.0 + math.exp(-row[h])) for h in heads] for row in b]
    g = [[-math.exp(A_log[h]) * _softplus(row[h] + dt_bias[h]) for h in heads] for row in a]

    def col_std(m: list[list[float]]) -> float:
        return sum(_std([r[h] for r in m]) for h in heads) / len(heads)

    def step(m: list[list[float]]) -> float:
        diffs = [abs(m[t][h] - m[t - 1][h]) for t in range(1, len(m)) for h in heads]
        return sum(diffs) / len(diffs)

    return [col_std(beta), col_std(g), step(beta), step(g)]


def _softplus(x: float) -> float:
    return x if x > 20 else math.log1p(math.exp(x))


def verdict(
    summary: Mapping[str, Any] | None, thresholds: GateThresholds
) -> tuple[bool | None, str]:
    """``(fit, line)``: True when the gates vary enough, False when flat,
    None when they were not measured (both make a scenario inconclusive)."""
    if not summary or not summary.get("measured"):
        return None, "gates not measured: no Gated DeltaNet forward of a real step was observed"
    beta, g = float(summary["beta_std"]), float(summary["g_std"])
    detail = (
        f"beta std {beta:.3g}, g std {g:.3g}, step |dbeta| {float(summary['beta_step']):.3g}, "
        f"|dg| {float(summary['g_step']):.3g} (flattest of {len(summary['layers'])} layers, "
        f"{summary['observations']} forwards)"
    )
    if beta < thresholds.min_beta_std or g < thresholds.min_g_std:
        return False, (
            f"gates flat: {detail}; need beta std >= {thresholds.min_beta_std}, "
            f"g std >= {thresholds.min_g_std}"
        )
    return True, f"gates vary: {detail}"
