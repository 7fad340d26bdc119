"""The builder suite: releases' own GDNAttentionMetadataBuilder (vLLM #51565).

The release tests are the proof: on the fixed release (0.31.0) every
scenario passes; on affected releases a new request whose chunk is one token
is classified a decode by the tree's own builder and reads its slot's
previous owner's state. 0.23.0-0.30.0 split decodes off mixed batches too
(decode_new_prefill fails); 0.20.0-0.22.1 run every non-spec row of a batch
with a prefill through the masked prefill path (it passes). From 0.18.0 a
one-token non-spec row beside spec rows is a prefill (spec_plus_new passes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gdn_backport.harness.loader import HarnessError, LoadedTree
from gdn_backport.harness.standins import make_stub
from gdn_backport.patchsets.pr51565.suite import (
    BUILDER_SCENARIOS,
    Req,
    _check_no_stubs,
    _literal_field_defaults,
    _slot_blocks,
    run_builder_suite,
)
from gdn_backport.verify import ScenarioResult
from tests.harness_fixtures import interpreted, release_tree

ALL = (
    "new_one_token",
    "decode_plus_new",
    "first_chunk_one_token",
    "decode_new_prefill",
    "spec_plus_new",
    "resumed_chunk_decode",
    "capture_dummy",
)
_AFFECTED_MIXED = frozenset({"spec_plus_new", "resumed_chunk_decode", "capture_dummy"})
EXPECTED_PASS: dict[str, frozenset[str]] = {
    "0.31.0": frozenset(ALL),
    "0.30.0": _AFFECTED_MIXED,
    "0.25.1": _AFFECTED_MIXED,
    "0.21.0": _AFFECTED_MIXED | {"decode_new_prefill"},
}
# What the tree's builder said about the new one-token request (its note).
EXPECTED_CLASS = {
    "0.31.0": "decodes=0 prefills=1",
    "0.30.0": "decodes=1 prefills=0",
    "0.25.1": "decodes=1 prefills=0",
    "0.21.0": "decodes=1 prefills=0",
}


# -- no release needed ----------------------------------------------------------


def test_scenario_names_are_the_public_ones() -> None:
    assert tuple(BUILDER_SCENARIOS) == ALL
    for scenario in BUILDER_SCENARIOS.values():
        fresh = [r for r in scenario.reqs if r.fresh]
        if scenario.kind == "fresh":
            assert len(fresh) == 1 and fresh[0].num_computed == 0
            assert fresh[0].num_scheduled == 1 <= fresh[0].prompt_len
        else:
            assert not fresh
    spec = BUILDER_SCENARIOS["spec_plus_new"]
    assert spec.num_spec == 3
    assert [r.spec for r in spec.reqs] == [True, True, False]
    resumed = BUILDER_SCENARIOS["resumed_chunk_decode"].reqs[0]
    assert resumed.prefilling and resumed.num_computed == 5 and resumed.prompt_len == 9
    assert not any(r.prefilling for r in BUILDER_SCENARIOS["capture_dummy"].reqs)


def test_req_kinds() -> None:
    assert Req(0, 6, 10, 4, draft=3).spec
    # Drafts scheduled but not all of them: the runner passes -1 (not a spec decode).
    assert not Req(0, 6, 10, 3, draft=3).spec
    assert not Req(0, 6, 9, 1).prefilling and Req(0, 8, 0, 1).prefilling


def test_slot_blocks_skip_the_null_block_and_do_not_overlap() -> None:
    reqs = [Req(i, 4, 0, 1) for i in range(3)]
    blocks, total = _slot_blocks(reqs, width=4)
    slots = [s for block in blocks.values() for s in block]
    assert len(slots) == len(set(slots)) == 12
    assert 0 not in slots and max(slots) < total
    assert total > 1 + len(slots)  # spare slots, never handed out


def test_unknown_scenario_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="unknown builder scenario"):
        run_builder_suite(tmp_path, scenarios=["no_such"])


def test_stubbed_metadata_fields_are_refused(tmp_path: Path) -> None:
    @dataclasses.dataclass
    class Meta:
        num_decodes: int
        checkpoint: object = None

    loaded = LoadedTree.__new__(LoadedTree)
    loaded.tree = tmp_path
    _check_no_stubs(loaded, Meta(1))
    with pytest.raises(HarnessError, match="checkpoint"):
        _check_no_stubs(loaded, Meta(1, make_stub("x.MambaPrefillCheckpointBuilder()")))


def test_literal_defaults_follow_bases_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kv.py"
    path.write_text(
        "class Base:\n    block_size: int\n    mode: str = 'none'\n"
        "class MambaSpec(Base):\n    blocks: int = 0\n    align: int | None = None\n"
        "    shapes: tuple = make()\n"
    )
    assert _literal_field_defaults(path, "MambaSpec") == {
        "mode": "none",
        "blocks": 0,
        "align": None,
    }
    assert _literal_field_defaults(tmp_path / "absent.py", "MambaSpec") == {}


# -- real releases ------------------------------------------------------------------


def _tree(version: str) -> Path:
    interpreted()
    try:
        return release_tree(version)
    except Exception as exc:  # offline without a cached tree
        pytest.skip(f"vLLM {version} is not cached and cannot be fetched: {exc}")


def _table(results: list[ScenarioResult]) -> str:
    return "\n".join(
        f"{r.name:22s} {'PASS' if r.passed else 'FAIL'} {r.layout} {r.note}" for r in results
    )


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(EXPECTED_PASS))
def test_real_builder_on_release(version: str) -> None:
    results = run_builder_suite(_tree(version), "cpu")
    assert [r.name for r in results] == list(ALL)
    table = _table(results)
    passed = {r.name for r in results if r.passed}
    assert passed == EXPECTED_PASS[version], table
    by_name = {r.name: r for r in results}
    for r in results:
        assert not r.note.startswith("harness:"), table  # the harness drove every scenario
        if not r.passed:
            assert "stale state read" in r.note, table
            assert "other rows changed" not in r.note, table
    assert EXPECTED_CLASS[version] in by_name["new_one_token"].note, table
    # The resumed one-token chunk stays a decode, reading its real state.
    assert "decodes=1 prefills=0" in by_name["resumed_chunk_decode"].note, table
    assert "decodes=3 prefills=0" in by_name["capture_dummy"].note, table
    # Spec rows beside the new request: the builder ran the spec path.
    assert "spec=2" in by_name["spec_plus_new"].note, table
    assert torch.get_default_dtype() == torch.float32  # the suite leaves globals alone
