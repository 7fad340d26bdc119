"""harness/reference.py: the float64 reference step, against plain loops."""

from __future__ import annotations

import torch

from gdn_backport.harness.batch import Batch, Row, SlotMap
from gdn_backport.harness.layer import LayerShape, LayerTensors, make_tensors
from gdn_backport.harness.reference import reference_step

# -- the reference -------------------------------------------------------------


def _tensors(shape: LayerShape, slots: int) -> LayerTensors:
    return make_tensors(shape, slots, "VK", torch.device("cpu"), seed=3)


def test_reference_spec_row_writes_per_token_states_and_shifts_conv() -> None:
    shape = LayerShape(dtype=torch.float32)
    batch = Batch((Row(True, 3, num_accepted=2),), num_spec=3)
    smap = SlotMap.for_steps([batch])
    tensors = _tensors(shape, smap.num_slots)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, shape.conv_dim, generator=gen)
    a, b = torch.randn(3, shape.num_v_heads, generator=gen), torch.randn(3, shape.num_v_heads)
    ref = reference_step(shape, tensors, batch, smap, qkv, a, b)
    block = smap.blocks[0]
    untouched = sorted(set(range(smap.num_slots)) - set(block[:3]))
    before = tensors.ssm_pool.double()
    assert torch.equal(ref.ssm_pool[untouched], before[untouched])
    assert not torch.equal(ref.ssm_pool[block[0]], before[block[0]])
    width = shape.conv_kernel
    conv_before = tensors.conv_pool.double()
    expected = torch.cat([conv_before[block[0], 2 : 1 + width - 1], qkv.double()])
    assert torch.equal(ref.conv_pool[block[0], : width - 2 + 3], expected)
    others = [s for s in range(smap.num_slots) if s != block[0]]
    assert torch.equal(ref.conv_pool[others], conv_before[others])


def test_reference_matches_a_direct_recurrence_for_one_head() -> None:
    shape = LayerShape(
        num_k_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=4, dtype=torch.float32
    )
    batch = Batch((Row(False, 2, has_initial_state=False),), num_spec=3)
    smap = SlotMap.for_steps([batch])
    tensors = _tensors(shape, smap.num_slots)
    tensors.conv_weight.zero_()
    tensors.conv_weight[:, 0, -1] = 1.0  # conv = identity on the current token
    tensors.conv_bias.zero_()  # type: ignore[union-attr]
    qkv = torch.rand(2, shape.conv_dim) + 0.5
    a, b = torch.zeros(2, 1), torch.zeros(2, 1)
    ref = reference_step(shape, tensors, batch, smap, qkv, a, b)
    y = torch.nn.functional.silu(qkv.double())
    q, k, v = y[:, :4], y[:, 4:8], y[:, 8:]
    q = torch.nn.functional.normalize(q, dim=-1) * 0.5
    k = torch.nn.functional.normalize(k, dim=-1)
    g = -torch.exp(tensors.A_log.double()) * torch.nn.functional.softplus(tensors.dt_bias.double())
    state = torch.zeros(4, 4, dtype=torch.float64)
    for t in range(2):
        state = state * torch.exp(g[0])
        u = 0.5 * (v[t] - k[t] @ state)
        state = state + torch.outer(k[t], u)
        assert torch.allclose(ref.out[t, 0], q[t] @ state)


def test_reference_matches_a_per_head_loop_with_grouped_heads_and_a_real_conv() -> None:
    # Value head h reads key head h // (HV / H) (not h % H), and the conv is
    # a causal window over (history, tokens): checked against plain loops.
    shape = LayerShape(
        num_k_heads=2, num_v_heads=4, head_k_dim=4, head_v_dim=4, dtype=torch.float32
    )
    batch = Batch((Row(False, 3, has_initial_state=True),), num_spec=3)
    smap = SlotMap.for_steps([batch])
    tensors = _tensors(shape, smap.num_slots)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, shape.conv_dim, generator=gen)
    a, b = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    ref = reference_step(shape, tensors, batch, smap, qkv, a, b)

    slot, width = smap.blocks[0][0], shape.conv_kernel
    weight = tensors.conv_weight.double().view(shape.conv_dim, width)
    assert tensors.conv_bias is not None
    full = torch.cat([tensors.conv_pool[slot, : width - 1].double(), qkv.double()])
    y = torch.stack(
        [
            sum(full[t + w] * weight[:, w] for w in range(width)) + tensors.conv_bias.double()
            for t in range(3)
        ]
    )
    y = torch.nn.functional.silu(y).float().double()  # rounded as the kernels store it
    q, k, v = y[:, :8].view(3, 2, 4), y[:, 8:16].view(3, 2, 4), y[:, 16:].view(3, 4, 4)
    q = torch.nn.functional.normalize(q, dim=-1, eps=1e-6) * 0.5
    k = torch.nn.functional.normalize(k, dim=-1, eps=1e-6)
    decay = -torch.exp(tensors.A_log.double())
    g = decay * torch.nn.functional.softplus(a.double() + tensors.dt_bias.double())
    beta = torch.sigmoid(b.double())
    for h in range(4):
        state = tensors.ssm_pool[slot, h].double().T  # pool is (V, K)
        for t in range(3):
            state = state * torch.exp(g[t, h])
            u = beta[t, h] * (v[t, h] - k[t, h // 2] @ state)
            state = state + torch.outer(k[t, h // 2], u)
            assert torch.allclose(ref.out[t, h], q[t, h // 2] @ state)
        assert torch.allclose(ref.ssm_pool[slot, h], state.T)
