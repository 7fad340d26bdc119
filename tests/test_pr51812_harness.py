"""The pr51812 patchset's harness pieces: its scenarios and its metadata analysis
of a loaded tree (the patchset's, so named after it; the core's harness
modules have their own same-stem files).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch

from gdn_backport.patchsets.pr51812.metadata import _collect, _metadata_names
from gdn_backport.patchsets.pr51812.scenarios import (
    EXTRA_SCENARIOS,
    SCENARIOS,
    ci_scenarios,
    scenario,
)
from tests.harness_fixtures import fake_loaded


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


def test_conv_helper_is_called_the_way_its_signature_asks(tmp_path: Path) -> None:
    from gdn_backport.harness.loader import HarnessError
    from gdn_backport.patchsets.pr51812.metadata import _call_conv_helper

    loaded = fake_loaded(tmp_path)
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
    loaded = fake_loaded(tmp_path)
    _check_feature_off(loaded, frozenset({"aiter_prefill_metadata", "num_prefills"}))
    with pytest.raises(HarnessError, match="checkpoint"):
        _check_feature_off(loaded, frozenset({"checkpoint"}))
