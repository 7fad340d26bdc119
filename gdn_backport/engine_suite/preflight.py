"""Before any engine starts: is there a vLLM, does it know the model, is
there a GPU? Each "no" is a refusal (exit 2, one line on stderr).

The facts come from a tiny child ``python -c`` of the Python that will run
the engines (which may not be ours): where ``vllm`` is (``find_spec``, which
does not import it), torch's version and whether it sees CUDA. Whether the
vLLM knows the model is read from its registry's source text
(``vllm/model_executor/models/registry.py``), never from a version number:
forks report any version.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["REGISTRY", "Refusal", "check", "probe"]

REGISTRY = "model_executor/models/registry.py"

_PROBE = r"""
import importlib.util, json, os, sys
out = {"python": sys.executable}
spec = importlib.util.find_spec("vllm")
where = None
if spec is not None:
    if spec.submodule_search_locations:
        where = list(spec.submodule_search_locations)[0]
    elif spec.origin:
        where = os.path.dirname(spec.origin)
out["vllm"] = where
if where is not None and sys.argv[1] == "cuda":
    try:
        import torch
        out["torch"] = torch.__version__
        out["cuda"] = bool(torch.cuda.is_available())
        out["device"] = torch.cuda.get_device_name(0) if out["cuda"] else None
    except Exception as exc:
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Refusal:
    path: str
    reason: str

    def line(self) -> str:
        return f"gdn-backport: {self.path}: {self.reason}"

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


def probe(
    python: str, env: Mapping[str, str], cuda: bool, timeout: float = 180.0
) -> dict[str, Any]:
    """The child's facts (``{"error": ...}`` when it could not run)."""
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE, "cuda" if cuda else "no-cuda"],
            capture_output=True,
            text=True,
            env=dict(env),
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit code {proc.returncode}: {tail}"}
    return data


def check(
    python: str,
    env: Mapping[str, str] | None = None,
    architectures: Sequence[str] = (),
    *,
    require_cuda: bool = True,
) -> tuple[Refusal | None, dict[str, Any]]:
    """``(refusal or None, facts)``: vLLM importable, then its registry
    knows ``architectures``, then torch sees CUDA (``require_cuda``)."""
    environ = os.environ if env is None else env
    facts = probe(python, environ, cuda=False)
    if "error" in facts:
        return Refusal(python, f"cannot run this Python: {facts['error']}"), facts
    where = facts.get("vllm")
    if not where:
        return Refusal("vllm", "no vLLM importable in this Python"), facts
    registry = Path(where) / REGISTRY
    try:
        text = registry.read_text(encoding="utf-8")
    except OSError:
        return Refusal(
            where, f"no model registry ({REGISTRY}): cannot tell which models it runs"
        ), facts
    for arch in architectures:
        if f'"{arch}"' not in text:
            return Refusal(where, f"the model registry ({REGISTRY}) lacks {arch}"), facts
    if require_cuda:
        # A second child: importing torch takes seconds, and the refusals
        # above need none of it.
        facts.update(probe(python, environ, cuda=True))
        if "error" in facts:
            return Refusal(python, f"cannot run this Python: {facts['error']}"), facts
        if "torch_error" in facts:
            return Refusal(python, f"torch is not importable: {facts['torch_error']}"), facts
        if not facts.get("cuda"):
            return Refusal(
                python,
                f"torch {facts.get('torch')} sees no CUDA device (the engine suite needs a GPU)",
            ), facts
    return None, facts
