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


# -- shape 2: [1, T, H] gates gathered along dim 1 -------------------------------

QWEN_0171 = "vllm/model_executor/models/qwen3_next.py"
FORK_ENGINE = "myengine/layers/gdn.py"
ENGINE_HEAD = """\
import torch
from vllm.model_executor.layers.fla.ops import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
)
from myengine.gating import fused_gdn_gating


class EngineGatedDeltaNet:
"""
# The fork's engine computes the gates as vLLM's gating did: [1, T, H].
ENGINE_GATING = """\
import torch


def fused_gdn_gating(A_log, a, b, dt_bias):
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return g.unsqueeze(0), b.sigmoid().unsqueeze(0)
"""


def engine_layer(g_gather: str = "g.index_select(1, spec_token_indx)") -> str:
    """0.17.1's _forward_core (the pre-0.18 upstream design) in a fork's own
    engine: its own metadata object, its own gating module."""
    text = _release_text("0.17.1", QWEN_0171)
    start = text.index("    def _forward_core(")
    body = text[start : text.index("\n    def ", start + 10)]
    body = body.split("\n\nclass ", 1)[0]  # the method is the class's last
    vllm_metadata = body[
        body.index("        forward_context = get_forward_context()\n") : body.index(
            "        has_initial_state = attn_metadata.has_initial_state\n"
        )
    ]
    assert "GDNAttentionMetadata" in vllm_metadata, "0.17.1 moved: update the transform"
    body = body.replace(
        vllm_metadata, "        attn_metadata = self.engine.step_metadata(self.layer_id)\n"
    )
    body = body.replace("self.kv_cache[forward_context.virtual_engine]", "self.kv_cache")
    assert body.count("g.index_select(1, spec_token_indx)") == 1
    body = body.replace("g.index_select(1, spec_token_indx)", g_gather)
    return ENGINE_HEAD + body + "\n"


def _engine_site(tmp_path: Path, layer: str, gating: str = ENGINE_GATING) -> tuple[str, str]:
    root = _write(tmp_path, {FORK_ENGINE: layer, "myengine/gating.py": gating})
    _, sites = scan_tree(root)
    (site,) = [s for s in sites if s.function.endswith("._forward_core")]
    return site.status.value, site.reason


def test_pre_018_design_in_a_fork_engine_is_not_affected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, reason = _engine_site(tmp_path, engine_layer())
    assert status == "not_affected", reason
    assert "gathered by the spec token index" in reason
    # Nothing to do: apply exits 0 and changes nothing.
    root = tmp_path / "tree"
    before = (root / FORK_ENGINE).read_bytes()
    code, _, err = run(capsys, "apply", str(root), "--patchset", "pr51812")
    assert code == 0, err
    assert (root / FORK_ENGINE).read_bytes() == before


def test_a_subscript_dim1_gather_is_aligned(tmp_path: Path) -> None:
    layer = engine_layer("g[:, spec_token_indx]").replace(
        "beta.index_select(1, spec_token_indx)", "beta[:, spec_token_indx]"
    )
    status, reason = _engine_site(tmp_path, layer)
    assert status == "not_affected", reason


def test_a_dim0_gather_of_leading_one_gates_is_not_aligned(tmp_path: Path) -> None:
    # [1, T, H] selected along dim 0 (its size-1 batch axis): not token rows.
    status, reason = _engine_site(tmp_path, engine_layer("g.index_select(0, spec_token_indx)"))
    assert status in ("unknown", "affected"), reason
    assert "selects along dim 0, but the token axis" in reason and "[1, T, ...]" in reason


def test_a_dim1_gather_of_token_major_gates_is_not_aligned(tmp_path: Path) -> None:
    # The gates squeezed to [T, H]: dim 1 selects heads, not the spec tokens.
    gating = "        g, beta = fused_gdn_gating(self.A_log, a, b, self.dt_bias)\n"
    layer = engine_layer()
    assert layer.count(gating) == 1
    layer = layer.replace(gating, gating + "        g = g.squeeze(0)\n        beta = beta[0]\n")
    status, reason = _engine_site(tmp_path, layer)
    assert status in ("unknown", "affected"), reason
    assert "selects along dim 1, but the token axis" in reason and "[T, ...]" in reason


SMALL_T_MAJOR = textwrap.dedent("""\
    from vllm.model_executor.layers.fla.ops import fused_recurrent_gated_delta_rule
    from vllm.model_executor.models.qwen3_next import fused_gdn_gating


    class ForkGDN:
        def _forward_core(self, mixed_qkv, b, a, core_attn_out, md):
            idx = md.spec_token_indx
            q, k, v = self.split(mixed_qkv.index_select(0, idx))
            g, beta = fused_gdn_gating(self.A_log, a, b, self.dt_bias)  # [1, T, H]
            g_spec = {g}
            beta_spec = {beta}
            out, _ = fused_recurrent_gated_delta_rule(
                q=q, k=k, v=v, g=g_spec, beta=beta_spec, initial_state=self.state,
                ssm_state_indices=md.spec_state_indices_tensor,
                num_accepted_tokens=md.num_accepted_tokens,
            )
""")


