"""harness/layer.py: the attributes a layer reads, its shapes and tensors."""

from __future__ import annotations

import functools
from typing import Any


class _CheckpointingLayer:
    # Annotations only: instance attributes, as the tree's __init__ sets them.
    _sizes: list[int]
    plan: object
    _checkpoint_exporter: Any

    @functools.cached_property
    def _buffer_spec(self) -> tuple[int, ...]:
        return tuple(self._sizes)

    def _forward_core(self, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> None:
        if self.plan is not None:
            self._checkpoint_exporter.export(self._buffer_spec)


def test_cached_properties_are_not_attributes_to_provide() -> None:
    from gdn_backport.harness.layer import self_attributes

    direct, _ = self_attributes(_CheckpointingLayer)
    assert direct == {"plan", "_checkpoint_exporter"}


class _Layer:
    prefix: str

    def _forward_core(self, mixed_qkv: Any) -> Any:
        out = self.helper(mixed_qkv)
        cache = self.kv_cache[self.engine]
        return out, cache, self.A_log

    def helper(self, x: Any) -> Any:
        return self.conv1d(x) + self.dt_bias + self.A_log


class _Fixed:
    def _forward_core(self, x: Any) -> Any:
        return self.kv_cache[0]


def test_reads_of_the_method_and_of_what_it_calls_on_self() -> None:
    from gdn_backport.harness.layer import LayerReads, self_attributes

    direct, indirect = self_attributes(_Layer)
    assert direct == {"kv_cache", "engine", "A_log"}  # helper is a method: followed
    assert indirect == {"conv1d", "dt_bias"}  # A_log read directly too: counted once
    reads = LayerReads.of(_Layer)
    assert reads.kv_cache_per_engine and reads.direct == frozenset(direct)
    assert not LayerReads.of(_Fixed).kv_cache_per_engine  # self.kv_cache[0]


def test_shape_dims_and_the_tensors_drawn_for_it() -> None:
    import torch

    from gdn_backport.harness.layer import LayerShape, activation_dtype, make_tensors, step_inputs

    shape = LayerShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=4, conv_kernel=4)
    assert (shape.key_dim, shape.value_dim, shape.conv_dim) == (16, 16, 48)
    assert shape.conv_state_len == 3 + shape.num_spec
    cpu = torch.device("cpu")
    assert shape.output(5, cpu).shape == (5, 4, 4) and not shape.output(5, cpu).any()
    vk = make_tensors(shape, 7, "VK", cpu, seed=1)
    kv = make_tensors(shape, 7, "KV", cpu, seed=1)
    assert vk.ssm_pool.shape == (7, 4, 4, 8) and kv.ssm_pool.shape == (7, 4, 8, 4)
    assert vk.conv_pool.shape == (7, shape.conv_state_len, 48)
    assert vk.conv_weight.shape == (48, 1, 4) and (vk.A_log > 0).all()
    assert torch.equal(make_tensors(shape, 7, "VK", cpu, seed=1).ssm_pool, vk.ssm_pool)
    copy = vk.clone_pools()
    copy.ssm_pool.add_(1)
    assert not torch.equal(copy.ssm_pool, vk.ssm_pool) and copy.A_log is vk.A_log
    qkv, a, b = step_inputs(shape, 3, cpu, seed=2)
    assert qkv.shape == (3, 48) and a.shape == b.shape == (3, 4) and a.is_contiguous()
    _, a2, _ = step_inputs(shape, 3, cpu, seed=2, strided=True)
    assert torch.equal(a, a2) and not a2.is_contiguous()
    assert activation_dtype("cpu") is torch.float16
    assert activation_dtype(torch.device("cuda", 0)) is torch.bfloat16
