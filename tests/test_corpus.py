"""The mutation corpus (:mod:`tests.corpus`) on real releases from PyPI.

Variants of the real ``_forward_core`` of 0.18.1, 0.21.0 and 0.27.1 (one per
layout), generated here at test time, each with its expected outcome per
strategy. CI keeps to a few minutes: every variant goes through scan and
apply with the gather strategy, and the ones where it matters with the
kernel strategy, each on one release (rotating over the layouts); a
representative subset per layout (:data:`CI_VERIFY`) runs the regression
suite on CPU. The whole corpus, every case on every release with
every patched variant verified, is ``bench/bench_corpus.py``.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest

from gdn_backport import sources
from tests import corpus
from tests.corpus import LAYOUTS, STRATEGIES, VARIANTS, CaseResult, Expect

pytestmark = pytest.mark.network

# Scenarios every verified case must pass: the PR's layout (non-spec before
# spec: the bug shows) and pure spec (the fast path, zero-copy).
SCENARIOS = ("pr_layout", "pure_spec")


# Verified in CI: per layout the release with one strategy and two fork
# shapes (one hand-fixed variant, whose "fixed" verdict is checked too).
CI_VERIFY = (
    ("0.18.1", "release", "gather"),
    ("0.18.1", "positional_args", "gather"),
    ("0.18.1", "fixed_ifexp", "gather"),
    ("0.21.0", "release", "kernel"),
    ("0.21.0", "one_gate_gathered", "gather"),
    ("0.21.0", "import_alias", "gather"),
    ("0.27.1", "release", "gather"),
    ("0.27.1", "no_fast_path", "gather"),
    ("0.27.1", "rename_gates", "kernel"),
    # The spec path through helpers and fork kernels (issue 12).
    ("0.27.1", "helper_positional", "gather"),
    ("0.27.1", "two_levels", "gather"),
    ("0.21.0", "imported_helper", "gather"),
    ("0.18.1", "fork_kernel_declared", "gather"),
    ("0.27.1", "none_guard", "gather"),
    # Gates staged through None-initialised locals, gathered before the call
    # (issue 24): the regression suite runs the patched layer.
    ("0.27.1", "staged_gates", "gather"),
    ("0.21.0", "identity_index", "gather"),
    ("0.27.1", "helper_fixed", "gather"),
)

# Chain variants that must fail the PR's layout unpatched on the real
# kernels: the patched results above prove something only if so.
CI_NEGATIVE = (
    ("0.27.1", "helper_reads_metadata"),
    ("0.21.0", "imported_helper"),
    ("0.18.1", "fork_kernel_declared"),
)


# The kernel strategy costs three times the gather one (its import edit
# visits the whole module): in CI it runs on the variants where it takes
# another path than gather (call forms, index forms, half-done fixes).
CI_KERNEL = (
    "positional_args",
    "import_alias",
    "module_alias",
    "local_alias",
    "no_fast_path",
    "fancy_index",
    "one_gate_gathered",
    "fixed_renamed",
    "inline_gate_gather",
    "wrapper_function",
    "untraceable_index",
)


def _ci_cases() -> list[tuple[str, str, str]]:
    """Every variant with the gather strategy and the CI_KERNEL ones with the
    kernel strategy, each on one release (rotating over the layouts), the
    release itself on every layout, and the verified cases."""
    cases = []
    for i, var in enumerate(VARIANTS):
        cases.append((LAYOUTS[i % len(LAYOUTS)].version, var.name, "gather"))
        if var.name in CI_KERNEL:
            cases.append((LAYOUTS[(i + 1) % len(LAYOUTS)].version, var.name, "kernel"))
    for lay in LAYOUTS:
        for strategy in STRATEGIES:
            cases.append((lay.version, "release", strategy))
    cases.extend(CI_VERIFY)
    return list(dict.fromkeys(cases))


CI_CASES = _ci_cases()


@functools.cache
def _original(version: str) -> str:
    lay = corpus.layout(version)
    return (sources.release_tree(version) / lay.path).read_text(encoding="utf-8")


@functools.cache
def _source(version: str, name: str) -> str:
    """A variant's text, generated once per test session."""
    return corpus.variant_source(_original(version), corpus.layout(version), corpus.variant(name))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A slim copy of each layout's release, made once per module."""
    root = tmp_path_factory.mktemp("corpus")
    return {lay.version: corpus.slim_tree(lay.version, root / lay.version) for lay in LAYOUTS}


