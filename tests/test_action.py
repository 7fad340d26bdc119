"""The composite Action (``action.yml``), issue 22.

No GitHub runner is at hand, so the steps run here as a runner runs a
composite action's steps: in order, ``bash --noprofile --norc -eo pipefail``,
with ``${{ inputs.* }}`` and ``${{ steps.*.outputs.* }}`` substituted into
``env``/``with``/``if``, ``$GITHUB_OUTPUT``, ``$GITHUB_PATH`` and
``$GITHUB_ACTION_PATH`` as the runner provides them, a failed step skipping
the rest but those whose ``if`` says ``always()``. The ``uses:`` step
(``github/codeql-action/upload-sarif``) is not run: what it would be handed
is checked. The install step runs with a stub ``python3`` that records the
pip install and puts a ``gdn-backport`` that runs this checkout's on the
venv's path; every other step runs the real tool.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gdn_backport import registry
from tests.conftest import run

REPO = Path(__file__).resolve().parents[1]
ACTION = yaml.safe_load((REPO / "action.yml").read_text())
SITE = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"


@dataclass
class Run:
    inputs: dict[str, str]
    steps: dict[str, dict[str, str]] = field(default_factory=dict)
    failed: bool = False
    log: list[tuple[str, str]] = field(default_factory=list)  # (step name, what happened)
    output: dict[str, str] = field(default_factory=dict)  # step name -> its stdout
    uses: list[dict[str, Any]] = field(default_factory=list)


def _value(ref: str, r: Run) -> str:
    parts = ref.split(".")
    if parts[0] == "inputs":
        return r.inputs[parts[1]]
    if parts[0] == "steps" and parts[2] == "outputs":
        return r.steps.get(parts[1], {}).get(parts[3], "")
    raise AssertionError(f"an expression this test does not know: {ref}")


def evaluate(expr: str, r: Run) -> bool | str:
    """The expressions action.yml uses: ``always()``, ``x == 'lit'``,
    ``x != ''``, joined by ``&&``."""
    terms = [t.strip() for t in expr.split("&&")]
    results: list[bool | str] = []
    for term in terms:
        if term == "always()":
            results.append(True)
            continue
        m = re.fullmatch(r"([\w.-]+)\s*(==|!=)\s*'([^']*)'", term)
        if m:
            left = _value(m[1], r)
            results.append((left == m[3]) == (m[2] == "=="))
            continue
        assert re.fullmatch(r"[\w.-]+", term), term
        results.append(_value(term, r))
    return results[0] if len(results) == 1 else all(bool(x) for x in results)


def substitute(text: str, r: Run) -> str:
    return re.sub(r"\$\{\{\s*(.*?)\s*\}\}", lambda m: str(evaluate(m[1], r)), text)


def _outputs(file: Path) -> dict[str, str]:
    out = {}
    for line in file.read_text().splitlines():
        key, sep, value = line.partition("=")
        assert sep, f"not name=value: {line!r}"
        out[key] = value
    return out


def _stubs(tmp: Path) -> Path:
    """A ``python3`` that makes a fake venv: its ``python -m pip`` records
    what it installs, its ``gdn-backport`` is this checkout's."""
    bin_ = tmp / "stub-bin"
    bin_.mkdir()
    python3 = bin_ / "python3"
    python3.write_text(f"""#!/bin/sh
# python3 -m venv DIR
[ "$1 $2" = "-m venv" ] || exit 97
mkdir -p "$3/bin"
cat > "$3/bin/python" <<'EOF'
#!/bin/sh
echo "$@" >> "{tmp}/pip.log"
EOF
cat > "$3/bin/gdn-backport" <<'EOF'
#!/bin/sh
exec "{sys.executable}" -m gdn_backport "$@"
EOF
chmod +x "$3/bin/python" "$3/bin/gdn-backport"
""")
    python3.chmod(0o755)
    return bin_


