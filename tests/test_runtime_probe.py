"""The reachability probe (``GDN_BACKPORT_PROBE=1``): classification, wrapping,
reporting, and agreement with each release's own metadata builder.

The unit tests drive a builder written here. The ``network`` tests load the
real ``GDNAttentionMetadataBuilder`` of a release through the harness's
stand-ins, wrap it, build metadata for named layouts (and random ones), and
compare the probe's counts with what the builder itself produced: the
gather branch taken, and ``spec_token_indx`` different from ``0..n-1``.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import inspect
import itertools
import json
import logging
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_backport import matrix
from gdn_backport.patchsets.pr51565.probe import new_row_decodes
from gdn_backport.patchsets.pr51812.probe import Layout, classify
from gdn_backport.patchsets.pr51812.scenarios import EXTRA_SCENARIOS, SCENARIOS
from gdn_backport.runtime import hook, probe
from gdn_backport.runtime.probe import Probe, ProbeCounts, wrap_builder
from gdn_backport.site import Status
from tests.harness_fixtures import release_tree

# -- layouts ---------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A batch as the model runner hands it to the builder: per row the
    query length and the draft count (-1: not a spec row)."""

    name: str
    lens: tuple[int, ...]
    drafts: tuple[int, ...]
    mixed: bool
    not_prefix: bool

    def query_start_loc(self) -> torch.Tensor:
        out = torch.zeros(len(self.lens) + 1, dtype=torch.int32)
        out[1:] = torch.tensor(self.lens, dtype=torch.int32).cumsum(0)
        return out


def S(n: int) -> tuple[int, int]:  # a spec row of n tokens (n - 1 drafts)
    return (n, n - 1)


def N(n: int) -> tuple[int, int]:  # a non-spec row of n tokens
    return (n, -1)


def case(name: str, *rows: tuple[int, int], mixed: bool, not_prefix: bool) -> Case:
    return Case(name, tuple(r[0] for r in rows), tuple(r[1] for r in rows), mixed, not_prefix)


CASES = (
    case("pure_spec", S(3), S(3), mixed=False, not_prefix=False),
    case("pure_decode", N(1), N(1), mixed=False, not_prefix=False),
    case("pure_prefill", N(5), N(7), mixed=False, not_prefix=False),
    case("pr_layout", N(1), S(3), mixed=True, not_prefix=True),  # upstream PR's layout
    case("prefill_chunk_first", N(10), S(3), mixed=True, not_prefix=True),
    case("spec_first", S(3), N(5), mixed=True, not_prefix=False),
    case("interleaved_snns", S(3), N(1), N(4), S(3), mixed=True, not_prefix=True),
    case("interleaved_nssn", N(2), S(3), S(3), N(1), mixed=True, not_prefix=True),
    case("spec_then_padding", S(3), S(3), N(0), mixed=False, not_prefix=False),
    case("padding_is_not_a_token", S(3), N(0), S(2), N(4), mixed=True, not_prefix=False),
    case("fewer_drafts", N(1), S(2), mixed=True, not_prefix=True),
)
NUM_SPEC = 2  # spec rows of CASES have at most 3 tokens


@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_classify_layouts(c: Case) -> None:
    assert classify(c.query_start_loc(), torch.tensor(c.drafts)) == Layout(c.mixed, c.not_prefix)
    # Plain sequences (recorded metadata) classify the same.
    assert classify(c.query_start_loc().tolist(), list(c.drafts)) == Layout(c.mixed, c.not_prefix)


def test_classify_refuses_device_tensors_and_mismatched_rows() -> None:
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    drafts = torch.tensor([-1, 2])
    with pytest.raises((TypeError, NotImplementedError, RuntimeError)):
        classify(qsl.to("meta"), drafts)
    with pytest.raises((TypeError, NotImplementedError, RuntimeError)):
        classify(qsl, drafts.to("meta"))
    with pytest.raises(ValueError, match="rows"):
        classify(qsl, torch.tensor([-1, 2, 2]))


# -- a builder written here ---------------------------------------------------

BUILD_RESULT = object()


