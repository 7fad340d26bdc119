"""The command line: exit codes, one-line errors, the --json contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gdn_backport.cli import main
from tests.conftest import AFFECTED, FIXED, run
from tests.test_engine import SITE, snapshot


def test_scan_json_contract(capsys: pytest.CaptureFixture[str], affected_tree: Path) -> None:
    code, out, _ = run(capsys, "scan", str(affected_tree), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["tree"] == str(affected_tree)
    [site] = doc["sites"]
    assert site == {
        "path": SITE.as_posix(),
        "line": 2,
        "function": "Layer._forward_core",
        "status": "affected",
        "reason": site["reason"],
        "patchset": "pr51812",
    }
    assert "gate a=a" in site["reason"]
    assert doc["patchsets"] == ["pr51812", "pr51565"]


def test_apply_json_has_changed(capsys: pytest.CaptureFixture[str], affected_tree: Path) -> None:
    code, out, _ = run(capsys, "apply", str(affected_tree), "--json")
    assert code == 0
    [site] = json.loads(out)["sites"]
    assert (site["status"], site["changed"]) == ("fixed", True)
    code, out, _ = run(capsys, "apply", "--check", str(affected_tree))
    assert code == 0
    code, out, _ = run(capsys, "revert", str(affected_tree), "--json")
    assert code == 0
    [site] = json.loads(out)["sites"]
    assert (site["status"], site["changed"]) == ("affected", True)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"def f(:\n    spec_token_indx, spec_state_indices_tensor\n", "syntax error"),
        (b"def f(md):\n    return md.spec_token_indx\n\xff\xfe\n", "not valid UTF-8"),
        (b"\x00\x01def spec_token_indx\x00", "binary data"),
    ],
    ids=["syntax-error", "non-utf8", "binary"],
)
@pytest.mark.parametrize("command", ["scan", "apply"])
def test_bad_file_one_line_exit_2_nothing_changed(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    command: str,
    content: bytes,
    reason: str,
) -> None:
    bad = affected_tree / "vllm" / "bad.py"
    bad.write_bytes(content)
    before = snapshot(affected_tree)
    code, _, err = run(capsys, command, str(affected_tree))
    assert code == 2
    assert err.count("\n") == 1 and str(bad) in err and reason in err
    assert snapshot(affected_tree) == before


def test_missing_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "scan", str(tmp_path / "nope"))
    assert code == 2 and "no such file" in err and err.count("\n") == 1


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], affected_tree: Path) -> None:
    assert run(capsys, "apply", "--strategy", "magic", str(affected_tree))[0] == 2
    assert run(capsys, "scan")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2


def test_tree_without_sites(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    code, out, _ = run(capsys, "scan", str(tmp_path), "--json")
    assert code == 0 and json.loads(out)["sites"] == []


def test_check_on_an_affected_tree_says_what_is_affected(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    """Issue 13: it said "nothing to do: no affected site" while exiting 1."""
    expected = f"check failed: 1 affected site(s): {SITE.as_posix()}:2 Layer._forward_core"
    code, out, _ = run(capsys, "apply", "--check", str(affected_tree))
    assert code == 1 and out.rstrip("\n").splitlines()[-1] == expected
    assert "nothing to do" not in out
    code, out, _ = run(capsys, "apply", "--check", str(affected_tree), "--json")
    assert code == 1 and json.loads(out)["message"] == expected


def test_help_is_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    # main(argv) -> int, testable as a function: --help returns its code.
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "main(argv)" not in out and "library API" not in out
    for part in ("PR #51812", "apply --check PATH", "exit codes:", "2  bad usage or a refusal"):
        assert part in out, part


def test_a_usage_error_names_the_program_once(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "revert")
    assert code == 2
    assert err == (
        "gdn-backport: revert: one of the arguments path --release --installed is required\n"
    )


def test_the_undo_hint_names_the_tree(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, affected_tree: Path
) -> None:
    spaced = tmp_path / "my fork"
    affected_tree.rename(spaced)
    code, out, _ = run(capsys, "apply", str(spaced))
    assert code == 0
    assert f"undo with `gdn-backport revert '{spaced}'`" in out
    code, out, _ = run(capsys, "revert", str(spaced))
    assert code == 0 and "restored 1 file(s)" in out


PROCESS_GC = """\
import gc, sys
from gdn_backport.cli import main
sys.argv = ["gdn-backport", *sys.argv[1:]]
code = main()
print(code, gc.isenabled(), len(gc.get_objects()), gc.get_freeze_count())
"""


@pytest.mark.parametrize(
    ("command", "verdict", "collector"),
    [("scan", "1", "False"), ("apply", "0", "False"), ("doctor", "2", "True")],
)
def test_the_command_leaves_nothing_for_the_exit_collection(
    affected_tree: Path, command: str, verdict: str, collector: str
) -> None:
    """The process's own command ends with what it made frozen: the
    collection the interpreter runs at exit traverses nothing (it cost a
    cold scan of vLLM 0.33.0 a third of its time); a command that reads a
    tree and ends runs without the collector."""
    import os
    import subprocess
    import sys

    args = {"scan": [str(affected_tree)], "apply": ["--dry-run", str(affected_tree)]}
    argv = [sys.executable, "-c", PROCESS_GC, command, *args.get(command, [])]
    env = {**os.environ, "GDN_BACKPORT_NO_CACHE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    code, enabled, young, frozen = done.stdout.split()[-4:]
    assert (code, enabled) == (verdict, collector)
    assert int(young) < 5_000 < int(frozen)


def test_a_caller_of_main_keeps_its_collector(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    import gc

    before = (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count())
    assert run(capsys, "scan", str(affected_tree))[0] == 1
    assert (gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()) == before


def test_a_scan_of_a_path_imports_no_release_or_codemod_machinery(affected_tree: Path) -> None:
    """``scan PATH`` pays for neither the release machinery (http, tarfile,
    packaging: ``sources``) nor libcst's codemods (0.4 s)."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys\nfrom gdn_backport.cli import main\n"
        "code = main(['scan', sys.argv[1]])\n"
        "print(code, *sorted(m for m in ('gdn_backport.sources', 'libcst.codemod') "
        "if m in sys.modules))\n"
    )
    env = {**os.environ, "GDN_BACKPORT_NO_CACHE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe, str(affected_tree)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert done.stdout.splitlines()[-1].split() == ["1"]


def test_an_apply_with_nothing_to_rewrite_imports_no_codemod_machinery(tmp_path: Path) -> None:
    """``apply`` on a tree whose sites are all fixed rewrites nothing: it
    pays for the analysis, not libcst's codemod framework (0.2-0.3 s of a
    cold run); a tree with a rewrite does import it (the probe sees it)."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys\nfrom gdn_backport.cli import main\n"
        "code = main(['apply', '--dry-run', '--patchset', 'pr51812', sys.argv[1]])\n"
        "print(code, 'libcst.codemod' in sys.modules)\n"
    )
    env = {**os.environ, "GDN_BACKPORT_NO_CACHE": "1"}
    seen = {}
    for name, text in (("fixed", FIXED), ("affected", AFFECTED)):
        gdn = tmp_path / name / "vllm" / "model_executor" / "layers" / "mamba"
        gdn.mkdir(parents=True)
        (gdn / "gdn_linear_attn.py").write_text(text)
        (tmp_path / name / "vllm" / "__init__.py").write_text("# a fork's tree\n")
        done = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / name)],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        seen[name] = done.stdout.splitlines()[-1]
    assert seen == {"fixed": "0 False", "affected": "0 True"}


# -- D7: a module the walk cannot take is bad input, for every command and patchset


RUNNER = Path("vllm/v1/worker/gpu_model_runner.py")


@pytest.mark.parametrize("jobs", ["1", "2"])  # "2": the later patchset's scan in a forked child
@pytest.mark.parametrize("patchset", [[], ["--patchset", "pr51812"], ["--patchset", "pr51565"]])
@pytest.mark.parametrize(
    "argv",
    [["scan"], ["scan", "--json"], ["apply"], ["apply", "--dry-run"], ["apply", "--check"]],
    ids=" ".join,
)
def test_a_dangling_module_link_is_refused_and_nothing_is_written(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    affected_tree: Path,
    argv: list[str],
    patchset: list[str],
    jobs: str,
) -> None:
    """The release repro of D7: gpu_model_runner.py is a link to nothing.
    Skipped, the scan misses pr51565's runner and ``apply`` writes a half
    fix; it is bad input: exit 2, one line naming it, nothing changed."""
    monkeypatch.setenv("GDN_BACKPORT_JOBS", jobs)
    link = affected_tree / RUNNER
    link.parent.mkdir(parents=True)
    link.symlink_to("/nonexistent/gpu_model_runner.py")
    before = snapshot(affected_tree)
    code, out, err = run(capsys, *argv, *patchset, str(affected_tree))
    assert code == 2, (out, err)
    target = "/nonexistent/gpu_model_runner.py"
    assert (
        err
        == f"gdn-backport: {link}: symbolic link to nothing (its target {target} does not exist)\n"
    )
    if "--json" in argv:
        assert json.loads(out)["exit_code"] == 2
    assert snapshot(affected_tree) == before
    assert not (affected_tree / ".gdn-backport").exists()


# -- D10: scan's exit 2 for an unknown site comes with its line on stderr


@pytest.mark.parametrize(
    "argv", [[], ["--json"], ["--format", "sarif"], ["--format", "github"]], ids=" ".join
)
def test_a_scan_with_an_unknown_site_says_so_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    # A kernel behind an unknown wrapper: an unknown site.
    (tmp_path / "vllm" / "gdn.py").write_text(GatherGatesCodemod.REFUSES[1][0])
    code, out, err = run(capsys, "scan", *argv, str(tmp_path))
    assert code == 2
    assert err == (
        "gdn-backport: 1 unknown site(s): vllm/gdn.py:1 spec_step; "
        "apply refuses them (the reasons are in the report)\n"
    )
    if argv and argv[0] in ("--json", "--format") and argv[-1] != "github":
        json.loads(out)  # stdout stays one document