def run_action(inputs: dict[str, str], tmp: Path, cwd: Path) -> Run:
    """Every step of action.yml, as the runner would, with these inputs."""
    given = {name: spec.get("default", "") for name, spec in ACTION["inputs"].items()}
    assert set(inputs) <= set(given), set(inputs) - set(given)
    r = Run({**given, **inputs})
    stub = _stubs(tmp)
    path = [str(stub), *os.environ["PATH"].split(os.pathsep)]
    for i, step in enumerate(ACTION["runs"]["steps"]):
        name = step["name"]
        cond = step.get("if", "success()")
        if cond == "success()":
            wanted = not r.failed
        else:
            wanted = bool(evaluate(cond, r)) and (not r.failed or "always()" in cond)
        if not wanted:
            r.log.append((name, "skipped"))
            continue
        if "uses" in step:
            r.uses.append({"uses": step["uses"], **{k: substitute(str(v), r)
                                                   for k, v in step["with"].items()}})  # fmt: skip
            r.log.append((name, "uses"))
            continue
        assert step["shell"] == "bash"
        assert "${{" not in step["run"], f"{name}: an expression inside run: is shell code"
        output, gpath = tmp / f"output-{i}", tmp / f"path-{i}"
        output.write_text("")
        gpath.write_text("")
        env = {
            **os.environ,
            **{k: substitute(str(v), r) for k, v in step.get("env", {}).items()},
            "PATH": os.pathsep.join(path),
            "GITHUB_OUTPUT": str(output),
            "GITHUB_PATH": str(gpath),
            "GITHUB_ACTION_PATH": str(REPO),
            "RUNNER_TEMP": str(tmp),
        }
        done = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        r.output[name] = done.stdout
        r.log.append((name, f"exit {done.returncode}"))
        if "id" in step:
            r.steps[step["id"]] = _outputs(output)
        path = [*gpath.read_text().split(), *path]
        if done.returncode:
            r.failed = True
    return r


def outputs(r: Run) -> dict[str, str]:
    return {k: substitute(v["value"], r) for k, v in ACTION["outputs"].items()}


# -- the file itself ------------------------------------------------------------------


def test_the_action_declares_what_it_takes_and_gives() -> None:
    assert {"name", "description", "inputs", "outputs", "runs"} <= set(ACTION)
    assert ACTION["runs"]["using"] == "composite"
    assert set(ACTION["inputs"]) == {"path", "patchsets", "strategy", "sarif", "matrix"}
    for spec in ACTION["inputs"].values():
        assert spec["description"] and isinstance(spec.get("default"), str)
    assert set(ACTION["outputs"]) == {"sarif", "matrix", "exit-code"}
    for step in ACTION["runs"]["steps"]:
        # Composite steps: `run` needs its shell; `uses` names a version.
        assert ("run" in step) != ("uses" in step), step["name"]
        assert "shell" in step if "run" in step else "@" in step["uses"]
    [upload] = [s for s in ACTION["runs"]["steps"] if "uses" in s]
    assert upload["uses"].startswith("github/codeql-action/upload-sarif@")


# -- the input check -------------------------------------------------------------------


def test_every_bad_input_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-folder").mkdir()
    r = run_action(
        {"path": "no/such", "patchsets": "pr51812, nope,pr51565", "strategy": "fast",
         "sarif": "a-folder", "matrix": "yes"},
        tmp_path, tmp_path,
    )  # fmt: skip
    first = ACTION["runs"]["steps"][0]["name"]
    assert r.log[0] == (first, "exit 1") and all(what == "skipped" for _, what in r.log[1:])
    lines = r.output[first].splitlines()
    # In the order of the folders of patchsets/ (the shell's glob).
    folders = sorted(registry.discover(), key=lambda p: p.info.id)
    known = " ".join(p.info.id for p in folders)
    assert lines == [
        "::error title=gdn-backport action::input path: 'no/such' does not exist "
        "(the folder that holds vllm/)",
        f"::error title=gdn-backport action::input patchsets: 'nope' is not a patchset "
        f"(choose from {known})",
        "::error title=gdn-backport action::input strategy: 'fast' is not a strategy "
        "(choose from " + " ".join(s for p in folders for s in p.info.strategies) + ")",
        "::error title=gdn-backport action::input sarif: 'a-folder' is a folder (name the file "
        "to write)",
        "::error title=gdn-backport action::input matrix: 'yes' is not true or false",
    ]
    (tmp_path / "again").mkdir()
    r = run_action({"path": str(tmp_path), "sarif": "missing/x.sarif", "matrix": "50%\nno"},
                   tmp_path / "again", tmp_path)  # fmt: skip
    assert r.output[first].splitlines() == [
        "::error title=gdn-backport action::input sarif: the folder of 'missing/x.sarif' "
        "does not exist",
        "::error title=gdn-backport action::input matrix: '50%25%0Ano' is not true or false",
    ]