class FakeBuilder:
    """``build`` with vLLM's signature; returns a fixed object, reads nothing."""

    use_spec_decode = True
    calls = 0

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        num_accepted_tokens: Any = None,
        num_decode_draft_tokens_cpu: Any = None,
        fast_build: bool = False,
    ) -> Any:
        type(self).calls += 1
        return BUILD_RESULT


def fresh_builder() -> type[FakeBuilder]:
    return type("Builder", (FakeBuilder,), {"build": FakeBuilder.build, "calls": 0})


def host_only(c: Case) -> Any:
    """CommonAttentionMetadata-like: host tensors real, device tensors on
    ``meta``, where any read of a value (.item(), .tolist(), .cpu(), numpy)
    raises, which the probe would count as an error."""
    qsl = c.query_start_loc()
    return types.SimpleNamespace(
        query_start_loc=qsl.to("meta"),
        query_start_loc_cpu=qsl,
        seq_lens=torch.empty(len(c.lens), device="meta"),
        block_table_tensor=torch.empty(len(c.lens), 4, device="meta"),
        num_reqs=len(c.lens),
        num_actual_tokens=sum(c.lens),
    )


def build_case(builder: Any, c: Case, positional: bool = False) -> Any:
    m = host_only(c)
    accepted = torch.ones(len(c.lens), device="meta")
    drafts = torch.tensor(c.drafts, dtype=torch.int32)
    if positional:
        return builder.build(0, m, accepted, drafts)
    return builder.build(
        common_prefix_len=0,
        common_attn_metadata=m,
        num_accepted_tokens=accepted,
        num_decode_draft_tokens_cpu=drafts,
    )


def test_wrapper_counts_every_layout_from_host_tensors_only() -> None:
    cls, p = fresh_builder(), Probe(every=0)
    assert wrap_builder(cls, p)
    builder = cls()
    for i, c in enumerate(CASES):
        assert build_case(builder, c, positional=i % 2 == 0) is BUILD_RESULT
    assert cls.calls == len(CASES)
    assert p.counts() == ProbeCounts(
        builds=len(CASES),
        mixed=sum(c.mixed for c in CASES),
        spec_not_prefix=sum(c.not_prefix for c in CASES),
        errors=0,
    )


def test_spec_decoding_off_or_no_drafts_is_never_mixed() -> None:
    cls, p = fresh_builder(), Probe(every=0)
    wrap_builder(cls, p)
    pr = CASES[3]
    off = cls()
    off.use_spec_decode = False
    build_case(off, pr)
    cls().build(0, host_only(pr), None, None)  # no draft counts: no spec rows
    # Every spec row drafted nothing: 0.18-0.31 treat the batch as non-spec.
    zero = Case("zero_drafts", (1, 1), (-1, 0), False, False)
    build_case(cls(), zero)
    assert p.counts() == ProbeCounts(builds=3)


def test_builder_counts_decide_the_branch_when_the_metadata_has_them() -> None:
    """A release that runs the spec path for zero-draft batches (0.29+)
    returns num_spec_decodes > 0: the probe follows the builder, not the
    older rule."""

    class CountsBuilder(FakeBuilder):
        def build(
            self,
            common_prefix_len: int,
            common_attn_metadata: Any,
            num_accepted_tokens: Any = None,
            num_decode_draft_tokens_cpu: Any = None,
            fast_build: bool = False,
        ) -> Any:
            return types.SimpleNamespace(num_spec_decodes=1, num_prefills=1, num_decodes=0)

    p = Probe(every=0)
    wrap_builder(CountsBuilder, p)
    build_case(CountsBuilder(), Case("zero_drafts", (1, 1), (-1, 0), False, False))
    assert p.counts() == ProbeCounts(builds=1, mixed=1, spec_not_prefix=1)


