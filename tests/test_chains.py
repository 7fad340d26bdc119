"""The spec path through helpers, fork kernels, path feasibility (issue 12).

Small trees written here, shaped like forks: the kernel call moved into a
method, a module function or another module of the tree; a fork's own kernel
with and without a declaration; gates staged through ``None``; branches that
contradict each other; a locally built identity index.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from gdn_backport.patchsets.pr51812.scan import scan_tree
from tests.conftest import run

KERNEL = "fused_sigmoid_gating_delta_rule_update"

# The caller every shape shares: q/k/v gathered in the mixed branch, aliased
# on the pure-spec path, handed on with raw gates by ``{call}``.
CALLER = """\
class Layer:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        md = self.metadata()
        spec_token_indx = md.spec_token_indx
        slots = md.spec_state_indices_tensor
        if md.spec_sequence_masks is not None:
            if md.num_prefills == 0 and md.num_decodes == 0:
                mixed_qkv_spec = mixed_qkv
            else:
                mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
            q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
            core_attn_out[:] = {call}
"""

HELPER_METHOD = f"""\

    def _spec_update(self, a, b, q, k, v, slots, accepted):
        return {KERNEL}(
            A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
            ssm_state_indices=slots, num_accepted_tokens=accepted,
        )
"""

HEADER = f"from vllm.ops import {KERNEL}\n\n\n"


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "tree"
    for rel, text in {"vllm/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def scan_json(
    capsys: pytest.CaptureFixture[str], root: Path, *argv: str
) -> list[dict[str, object]]:
    _, out, err = run(capsys, "scan", str(root), "--json", *argv)
    assert out, err
    found: list[dict[str, object]] = json.loads(out)["sites"]
    return found


def only(found: list[dict[str, object]], function: str) -> dict[str, object]:
    [site] = [s for s in found if s["function"] == function]
    return site


# -- helpers ---------------------------------------------------------------------


def test_helper_method_is_a_site_through_the_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call = "self._spec_update(a, b, q, k, v, slots, md.num_accepted_tokens)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + HELPER_METHOD})
    site = only(scan_json(capsys, root), "Layer._forward_core")
    assert site["status"] == "affected"
    assert site["via"] == ["Layer._forward_core", "Layer._spec_update", KERNEL]
    code, out, _ = run(capsys, "scan", str(root))
    assert code == 1
    assert f"Layer._forward_core -> Layer._spec_update -> {KERNEL}" in out
    # Before issue 12 the helper alone was analysed: its parameters all rows,
    # "aligned". It must not be reported on its own.
    assert not [s for s in scan_json(capsys, root) if s["function"] == "Layer._spec_update"]


def test_gather_patches_the_caller_and_leaves_the_helper(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call = "self._spec_update(a, b, q, k, v, slots, md.num_accepted_tokens)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + HELPER_METHOD})
    before = (root / "vllm/gdn.py").read_text()
    code, out, _ = run(capsys, "apply", str(root))
    assert code == 0, out
    after = (root / "vllm/gdn.py").read_text()
    assert "self._spec_update(a_spec, b_spec, q, k, v, slots" in after
    assert "a_spec = a.index_select(0, spec_token_indx)" in after
    assert "                a_spec = a\n" in after  # upstream's alias on the pure-spec path
    # The helper's own text is unchanged.
    assert after.endswith(HELPER_METHOD)
    assert only(scan_json(capsys, root), "Layer._forward_core")["status"] == "fixed"
    assert run(capsys, "apply", str(root))[0] == 0
    assert (root / "vllm/gdn.py").read_text() == after
    assert run(capsys, "revert", str(root))[0] == 0
    assert (root / "vllm/gdn.py").read_text() == before


def test_helper_reading_the_slots_from_metadata_is_no_silent_miss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The caller never names the spec state slots (it did not count as a
    # spec path before issue 12: "no GDN spec path found", exit 0).
    text = f"""\
        from vllm.ops import {KERNEL}


        class Layer:
            def _forward_core(self, mixed_qkv, b, a, out):
                md = self.metadata()
                x = mixed_qkv.index_select(0, md.spec_token_indx)
                q, k, v = self.rearrange_mixed_qkv(x)
                out[:] = self._spec(q, k, v, a, b, md)

            def _spec(self, q, k, v, a, b, md):
                return {KERNEL}(
                    A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
                    ssm_state_indices=md.spec_state_indices_tensor,
                    num_accepted_tokens=md.num_accepted_tokens,
                )
        """
    root = tree(tmp_path, {"vllm/gdn.py": text})
    assert run(capsys, "apply", "--check", str(root))[0] == 1
    assert run(capsys, "apply", str(root))[0] == 0
    assert "out[:] = self._spec(q, k, v, a_spec, b_spec, md)" in (root / "vllm/gdn.py").read_text()


def test_module_function_and_imported_helper_two_levels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    caller = "from .spec import spec_update\n\n\n" + CALLER.format(
        call="spec_update(self, q, k, v, a, b, slots, md.num_accepted_tokens)"
    )
    spec = f"""\
        from vllm.ops import {KERNEL}


        def spec_update(layer, q, k, v, a, b, slots, acc):
            return _inner(layer, q=q, k=k, v=v, a=a, b=b, slots=slots, acc=acc)


        def _inner(layer, q, k, v, a, b, slots, acc=None):
            return {KERNEL}(
                A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias, q=q, k=k, v=v,
                ssm_state_indices=slots, num_accepted_tokens=acc,
            )
        """
    root = tree(tmp_path, {"vllm/layers/gdn.py": caller, "vllm/layers/spec.py": spec})
    (root / "vllm/layers/__init__.py").write_text("")
    site = only(scan_json(capsys, root), "Layer._forward_core")
    assert site["status"] == "affected"
    assert site["path"] == "vllm/layers/gdn.py"
    assert site["via"] == ["Layer._forward_core", "spec_update", "_inner", KERNEL]
    assert run(capsys, "apply", str(root))[0] == 0
    assert (root / "vllm/layers/spec.py").read_text() == textwrap.dedent(spec)
    assert only(scan_json(capsys, root), "Layer._forward_core")["status"] == "fixed"


def test_a_helper_with_two_callers_gets_both_patched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    second = """\

    def _spec_only(self, mixed_qkv, b, a, md):
        i = md.spec_token_indx
        x = mixed_qkv.index_select(0, i)
        q, k, v = self.rearrange_mixed_qkv(x)
        return self._spec_update(a, b, q, k, v, md.spec_state_indices_tensor, None)
