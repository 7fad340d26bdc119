"""harness/batch.py: rows, batches and the slot map they are laid out in."""

from __future__ import annotations

import pytest

from gdn_backport.harness.batch import Batch, Row, SlotMap
from gdn_backport.patchsets.pr51812.scenarios import (
    SCENARIOS,
)

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
