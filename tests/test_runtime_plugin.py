"""The vLLM general plugin: in-memory patch of the GDN method in effect."""

from __future__ import annotations

import importlib
import inspect
import logging
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gdn_backport.patchsets.pr51565 import runtime as split_runtime
from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod
from gdn_backport.patchsets.pr51812.runtime import live
from gdn_backport.patchsets.pr51812.runtime import plugin as layer
from gdn_backport.patchsets.pr51812.runtime.live import MARKER
from gdn_backport.runtime import hook, plugin
from tests.fake_vllm import AFFECTED, FIXED, make_site

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
GDN = "vllm.model_executor.layers.gdn"


def _as_layer(function: str) -> str:
    """One of the codemod's ``spec_step`` examples as ``Layer._forward_core``
    (an example that is already a ``Layer`` class is taken as it is)."""
    if function.startswith("class Layer:"):
        return function
    method = function.replace("def spec_step(", "def _forward_core(")
    return "class Layer:\n" + textwrap.indent(method, "    ")


NOT_AFFECTED = _as_layer(GatherGatesCodemod.UNCHANGED[1])
UNKNOWN = _as_layer(GatherGatesCodemod.REFUSES[2][0])
REFUSED = _as_layer(GatherGatesCodemod.REFUSES[0][0])


def _method() -> Any:
    return importlib.import_module(GDN).Layer.__dict__["_forward_core"]


