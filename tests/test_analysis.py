"""The data-flow analysis on small sites written here: one behaviour each."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from gdn_backport.patchsets.pr51812.analysis import analyse
from gdn_backport.patchsets.pr51812.config import load
from gdn_backport.site import Status


def status(source: str, imports: dict[str, str] | None = None) -> Status | None:
    module = cst.parse_module(textwrap.dedent(source))
    func = module.body[-1]
    assert isinstance(func, cst.FunctionDef)
    result = analyse(func, load(), imports or {})
    return None if result is None else result.status


KERNEL_TAIL = """
    q, k, v = self.rearrange_mixed_qkv(x_spec)
    return fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log, a={a}, b={b}, dt_bias=self.dt_bias, q=q, k=k, v=v,
        ssm_state_indices=md.spec_state_indices_tensor,
        num_accepted_tokens=md.num_accepted_tokens,
    )
"""


def site(body: str, a: str = "a", b: str = "b") -> str:
    head = "def f(self, x, b, a, md):\n"
    return head + textwrap.indent(textwrap.dedent(body), "    ") + KERNEL_TAIL.format(a=a, b=b)


CASES = [
    # (id, source, expected)
    ("raw-gates", site("x_spec = x.index_select(0, md.spec_token_indx)\n"), Status.AFFECTED),
    (
        "gathered-gates",
        site(
            """\
            i = md.spec_token_indx
            x_spec = x.index_select(0, i)
            a_s = a.index_select(0, i)
            b_s = b.index_select(0, i)
            """,
            "a_s",
            "b_s",
        ),
        Status.FIXED,
    ),
    (
        "gates-gathered-by-the-non-spec-index",
        site(
            """\
            x_spec = x.index_select(0, md.spec_token_indx)
            a_s = a.index_select(0, md.non_spec_token_indx)
            b_s = b.index_select(0, md.non_spec_token_indx)
            """,
            "a_s",
            "b_s",
        ),
        Status.AFFECTED,
    ),
    (
        "only-b-gathered",
        site(
            """\
            x_spec = x.index_select(0, md.spec_token_indx)
            b_s = b.index_select(0, md.spec_token_indx)
            """,
            "a",
            "b_s",
        ),
        Status.AFFECTED,
    ),
    (
        "mask-complement-is-non-spec",
        site(
            """\
            m = md.spec_token_masks
            x_spec = x[m]
            a_s, b_s = a[~m], b[~m]
            """,
            "a_s",
            "b_s",
        ),
        Status.AFFECTED,
    ),
    (
        "pure-spec-alias-on-both-sides",
        site(
            """\
            if md.num_prefills == 0 and md.num_decodes == 0:
                x_spec, a_s, b_s = x, a, b
            else:
                i = md.spec_token_indx
                x_spec, a_s, b_s = x[i], a[i], b[i]
            """,
            "a_s",
            "b_s",
        ),
        Status.FIXED,
    ),
    (
        "alias-in-the-wrong-branch",
        site(
            """\
            if md.num_prefills == 0 and md.num_decodes == 0:
                x_spec = x
                a_s = a.index_select(0, md.spec_token_indx)
            else:
                x_spec = x.index_select(0, md.spec_token_indx)
                a_s = a
            """,
            "a_s",
        ),
        Status.AFFECTED,
    ),
    (
        "gathered-twice-is-unknown",
        site("x_spec = x[md.spec_token_indx][md.spec_token_indx]\n"),
        Status.UNKNOWN,
    ),
    # Every call handed the spec state slots is a site: with no gather, q/k/v
    # and the gates carry the same (all) rows.
    ("no-gather-not-affected", site("x_spec = x\n"), Status.NOT_AFFECTED),
]


@pytest.mark.parametrize(("source", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_status(source: str, expected: Status | None) -> None:
    assert status(source) is expected


def test_positional_binding_follows_the_kernel_signature() -> None:
    src = """\
    def f(self, x, b, a, md):
        i = md.spec_token_indx
        x_spec = x.index_select(0, i)
        q, k, v = self.split(x_spec)
        return fused_sigmoid_gating_delta_rule_update(
            self.A_log, {}, {}, self.dt_bias, q, k, v,
            ssm_state_indices=md.spec_state_indices_tensor,
        )
    """
    assert status(src.format("a", "b")) is Status.AFFECTED
    assert status(src.format("a[i]", "b[i]")) is Status.FIXED


def test_import_alias_is_resolved() -> None:
    src = """\
    def f(self, x, b, a, md):
        x_spec = x.index_select(0, md.spec_token_indx)
        q, k, v = self.split(x_spec)
        return upd(A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
                   ssm_state_indices=md.spec_state_indices_tensor)
    """
    # Unlisted, `upd` takes the spec slots with gathered and raw rows: it may
    # be a kernel with the bug, so the tool cannot say (fail closed).
    assert status(src) is Status.UNKNOWN
    imports = {"upd": "fla.ops.fused_sigmoid_gating_delta_rule_update"}
    assert status(src, imports) is Status.AFFECTED


def test_the_non_spec_decode_call_is_not_the_spec_call() -> None:
    src = """\
    def f(self, x, b, a, md):
        x_ns = x.index_select(0, md.non_spec_token_indx)
        x_spec = x.index_select(0, md.spec_token_indx)
        q, k, v = self.split(x_ns)
        return fused_sigmoid_gating_delta_rule_update(
            A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
            ssm_state_indices=md.non_spec_state_indices_tensor,
        )
    """
    assert status(src) is None


def test_precomputed_gates_gathered_are_not_affected() -> None:
    src = """\
    def f(self, x, b, a, md):
        g, beta = fused_gdn_gating(self.A_log, a, b, self.dt_bias)
        i = md.spec_token_indx
        x_spec = x.index_select(0, i)
        q, k, v = self.split(x_spec)
        return fused_recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=g.index_select(1, i), beta=beta.index_select(1, i),
            ssm_state_indices=md.spec_state_indices_tensor,
        )
    """
    assert status(src) is Status.NOT_AFFECTED


def test_renamed_metadata_fields_are_followed_through_locals() -> None:
    src = site(
        """\
        meta = md
        tok = meta.spec_token_indx
        sel = tok.to(x.device)
        x_spec = x.index_select(0, sel)
        """
    )
    assert status(src) is Status.AFFECTED


@pytest.mark.parametrize(
    ("imports", "index", "expected"),
    [
        # Ours, imported: a gather by the spec index, identity for None.
        ({"gather_token_rows": "gdn_backport_kernels.gather_token_rows"}, "i", Status.FIXED),
        ({"gather_token_rows": "gdn_backport_kernels.gather_token_rows"}, "None", Status.AFFECTED),
        # A fork's own function of that name may do anything: not a gather.
        ({}, "i", Status.UNKNOWN),
        ({"gather_token_rows": "fork.utils.gather_token_rows"}, "i", Status.UNKNOWN),
    ],
    ids=["ours", "ours-none-index", "local-name", "other-module"],
)
def test_row_gather_is_ours_only(imports: dict[str, str], index: str, expected: Status) -> None:
    # The fallback branch of the kernel strategy's guarded call gathers the
    # gates with gdn_backport_kernels.gather_token_rows (patchset [row_gather]).
    body = f"""\
    i = md.spec_token_indx
    x_spec = x.index_select(0, i)
    a_s = gather_token_rows(a, {index})
    b_s = gather_token_rows(b, index={index})
    """
    assert status(site(body, "a_s", "b_s"), imports) is expected
