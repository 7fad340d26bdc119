"""The kernel strategy's reading of the tree's own kernel, and its apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_backport.patchsets.pr51812.codemods.base import Refusal
from gdn_backport.patchsets.pr51812.codemods.kernel_op import null_slot_id
from gdn_backport.patchsets.pr51812.plan import apply_tree
from gdn_backport.pipeline import Mode, revert_tree
from gdn_backport.site import Status
from tests.conftest import AFFECTED

KERNEL = """\
def fused_sigmoid_gating_delta_rule_update(A_log, a, b, dt_bias, q, k, v):
    pass

def kernel(i_n, p_idx):
    state_idx = load(p_idx + i_n)
    if state_idx {skip} 0:
        return
    final_state_idx = load(p_idx + i_n + 1)
    if final_state_idx {store} 0:
        store()
"""


def _tree(tmp_path: Path, skip: str, store: str) -> Path:
    ops = tmp_path / "vllm" / "fla" / "ops"
    ops.mkdir(parents=True)
    (ops / "fused_sigmoid_gating.py").write_text(KERNEL.format(skip=skip, store=store))
    return tmp_path


@pytest.mark.parametrize(
    ("skip", "store", "expected"), [("<", ">=", -1), ("<=", ">", 0)], ids=["pad-slot", "null-block"]
)
def test_slot_rule_read_from_the_kernel(
    tmp_path: Path, skip: str, store: str, expected: int
) -> None:
    assert null_slot_id(_tree(tmp_path, skip, store)) == expected


@pytest.mark.parametrize(("skip", "store"), [("<", ">"), ("==", "!=")], ids=["mixed", "none"])
def test_unclear_slot_rule_is_refused(tmp_path: Path, skip: str, store: str) -> None:
    with pytest.raises(Refusal, match="cannot tell which state slots"):
        null_slot_id(_tree(tmp_path, skip, store))


def test_kernel_strategy_apply_scan_revert(tmp_path: Path) -> None:
    root = _tree(tmp_path, "<=", ">")
    site = root / "vllm" / "gdn.py"
    site.write_text(AFFECTED)
    out = apply_tree(root, "kernel", Mode.WRITE)
    assert out.exit_code == 0, out.refused
    text = site.read_text()
    assert "from gdn_backport_kernels import gated_delta_rule_spec_update" in text
    assert "null_slot_id=0" in text and "spec_token_indx=spec_token_rows" in text
    [change] = out.changes
    assert change.status is Status.FIXED and "gated_delta_rule_spec_update" in change.now.reason
    # Idempotent, and the gather strategy has nothing left to do either.
    assert not apply_tree(root, "kernel").written
    assert not apply_tree(root, "gather").written
    revert_tree(root)
    assert site.read_text() == AFFECTED


@pytest.mark.network
@pytest.mark.parametrize(
    ("version", "branch"),
    [("0.18.1", "fallback"), ("0.21.0", "fallback"), ("0.27.1", "op")],
)
def test_guarded_call_passes_the_suite_on_either_branch(
    version: str, branch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel strategy's guarded call on a real release: with the op
    # forced off, the fallback branch (the tree's own kernel on gathered
    # gates) must pass the mixed-batch suite alone; without, the op must.
    from gdn_backport.verify import triton_problem, verify_tree
    from tests import corpus

    if triton_problem():
        pytest.skip(triton_problem())
    root = corpus.slim_tree(version, tmp_path / version)
    out = apply_tree(root, "kernel", Mode.WRITE)
    assert out.exit_code == 0, out.refused
    if branch == "fallback":
        monkeypatch.setenv("GDN_BACKPORT_KERNEL", "off")
    ran: dict[str, int] = {}

    def count_spec_calls(module: object) -> None:
        for name in ("gated_delta_rule_spec_update", "fused_sigmoid_gating_delta_rule_update"):
            fn = getattr(module, name)

            def counted(*args: object, _fn: object = fn, _name: str = name, **kw: object) -> object:
                if kw.get("num_accepted_tokens") is not None:
                    ran[_name] = ran.get(_name, 0) + 1
                return _fn(*args, **kw)  # type: ignore[operator]

            setattr(module, name, counted)

    report = verify_tree(root, scenarios=["pr_layout", "pure_spec"], patch=count_spec_calls)
    assert report.passed, [(r.name, r.note) for r in report.rows] or report.error
    want = (
        "gated_delta_rule_spec_update"
        if branch == "op"
        else "fused_sigmoid_gating_delta_rule_update"
    )
    assert set(ran) == {want}, ran
