"""engine_suite/config.py: an engine's settings as data, checked, and as vllm.LLM kwargs."""

from __future__ import annotations

import pytest

from gdn_backport.engine_suite.config import CUDAGRAPH_MODES, ENGINE_ENV, EngineConfig


def test_the_default_is_a_small_eager_engine() -> None:
    cfg = EngineConfig()
    assert cfg.graphs == "eager"
    kw = cfg.llm_kwargs("/m", seed=3, dtype="float16")
    assert kw["model"] == "/m" and kw["seed"] == 3 and kw["dtype"] == "float16"
    assert kw["load_format"] == "dummy" and kw["async_scheduling"] is False
    assert kw["gdn_prefill_backend"] == "triton" and kw["enforce_eager"] is True
    for absent in (
        "speculative_config",
        "compilation_config",
        "attention_config",
        "mamba_cache_mode",
        "max_num_batched_tokens",
        "num_gpu_blocks_override",
    ):
        assert absent not in kw  # fmt: skip


def test_what_a_scenario_varies_reaches_the_kwargs() -> None:
    cfg = EngineConfig(
        num_speculative_tokens=3,
        enforce_eager=False,
        cudagraph_mode="FULL",
        mamba_cache_mode="align",
        max_num_batched_tokens=64,
        attention_backend="FLASH_ATTN",
        num_gpu_blocks_override=40,
    )
    kw = cfg.llm_kwargs("/m", 0, "bfloat16")
    assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL"}
    assert kw["attention_config"] == {"backend": "FLASH_ATTN"}
    assert (kw["mamba_cache_mode"], kw["max_num_batched_tokens"]) == ("align", 64)
    assert kw["num_gpu_blocks_override"] == 40
    assert cfg.graphs == "FULL"
    assert EngineConfig(enforce_eager=False).graphs == "default graphs"
    assert "compilation_config" not in EngineConfig(enforce_eager=False).llm_kwargs("/m", 0, "x")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_speculative_tokens": -1}, "num_speculative_tokens = -1: expected >= 0"),
        ({"cudagraph_mode": "SOME", "enforce_eager": False}, "expected one of NONE, PIECEWISE"),
        ({"cudagraph_mode": "FULL"}, "CUDA graphs need enforce_eager=False"),
        ({"mamba_cache_mode": "most"}, "mamba_cache_mode = 'most': expected one of none"),
        ({"max_model_len": 8}, "max_model_len = 8: too small"),
        ({"max_num_seqs": 0}, "max_num_seqs = 0: too small"),
        ({"gpu_memory_utilization": 0.0}, r"expected in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, r"expected in \(0, 1\]"),
    ],
)
def test_bad_settings_name_the_key(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"engine config: .*{message}"):
        EngineConfig(**changes)  # type: ignore[arg-type]


def test_json_round_trips_and_refuses_unknown_keys() -> None:
    cfg = EngineConfig(num_speculative_tokens=2, enable_prefix_caching=True)
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="engine config: speculative: unknown key"):
        EngineConfig.from_json({"speculative": 2})
    other = cfg.replace(max_num_seqs=4)
    assert other.max_num_seqs == 4 and cfg.max_num_seqs == 16
    with pytest.raises(ValueError, match="too small"):
        cfg.replace(max_num_seqs=0)


def test_the_engine_environment_keeps_the_run_offline_and_in_process() -> None:
    assert ENGINE_ENV["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert ENGINE_ENV["HF_HUB_OFFLINE"] == "1" and ENGINE_ENV["TRANSFORMERS_OFFLINE"] == "1"
    assert "NONE" in CUDAGRAPH_MODES
