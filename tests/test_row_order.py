"""Operations that take token rows apart (``row_order``): a gate gathered by
the spec index and then reordered, mixed or cut, or gathered by an index
that was changed, is ``unknown``, never ``fixed``; casts, moves, views and
the padding trim keep the rows (and the verdict)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_backport.cli import main
from gdn_backport.site import Status
from tests.test_analysis import site, status

GATHER = """\
i = {index}
x_spec = x.index_select(0, md.spec_token_indx)
a_s = {a}
b_s = b.index_select(0, md.spec_token_indx)
"""


def gathered(a: str, index: str = "md.spec_token_indx") -> str:
    return site(GATHER.format(a=a, index=index), "a_s", "b_s")


def between(lines: str) -> str:
    """The site with q/k/v and ``b`` gathered by the spec index and
    ``lines`` (which make ``a_s``) between them, ``a_s`` handed as ``a``."""
    spec = "x_spec = x.index_select(0, md.spec_token_indx)"
    return site(f"{spec}\n{lines}\nb_s = b.index_select(0, md.spec_token_indx)\n", "a_s", "b_s")


# The gate ``a`` after each of these is not the spec rows of q/k/v.
BROKEN = [
    ("flip", "a.index_select(0, md.spec_token_indx).flip(0)"),
    ("flip-dims-kw", "a.index_select(0, md.spec_token_indx).flip(dims=(0,))"),
    ("roll", "a.index_select(0, md.spec_token_indx).roll(1, 0)"),
    ("roll-flat", "a.index_select(0, md.spec_token_indx).roll(1)"),
    ("cumsum", "a.index_select(0, md.spec_token_indx).cumsum(0)"),
    ("sort", "a.index_select(0, md.spec_token_indx).sort(dim=0).values"),
    ("narrow", "a.narrow(0, 0, md.spec_token_indx.numel())"),
    ("mean-over-tokens", "a.index_select(0, md.spec_token_indx).mean(0, keepdim=True)"),
    ("torch-flip", "torch.flip(a.index_select(0, md.spec_token_indx), [0])"),
    ("torch-cumsum", "torch.cumsum(a.index_select(0, md.spec_token_indx), dim=0)"),
    ("index-plus-one", "a.index_select(0, md.spec_token_indx + 1)"),
    ("index-minus-one", "a.index_select(0, md.spec_token_indx - 1)"),
    ("index-negated", "a.index_select(0, -md.spec_token_indx)"),
    ("index-flipped", "a.index_select(0, md.spec_token_indx.flip(0))"),
    (
        "index-masked",
        "a.index_select(0, md.spec_token_indx.masked_fill(md.spec_token_indx > 3, 0))",
    ),
    ("index-zeros", "a.index_select(0, torch.zeros_like(md.spec_token_indx))"),
    (
        "index-where",
        "a.index_select(0, torch.where(md.spec_token_indx > 3, md.spec_token_indx, 0))",
    ),
    ("cut-from-one", "a.index_select(0, md.spec_token_indx)[1:]"),
    ("every-other-row", "a.index_select(0, md.spec_token_indx)[::2]"),
    ("index-prefix", "a.index_select(0, md.spec_token_indx[:1])"),
    ("index-from-one", "a.index_select(0, md.spec_token_indx[1:])"),
    ("index-picked", "a[md.spec_token_indx[0]]"),
]


@pytest.mark.parametrize("gate", [g for _, g in BROKEN], ids=[n for n, _ in BROKEN])
def test_a_gate_whose_rows_were_taken_apart_is_unknown(gate: str) -> None:
    assert status(gathered(gate), {"torch": "torch"}) is Status.UNKNOWN


def test_an_index_changed_before_the_gathers_is_unknown() -> None:
    """Every gather reads the changed index the same way: still not the rows
    the kernel's spec slots belong to."""
    body = """\
    i = md.spec_token_indx + 1
    x_spec = x.index_select(0, i)
    a_s = a.index_select(0, i)
    b_s = b.index_select(0, i)
    """
    assert status(site(body, "a_s", "b_s")) is Status.UNKNOWN


KEPT = [
    ("contiguous", "a.index_select(0, md.spec_token_indx).contiguous()"),
    ("cast", "a.index_select(0, md.spec_token_indx).float()"),
    ("to", "a.index_select(0, md.spec_token_indx).to(x.dtype)"),
    ("sum-over-heads", "a.index_select(0, md.spec_token_indx).sum(-1, keepdim=True)"),
    ("flip-heads", "a.index_select(0, md.spec_token_indx).flip(1)"),
    ("index-cast", "a.index_select(0, md.spec_token_indx.long())"),
    ("index-moved", "a.index_select(0, md.spec_token_indx.to(a.device))"),
    ("index-trimmed", "a.index_select(0, md.spec_token_indx[: md.num_actual_tokens])"),
    ("scaled", "a.index_select(0, md.spec_token_indx) * 2"),
    ("cut-from-zero", "a.index_select(0, md.spec_token_indx)[0:]"),
    ("heads-cut", "a.index_select(0, md.spec_token_indx)[:, 1:]"),
]


