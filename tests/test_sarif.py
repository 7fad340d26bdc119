"""``scan``/``apply --check --format sarif``: SARIF 2.1.0 for code scanning (issue 22).

Every log is validated against OASIS's SARIF 2.1.0 schema (errata 01),
vendored in tests/data/ (docs/decisions.md says where it comes from and
why it may be copied). A fix must be the patchset's own rewrite: its
replacements, applied to the files as they are, give what ``apply``
writes, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gdn_backport import registry
from gdn_backport.sarif import SCHEMA
from tests.conftest import run

DATA = Path(__file__).resolve().parent / "data"
SITE = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"
KERNEL = "fused_sigmoid_gating_delta_rule_update"


SCHEMA_SHA256 = "c3b4bb2d6093897483348925aaa73af03b3e3f4bd4ca38cef26dcb4212a2682e"


def test_the_vendored_schema_is_oasis_as_recorded() -> None:
    """tests/data/README.md records it: OASIS's errata 01 schema, unmodified."""
    data = (DATA / "sarif-schema-2.1.0.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == SCHEMA_SHA256
    assert SCHEMA_SHA256 in (DATA / "README.md").read_text()
    assert json.loads(data)["id"] == SCHEMA


def _validator() -> Any:
    schema = json.loads((DATA / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


VALIDATOR = _validator()


def sarif(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = run(capsys, *argv, "--format", "sarif")
    doc = json.loads(out)
    errors = sorted(VALIDATOR.iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    return code, doc, err


def _lines(text: str) -> list[str]:
    # SARIF's lines, as the log declares them (newlineSequences): CRLF, LF, CR.
    return re.split(r"(?<=\r\n)|(?<=\n)|(?<=\r)(?!\n)", text)


def _offset(lines: list[str], line: int, column: int) -> int:
    return sum(len(x) for x in lines[: line - 1]) + column - 1


def apply_fix(text: str, replacements: list[dict[str, Any]]) -> str:
    """What a SARIF consumer does with a fix's replacements of one file."""
    lines = _lines(text)
    spans = []
    for r in replacements:
        d = r["deletedRegion"]
        start = _offset(lines, d["startLine"], d["startColumn"])
        end = _offset(lines, d["endLine"], d["endColumn"])
        spans.append((start, end, r["insertedContent"]["text"]))
    for start, end, new in sorted(spans, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def results(doc: dict[str, Any]) -> list[dict[str, Any]]:
    [one] = doc["runs"]
    found: list[dict[str, Any]] = one["results"]
    return found


# -- small trees written here ------------------------------------------------------------


def test_rules_are_the_patchsets(capsys: pytest.CaptureFixture[str], affected_tree: Path) -> None:
    code, doc, _ = sarif(capsys, "scan", str(affected_tree))
    assert code == 1
    assert doc["version"] == "2.1.0" and doc["$schema"] == SCHEMA
    [one] = doc["runs"]
    driver = one["tool"]["driver"]
    assert driver["name"] == "gdn-backport"
    rules = {r["id"]: r for r in driver["rules"]}
    assert list(rules) == list(registry.available())
    for ps in registry.discover():
        r = rules[ps.info.id]
        repo, number = ps.info.upstream.split("#")
        assert r["helpUri"] == f"https://github.com/{repo}/pull/{number}"
        assert r["fullDescription"]["text"] == ps.info.title
        assert ps.info.summary in r["shortDescription"]["text"]
    # ruleIndex points at the rule of ruleId.
    for res in results(doc):
        assert driver["rules"][res["ruleIndex"]]["id"] == res["ruleId"]


def test_an_affected_site_carries_its_fix_at_the_kernel_call(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, tmp_path: Path
) -> None:
    code, doc, _ = sarif(capsys, "apply", "--check", str(affected_tree))
    assert code == 1
    [res] = results(doc)
    assert res["ruleId"] == "pr51812" and res["level"] == "error"
    props = res["properties"]
    assert props["status"] == "affected" and props["location"] == "call"
    [loc] = res["locations"]
    phys = loc["physicalLocation"]
    assert phys["artifactLocation"] == {"uri": SITE, "uriBaseId": "%SRCROOT%"}
    text = (affected_tree / SITE).read_text()
    lines = text.splitlines()
    region = phys["region"]
    # The region is the spec kernel's call, the def line is in the properties.
    assert lines[region["startLine"] - 1][region["startColumn"] - 1 :].startswith(KERNEL + "(")
    assert lines[props["line"] - 1].lstrip().startswith("def _forward_core")
    assert region["startLine"] > props["line"]
    assert loc["logicalLocations"] == [{"fullyQualifiedName": props["function"],
                                        "kind": "function"}]  # fmt: skip
    # The fix, applied as a SARIF consumer would, is what `apply` writes.
    [fix] = res["fixes"]
    [change] = fix["artifactChanges"]
    assert change["artifactLocation"]["uri"] == SITE
    fixed = apply_fix(text, change["replacements"])
    copy = tmp_path / "copy"
    shutil.copytree(affected_tree, copy)
    assert run(capsys, "apply", str(copy))[0] == 0
    assert fixed == (copy / SITE).read_text()


def test_exit_codes_and_stderr_are_the_commands_own(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    for argv, want in (
        (["scan"], 1),
        (["apply", "--check"], 1),
        (["apply", "--dry-run"], 0),
    ):
        plain = run(capsys, *argv, str(affected_tree))
        code, doc, err = sarif(capsys, *argv, str(affected_tree))
        assert code == plain[0] == want, argv
        assert err == plain[2]
        assert doc["runs"][0]["invocations"] == [{"executionSuccessful": True, "exitCode": want}]


def test_a_writing_apply_refuses_the_format(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    before = (affected_tree / SITE).read_bytes()
    for fmt in ("sarif", "github"):
        code, out, err = run(capsys, "apply", str(affected_tree), "--format", fmt)
        assert (code, out) == (2, "")
        assert err == f"gdn-backport: apply: --format {fmt} goes with --check or --dry-run\n"
    code, out, err = run(capsys, "scan", str(affected_tree), "--json", "--format", "sarif")
    assert code == 2 and "--json and --format sarif exclude each other" in err
    assert (affected_tree / SITE).read_bytes() == before
    # --format json is --json.
    assert json.loads(run(capsys, "scan", str(affected_tree), "--format", "json")[1])["sites"]


CALLER = f"""\
from vllm.ops import {KERNEL}


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
            core_attn_out[:] = self._spec_update(a, b, q, k, v, slots, md.num_accepted_tokens)

    def _spec_update(self, a, b, q, k, v, slots, accepted):
        return {KERNEL}(
            A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
            ssm_state_indices=slots, num_accepted_tokens=accepted,
        )
"""

# A kernel under an alias: the sweep finds it and the analysis cannot judge it.
UNKNOWN = f"""\
import functools

from vllm.ops import {KERNEL}


class Other:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        md = self.metadata()
        spec_token_indx = md.spec_token_indx
        slots = md.spec_state_indices_tensor
        mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
        q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
        kernel = functools.partial({KERNEL}, a=a, b=b)
        core_attn_out[:] = kernel(q=q, k=k, v=v, ssm_state_indices=slots)
"""


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"vllm/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_a_chain_goes_to_related_locations_and_the_helper_call_is_the_location(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = _tree(tmp_path / "fork", {"vllm/layer.py": CALLER})
    code, doc, _ = sarif(capsys, "apply", "--check", str(root))
    assert code == 1
    [res] = results(doc)
    region = res["locations"][0]["physicalLocation"]["region"]
    line = CALLER.splitlines()[region["startLine"] - 1]
    # The call the fix changes: the helper's, which hands the gates down.
    assert line[region["startColumn"] - 1 :].startswith("self._spec_update(a, b")
    related = res["relatedLocations"]
    assert [r["logicalLocations"][0]["fullyQualifiedName"] for r in related] == [
        "Layer._forward_core",
        "Layer._spec_update",
        KERNEL,
    ]
    assert [r["id"] for r in related] == [1, 2, 3]
    # Functions of the site's file have their def line; the kernel is named only.
    assert related[1]["physicalLocation"]["region"] == {"startLine": 17}
    assert "physicalLocation" not in related[2]
    assert "[Layer._spec_update](2)" in res["message"]["text"]
    [change] = res["fixes"][0]["artifactChanges"]
    fixed = apply_fix(CALLER, change["replacements"])
    assert run(capsys, "apply", str(root))[0] == 0
    assert fixed == (root / "vllm" / "layer.py").read_text()


def test_unknown_sites_are_errors_without_a_fix_and_their_patchset_offers_none(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    root = _tree(tmp_path / "fork", {"vllm/layer.py": CALLER, "vllm/other.py": UNKNOWN})
    plain = run(capsys, "apply", "--check", str(root))
    code, doc, err = sarif(capsys, "apply", "--check", str(root))
    assert code == plain[0] == 2 and err == plain[2] and err.count("\n") == 1
    by_status = {r["properties"]["status"]: r for r in results(doc)}
    unknown, affected = by_status["unknown"], by_status["affected"]
    assert unknown["level"] == "error" and "fixes" not in unknown
    # No call line for an unknown site: its function's def line.
    assert unknown["properties"]["location"] == "site"
    assert unknown["locations"][0]["physicalLocation"]["region"] == {"startLine": 7}
    assert "apply` refuses this tree" in unknown["message"]["text"]
    # The patchset refuses the tree: no fix for its affected site either, and why.
    assert "fixes" not in affected
    assert affected["properties"]["noFix"].startswith("apply refuses this tree (vllm/other.py")
    assert affected["properties"]["location"] == "site"


def test_uris_are_relative_to_the_checkout_that_holds_the_tree(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    affected_tree: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # affected_tree is tmp_path/"tree": a CI job runs in the repository's top.
    monkeypatch.chdir(tmp_path)
    _, doc, _ = sarif(capsys, "scan", "tree")
    [one] = doc["runs"]
    assert one["originalUriBaseIds"] == {"%SRCROOT%": {"uri": tmp_path.resolve().as_uri() + "/"}}
    [res] = one["results"]
    assert res["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == f"tree/{SITE}"
    # The site's own path stays tree-relative (the JSON contract's).
    assert res["properties"]["path"] == SITE
    # A tree outside the current directory: URIs relative to the tree.
    monkeypatch.chdir(affected_tree / "vllm")
    _, doc, _ = sarif(capsys, "scan", str(affected_tree))
    [one] = doc["runs"]
    assert one["originalUriBaseIds"]["%SRCROOT%"]["uri"] == affected_tree.resolve().as_uri() + "/"
    assert one["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == SITE


def test_a_fixed_tree_has_no_result(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    code, doc, _ = sarif(capsys, "apply", "--check", str(affected_tree))
    assert code == 0 and results(doc) == []


# -- a real release ------------------------------------------------------------------


@pytest.mark.network
@pytest.mark.parametrize(
    "options",
    # The kernel strategy is pr51812's alone (its fix adds an import at the
    # file's top, outside the site's function).
    [["--strategy", "gather"], ["--strategy", "kernel", "--patchset", "pr51812"]],
    ids=["gather", "kernel"],
)
def test_the_fixes_of_a_real_release_are_what_apply_writes(
    capsys: pytest.CaptureFixture[str], release: Any, tmp_path: Path, options: list[str]
) -> None:
    """0.25.1 is affected by both patchsets: the spec kernel call of the
    Qwen layer, the metadata builder and both runners' routes. Each result's
    fix, applied to the release as it is, gives the file ``apply`` writes."""
    tree: Path = release("0.25.1")
    code, doc, _ = sarif(capsys, "apply", "--check", "--release", "0.25.1", *options)
    assert code == 1
    found = results(doc)
    want = [("pr51812", "QwenGatedDeltaNetAttention._forward_core")]
    if "--patchset" not in options:
        want = [
            ("pr51565", "GDNAttentionMetadataBuilder.build"),
            ("pr51565", "GPUModelRunner.execute_model"),
            ("pr51565", "GPUModelRunner.execute_model"),
            *want,
        ]
    assert sorted((r["ruleId"], r["properties"]["function"]) for r in found) == want
    work = tmp_path / "work"
    assert run(capsys, "apply", "--release", "0.25.1", "--workdir", str(work), *options)[0] == 0
    for res in found:
        assert res["fixes"], res["message"]
        for change in res["fixes"][0]["artifactChanges"]:
            uri = change["artifactLocation"]["uri"]
            original = (tree / uri).read_text(encoding="utf-8")
            assert apply_fix(original, change["replacements"]) == (work / uri).read_text(
                encoding="utf-8"
            ), uri
    [qwen] = [r for r in found if r["ruleId"] == "pr51812"]
    region = qwen["locations"][0]["physicalLocation"]["region"]
    layer = (tree / qwen["properties"]["path"]).read_text().splitlines()
    assert layer[region["startLine"] - 1].strip() == f"{KERNEL}("
    for builder in (r for r in found if r["properties"]["function"].endswith(".build")):
        lines = (tree / builder["properties"]["path"]).read_text().splitlines()
        start = builder["locations"][0]["physicalLocation"]["region"]["startLine"]
        assert lines[start - 1].strip().startswith("split_decodes_and_prefills(")