def _heavy(code: str, path: str) -> list[str]:
    probe = (
        f"import sys\n{code}\n"
        "heavy = ('torch', 'libcst', 'vllm', 'gdn_backport.patchsets.pr51812.analysis')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    env = {"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    return eval(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_without_vllm_register_imports_nothing_heavy(tmp_path: Path) -> None:
    code = "from gdn_backport.runtime.plugin import register\nregister()"
    assert _heavy(code, str(REPO)) == []
    # The control: with a vLLM present the same call does load the analysis.
    site = make_site(tmp_path)
    assert "libcst" in _heavy(code, f"{site}:{REPO}")


def test_importing_the_plugin_imports_nothing_heavy_even_with_vllm(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    assert _heavy("import gdn_backport.runtime.plugin", f"{site}:{REPO}") == []


def test_entry_point_is_declared() -> None:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    group = doc["project"]["entry-points"]["vllm.general_plugins"]
    assert group == {"gdn_backport": "gdn_backport.runtime.plugin:register"}
    from setuptools import find_packages

    # setup.py ships every gdn_backport package it finds: the plugin's too.
    assert "gdn_backport.runtime" in find_packages(str(REPO), include=["gdn_backport.*"])


def test_affected_module_imported_later_is_patched_on_import(
    fake: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fake()
    caplog.set_level(logging.INFO, "gdn_backport")
    plugin.register()
    assert GDN not in sys.modules  # vLLM imports models after the plugins
    fn = _method()
    mark = getattr(fn, MARKER)
    assert mark["strategy"] == "gather" and mark["upstream"] == "vllm-project/vllm#51812"
    assert fn.__code__.co_filename == "<gdn-backport:pr51812 vllm/model_executor/layers/gdn.py>"
    # Lines above the inserted ones keep the file's numbers.
    assert fn.__code__.co_firstlineno == mark["original"].__code__.co_firstlineno
    assert "a_spec = a.index_select(0, spec_token_indx)" in inspect.getsource(fn)
    lines = [r.getMessage() for r in caplog.records if r.name == "gdn_backport"]
    assert lines == [
        "gdn-backport: patched Layer._forward_core (vllm/model_executor/layers/gdn.py:5): "
        "affected -> fixed (vLLM PR #51812, gather)"
    ]


def test_module_imported_before_register_is_patched(fake: Any) -> None:
    fake()
    original = _method()
    plugin.register()
    assert getattr(_method(), MARKER)["original"] is original


def test_second_register_changes_nothing(fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake()
    plugin.register()
    first = _method()
    caplog.set_level(logging.DEBUG, "gdn_backport")
    plugin.register()
    assert _method() is first
    assert sum(isinstance(f, hook.PostImportFinder) for f in sys.meta_path) == 1
    watches = list(hook.installed().watches)  # type: ignore[union-attr]
    assert watches == [layer.WATCH, split_runtime.WATCH]
    assert not [r for r in caplog.records if "patched" in r.getMessage()]


@pytest.mark.parametrize("source", [FIXED, NOT_AFFECTED], ids=["fixed", "not_affected"])
def test_fixed_and_not_affected_are_left_alone(fake: Any, source: str) -> None:
    fake(gdn=source)
    original = _method()
    plugin.register()
    assert _method() is original


@pytest.mark.parametrize(
    ("source", "says"),
    [(UNKNOWN, "unknown: "), (REFUSED, "the rewrite was refused: ")],
    ids=["unknown", "refused"],
)
def test_unknown_or_refused_logs_an_error_and_keeps_the_original(
    fake: Any, caplog: pytest.LogCaptureFixture, source: str, says: str
) -> None:
    fake(gdn=source)
    original = _method()
    plugin.register()
    assert _method() is original
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and says in errors[0] and "Layer._forward_core" in errors[0]


@pytest.mark.parametrize(("hw", "patched"), [(AFFECTED, True), (FIXED, False)])
def test_hardware_plugin_replacement_is_what_gets_analysed(
    fake: Any, hw: str, patched: bool
) -> None:
    fake(hardware=hw)
    importlib.import_module("vllm.plugins").load_general_plugins()
    module = importlib.import_module(GDN)
    # Whichever plugin ran first, the first layer built sees the settled method.
    module.Layer()
    fn = _method()
    mark = getattr(fn, MARKER, None)
    if patched:
        assert mark is not None and mark["original"].__module__ == "vllm_fakehw.ops"
        assert fn.__code__.co_filename == "<gdn-backport:pr51812 vllm_fakehw/ops.py>"
    else:
        assert mark is None and fn.__module__ == "vllm_fakehw.ops"
    [method] = live.live_methods(module)
    assert method.status.value == "fixed"


def test_replacement_after_the_first_check_is_caught_at_first_construction(fake: Any) -> None:
    fake()
    plugin.register()
    module = importlib.import_module(GDN)
    original = getattr(_method(), MARKER)["original"]
    module.Layer._forward_core = original  # a later plugin puts affected code back
    module.Layer()
    assert getattr(_method(), MARKER, None) is not None


class _Md:
    """Metadata of one step: token 0 non-spec, tokens 1-3 one spec row."""

    def __init__(self, torch: Any) -> None:
        self.spec_sequence_masks = torch.tensor([False, True])
        self.spec_token_indx = torch.tensor([1, 2, 3])
        self.non_spec_token_indx = torch.tensor([0])
        self.spec_state_indices_tensor = torch.tensor([[1]])
        self.non_spec_state_indices_tensor = torch.tensor([0])
        self.num_prefills, self.num_decodes = 0, 1
        self.num_accepted_tokens = torch.tensor([2])


def _spec_gate_rows(
    module: Any, torch: Any, steps: int = 1, after_step: Callable[[], object] = lambda: None
) -> list[list[float]]:
    """Run the live ``Layer._forward_core`` of ``module`` on :class:`_Md`'s
    step ``steps`` times, the kernel replaced by a recorder: the gate rows
    ``a`` that each spec call (the one given accepted tokens) received."""
    got: list[list[float]] = []

    def kernel(**kw: Any) -> tuple[Any, None]:
        if kw.get("num_accepted_tokens") is not None:
            got.append(kw["a"].flatten().tolist())
        return kw["q"], None

    md = _Md(torch)
    module.fused_sigmoid_gating_delta_rule_update = kernel
    module.get_forward_context = lambda: types.SimpleNamespace(attn_metadata={"p": md})
    layer = module.Layer("p")
    layer.kv_cache, layer.A_log, layer.dt_bias = [None, None], None, None
    layer.rearrange_mixed_qkv = lambda x: (x, x, x)
    a = torch.arange(4.0)[:, None]
    for _ in range(steps):
        _method()(layer, torch.zeros(4, 1), a.clone(), a, None)
        after_step()
    return got


def test_patched_method_runs_in_its_module_and_gives_the_kernel_spec_gates(fake: Any) -> None:
    torch = pytest.importorskip("torch")
    fake()
    module = importlib.import_module(GDN)
    got = _spec_gate_rows(module, torch, steps=2, after_step=plugin.register)
    # Unpatched the spec kernel gets every token's gates (it reads rows 0-2:
    # the bug); patched, the spec tokens' rows 1-3.
    assert got == [[0, 1, 2, 3], [1, 2, 3]]


# One release per affected layout: models/qwen3_next.py (0.18),
# layers/mamba/gdn_linear_attn.py (0.19-0.21), layers/mamba/gdn/ (0.22-0.27.1).
@pytest.mark.network
@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.18.1", "0.21.0", "0.25.1"])
def test_suite_passes_on_the_plugin_patched_class_of_a_release(version: str) -> None:
    from gdn_backport.verify import verify_tree
    from tests.harness_fixtures import interpreted, release_tree

    interpreted()
    tree = release_tree(version)
    # The control: the release as it is fails the PR's own layout.
    before = verify_tree(tree, scenarios=["pr_layout"])
    assert before.exit_code == 1, before.table()
    patched: list[live.LiveMethod] = []
    after = verify_tree(
        tree,
        scenarios=["pr_layout", "production"],
        patch=lambda module: patched.extend(layer.patch_module(module)),
    )
    assert after.passed, after.table()
    qwen = [m for m in patched if m.name == "_forward_core" and m.ours is not None]
    assert len(qwen) == 1 and qwen[0].status.value == "fixed", patched


# The spec kernel one call down, in a method of the layer (issue 12): the
# plugin patches the live caller and leaves the helper as it is.
CHAINED = """\
class Layer:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        m = get_forward_context().attn_metadata[self.prefix]
        spec_token_indx = m.spec_token_indx
        if m.spec_sequence_masks is not None:
            if m.num_prefills == 0 and m.num_decodes == 0:
                mixed_qkv_spec = mixed_qkv
            else:
                mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)
            q, k, v = self.rearrange_mixed_qkv(mixed_qkv_spec)
            out, _ = self._spec_update(a, b, q, k, v, m.spec_state_indices_tensor, m)
            return out

    def _spec_update(self, a, b, q, k, v, slots, m):
        return fused_sigmoid_gating_delta_rule_update(
            A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
            initial_state=self.kv_cache[1], ssm_state_indices=slots,
            num_accepted_tokens=m.num_accepted_tokens,
        )
"""


def test_a_chained_spec_path_is_patched_in_the_live_caller(fake: Any) -> None:
    torch = pytest.importorskip("torch")
    fake(gdn=CHAINED)
    plugin.register()
    module = importlib.import_module(GDN)
    mark = getattr(_method(), MARKER, None)
    assert mark is not None, "the caller was not patched"
    helper = module.Layer.__dict__["_spec_update"]
    assert getattr(helper, MARKER, None) is None  # the helper is left as it is
    assert "_spec_update(a_spec, b_spec, q, k, v" in inspect.getsource(_method())
    # Through the helper, the kernel gets the spec tokens' gate rows 1-3.
    assert _spec_gate_rows(module, torch) == [[1, 2, 3]]
    [method] = [m for m in live.live_methods(module) if m.name == "_forward_core"]
    assert method.status.value == "fixed"


SPLIT_BUILDER = """
from vllm.v1.utils import split_decodes_and_prefills

class Builder:
    def build(self, common_prefix_len, common_attn_metadata):
        m = common_attn_metadata
        a, b, c, d = split_decodes_and_prefills(m, decode_threshold=1)
        return dict(non_spec_state_indices_tensor=None)
"""
SPLIT_FIXED = SPLIT_BUILDER.replace(
    "split_decodes_and_prefills(m, decode_threshold=1)",
    "split_decodes_and_prefills(m.replace(is_prefilling=(m.seq_lens_cpu_upper_bound <= 1) "
    "& m.is_prefilling), treat_short_extends_as_decodes=False)",
)
SPLIT_RUNNER = """
class Runner:
    def _is_uniform_decode(self, n):
        return True

    def execute_model(self, scheduler_output):
        return self._determine_batch_execution_and_padding(num_tokens=1, num_reqs=1)
"""


@pytest.mark.parametrize(
    ("builder", "errors"),
    [
        # The open route is part of the builder's fix: reported with it.
        (
            SPLIT_BUILDER,
            [
                "vllm.v1.runner.Runner.execute_model: affected",
                "vllm.v1.builder.Builder.build: affected",
            ],
        ),
        # 0.31.0's half fix: the builder is fixed, the runner's route open.
        (SPLIT_FIXED, ["vllm.v1.runner.Runner.execute_model: affected"]),
    ],
)
def test_pr51565_sites_are_reported_not_patched(
    fake: Any, caplog: pytest.LogCaptureFixture, builder: str, errors: list[str]
) -> None:
    site = fake()
    v1 = site / "vllm" / "v1"
    v1.mkdir()
    (v1 / "__init__.py").write_text("")
    (v1 / "utils.py").write_text("def split_decodes_and_prefills(*a, **k):\n    return 0\n")
    (v1 / "runner.py").write_text(SPLIT_RUNNER)
    (v1 / "builder.py").write_text(builder)
    caplog.set_level(logging.INFO, "gdn_backport")
    plugin.register()
    importlib.import_module("vllm.v1.runner")  # the runner first, as a worker does
    importlib.import_module("vllm.v1.builder")
    found = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [line.split(" for vLLM #51565")[0] for line in found] == [
        f"gdn-backport: {e}" for e in errors
    ]
    # D5: the hint works for a read-only image too (patch where it is built).
    assert all("read-only image: apply it where the image is built" in line for line in found)
    assert all("apply --installed --patchset pr51565" in line for line in found)
    # Reported, not patched: the class's build is the file's own.
    build = importlib.import_module("vllm.v1.builder").Builder.build
    assert inspect.getsourcefile(build) == str(v1 / "builder.py")
