"""CI exports: GitHub Actions strategy.matrix (JSON), Buildkite pipeline (YAML), docs/ examples.

The structure checks always run (ours, against what those systems require);
the YAML additionally round-trips through PyYAML where it is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from gdn_backport import matrix
from gdn_backport.cli import build_parser, main
from gdn_backport.errors import UsageError
from gdn_backport.matrix import export

DOCS = Path(__file__).resolve().parent.parent / "docs"

try:
    import yaml
except ImportError:  # pragma: no cover - PyYAML is optional
    yaml = None

needs_yaml = pytest.mark.skipif(yaml is None, reason="PyYAML is not installed")


def _cells() -> list[matrix.Cell]:
    return matrix.cells(matrix.load())


def _run_args(command: str) -> list[str]:
    """The arguments a cell's command gives ``gdn-backport``; asserts the program."""
    argv = shlex.split(command)
    assert argv[:3] == ["gdn-backport", "matrix", "run"], command
    return argv[1:]


def _commands(text: str) -> list[list[str]]:
    """The gdn-backport command lines of a doc (code, not prose or comments)."""
    found = []
    for line in text.splitlines():
        code = line.strip()
        at = code.find("gdn-backport ")
        prefix = code[:at]
        if at < 0 or not code[at:].startswith(("gdn-backport matrix", "gdn-backport fetch")):
            continue
        if not (prefix in ("", "run: ", "- run: ") or prefix.endswith(("$(", "cache "))):
            continue
        cmd = re.split(r" \| | >> |\)|  #", code[at:])[0]
        # Shell-built arguments ("$@", ${TREE:+--tree "$TREE"}) are checked by
        # running the step (test_docs_github_cell_step_runs_what_the_plan_emits).
        cmd = re.sub(r"\$\{\w+:\+[^}]*\}", "", cmd).replace('"$@"', "")
        cmd = re.sub(r"\$\{?\w+\}?", "x", cmd.replace('"$CELL"', "0.25.1-gather"))
        found.append(shlex.split(cmd)[1:])
    assert found
    return found


# -- GitHub Actions --------------------------------------------------------------


def test_github_matrix_is_one_line_of_include_entries(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", "export", "github"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n") == 1  # one line for $GITHUB_OUTPUT
    doc = json.loads(text)
    assert export.check_github(doc) == []
    include = doc["include"]
    assert [e["id"] for e in include] == [c.id for c in _cells()]
    assert include[0] == {"id": "0.10.2-none", "strategy": "none", "release": "0.10.2"}
    assert {"id": "0.25.1-kernel", "strategy": "kernel", "release": "0.25.1"} in include
    for e in include:
        assert e["id"] == f"{e['release']}-{e['strategy']}"
        # What the example workflow runs for each entry selects exactly that cell.
        args = build_parser().parse_args(["matrix", "run", "--cell", e["id"]])
        (cell,) = matrix.cells(matrix.load(), ids=args.cell)
        assert cell.id == e["id"]


