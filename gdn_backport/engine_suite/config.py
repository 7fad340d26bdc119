"""How one engine is built: the LLM settings a scenario varies, as data.

:meth:`EngineConfig.llm_kwargs` turns it into ``vllm.LLM(**kwargs)`` for
vLLM 0.25.1's ``EngineArgs`` (engine/arg_utils.py): dummy load format (our
seeded weights replace it, :mod:`.weights`), no tokenizer, the Triton GDN
prefill backend (FlashInfer is not in the GPU machine's bundle), text only,
and ``async_scheduling=False`` so that each ``LLMEngine.step()`` is exactly
one schedule + one ``execute_model`` and a step's outputs line up with that
step's metadata builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["CUDAGRAPH_MODES", "ENGINE_ENV", "EngineConfig"]

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
MAMBA_CACHE_MODES = ("none", "align", "all")

# Set in every engine child before vLLM is imported: the engine core runs in
# the driver's process (so its hooks see the runner and the builder), no
# FlashInfer sampler, nothing phones home, nothing is downloaded.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class EngineConfig:
    num_speculative_tokens: int = 0
    enforce_eager: bool = True
    # None: vLLM's default for the model (FULL_AND_PIECEWISE for GDN models)
    # when not eager.
    cudagraph_mode: str | None = None
    enable_prefix_caching: bool = False
    mamba_cache_mode: str | None = None
    max_model_len: int = 256
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.3
    attention_backend: str | None = None
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            self._bad("num_speculative_tokens", "expected >= 0")
        if self.cudagraph_mode is not None and self.cudagraph_mode not in CUDAGRAPH_MODES:
            self._bad("cudagraph_mode", f"expected one of {', '.join(CUDAGRAPH_MODES)}")
        if self.enforce_eager and self.cudagraph_mode not in (None, "NONE"):
            self._bad("cudagraph_mode", "CUDA graphs need enforce_eager=False")
        if self.mamba_cache_mode is not None and self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            self._bad("mamba_cache_mode", f"expected one of {', '.join(MAMBA_CACHE_MODES)}")
        if self.max_model_len < 16 or self.max_num_seqs < 1:
            self._bad("max_model_len" if self.max_model_len < 16 else "max_num_seqs", "too small")
        if not 0 < self.gpu_memory_utilization <= 1:
            self._bad("gpu_memory_utilization", "expected in (0, 1]")

    def _bad(self, key: str, why: str) -> None:
        raise ValueError(f"engine config: {key} = {getattr(self, key)!r}: {why}")

    @property
    def graphs(self) -> str:
        """The CUDA-graph setting in words, for tables."""
        if self.enforce_eager:
            return "eager"
        return self.cudagraph_mode or "default graphs"

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"engine config: {unknown[0]}: unknown key")
        return cls(**data)

    def llm_kwargs(self, model_dir: str, seed: int, dtype: str) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model": model_dir,
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "language_model_only": True,
            "enforce_eager": self.enforce_eager,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": seed,
            "dtype": dtype,
            "tensor_parallel_size": 1,
            "enable_prefix_caching": self.enable_prefix_caching,
            "gdn_prefill_backend": "triton",
            "async_scheduling": False,
            "disable_log_stats": False,
        }
        if self.num_speculative_tokens:
            kw["speculative_config"] = {
                "method": "mtp",
                "num_speculative_tokens": self.num_speculative_tokens,
            }
        if self.cudagraph_mode is not None and not self.enforce_eager:
            kw["compilation_config"] = {"cudagraph_mode": self.cudagraph_mode}
        optional = {
            "mamba_cache_mode": self.mamba_cache_mode,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
        }
        kw.update({k: v for k, v in optional.items() if v is not None})
        if self.attention_backend:
            kw["attention_config"] = {"backend": self.attention_backend}
        return kw
