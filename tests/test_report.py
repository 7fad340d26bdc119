"""Human tables fit the terminal: wrapped, never cut."""

from __future__ import annotations

import json
import re

import pytest

from gdn_backport.report import table
from tests.conftest import run

REASON = (
    "fused_recurrent_gated_delta_rule: the gates (g=g_spec, beta=beta_spec) carry the same "
    "rows as q/k/v on every path, and the state slots are the spec ones; nothing here reads "
    "another token's gate rows, so the site is left exactly as it is written in this tree "
    "whatever its strategy"
)
ROWS = [
    ("vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:1556", "Qwen._forward_core",
     "affected", REASON),
    ("vllm/a.py:1", "f", "fixed", "short"),
]  # fmt: skip


@pytest.mark.parametrize("width", [60, 80, 100, 140])
def test_a_long_reason_is_wrapped_to_the_width_and_kept_whole(width: int) -> None:
    """D18: no line over the width (tables used to be up to 561 columns);
    every character of every cell is still there, on continuation lines,
    and from 100 columns on every word of the reason whole."""
    out = table(["site", "function", "status", "reason"], ROWS, width=width)
    assert max(len(line) for line in out.splitlines()) <= width, out
    assert _cells(out) == [[c.replace(" ", "") for c in row] for row in ROWS]
    if width >= 100:
        for word in REASON.split():
            assert word in out, word


def test_a_table_that_fits_is_as_before() -> None:
    out = table(["a", "b"], [("x", "y y")], width=100)
    assert out == "a  b\n-  ---\nx  y y"


def _cells(out: str) -> list[list[str]]:
    """The table in ``out`` read back: its rows (a row starts where its
    status is, a word no wrap breaks), each cell's fragments joined with
    every space removed (what a wrap may move, nothing else)."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+(  -+)*", line))
    spans = [m.span() for m in re.finditer(r"-+", lines[at])]
    status = lines[at - 1].split().index("status")
    rows: list[list[str]] = []
    for line in lines[at + 1 :]:
        parts = [line[a : (b if i < len(spans) - 1 else None)] for i, (a, b) in enumerate(spans)]
        if parts[status].strip():
            rows.append([""] * len(spans))
        for i, part in enumerate(parts):
            rows[-1][i] += part.replace(" ", "")
    return rows


@pytest.mark.network
def test_a_real_release_scan_fits_100_columns_and_loses_nothing(
    capsys: pytest.CaptureFixture[str], release: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D18: ``scan`` of 0.33.0 (two patchsets, a call chain: 561 columns
    before) written to no terminal: 100 columns, every character of every
    site and reason there (``--json`` holds them as they are)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    tree = str(release("0.33.0"))  # type: ignore[operator]
    _, out, _ = run(capsys, "scan", tree)
    assert max(len(line) for line in out.splitlines()) <= 100
    _, doc, _ = run(capsys, "scan", tree, "--json")
    sites = json.loads(doc)["sites"]
    rows = _cells(out)
    assert len(rows) == len(sites)
    for row, site in zip(rows, sites, strict=True):
        assert row[1] == f"{site['path']}:{site['line']}"
        assert row[-1] == site["reason"].replace(" ", "")
