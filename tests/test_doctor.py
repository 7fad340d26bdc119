"""``gdn-backport doctor`` on fake vLLM installs (tests/fake_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gdn_backport.cli import main
from gdn_backport.patchsets.pr51812.plan import apply_tree
from tests.fake_vllm import AFFECTED, FIXED, forget_fake
from tests.test_runtime_plugin import UNKNOWN

GDN_FILE = "vllm/model_executor/layers/gdn.py"


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["doctor", "--json", *args])
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == code
    return code, doc


def test_no_vllm_is_exit_2_with_one_line(
    fake: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert main(["doctor"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gdn-backport: vLLM is not importable")


def test_affected_without_our_plugin_is_exit_1(
    fake: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    fake(ours=False)
    code, doc = doctor(capsys)
    assert code == 1
    [row] = doc["rows"]
    assert (row["method"], row["path"], row["status"]) == (
        "Layer._forward_core",
        GDN_FILE,
        "affected",
    )
    assert row["live"] == f"{GDN_FILE}:5" and row["runtime_patch"] is False
    assert row["on_disk"] == "no apply record"
    assert doc["verdict"].startswith("AFFECTED: Layer._forward_core")
    assert "gdn-backport plugin not loaded" in doc["plugins"]


def test_our_plugin_in_effect_is_exit_0(fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fake()
    code, doc = doctor(capsys)
    assert code == 0
    [row] = doc["rows"]
    assert row["status"] == "fixed" and row["runtime_patch"] is True
    assert row["live"] == f"<gdn-backport:pr51812 {GDN_FILE}>:5"
    assert doc["verdict"] == "ok: fixed in memory by the gdn-backport plugin (Layer._forward_core)"


def test_vllm_plugins_leaving_ours_out_is_seen(
    fake: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake()
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    assert doctor(capsys)[0] == 1


def test_no_plugins_flag_looks_at_the_file_as_imported(
    fake: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    fake(hardware=FIXED, ours=False)
    code, doc = doctor(capsys, "--no-plugins")
    assert code == 1 and doc["rows"][0]["live"] == f"{GDN_FILE}:5"


@pytest.mark.parametrize(("hw", "status", "code"), [(AFFECTED, "affected", 1), (FIXED, "fixed", 0)])
def test_hardware_plugin_replacement_is_what_is_reported(
    fake: Any, capsys: pytest.CaptureFixture[str], hw: str, status: str, code: int
) -> None:
    # The file on disk is affected either way: only the live method counts.
    fake(hardware=hw, ours=False)
    got, doc = doctor(capsys)
    assert got == code
    [row] = doc["rows"]
    assert row["status"] == status and row["live"].startswith(str(Path("vllm_fakehw", "ops.py")))


def test_hardware_plugin_and_ours_together_end_patched(
    fake: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    fake(hardware=AFFECTED)
    code, doc = doctor(capsys)
    assert code == 0
    assert doc["rows"][0]["live"] == "<gdn-backport:pr51812 vllm_fakehw/ops.py>:1"


def test_file_patched_by_apply_is_reported(fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    site = fake(ours=False)
    assert apply_tree(site).exit_code == 0
    code, doc = doctor(capsys)
    assert code == 0
    [row] = doc["rows"]
    assert row["status"] == "fixed" and row["on_disk"] == "patched by apply (gather)"
    (site / GDN_FILE).write_text((site / GDN_FILE).read_text() + "# local edit\n")
    forget_fake()
    assert doctor(capsys)[1]["rows"][0]["on_disk"] == "apply record, but the file changed since"


def test_unknown_in_effect_is_exit_2(fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fake(gdn=UNKNOWN)
    code, doc = doctor(capsys)
    assert code == 2 and doc["verdict"].startswith("UNKNOWN: Layer._forward_core")


def test_table_output(fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    site = fake(ours=False)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"vllm: 0.0.0+fake ({site / 'vllm'})"
    assert out[2].split() == [
        "patchset",
        "method",
        "file",
        "in",
        "effect",
        "status",
        "runtime",
        "patch",
        "on",
        "disk",
    ]
    assert out[-1].startswith("verdict: AFFECTED")


@pytest.mark.network
def test_pr51565_rows_come_from_the_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The installed 0.25.1's builder is affected by vLLM #51565 on disk (no
    runtime patch covers it); after ``apply --installed --patchset pr51565``
    doctor says the file is patched and the builder and runners are fixed."""
    from gdn_backport import doctor, registry, sources

    root = sources.copy_release("0.25.1", tmp_path / "site")
    rows = registry.get("pr51565").doctor_rows(root / "vllm", root)
    by = {r.method: r for r in rows}
    builder = by["GDNAttentionMetadataBuilder.build"]
    assert (builder.status, builder.patchset, builder.on_disk) == (
        "affected",
        "pr51565",
        "no apply record",
    )
    from gdn_backport.patchsets.pr51565 import plan as engine

    assert engine.apply_tree(root / "vllm", root=root).exit_code == 0
    rows = registry.get("pr51565").doctor_rows(root / "vllm", root)
    assert {r.status for r in rows} == {"fixed"}
    assert {r.on_disk for r in rows} == {"patched by apply (reclassify)"}
    report = doctor.Report(rows=rows)
    assert report.exit_code == 0
    report = doctor.Report(rows=[by["GDNAttentionMetadataBuilder.build"]])
    assert report.exit_code == 1 and "vLLM #51565" in report.verdict


def test_a_verdict_tells_apart_methods_of_one_name_by_their_module() -> None:
    """vLLM's V1 and V2 runners both define ``GPUModelRunner.execute_model``:
    the verdict names each one's module (it named the method twice)."""
    from gdn_backport import doctor

    def row(module: str, status: str, method: str = "GPUModelRunner.execute_model") -> Any:
        path = "vllm/" + module.removeprefix("vllm.").replace(".", "/") + ".py"
        return doctor.Row(method, module, path, path, status, "", False, "", patchset="pr51565")

    v1, v2 = "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"
    for status, head in (("affected", "AFFECTED: "), ("unknown", "UNKNOWN: ")):
        rows = [row(v1, status), row(v2, status), row("vllm.b", status, "Builder.build")]
        verdict = doctor.Report(rows=rows).verdict
        assert verdict.startswith(head)
        assert f"GPUModelRunner.execute_model ({v1}), GPUModelRunner.execute_model ({v2})" in (
            verdict
        )
        assert "Builder.build" in verdict and "Builder.build (" not in verdict