"""
    call = "self._spec_update(a, b, q, k, v, slots, md.num_accepted_tokens)"
    text = HEADER + CALLER.format(call=call) + HELPER_METHOD + second
    root = tree(tmp_path, {"vllm/gdn.py": text})
    found = scan_json(capsys, root)
    assert {s["function"]: s["status"] for s in found} == {
        "Layer._forward_core": "affected",
        "Layer._spec_only": "affected",
    }
    assert run(capsys, "apply", str(root))[0] == 0
    after = (root / "vllm/gdn.py").read_text()
    assert "self._spec_update(a_spec, b_spec, q, k, v, md.spec_state_indices_tensor" in after
    assert "a_spec = a.index_select(0, i)" in after
    assert {s["status"] for s in scan_json(capsys, root)} == {"fixed"}


def test_a_helper_given_gathered_gates_is_fixed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call = "self._spec_update(a[spec_token_indx], b[spec_token_indx], q, k, v, slots, None)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + HELPER_METHOD})
    # On the pure-spec path the index is the identity at run time, but not to
    # the analysis: gathered gates beside all-row q/k/v there cannot be proven.
    site = only(scan_json(capsys, root), "Layer._forward_core")
    assert site["status"] == "unknown"
    assert "right only if every row is a spec token" in str(site["reason"])
    fixed = CALLER.replace(
        "                mixed_qkv_spec = mixed_qkv\n",
        "                mixed_qkv_spec = mixed_qkv\n                a_s, b_s = a, b\n",
    ).replace(
        "mixed_qkv.index_select(0, spec_token_indx)\n",
        "mixed_qkv.index_select(0, spec_token_indx)\n"
        "                a_s, b_s = a[spec_token_indx], b[spec_token_indx]\n",
    )
    text = HEADER + fixed.format(call="self._spec_update(a_s, b_s, q, k, v, slots, None)")
    root = tree(tmp_path / "fixed", {"vllm/gdn.py": text + HELPER_METHOD})
    assert only(scan_json(capsys, root), "Layer._forward_core")["status"] == "fixed"


def test_a_helper_that_reads_the_gate_refuses_naming_the_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    helper = HELPER_METHOD.replace(
        "        return", "        self.rows = a.shape[0]\n        return"
    )
    call = "self._spec_update(a, b, q, k, v, slots, md.num_accepted_tokens)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + helper})
    before = (root / "vllm/gdn.py").read_bytes()
    code, _, err = run(capsys, "apply", str(root))
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "Layer._forward_core -> Layer._spec_update" in err
    assert "beyond passing it to the kernel" in err
    assert (root / "vllm/gdn.py").read_bytes() == before


def test_the_kernel_strategy_refuses_a_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call = "self._spec_update(a, b, q, k, v, slots, md.num_accepted_tokens)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + HELPER_METHOD})
    code, _, err = run(capsys, "apply", str(root), "--strategy", "kernel")
    assert code == 2 and "use --strategy gather" in err


def test_deeper_than_the_limit_is_unknown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Five helpers down: past the followed depth, never silently passed.
    chain = "".join(
        f"\n    def _h{i}(self, a, b, q, k, v, slots):\n"
        f"        return self._h{i + 1}(a, b, q, k, v, slots)\n"
        for i in range(5)
    )
    last = HELPER_METHOD.replace(
        "_spec_update(self, a, b, q, k, v, slots, accepted)", "_h5(self, a, b, q, k, v, slots)"
    ).replace("num_accepted_tokens=accepted", "num_accepted_tokens=None")
    call = "self._h0(a, b, q, k, v, slots)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + chain + last})
    site = only(scan_json(capsys, root), "Layer._forward_core")
    assert site["status"] == "unknown"
    assert "deeper than" in str(site["reason"])


def test_recursion_is_cut_and_unknown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    helper = """\

    def _spec_update(self, a, b, q, k, v, slots, n):
        if n:
            return self._spec_update(a, b, q, k, v, slots, n - 1)
        return torch.ops.fork.gdn(q, k, v, a, b, slots)
