"""Fork shapes that releases never use, on the spec call of our own example.

Each shape rewrites the spec kernel call (or its gate arguments) of the
example layer the way a fork might: gates chosen by a conditional
expression, a lambda that gathers or that wraps the kernel, a lambda handed
to a capture helper or called in place, arguments packed into a dict or a
tuple. What must hold: a buggy shape is never reported clean or missed
(affected, or unknown with its reason), a fixed shape is never reported
affected, and `apply` on a shape it cannot rewrite changes nothing.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gdn_backport.patchsets.pr51812.scan import scan_tree
from tests.conftest import AFFECTED, run
from tests.test_chains import tree

KERNEL = "fused_sigmoid_gating_delta_rule_update"
HEADER = f"import torch\nfrom vllm.model_executor.layers.fla.ops import {KERNEL}\n\n\n"
GATES = "a=a,  # the gate rows the bug is about\n                b=b,"
REST = (
    "dt_bias=self.dt_bias, q=query_spec, k=key_spec, v=value_spec, initial_state=ssm_state,"
    " ssm_state_indices=spec_state_indices_tensor, num_accepted_tokens=m.num_accepted_tokens"
)
PURE = "(m.num_prefills == 0 and m.num_decodes == 0)"

_start = AFFECTED.index(f"            out_spec, _ = {KERNEL}(\n")
_end = AFFECTED.index("            )\n", _start) + len("            )\n")


def with_gates(a: str, b: str) -> str:
    assert GATES in AFFECTED
    return HEADER + AFFECTED.replace(GATES, f"a={a}, b={b},", 1)


def with_call(lines: str) -> str:
    """The spec call replaced by ``lines`` (statements at its indentation)."""
    body = textwrap.indent(textwrap.dedent(lines).strip() + "\n", " " * 12)
    return HEADER + AFFECTED[:_start] + body + AFFECTED[_end:]


HELPER_ROWS = "def _rows(t, idx, pure):\n    return t if pure else t.index_select(0, idx)\n\n\n"

FIXED_SHAPES = {
    # upstream's placement as a conditional expression: the test that chose
    # the q/k/v rows, written with parentheses
    "ifexp_parenthesised": with_gates(
        f"a if {PURE} else a[spec_token_indx]", f"b if {PURE} else b[spec_token_indx]"
    ),
    # the same test with its operands the other way round
    "ifexp_operands_swapped": with_gates(
        "a if m.num_decodes == 0 and m.num_prefills == 0"
        " else torch.index_select(a, 0, spec_token_indx)",
        "b if (m.num_decodes == 0 and m.num_prefills == 0) else b.index_select(0, spec_token_indx)",
    ),
    # a module helper handed the pure-spec test as a value
    "helper_given_the_test": HELPER_ROWS
    + with_gates(f"_rows(a, spec_token_indx, {PURE})", f"_rows(b, spec_token_indx, {PURE})"),
    # a local lambda that gathers, called on each gate
    "lambda_gathers": with_call(f"""
        pick = lambda t: t if {PURE} else t.index_select(0, spec_token_indx)
        out_spec, _ = {KERNEL}(A_log=self.A_log, a=pick(a), b=pick(b), {REST})
    """),
}

BUGGY_SHAPES = {
    # a test that does not imply the pure-spec path
    "ifexp_weaker_test": with_gates(
        "a if m.num_prefills == 0 else a[spec_token_indx]",
        "b if m.num_prefills == 0 else b[spec_token_indx]",
    ),
    "helper_given_a_weaker_test": HELPER_ROWS
    + with_gates(
        "_rows(a, spec_token_indx, m.num_prefills == 0)",
        "_rows(b, spec_token_indx, m.num_prefills == 0)",
    ),
    "ifexp_negated_test": with_gates(
        f"a if not {PURE} else a[spec_token_indx]", f"b if not {PURE} else b[spec_token_indx]"
    ),
    # the kernel inside a lambda: called by name, in place, or handed on
    "lambda_called_by_name": with_call(f"""
        run = lambda aa, bb: {KERNEL}(A_log=self.A_log, a=aa, b=bb, {REST})
        out_spec, _ = run(a, b)
    """),
    "lambda_called_in_place": with_call(f"""
        out_spec, _ = (lambda aa, bb: {KERNEL}(A_log=self.A_log, a=aa, b=bb, {REST}))(a, b)
    """),
    "lambda_handed_on": with_call(f"""
        out_spec, _ = self.capture(lambda: {KERNEL}(A_log=self.A_log, a=a, b=b, {REST}))
    """),
    "named_lambda_handed_on": with_call(f"""
        fn = lambda: {KERNEL}(A_log=self.A_log, a=a, b=b, {REST})
        out_spec, _ = self.capture(fn)
    """),
    # arguments packed before the call
    "kwargs_dict_call": with_call(f"""
        kw = dict(A_log=self.A_log, a=a, b=b, {REST})
        out_spec, _ = {KERNEL}(**kw)
    """),
    "kwargs_dict_literal": with_call(f"""
        kw = {{"A_log": self.A_log, "a": a, "b": b, "dt_bias": self.dt_bias, "q": query_spec,
              "k": key_spec, "v": value_spec, "initial_state": ssm_state,
              "ssm_state_indices": spec_state_indices_tensor}}
        out_spec, _ = {KERNEL}(**kw)
    """),
    "args_tuple": with_call(f"""
        args = (self.A_log, a, b, self.dt_bias, query_spec, key_spec, value_spec, 1.0, 20.0,
                None, ssm_state, True, None, spec_state_indices_tensor)
        out_spec, _ = {KERNEL}(*args)
    """),
}


SITE = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"


def _tree(tmp_path: Path, text: str) -> Path:
    compile(text, "shape", "exec")  # a shape that is not Python is a broken test
    return tree(tmp_path, {SITE: text})


def _statuses(root: Path) -> set[str]:
    _, sites = scan_tree(root)
    return {s.status for s in sites}


@pytest.mark.parametrize("name", sorted(FIXED_SHAPES))
def test_a_fixed_shape_is_never_affected(tmp_path: Path, name: str) -> None:
    assert _statuses(_tree(tmp_path, FIXED_SHAPES[name])) == {"fixed"}


@pytest.mark.parametrize("name", sorted(BUGGY_SHAPES))
def test_a_buggy_shape_is_never_missed(tmp_path: Path, name: str) -> None:
    statuses = _statuses(_tree(tmp_path, BUGGY_SHAPES[name]))
    assert statuses and statuses <= {"affected", "unknown"}, statuses


@pytest.mark.parametrize("name", ["lambda_called_by_name", "kwargs_dict_call", "args_tuple"])
def test_apply_refuses_what_it_cannot_rewrite_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    root = _tree(tmp_path, BUGGY_SHAPES[name])
    path = root / SITE
    before = path.read_bytes()
    code, _, err = run(capsys, "apply", str(root))
    assert code == 2 and str(path) in err, err
    assert path.read_bytes() == before
    assert not (root / ".gdn-backport").exists()
