"""harness/interpreter.py: the fixes to Triton's CPU interpreter, on tiny kernels.

One subprocess: ``TRITON_INTERPRET`` is read when triton is imported, and the
fixes patch triton's classes for the whole process (never this one's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import json
import torch, triton, triton.language as tl

@triton.jit
def copy(x_ptr, y_ptr, n, B: tl.constexpr):
    pid = tl.program_id(0)
    ok = pid < n  # a scalar comparison, splatted into a block mask below
    offs = tl.arange(0, B)
    tl.store(y_ptr + pid * B + offs, tl.load(x_ptr + pid * B + offs, mask=ok, other=-1.0))

def run():
    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    def grid(meta):
        meta["n"] = 0  # as causal_conv1d_fn's grid writes META: a copy, compiled
        return (2,)
    copy[grid](x, y, 2, B=4)
    return y.tolist()

@triton.autotune(configs=[triton.Config({"B": 4}), triton.Config({"B": 8})], key=["n"])
@triton.jit
def tuned(x_ptr, y_ptr, n, B: tl.constexpr):
    offs = tl.arange(0, B)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1)

out = {"before": run()}
from gdn_backport.harness.interpreter import patch_interpreter
out["patched"] = patch_interpreter()
out["again"] = patch_interpreter()
out["after"] = run()
x, y = torch.arange(8, dtype=torch.float32), torch.zeros(8)
tuned[(1,)](x, y, 8)
out["tuned"] = y.tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def got(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    pytest.importorskip("triton")
    script = Path(tmp_path_factory.mktemp("interp")) / "k.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_fixes_are_applied_once_per_process(got: dict[str, object]) -> None:
    patched = got["patched"]
    assert isinstance(patched, list)
    assert {"GridExecutor.__init__", "Autotuner._bench"} <= set(patched)
    assert "create_icmpSLT" in patched and "create_fcmpOLT" in patched
    assert got["again"] == []


def test_a_grid_that_writes_its_meta_no_longer_replaces_a_kernel_argument(
    got: dict[str, object],
) -> None:
    # Unpatched, the grid's META["n"] = 0 reaches the kernel: every load masked off.
    assert got["before"] == [-1.0] * 8
    assert got["after"] == [float(i) for i in range(8)]


def test_an_autotuned_kernel_runs_its_first_config_without_a_gpu(got: dict[str, object]) -> None:
    assert got["tuned"] == [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]  # B=4, the first