def test_github_matrix_selection_and_trees(tmp_path: Path) -> None:
    m = matrix.load()
    doc = export.github_matrix(matrix.cells(m, releases=["0.28.0"]))
    assert doc == {
        "include": [
            {"id": "0.28.0-none", "strategy": "none", "release": "0.28.0"},
            {"id": "0.28.0-reclassify", "strategy": "reclassify", "release": "0.28.0"},
        ]
    }
    fork = matrix.adhoc_tree(tmp_path, ref="main")
    gather, reclassify = export.github_matrix(matrix.cells(m, trees=[fork]))["include"]
    assert gather == {"id": f"{fork.name}-gather", "strategy": "gather", "tree": str(tmp_path),
                      "ref": "main"}  # fmt: skip
    # Every patchset's default strategy: a fork's CI gets pr51565 too (D4).
    assert reclassify["strategy"] == "reclassify" and reclassify["tree"] == str(tmp_path)
    # A tree that is not there is a usage error, not an empty document.
    with pytest.raises(UsageError, match="no such directory"):
        matrix.adhoc_tree(tmp_path / "missing", ref="main")
    with pytest.raises(UsageError, match="no such file or directory"):
        matrix.adhoc_tree(tmp_path / "missing")


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ([], "exactly the key 'include'"),
        ({"include": []}, "non-empty list"),
        ({"include": [{"id": "a", "strategy": "none"}]}, "exactly one of 'release' and 'tree'"),
        ({"include": [{"id": "", "strategy": "none", "release": "1"}]}, "'id' must be"),
        ({"include": [{"id": "a", "strategy": "none", "release": 1}]}, "values must be strings"),
        ({"include": [{"id": "a", "strategy": "s", "release": "1"}] * 2}, "ids not unique: a"),
        (
            {"include": [{"id": str(i), "strategy": "s", "release": "1"} for i in range(257)]},
            "at most 256",
        ),
    ],
)
def test_github_checks(doc: object, problem: str) -> None:
    assert any(problem in p for p in export.check_github(doc)), export.check_github(doc)


# -- Buildkite ---------------------------------------------------------------------


def test_buildkite_pipeline_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", "export", "buildkite", "--queue", "h200-gpu"]) == 0
    text = capsys.readouterr().out
    doc = export.buildkite_pipeline(_cells(), queue="h200-gpu")
    assert text == export.buildkite_yaml(_cells(), queue="h200-gpu")
    assert export.check_buildkite(doc) == []
    steps = doc["steps"]
    assert isinstance(steps, list) and len(steps) == 85
    keys = [s["key"] for s in steps]
    assert len(set(keys)) == len(keys) and keys[0] == "cell-0_10_2-none"
    for step, cell in zip(steps, _cells(), strict=True):
        assert step["agents"] == {"queue": "h200-gpu"}
        assert cell.target in step["label"] and cell.strategy in step["label"]
        args = build_parser().parse_args(_run_args(step["command"]))
        (again,) = matrix.cells(matrix.load(), ids=args.cell)
        assert again.id == cell.id
    # The text is that document: every step's fields appear as written.
    assert text.count("\n  - label: ") == 85
    assert '    key: "cell-0_25_1-gather"\n' in text
    assert '    command: "gdn-backport matrix run --cell 0.25.1-gather"\n' in text
    assert '    agents:\n      queue: "h200-gpu"\n' in text


@needs_yaml
def test_buildkite_yaml_round_trips_through_pyyaml() -> None:
    cells = _cells()
    assert yaml.safe_load(export.buildkite_yaml(cells, "gpu")) == (
        export.buildkite_pipeline(cells, "gpu")
    )


def test_buildkite_queue_must_not_be_empty() -> None:
    with pytest.raises(Exception, match="--queue"):
        export.buildkite_pipeline(_cells(), queue=" ")


@pytest.mark.parametrize(
    ("step", "problem"),
    [
        ({"command": "x", "key": "k"}, "'label' must be"),
        ({"label": "l", "key": "k"}, "'command' must be"),
        ({"label": "l", "command": "x", "key": "0.25.1"}, "key '0.25.1'"),
        (
            {"label": "l", "command": "x", "key": "123e4567-e89b-12d3-a456-426614174000"},
            "not a UUID",
        ),
        ({"label": "l", "command": "x", "key": "k", "queue": "gpu"}, "does not know: queue"),
        ({"label": "l", "command": "x", "key": "k", "agents": {"queue": 1}}, "'agents'"),
        ({"label": "l", "command": "x", "key": "k", "timeout_in_minutes": 0}, "timeout"),
    ],
)
def test_buildkite_checks(step: dict[str, object], problem: str) -> None:
    problems = export.check_buildkite({"steps": [step]})
    assert any(problem in p for p in problems), problems