def test_wrap_is_idempotent_and_keeps_the_signature() -> None:
    cls, p = fresh_builder(), Probe(every=0)
    original = cls.__dict__["build"]
    assert wrap_builder(cls, p)
    wrapped = cls.__dict__["build"]
    assert wrap_builder(cls, p) and wrap_builder(cls)  # again, with another probe: no-op
    assert cls.__dict__["build"] is wrapped
    assert wrapped.__wrapped__ is original
    assert inspect.signature(cls.build) == inspect.signature(original)
    assert cls.build.__name__ == "build" and cls.build.__doc__ == original.__doc__
    build_case(cls(), CASES[3])
    assert p.counts().builds == 1 and cls.calls == 1
    assert probe.unwrap_builder(cls)
    assert cls.__dict__["build"] is original
    assert not probe.unwrap_builder(cls)


def test_wrapping_an_inherited_build_and_unwrapping_it() -> None:
    class Sub(FakeBuilder):
        pass

    p = Probe(every=0)
    assert wrap_builder(Sub, p)
    build_case(Sub(), CASES[3])
    assert p.counts() == ProbeCounts(builds=1, mixed=1, spec_not_prefix=1)
    assert FakeBuilder.__dict__["build"] is not Sub.__dict__["build"]  # parent untouched
    assert probe.unwrap_builder(Sub) and "build" not in Sub.__dict__


def test_builds_without_the_inputs_are_not_wrapped(caplog: pytest.LogCaptureFixture) -> None:
    class Other:
        def build(self, common_prefix_len: int, common_attn_metadata: Any) -> Any:
            return 1

    before = Other.__dict__["build"]
    with caplog.at_level(logging.WARNING, "gdn_backport.probe"):
        assert not wrap_builder(Other, Probe())
        assert not wrap_builder(type("NoBuild", (), {}), Probe())
    assert Other.__dict__["build"] is before
    assert "num_decode_draft_tokens_cpu" in caplog.text


