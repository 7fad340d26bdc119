"""pr51565's fast paths give the answers of the slow ones (no timings asserted):
the sieve before parsing, the proof's reuse of the plan's analyses."""

from __future__ import annotations

import ast
import functools
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from gdn_backport.patchsets.pr51565 import scan
from gdn_backport.patchsets.pr51565.analysis import Finding, analyse_module
from gdn_backport.patchsets.pr51565.codemods import examples
from gdn_backport.patchsets.pr51565.config import Config, load
from gdn_backport.pipeline import Mode
from gdn_backport.tree import Tree
from tests import test_prior_state as prior

# A backend's builder: it classifies with the split function but fills no
# GDN field (most of a release's modules that name the split function).
OTHER_BACKEND = """
from vllm.attn.utils import split_decodes_and_prefills

class FlashBuilder:
    def build(self, common_prefix_len, common):
        nd, np_, ndt, npt = split_decodes_and_prefills(common, decode_threshold=1)
        return FlashMeta(num_decodes=nd)
"""

INSTALLED = """
from vllm.attn import GDNAttentionMetadataBuilder
def _device_build(self, prefix, common):
    return my_ops.build_gdn_metadata(common)
def register():
    GDNAttentionMetadataBuilder . build=_device_build
"""


def _modules() -> dict[str, str]:
    """Every module text the pr51565 tests and examples judge, and spellings
    the sieve must not lose (odd spacing, a non-ASCII identifier that reads
    as an ASCII one)."""
    texts = {
        name: textwrap.dedent(value).lstrip()
        for source in (prior, examples)
        for name, value in vars(source).items()
        if isinstance(value, str) and "def " in value and name.isupper()
    }
    texts["OTHER_BACKEND"] = OTHER_BACKEND
    texts["INSTALLED"] = INSTALLED
    texts["INSTALLED_CONTINUED"] = INSTALLED.replace(" . build=", ".\\\n    build =")
    texts["DEF_SPACED"] = prior.BUILDER.replace("def build", "def  build")
    # NFKC reads a fullwidth b (U+FF42) as "b".
    texts["NFKC_METHOD"] = prior.BUILDER.replace("def build", "def \uff42uild")
    texts["NFKC_FIELD"] = INSTALLED.replace(
        "GDNAttentionMetadataBuilder . build", "B.build"
    ).replace("build_gdn_metadata(common)", "f(non_spec_state_indices_tens\uff4fr=common)")
    return texts


@pytest.mark.parametrize("name", sorted(_modules()))
def test_the_sieve_drops_no_module_with_a_site(name: str) -> None:
    text = _modules()[name]
    try:
        tree = ast.parse(text)
    except SyntaxError:
        pytest.skip("not a module (a fragment of one)")
    found = analyse_module(tree, text, load())
    kept = scan.sieve(load())(text.encode(), lambda: text)
    assert kept or not found, found


def test_the_sieve_keeps_what_the_analysis_needs_and_drops_other_backends() -> None:
    may_hold = scan.sieve(load())
    modules = _modules()
    for name in ("INSTALLED", "INSTALLED_CONTINUED", "DEF_SPACED", "NFKC_METHOD", "NFKC_FIELD"):
        text = modules[name]
        assert analyse_module(ast.parse(text), text, load()), name
        assert may_hold(text.encode(), functools.partial(str, text)), name
    assert not may_hold(OTHER_BACKEND.encode(), lambda: OTHER_BACKEND)


def test_a_backend_that_fills_no_gdn_field_is_not_parsed(tmp_path: Path) -> None:
    """The scan reads the tree's modules naming the split function and parses
    only those that may hold a site (it parsed every one of them)."""
    root = prior._tree(tmp_path)
    prior._write(root, {"vllm/attn/flash.py": OTHER_BACKEND})
    texts = scan._texts(Tree.of(root), root)
    names = sorted(p.relative_to(root).as_posix() for p in texts)
    assert names == ["vllm/attn/fancy.py", "vllm/worker/gpu/runner2.py", "vllm/worker/runner.py"]


def test_the_proof_analyses_again_only_what_it_rewrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A builder with no decodes: a site, not rewritten.
    done = prior.BUILDER.replace("FancyBuilder", "DoneBuilder").replace(
        "decode_threshold=1", "decode_threshold=0"
    )
    root = prior._tree(tmp_path)
    prior._write(root, {"vllm/attn/done.py": done})
    seen: Counter[str] = Counter()
    real = scan.analyse_module

    def counted(tree: ast.Module, text: str, cfg: Config) -> list[Finding]:
        seen[text] += 1
        return real(tree, text, cfg)

    monkeypatch.setattr(scan, "analyse_module", counted)
    tree = Tree.of(root)
    from gdn_backport.patchsets.pr51565 import plan

    result = plan.plan(tree, "reclassify", Mode.DRY_RUN)
    assert result.outcome.refused == []
    assert set(result.texts) == {
        root / "vllm/attn/fancy.py",
        root / "vllm/worker/runner.py",
        root / "vllm/worker/gpu/runner2.py",
    }
    assert seen[(root / "vllm/attn/done.py").read_text()] == 1
    assert all(seen[text] == 1 for text in result.texts.values())
    assert sum(seen.values()) == 4 + 3


