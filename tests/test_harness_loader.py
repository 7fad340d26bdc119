"""harness/loader.py: finding the site, loading a tree with stand-ins, activation.

The ones marked ``network`` load a real release.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from gdn_backport.harness.layer import LayerShape
from gdn_backport.harness.standins import is_stub
from gdn_backport.patchsets.pr51812.scenarios import (
    scenario,
)
from tests.harness_fixtures import fake_loaded, interpreted, release_tree

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


@pytest.mark.network
def test_loading_a_tree_writes_no_bytecode_into_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify loads the user's tree (a fork's checkout, a patched copy):
    with Python's bytecode writing on, it must still leave no __pycache__
    there (a revert compared byte for byte found one)."""
    interpreted()
    from gdn_backport import sources
    from gdn_backport.harness.loader import load_tree

    tree = sources.copy_release("0.28.0", tmp_path / "tree")
    for cached in tree.rglob("*.pyc"):
        cached.unlink()
    monkeypatch.setattr("sys.dont_write_bytecode", False)
    loaded = load_tree(tree)
    assert loaded.module is not None
    import sys

    assert sys.dont_write_bytecode is False
    assert sorted(tree.rglob("*.pyc")) == []


def test_stubbed_tree_modules_keep_their_literal_constants(tmp_path: Path) -> None:
    utils = tmp_path / "vllm" / "attention" / "backends" / "utils.py"
    utils.parent.mkdir(parents=True)
    utils.write_text("import torch\nPAD_SLOT_ID = -1\nNOT_LITERAL = torch.int32\n")
    loaded = fake_loaded(tmp_path)
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
    with fake_loaded(tmp_path, "cpu").active():
        pass
    assert installed == []
    # The allocator itself is not called: that needs a GPU.
    with fake_loaded(tmp_path, "cuda").active():
        pass
    assert len(installed) == 1 and callable(installed[0])
    monkeypatch.delattr(triton, "set_allocator")
    with fake_loaded(tmp_path, "cuda").active():
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
