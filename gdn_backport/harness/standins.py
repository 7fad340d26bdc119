"""Small stand-ins for the parts of vLLM the GDN layer imports but never runs.

The harness executes a tree's own GDN module and the kernel modules it
imports (Triton causal conv1d, the FLA ops) from source. Everything else in
vLLM is replaced here: either by a hand-written stand-in that behaves like
the real thing for the few calls made on the ``_forward_core`` path
(platform, forward context, logger, custom-op registration, ...) or by an
*auto-stub*: a module whose attributes are inert classes, enough for class
definitions, decorators and annotations at import time. Which names were
auto-stubbed is recorded so a failure can name them.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "STANDIN_BUILDERS",
    "ConfigNode",
    "HarnessContext",
    "is_stub",
    "make_stub",
    "make_stub_module",
    "module_constants",
    "vllm_config",
]


# --------------------------------------------------------------------------
# Auto-stubs
# --------------------------------------------------------------------------


class _StubMeta(type):
    """Metaclass of auto-stub classes: inert under attribute access and calls.

    A stub used as a decorator (one callable argument) returns its argument,
    so ``@support_torch_compile`` or ``@SomeOp.register("x")`` leave the
    decorated object unchanged. A stub is falsy, so module-level feature
    probes (``if rocm_aiter_ops.is_enabled():``) take the "absent" branch.
    Classes derived from a stub behave normally.
    """

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return make_stub(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls.__dict__.get("_gdn_stub", False):
            return super().__call__(*args, **kwargs)
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return make_stub(f"{cls.__qualname__}()")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __bool__(cls) -> bool:
        return not cls.__dict__.get("_gdn_stub", False)

    def __iter__(cls) -> Iterator[Any]:
        return iter(())


def make_stub(qualname: str) -> type:
    """An inert class standing for ``qualname`` (see :class:`_StubMeta`)."""
    return _StubMeta(qualname.rsplit(".", 1)[-1], (), {"_gdn_stub": True, "__qualname__": qualname})


def is_stub(obj: object) -> bool:
    return isinstance(obj, _StubMeta) and bool(obj.__dict__.get("_gdn_stub", False))


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        stub = make_stub(f"{self.__name__}.{name}")
        setattr(self, name, stub)
        return stub


def make_stub_module(name: str) -> types.ModuleType:
    module = _StubModule(name)
    module.__path__ = []
    module.__gdn_stub__ = True  # type: ignore[attr-defined]
    return module


# --------------------------------------------------------------------------
# The context the stand-ins read: device and the current forward context
# --------------------------------------------------------------------------


class HarnessContext:
    """What the stand-ins need from the harness: the device and the metadata.

    ``forward_context`` is what ``get_forward_context()`` returns inside the
    tree's code; the harness sets it around each call of ``_forward_core``.
    """

    def __init__(self, tree: Path, device: str) -> None:
        self.tree = tree
        self.device = torch.device(device)
        self.forward_context: Any = None

    @contextlib.contextmanager
    def forward(self, attn_metadata: Any, layers: dict[str, Any]) -> Iterator[None]:
        previous = self.forward_context
        self.forward_context = types.SimpleNamespace(
            attn_metadata=attn_metadata,
            no_compile_layers=layers,
            virtual_engine=0,
        )
        try:
            yield
        finally:
            self.forward_context = previous


def _module(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__dict__.update(attrs)
    return module


def _with_stub_fallback(module: types.ModuleType) -> types.ModuleType:
    """Let ``module`` answer unknown names with auto-stubs (names only, no values)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        stub = make_stub(f"{module.__name__}.{name}")
        setattr(module, name, stub)
        return stub

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


# --------------------------------------------------------------------------
# Hand-written stand-ins
# --------------------------------------------------------------------------