def test_partial_keeps_the_text_lazy() -> None:
    """The sieve decodes a module only where its bytes are not ASCII."""
    calls: list[int] = []

    def text() -> str:
        calls.append(1)
        return OTHER_BACKEND

    scan.sieve(load())(OTHER_BACKEND.encode(), functools.partial(text))
    assert calls == []


def test_the_v1_route_is_looked_for_only_in_methods_naming_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every method of an 8,000-line runner was walked for the dispatch
    call; now only those whose lines name it (in NFKC form: a fullwidth
    letter spells the same name)."""
    from gdn_backport.patchsets.pr51565 import analysis

    walked: list[str] = []
    real = analysis._v1_calls

    def counted(qual: str, fn: ast.FunctionDef, cfg: Config) -> object:
        walked.append(qual)
        return real(qual, fn, cfg)

    monkeypatch.setattr(analysis, "_v1_calls", counted)
    text = examples.V1_RUNNER
    plain = analyse_module(ast.parse(text), text, load())
    assert [f.function for f in plain] == ["GPUModelRunner.execute_model"]
    named = {
        q for q, fn in analysis._methods(ast.parse(text)) if "_determine_batch" in ast.unparse(fn)
    }
    assert "GPUModelRunner._update_states" not in named
    assert sorted(walked) == sorted(named)
    walked.clear()
    # U+FF44, a fullwidth d, reads as "d".
    wide = text.replace(
        "self._determine_batch_execution_and_padding(\n",
        "self._\uff44etermine_batch_execution_and_padding(\n",
    )
    assert wide != text
    found = analyse_module(ast.parse(wide), wide, load())
    assert [(f.function, f.status) for f in found] == [(f.function, f.status) for f in plain]


@pytest.mark.parametrize(
    ("disk", "rewritten", "unaffected"),
    [
        # A GDN layer another patchset rewrote: neither text is read.
        ("def f(a):\n    return a\n", "def f(a):\n    return a[idx]\n", True),
        # The rewrite names what the plan reads: a builder's split and field.
        (
            "def f(a):\n    return a\n",
            OTHER_BACKEND.replace("num_decodes=nd", "non_spec_state_indices_tensor=nd"),
            False,
        ),
        # Read as it is on disk (the plan made ahead saw it).
        (
            OTHER_BACKEND.replace("num_decodes=nd", "non_spec_state_indices_tensor=nd"),
            "def f(a):\n    return a\n",
            False,
        ),
        # The facts' definitions (tree_facts reads them).
        ("def f(a):\n    return a\n", "class CommonAttentionMetadata:\n    x: int\n", False),
    ],
)
def test_a_plan_is_unaffected_only_by_files_its_sieves_reject_both_ways(
    tmp_path: Path, disk: str, rewritten: str, unaffected: bool
) -> None:
    """``pipeline`` keeps pr51565's plan made ahead (on the tree as the run
    found it) only where an earlier patchset's rewrite cannot change it."""
    from gdn_backport.patchsets.pr51565.plan import unaffected_by

    file = tmp_path / "m.py"
    assert unaffected_by({file: (disk.encode(), rewritten)}) is unaffected


def test_the_plan_and_its_proof_sieve_each_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proof reads the tree again: its sieve is the plan's (it sieved
    every module twice)."""
    root = prior._tree(tmp_path)
    prior._write(root, {"vllm/attn/flash.py": OTHER_BACKEND})
    seen: Counter[bytes] = Counter()
    real = scan.sieve

    def counted(cfg: Config) -> object:
        may_hold = real(cfg)

        def each(data: bytes, text: object) -> bool:
            seen[data] += 1
            return may_hold(data, text)  # type: ignore[arg-type]

        return each

    monkeypatch.setattr(scan, "sieve", counted)
    from gdn_backport.patchsets.pr51565 import plan

    result = plan.plan(Tree.of(root), "reclassify", Mode.DRY_RUN)
    assert result.outcome.refused == [] and result.texts
    on_disk = sorted(p.read_bytes() for p in root.rglob("*.py"))
    assert sorted(seen) == on_disk
    assert set(seen.values()) == {1}
