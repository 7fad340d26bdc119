"""A plugin's tree read against the vLLM it runs on (``--vllm PATH``, else
the importable one): the definitions it lacks come from that vLLM, only the
plugin's files are written, and bad input is one line and exit 2.

The plugin is written here (a GDN builder subclass swapped in over
upstream's, importing vLLM's ``CommonAttentionMetadata`` and split
function); the vLLMs are real releases from the cache, read in place, and a
private copy of 0.25.1's ``vllm/v1`` patched by pr51565 itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from gdn_backport import context, sources
from gdn_backport.context import Vllm, is_plugin_tree, vllm_package
from gdn_backport.errors import UsageError
from tests.conftest import run

_HEAD = '''\
"""A plugin's GDN metadata builder, swapped in over upstream's."""

import torch

from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends import gdn_attn
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills


class MyGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        num_accepted_tokens: torch.Tensor | None = None,
        num_decode_draft_tokens_cpu: torch.Tensor | None = None,
        fast_build: bool = False,
    ) -> GDNAttentionMetadata:
        m = common_attn_metadata
'''

_SPLIT = """\
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(m, decode_threshold=1)
        )
"""

# The same builder with upstream's 0.31.0 rule written by hand.
_FIXED_SPLIT = """\
        query_lens_cpu = m.query_start_loc_cpu.diff()
        no_prior_state = (query_lens_cpu > 0) & (m.seq_lens_cpu_upper_bound <= query_lens_cpu)
        if m.is_prefilling is not None:
            no_prior_state &= m.is_prefilling
        else:
            no_prior_state = torch.zeros_like(no_prior_state)
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(
                m.replace(is_prefilling=no_prior_state),
                decode_threshold=1,
                treat_short_extends_as_decodes=False,
            )
        )
"""

_TAIL = """\
        return GDNAttentionMetadata(
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_spec_decodes=0,
            num_spec_decode_tokens=0,
            num_actual_tokens=m.num_actual_tokens,
            non_spec_state_indices_tensor=m.block_table_tensor[:, 0],
        )


gdn_attn.GDNAttentionBackend.get_builder_cls = staticmethod(
    lambda: MyGDNAttentionMetadataBuilder
)
"""

BUILDER = _HEAD + _SPLIT + _TAIL
FIXED_BUILDER = _HEAD + _FIXED_SPLIT + _TAIL
SITE = "vllm_myplugin/gdn_builder.py"


def _plugin(tmp_path: Path, builder: str = BUILDER) -> Path:
    root = tmp_path / "plugin"
    (root / "vllm_myplugin").mkdir(parents=True)
    (root / "vllm_myplugin" / "__init__.py").write_text(
        "def register():\n    from vllm_myplugin import gdn_builder  # noqa: F401\n"
    )
    (root / SITE).write_text(builder)
    return root


def _state(root: Path) -> dict[str, str]:
    """Every file below ``root`` (links not followed) and its digest: a
    refusal or a read must leave this as it was."""
    out: dict[str, str] = {}
    for folder, dirs, names in os.walk(root):
        for name in [*names, *dirs]:
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink() or path.is_dir():
                out[rel] = "link" if path.is_symlink() else "dir"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(autouse=True)
def _no_importable_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The importable vllm is whatever a test puts on sys.path (none by
    default), whatever the machine has installed."""
    real = context.importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        if name == "vllm" and not getattr(sys, "_gdn_test_vllm", False):
            return None
        return real(name, package)

    monkeypatch.setattr(context.importlib.util, "find_spec", find_spec)


@pytest.fixture(scope="module")
def patched_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """0.25.1's ``vllm/v1`` (its metadata, split function, builders and
    both runners), copied and patched by pr51565: the vLLM a plugin runs on
    once ``apply --installed`` went through."""
    src = sources.release_tree("0.25.1") / "vllm"
    root = tmp_path_factory.mktemp("v0251") / "site"
    (root / "vllm").mkdir(parents=True)
    for name in ("__init__.py", "_version.py"):
        shutil.copyfile(src / name, root / "vllm" / name)
    shutil.copytree(src / "v1", root / "vllm" / "v1")
    from gdn_backport import pipeline, registry

    (ps,) = registry.selected(["pr51565"])
    ((_, out),) = pipeline.apply(root, [ps])
    assert out.refused == [] and out.written, out
    return root