def _can_verify() -> bool:
    """Triton runs the kernels here (under the interpreter on CPU)."""
    from gdn_backport.verify import triton_problem

    problem = triton_problem()
    if problem:
        # CI installs a Triton that runs the kernels: there, never skip.
        if os.environ.get("GDN_BACKPORT_REQUIRE_TRITON") == "1":
            pytest.fail(problem)
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _verify_scenarios(case: tuple[str, str, str]) -> tuple[str, ...] | None:
    if case not in CI_VERIFY or not _can_verify():
        return None
    return SCENARIOS


@pytest.mark.parametrize(
    ("version", "name", "strategy"), CI_CASES, ids=[f"{v}-{n}-{s}" for v, n, s in CI_CASES]
)
def test_variant(
    version: str,
    name: str,
    strategy: str,
    bases: dict[str, Path],
    tmp_path: Path,
) -> None:
    var = corpus.variant(name)
    result = corpus.run_case(
        bases[version],
        corpus.layout(version),
        var,
        strategy,
        tmp_path,
        verify=_verify_scenarios((version, name, strategy)),
        source=_source(version, name),
    )
    assert not result.problems, result.problems
    assert result.got == var.expect(strategy).outcome


@pytest.mark.parametrize(("version", "name"), CI_NEGATIVE, ids=[f"{v}-{n}" for v, n in CI_NEGATIVE])
def test_chain_variant_fails_unpatched(
    version: str, name: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    if (
        _verify_scenarios((version, "release", "gather" if version != "0.21.0" else "kernel"))
        is None
    ):
        pytest.skip("no Triton that runs the kernels here")
    failed, notes = corpus.unpatched_fails(
        bases[version], corpus.layout(version), corpus.variant(name), tmp_path
    )
    assert failed, notes


def test_every_variant_applies_to_every_layout() -> None:
    """Each transformation finds its anchors in every layout, changes the
    source, and the result parses; no vLLM source is kept anywhere."""
    for lay in LAYOUTS:
        seen: set[tuple[str, str]] = set()
        for var in VARIANTS:
            text, files = corpus.variant_files(_original(lay.version), lay, var)
            ast.parse(text)
            assert (text == _original(lay.version)) == (var.name == "release"), var.name
            key = (text, repr(sorted(files.items())))
            assert key not in seen, f"{var.name} duplicates another variant"
            seen.add(key)


def test_expectations_are_complete() -> None:
    names = [v.name for v in VARIANTS]
    assert len(names) == len(set(names))
    outcomes = {v.expect(s).outcome for v in VARIANTS for s in STRATEGIES}
    assert outcomes == {"patched", "fixed", "refused"}
    for v in VARIANTS:
        for s in STRATEGIES:
            e = v.expect(s)
            assert (e.outcome == "refused") == bool(e.reason), (v.name, s)
    # The CI subset runs every variant, both strategies on every layout, and
    # verifies patched (or fixed) cases on every layout.
    assert {n for _, n, _ in CI_CASES} == set(names)
    assert {(v, s) for v, _, s in CI_CASES} == {
        (lay.version, s) for lay in LAYOUTS for s in STRATEGIES
    }
    for _, name, strategy in CI_VERIFY:
        assert corpus.variant(name).expect(strategy).outcome != "refused"
    assert {v for v, _, _ in CI_VERIFY} == {lay.version for lay in LAYOUTS}


def test_counts_table_counts_wrong_cases() -> None:
    def case(got: str, verified: bool | None, problems: list[str]) -> CaseResult:
        r = CaseResult("0.27.1", "v", "gather", Expect(got), got=got, verified=verified)
        r.problems.extend(problems)
        return r

    results = [
        case("patched", True, []),
        case("patched", None, []),
        case("fixed", None, []),
        case("refused", None, []),
        case("patched", False, ["WRONG PATCH: verify failed"]),
    ]
    text = corpus.counts_table(results)
    gather = next(line for line in text.splitlines() if line.startswith("gather"))
    assert gather.split() == ["gather", "5", "1", "1", "1", "1", "1"]
    assert "WRONG PATCH" in corpus.render(results)
