"""The tiny model the engine suite drives: a Qwen3.5 dense text model with one
MTP layer, written as a folder holding only ``config.json``.

vLLM loads it with ``load_format="dummy"`` and ``language_model_only=True``;
the weights come from :mod:`.weights`, the prompts are token ids, so no
tokenizer and no download are needed. The shape defaults are the ones a
colleague verified on the H200 with vLLM 0.25.1 (three Gated DeltaNet layers,
one full-attention layer, linear key/value heads 2/4 of dim 128, hidden 512,
vocabulary 4096).

The same :class:`ModelShape` always gives the same bytes, so a model folder
can be named by its digest and shared by every engine of a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURE", "MTP_ARCHITECTURE", "ModelShape", "config_dict", "write_model_dir"]

# What the model registry of the engine under test must know (preflight
# checks its registry for both).
ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
MTP_ARCHITECTURE = "Qwen3_5MTP"
DTYPES = ("bfloat16", "float16")
# Special ids sit at the top of the vocabulary; prompts never use them.
RESERVED_TOP = 4
RESERVED_BOTTOM = 16


@dataclass(frozen=True)
class ModelShape:
    """The knobs of the tiny model; every other config value is derived."""

    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_layers: int = 4
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    mtp_layers: int = 1
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "dtype":
                if value not in DTYPES:
                    _bad(f.name, value, f"one of {', '.join(DTYPES)}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _bad(f.name, value, "a positive integer")
        if self.vocab_size < 64:
            _bad("vocab_size", self.vocab_size, "at least 64 (prompts avoid the reserved ids)")
        if not self.linear_layers:
            _bad(
                "full_attention_interval",
                self.full_attention_interval,
                "leaves no linear_attention (Gated DeltaNet) layer: nothing to test",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            _bad("num_key_value_heads", self.num_key_value_heads, "must divide num_attention_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            _bad(
                "linear_num_key_heads",
                self.linear_num_key_heads,
                "must divide linear_num_value_heads",
            )
        if self.head_dim % 8:
            # A quarter of the head is rotary, and M-RoPE halves that again.
            _bad("head_dim", self.head_dim, "a multiple of 8 (partial rotary factor 0.25)")

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_layers)
        ]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == "linear_attention"]

    @property
    def prompt_token_range(self) -> tuple[int, int]:
        """Token ids prompts may use: ``[low, high)``, clear of special ids."""
        return RESERVED_BOTTOM, self.vocab_size - RESERVED_TOP

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelShape:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(
                    f"model config: {key}: unknown key (known: {', '.join(sorted(known))})"
                )
        return cls(**data)

    def digest(self) -> str:
        """A short name for this shape's config: equal shapes, equal digests."""
        return hashlib.sha256(_dump(config_dict(self))).hexdigest()[:16]


def _bad(key: str, value: object, expected: str) -> None:
    raise ValueError(f"model config: {key} = {value!r}: expected {expected}")


def _mrope_section(rotary_half: int) -> list[int]:
    # Qwen3.5's interleaved M-RoPE splits the rotary half over (t, h, w);
    # for head_dim 256 this is upstream's [11, 11, 10].
    base, rest = divmod(rotary_half, 3)
    return [base + (rest > 0), base + (rest > 1), base]


def config_dict(shape: ModelShape) -> dict[str, Any]:
    """The ``config.json`` of ``shape`` (text model + MTP + a 1-block vision
    tower that ``language_model_only=True`` never builds)."""
    rotary_half = shape.head_dim // 4 // 2
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "layer_types": shape.layer_types,
        "full_attention_interval": shape.full_attention_interval,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "attn_output_gate": True,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": _mrope_section(rotary_half),
            "mrope_interleaved": True,
        },
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "linear_conv_kernel_dim": shape.linear_conv_kernel_dim,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": shape.mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": shape.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    vision = {
        "model_type": "qwen3_5",
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 1,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": shape.hidden_size,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [],
    }
    top = shape.vocab_size
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": top - 4,
        "video_token_id": top - 3,
        "vision_start_token_id": top - 2,
        "vision_end_token_id": top - 1,
        "tie_word_embeddings": False,
        "torch_dtype": shape.dtype,
        "dtype": shape.dtype,
    }


def _dump(config: dict[str, Any]) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def write_model_dir(folder: Path, shape: ModelShape | None = None) -> Path:
    """Write ``folder/config.json`` for ``shape`` (default shape when None)
    and return ``folder``. Rewrites only when the bytes differ, so engines
    already reading the folder never see a half-written file."""
    data = _dump(config_dict(shape or ModelShape()))
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "config.json"
    if target.exists() and target.read_bytes() == data:
        return folder
    tmp = folder / ".config.json.tmp"
    tmp.write_bytes(data)
    tmp.replace(target)
    return folder