def test_a_swapped_in_builder_is_patched_and_proven_against_the_vllm_it_runs_on(
    tmp_path: Path, patched_v1: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fails on the code before ``--vllm``: the option did not exist, and the
    plugin was refused for lacking vLLM's definitions."""
    plugin = _plugin(tmp_path)
    vllm_before = _state(patched_v1)
    code, out, err = run(capsys, "scan", str(plugin), "--vllm", str(patched_v1))
    assert code == 1 and "MyGDNAttentionMetadataBuilder.build" in out and "affected" in out
    code, out, err = run(capsys, "apply", str(plugin), "--vllm", str(patched_v1 / "vllm"))
    assert code == 0, err
    row = next(ln for ln in out.splitlines() if ln.startswith(SITE))
    assert row.split()[-3:] == ["affected", "fixed", "yes"]
    # The rule reads the fields of 0.25.1's metadata, through its own replace method.
    text = (plugin / SITE).read_text()
    assert "m.seq_lens_cpu_upper_bound <= query_lens_cpu" in text
    assert "m.replace(is_prefilling=no_prior_state)" in text
    assert "treat_short_extends_as_decodes=False" in text
    line = next(ln for ln in out.splitlines() if ln.startswith("vllm read: "))
    assert str(patched_v1 / "vllm") in line and "vLLM 0.25.1" in line and "--vllm" in line
    assert "CommonAttentionMetadata" in line and "the model runner" in line
    # Only the plugin was written: the vLLM holds what it held.
    assert _state(patched_v1) == vllm_before
    code, out, _ = run(capsys, "scan", str(plugin), "--vllm", str(patched_v1), "--json")
    doc = json.loads(out)
    assert code == 0 and [s["status"] for s in doc["sites"]] == ["fixed"]
    assert doc["vllm_context"]["source"] == "--vllm"
    assert doc["vllm_context"]["vllm_version"]["version"] == "0.25.1"
    code, out, _ = run(capsys, "apply", "--check", str(plugin), "--vllm", str(patched_v1))
    assert code == 0


def test_the_importable_vllm_is_the_default(
    tmp_path: Path,
    patched_v1: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "vllm" not in sys.modules
    monkeypatch.syspath_prepend(str(patched_v1))
    monkeypatch.setattr(sys, "_gdn_test_vllm", True, raising=False)
    plugin = _plugin(tmp_path)
    code, out, err = run(capsys, "apply", str(plugin), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["written"] == [SITE], err
    assert doc["vllm_context"]["source"] == "installed"
    assert doc["vllm_context"]["package"] == str((patched_v1 / "vllm").resolve())
    assert "vllm" not in sys.modules  # found, never imported


def test_against_an_unpatched_vllm_the_builder_fix_waits_for_its_runner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.25.1 as released: the plugin's builder fix alone would be the half
    fix (vLLM's FULL decode routes open): refused, naming the route."""
    release = sources.release_tree("0.25.1")
    plugin = _plugin(tmp_path)
    before, vllm_before = _state(plugin), _state(release / "vllm" / "v1" / "worker")
    code, _, err = run(capsys, "apply", str(plugin), "--vllm", str(release))
    assert code == 2
    assert "vllm/v1/worker/gpu_model_runner.py" in err and "GPUModelRunner.execute_model" in err
    assert "apply pr51565 to that vLLM first" in err and len(err.splitlines()) == 1
    assert _state(plugin) == before
    assert _state(release / "vllm" / "v1" / "worker") == vllm_before


def test_a_fixed_plugin_builder_reads_fixed_on_a_fixed_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    release = sources.release_tree("0.31.0")
    plugin = _plugin(tmp_path, FIXED_BUILDER)
    code, out, _ = run(capsys, "scan", str(plugin), "--vllm", str(release), "--json")
    doc = json.loads(out)
    assert code == 0 and [s["status"] for s in doc["sites"]] == ["fixed"]
    code, out, _ = run(capsys, "apply", str(plugin), "--vllm", str(release))
    assert code == 0 and (plugin / SITE).read_text() == FIXED_BUILDER


def test_an_affected_plugin_builder_on_a_release_with_upstreams_half_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.31.0 fixed its own builders but left the V1 route open: the plugin's
    builder fix is refused until that vLLM is patched."""
    plugin = _plugin(tmp_path)
    code, _, err = run(capsys, "apply", str(plugin), "--vllm", str(sources.release_tree("0.31.0")))
    assert code == 2 and "gpu_model_runner.py" in err and "is open" in err
    assert (plugin / SITE).read_text() == BUILDER


def test_without_a_vllm_the_refusal_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fails on the code before ``--vllm``: the refusal did not say what to pass."""
    plugin = _plugin(tmp_path)
    before = _state(plugin)
    code, out, err = run(capsys, "apply", str(plugin))
    assert code == 2 and len(err.splitlines()) == 1
    assert "no definition of CommonAttentionMetadata and split_decodes_and_prefills" in err
    assert "pass --vllm PATH" in err
    assert "vllm read" not in out
    assert _state(plugin) == before


def _bad(tmp_path: Path, kind: str) -> Path:
    if kind == "missing":
        return tmp_path / "nowhere"
    if kind == "file":
        (tmp_path / "notes.txt").write_text("x\n")
        return tmp_path / "notes.txt"
    if kind == "not-a-vllm":
        (tmp_path / "other" / "pkg").mkdir(parents=True)
        (tmp_path / "other" / "pkg" / "__init__.py").write_text("")
        return tmp_path / "other"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("missing", "no such file or directory"),
        ("file", "not a folder"),
        ("not-a-vllm", "not a vLLM"),
        ("unreadable", "cannot read"),
    ],
)
@pytest.mark.parametrize("command", [["scan"], ["apply"], ["apply", "--check"]])
def test_bad_vllm_paths_are_one_line_and_change_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    reason: str,
    command: list[str],
) -> None:
    plugin = _plugin(tmp_path)
    if kind == "unreadable":
        # Root reads through any mode bits: the folder's listing fails instead.
        bad = tmp_path / "locked"
        (bad / "vllm").mkdir(parents=True)
        (bad / "vllm" / "__init__.py").write_text("")
        real = os.scandir

        def scandir(path: object = ".") -> object:
            if Path(str(path)) == bad:
                raise PermissionError(13, "Permission denied")
            return real(path)  # type: ignore[call-overload]

        monkeypatch.setattr(context.os, "scandir", scandir)
    else:
        bad = _bad(tmp_path, kind)
    before = _state(tmp_path)
    code, out, err = run(capsys, *command, str(plugin), "--vllm", str(bad))
    assert code == 2 and out == ""
    assert err.splitlines() == [err.strip()] and f"--vllm {bad}: " in err and reason in err
    assert _state(tmp_path) == before


def test_vllm_goes_with_a_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "scan", "--release", "0.25.1", "--vllm", str(tmp_path))
    assert code == 2 and "--vllm goes with PATH" in err