"""
    call = "self._spec_update(a, b, q, k, v, slots, 2)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + helper})
    site = only(scan_json(capsys, root), "Layer._forward_core")
    assert site["status"] == "unknown"


# -- a fork's own kernels ---------------------------------------------------------

FORK = "torch.ops.myfork.gdn_spec(q, k, v, a, b, slots, md.num_accepted_tokens)"


def test_an_undeclared_fork_kernel_is_unknown_with_a_declaration_to_paste(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tree(tmp_path, {"vllm/gdn.py": "import torch\n\n\n" + CALLER.format(call=FORK)})
    site = only(scan_json(capsys, root), "Layer._forward_core")
    assert site["status"] == "unknown"
    reason = str(site["reason"])
    snippet = reason[reason.index("kernel = [") :]
    # The snippet, pasted as it is, lets the tool decide: affected, then fixed.
    (root / ".gdn-backport.toml").write_text(snippet + "\n")
    assert only(scan_json(capsys, root), "Layer._forward_core")["status"] == "affected"
    assert run(capsys, "apply", str(root))[0] == 0
    text = (root / "vllm/gdn.py").read_text()
    assert "torch.ops.myfork.gdn_spec(q, k, v, a_spec, b_spec, slots" in text
    # A raw-gate kernel, as the suggestion declares it (fix_target = true):
    # its site is fixed once the gates are gathered (D21: it read not_affected).
    assert "fix_target = true" in snippet
    assert only(scan_json(capsys, root), "Layer._forward_core")["status"] == "fixed"


DECLARATION = """\
[[kernel]]
name = "gdn_spec"
params = ["q", "k", "v", "g1", "g2", "state_slots", "accepted"]
rows = ["q", "k", "v"]
gates = ["g1", "g2"]
state_indices = "state_slots"
accepted = "accepted"
fix_target = true
"""


@pytest.mark.parametrize("where", ["overlay", "pyproject", "option"])
def test_declarations_come_from_the_tree_or_an_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    root = tree(tmp_path, {"vllm/gdn.py": "import torch\n\n\n" + CALLER.format(call=FORK)})
    argv: list[str] = []
    if where == "overlay":
        (root / ".gdn-backport.toml").write_text(DECLARATION)
    elif where == "pyproject":
        tool = DECLARATION.replace("[[kernel]]", "[[tool.gdn-backport.kernel]]")
        (root / "pyproject.toml").write_text('[project]\nname = "fork"\n\n' + tool)
    else:
        (tmp_path / "k.toml").write_text(DECLARATION)
        argv = ["--kernels", str(tmp_path / "k.toml")]
    site = only(scan_json(capsys, root, *argv), "Layer._forward_core")
    assert site["status"] == "affected"
    assert "gdn_spec: gate g1=a has all rows" in str(site["reason"])
    assert run(capsys, "apply", str(root), *argv)[0] == 0
    assert only(scan_json(capsys, root, *argv), "Layer._forward_core")["status"] == "fixed"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (DECLARATION.replace('"state_slots"\n', '"nope"\n'), "'nope' is not one of its params"),
        (DECLARATION.replace("gdn_spec", KERNEL), "a declaration cannot redefine it"),
        (DECLARATION + DECLARATION, "declared twice"),
        (DECLARATION.replace("fix_target = true", "fix_target = 1"), "fix_target"),
        ("[[kernel]\n", "not valid TOML"),
        (DECLARATION.replace("rows", "row"), "unknown key 'row'"),
    ],
)
def test_a_bad_declaration_is_a_one_line_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, reason: str
) -> None:
    root = tree(tmp_path, {"vllm/gdn.py": "import torch\n\n\n" + CALLER.format(call=FORK)})
    (root / ".gdn-backport.toml").write_text(text)
    before = (root / "vllm/gdn.py").read_bytes()
    for argv in (["scan"], ["apply"]):
        code, _, err = run(capsys, *argv, str(root))
        assert code == 2
        assert reason in err and ".gdn-backport.toml" in err
        assert len(err.strip().splitlines()) == 1
    assert (root / "vllm/gdn.py").read_bytes() == before


def test_an_unlisted_callee_with_consistent_rows_is_not_affected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    call = "torch.ops.myfork.gdn_spec(q, k, v, a[spec_token_indx], b[spec_token_indx], slots)"
    text = "import torch\n\n\n" + CALLER.format(call=call).replace(
        "mixed_qkv_spec = mixed_qkv\n", "mixed_qkv_spec = mixed_qkv[spec_token_indx]\n"
    )
    root = tree(tmp_path, {"vllm/gdn.py": text})
    code, out, _ = run(capsys, "scan", str(root))
    assert code == 0 and "no GDN spec path found" not in out
    site = only(scan_json(capsys, root), "Layer._forward_core")
    assert site["status"] == "not_affected"
    assert "every row argument carries spec rows" in str(site["reason"])


# -- path feasibility ---------------------------------------------------------------

BODY = f"""\
from vllm.ops import {KERNEL}