@pytest.mark.parametrize(
    ("g", "beta", "aligned"),
    [
        # the layout unknown (an entry's parameter): the gather says where
        ("a.index_select(0, idx)", "b.index_select(0, idx)", True),
        ("g.index_select(1, idx)", "beta[:, idx]", True),
        ("g[0].index_select(0, idx)", "beta.squeeze(0)[idx]", True),
        ("g.squeeze(0).unsqueeze(0)[:, idx]", "beta[:, idx]", True),
        ("g.index_select(0, idx)", "beta[:, idx]", False),  # [1, T, H] by dim 0
        ("g[idx]", "beta[idx]", False),
        ("g[0].index_select(1, idx)", "beta[:, idx]", False),  # [T, H] by dim 1
        ("g.squeeze(0)[:, idx]", "beta.squeeze(0)[idx]", False),
        ("g.index_select(1, idx)", "beta[..., idx]", False),  # the axis cannot be told
    ],
)
def test_the_token_axis_decides_a_gather(tmp_path: Path, g: str, beta: str, aligned: bool) -> None:
    root = _write(tmp_path, {"vllm/fork/gdn.py": SMALL_T_MAJOR.format(g=g, beta=beta)})
    _, sites = scan_tree(root)
    statuses = {s.status.value for s in sites}
    if aligned:
        assert statuses == {"not_affected"}, [s.reason for s in sites]
    else:
        assert statuses and statuses <= {"unknown", "affected"}, [s.reason for s in sites]


# -- shape 3: a helper outside the tree gathers the rows ------------------------

HELPER_CALLER = textwrap.dedent(f"""\
    from vllm.model_executor.layers.fla.ops import {KERNEL}
    from myfork.spec_utils import gather_spec_rows


    class ForkGDN:
        def _forward_core(self, mixed_qkv, b, a, core_attn_out, md):
            idx = md.spec_token_indx
            mixed_qkv_spec, a_spec, b_spec = gather_spec_rows(idx, mixed_qkv, a, b)
            q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
            out, _ = {KERNEL}(
                A_log=self.A_log, a=a_spec, b=b_spec, dt_bias=self.dt_bias, q=q, k=k, v=v,
                ssm_state_indices=md.spec_state_indices_tensor,
                num_accepted_tokens=md.num_accepted_tokens,
            )
""")
HELPER_FILES = {"vllm/myfork/__init__.py": "", "vllm/myfork/gdn.py": HELPER_CALLER}


def test_a_gather_helper_missing_from_the_tree_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _write(tmp_path, HELPER_FILES)
    _, sites = scan_tree(root)
    (site,) = sites
    assert site.status.value == "unknown"
    assert "`gather_spec_rows` imported from `myfork.spec_utils`" in site.reason, site.reason
    assert "does not hold: scan a tree that includes myfork/spec_utils.py" in site.reason
    assert "ForkGDN._forward_core" in site.reason
    code, _, err = run(capsys, "apply", str(root), "--patchset", "pr51812")
    assert code == 2 and "myfork.spec_utils" in err, err


def test_a_helper_in_the_tree_is_not_called_missing(tmp_path: Path) -> None:
    # The module is there (a helper that forgets the gates): whatever the
    # verdict, the reason never says the tree lacks it, and never clean.
    helper = "def gather_spec_rows(idx, x, a, b):\n    return x.index_select(0, idx), a, b\n"
    root = _write(
        tmp_path, {**HELPER_FILES, "myfork/__init__.py": "", "myfork/spec_utils.py": helper}
    )
    _, sites = scan_tree(root)
    (site,) = sites
    assert site.status.value in ("unknown", "affected")
    assert "does not hold" not in site.reason


# -- shape 4: a second spec path, for tree speculation ---------------------------

TREE_SPEC = textwrap.dedent("""\
    import functools

    import torch
    from vllm.model_executor.layers.fla.ops import (
        fused_recurrent_gated_delta_rule,
        fused_sigmoid_gating_delta_rule_update,
    )
    from vllm.model_executor.models.qwen3_next import fused_gdn_gating


    class TreeSpecGDN:
        def _forward_core(self, mixed_qkv, b, a, core_attn_out, md):
            if md.tree_attn_bias is not None:
                return self._forward_tree_spec(mixed_qkv, b, a, core_attn_out, md)
            idx = md.spec_token_indx
            a_spec = a.index_select(0, idx)
            b_spec = b.index_select(0, idx)
            q, k, v = self.rearrange_mixed_qkv(mixed_qkv.index_select(0, idx))
            out, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log, a=a_spec, b=b_spec, dt_bias=self.dt_bias, q=q, k=k, v=v,
                ssm_state_indices=md.spec_state_indices_tensor,
                num_accepted_tokens=md.num_accepted_tokens,
            )

        def _forward_tree_spec(self, mixed_qkv, b, a, core_attn_out, md):
            spec_token_indx = md.spec_token_indx
            q, k, v = self.rearrange_mixed_qkv(mixed_qkv.index_select(0, spec_token_indx))
            g, beta = fused_gdn_gating(self.A_log, a, b, self.dt_bias)
            g_spec = {g}
            beta_spec = {beta}
    {call}
    """)
