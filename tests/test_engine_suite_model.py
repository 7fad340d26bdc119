"""The tiny model's config: valid, deterministic, validated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gdn_backport.engine_suite.model import (
    ARCHITECTURE,
    ModelShape,
    config_dict,
    write_model_dir,
)


def test_default_is_the_verified_shape() -> None:
    cfg = config_dict(ModelShape())
    text = cfg["text_config"]
    assert cfg["architectures"] == [ARCHITECTURE]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (2, 4)
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
    assert (text["hidden_size"], text["vocab_size"], text["mtp_num_hidden_layers"]) == (
        512,
        4096,
        1,
    )
    assert text["rope_parameters"]["mrope_section"] == [11, 11, 10]
    # Special ids stay inside the vocabulary, above every prompt token.
    low, high = ModelShape().prompt_token_range
    assert high <= cfg["image_token_id"] < cfg["vision_end_token_id"] < text["vocab_size"]
    assert low > text["eos_token_id"]


def test_written_folder_is_json_and_deterministic(tmp_path: Path) -> None:
    shape = ModelShape(num_layers=8, linear_num_value_heads=8)
    a = write_model_dir(tmp_path / "a", shape) / "config.json"
    b = write_model_dir(tmp_path / "b", shape) / "config.json"
    assert a.read_bytes() == b.read_bytes()
    data = json.loads(a.read_text())
    assert data["text_config"]["layer_types"].count("full_attention") == 2
    assert shape.digest() == ModelShape(num_layers=8, linear_num_value_heads=8).digest()
    assert shape.digest() != ModelShape().digest()
    assert sorted(p.name for p in a.parent.iterdir()) == ["config.json"]


def test_head_dim_drives_the_mrope_sections() -> None:
    text = config_dict(ModelShape(head_dim=128))["text_config"]
    assert sum(text["rope_parameters"]["mrope_section"]) == 128 // 4 // 2


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_size": -4}, "hidden_size"),
        ({"num_layers": True}, "num_layers"),
        ({"dtype": "fp8"}, "dtype"),
        ({"full_attention_interval": 1}, "full_attention_interval"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"linear_num_key_heads": 3}, "linear_num_key_heads"),
        ({"head_dim": 100}, "head_dim"),
    ],
)
def test_bad_values_are_refused_by_key(changes: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=rf"model config: {key} = "):
        ModelShape(**changes)  # type: ignore[arg-type]


def test_unknown_key_is_named() -> None:
    with pytest.raises(ValueError, match="model config: num_heads: unknown key"):
        ModelShape.from_json({"num_heads": 4})
    assert ModelShape.from_json(ModelShape().to_json()) == ModelShape()
