"""Results instead of exceptions: a codemod or a plan that crashes is that
plan's refusal (one line naming the file, exit 2, nothing written, the
traceback kept for ``--json`` and ``GDN_BACKPORT_TRACEBACK=1``), the same for
every patchset; a refusal is a refusal, an unforeseen error an internal one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from libcst.codemod import CodemodContext, SkipFile, transform_module

from gdn_backport import registry, result
from gdn_backport.cli import main
from gdn_backport.errors import Refusal, UsageError
from gdn_backport.patchsets.pr51565.codemods import examples as ex51565
from gdn_backport.patchsets.pr51565.codemods.builder_rule import BuilderRuleCodemod
from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod

BOOM = "boom: the codemod hit a bug"


def _raise(*_: Any, **__: Any) -> Any:
    raise RuntimeError(BOOM)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"vllm/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# (patchset, the files of a tree it patches, the file whose codemod crashes,
#  what to make raise)
CASES: dict[str, tuple[dict[str, str], str, Callable[[pytest.MonkeyPatch], None]]] = {
    "pr51812": (
        {"vllm/model_executor/layers/mamba/gdn_linear_attn.py": GatherGatesCodemod.REWRITES[0][0]},
        "vllm/model_executor/layers/mamba/gdn_linear_attn.py",
        lambda mp: mp.setattr(GatherGatesCodemod, "plan_call", _raise),
    ),
    "pr51565": (
        {
            "vllm/v1/attention/backends/gdn_attn.py": ex51565.BUILDER,
            "vllm/v1/worker/gpu_model_runner.py": ex51565.V1_RUNNER,
        },
        "vllm/v1/attention/backends/gdn_attn.py",
        lambda mp: mp.setattr(BuilderRuleCodemod, "leave_IndentedBlock", _raise),
    ),
}


@pytest.mark.parametrize("patchset", sorted(CASES))
def test_a_crashing_codemod_is_a_refusal_of_its_file(
    patchset: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files, crashing, make_it_raise = CASES[patchset]
    root = _tree(tmp_path / "tree", files)
    before = _snapshot(root)
    # The tree is patched as it stands: the crash below is the codemod's.
    code, out, err = _cli(capsys, "apply", "--dry-run", "--patchset", patchset, str(root))
    assert code == 0 and "+++ b/" + crashing in out, err
    make_it_raise(monkeypatch)
    monkeypatch.delenv(result.TRACEBACK_ENV, raising=False)
    code, out, err = _cli(capsys, "apply", "--patchset", patchset, str(root))
    lines = err.strip().splitlines()
    assert code == 2, out + err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gdn-backport: {root / crashing}: internal error in ")
    assert BOOM in lines[0] and "Traceback" not in err
    assert _snapshot(root) == before
    # --json carries the traceback; the line on stderr stays one line.
    code, out, err = _cli(capsys, "apply", "--json", "--patchset", patchset, str(root))
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2 and len(err.strip().splitlines()) == 1
    (refused,) = doc["refused"]
    assert refused["path"] == crashing and "internal error" in refused["reason"]
    assert "Traceback (most recent call last)" in refused["traceback"]
    assert f"RuntimeError: {BOOM}" in refused["traceback"]
    # GDN_BACKPORT_TRACEBACK=1: the traceback on stderr after the line.
    monkeypatch.setenv(result.TRACEBACK_ENV, "1")
    code, _, err = _cli(capsys, "apply", "--patchset", patchset, str(root))
    assert code == 2 and err.startswith(lines[0] + "\n")
    assert "Traceback (most recent call last)" in err and f"RuntimeError: {BOOM}" in err
    assert _snapshot(root) == before


@pytest.mark.parametrize("patchset", sorted(CASES))
def test_a_crashing_plan_is_a_refusal_of_that_plan(
    patchset: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files, _, _ = CASES[patchset]
    root = _tree(tmp_path / "tree", files)
    before = _snapshot(root)
    monkeypatch.setattr(registry.get(patchset), "plan", _raise)
    # Every patchset: the other one plans, and nothing is written for it either.
    code, out, err = _cli(capsys, "apply", "--json", str(root))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"internal error in the plan of patchset {patchset}" in lines[0]
    assert lines[0].startswith(f"gdn-backport: {root}: ")
    doc = json.loads(out)
    assert doc["written"] == [] and f"RuntimeError: {BOOM}" in doc["refused"][0]["traceback"]
    assert _snapshot(root) == before


def test_bad_input_inside_a_plan_is_still_bad_input() -> None:
    """A UsageError is no internal error: it keeps its own line (the CLI's)."""

    def bad() -> None:
        raise UsageError("x.py: changed on disk while gdn-backport ran")

    with pytest.raises(UsageError, match="changed on disk"):
        result.attempt(bad, "the plan")


def test_attempt_and_transform_results() -> None:
    assert result.attempt(lambda: 3, "x") == result.Success(3)

    def skip() -> None:
        raise SkipFile("nothing here")

    def refuse() -> None:
        raise Refusal("not a shape this knows")

    assert result.attempt(skip, "x") == result.Skip("nothing here")
    assert result.attempt(refuse, "x") == result.Failure("not a shape this knows")
    crash = result.attempt(lambda: {}["k"], "the step")
    assert isinstance(crash, result.Failure) and crash.internal
    assert crash.reason.startswith("internal error in the step: KeyError: 'k'")
    assert crash.traceback is not None and "KeyError" in crash.traceback
    # libcst's runner, read the same way: skip, refusal, success.
    codemod = BuilderRuleCodemod(CodemodContext())
    run = result.of_transform(transform_module(codemod, "x = 1\n"), "b")
    assert isinstance(run, result.Skip)
    refused = result.of_transform(transform_module(codemod, ex51565.BUILDER_AS_SHIPPED), "b")
    assert isinstance(refused, result.Failure) and not refused.internal
    assert "no definition of CommonAttentionMetadata" in refused.reason
    done = result.of_transform(transform_module(codemod, ex51565.BUILDER), "b")
    assert done == result.Success(ex51565.BUILDER_FIXED)