TREE_CALL = """\
        out, _ = fused_recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=g_spec, beta=beta_spec, initial_state=self.state,
            ssm_state_indices=md.spec_state_indices_tensor,
            num_accepted_tokens=md.num_accepted_tokens,
        )"""
TREE_PARTIAL = """\
        run = functools.partial(fused_recurrent_gated_delta_rule, initial_state=self.state)
        out, _ = run(
            q=q, k=k, v=v, g=g_spec, beta=beta_spec,
            ssm_state_indices=md.spec_state_indices_tensor,
        )"""


def _tree_spec(tmp_path: Path, g: str, beta: str, call: str = TREE_CALL) -> dict[str, object]:
    text = TREE_SPEC.format(g=g, beta=beta, call=call)
    compile(text, "tree_spec", "exec")
    root = _write(tmp_path, {"vllm/fork/tree_gdn.py": text})
    _, sites = scan_tree(root)
    tree_sites = [
        s
        for s in sites
        if "fused_recurrent_gated_delta_rule" in s.reason or ("_forward_tree_spec" in s.function)
    ]
    assert tree_sites, [(s.function, s.reason) for s in sites]
    worst = min(
        tree_sites,
        key=lambda s: ["affected", "unknown", "fixed", "not_affected"].index(s.status.value),
    )
    return {"status": worst.status.value, "reason": worst.reason, "function": worst.function}


def test_a_tree_spec_path_gathered_by_the_spec_index_is_not_affected(tmp_path: Path) -> None:
    site = _tree_spec(tmp_path, "g.index_select(1, spec_token_indx)", "beta[:, spec_token_indx]")
    assert site["status"] == "not_affected", site
    assert "gathered by the spec token index" in str(site["reason"])


@pytest.mark.parametrize(
    ("g", "beta"),
    [
        ("g", "beta"),  # every token's gates beside the spec rows of q/k/v
        ("g.index_select(1, md.non_spec_token_indx)", "beta[:, spec_token_indx]"),
    ],
)
def test_a_tree_spec_path_with_misaligned_gates_is_affected(
    tmp_path: Path, g: str, beta: str
) -> None:
    site = _tree_spec(tmp_path, g, beta)
    assert site["status"] == "affected", site


def test_a_tree_spec_path_the_analysis_cannot_follow_names_what_stopped_it(
    tmp_path: Path,
) -> None:
    site = _tree_spec(tmp_path, "g", "beta", TREE_PARTIAL)
    assert site["status"] == "unknown", site
    reason = str(site["reason"])
    text = (tmp_path / "tree" / "vllm/fork/tree_gdn.py").read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if "functools.partial(" in t)
    assert (
        f"`run` is `functools.partial(fused_recurrent_gated_delta_rule, ...)` at line {line} "
        "of TreeSpecGDN._forward_tree_spec"
    ) in reason, reason


# -- rows gathered inside a comprehension (a silent miss until session 9) -----

_COMPREHENSION_HELPER = """\
def gather_rows(idx, *ts):
    return tuple(t.index_select(0, idx) for t in ts)


class Layer:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = get_forward_context().attn_metadata[self.prefix]
        spec_token_indx = m.spec_token_indx
        spec_state_indices_tensor = m.spec_state_indices_tensor
        if m.spec_sequence_masks is not None:
            (mixed_qkv_spec,) = gather_rows(spec_token_indx, mixed_qkv)
            query_spec, key_spec, value_spec = self.rearrange_mixed_qkv(mixed_qkv_spec)
            out_spec, _ = fused_sigmoid_gating_delta_rule_update(
                A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias,
                q=query_spec, k=key_spec, v=value_spec,
                initial_state=self.kv_cache[1],
                ssm_state_indices=spec_state_indices_tensor,
                num_accepted_tokens=m.num_accepted_tokens,
            )
"""


def test_rows_gathered_in_a_comprehension_are_not_read_as_clean(tmp_path: Path) -> None:
    """A helper gathering q/k/v in a comprehension, the gates left whole:
    the comprehension's variable was bound to no rows, so the gather was
    lost and the affected site read not_affected, exit 0."""
    gdn = tmp_path / "vllm" / "model_executor" / "layers" / "mamba"
    gdn.mkdir(parents=True)
    (gdn / "gdn_linear_attn.py").write_text(_COMPREHENSION_HELPER)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    _, sites = scan_tree(tmp_path)
    assert sites and all(s.status.value in ("affected", "unknown") for s in sites), [
        (s.status.value, s.reason) for s in sites
    ]