@pytest.mark.parametrize("gate", [g for _, g in KEPT], ids=[n for n, _ in KEPT])
def test_casts_moves_and_the_padding_trim_keep_the_rows(gate: str) -> None:
    assert status(gathered(gate), {"torch": "torch"}) is Status.FIXED


def test_a_start_plus_a_count_is_a_range_bound_not_a_changed_index() -> None:
    """``spec_token_start + num_spec_decode_tokens`` ends the spec range (the
    Kimi layers' slices): no arithmetic on an index."""
    body = """\
    end = md.spec_token_start + md.num_spec_decode_tokens
    x_spec = x[md.spec_token_start : end]
    a_s = a[md.spec_token_start : end]
    b_s = b[md.spec_token_start : end]
    """
    assert status(site(body, "a_s", "b_s")) is Status.FIXED


@pytest.mark.parametrize(
    "write", ["i[0] = 0", "i += 1", "i.add_(1)", "i.copy_(i.flip(0))", "i[:] = i.flip(0)"]
)
def test_an_index_written_in_place_between_the_gathers_is_unknown(write: str) -> None:
    """q/k/v read the index before the write, the gates after it: their rows differ."""
    body = f"""\
    i = md.spec_token_indx
    x_spec = x.index_select(0, i)
    {write}
    a_s = a.index_select(0, i)
    b_s = b.index_select(0, i)
    """
    assert status(site(body, "a_s", "b_s")) is Status.UNKNOWN


def test_a_buffer_filled_in_place_keeps_the_index_it_was_read_with() -> None:
    """Writing into a row tensor (``out[:n] = part``) leaves the index alone."""
    body = """\
    i = md.spec_token_indx
    x_spec = x.index_select(0, i)
    a_s = a.index_select(0, i)
    b_s = b.index_select(0, i)
    buf = x_spec.clone()
    buf[:2] = x_spec[:2]
    """
    assert status(site(body, "a_s", "b_s")) is Status.FIXED


# Writes into a gathered gate (``a_s``) between its gather and the call.
OVERWRITTEN = [
    ("slice-all-rows", "a_s[:] = a[: a_s.shape[0]]"),
    ("copy-all-rows", "a_s.copy_(a[: a_s.shape[0]])"),
    ("add-all-rows", "a_s.add_(a[: a_s.shape[0]])"),
    ("non-spec-rows", "a_s[:] = a.index_select(0, md.non_spec_token_indx)"),
    ("copy-non-spec-rows", "a_s.copy_(a.index_select(0, md.non_spec_token_indx))"),
]


@pytest.mark.parametrize("write", [w for _, w in OVERWRITTEN], ids=[n for n, _ in OVERWRITTEN])
def test_a_gate_written_with_other_rows_is_unknown(write: str) -> None:
    """The gate the kernel reads then mixes its spec rows with rows of
    another named selection: not the rows q/k/v hold (never ``fixed``, and
    never gathered again by ``apply``). Rows nobody can name written in are
    not judged (a buffer filled from slices of its own rows looks the same:
    ``test_a_buffer_filled_from_slices_of_its_own_rows_keeps_them``)."""
    lines = f"a_s = a.index_select(0, md.spec_token_indx)\n{write}"
    assert status(between(lines), {"torch": "torch"}) is Status.UNKNOWN


KEPT_WRITES = [
    ("scaled", "a_s[:] = a_s * 2"),
    ("masked-constant", "a_s[a_s > 0] = 0.0"),
    ("masked-fill", "a_s.masked_fill_(a_s > 0, 0.0)"),
    ("weights", "a_s.mul_(self.A_log)"),
    ("same-rows", "a_s.copy_(a.index_select(0, md.spec_token_indx).float())"),
]


@pytest.mark.parametrize("write", [w for _, w in KEPT_WRITES], ids=[n for n, _ in KEPT_WRITES])
def test_a_gate_written_with_its_own_rows_or_no_rows_keeps_them(write: str) -> None:
    lines = f"a_s = a.index_select(0, md.spec_token_indx)\n{write}"
    assert status(between(lines), {"torch": "torch"}) is Status.FIXED


