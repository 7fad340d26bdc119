"""Seeded weight rules on a fake named-parameter module (torch on the CPU)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from gdn_backport.engine_suite import weights  # noqa: E402
from gdn_backport.engine_suite.gates import GateMeter, GateThresholds, verdict  # noqa: E402
from gdn_backport.engine_suite.weights import WeightRules, initialize, kind_of  # noqa: E402

HIDDEN, HV, KEY, CONV_K = 64, 4, 32, 4


class GemmaRMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))


class RMSNormGated(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class Linear(nn.Module):
    def __init__(self, fan_in: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, fan_in))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, n))


class ParallelLMHead(VocabParallelEmbedding):
    pass


class GDN(nn.Module):
    def __init__(self, reverse: bool = False) -> None:
        super().__init__()
        parts = [
            ("in_proj_ba", Linear(HIDDEN, 2 * HV)),
            ("in_proj_qkvz", Linear(HIDDEN, 4 * KEY)),
            ("norm", RMSNormGated(KEY)),
            ("out_proj", Linear(KEY, HIDDEN)),
        ]
        for name, module in reversed(parts) if reverse else parts:
            self.add_module(name, module)
        conv = nn.Module()
        conv.weight = nn.Parameter(torch.empty(3 * KEY, 1, CONV_K))
        self.conv1d = conv
        self.A_log = nn.Parameter(torch.empty(HV))
        self.dt_bias = nn.Parameter(torch.ones(HV))


class Model(nn.Module):
    """Named like Qwen3.5's vLLM model; ``reverse`` registers in another order."""

    def __init__(self, reverse: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        inner = nn.Module()
        inner.embed_tokens = VocabParallelEmbedding(256, HIDDEN)
        layer = nn.Module()
        layer.input_layernorm = GemmaRMSNorm(HIDDEN)
        layer.linear_attn = GDN(reverse)
        inner.layers = nn.ModuleList([layer])
        inner.norm = GemmaRMSNorm(HIDDEN)
        if reverse:
            self.lm_head = ParallelLMHead(256, HIDDEN)
            self.model = inner
        else:
            self.model = inner
            self.lm_head = ParallelLMHead(256, HIDDEN)
        self.to(dtype)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_kinds_by_name_and_norm_class() -> None:
    assert kind_of("model.layers.0.linear_attn.A_log", [], 1) == "A_log"
    assert kind_of("model.layers.0.linear_attn.dt_bias", [], 1) == "dt_bias"
    assert (
        kind_of("model.layers.0.linear_attn.in_proj_ba.weight", ["MergedColumnParallelLinear"], 2)
        == "gate_proj"
    )
    assert kind_of("lm_head.weight", ["ParallelLMHead", "VocabParallelEmbedding"], 2) == "lm_head"
    assert kind_of("model.embed_tokens.weight", ["VocabParallelEmbedding"], 2) == "embedding"
    # Qwen3.5's layer norms are vLLM's GemmaRMSNorm: x * (1 + w), so w ~ 0.
    assert (
        kind_of("model.norm.weight", ["Qwen3NextRMSNorm", "GemmaRMSNorm", "CustomOp"], 1)
        == "norm_zero"
    )
    assert (
        kind_of("model.layers.0.linear_attn.norm.weight", ["RMSNormGated", "CustomOp"], 1)
        == "norm_unit"
    )
    assert kind_of("model.layers.0.linear_attn.norm.bias", ["LayerNorm"], 1) == "bias"
    assert (
        kind_of("model.layers.0.self_attn.o_proj.weight", ["RowParallelLinear"], 2)
        == "residual_out"
    )
    assert kind_of("model.fc.weight", ["ColumnParallelLinear"], 2) == "linear"
    assert kind_of("model.layers.0.attn_layer_scale", [], 1) == "fallback"


def test_values_do_not_depend_on_order_or_dtype() -> None:
    rules = WeightRules(seed=7)
    a, b = Model(), Model(reverse=True)
    initialize(a, rules, "M")
    initialize(b, rules, "M")
    pa, pb = _params(a), _params(b)
    assert list(pa) != list(pb) and set(pa) == set(pb)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    c = Model(dtype=torch.bfloat16)
    initialize(c, rules, "M")
    for name, p in _params(c).items():
        assert torch.allclose(p.float(), pa[name], atol=0.02, rtol=0.01), name
    d = Model()
    initialize(d, WeightRules(seed=8), "M")
    assert not torch.equal(_params(d)["lm_head.weight"], pa["lm_head.weight"])


def test_ranges_of_the_gate_parameters_and_norms() -> None:
    model = Model().requires_grad_(False)
    report = initialize(model, WeightRules(), "M")
    gdn = model.model.layers[0].linear_attn
    a = torch.exp(gdn.A_log.detach())
    assert bool(((a >= 1.0) & (a <= 16.0)).all())
    dt = torch.nn.functional.softplus(gdn.dt_bias.detach())
    assert bool(((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all())
    assert float(model.model.norm.weight.abs().max()) < 0.5
    assert abs(float(gdn.norm.weight.mean()) - 1.0) < 0.1
    assert abs(float(model.model.embed_tokens.weight.std()) - 1.0) < 0.1
    # Fan-in scaling: a linear keeps unit-RMS inputs at unit RMS.
    assert abs(float(gdn.in_proj_qkvz.weight.std()) * math.sqrt(HIDDEN) - 1.0) < 0.1
    assert abs(float(gdn.conv1d.weight.std()) * math.sqrt(CONV_K) - 1.0) < 0.15
    assert report.kinds["A_log"] == report.kinds["dt_bias"] == 1 and not report.fallback


def _gates(model: Model, tokens: int = 256) -> dict[str, object]:
    gdn = model.model.layers[0].linear_attn
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(0))
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # what the input norm hands the layer
    ba = x @ gdn.in_proj_ba.weight.detach().T
    b, a = ba.chunk(2, dim=-1)  # Qwen3.5's split_ba: b first
    meter = GateMeter(lambda: tokens)
    meter.observe("layer", gdn, b, a)
    return meter.summary()


def test_gate_gain_makes_the_gates_vary_and_dummy_weights_do_not() -> None:
    model = Model()
    initialize(model, WeightRules(), "M")
    fit, line = verdict(_gates(model), GateThresholds())
    assert fit is True and line.startswith("gates vary")
    # vLLM's own dummy weights: uniform in [-1e-3, 1e-3] everywhere.
    dummy = Model()
    with torch.no_grad():
        for p in dummy.parameters():
            p.uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(1))
    fit, line = verdict(_gates(dummy), GateThresholds())
    assert fit is False and line.startswith("gates flat")


def test_install_wraps_the_loader_and_undoes() -> None:
    calls: list[str] = []

    class Loader:
        def load_weights(self, model: nn.Module, model_config: object) -> str:
            calls.append("vllm")
            return "loaded"

    original = Loader.load_weights
    undo = weights.install(WeightRules(seed=3), Loader)
    model = Model()
    before = len(weights.REPORTS)
    assert Loader().load_weights(model, None) == "loaded"
    assert calls == ["vllm"] and len(weights.REPORTS) == before + 1
    assert weights.REPORTS[-1].namespace == "Model"
    assert float(model.lm_head.weight.detach().std()) > 0.1
    undo()
    assert Loader.load_weights is original


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="gate_gain"):
        WeightRules(gate_gain=0)
    with pytest.raises(ValueError, match="a_range"):
        WeightRules(a_range=(16.0, 1.0))
    with pytest.raises(ValueError, match="unknown key"):
        WeightRules.from_json({"gain": 1})
    assert WeightRules.from_json(WeightRules().to_json()) == WeightRules()
