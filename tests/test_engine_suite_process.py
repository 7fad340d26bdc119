"""engine_suite/process.py: one engine child, its environment, result, logs and timeout.

The "python" run here is a made-up interpreter (a script that reads the
spec it is given): no vLLM, no engine; a child per case, each a fraction of
a second.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import gdn_backport
from gdn_backport.engine_suite.config import ENGINE_ENV
from gdn_backport.engine_suite.process import DRIVER, ChildResult, child_env, run_child

_FAKE = """\
import json, sys, time
assert sys.argv[1:3] == ["-m", "{driver}"], sys.argv
spec = json.load(open(sys.argv[sys.argv.index("--spec") + 1]))
print("engine says hi")
print("first\\nsecond\\nthird\\nlast words", file=sys.stderr)
mode = spec["mode"]
if mode == "sleep":
    time.sleep(60)
result = {{"ok": {{"ok": True, "v": 1}}, "ok_rc": {{"ok": True}},
          "fail": {{"ok": False, "error": "engine died"}}, "list": [1]}}.get(mode)
if result is not None:
    json.dump(result, open(spec["result"], "w"))
sys.exit(5 if mode == "ok_rc" else 0 if mode == "ok" else 3)
"""


@pytest.fixture
def python(tmp_path: Path) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n" + _FAKE.format(driver=DRIVER))
    script.chmod(0o755)
    return str(script)


def _run(
    python: str, folder: Path, mode: str, timeout: float = 30.0, reuse: bool = False
) -> ChildResult:
    return run_child(python, {"mode": mode}, folder, "cell", timeout, dict(os.environ), reuse)


def test_a_child_that_writes_an_ok_result(python: str, tmp_path: Path) -> None:
    res = _run(python, tmp_path / "out", "ok")
    assert res.ok and res.error is None and res.rc == 0
    assert res.result == {"ok": True, "v": 1}
    assert res.stdout.read_text() == "engine says hi\n"
    spec = json.loads((tmp_path / "out" / "cell.spec.json").read_text())
    assert spec == {"mode": "ok", "result": str(tmp_path / "out" / "cell.result.json")}


def test_no_result_names_the_exit_code_and_the_log_tail(python: str, tmp_path: Path) -> None:
    res = _run(python, tmp_path, "none")
    assert not res.ok and res.rc == 3 and res.result is None
    assert res.error is not None and res.error.startswith("exit code 3 and no result (log: ")
    assert res.error is not None and res.error.endswith("second | third | last words)")


@pytest.mark.parametrize(
    ("mode", "error"),
    [("fail", "engine died"), ("ok_rc", "exit code 5 after a result"), ("list", "exit code 3")],
)
def test_a_result_that_is_not_ok_is_an_error(
    python: str, tmp_path: Path, mode: str, error: str
) -> None:
    res = _run(python, tmp_path, mode)
    assert not res.ok
    assert res.error is not None and res.error.startswith(error)


def test_a_child_past_its_timeout_is_killed(python: str, tmp_path: Path) -> None:
    res = _run(python, tmp_path, "sleep", timeout=1.0)
    assert res.timed_out and res.rc is None and not res.ok
    assert res.error is not None and res.error.startswith("timed out after 1 s")
    assert res.seconds < 30


def test_reuse_takes_an_ok_result_already_there_and_reruns_otherwise(
    python: str, tmp_path: Path
) -> None:
    (tmp_path / "cell.result.json").write_text('{"ok": true, "kept": 1}')
    res = _run(python, tmp_path, "none", reuse=True)
    assert res.reused and res.result == {"ok": True, "kept": 1} and res.ok
    assert not (tmp_path / "cell.spec.json").exists()  # nothing was run
    (tmp_path / "cell.result.json").write_text('{"ok": false}')
    res = _run(python, tmp_path, "ok", reuse=True)
    assert not res.reused and res.result == {"ok": True, "v": 1}
    # Without reuse an old result is removed before the child starts.
    res = _run(python, tmp_path, "none")
    assert res.result is None


def test_child_env_adds_the_engine_settings_and_our_package_last() -> None:
    ours = str(Path(gdn_backport.__file__).resolve().parent.parent)
    env = child_env({"VLLM_PLUGINS": "x", "PYTHONPATH": f"/variant{os.pathsep}{ours}"},
                    base={"HOME": "/h", "HF_HUB_OFFLINE": "0"})  # fmt: skip
    assert env["HOME"] == "/h" and env["VLLM_PLUGINS"] == "x"
    assert env["HF_HUB_OFFLINE"] == ENGINE_ENV["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"] == f"/variant{os.pathsep}{ours}"  # not added twice
    assert child_env(base={})["PYTHONPATH"] == ours
    assert child_env(base={"PYTHONUNBUFFERED": "0"})["PYTHONUNBUFFERED"] == "0"
    assert child_env(base={})["PYTHONUNBUFFERED"] == "1"