def test_the_package_a_path_names(tmp_path: Path) -> None:
    for rel in ("a/vllm", "b/vllm-0.25.1/vllm", "c/x/y/vllm"):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "__init__.py").write_text("")
    assert vllm_package(tmp_path / "a") == (tmp_path / "a" / "vllm").resolve()
    assert vllm_package(tmp_path / "a" / "vllm") == (tmp_path / "a" / "vllm").resolve()
    assert vllm_package(tmp_path / "b") == (tmp_path / "b" / "vllm-0.25.1" / "vllm").resolve()
    with pytest.raises(UsageError, match="not a vLLM"):
        vllm_package(tmp_path / "c")  # two folders down is not a vLLM tree


def test_only_a_plugins_tree_is_read_against_the_importable_vllm(tmp_path: Path) -> None:
    """A folder of vLLM's own code (a single file's folder, a checkout) is
    never mixed with another vLLM unless one is named."""
    (tmp_path / "vllm" / "v1" / "attention").mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "plug").mkdir()
    assert not is_plugin_tree(tmp_path)
    assert not is_plugin_tree(tmp_path / "vllm" / "v1" / "attention")
    assert is_plugin_tree(tmp_path / "plug")
    assert Vllm().package(tmp_path / "vllm" / "v1" / "attention") is None
    assert Vllm(tmp_path).package(tmp_path / "vllm" / "v1") == (tmp_path / "vllm").resolve()


def test_nothing_read_nothing_said() -> None:
    ctx = Vllm()
    assert ctx.lines() == [] and ctx.to_json() is None