class _Logger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """vLLM's logger adds ``*_once`` methods; the harness keeps them quiet."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(f"gdn_backport.harness.vllm.{name}"), {})
        self._seen: set[tuple[str, str]] = set()

    def _once(self, level: str, msg: str, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("scope", None)
        key = (level, msg)
        if key not in self._seen:
            self._seen.add(key)
            getattr(self, level)(msg, *args, **kwargs)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once("info", msg, *args, **kwargs)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once("warning", msg, *args, **kwargs)

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self._once("debug", msg, *args, **kwargs)


def _logger_module(ctx: HarnessContext) -> types.ModuleType:
    return _module(
        "vllm.logger",
        "stand-in: vLLM's logger factory",
        init_logger=_Logger,
        logger=_Logger("vllm"),
    )


class _Platform:
    """``current_platform``: CUDA when the harness runs on CUDA, else "interpreted".

    ``is_cpu()`` is always False: on CPU the harness runs the tree's Triton
    kernels under ``TRITON_INTERPRET=1`` instead of vLLM's CPU fallbacks.
    ``is_device_capability``/``has_device_capability`` are False so that the
    tree picks its Triton/FLA prefill kernels, never FlashInfer or CuteDSL:
    those are not part of the harness.
    """

    def __init__(self, ctx: HarnessContext) -> None:
        self._cuda = ctx.device.type == "cuda"
        self.device_type = "cuda" if self._cuda else "cpu"
        self.device_name = self.device_type
        self.dispatch_key = "CUDA" if self._cuda else "CPU"
        self.ray_device_key = "GPU" if self._cuda else ""
        self.simple_compile_backend = "inductor"

    def is_cuda(self) -> bool:
        return self._cuda

    def is_cuda_alike(self) -> bool:
        return self._cuda

    def is_device_capability(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def has_device_capability(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def is_device_capability_family(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def is_arch_support_pdl(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> Any:
        if not self._cuda:
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return types.SimpleNamespace(major=major, minor=minor, to_int=lambda: major * 10 + minor)

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if self._cuda else "cpu"

    def num_compute_units(self, device_id: int = 0) -> int:
        if not self._cuda:
            return 1
        return int(torch.cuda.get_device_properties(device_id).multi_processor_count)

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("is_", "support", "use_")) or "support" in name:
            return lambda *args, **kwargs: False
        raise AttributeError(f"gdn-backport harness: no stand-in for current_platform.{name}")


def _platforms_module(ctx: HarnessContext) -> types.ModuleType:
    return _with_stub_fallback(
        _module(
            "vllm.platforms",
            "stand-in: vLLM's platform probe",
            current_platform=_Platform(ctx),
            __path__=[],
        )
    )


def _forward_context_module(ctx: HarnessContext) -> types.ModuleType:
    def get_forward_context() -> Any:
        if ctx.forward_context is None:
            raise RuntimeError("gdn-backport harness: no forward context is set")
        return ctx.forward_context

    def is_forward_context_available() -> bool:
        return ctx.forward_context is not None

    return _with_stub_fallback(
        _module(
            "vllm.forward_context",
            "stand-in: the forward context the harness sets around each step",
            get_forward_context=get_forward_context,
            is_forward_context_available=is_forward_context_available,
            ForwardContext=types.SimpleNamespace,
        )
    )


class ConfigNode(types.SimpleNamespace):
    """A node of the stand-in config: a missing field names its path.

    The error is an ``AttributeError``, so ``getattr(cfg, name, default)``
    probes still get their default.
    """

    def __init__(self, path: str, **fields: Any) -> None:
        super().__init__(**fields)
        object.__setattr__(self, "_gdn_path", path)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        path = self.__dict__.get("_gdn_path", "vllm_config")
        raise AttributeError(f"gdn-backport harness: the config stand-in has no {path}.{name}")


# The sections of the config that are nodes (more fields merge into them).
_SECTIONS = ("model_config", "cache_config", "compilation_config", "parallel_config")


def vllm_config(**more: Any) -> ConfigNode:
    """The harness's one vLLM config: the Triton/FLA prefill backend (the
    one the harness runs everywhere), no prefix-caching checkpoints ("align":
    the metadata fields of that feature stay None), no speculative decoding,
    an HF config with no fields (the tree's ``getattr(...,
    "linear_key_head_dim", None)`` probes, backend choice and its log line,
    see "unknown"; trees read it as ``hf_text_config`` or, in
    ChunkGatedDeltaRule's log, ``hf_config``). ``more``: a dict of fields
    for a section (``cache_config={"block_size": 16}``), or a value for a
    top-level field (``speculative_config=...``) that replaces it."""
    model = "vllm_config.model_config"
    fields: dict[str, dict[str, Any]] = {
        "model_config": {
            "hf_config": ConfigNode(f"{model}.hf_config"),
            "hf_text_config": ConfigNode(f"{model}.hf_text_config"),
        },
        "cache_config": {"mamba_cache_mode": "none"},
        "compilation_config": {},
        "parallel_config": {},
    }
    top: dict[str, Any] = {
        "additional_config": {"gdn_prefill_backend": "triton"},
        "speculative_config": None,
    }
    for name, value in more.items():
        if name in _SECTIONS:
            fields[name].update(value)
        else:
            top[name] = value
    nodes = {name: ConfigNode(f"vllm_config.{name}", **f) for name, f in fields.items()}
    return ConfigNode("vllm_config", **top, **nodes)


def _config_module(ctx: HarnessContext) -> types.ModuleType:
    config = vllm_config()
    return _with_stub_fallback(
        _module(
            "vllm.config",
            "stand-in: vLLM's config, one fixed config for the harness",
            get_current_vllm_config=lambda: config,
            __path__=[],
        )
    )


def _distributed_module(ctx: HarnessContext) -> types.ModuleType:
    def divide(numerator: int, denominator: int) -> int:
        assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
        return numerator // denominator

    return _with_stub_fallback(
        _module(
            "vllm.distributed",
            "stand-in: one rank, tensor parallel size 1",
            divide=divide,
            get_tensor_model_parallel_world_size=lambda: 1,
            get_tensor_model_parallel_rank=lambda: 0,
            __path__=[],
        )
    )


class CustomOp(nn.Module):
    """vLLM's ``CustomOp``: ``forward`` calls ``_forward_method`` or ``forward_native``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        method = self.__dict__.get("_forward_method") or self.forward_native
        return method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.forward_native")

    @classmethod
    def register(cls, name: str) -> Callable[[Any], Any]:
        return lambda op: op

    @classmethod
    def register_oot(cls, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        return lambda op: op

    @classmethod
    def enabled(cls) -> bool:
        return True


class PluggableLayer(nn.Module):
    """vLLM's ``PluggableLayer``: a plain module whose ``register`` is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @classmethod
    def register(cls, name: str) -> Callable[[Any], Any]:
        return lambda layer: layer

    @classmethod
    def register_oot(cls, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        return lambda layer: layer


def _custom_op_module(ctx: HarnessContext) -> types.ModuleType:
    return _with_stub_fallback(
        _module(
            "vllm.model_executor.custom_op",
            "stand-in: CustomOp / PluggableLayer without registries",
            CustomOp=CustomOp,
            PluggableLayer=PluggableLayer,
        )
    )


def _torch_utils_module(ctx: HarnessContext) -> types.ModuleType:
    def direct_register_custom_op(*args: Any, **kwargs: Any) -> None:
        # The harness calls _forward_core directly, never through torch.ops.
        return None

    def async_tensor_h2d(data: Any, dtype: Any = None, target_device: Any = None, **kw: Any) -> Any:
        device = kw.get("device", target_device)
        return torch.as_tensor(data, dtype=dtype, device=device)

    return _with_stub_fallback(
        _module(
            "vllm.utils.torch_utils",
            "stand-in: custom-op registration and small tensor helpers",
            direct_register_custom_op=direct_register_custom_op,
            async_tensor_h2d=async_tensor_h2d,
            LayerNameType=str,
            _encode_layer_name=lambda name: name,
            _resolve_layer_name=lambda name: name,
            PIN_MEMORY=False,
            is_pin_memory_available=lambda: False,
        )
    )


def _platform_utils_module(ctx: HarnessContext) -> types.ModuleType:
    platform = _Platform(ctx)
    return _with_stub_fallback(
        _module(
            "vllm.utils.platform_utils",
            "stand-in: device properties",
            num_compute_units=platform.num_compute_units,
            get_device_name_as_file_name=lambda device_id=0: platform.get_device_name(device_id),
            is_pin_memory_available=lambda: False,
        )
    )


def _gpu_sync_debug_module(ctx: HarnessContext) -> types.ModuleType:
    return _with_stub_fallback(
        _module(
            "vllm.utils.gpu_sync_debug",
            "stand-in: GPU sync checks are off",
            gpu_sync_allowed=lambda *args, **kwargs: contextlib.nullcontext(),
        )
    )


def module_constants(path: Path) -> dict[str, Any]:
    """Module-level ``NAME = <literal>`` assignments of a tree file."""
    if not path.is_file():
        return {}
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id.isupper():
                with contextlib.suppress(ValueError, TypeError, SyntaxError, RecursionError):
                    found[target.id] = ast.literal_eval(node.value)
    return found


def _function_from_tree(path: Path, name: str, namespace: dict[str, Any]) -> Any:
    """Compile one top-level function of a tree file into ``namespace``."""
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            module = ast.Module(body=[node], type_ignores=[])
            exec(compile(module, str(path), "exec"), namespace)
            return namespace[name]
    return None


def _attention_utils_module(ctx: HarnessContext) -> types.ModuleType:
    """Constants and ``compute_causal_conv1d_metadata`` taken from the tree's own file."""
    import numpy as np

    path = ctx.tree / "vllm" / "v1" / "attention" / "backends" / "utils.py"
    constants = module_constants(path)
    module = _module(
        "vllm.v1.attention.backends.utils",
        "stand-in: the tree's constants and conv1d metadata helper, nothing else",
        PAD_SLOT_ID=constants.get("PAD_SLOT_ID", -1),
        NULL_BLOCK_ID=constants.get("NULL_BLOCK_ID", 0),
    )
    namespace: dict[str, Any] = {
        "np": np,
        "torch": torch,
        "Any": Any,
        "PAD_SLOT_ID": module.PAD_SLOT_ID,
        "PIN_MEMORY": False,
        "np_to_pinned_tensor": lambda array: torch.from_numpy(array),
    }
    helper = _function_from_tree(path, "compute_causal_conv1d_metadata", namespace)
    if helper is not None:
        module.__dict__["compute_causal_conv1d_metadata"] = helper
    return _with_stub_fallback(module)


class GDNAttentionMetadata(types.SimpleNamespace):
    """Stand-in for the tree's metadata dataclass; see :mod:`.metadata`.

    Reading a field the harness did not synthesise raises an error naming it,
    instead of a plain ``AttributeError`` deep in the tree's code.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"gdn-backport harness: GDNAttentionMetadata.{name} was read but not "
            "synthesised (the static analysis of _forward_core did not see it)"
        )


def _gdn_attn_module(ctx: HarnessContext) -> types.ModuleType:
    return _with_stub_fallback(
        _module(
            "vllm.v1.attention.backends.gdn_attn",
            "stand-in: the metadata class only",
            GDNAttentionMetadata=GDNAttentionMetadata,
        )
    )


def _mamba_utils_module(ctx: HarnessContext) -> types.ModuleType:
    # The harness stores conv state as (slots, state_len, dim) ("SD"), the
    # layout every release's _forward_core transposes into (dim, state_len).
    return _with_stub_fallback(
        _module(
            "vllm.model_executor.layers.mamba.mamba_utils",
            "stand-in: conv state layout probe",
            is_conv_state_dim_first=lambda: False,
            get_conv_state_layout=lambda: "SD",
        )
    )


class _AiterOps:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: False


def _aiter_module(ctx: HarnessContext) -> types.ModuleType:
    return _with_stub_fallback(
        _module("vllm._aiter_ops", "stand-in: ROCm AITER is absent", rocm_aiter_ops=_AiterOps())
    )


_ENV_DEFAULTS: dict[str, Any] = {
    # Read by __init__ paths and kernel helpers; the values are vLLM's defaults.
    "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE": True,
    "VLLM_TRITON_USE_TD": None,
    "VLLM_USE_V1": True,
}


def _envs_module(ctx: HarnessContext) -> types.ModuleType:
    module = _module("vllm.envs", "stand-in: vLLM's environment knobs, defaults only")

    def __getattr__(name: str) -> Any:
        if name in _ENV_DEFAULTS:
            return _ENV_DEFAULTS[name]
        raise AttributeError(f"gdn-backport harness: no stand-in value for vllm.envs.{name}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _triton_utils_module(ctx: HarnessContext) -> types.ModuleType:
    # vLLM's own triton_utils disables Triton when no GPU driver is active,
    # which is exactly the interpreter case: the stand-in always exposes it.
    import triton
    import triton.language as tl

    module = _module(
        "vllm.triton_utils",
        "stand-in: triton, tl, tldevice, always the real Triton",
        triton=triton,
        tl=tl,
        HAS_TRITON=True,
        LOG2E=1.4426950408889634,
        LOGE2=0.6931471805599453,
        __path__=[],
    )

    def __getattr__(name: str) -> Any:
        if name == "tldevice":
            import triton.language.extra.libdevice as tldevice

            return tldevice
        if name in ("gluon", "gl", "aggregate"):
            raise AttributeError(f"gdn-backport harness: vllm.triton_utils.{name} not provided")
        if name == "use_tensor_descriptor":
            return lambda override=None: bool(override)
        raise AttributeError(name)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _triton_importing_module(ctx: HarnessContext) -> types.ModuleType:
    return _with_stub_fallback(_module("vllm.triton_utils.importing", "stand-in", HAS_TRITON=True))


def _tensor_descriptor_module(ctx: HarnessContext) -> types.ModuleType:
    return _module(
        "vllm.triton_utils.tensor_descriptor",
        "stand-in: tensor descriptors off unless asked",
        use_tensor_descriptor=lambda override=None: bool(override),
    )


def _vllm_package(ctx: HarnessContext) -> types.ModuleType:
    return _module(
        "vllm",
        "stand-in package root: submodules come from the tree or the stand-ins",
        __path__=[str(ctx.tree / "vllm")],
        __version__="0+gdn-backport-harness",
    )


StandinBuilder = Callable[[HarnessContext], types.ModuleType]

STANDIN_BUILDERS: dict[str, StandinBuilder] = {
    "vllm": _vllm_package,
    "vllm.envs": _envs_module,
    "vllm.logger": _logger_module,
    "vllm.platforms": _platforms_module,
    "vllm.forward_context": _forward_context_module,
    "vllm.config": _config_module,
    "vllm.distributed": _distributed_module,
    "vllm.model_executor.custom_op": _custom_op_module,
    "vllm.utils.torch_utils": _torch_utils_module,
    "vllm.utils.platform_utils": _platform_utils_module,
    "vllm.utils.gpu_sync_debug": _gpu_sync_debug_module,
    "vllm.v1.attention.backends.utils": _attention_utils_module,
    "vllm.v1.attention.backends.gdn_attn": _gdn_attn_module,
    "vllm.model_executor.layers.mamba.mamba_utils": _mamba_utils_module,
    "vllm._aiter_ops": _aiter_module,
    "vllm.triton_utils": _triton_utils_module,
    "vllm.triton_utils.importing": _triton_importing_module,
    "vllm.triton_utils.tensor_descriptor": _tensor_descriptor_module,
}