def test_buildkite_keys_must_be_unique() -> None:
    step = {"label": "l", "command": "x", "key": "k"}
    assert "step keys not unique: k" in export.check_buildkite({"steps": [step, step]})
    assert export.check_buildkite({"step": []}) == ["must be a mapping with 'steps'"]


# -- the YAML writer ---------------------------------------------------------------

SAMPLE = {
    "steps": [
        {"label": 'quote " colon: hash # and \\ back', "n": 3, "ok": True, "empty": []},
        {"label": "naïve\nsecond line", "agents": {"queue": "gpu", "weird key": "v"}, "d": {}},
    ],
    "true": "a key YAML would read as a boolean",
}
SAMPLE_YAML = """\
steps:
  - label: "quote \\" colon: hash # and \\\\ back"
    n: 3
    ok: true
    empty: []
  - label: "na\\u00efve\\nsecond line"
    agents:
      queue: "gpu"
      "weird key": "v"
    d: {}
"true": "a key YAML would read as a boolean"
"""


def test_yaml_writer_text() -> None:
    assert export.to_yaml(SAMPLE) == SAMPLE_YAML
    with pytest.raises(TypeError):
        export.to_yaml({"x": 1.5})


@needs_yaml
def test_yaml_writer_round_trips_through_pyyaml() -> None:
    assert yaml.safe_load(export.to_yaml(SAMPLE)) == SAMPLE


# -- the examples in docs/ -----------------------------------------------------------


def test_docs_examples_use_what_the_tool_emits() -> None:
    workflow = (DOCS / "github-actions.yml").read_text()
    pipeline = (DOCS / "buildkite.yml").read_text()
    guide = (DOCS / "ci.md").read_text()
    assert "gdn-backport matrix export github" in workflow
    assert "fromJSON(needs.plan.outputs.matrix)" in workflow
    assert "gdn-backport matrix run --cell" in workflow
    assert "gdn-backport matrix export buildkite" in pipeline
    assert "buildkite-agent pipeline upload" in pipeline
    for text in (guide, workflow, pipeline):
        # Every gdn-backport command in the docs parses with today's CLI.
        for argv in _commands(text):
            build_parser().parse_args(argv)
    assert 'nox -s "cell(0.25.1-gather)"' in guide and "GDN_BACKPORT_OFFLINE=1" in guide
    assert "--no-venv" in guide and "fetch --matrix" in guide