def test_a_fixed_plugin_builder_on_an_open_vllm_runner_is_said_to_be_a_half_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plugin's own site is fixed (exit 0); the half fix it makes with
    0.31.0's open V1 route is said, in the text and in the JSON."""
    plugin = _plugin(tmp_path, FIXED_BUILDER)
    release = str(sources.release_tree("0.31.0"))
    code, out, _ = run(capsys, "scan", str(plugin), "--vllm", release)
    note = next(ln for ln in out.splitlines() if ln.startswith("note: pr51565:"))
    assert code == 0 and "gpu_model_runner.py" in note and "half fix" in note
    code, out, _ = run(capsys, "scan", str(plugin), "--vllm", release, "--json")
    assert json.loads(out)["vllm_context"]["notes"] == [note]


def test_a_plugins_runner_is_judged_with_the_builders_of_its_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plugin with a runner of its own and no builder: its open FULL
    decode route is a half fix with 0.31.0's builders, which call a new
    one-token row a prefill. Fails on the code before: read alone, the
    route was ``not_affected`` (no builder in the tree reclassifies)."""
    from tests.test_prior_state import V1_RUNNER

    plugin = _plugin(tmp_path)
    (plugin / SITE).unlink()
    runner = "vllm_myplugin/runner.py"
    (plugin / runner).write_text(
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n" + V1_RUNNER
    )
    release = str(sources.release_tree("0.31.0"))
    code, out, _ = run(capsys, "scan", str(plugin), "--vllm", release, "--json")
    doc = json.loads(out)
    assert code == 1 and [s["status"] for s in doc["sites"]] == ["affected"]
    assert "half fix" in doc["sites"][0]["reason"]
    assert "the metadata builders" in doc["vllm_context"]["read"]
    code, out, err = run(capsys, "apply", str(plugin), "--vllm", release)
    assert code == 0, err
    assert "force_uniform_decode=False" in (plugin / runner).read_text()
    row = next(ln for ln in out.splitlines() if ln.startswith(runner))
    assert row.split()[-3:] == ["affected", "fixed", "yes"]


LAYER = """\
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)


class HwGatedDeltaNet(QwenGatedDeltaNetAttention):
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        self._hw_prepare()
        return super()._forward_core(mixed_qkv, b, a, core_attn_out)


class HwInherits(QwenGatedDeltaNetAttention):
    def _hw_prepare(self):
        pass


class HwOwnCore(QwenGatedDeltaNetAttention):
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        return self._hw_core(mixed_qkv, b, a, core_attn_out)
"""


@pytest.mark.parametrize(("version", "noted"), [("0.25.1", True), ("0.31.0", False)])
def test_a_plugin_layer_running_vllms_forward_core_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str, noted: bool
) -> None:
    """pr51812 through inheritance: a subclass handing on to (or inheriting)
    vLLM's ``_forward_core`` runs vLLM's site; the plugin has none of its
    own (exit 0) and the note names the vLLM's. Fails on the code before:
    "no GDN spec path" and nothing more. A class with its own core is not
    named (its own code is what runs)."""
    plugin = tmp_path / "plug"
    (plugin / "vllm_hw").mkdir(parents=True)
    (plugin / "vllm_hw" / "gdn.py").write_text(LAYER)
    release = sources.release_tree(version)
    code, out, _ = run(capsys, "scan", str(plugin), "--vllm", str(release))
    notes = [ln for ln in out.splitlines() if ln.startswith("note: pr51812:")]
    assert code == 0 and "QwenGatedDeltaNetAttention (a base class)" in out
    if not noted:
        assert notes == []
        return
    assert len(notes) == 2, notes
    assert (
        "HwGatedDeltaNet._forward_core hands on to QwenGatedDeltaNetAttention._forward_core"
        in notes[0]
    )
    assert "HwInherits._forward_core inherits" in notes[1]
    assert all("qwen_gdn_linear_attn.py" in n and ", affected: " in n for n in notes)
    code, out, _ = run(capsys, "scan", str(plugin), "--vllm", str(release), "--json")
    assert json.loads(out)["vllm_context"]["notes"] == notes


def test_commit_of_a_plugin_repository_reads_the_same_vllm(
    tmp_path: Path,
    patched_v1: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.test_gitflow import make_repo

    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    plugin = _plugin(tmp_path)
    repo = make_repo(plugin)
    code, out, err = run(capsys, "apply", "--commit", str(plugin), "--vllm", str(patched_v1))
    assert code == 0, err
    assert "vllm read: " in out and repo.active_branch.name == "gdn-backport/pr51565"
    assert "treat_short_extends_as_decodes=False" in repo.git.show("HEAD")
