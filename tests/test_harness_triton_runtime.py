"""harness/triton_runtime.py: what the harness changes in Triton's runtime.

The ones marked ``network`` load a real release.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness_fixtures import interpreted, release_tree


@pytest.mark.network
def test_gpu_runs_pin_each_autotuner_to_its_first_config() -> None:
    interpreted()
    from triton.runtime.autotuner import Autotuner

    from gdn_backport.harness.loader import load_tree
    from gdn_backport.harness.triton_runtime import pin_autotuners

    loaded = load_tree(release_tree("0.27.1"))
    tuners = [
        v for m in loaded.modules.values() for v in vars(m).values() if isinstance(v, Autotuner)
    ]
    assert any(len(t.configs) > 1 for t in tuners)
    firsts = [t.configs[0] for t in tuners]
    assert pin_autotuners(loaded.modules.values()) > 0
    assert [t.configs for t in tuners] == [[c] for c in firsts]


_KERNEL_MODULE = """
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N", "M"])
def kernel(x, N: tl.constexpr, M):
    pass
"""


def test_constexprs_are_taken_out_of_do_not_specialize(tmp_path: Path) -> None:
    # Compiled Triton only (the interpreter has no JITFunction): a subprocess
    # without TRITON_INTERPRET. Triton 3.6 refuses to compile a constexpr
    # listed in do_not_specialize (0.10.2's fused recurrent kernel has N so).
    import os
    import subprocess
    import sys

    (tmp_path / "kmod.py").write_text(_KERNEL_MODULE, encoding="utf-8")
    script = (
        "import kmod\n"
        "from gdn_backport.harness.triton_runtime import unlist_specialized_constexprs\n"
        "flags = lambda: [p.do_not_specialize for p in kmod.kernel.params]\n"
        "before = flags()\n"
        "print(before, unlist_specialized_constexprs([kmod]), flags())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    # N (constexpr) unlisted, M (a plain argument) left as the author asked.
    assert done.stdout.split() == ["[False,", "True,", "True]", "1", "[False,", "False,", "True]"]
