"""Fork shapes of issue 24: gates staged, gathered along another dimension,
gathered by a helper outside the tree, a second spec path.

Each shape is built from a real release's spec path (fetched at test time
into the cache, never committed) by a transform written here, or is a small
example written here. What must hold: a shape the analysis understands gets
the verdict it deserves (and, when affected, a rewrite the proof accepts:
re-scan `fixed`, a second apply changes nothing, revert gives the original
bytes back); a near miss (a mutant) is never accepted as aligned.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from gdn_backport import sources
from gdn_backport.patchsets.pr51812.scan import scan_tree
from tests.conftest import run

QWEN_0251 = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
KERNEL = "fused_sigmoid_gating_delta_rule_update"

# -- shape 1: gates staged through a local that starts as None ----------------

STAGE = """\
        a_in = None
        b_in = None
        if spec_sequence_masks is not None and {cond}:
            a_in = {a_set}
            b_in = b.float()
        if a_in is None:
            a_in = a.contiguous()
        if b_in is None:
            b_in = b.contiguous()

"""
# The spec call of 0.25.1's _forward_core, and the comment above it.
SPEC_BLOCK = (
    "        # 2. Recurrent attention\n\n"
    "        # 2.1: Process the multi-query part\n"
    "        if spec_sequence_masks is not None:\n"
    "            core_attn_out_spec, last_recurrent_state = (\n"
)
SPEC_GATES = (
    f"                {KERNEL}(\n"
    "                    A_log=self.A_log,\n"
    "                    a=a,\n"
    "                    b=b,"
)


def _release_text(version: str, rel: str) -> str:
    return (sources.release_tree(version) / rel).read_text(encoding="utf-8")


def _write(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "tree"
    for rel, text in {"vllm/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def staged(
    text: str,
    cond: str = "self.fp32_gates",
    a_set: str = "a.float()",
    before: str = "",
) -> str:
    """0.25.1's spec call with its gates staged as forks do: ``a_in = None``,
    set under a condition, defaulted to ``a.contiguous()``, passed as ``a=a_in``."""
    assert text.count(SPEC_BLOCK) == 1, "0.25.1's spec call moved: update the transform"
    stage = before + STAGE.format(cond=cond, a_set=a_set)
    text = text.replace(SPEC_BLOCK, stage + SPEC_BLOCK)
    at = text.index(SPEC_GATES, text.index("        if a_in is None:\n"))
    new = SPEC_GATES.replace("a=a,", "a=a_in,").replace("b=b,", "b=b_in,")
    return text[:at] + new + text[at + len(SPEC_GATES) :]


def _sites(capsys: pytest.CaptureFixture[str], root: Path) -> list[dict[str, object]]:
    _, out, err = run(capsys, "scan", str(root), "--json", "--patchset", "pr51812")
    assert out, err
    return [s for s in json.loads(out)["sites"] if s["function"].endswith("._forward_core")]


def _qwen_site(sites: list[dict[str, object]]) -> dict[str, object]:
    (site,) = [s for s in sites if s["path"] == QWEN_0251 and "Qwen" in str(s["function"])]
    return site


def test_staged_gates_of_a_real_release_are_patched_and_proven(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write(tmp_path, {QWEN_0251: staged(_release_text("0.25.1", QWEN_0251))})
    path = root / QWEN_0251
    original = path.read_bytes()
    assert _qwen_site(_sites(capsys, root))["status"] == "affected"

    code, out, err = run(capsys, "apply", str(root), "--patchset", "pr51812")
    assert code == 0, err
    patched = path.read_text(encoding="utf-8")
    # Every path to the kernel gets spec-row gates: chosen again right before
    # the call, by the test that chose q/k/v's rows, from the staged local.
    assert (
        "            if attn_metadata.num_prefills == 0 and attn_metadata.num_decodes == 0:\n"
        "                a_in_spec = a_in\n"
        "                b_in_spec = b_in\n"
        "            else:\n"
        "                a_in_spec = a_in.index_select(0, spec_token_indx)\n"
        "                b_in_spec = b_in.index_select(0, spec_token_indx)\n"
        "            core_attn_out_spec, last_recurrent_state = (\n"
    ) in patched
    assert "a=a_in_spec," in patched and "b=b_in_spec," in patched
    assert _qwen_site(_sites(capsys, root))["status"] == "fixed"

    code, out, _ = run(capsys, "apply", str(root), "--patchset", "pr51812", "--json")
    assert code == 0 and not any(s["changed"] for s in json.loads(out)["sites"])
    assert path.read_text(encoding="utf-8") == patched

    code, _, err = run(capsys, "revert", str(root))
    assert code == 0, err
    assert path.read_bytes() == original


# Near misses: each must not be patched as if its gates were understood.
STAGED_MUTANTS = {
    # a staged gate that holds the non-spec rows on one path: no rewrite of
    # the spec rows can align it
    "staged_from_non_spec_rows": (
        {"a_set": "a.index_select(0, non_spec_token_indx)"},
        "does not carry all token rows",
    ),
    # the test that chose q/k/v's rows reads a name reassigned before the
    # call: choosing the gate's rows again there could choose otherwise
    "test_name_reassigned": (
        {"before": "        attn_metadata = self.other_metadata\n"},
        "changes before the call",
    ),
}


@pytest.mark.parametrize("name", sorted(STAGED_MUTANTS))
def test_staged_gates_near_misses_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    kwargs, reason = STAGED_MUTANTS[name]
    root = _write(tmp_path, {QWEN_0251: staged(_release_text("0.25.1", QWEN_0251), **kwargs)})
    path = root / QWEN_0251
    before = path.read_bytes()
    assert _qwen_site(_sites(capsys, root))["status"] in ("affected", "unknown")
    code, _, err = run(capsys, "apply", str(root), "--patchset", "pr51812")
    assert code == 2 and reason in err, err
    assert path.read_bytes() == before
    assert not (root / ".gdn-backport").exists()


STAGED_SMALL = textwrap.dedent(f"""\
    import torch
    from vllm.model_executor.layers.fla.ops import {KERNEL}


    class ForkGDN:
        def _forward_core(self, mixed_qkv, b, a, core_attn_out):
            md = self.metadata()
            spec_token_indx = md.spec_token_indx
            mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
            q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
            a_in = None
            if md.num_prefills > 0:
                a_in = a.float()
            if a_in is None:
                a_in = a.contiguous()
            out, _ = {KERNEL}(
                A_log=self.A_log, a=a_in, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
                ssm_state_indices=md.spec_state_indices_tensor,
                num_accepted_tokens=md.num_accepted_tokens,
            )
            core_attn_out[: out.shape[0]] = out
""")


def test_staged_gate_of_a_small_fork_is_gathered_before_the_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rel = "vllm/fork/gdn.py"
    root = _write(tmp_path, {rel: STAGED_SMALL})
    code, _, err = run(capsys, "apply", str(root), "--patchset", "pr51812")
    assert code == 0, err
    patched = (root / rel).read_text(encoding="utf-8")
    assert (
        f"        a_in_spec = a_in.index_select(0, spec_token_indx)\n        out, _ = {KERNEL}(\n"
    ) in patched
    assert "a=a_in_spec, b=b_spec," in patched
    _, sites = scan_tree(root)
    assert {s.status for s in sites} == {"fixed"}
