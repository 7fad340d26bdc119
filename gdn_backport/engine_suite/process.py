"""One engine child: spec in, JSON result out, logs to files, a timeout.

The child runs in its own session, so a timeout kills the whole process
group (vLLM may have started compile workers) and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gdn_backport
from gdn_backport.engine_suite.config import ENGINE_ENV

__all__ = ["ChildResult", "child_env", "run_child"]

DRIVER = "gdn_backport.engine_suite.driver"


@dataclass
class ChildResult:
    name: str
    rc: int | None
    result: dict[str, Any] | None
    error: str | None
    seconds: float
    stdout: Path
    stderr: Path
    timed_out: bool = False
    reused: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None and bool(self.result.get("ok"))


def child_env(
    extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of an engine child: ours (or ``base``), the engine
    settings, ``extra`` (a variant's PYTHONPATH, VLLM_PLUGINS), and our own
    package importable after whatever PYTHONPATH says."""
    env = dict(os.environ if base is None else base)
    env.update(ENGINE_ENV)
    env.update(extra or {})
    ours = str(Path(gdn_backport.__file__).resolve().parent.parent)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ours not in parts:
        parts.append(ours)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def run_child(
    python: str,
    spec: dict[str, Any],
    folder: Path,
    name: str,
    timeout: float,
    env: Mapping[str, str],
    reuse: bool = False,
) -> ChildResult:
    """Run the driver on ``spec``; its result goes to ``folder/name.result.json``.

    ``reuse``: a result already there that says ok is taken as is (a
    resumed run does not start that engine again)."""
    folder.mkdir(parents=True, exist_ok=True)
    result_path = folder / f"{name}.result.json"
    spec_path = folder / f"{name}.spec.json"
    out, err = folder / f"{name}.stdout.txt", folder / f"{name}.stderr.txt"
    if reuse and result_path.exists():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            previous = json.loads(result_path.read_text(encoding="utf-8"))
            if isinstance(previous, dict) and previous.get("ok"):
                return ChildResult(name, 0, previous, None, 0.0, out, err, reused=True)
    result_path.unlink(missing_ok=True)
    spec_path.write_text(
        json.dumps({**spec, "result": str(result_path)}, indent=1), encoding="utf-8"
    )
    start = time.monotonic()
    timed_out = False
    with out.open("wb") as fo, err.open("wb") as fe:
        proc = subprocess.Popen(
            [python, "-m", DRIVER, "--spec", str(spec_path)],
            stdout=fo,
            stderr=fe,
            env=dict(env),
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.monotonic() - start
    data: dict[str, Any] | None = None
    if result_path.exists():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            loaded = json.loads(result_path.read_text(encoding="utf-8"))
            data = loaded if isinstance(loaded, dict) else None
    error: str | None = None
    if timed_out:
        error = f"timed out after {timeout:.0f} s (log: {err})"
    elif data is None:
        error = f"exit code {rc} and no result (log: {err}: {_tail(err)})"
    elif not data.get("ok"):
        error = str(data.get("error") or f"exit code {rc}")
    elif rc != 0:
        error = f"exit code {rc} after a result"
    return ChildResult(name, rc, data, error, seconds, out, err, timed_out=timed_out)