def test_a_buffer_filled_from_slices_of_its_own_rows_keeps_them() -> None:
    """vLLM's CPU spec path (0.27+): ``out = torch.empty_like(x_spec)``, then
    ``out[start : start + n] = f(x_spec[start : start + n])`` per sequence."""
    body = """\
    x_spec = x.index_select(0, md.spec_token_indx)
    a_s = a.index_select(0, md.spec_token_indx)
    b_s = b.index_select(0, md.spec_token_indx)
    out = torch.empty_like(x_spec)
    for i in range(md.num_spec_decodes):
        start = int(md.spec_query_start_loc[i].item())
        n = int(md.seq_lens[i].item())
        out[start : start + n] = x_spec[start : start + n] * 2
    x_spec = out
    """
    assert status(site(body, "a_s", "b_s"), {"torch": "torch"}) is Status.FIXED


# A gate's token axis indexed by a value the analysis cannot name: not the
# rows of the step in order (``apply`` would gather them again: wrong rows),
# nor the spec rows once gathered.
PICKED = [
    ("metadata-index", "a_s = a[md.perm]"),
    ("local-permutation", "perm = torch.randperm(a.shape[0])\na_s = a[perm]"),
    ("one-row", "a_s = a[md.row]"),
    ("two-dims", "a_s = a[md.perm, :]"),
    ("picked-then-gathered", "a_s = a[md.perm].index_select(0, md.spec_token_indx)"),
    ("in-the-call", "a_s = a[md.perm]\na_s = a_s.float()"),
]


@pytest.mark.parametrize("pick", [p for _, p in PICKED], ids=[n for n, _ in PICKED])
def test_a_gate_picked_by_an_unknown_index_is_unknown_never_patched(pick: str) -> None:
    assert status(between(pick), {"torch": "torch"}) is Status.UNKNOWN


PICKS_KEPT = [
    ("heads", "a_s = a.index_select(0, md.spec_token_indx)[:, md.head]"),
    ("lead-dropped", "a_s = a.index_select(0, md.spec_token_indx)[None][0]"),
    ("ellipsis", "a_s = a.index_select(0, md.spec_token_indx)[..., md.head]"),
]


@pytest.mark.parametrize("pick", [p for _, p in PICKS_KEPT], ids=[n for n, _ in PICKS_KEPT])
def test_a_gate_indexed_off_its_token_axis_keeps_its_rows(pick: str) -> None:
    assert status(between(pick), {"torch": "torch"}) is Status.FIXED


def test_a_dict_looked_up_beside_the_call_changes_nothing() -> None:
    """``slot_mapping[layer_name]`` indexes an entry parameter the analysis
    takes for rows: only a gate that came through such a pick is judged."""
    body = """\
    slots = md.slot_mapping[self.layer_name]
    x_spec = x.index_select(0, md.spec_token_indx)
    a_s = a.index_select(0, md.spec_token_indx)
    b_s = b.index_select(0, md.spec_token_indx)
    """
    assert status(site(body, "a_s", "b_s"), {"torch": "torch"}) is Status.FIXED
    raw = site("x_spec = x.index_select(0, md.spec_token_indx)\nmd.slot_mapping[self.n]\n")
    assert status(raw) is Status.AFFECTED


@pytest.mark.parametrize("gate", ["a[md.perm]", "a[: md.num_spec_decode_tokens]"])
def test_apply_refuses_a_gate_it_cannot_vouch_for_and_writes_nothing(
    tmp_path: Path, gate: str
) -> None:
    """Before: ``affected``, and apply gathered the picked or cut rows again
    by the spec index (``a_s.index_select(0, md.spec_token_indx)``): a wrong
    patch."""
    func = between(f"a_s = {gate}")
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    layer = tmp_path / "vllm" / "layer.py"
    text = "from vllm.ops import fused_sigmoid_gating_delta_rule_update\n\n\n" + func
    layer.write_text(text)
    assert main(["apply", str(tmp_path)]) == 2
    assert layer.read_text() == text
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["__init__.py", "layer.py", "vllm"]


# A gate cut to a prefix by a count (``x[:n]``, read as the padding trim)
# that q/k/v were not cut by: a prefix of some rows, not every real token.
CUT = [
    ("spec-count", "n = md.num_spec_decode_tokens\na_s = a[:n]"),
    ("decode-count", "a_s = a[: md.num_decode_tokens]"),
    ("cut-then-gathered", "a_s = a[: md.num_decodes].index_select(0, md.spec_token_indx)"),
    ("identity-prefix", "a_s = a.index_select(0, torch.arange(md.num_spec_decode_tokens))"),
    # The analysis cannot tell the padding count from a count of some rows
    # by its name: a gate cut alone, even by ``num_actual_tokens``, is refused.
    ("gate-cut-alone", "a_s = a[: md.num_actual_tokens]"),
]