@needs_yaml
def test_docs_github_workflow_structure() -> None:
    doc = yaml.safe_load((DOCS / "github-actions.yml").read_text())
    jobs = doc["jobs"]
    plan, cell = jobs["plan"], jobs["cell"]
    assert plan["outputs"]["matrix"] == "${{ steps.cells.outputs.matrix }}"
    (emit,) = [s for s in plan["steps"] if s.get("id") == "cells"]
    assert "gdn-backport matrix export github" in emit["run"]
    assert '>> "$GITHUB_OUTPUT"' in emit["run"]
    assert cell["needs"] == "plan"
    assert cell["strategy"]["fail-fast"] is False
    assert cell["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    # The fields the job reads are those every emitted entry has.
    assert cell["env"]["CELL"] == "${{ matrix.id }}"
    emitted = json.loads(export.github_json(_cells()))["include"][0]
    assert {"id", "release", "strategy"} <= set(emitted)
    runs = " ".join(s.get("run", "") for s in cell["steps"])
    assert 'set -- --cell "$CELL"' in runs and 'gdn-backport matrix run "$@"' in runs
    (upload,) = [s for s in cell["steps"] if "upload-artifact" in s.get("uses", "")]
    assert upload["with"]["path"] == ".nox-results/"


@needs_yaml
@pytest.mark.parametrize("kind", ["release", "tree", "tree-at-ref"])
def test_docs_github_cell_step_runs_what_the_plan_emits(tmp_path: Path, kind: str) -> None:
    """Issue 13: a cell of `matrix export github --tree DIR` carries a tree
    the workflow never passed. The cell job's step, run by bash with the
    matrix entry the tool emits, must call `matrix run` with arguments
    that select exactly that cell."""
    if kind == "release":
        trees: list[matrix.Tree] = []
        cells = matrix.cells(matrix.load(), ["0.25.1"], ["gather"], None, trees)
    else:
        fork = tmp_path / "my-fork"
        (fork / "vllm").mkdir(parents=True)
        (fork / "vllm" / "__init__.py").write_text("")
        trees = [matrix.adhoc_tree(fork, "release/2.3" if kind == "tree-at-ref" else "")]
        cells = matrix.cells(matrix.load(), None, ["gather"], None, trees)
    [entry] = export.github_matrix(cells)["include"]
    doc = yaml.safe_load((DOCS / "github-actions.yml").read_text())
    job = doc["jobs"]["cell"]
    [step] = [s for s in job["steps"] if "gdn-backport matrix run" in s.get("run", "")]
    env = {
        name: re.sub(r"\$\{\{ matrix\.(\w+) \}\}", lambda m: entry.get(m[1], ""), value)
        for name, value in job["env"].items()
    }
    stub = tmp_path / "bin" / "gdn-backport"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\n\' "$a"; done > "$ARGS_OUT"\n')
    stub.chmod(0o755)
    out = tmp_path / "args"
    path = f"{stub.parent}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        env={**os.environ, **env, "PATH": path, "ARGS_OUT": str(out)},
        check=True,
    )
    argv = out.read_text().splitlines()
    args = build_parser().parse_args(argv)
    assert args.command == "matrix" and args.matrix_command == "run"
    chosen = [matrix.adhoc_tree(t, args.ref) for t in args.tree or ()]
    assert chosen == trees
    assert matrix.cells(matrix.load(), args.release, args.strategy, args.cell, chosen) == cells


def test_buildkite_dollars_reach_the_shell_as_written() -> None:
    """Buildkite interpolates $VAR at upload; the pipeline writes $$ so the
    step's shell gets --setup's text as given."""
    setup = 'pip install -q "$WHEEL" && echo ${HOME} $$ \\$PATH'
    steps = export.buildkite_pipeline(_cells()[:1], "gpu", setup)["steps"]
    assert isinstance(steps, list)
    command = steps[0]["command"]
    assert "$$WHEEL" in command and "$${HOME}" in command
    # What Buildkite's upload makes of it: $$ -> $.
    assert command.replace("$$", "$").startswith(setup + " && gdn-backport matrix run")
    assert re.search(r"(?<!\$)\$(?!\$)", command.replace("$$", "")) is None


@needs_yaml
def test_docs_buildkite_pipeline_structure() -> None:
    doc = yaml.safe_load((DOCS / "buildkite.yml").read_text())
    assert export.check_buildkite(doc) == []
    (plan,) = doc["steps"]
    assert "gdn-backport matrix export buildkite" in plan["command"]
    assert plan["command"].rstrip().endswith("| buildkite-agent pipeline upload")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["matrix"], ["matrix", "check"]),
        (["matrix", "--release", "0.25.1"], ["matrix", "check", "--release", "0.25.1"]),
        (["matrix", "--format", "json"], ["matrix", "check", "--json"]),
        (["matrix", "--run", "--cell", "0.25.1-g"], ["matrix", "run", "--cell", "0.25.1-g"]),
        (["matrix", "--run", "--format=json"], ["matrix", "run", "--json"]),
        (["matrix", "--format", "buildkite", "--queue", "q"],
         ["matrix", "export", "buildkite", "--queue", "q"]),
    ],
)  # fmt: skip
def test_matrix_flags_of_before_its_subcommands_still_work(
    old: list[str], new: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # CI files exported by earlier versions call `matrix --run --cell ...`.
    from gdn_backport.cli import _legacy_matrix

    assert _legacy_matrix(old) == new
    err = capsys.readouterr().err
    assert ("is now `matrix" in err) == ("--run" in old or "--format" in " ".join(old)), err
    build_parser().parse_args(new)
