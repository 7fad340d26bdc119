"""``verify_tree``: the mutation check on real releases, the report, the CLI shape.

On CPU the real kernels run under ``TRITON_INTERPRET=1`` with small shapes.
The core proof: on an affected, unpatched release the mixed scenarios fail
(by far more than the tolerance, with the spec kernel reading other tokens'
gates) while pure-spec and spec-first pass; patched and fixed releases pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn_backport.harness.batch import Batch, Row
from gdn_backport.patchsets.pr51812.scenarios import Scenario
from gdn_backport.verify import ScenarioResult, VerifyReport, verify_tree
from tests.harness_fixtures import interpreted, patched_copy, release_tree

AFFECTED = ("0.18.1", "0.21.0", "0.27.1")
MUTATION = ("pr_layout", "pure_spec", "spec_first")
PATCHED = ("pr_layout", "pure_spec", "two_steps")
CI = ("pr_layout", "production", "pure_spec", "no_spec", "spec_first", "two_steps")


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("patched")


def _rows(report: VerifyReport) -> dict[str, ScenarioResult]:
    assert not report.error, report.error
    return {r.name: r for r in report.rows}


# -- the report ----------------------------------------------------------------


def test_report_json_and_table_and_exit_codes() -> None:
    row = ScenarioResult("pr_layout", "tag", "[N1, S3@2]", 0.5, 0.01, False, "why")
    report = VerifyReport(tree="t", site="s", device="cpu", dtype="float16", rows=[row])
    doc = json.loads(report.to_json())
    assert doc["passed"] is False and doc["exit_code"] == 1
    assert doc["rows"][0]["max_abs_err"] == 0.5
    assert "FAIL" in report.table() and "pr_layout" in report.table()
    ok = VerifyReport("t", "s", "cpu", "float16", [ScenarioResult("a", "t", "l", 0.0, 0.01, True)])
    assert ok.exit_code == 0
    broken = VerifyReport("t", "", "cpu", "float16", error="no vllm/")
    assert broken.exit_code == 2 and "error" in broken.table()


def test_verify_refuses_what_it_cannot_drive(tmp_path: Path) -> None:
    assert "no vllm/" in verify_tree(tmp_path).error
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "m.py").write_text("class A:\n    def _forward(self):\n        pass\n")
    report = verify_tree(tmp_path)
    assert report.exit_code == 2 and "_forward" in report.error
    assert verify_tree(tmp_path, scenarios=["nope"]).exit_code == 2


def test_cuda_without_a_device_is_an_error_not_a_crash(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    assert "CUDA" in verify_tree(tmp_path, device="cuda").error


# -- the mutation check ----------------------------------------------------------


@pytest.mark.network
@pytest.mark.parametrize("version", AFFECTED)
def test_unpatched_affected_release_fails_mixed_batches(version: str) -> None:
    interpreted()
    rows = _rows(verify_tree(release_tree(version), scenarios=MUTATION))
    bad = rows["pr_layout"]
    assert not bad.passed
    # The failure is the gate misalignment, far beyond numerical noise.
    assert bad.max_abs_err > 10 * bad.tolerance
    assert "read the gates of tokens (0, 1, 2), the spec tokens are (1, 2, 3)" in bad.note
    assert rows["pure_spec"].passed, rows["pure_spec"].note
    assert "zero-copy" in rows["pure_spec"].note
    assert rows["spec_first"].passed, rows["spec_first"].note


@pytest.mark.network
@pytest.mark.parametrize("strategy", ["gather", "kernel"])
@pytest.mark.parametrize("version", AFFECTED)
def test_patched_affected_release_passes(version: str, strategy: str, patched_root: Path) -> None:
    interpreted()
    report = verify_tree(patched_copy(version, patched_root, strategy), scenarios=PATCHED)
    rows = _rows(report)
    assert report.passed, report.table()
    assert "zero-copy" in rows["pure_spec"].note


@pytest.mark.network
@pytest.mark.parametrize("version", ["0.17.1", "0.28.0"])
def test_not_affected_and_fixed_releases_pass(version: str) -> None:
    interpreted()
    report = verify_tree(release_tree(version), scenarios=CI)
    assert report.passed, report.table()
    assert all(r.max_abs_err <= r.tolerance for r in report.rows)


# -- the layout before 0.11.1: _forward(hidden_states, output) -------------------

FORWARD = ("pr_layout", "no_spec", "two_steps")
# The bug of PR #51812 planted in 0.10.2's mask-based selection: the spec
# kernel gets the gates of the batch's first tokens.
_MASKED_GATES = (
    "                g_spec = g[:, spec_token_masks]\n"
    "                beta_spec = beta[:, spec_token_masks]\n"
)
_FIRST_TOKENS_GATES = (
    "                g_spec = g[:, : int(spec_token_masks.sum())]\n"
    "                beta_spec = beta[:, : int(spec_token_masks.sum())]\n"
)


@pytest.mark.network
@pytest.mark.parametrize("version", ["0.10.2", "0.11.0"])
def test_forward_layout_releases_are_driven_and_pass(version: str) -> None:
    interpreted()
    report = verify_tree(release_tree(version), scenarios=FORWARD)
    assert report.site.endswith("Qwen3NextGatedDeltaNet._forward"), report.site
    assert report.passed, report.table()


@pytest.mark.network
def test_forward_layout_with_the_bug_planted_fails_mixed_batches(tmp_path: Path) -> None:
    from gdn_backport import sources

    interpreted()
    root = tmp_path / "planted"
    sources.copy_release("0.10.2", root)
    module = root / "vllm" / "model_executor" / "models" / "qwen3_next.py"
    text = module.read_text(encoding="utf-8")
    assert text.count(_MASKED_GATES) == 1
    module.write_text(text.replace(_MASKED_GATES, _FIRST_TOKENS_GATES), encoding="utf-8")
    rows = _rows(verify_tree(root, scenarios=MUTATION))
    bad = rows["pr_layout"]
    assert not bad.passed and bad.max_abs_err > 10 * bad.tolerance, bad
    # Pure spec takes g as it is, spec-first selects the same rows either way.
    assert rows["pure_spec"].passed, rows["pure_spec"].note
    assert rows["spec_first"].passed, rows["spec_first"].note


# -- random compositions ---------------------------------------------------------

_row = st.one_of(
    st.builds(Row, spec=st.just(True), query_len=st.integers(1, 4), num_accepted=st.integers(1, 4)),
    st.builds(Row, spec=st.just(False), query_len=st.integers(1, 6)),
)


@pytest.mark.network
@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(rows=st.lists(_row, min_size=2, max_size=4).filter(lambda rs: any(r.spec for r in rs)))
def test_random_compositions_separate_fixed_from_affected(rows: list[Row]) -> None:
    interpreted()
    from gdn_backport.harness.layer import LayerShape
    from gdn_backport.harness.loader import load_tree
    from gdn_backport.patchsets.pr51812.suite import SuiteRunner

    batch = Batch(tuple(rows), num_spec=3)
    shows = any(n < s for n in batch.non_spec_token_indx() for s in batch.spec_token_indx())
    item = Scenario("random", "hypothesis", (batch,), "fail" if shows else "pass")
    for version, ok in (("0.28.0", True), ("0.27.1", not shows)):
        loaded = _LOADED.get(version) or _LOADED.setdefault(
            version, load_tree(release_tree(version))
        )
        runner = SuiteRunner(loaded, LayerShape(dtype=torch.float16), torch.device("cpu"))
        result = runner.run(item, self_consistency=False)
        assert result.passed is ok, (version, batch.describe(), result.note)


_LOADED: dict[str, object] = {}


# -- GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.network
def test_gpu_mutation_check() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rows = _rows(verify_tree(release_tree("0.27.1"), device="cuda", scenarios=MUTATION))
    assert not rows["pr_layout"].passed and rows["pure_spec"].passed
    assert verify_tree(release_tree("0.28.0"), device="cuda", scenarios=CI).passed
