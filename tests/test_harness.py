"""Harness unit tests: batches, metadata analysis, stand-ins, the reference.

Most run without vLLM; the ones marked ``network`` load a real release.
"""

from __future__ import annotations

import ast
import functools
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from gdn_backport.harness.batch import Batch, Row, SlotMap
from gdn_backport.harness.layer import LayerShape, LayerTensors, make_tensors
from gdn_backport.harness.loader import GdnSite, LoadedTree
from gdn_backport.harness.reference import reference_step
from gdn_backport.harness.standins import HarnessContext, is_stub, make_stub, make_stub_module
from gdn_backport.patchsets.pr51812.metadata import _collect, _metadata_names
from gdn_backport.patchsets.pr51812.scenarios import (
    EXTRA_SCENARIOS,
    SCENARIOS,
    ci_scenarios,
    scenario,
)
from tests.harness_fixtures import interpreted, release_tree

# -- batches and slots ------------------------------------------------------


def test_batch_token_indices_follow_row_order() -> None:
    batch = Batch((Row(False, 1), Row(True, 3)), num_spec=3)
    assert batch.spec_token_indx() == [1, 2, 3]
    assert batch.non_spec_token_indx() == [0]
    assert batch.describe() == "[N1, S3@1]"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ((Row(True, 5),), "at most"),
        ((Row(True, 4, num_accepted=5),), "num_accepted"),
        ((Row(True, 4, has_initial_state=False),), "always has a state"),
        ((Row(False, 0),), "query_len"),
    ],
)
def test_batch_refuses_impossible_rows(rows: tuple[Row, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Batch(rows, num_spec=3)


def test_slot_map_never_hands_out_the_null_block_and_keeps_spares() -> None:
    steps = [s for sc in SCENARIOS for s in sc.steps]
    for batch in steps:
        smap = SlotMap.for_steps([batch])
        used = smap.used()
        assert 0 not in used
        assert len(used) == sum(len(b) for b in smap.blocks.values())
        assert smap.num_slots - 1 - len(used) == 3
        for rid, row in zip(batch.request_ids(), batch.rows, strict=True):
            assert len(smap.blocks[rid]) == (batch.num_spec + 1 if row.spec else 1)


def test_scenarios_are_tagged_and_expect_what_the_layout_implies() -> None:
    for sc in SCENARIOS + EXTRA_SCENARIOS:
        assert sc.tag
        # The bug shows iff a non-spec token precedes a spec token somewhere.
        shows = any(
            any(n < s for n in b.non_spec_token_indx() for s in b.spec_token_indx())
            for b in sc.steps
        )
        assert sc.expect_unpatched == ("fail" if shows else "pass"), sc.name
    assert {s.name for s in ci_scenarios()} <= {s.name for s in SCENARIOS}
    with pytest.raises(KeyError, match="no scenario"):
        scenario("nope")


# -- stand-ins ----------------------------------------------------------------


def test_stubs_are_inert_decorators_falsy_and_subclassable() -> None:
    stub = make_stub("vllm.x.Thing")
    assert is_stub(stub) and not stub

    def fn() -> int:
        return 1

    assert stub.register("name")(fn) is fn  # decorator factory, then decorator
    assert stub(fn) is fn

    class Derived(torch.nn.Module, stub):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.x = 3

    assert Derived().x == 3 and not is_stub(Derived)
    module = make_stub_module("vllm.fake")
    assert is_stub(module.Anything)
    assert (module.Anything | None) is not None


# -- metadata analysis ---------------------------------------------------------


_METHOD = textwrap.dedent(
    """
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        md = get_forward_context().attn_metadata[self.prefix]
        assert isinstance(md, GDNAttentionMetadata)
        n = md.num_actual_tokens
        conv(mixed_qkv, metadata=md)
        if getattr(md, "num_spec_decodes", 0):
            pass
    """
)
_CALLEE = textwrap.dedent(
    """
    def conv(x, metadata=None):
        return metadata.nums_dict, metadata.batch_ptr
    """
)


def test_metadata_fields_follow_the_variable_into_callees() -> None:
    fn = ast.parse(_METHOD).body[0]
    callee = ast.parse(_CALLEE).body[0]
    assert isinstance(fn, ast.FunctionDef) and isinstance(callee, ast.FunctionDef)
    names = _metadata_names(fn)
    assert "md" in names
    sentinel = object()

    def resolve(node: ast.expr) -> tuple[object, bool] | None:
        return (sentinel, False) if isinstance(node, ast.Name) and node.id == "conv" else None

    import gdn_backport.patchsets.pr51812.metadata as metadata

    original = metadata._parse_function
    metadata._parse_function = lambda obj: callee if obj is sentinel else original(obj)  # type: ignore[assignment]
    try:
        fields = _collect(fn, names, resolve, set())
    finally:
        metadata._parse_function = original  # type: ignore[assignment]
    assert fields == {"num_actual_tokens", "num_spec_decodes", "nums_dict", "batch_ptr"}


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


# -- a real release: loader, analysis, one step ------------------------------------


@pytest.mark.network
def test_loader_drives_a_real_release_on_cpu() -> None:
    interpreted()
    from gdn_backport.harness.layer import self_attributes
    from gdn_backport.harness.loader import load_tree
    from gdn_backport.patchsets.pr51812.metadata import metadata_fields
    from gdn_backport.patchsets.pr51812.suite import SuiteRunner

    loaded = load_tree(release_tree("0.28.0"))
    assert loaded.site.cls == "QwenGatedDeltaNetAttention"
    assert any(".ops.causal_conv1d" in name for name in loaded.real)
    assert any("fused_sigmoid_gating" in name for name in loaded.real)
    fields = metadata_fields(loaded)
    # Read through causal_conv1d_fn(metadata=...), not by _forward_core itself.
    assert {"nums_dict", "batch_ptr", "spec_token_indx", "num_accepted_tokens"} <= fields
    assert loaded.layer_class is not None
    direct, _ = self_attributes(loaded.layer_class)
    assert {"A_log", "dt_bias", "conv1d", "kv_cache"} <= direct
    runner = SuiteRunner(loaded, LayerShape(dtype=torch.float16), torch.device("cpu"))
    result = runner.run(scenario("pr_layout"))
    assert result.passed, result.note
    # The harness leaves no vllm module behind.
    import sys

    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
    assert isinstance(loaded.module, types.ModuleType)
    # active() nests (a step enters it once; helpers enter it again): only
    # the outermost exit takes the tree's modules out.
    with loaded.active():
        with loaded.active():
            assert sys.modules[loaded.site.module] is loaded.module
        assert sys.modules[loaded.site.module] is loaded.module
    assert loaded.site.module not in sys.modules


# -- adapting to what a tree declares (no release needed) ------------------------------


def _fake_loaded(root: Path, device: str = "cpu") -> LoadedTree:
    """A LoadedTree over ``root`` with nothing loaded (``torch.device("cuda")``
    is only a name: no GPU is needed until a tensor is made on it)."""
    site = GdnSite(path=root / "vllm" / "m.py", module="vllm.m", cls="Layer")
    return LoadedTree(tree=root, site=site, context=HarnessContext(root, device), interpreted=False)


def test_conv_helper_is_called_the_way_its_signature_asks(tmp_path: Path) -> None:
    from gdn_backport.harness.loader import HarnessError
    from gdn_backport.patchsets.pr51812.metadata import _call_conv_helper

    loaded = _fake_loaded(tmp_path)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    seen: list[tuple[str, object]] = []

    def newer(query_start_loc_p_cpu: torch.Tensor, *, device: torch.device) -> tuple[int]:
        seen.append((query_start_loc_p_cpu.device.type, device))
        return (1,)

    def older(query_start_loc_p: torch.Tensor) -> tuple[int]:
        seen.append((query_start_loc_p.device.type, None))
        return (2,)

    def other(query_start_loc: torch.Tensor, block_m: int) -> None:
        raise AssertionError("not called")

    cpu = torch.device("cpu")
    assert _call_conv_helper(loaded, newer, cu, cpu) == (1,)
    assert _call_conv_helper(loaded, older, cu, cpu) == (2,)
    assert seen == [("cpu", cpu), ("cpu", None)]
    with pytest.raises(HarnessError, match="block_m"):
        _call_conv_helper(loaded, other, cu, cpu)


def test_config_standin_has_hf_config_and_names_missing_fields(tmp_path: Path) -> None:
    from gdn_backport.harness.standins import _config_module

    config = _config_module(HarnessContext(tmp_path, "cpu")).get_current_vllm_config()
    model = config.model_config
    assert getattr(model.hf_config, "linear_key_head_dim", None) is None
    assert getattr(model.hf_text_config, "linear_key_head_dim", None) is None
    with pytest.raises(AttributeError, match=r"no vllm_config\.model_config\.dtype"):
        _ = model.dtype


def test_feature_off_metadata_fields_need_a_none_default(tmp_path: Path) -> None:
    from gdn_backport.harness.loader import HarnessError
    from gdn_backport.patchsets.pr51812.metadata import _check_feature_off

    backends = tmp_path / "vllm" / "v1" / "attention" / "backends"
    backends.mkdir(parents=True)
    (backends / "gdn_attn.py").write_text(
        "class GDNAttentionMetadata:\n"
        "    num_prefills: int\n"
        "    aiter_prefill_metadata: object | None = None\n"
        "    checkpoint: object\n"
    )
    loaded = _fake_loaded(tmp_path)
    _check_feature_off(loaded, frozenset({"aiter_prefill_metadata", "num_prefills"}))
    with pytest.raises(HarnessError, match="checkpoint"):
        _check_feature_off(loaded, frozenset({"checkpoint"}))


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


def test_stubbed_tree_modules_keep_their_literal_constants(tmp_path: Path) -> None:
    utils = tmp_path / "vllm" / "attention" / "backends" / "utils.py"
    utils.parent.mkdir(parents=True)
    utils.write_text("import torch\nPAD_SLOT_ID = -1\nNOT_LITERAL = torch.int32\n")
    loaded = _fake_loaded(tmp_path)
    spec = loaded._spec_for("vllm.attention.backends.utils")
    assert spec.loader is not None
    module: Any = spec.loader.create_module(spec)
    assert module.PAD_SLOT_ID == -1
    assert is_stub(module.NOT_LITERAL)
    assert "vllm.attention.backends.utils" in loaded.stubbed


def test_triton_allocator_is_installed_for_cuda_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    triton = pytest.importorskip("triton")
    installed: list[object] = []
    monkeypatch.setattr(triton, "set_allocator", installed.append, raising=False)
    with _fake_loaded(tmp_path, "cpu").active():
        pass
    assert installed == []
    # The allocator itself is not called: that needs a GPU.
    with _fake_loaded(tmp_path, "cuda").active():
        pass
    assert len(installed) == 1 and callable(installed[0])
    monkeypatch.delattr(triton, "set_allocator")
    with _fake_loaded(tmp_path, "cuda").active():
        pass
    assert len(installed) == 1


@pytest.mark.network
@pytest.mark.parametrize(
    ("version", "why"),
    [
        ("0.12.0", "compute_causal_conv1d_metadata(query_start_loc_p); PAD_SLOT_ID"),
        ("0.22.0", "ChunkGatedDeltaRule logs model_config.hf_config"),
        ("0.32.0", "metadata field aiter_prefill_metadata"),
        ("0.33.0", "checkpoint fields, _checkpoint_exporter, a cached_property"),
    ],
)
def test_loader_drives_releases_with_version_specific_pieces(version: str, why: str) -> None:
    interpreted()
    from gdn_backport.harness.loader import load_tree
    from gdn_backport.patchsets.pr51812.suite import SuiteRunner

    loaded = load_tree(release_tree(version))
    runner = SuiteRunner(loaded, LayerShape(dtype=torch.float16), torch.device("cpu"))
    result = runner.run(scenario("pr_layout"), self_consistency=False)
    if version == "0.22.0":  # affected: driven, and the bug shows
        assert not result.passed and "read the gates of tokens" in result.note, why
    else:
        assert result.passed, (why, result.note)


@pytest.mark.network
def test_gpu_runs_pin_each_autotuner_to_its_first_config() -> None:
    interpreted()
    from triton.runtime.autotuner import Autotuner

    from gdn_backport.harness.loader import load_tree
    from gdn_backport.harness.triton_runtime import pin_autotuners

    loaded = load_tree(release_tree("0.27.1"))
    tuners = [
        v for m in loaded.modules.values() for v in vars(m).values() if isinstance(v, Autotuner)
    ]
    assert any(len(t.configs) > 1 for t in tuners)
    firsts = [t.configs[0] for t in tuners]
    assert pin_autotuners(loaded.modules.values()) > 0
    assert [t.configs for t in tuners] == [[c] for c in firsts]


# -- site discovery -------------------------------------------------------------

_LAYER = """
class Layer:
    def rearrange_mixed_qkv(self, mixed_qkv):
        return mixed_qkv

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        spec_token_indx = None
        return spec_token_indx
"""


def test_site_discovery_skips_records_and_links(tmp_path: Path) -> None:
    """The records of an in-place patch hold the affected original: never a site."""
    from gdn_backport.harness.loader import find_gdn_sites

    pkg = tmp_path / "vllm" / "layers"
    pkg.mkdir(parents=True)
    (pkg / "gdn.py").write_text(_LAYER)
    records = tmp_path / "vllm" / ".gdn-backport" / "originals" / "vllm" / "layers"
    records.mkdir(parents=True)
    (records / "gdn.py").write_text(_LAYER)
    (pkg / "link.py").symlink_to(pkg / "gdn.py")
    assert [(s.module, s.cls) for s in find_gdn_sites(tmp_path)] == [("vllm.layers.gdn", "Layer")]


_KERNEL_MODULE = """
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N", "M"])
def kernel(x, N: tl.constexpr, M):
    pass
"""


def test_constexprs_are_taken_out_of_do_not_specialize(tmp_path: Path) -> None:
    # Compiled Triton only (the interpreter has no JITFunction): a subprocess
    # without TRITON_INTERPRET. Triton 3.6 refuses to compile a constexpr
    # listed in do_not_specialize (0.10.2's fused recurrent kernel has N so).
    import os
    import subprocess
    import sys

    (tmp_path / "kmod.py").write_text(_KERNEL_MODULE, encoding="utf-8")
    script = (
        "import kmod\n"
        "from gdn_backport.harness.triton_runtime import unlist_specialized_constexprs\n"
        "flags = lambda: [p.do_not_specialize for p in kmod.kernel.params]\n"
        "before = flags()\n"
        "print(before, unlist_specialized_constexprs([kmod]), flags())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    # N (constexpr) unlisted, M (a plain argument) left as the author asked.
    assert done.stdout.split() == ["[False,", "True,", "True]", "1", "[False,", "False,", "True]"]
