"""docs/ci.md's snippets parse and say what the tool does (issue 22).

Every fenced YAML, TOML and JSON block is parsed; a workflow has what
GitHub requires of one (``on``, ``jobs``, each job's ``runs-on`` and steps
that each ``run`` or ``use`` something), a use of this repository's Action
passes only its inputs and reads only its outputs, a pre-commit
configuration is one pre-commit accepts and names this repository's hooks,
a SARIF excerpt is a SARIF ``result``. The numbers the guide states about
the matrix are the export's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gdn_backport import matrix
from gdn_backport.matrix import export
from tests.conftest import run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
GUIDE = (REPO / "docs" / "ci.md").read_text()
ACTION = yaml.safe_load((REPO / "action.yml").read_text())
HOOKS = {h["id"] for h in yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())}
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def snippets(kind: str) -> list[str]:
    aliases = {"yaml": ("yaml", "yml"), "toml": ("toml",), "json": ("json",)}[kind]
    return [body for lang, body in FENCE.findall(GUIDE) if lang in aliases]


def test_every_fenced_block_is_one_of_the_checked_kinds() -> None:
    langs = [lang for lang, _ in FENCE.findall(GUIDE)]
    assert set(langs) <= {"yaml", "yml", "toml", "json"}, langs
    assert len(snippets("yaml")) >= 4 and snippets("toml") and len(snippets("json")) >= 2
    # The fences are closed: no ``` is left outside a matched block.
    assert FENCE.sub("", GUIDE).count("```") == 0


def _expressions(text: str) -> list[str]:
    return re.findall(r"\$\{\{\s*(.*?)\s*\}\}", text)


def _check_step(step: dict[str, Any], where: str) -> None:
    assert isinstance(step, dict), where
    assert ("run" in step) != ("uses" in step), f"{where}: a step runs or uses, one of them"
    if "uses" in step:
        assert "@" in step["uses"], f"{where}: {step['uses']} names no version"
    if str(step.get("uses", "")).startswith("OWNER/gdn-backport@"):
        unknown = set(step.get("with", {})) - set(ACTION["inputs"])
        assert not unknown, f"{where}: the Action has no input {unknown}"
        for value in step.get("with", {}).values():
            assert isinstance(value, str), f"{where}: inputs are strings ({value!r})"


def _check_workflow(doc: dict[Any, Any], where: str) -> None:
    # PyYAML (YAML 1.1) reads the key `on` as True; GitHub reads it as "on".
    assert "on" in doc or True in doc, f"{where}: a workflow needs `on`"
    jobs = doc["jobs"]
    assert isinstance(jobs, dict) and jobs, where
    for name, job in jobs.items():
        here = f"{where}: job {name}"
        assert "runs-on" in job, f"{here}: no runs-on"
        steps = job["steps"]
        assert isinstance(steps, list) and steps, f"{here}: no steps"
        ids = {s.get("id") for s in steps}
        for i, step in enumerate(steps):
            _check_step(step, f"{here}, step {i}")
        needs = job.get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            assert need in jobs, f"{here}: needs {need}, which is no job"
        strategy = job.get("strategy", {}).get("matrix")
        if isinstance(strategy, str):
            assert re.fullmatch(r"\$\{\{ fromJSON\(needs\.\w+\.outputs\.\w+\) \}\}", strategy)
        text = yaml.safe_dump(job)
        for expr in _expressions(text):
            m = re.fullmatch(r"steps\.(\w+)\.outputs\.([\w-]+)", expr)
            if m:
                assert m[1] in ids, f"{here}: ${{{{ {expr} }}}} names no step"
                [step] = [s for s in steps if s.get("id") == m[1]]
                if str(step.get("uses", "")).startswith("OWNER/gdn-backport@"):
                    assert m[2] in ACTION["outputs"], f"{here}: the Action has no output {m[2]}"
            m = re.fullmatch(r"needs\.(\w+)\.outputs\.([\w-]+)", expr.removeprefix("fromJSON(")
                             .removesuffix(")"))  # fmt: skip
            if m:
                assert m[2] in jobs[m[1]].get("outputs", {}), f"{here}: {expr}"


def test_yaml_snippets_are_what_github_and_pre_commit_take(tmp_path: Path) -> None:
    from pre_commit.clientlib import load_config

    kinds = []
    for i, body in enumerate(snippets("yaml")):
        doc = yaml.safe_load(body)
        where = f"docs/ci.md yaml block {i}"
        if isinstance(doc, dict) and "jobs" in doc:
            _check_workflow(doc, where)
            kinds.append("workflow")
        elif isinstance(doc, dict) and "repos" in doc:
            config = tmp_path / f"config-{i}.yaml"
            config.write_text(body)
            loaded = load_config(str(config))  # pre-commit's own validation
            ids = {h["id"] for r in loaded["repos"] for h in r["hooks"]}
            assert ids <= HOOKS and ids, ids
            kinds.append("pre-commit")
        elif isinstance(doc, list):
            for j, step in enumerate(doc):
                _check_step(step, f"{where}, step {j}")
            kinds.append("steps")
        else:
            raise AssertionError(f"{where}: not a workflow, steps or a pre-commit config")
    assert kinds.count("workflow") >= 2 and "pre-commit" in kinds and "steps" in kinds
    # The Action's snippet uses it with its SARIF and matrix.
    assert any("OWNER/gdn-backport@" in body for body in snippets("yaml"))


def test_toml_snippets_parse_as_the_matrix_reads_them() -> None:
    for body in snippets("toml"):
        doc = tomllib.loads(body)
        for tree in doc.get("tree", []):
            assert set(tree) <= {"name", "path", "ref", "strategies"}, tree
            assert {"name", "path"} <= set(tree)


def _sarif_definitions() -> dict[str, Any]:
    schema = json.loads((REPO / "tests" / "data" / "sarif-schema-2.1.0.json").read_text())
    return {"$schema": schema["$schema"], "definitions": schema["definitions"]}


def test_json_snippets_are_what_the_tool_prints() -> None:
    cells = export.github_matrix(matrix.cells(matrix.load()))["include"]
    seen = set()
    for body in snippets("json"):
        doc = json.loads(body)
        if "include" in doc:
            # The first entries of the real export, as written.
            assert doc["include"] == cells[: len(doc["include"])]
            seen.add("matrix")
        elif "ruleId" in doc:
            schema = {**_sarif_definitions(), "$ref": "#/definitions/result"}
            jsonschema.Draft4Validator(schema).validate(doc)
            seen.add("sarif")
    assert seen == {"matrix", "sarif"}


@pytest.mark.network
def test_the_sarif_excerpt_is_a_real_result_of_vllm_0_25_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    [excerpt] = [json.loads(b) for b in snippets("json") if "ruleId" in b]
    _, out, _ = run(capsys, "scan", "--release", "0.25.1", "--format", "sarif")
    [real] = [r for r in json.loads(out)["runs"][0]["results"] if r["ruleId"] == "pr51812"]
    assert excerpt["locations"][0]["physicalLocation"] == real["locations"][0]["physicalLocation"]
    [want] = excerpt["fixes"][0]["artifactChanges"][0]["replacements"]
    assert want in real["fixes"][0]["artifactChanges"][0]["replacements"]
    assert real["message"]["text"].startswith(excerpt["message"]["text"].removesuffix(" ..."))
    # The annotation shown is that result's line.
    _, out, _ = run(capsys, "scan", "--release", "0.25.1", "--format", "github")
    [shown] = [line.strip() for line in GUIDE.splitlines() if line.startswith("    ::error ")]
    assert shown in out.splitlines()


def test_the_numbers_of_the_matrix_are_the_exports() -> None:
    m = matrix.load()
    regular = matrix.cells(m)
    wheel_only = matrix.cells(m, releases=[r.version for r in m.releases if r.wheel_only])
    assert len(export.github_matrix(regular)["include"]) == len(regular)
    [(stated, more)] = re.findall(r"makes (\d+) cells;.*?add (\d+) more", GUIDE, re.S)
    assert (int(stated), int(more)) == (len(regular), len(wheel_only))
    sdists = [r for r in m.releases if not r.wheel_only]
    assert f"With the {len(sdists)} releases that have\nan sdist" in GUIDE
    assert f"{len(regular) + len(wheel_only)} cell sessions" in GUIDE
    [progress] = re.findall(r"\[12/(\d+)\]", GUIDE)
    assert int(progress) == len(regular)
    [(ran, ok)] = re.findall(
        r"ran all (\d+) cells on one\nNVIDIA H200 in [\d.]+ s, (\d+) ok", GUIDE
    )
    assert int(ran) == int(ok) == len(regular)
    # `matrix --run` became `matrix run` (the old spelling still works, unsaid).
    assert "--run" not in GUIDE