def test_probe_errors_are_counted_logged_once_and_never_change_the_result(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cls, p = fresh_builder(), Probe(every=0)
    wrap_builder(cls, p)
    b = cls()
    broken = types.SimpleNamespace()  # no query_start_loc_cpu
    device_only = types.SimpleNamespace(query_start_loc_cpu=CASES[3].query_start_loc().to("meta"))
    drafts = torch.tensor(CASES[3].drafts)
    with caplog.at_level(logging.INFO, "gdn_backport.probe"):
        assert b.build(0, broken, None, drafts) is BUILD_RESULT
        # Negative control for "host tensors only": a device tensor where the
        # probe reads is refused (an error), not read.
        assert b.build(0, device_only, None, drafts) is BUILD_RESULT
        assert build_case(b, CASES[3]) is BUILD_RESULT
    assert p.counts() == ProbeCounts(builds=3, mixed=1, spec_not_prefix=1, errors=2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "AttributeError" in warnings[0].getMessage()
    assert p.counts().line(pid=7).endswith(", 2 probe errors [pid 7]")


def test_the_builders_own_exceptions_pass_through_uncounted() -> None:
    err = KeyError("from the builder")

    class Failing(FakeBuilder):
        def build(
            self,
            common_prefix_len: int,
            common_attn_metadata: Any,
            num_accepted_tokens: Any = None,
            num_decode_draft_tokens_cpu: Any = None,
            fast_build: bool = False,
        ) -> Any:
            raise err

    p = Probe(every=0)
    assert wrap_builder(Failing, p)
    with pytest.raises(KeyError) as raised:
        build_case(Failing(), CASES[3])
    assert raised.value is err
    assert p.counts() == ProbeCounts()


# -- reporting ---------------------------------------------------------------

LINE = re.compile(
    r"gdn-backport probe: (\d+) builds, (\d+) mixed \((\d+\.\d)/1000\), "
    r"(\d+) spec-not-prefix \((\d+\.\d\d)/1000\) \[pid \d+\]"
)


def test_line_format_and_rates() -> None:
    counts = ProbeCounts(builds=123456, mixed=2345, spec_not_prefix=63)
    assert counts.line(pid=1234) == (
        "gdn-backport probe: 123456 builds, 2345 mixed (19.0/1000), "
        "63 spec-not-prefix (0.51/1000) [pid 1234]"
    )
    assert ProbeCounts().line(pid=1) == (
        "gdn-backport probe: 0 builds, 0 mixed (0.0/1000), 0 spec-not-prefix (0.00/1000) [pid 1]"
    )


def test_logs_every_n_builds_and_once_at_exit(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    cls, p = fresh_builder(), Probe(every=4, json_path=str(tmp_path / "probe.jsonl"))
    wrap_builder(cls, p)
    b = cls()
    with caplog.at_level(logging.INFO, "gdn_backport.probe"):
        for c in CASES[:9]:  # 9 builds: lines at 4 and 8
            build_case(b, c)
        periodic = [LINE.fullmatch(r.getMessage()) for r in caplog.records]
        p.report_at_exit()
        p.report_at_exit()  # once only
    assert [m and m.group(1) for m in periodic] == ["4", "8"]
    final = LINE.fullmatch(caplog.records[-1].getMessage())
    assert final is not None and len(caplog.records) == 3
    expected = CASES[:9]
    assert final.groups()[:2] == ("9", str(sum(c.mixed for c in expected)))
    assert final.group(4) == str(sum(c.not_prefix for c in expected))
    records = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert [(r["builds"], r["final"]) for r in records] == [(4, False), (8, False), (9, True)]
    assert set(records[-1]) == {
        "pid",
        "time",
        "final",
        "builds",
        "mixed",
        "spec_not_prefix",
        "errors",
        "new_row_decodes",
    }


def _meta(lens: list[int], **fields: list[int]) -> Any:
    starts = [0, *itertools.accumulate(lens)]
    m = types.SimpleNamespace(query_start_loc_cpu=torch.tensor(starts))
    for name, values in fields.items():
        setattr(m, name, torch.tensor(values))
    return m


def test_new_row_decodes_vllm_51565() -> None:
    """A row without prior state classified as a decode is counted; a
    resumed chunk, a capture dummy (not prefilling) and a new row the
    builder made a prefill are not."""
    decodes = types.SimpleNamespace(num_decodes=2, num_prefills=1, num_spec_decodes=0)
    # rows: a decode (seq 10), a new one-token prompt (seq 1), an 8-token prefill
    new = _meta([1, 1, 8], seq_lens_cpu_upper_bound=[10, 1, 8], is_prefilling=[0, 1, 1])
    assert new_row_decodes(new, decodes, None)
    resumed = _meta([1, 1, 8], seq_lens_cpu_upper_bound=[10, 6, 8], is_prefilling=[0, 1, 1])
    assert not new_row_decodes(resumed, decodes, None)
    capture = _meta([1, 1, 1], seq_lens_cpu_upper_bound=[1, 1, 1], is_prefilling=[0, 0, 0])
    all_decodes = types.SimpleNamespace(num_decodes=3, num_prefills=0, num_spec_decodes=0)
    assert not new_row_decodes(capture, all_decodes, None)
    fixed = types.SimpleNamespace(num_decodes=1, num_prefills=2, num_spec_decodes=0)
    assert not new_row_decodes(new, fixed, None)
    # Older metadata: computed tokens, no is_prefilling; beside spec rows
    # (before 0.18 one-token non-spec rows there stayed decodes).
    old = _meta([4, 1], num_computed_tokens_cpu=[7, 0])
    spec = types.SimpleNamespace(num_decodes=1, num_prefills=0, num_spec_decodes=1)
    assert new_row_decodes(old, spec, torch.tensor([3, -1]))
    # No prior-state field (a fork): not counted.
    assert not new_row_decodes(_meta([4, 1]), spec, torch.tensor([3, -1]))


def test_nothing_at_exit_without_builds(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "gdn_backport.probe"):
        Probe().report_at_exit()
    assert not caplog.records


# -- install_from_env ----------------------------------------------------------


@pytest.fixture
def clean_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Probe]:
    """A fresh process-wide probe; the hook and atexit left as they were."""
    fresh = Probe()
    monkeypatch.setattr(probe, "PROBE", fresh)
    monkeypatch.setattr(probe, "_exit_registered", True)  # keep pytest's atexit clean
    for name in (probe.ENV_ON, probe.ENV_EVERY, probe.ENV_FILE):
        monkeypatch.delenv(name, raising=False)
    yield fresh
    probe.uninstall()


def fake_builder_module(monkeypatch: pytest.MonkeyPatch) -> type[FakeBuilder]:
    module = types.ModuleType(probe.BUILDER_MODULE)
    cls = fresh_builder()
    module.GDNAttentionMetadataBuilder = cls  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, probe.BUILDER_MODULE, module)
    return cls


@pytest.mark.parametrize("value", [None, "0", "", "true"])
def test_env_off_wraps_nothing(
    clean_probe: Probe, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is not None:
        monkeypatch.setenv(probe.ENV_ON, value)
    cls = fake_builder_module(monkeypatch)
    hooks = list(sys.meta_path)
    probe.install_from_env()
    assert "build" in cls.__dict__ and not hasattr(cls.build, "__wrapped__")
    assert sys.meta_path == hooks


def test_env_on_wraps_an_already_imported_builder(
    clean_probe: Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(probe.ENV_ON, "1")
    monkeypatch.setenv(probe.ENV_EVERY, "2")
    cls = fake_builder_module(monkeypatch)
    hooks = list(sys.meta_path)
    probe.install_from_env()
    probe.install_from_env()  # the plugin may run twice in one process
    assert sys.meta_path == hooks  # no import hook needed
    assert clean_probe.every == 2
    build_case(cls(), CASES[3])
    assert clean_probe.counts() == ProbeCounts(builds=1, mixed=1, spec_not_prefix=1)
    assert cls.calls == 1


def test_bad_every_falls_back_to_the_default(
    clean_probe: Probe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(probe.ENV_ON, "1")
    monkeypatch.setenv(probe.ENV_EVERY, "often")
    fake_builder_module(monkeypatch)
    probe.install_from_env()
    assert clean_probe.every == probe.DEFAULT_EVERY


# A stand-in vLLM written here: only the builder module's path matters.
FAKE_GDN_ATTN = """
class GDNAttentionMetadataBuilder:
    use_spec_decode = True

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False):
        return "metadata"
"""


def fake_vllm_site(tmp_path: Path) -> Path:
    """A directory with ``vllm/v1/attention/backends/gdn_attn.py`` = FAKE_GDN_ATTN."""
    pkg = tmp_path / "site" / "vllm" / "v1" / "attention" / "backends"
    pkg.mkdir(parents=True)
    for d in [pkg, *pkg.parents][:4]:
        (d / "__init__.py").write_text("")
    (pkg / "gdn_attn.py").write_text(FAKE_GDN_ATTN)
    return tmp_path / "site"


CHILD = """
import itertools, multiprocessing, sys, types
sys.path.insert(0, sys.argv[1])
from gdn_backport.runtime import hook, probe
probe.install_from_env()                       # before vLLM imports the builder
assert "vllm.v1.attention.backends.gdn_attn" not in sys.modules
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as B
assert getattr(B.build, "__gdn_backport_probe__", False)
assert not hook.watching(probe.WATCH)

def step(lens, drafts):                        # recorded metadata: plain lists
    m = types.SimpleNamespace(query_start_loc_cpu=[0, *itertools.accumulate(lens)])
    assert B().build(0, m, None, drafts) == "metadata"

def forked():
    step([1, 3], [-1, 2])
    sys.exit(0)                                # fork children leave through os._exit

for _ in range(3):
    step([1, 3], [-1, 2])                      # the PR's layout: mixed, not a prefix
    step([3, 5], [2, -1])                      # mixed, spec first
    step([3, 3], [2, 2])                       # pure spec
assert "torch" not in sys.modules              # the probe never needs it
ctx = multiprocessing.get_context("fork")
child = ctx.Process(target=forked)
child.start(); child.join()
assert child.exitcode == 0
"""


def test_import_hook_and_exit_lines_in_real_processes(tmp_path: Path) -> None:
    """End to end, in fresh interpreters: the hook wraps the builder when its
    module is first imported; periodic lines, the final line at exit (atexit)
    and in a forked child (multiprocessing's finalizers), and the JSON file."""
    site = fake_vllm_site(tmp_path)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {
        "GDN_BACKPORT_PROBE": "1",
        "GDN_BACKPORT_PROBE_EVERY": "4",
        "GDN_BACKPORT_PROBE_FILE": str(tmp_path / "probe.jsonl"),
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        [sys.executable, str(script), str(site)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [LINE.search(line) for line in done.stderr.splitlines()]
    counted = [(m.group(1), m.group(2), m.group(4)) for m in lines if m]
    # parent: every 4 builds (4, 8); the fork child, at its exit: its own one
    # build; then the parent at exit: 9.
    assert counted == [("4", "3", "2"), ("8", "6", "3"), ("1", "1", "1"), ("9", "6", "3")]
    assert "counting vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder.build" in (
        done.stderr
    )
    records = [json.loads(x) for x in (tmp_path / "probe.jsonl").read_text().splitlines()]
    finals = sorted((r["builds"], r["pid"] != records[0]["pid"]) for r in records if r["final"])
    assert finals == [(1, True), (9, False)]


# -- the release's own builder ---------------------------------------------------

BUILDER_FILE = ("vllm", "v1", "attention", "backends", "gdn_attn.py")
# One release per distinct gdn_attn.py source among the affected releases
# (test_representatives_cover_every_affected_builder checks it); 0.28.0, the
# first fixed one; 0.33.0, the newest, whose builder (from 0.32.0) keeps the
# spec path for a batch whose spec rows drafted nothing.
REPRESENTATIVES = (
    *("0.18.1", "0.21.0", "0.22.0", "0.23.0", "0.25.1", "0.26.0", "0.27.1"),
    *("0.28.0", "0.33.0"),
)


def _sha(tree: Path) -> str:
    return hashlib.sha256(tree.joinpath(*BUILDER_FILE).read_bytes()).hexdigest()


@pytest.mark.network
def test_representatives_cover_every_affected_builder() -> None:
    affected = [
        r.version
        for r in matrix.load().releases
        if (e := r.expectation("pr51812")) and e.status is Status.AFFECTED and not r.wheel_only
    ]
    assert "0.18.0" in affected and "0.27.1" in affected
    covered = {_sha(release_tree(v)) for v in REPRESENTATIVES}
    missing = [v for v in affected if _sha(release_tree(v)) not in covered]
    assert not missing, f"add a representative for {missing}"


class _Metadata(types.SimpleNamespace):
    """CommonAttentionMetadata's fields ``build`` reads, and its ``replace``."""

    def replace(self, **changes: Any) -> _Metadata:
        return _Metadata(**{**vars(self), **changes})


class RealBuilder:
    """A release's ``GDNAttentionMetadataBuilder``, loaded from its own file
    under the harness's stand-ins, made with ``object.__new__`` and the few
    attributes ``build`` reads. The block-table helper is the identity and
    ``split_decodes_and_prefills`` is the release's own function."""

    def __init__(self, version: str) -> None:
        from gdn_backport.harness.loader import LoadedTree, find_gdn_sites
        from gdn_backport.harness.standins import HarnessContext, _function_from_tree

        tree = release_tree(version)
        self.loaded = LoadedTree(
            tree=tree,
            site=find_gdn_sites(tree)[0],
            context=HarnessContext(tree, "cpu"),
            interpreted=False,
        )
        path = tree.joinpath(*BUILDER_FILE)
        with self.loaded.active():
            spec = importlib.util.spec_from_file_location(probe.BUILDER_MODULE, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        utils = tree / "vllm" / "v1" / "attention" / "backends" / "utils.py"
        namespace: dict[str, Any] = {"torch": torch, "CommonAttentionMetadata": Any}
        split = _function_from_tree(utils, "split_decodes_and_prefills", namespace)
        assert split is not None
        module.split_decodes_and_prefills = split  # type: ignore[attr-defined]
        module.mamba_get_block_table_tensor = lambda table, *rest: table  # type: ignore[attr-defined]
        self.cls: type = module.GDNAttentionMetadataBuilder
        # Does this builder fall back to all-non-spec when no spec row drafted
        # (0.18-0.31)? Read from its code, as the probe's host rule assumes.
        self.zero_draft_fallback = "[num_decode_draft_tokens_cpu >= 0]" in inspect.getsource(
            self.cls.build
        )
        self.probe = Probe(every=0)
        assert wrap_builder(self.cls, self.probe)
        self.builder = object.__new__(self.cls)
        self.builder.__dict__.update(
            use_spec_decode=True,
            num_spec=NUM_SPEC,
            kv_cache_spec=None,
            vllm_config=types.SimpleNamespace(
                cache_config=types.SimpleNamespace(mamba_cache_mode="none")
            ),
            use_full_cuda_graph=False,
            decode_cudagraph_max_bs=64,
            gdn_prefill_backend="triton",
            # 0.32+: prefix-caching checkpoints, off.
            checkpoint_builder=types.SimpleNamespace(build=lambda m, rows: None),
            plan_flashinfer_checkpoints=False,
        )

    def build(self, lens: tuple[int, ...], drafts: tuple[int, ...], num_spec: int) -> Any:
        """The wrapped build on CPU tensors; returns the builder's metadata."""
        self.builder.num_spec = num_spec
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
        query_lens = qsl.diff()
        seq_lens = query_lens + 7  # every row has some history
        m = _Metadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            seq_lens_cpu_upper_bound=seq_lens,
            num_reqs=len(lens),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(lens),
            block_table_tensor=torch.arange(len(lens) * (num_spec + 1), dtype=torch.int32).view(
                len(lens), num_spec + 1
            ),
            is_prefilling=None,
            compute_num_computed_tokens=lambda: seq_lens - query_lens,
        )
        accepted = torch.ones(len(lens), dtype=torch.int32)
        with self.loaded.active():
            return self.builder.build(
                common_prefix_len=0,
                common_attn_metadata=m,
                num_accepted_tokens=accepted,
                num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32),
            )


def truth(metadata: Any) -> Layout:
    """What the builder produced: the gather branch (spec and non-spec token
    indices both non-empty) and a spec_token_indx other than 0..n-1."""
    spec, nonspec = metadata.spec_token_indx, metadata.non_spec_token_indx
    if spec is None:
        return Layout(False, False)
    mixed = nonspec is not None and nonspec.numel() > 0
    arange = torch.arange(spec.numel(), dtype=spec.dtype)
    return Layout(mixed, not torch.equal(spec.cpu(), arange))


def check_agreement(
    real: RealBuilder, lens: tuple[int, ...], drafts: tuple[int, ...], k: int
) -> Layout:
    """The probe's count for one build equals the builder's own output."""
    before = real.probe.counts()
    expected = truth(real.build(lens, drafts, k))
    after = real.probe.counts()
    assert after.errors == 0
    assert after.builds == before.builds + 1
    got = Layout(
        bool(after.mixed - before.mixed), bool(after.spec_not_prefix - before.spec_not_prefix)
    )
    assert got == expected, (lens, drafts)
    # The host tensors alone agree too, under this builder's zero-draft rule.
    host = classify(torch.tensor([0, *lens]).cumsum(0), torch.tensor(drafts))
    if real.zero_draft_fallback and sum(d for d in drafts if d >= 0) == 0:
        host = Layout(False, False)
    assert host == expected, (lens, drafts)
    return expected


@pytest.fixture(scope="module", params=REPRESENTATIVES)
def real_builder(request: pytest.FixtureRequest) -> RealBuilder:
    return RealBuilder(request.param)


@pytest.mark.network
def test_probe_agrees_with_the_releases_own_builder(real_builder: RealBuilder) -> None:
    for c in CASES:
        assert check_agreement(real_builder, c.lens, c.drafts, NUM_SPEC) == Layout(
            c.mixed, c.not_prefix
        ), c.name
    # Every spec row drafted nothing: 0.18-0.31 build it as all non-spec, 0.32+
    # run the spec path (mixed, and here not a prefix). The probe follows both.
    zero_drafts = check_agreement(real_builder, (1, 1), (-1, 0), NUM_SPEC)
    fallback = real_builder.zero_draft_fallback
    assert zero_drafts == (Layout(False, False) if fallback else Layout(True, True))
    # The regression suite's layouts, step by step.
    for scenario in (*SCENARIOS, *EXTRA_SCENARIOS):
        for batch in scenario.steps:
            lens = tuple(r.query_len for r in batch.rows)
            drafts = tuple(r.query_len - 1 if r.spec else -1 for r in batch.rows)
            check_agreement(real_builder, lens, drafts, batch.num_spec)


@pytest.fixture(scope="module", params=("0.25.1", "0.33.0"))
def random_builder(request: pytest.FixtureRequest) -> RealBuilder:
    return RealBuilder(request.param)


@pytest.mark.network
@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.one_of(
            st.integers(0, 3).map(lambda d: (d + 1, d)),  # a spec row: 1 + d tokens
            st.tuples(st.integers(0, 9), st.just(-1)),  # non-spec, possibly padding
        ),
        min_size=1,
        max_size=8,
    ).filter(lambda rows: any(n > 0 for n, _ in rows))
)
def test_probe_agrees_with_the_builder_on_random_layouts(
    random_builder: RealBuilder, rows: list[tuple[int, int]]
) -> None:
    lens = tuple(n for n, _ in rows)
    drafts = tuple(d for _, d in rows)
    check_agreement(random_builder, lens, drafts, 3)


class AskEveryone(importlib.abc.MetaPathFinder):
    """A wrapping finder like the plugin's post-import hook: asks every
    other finder on sys.meta_path, before or after it."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] != "vllm":
            return None
        self.asked.append(fullname)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if finder is not self and find else None
            if spec is not None:
                return spec
        return None


@pytest.mark.parametrize("other_first", [True, False])
def test_import_hook_with_another_finder_that_asks_every_finder(
    clean_probe: Probe, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, other_first: bool
) -> None:
    monkeypatch.syspath_prepend(str(fake_vllm_site(tmp_path)))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # restored afterwards
    monkeypatch.setenv(probe.ENV_ON, "1")
    other = AskEveryone()
    if other_first:
        probe.install_from_env()
        sys.meta_path.insert(0, other)  # the plugin's order: its hook goes in last
    else:
        sys.meta_path.insert(0, other)
        probe.install_from_env()  # ours first: the other one asks ours back
    before = set(sys.modules)
    try:
        module = importlib.import_module(probe.BUILDER_MODULE)
        builder_cls = module.GDNAttentionMetadataBuilder
        assert getattr(builder_cls.build, "__gdn_backport_probe__", False)
        assert (
            builder_cls().build(
                0, types.SimpleNamespace(query_start_loc_cpu=[0, 1, 4]), None, [-1, 2]
            )
            == "metadata"
        )
    finally:
        for name in set(sys.modules) - before:
            del sys.modules[name]
    assert probe.BUILDER_MODULE in other.asked
    assert clean_probe.counts() == ProbeCounts(builds=1, mixed=1, spec_not_prefix=1)
    assert not hook.watching(probe.WATCH)


PLUGIN_LOGGING = """
import logging, sys, types
sys.path.insert(0, sys.argv[1])
# What the plugin does first: a handler on the package logger.
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("PLUGIN %(name)s %(message)s"))
logging.getLogger("gdn_backport").addHandler(handler)
logging.getLogger("gdn_backport").setLevel(logging.INFO)
from gdn_backport.runtime import probe
probe.install_from_env()
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder as B
B().build(0, types.SimpleNamespace(query_start_loc_cpu=[0, 1, 4]), None, [-1, 2])
"""


def test_lines_go_through_the_plugins_handler_once(tmp_path: Path) -> None:
    site = fake_vllm_site(tmp_path)
    script = tmp_path / "plugin_logging.py"
    script.write_text(PLUGIN_LOGGING)
    done = subprocess.run(
        [sys.executable, str(script), str(site)],
        env={"GDN_BACKPORT_PROBE": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no second handler of the probe's own
    final = [x for x in done.stdout.splitlines() if LINE.search(x)]
    assert len(final) == 1 and final[0].startswith(
        "PLUGIN gdn_backport.probe gdn-backport probe: 1 builds, 1 mixed"
    )