class Layer:
    def _forward_core(self, mixed_qkv, b, a, out):
        md = self.metadata()
        spec_sequence_masks = md.spec_sequence_masks
        spec_token_indx = md.spec_token_indx
{{body}}
def _k(a, b, q, md):
    return {KERNEL}(
        A_log=None, a=a, b=b, dt_bias=None, q=q, k=q, v=q,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
"""


def status_of(tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str) -> str:
    text = BODY.format(body=textwrap.indent(textwrap.dedent(body), " " * 8))
    root = tree(tmp_path, {"vllm/gdn.py": text})
    return str(only(scan_json(capsys, root), "Layer._forward_core")["status"])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # `is None` against `is not None`: the None arm never meets the call.
        (
            """\
            if spec_sequence_masks is None:
                a_s, b_s = None, None
            else:
                a_s = a.index_select(0, spec_token_indx)
                b_s = b.index_select(0, spec_token_indx)
            x = mixed_qkv.index_select(0, spec_token_indx)
            if spec_sequence_masks is not None:
                out[:] = _k(a_s, b_s, x, md)
            """,
            "fixed",
        ),
        # `c` against `not c`, and the attribute read against its local.
        (
            """\
            gathered = md.num_decodes > 0
            if gathered:
                x = mixed_qkv.index_select(0, spec_token_indx)
                a_s, b_s = a[spec_token_indx], b[spec_token_indx]
            if not gathered:
                x, a_s, b_s = mixed_qkv, a, b
            if md.spec_sequence_masks is not None:
                out[:] = _k(a_s, b_s, x, md)
            """,
            "fixed",
        ),
        # An early return: past it, the spec path exists.
        (
            """\
            if spec_sequence_masks is None:
                a_s = None
                return self.plain(mixed_qkv, a, b)
            a_s = a[spec_token_indx]
            x = mixed_qkv[spec_token_indx]
            out[:] = _k(a_s, b[spec_token_indx], x, md)
            """,
            "fixed",
        ),
        # Gates staged through None, set under a guard.
        (
            """\
            a_s = None
            b_s = None
            x = mixed_qkv.index_select(0, spec_token_indx)
            if a_s is None:
                a_s = a.index_select(0, spec_token_indx)
            if b_s is None:
                b_s = b
            out[:] = _k(a_s, b_s, x, md)
            """,
            "affected",
        ),
        (
            """\
            a_s = None
            if a_s is None:
                a_s = a.index_select(0, spec_token_indx)
            x = mixed_qkv.index_select(0, spec_token_indx)
            out[:] = _k(a_s, b[spec_token_indx], x, md)
            """,
            "fixed",
        ),
        # A local identity index when the metadata has none.
        (
            """\
            if spec_token_indx is None:
                spec_token_indx = torch.arange(mixed_qkv.shape[0])
            x = mixed_qkv.index_select(0, spec_token_indx)
            out[:] = _k(a, b, x, md)
            """,
            "affected",
        ),
        (
            """\
            if spec_token_indx is None:
                spec_token_indx = torch.arange(mixed_qkv.shape[0])
            x = mixed_qkv.index_select(0, spec_token_indx)
            out[:] = _k(a[spec_token_indx], b[spec_token_indx], x, md)
            """,
            "fixed",
        ),
        # Not a contradiction: an `or` arm does not negate its parts.
        (
            """\
            if spec_sequence_masks is None or md.num_decodes == 0:
                a_s = a
            else:
                a_s = a[spec_token_indx]
            x = mixed_qkv[spec_token_indx]
            if spec_sequence_masks is not None:
                out[:] = _k(a_s, b[spec_token_indx], x, md)
            """,
            "affected",
        ),
    ],
    ids=[
        "is-None-vs-is-not-None",
        "c-vs-not-c",
        "early-return",
        "None-guard-one-gate-raw",
        "None-guard-gathered",
        "arange-index-raw-gates",
        "arange-index-gathered",
        "or-is-no-contradiction",
    ],
)
def test_path_feasibility(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, expected: str
) -> None:
    assert status_of(tmp_path, capsys, "import torch\n" + textwrap.dedent(body)) == expected


def test_scan_of_a_chain_matches_the_library(tmp_path: Path) -> None:
    call = "self._spec_update(a, b, q, k, v, slots, md.num_accepted_tokens)"
    root = tree(tmp_path, {"vllm/gdn.py": HEADER + CALLER.format(call=call) + HELPER_METHOD})
    _, found = scan_tree(root)
    [site] = found
    assert site.chain == f"Layer._forward_core -> Layer._spec_update -> {KERNEL}"
    assert site.to_json()["via"] == list(site.via or ())