# -- whole runs --------------------------------------------------------------------------


def test_sarif_and_matrix_on_an_affected_tree(affected_tree: Path, tmp_path: Path) -> None:
    checkout = affected_tree.parent  # the job's workspace
    r = run_action(
        {"path": "tree", "sarif": "gdn.sarif", "matrix": "true", "patchsets": "pr51812"},
        tmp_path,
        checkout,
    )
    names = [name for name, _ in r.log]
    assert [what for _, what in r.log] == ["exit 0"] * 3 + ["uses", "exit 0", "exit 1"], r.log
    assert (tmp_path / "pip.log").read_text().split() == ["-m", "pip", "install", "--quiet",
                                                          str(REPO)]  # fmt: skip
    got = outputs(r)
    assert got["exit-code"] == "1" and got["sarif"] == "gdn.sarif"
    doc = json.loads((checkout / "gdn.sarif").read_text())
    [res] = doc["runs"][0]["results"]
    assert res["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == f"tree/{SITE}"
    assert res["fixes"]
    assert r.uses == [{"uses": ACTION["runs"]["steps"][3]["uses"], "sarif_file": "gdn.sarif",
                       "category": "gdn-backport"}]  # fmt: skip
    # The gate printed no annotations: code scanning shows the SARIF's.
    assert r.output[names[2]] == ""
    matrix = json.loads(got["matrix"])
    assert matrix == {"include": [{"id": "tree-gather", "strategy": "gather", "tree": "tree"},
                                  {"id": "tree-reclassify", "strategy": "reclassify",
                                   "tree": "tree"}]}  # fmt: skip


def test_annotations_without_sarif_and_a_fixed_tree_passes(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, tmp_path: Path
) -> None:
    checkout = affected_tree.parent
    (tmp_path / "one").mkdir()
    r = run_action({"path": "tree"}, tmp_path / "one", checkout)
    skipped = {name for name, what in r.log if what == "skipped"}
    upload, matrix_step = ACTION["runs"]["steps"][3]["name"], ACTION["runs"]["steps"][4]["name"]
    assert skipped == {upload, matrix_step}
    gate = ACTION["runs"]["steps"][2]["name"]
    [line] = r.output[gate].splitlines()
    assert line.startswith(f"::error file=tree/{SITE},line=")
    assert outputs(r) == {"sarif": "", "matrix": "", "exit-code": "1"}
    assert r.log[-1][1] == "exit 1" and r.failed

    assert run(capsys, "apply", str(affected_tree))[0] == 0
    (tmp_path / "two").mkdir()
    r = run_action({"path": "tree", "sarif": "out.sarif"}, tmp_path / "two", checkout)
    assert not r.failed and outputs(r)["exit-code"] == "0"
    assert json.loads((checkout / "out.sarif").read_text())["runs"][0]["results"] == []


def test_a_tree_without_vllm_uploads_nothing_and_fails(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = run_action({"path": "empty", "sarif": "x.sarif"}, tmp_path, tmp_path)
    assert outputs(r)["exit-code"] == "2" and outputs(r)["sarif"] == ""
    assert r.uses == [] and r.failed
