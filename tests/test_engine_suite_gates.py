"""The gate meter on layer objects, and the fitness verdict."""

from __future__ import annotations

from typing import Any

import pytest

from gdn_backport.engine_suite.gates import (
    GateMeter,
    GateThresholds,
    find_gdn_layers,
    gate_stats,
    verdict,
)


class Layer:
    def __init__(self) -> None:
        self.A_log = [0.0, 1.0]
        self.dt_bias = [-3.0, -1.0]

    def _forward_core(self, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> str:
        return "out"


ROWS_B = [[float(t % 5) - 2, float(t % 3)] for t in range(12)]
ROWS_A = [[float(t % 4) - 1, 0.5 * t] for t in range(12)]


def test_meter_sits_on_the_object_and_calls_the_class_method_as_it_is_now() -> None:
    tokens: list[int | None] = [None]
    meter = GateMeter(lambda: tokens[0])
    layer = Layer()
    layers = {"l0": layer, "attn": object()}
    assert list(find_gdn_layers(layers)) == ["l0"]
    assert meter.attach(layers) == 1 and meter.attach(layers) == 1
    assert (
        "_forward_core" not in Layer.__dict__
        or Layer.__dict__["_forward_core"] is not layer._forward_core
    )
    # Outside a real step (tokens None): nothing is measured, the call goes through.
    assert layer._forward_core(mixed_qkv=None, b=ROWS_B, a=ROWS_A, core_attn_out=None) == "out"
    assert not meter.summary()["measured"]

    # A patch applied to the class later is what runs.
    def patched(self: Layer, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> str:
        return "patched"

    original = Layer._forward_core
    Layer._forward_core = patched  # type: ignore[method-assign]
    try:
        tokens[0] = 12
        assert (
            layer._forward_core(mixed_qkv=None, b=ROWS_B, a=ROWS_A, core_attn_out=None) == "patched"
        )
    finally:
        Layer._forward_core = original  # type: ignore[method-assign]
    summary = meter.summary()
    assert summary["measured"] and summary["observations"] == 1
    assert summary["beta_std"] == pytest.approx(
        gate_stats(ROWS_B, ROWS_A, layer.A_log, layer.dt_bias)[0], abs=1e-6
    )


def test_host_statistics_match_torch() -> None:
    torch = pytest.importorskip("torch")
    layer = Layer()
    stats = gate_stats(ROWS_B, ROWS_A, layer.A_log, layer.dt_bias)
    meter = GateMeter(lambda: 12)
    t_layer = Layer()
    t_layer.A_log = torch.tensor(layer.A_log)  # type: ignore[assignment]
    t_layer.dt_bias = torch.tensor(layer.dt_bias)  # type: ignore[assignment]
    meter.observe("l", t_layer, torch.tensor(ROWS_B), torch.tensor(ROWS_A))
    s = meter.summary()
    assert [s["beta_std"], s["g_std"], s["beta_step"], s["g_step"]] == pytest.approx(
        stats, rel=1e-4
    )


def test_verdict() -> None:
    fit, line = verdict(None, GateThresholds())
    assert fit is None and "not measured" in line
    flat = {
        "measured": True,
        "layers": {"l": {}},
        "observations": 3,
        "beta_std": 0.0001,
        "g_std": 0.0002,
        "beta_step": 0.0,
        "g_step": 0.0,
    }
    fit, line = verdict(flat, GateThresholds())
    assert fit is False and line.startswith("gates flat: beta std 0.0001")
    fit, line = verdict({**flat, "beta_std": 0.2, "g_std": 1.5}, GateThresholds())
    assert fit is True and line.startswith("gates vary: beta std 0.2, g std 1.5")
