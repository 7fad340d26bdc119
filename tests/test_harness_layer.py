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