@pytest.mark.parametrize("cut", [c for _, c in CUT], ids=[n for n, _ in CUT])
def test_a_gate_cut_by_a_count_q_k_v_were_not_cut_by_is_unknown(cut: str) -> None:
    assert status(between(cut), {"torch": "torch"}) is Status.UNKNOWN


def test_the_padding_trim_of_q_k_v_and_the_gates_keeps_the_verdicts() -> None:
    """vLLM's ``mixed_qkv = mixed_qkv[:num_actual_tokens]`` beside ``a = a[:...]``
    (every release): one count cuts both, so the gates are every real row."""
    trim = [
        "n = md.num_actual_tokens",
        "x = x[:n]",
        "a = a[:n]",
        "b = b[:n]",
        "x_spec = x.index_select(0, md.spec_token_indx)",
    ]
    assert status(site("\n".join(trim) + "\n")) is Status.AFFECTED
    gathers = [
        "a_s = a.index_select(0, md.spec_token_indx)",
        "b_s = b.index_select(0, md.spec_token_indx)",
    ]
    assert status(site("\n".join(trim + gathers) + "\n", "a_s", "b_s")) is Status.FIXED


# The gates' index shifted by a count the q/k/v index was not (or the
# reverse): other rows than q/k/v's. One shift for both keeps the verdict.
SHIFTED = [
    (
        "gate-shifted",
        "x_spec = x.index_select(0, md.spec_token_indx)",
        "md.spec_token_indx + md.off",
    ),
    ("q-shifted", "x_spec = x.index_select(0, md.spec_token_indx - md.off)", "md.spec_token_indx"),
    (
        "other-shift",
        "x_spec = x.index_select(0, md.spec_token_indx - md.off)",
        "md.spec_token_indx - md.other",
    ),
]


@pytest.mark.parametrize(
    ("q", "index"), [(q, i) for _, q, i in SHIFTED], ids=[n for n, _, _ in SHIFTED]
)
def test_gates_gathered_by_an_index_shifted_otherwise_than_q_k_v_are_unknown(
    q: str, index: str
) -> None:
    body = "\n".join([q, f"a_s = a.index_select(0, {index})", f"b_s = b.index_select(0, {index})"])
    assert status(site(body + "\n", "a_s", "b_s")) is Status.UNKNOWN


def test_one_shift_for_q_k_v_and_the_gates_keeps_the_verdict() -> None:
    """A fork's local index (``spec_token_indx - shard_start``) used alike."""
    body = """\
    i = md.spec_token_indx - md.shard_start
    x_spec = x.index_select(0, i)
    a_s = a.index_select(0, i)
    b_s = b.index_select(0, i)
    """
    assert status(site(body, "a_s", "b_s")) is Status.FIXED


def test_raw_gates_beside_a_shifted_q_k_v_index_are_affected() -> None:
    """The rewrite gathers raw gates by q/k/v's own index, shift and all."""
    body = "x_spec = x.index_select(0, md.spec_token_indx - md.shard_start)\n"
    assert status(site(body)) is Status.AFFECTED


# Gates whose names cross the kernel's parameters: the gate handed as ``a``
# comes from the tensor named ``b`` only (a swap, or the other tensor).
CROSSED = [
    ("swapped-gathered", "a_s = a.index_select(0, i)\nb_s = b.index_select(0, i)", "b_s", "a_s"),
    ("other-tensor", "a_s = b.index_select(0, i)\nb_s = b.index_select(0, i)", "a_s", "b_s"),
    ("swapped-raw", "", "b", "a"),
]


@pytest.mark.parametrize(
    ("lines", "a", "b"), [(body, a, b) for _, body, a, b in CROSSED], ids=[n for n, *_ in CROSSED]
)
def test_gates_crossed_with_the_kernels_parameters_are_unknown(lines: str, a: str, b: str) -> None:
    head = "i = md.spec_token_indx\nx_spec = x.index_select(0, i)\n"
    assert status(site(head + lines + "\n", a, b)) is Status.UNKNOWN


def test_gates_that_read_both_tensors_or_other_names_keep_their_verdict() -> None:
    head = "i = md.spec_token_indx\nx_spec = x.index_select(0, i)\n"
    mixed = "a_s = (a + b).index_select(0, i)\nb_s = b.index_select(0, i)\n"
    assert status(site(head + mixed, "a_s", "b_s")) is Status.FIXED
    renamed = "alpha = b.index_select(0, i)\nbeta = a.index_select(0, i)\n"
    assert status(site(head + renamed, "beta", "alpha")) is Status.FIXED
