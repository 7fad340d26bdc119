"""Patchset pr51565 (vLLM PR #51565): analysis, rewrite and proof.

Small trees written here (the shapes vLLM's builders and runners have, in
our own words) pin every verdict rule and every refusal; the release tests
patch real trees and run the builder suite on them: the three stale-state
scenarios fail on the unpatched release and pass on our rewrite.
"""

from __future__ import annotations

import ast
import textwrap
import types
from pathlib import Path

import pytest

from gdn_backport.patchsets.pr51565 import plan as engine
from gdn_backport.patchsets.pr51565.analysis import analyse_module, settle
from gdn_backport.patchsets.pr51565.config import load
from gdn_backport.pipeline import Mode, revert_tree
from gdn_backport.site import Site, Status
from tests.conftest import run

UTILS = """
from dataclasses import dataclass

@dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: object
    seq_lens_cpu_upper_bound: object = None
    is_prefilling: object = None

def split_decodes_and_prefills(common_attn_metadata, decode_threshold=1,
                               require_uniform=False, treat_short_extends_as_decodes=True):
    return 0, 0, 0, 0
"""

OLD_UTILS = """
from dataclasses import dataclass

@dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: object
    num_computed_tokens_cpu: object = None

def split_decodes_and_prefills(common_attn_metadata, decode_threshold=1):
    return 0, 0, 0, 0
"""

BUILDER = """
import torch
from dataclasses import dataclass
from vllm.attn.utils import split_decodes_and_prefills

@dataclass
class Meta:
    non_spec_state_indices_tensor: object = None

class FancyBuilder:
    def build(self, common_prefix_len, common, spec=None):
        m = common
        if spec is None:
            nd, np_, ndt, npt = (
                split_decodes_and_prefills(m, decode_threshold=1)
            )
        else:
            nd, np_, ndt, npt = 0, 1, 0, 4
        return Meta(non_spec_state_indices_tensor=None)
"""

V1_RUNNER = """
class Runner:
    def _reorder(self):
        return self.input_batch.num_computed_tokens_cpu

    def _is_uniform_decode(self, max_len, uniform_len, num_tokens, num_reqs, force=None):
        return (max_len == uniform_len) if force is None else force

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs,
                                               force_uniform_decode=None):
        return self._is_uniform_decode(1, 1, num_tokens, num_reqs, force_uniform_decode)

    def execute_model(self, scheduler_output):
        num_reqs = 3
        mode = self._determine_batch_execution_and_padding(
            num_tokens=3,
            num_reqs=num_reqs,
        )
        return mode

    def capture(self):
        return self._determine_batch_execution_and_padding(
            num_tokens=8, num_reqs=8, force_uniform_decode=True
        )
"""

V2_RUNNER = """
def get_uniform_token_count(num_reqs, num_toks, max_query_len):
    return max_query_len if num_toks == max_query_len * num_reqs else None

class Runner2:
    def execute_model(self, scheduler_output, dummy_run=False):
        count = get_uniform_token_count(2, 2, 1)
        return count
"""


def _write(root: Path, files: dict[str, str]) -> Path:
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text("")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def _tree(tmp_path: Path, utils: str = UTILS, **extra: str) -> Path:
    files = {
        "vllm/attn/utils.py": utils,
        "vllm/attn/fancy.py": BUILDER,
        "vllm/worker/runner.py": V1_RUNNER,
        "vllm/worker/gpu/runner2.py": V2_RUNNER,
    }
    files.update({k.replace("__", "/"): v for k, v in extra.items()})
    return _write(tmp_path / "tree", files)


def _verdicts(text: str) -> list[tuple[str, str, Status]]:
    found = analyse_module(ast.parse(textwrap.dedent(text)), textwrap.dedent(text), load())
    return [(f.kind, f.function, f.status) for f in settle(found)]


def _build(body: str) -> str:
    """A family builder whose build() runs ``body`` (split: the call)."""
    return (
        "from u import split_decodes_and_prefills\n"
        "class B:\n"
        "    def build(self, prefix, common):\n"
        "        m = common\n"
        + textwrap.indent(textwrap.dedent(body), "        ")
        + "        return X(non_spec_state_indices_tensor=None)\n"
    )


# -- the builder's verdict ----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status"),
    [
        # By length alone (every release up to 0.30.0).
        ("a, b, c, d = split_decodes_and_prefills(m, decode_threshold=1)\n", Status.AFFECTED),
        ("a, b, c, d = split_decodes_and_prefills(m)\n", Status.AFFECTED),
        # 0.31.0's rule, in other names.
        (
            """
            ql = m.query_start_loc_cpu.diff()
            fresh = (ql > 0) & (m.seq_lens_cpu_upper_bound <= ql)
            fresh &= m.is_prefilling
            a, b, c, d = split_decodes_and_prefills(
                m.replace(is_prefilling=fresh), treat_short_extends_as_decodes=False)
            """,
            Status.FIXED,
        ),
        # dataclasses.replace, and an older prior-state field.
        (
            """
            fresh = (m._num_computed_tokens_cpu == 0) & m.is_prefilling
            a, b, c, d = split_decodes_and_prefills(
                replace(m, is_prefilling=fresh), 1, treat_short_extends_as_decodes=False)
            """,
            Status.FIXED,
        ),
        # Mutants of the rule: never "fixed".
        *(
            (
                f"""
                ql = m.query_start_loc_cpu.diff()
                fresh = {rule}
                a, b, c, d = split_decodes_and_prefills(
                    m.replace(is_prefilling=fresh), treat_short_extends_as_decodes=False)
                """,
                Status.UNKNOWN,
            )
            for rule in (
                # no capture gate: capture dummies (seq_len == query_len) become prefills
                "(ql > 0) & (m.seq_lens_cpu_upper_bound <= ql)",
                # strict: never true, nothing is reclassified
                "(m.seq_lens_cpu_upper_bound < ql) & m.is_prefilling",
                "(m.seq_lens_cpu_upper_bound >= ql) & m.is_prefilling",
                "~(m.seq_lens_cpu_upper_bound <= ql) & m.is_prefilling",
                "(m.seq_lens_cpu_upper_bound <= ql) | m.is_prefilling",
                "(m._num_computed_tokens_cpu > 0) & m.is_prefilling",
                "(m._num_computed_tokens_cpu == 1) & m.is_prefilling",
            )
        ),
        # Every prompt chunk a prefill (the Mamba builders): safe.
        (
            "a, b, c, d = split_decodes_and_prefills(m, treat_short_extends_as_decodes=False)\n",
            Status.NOT_AFFECTED,
        ),
        ("a, b, c, d = split_decodes_and_prefills(m, decode_threshold=0)\n", Status.NOT_AFFECTED),
        # Replaced by a value that compares no prior-state field: cannot tell.
        (
            """
            a, b, c, d = split_decodes_and_prefills(
                m.replace(is_prefilling=m.query_start_loc_cpu.diff() > 4),
                treat_short_extends_as_decodes=False)
            """,
            Status.UNKNOWN,
        ),
        (
            "a, b, c, d = split_decodes_and_prefills(m, treat_short_extends_as_decodes=flag)\n",
            Status.UNKNOWN,
        ),
        # Fixed split, but a spec branch counting one-token rows by length
        # with no reset (0.10-0.17's shape): a new row there reads stale state.
        (
            """
            if spec:
                a = (m.ql == 1).sum()
            else:
                a, b, c, d = split_decodes_and_prefills(m, treat_short_extends_as_decodes=False)
            """,
            Status.UNKNOWN,
        ),
        (
            """
            if spec:
                a = (m.ql == 1).sum()
                if a > 0 and spec > 0:
                    a = 0
            else:
                a, b, c, d = split_decodes_and_prefills(m, treat_short_extends_as_decodes=False)
            """,
            Status.NOT_AFFECTED,
        ),
    ],
)
def test_builder_verdicts(body: str, status: Status) -> None:
    [(kind, function, found)] = _verdicts(_build(body))
    assert (kind, function, found) == ("builder", "B.build", status)


# The whole rule as releases 0.31-0.33 ship it (and our rewrite writes it),
# in our own names: a branch that classifies, a spec branch that sets the
# counts itself, query lengths derived twice (once per branch).
RULE = """
qsl = m.query_start_loc_cpu
if self.spec is None:
    ql = qsl.diff()
    fresh = (ql > 0) & (m.seq_lens_cpu_upper_bound <= ql)
    if m.is_prefilling is not None:
        fresh &= m.is_prefilling
    else:
        fresh = torch.zeros_like(fresh)
    a, b, c, d = split_decodes_and_prefills(
        m.replace(is_prefilling=fresh), decode_threshold=1, treat_short_extends_as_decodes=False
    )
    if b:
        b -= int((ql[a:] == 0).sum())
        d = int(qsl[a + b]) - c
else:
    ql = qsl[1:] - qsl[:-1]
    a, b, c, d = 0, len(ql), 0, int(ql.sum())
"""


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("", ""),  # as written
        ("ql = qsl.diff()", "ql = torch.diff(qsl)"),
        ("ql = qsl.diff()", "ql = qsl[1:] - qsl[:-1]"),
        ("(ql > 0)", "(ql >= 1)"),
        ("(ql > 0) & ", ""),
        ("(m.seq_lens_cpu_upper_bound <= ql)", "(ql >= m.seq_lens_cpu_upper_bound)"),
        ("decode_threshold=1, ", ""),  # the split's default
    ],
)
def test_the_fixed_rule_in_every_form_releases_use_is_fixed(old: str, new: str) -> None:
    assert old in RULE
    body = RULE.replace(old, new, 1) if old else RULE
    assert _verdicts(_build(body)) == [("builder", "B.build", Status.FIXED)]


# D5: each edit undoes the fix (a new one-token row is a decode again, or
# the counts say so), and each was reported fixed.
RULE_MUTANTS = [
    # One-token rows left out of the rule.
    ("(ql > 0)", "(ql > 1)"),
    ("(ql > 0)", "(ql >= 2)"),
    # Arithmetic on an operand: no longer the prior-state test.
    ("<= ql)", "<= ql + 100)"),
    ("<= ql)", "<= ql * 0)"),
    ("(m.seq_lens_cpu_upper_bound <= ql)", "(m.seq_lens_cpu_upper_bound - 5 <= ql)"),
    # The rule's value overwritten, whole or in part, before the split.
    (
        "        fresh = torch.zeros_like(fresh)\n    a, b",
        "        fresh = torch.zeros_like(fresh)\n    fresh = torch.zeros_like(fresh)\n    a, b",
    ),
    ("    if m.is_prefilling", "    fresh = torch.zeros_like(fresh)\n    if m.is_prefilling"),
    ("    if m.is_prefilling", "    fresh[:] = False\n    if m.is_prefilling"),
    ("    if m.is_prefilling", "    fresh.fill_(False)\n    if m.is_prefilling"),
    ("    if m.is_prefilling", "    fresh &= ql > 1\n    if m.is_prefilling"),
    ("    if m.is_prefilling", "    alias = fresh\n    alias[:] = False\n    if m.is_prefilling"),
    (
        "    if m.is_prefilling",
        "    torch.logical_and(fresh, False, out=fresh)\n    if m.is_prefilling",
    ),
    # Not the rule's gate: the else branch keeps an ungated rule.
    ("    else:\n        fresh = torch.zeros_like(fresh)\n", ""),
    # A threshold of 2: two-token rows are decodes.
    ("decode_threshold=1", "decode_threshold=2"),
    # Query lengths that are not the difference of query_start_loc.
    ("ql = qsl.diff()", "ql = qsl[1:]"),
    ("ql = qsl.diff()", "ql = qsl.diff() - 1"),
    ("ql = qsl.diff()", "ql = m.seq_lens_cpu_upper_bound"),
    # The counts the split returned, rewritten afterwards.
    ("    if b:\n", "    a, b = a + b, 0\n    if b:\n"),
    ("    if b:\n", "    a += b\n    if b:\n"),
    ("        b -= int((ql[a:] == 0).sum())", "        b -= b"),
    ("        d = int(qsl[a + b]) - c", "        a, b = a + b, 0"),
    # ... after the branch, too.
    ("int(ql.sum())\n", "int(ql.sum())\na = a + b\n"),
]


@pytest.mark.parametrize(("old", "new"), RULE_MUTANTS)
def test_a_rule_edited_out_of_the_fix_is_never_fixed(old: str, new: str) -> None:
    assert old in RULE
    body = RULE.replace(old, new, 1)
    found = analyse_module(ast.parse(_build(body)), _build(body), load())
    assert [(f.kind, f.status) for f in found] == [("builder", Status.UNKNOWN)], found


def test_an_unknown_builder_makes_an_open_runner_route_unknown(tmp_path: Path) -> None:
    """D6: a builder the analysis cannot read (its split behind a helper)
    says nothing of how one-token rows are classified: an open route beside
    it is unknown, naming it; a guarded route stays fixed."""
    hidden = _build(
        """
        a, b, c, d = _split_fixed(m.replace(is_prefilling=m.is_prefilling))
        """
    ).replace(
        "class B:", "def _split_fixed(m):\n    return split_decodes_and_prefills(m)\n\n\nclass B:"
    )
    root = _tree(tmp_path)
    (root / "vllm/attn/fancy.py").write_text(hidden)
    sites = engine.scan_sites(root)
    assert {s.function: s.status for s in sites} == {
        "B.build": Status.UNKNOWN,
        "Runner.execute_model": Status.UNKNOWN,
        "Runner2.execute_model": Status.UNKNOWN,
    }
    [builder] = [s for s in sites if s.function == "B.build"]
    for s in sites:
        if s.function != "B.build":
            assert f"vllm/attn/fancy.py:{builder.line}" in s.reason, s.reason
    # The guard closes the route whatever the builders do.
    runner = tmp_path / "tree" / "vllm/worker/runner.py"
    runner.write_text(
        runner.read_text().replace(
            "            num_reqs=num_reqs,\n",
            f"            num_reqs=num_reqs,\n            force_uniform_decode={V1_GUARD},\n",
        )
    )
    assert {s.function: s.status for s in engine.scan_sites(root)}["Runner.execute_model"] is (
        Status.FIXED
    )


@pytest.mark.parametrize("cut", ["[:0]", "[1:num_reqs]", "[::2]", "[0]", "[idx]", "[:1]"])
def test_a_v1_guard_reading_only_some_rows_counts_does_not_close_the_route(
    tmp_path: Path, cut: str
) -> None:
    """Session 15 audit: the guard's counts cut to no rows (``[:0]``) or to
    some of them was read as the guard: ``fixed`` on an open route. Only the
    counts whole or cut to the requests (``[:num_reqs]``) close it."""
    root = _tree(tmp_path)
    runner = root / "vllm/worker/runner.py"
    guard = V1_GUARD.replace("[:num_reqs]", cut)
    runner.write_text(
        runner.read_text().replace(
            "            num_reqs=num_reqs,\n",
            f"            num_reqs=num_reqs,\n            force_uniform_decode={guard},\n",
        )
    )
    status = {s.function: s.status for s in engine.scan_sites(root)}["Runner.execute_model"]
    assert status is not Status.FIXED
    # The guard as written is fixed (the test's control).
    runner.write_text(runner.read_text().replace(guard, V1_GUARD))
    status = {s.function: s.status for s in engine.scan_sites(root)}["Runner.execute_model"]
    assert status is Status.FIXED


def test_builders_outside_the_family_and_family_without_split() -> None:
    # A builder that fills no GDN-family field is another bug family's (Mamba).
    other = "class M:\n    def build(self, p, m):\n        split_decodes_and_prefills(m)\n"
    assert _verdicts(other) == []
    # A family builder that classifies without the split call: unknown.
    manual = _build("a = (m.ql <= 1).sum()\nsplit_decodes_and_prefills\n")
    assert _verdicts(manual) == [("builder", "B.build", Status.UNKNOWN)]


def test_a_build_a_plugin_installs_on_the_class_is_judged_too() -> None:
    """A hardware plugin replacing ``GDNAttentionMetadataBuilder.build`` by a
    module function: judged like a method; one that classifies in its own
    op (no split call) is unknown, never silent."""
    own_op = (
        "from functools import wraps\n"
        "from vllm.attn import GDNAttentionMetadataBuilder\n"
        "ORIGINAL = GDNAttentionMetadataBuilder.build\n"
        "def _device_build(self, prefix, common):\n"
        "    return my_ops.build_gdn_metadata(common)\n"
        "def register():\n"
        "    GDNAttentionMetadataBuilder.build = wraps(ORIGINAL)(_device_build)\n"
    )
    assert _verdicts(own_op) == [("builder", "_device_build", Status.UNKNOWN)]
    length_only = own_op.replace(
        "    return my_ops.build_gdn_metadata(common)\n",
        "    a, b, c, d = split_decodes_and_prefills(common)\n    return a\n",
    )
    assert _verdicts(length_only) == [("builder", "_device_build", Status.AFFECTED)]
    # Put on another class, naming no GDN field: not this patchset's.
    other = own_op.replace("GDNAttentionMetadataBuilder.build =", "MambaBuilder.build =")
    assert _verdicts(other) == []


# -- runner routes --------------------------------------------------------------------


def test_runner_route_takes_its_verdict_from_the_builders() -> None:
    length_only = _build("a, b, c, d = split_decodes_and_prefills(m)\n")
    fixed = _build(
        "a, b, c, d = split_decodes_and_prefills(\n"
        "    m.replace(is_prefilling=(m.seq_lens_cpu_upper_bound <= 1) & m.is_prefilling),\n"
        "    treat_short_extends_as_decodes=False)\n"
    )
    runner = textwrap.dedent(V1_RUNNER)
    cfg = load()
    route = analyse_module(ast.parse(runner), runner, cfg)
    # Only the real step's call is a route; the capture call passes force itself.
    assert [(f.kind, f.function) for f in route] == [("runner_v1", "Runner.execute_model")]
    # Beside an affected builder the open route is part of the fix (D16: it
    # read "not_affected -> fixed, changed yes"); beside a fixed one, the
    # half fix; beside none (a tree without the builder's split), as assumed.
    for found_in, want, why in (
        (length_only, Status.AFFECTED, "must take the guard"),
        (fixed, Status.AFFECTED, "(half fix)"),
    ):
        found = analyse_module(ast.parse(found_in), found_in, cfg)
        settled = settle(found + route)
        assert settled[-1].status is want and why in settled[-1].reason, found_in
    alone = settle(list(route))
    assert alone[-1].status is Status.NOT_AFFECTED
    # A module without the shape-only test (a drafter's own dispatch): no route.
    assert not [f for f in route if f.kind == "builder"]
    drafter = runner.replace("_is_uniform_decode", "_uniform")
    assert analyse_module(ast.parse(drafter), drafter, cfg) == []
    # V2: a step function (scheduler_output) only.
    v2 = textwrap.dedent(V2_RUNNER)
    assert [f.kind for f in analyse_module(ast.parse(v2), v2, cfg)] == ["runner_v2"]
    speculator = v2.replace("scheduler_output", "input_batch")
    assert analyse_module(ast.parse(speculator), speculator, cfg) == []


V1_GUARD = (
    "False if bool((self.input_batch.num_computed_tokens_cpu[:num_reqs] == 0).any()) else None"
)
V2_GUARD = (
    "if count is not None and (\n"
    "    any(r.num_computed_tokens == 0 for r in scheduler_output.scheduled_new_reqs)\n"
    "    or 0 in scheduler_output.scheduled_cached_reqs.num_computed_tokens\n"
    "):\n"
    "    count = None\n"
)


def _route(text: str) -> list[tuple[str, Status]]:
    return [(f.kind, f.status) for f in analyse_module(ast.parse(text), text, load())]


@pytest.mark.parametrize(
    ("force", "status"),
    [
        (V1_GUARD, Status.FIXED),
        ("False if np.any(self.input_batch.num_computed_tokens_cpu[:num_reqs] <= 0) else None",
         Status.FIXED),
        # Mutants: the guard that never (or wrongly) fires is never "fixed".
        (V1_GUARD.replace("== 0", "> 0"), Status.UNKNOWN),
        (V1_GUARD.replace("== 0", "== 1"), Status.UNKNOWN),
        (V1_GUARD.replace("False if", "True if"), Status.UNKNOWN),
        (V1_GUARD.replace("else None", "else False"), Status.UNKNOWN),
        (V1_GUARD.replace(".any()", ".all()"), Status.UNKNOWN),
    ],
)  # fmt: skip
def test_v1_guard_verdicts(force: str, status: Status) -> None:
    runner = textwrap.dedent(V1_RUNNER).replace(
        "            num_reqs=num_reqs,\n",
        f"            num_reqs=num_reqs,\n            force_uniform_decode={force},\n",
    )
    assert _route(runner) == [("runner_v1", status)]


@pytest.mark.parametrize(
    ("guard", "status"),
    [
        (V2_GUARD, Status.FIXED),
        (V2_GUARD.replace("== 0 for", "== 1 for").replace("0 in", "1 in"), Status.UNKNOWN),
        (V2_GUARD.replace("count is not None and (", "count is not None and False and ("),
         Status.UNKNOWN),
        (V2_GUARD.replace("    count = None", "    count = 1"), Status.UNKNOWN),
        (V2_GUARD.replace("any(r.", "not any(r.").replace("    or 0 in", "    and 0 not in"),
         Status.UNKNOWN),
    ],
)  # fmt: skip
def test_v2_guard_verdicts(guard: str, status: Status) -> None:
    runner = textwrap.dedent(V2_RUNNER).replace(
        "        return count\n", textwrap.indent(guard, "        ") + "        return count\n"
    )
    assert _route(runner) == [("runner_v2", status)]


# -- apply, prove, revert on a small tree -------------------------------------------------


def _statuses(sites: list[Site]) -> dict[str, str]:
    return {s.function: s.status.value for s in sites}


def test_apply_fixes_the_builder_and_guards_both_runners(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = {p: (root / p).read_bytes() for p in ("vllm/attn/fancy.py", "vllm/worker/runner.py")}
    assert _statuses(engine.scan_sites(root)) == {
        "FancyBuilder.build": "affected",
        # The routes the builder's fix needs guarded are affected: apply changes them.
        "Runner.execute_model": "affected",
        "Runner2.execute_model": "affected",
    }
    out = engine.apply_tree(root, mode=Mode.WRITE)
    assert (out.exit_code, out.refused) == (0, [])
    assert sorted(out.written) == [
        "vllm/attn/fancy.py",
        "vllm/worker/gpu/runner2.py",
        "vllm/worker/runner.py",
    ]
    assert set(_statuses(engine.scan_sites(root)).values()) == {"fixed"}
    fancy = (root / "vllm/attn/fancy.py").read_text()
    # The tree's own names: its metadata variable and its four counts.
    assert "replace(m, is_prefilling=no_prior_state)" in fancy
    assert "if np_:\n                np_ -= int((query_lens_cpu[nd:] == 0).sum())" in fancy
    assert "from dataclasses import replace, dataclass" in fancy
    compile(fancy, "fancy.py", "exec")
    # Idempotent, then byte-identical after revert.
    again = engine.apply_tree(root, mode=Mode.WRITE)
    assert (again.written, again.exit_code) == ([], 0)
    back = revert_tree(root)
    assert back.refused == [] and len(back.written) == 3
    assert {p: (root / p).read_bytes() for p in before} == before


def _guard_module(text: str) -> types.ModuleType:
    module = types.ModuleType("guarded")
    exec(compile(text, "guarded.py", "exec"), module.__dict__)
    return module


def test_the_runner_guards_close_the_route_exactly_for_new_rows(tmp_path: Path) -> None:
    """The guards, executed: a batch with a row that has no computed tokens
    never takes the FULL decode route; any other batch is left as it was."""
    import numpy as np

    root = _tree(tmp_path)
    engine.apply_tree(root, mode=Mode.WRITE)
    v1 = _guard_module((root / "vllm/worker/runner.py").read_text())

    class Batch:
        num_computed_tokens_cpu = np.array([5, 0, 7, 0])

    runner = v1.Runner()
    runner.input_batch = Batch()
    assert runner.execute_model(None) is False  # row 1 is new: no uniform decode
    Batch.num_computed_tokens_cpu = np.array([5, 3, 7, 0])  # row 3 is past num_reqs
    assert runner.execute_model(None) is True
    assert runner.capture() is True  # the capture path is untouched
    v2 = _guard_module((root / "vllm/worker/gpu/runner2.py").read_text())

    def step(new: list[int], cached: list[int]) -> object:
        out = types.SimpleNamespace(
            scheduled_new_reqs=[types.SimpleNamespace(num_computed_tokens=n) for n in new],
            scheduled_cached_reqs=types.SimpleNamespace(num_computed_tokens=cached),
        )
        return v2.Runner2().execute_model(out)

    assert step([0], [4]) is None  # a new request: no uniform count
    assert step([], [0, 4]) is None  # a preempted one resumed from scratch
    assert step([3], [4]) == 1  # prefix-cached new request, decodes: unchanged


def test_a_runner_without_the_field_the_guard_reads_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    runner = root / "vllm/worker/runner.py"
    runner.write_text(runner.read_text().replace("num_computed_tokens_cpu", "computed_np"))
    out = engine.apply_tree(root, mode=Mode.WRITE)
    assert out.exit_code == 2 and not out.written
    assert "never reads self.input_batch.num_computed_tokens_cpu" in out.refused[0][1]


def test_refusals_change_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # No fields for a stateless rule (releases before 0.20.0).
    old = _tree(tmp_path / "old", utils=OLD_UTILS)
    snapshot = {p: p.read_bytes() for p in old.rglob("*.py")}
    code, _, err = run(capsys, "apply", str(old), "--patchset", "pr51565")
    assert code == 2 and "has no seq_lens_cpu_upper_bound, is_prefilling" in err
    assert len(err.strip().splitlines()) == 1 and "fancy.py" in err
    assert {p: p.read_bytes() for p in old.rglob("*.py")} == snapshot
    # A builder with no runner in the tree: the fix cannot be proven whole.
    lone = _write(tmp_path / "lone", {"vllm/attn/utils.py": UTILS, "vllm/attn/fancy.py": BUILDER})
    code, _, err = run(capsys, "apply", str(lone), "--patchset", "pr51565")
    assert code == 2 and "no model runner with a FULL decode CUDA-graph route" in err
    # The builder's file alone: its folder is the tree, the runners lie outside.
    tree = _tree(tmp_path / "one")
    code, _, err = run(capsys, "apply", str(tree / "vllm/attn/fancy.py"), "--patchset", "pr51565")
    assert code == 2 and "no model runner" in err
    # A flat plugin folder holding both: the builder's file alone cannot be
    # patched without the runner beside it.
    flat = _write(
        tmp_path / "flat",
        {"p/utils.py": UTILS, "p/fancy.py": BUILDER, "p/runner.py": V1_RUNNER},
    )
    code, _, err = run(capsys, "apply", str(flat / "p" / "fancy.py"), "--patchset", "pr51565")
    assert code == 2 and "the fix also rewrites runner.py" in err
    assert not (flat / "p" / ".gdn-backport").exists()


def test_scan_and_check_report_both_patchsets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tree(tmp_path)
    code, out, _ = run(capsys, "scan", str(root))
    assert code == 1 and "pr51565" in out and "FancyBuilder.build" in out
    code, out, _ = run(capsys, "apply", "--check", str(root))
    assert code == 1 and "FancyBuilder.build" in out
    code, out, _ = run(capsys, "apply", "--check", str(root), "--patchset", "pr51812")
    assert code == 0
    code, _, _ = run(capsys, "apply", str(root))
    assert code == 0
    code, out, _ = run(capsys, "apply", "--check", str(root))
    assert code == 0
    # revert --patchset takes only that patchset's records.
    code, out, _ = run(capsys, "revert", str(root), "--patchset", "pr51812")
    assert code == 0 and "nothing to revert" in out
    code, out, _ = run(capsys, "revert", str(root), "--patchset", "pr51565")
    assert code == 0 and "restored 3 file(s)" in out


# -- real releases ----------------------------------------------------------------------

# The scenarios that read a recycled slot where the builder classifies by length.
STALE = ("new_one_token", "decode_plus_new", "first_chunk_one_token")


@pytest.mark.network
@pytest.mark.slow
def test_release_patched_by_us_passes_the_builder_suite(tmp_path: Path) -> None:
    """0.25.1: our rewrite of its own builder and runners; the stale-state
    scenarios, which fail on the release as shipped (test_builder_suite),
    pass on it, and so does every other scenario."""
    from gdn_backport import sources
    from gdn_backport.patchsets.pr51565.suite import run_builder_suite
    from tests.harness_fixtures import interpreted

    interpreted()
    root = sources.copy_release("0.25.1", tmp_path / "tree")
    unpatched = {r.name: r.passed for r in run_builder_suite(root, scenarios=STALE)}
    assert unpatched == dict.fromkeys(STALE, False)
    out = engine.apply_tree(root, mode=Mode.WRITE)
    assert out.exit_code == 0 and sorted(out.written) == [
        "vllm/v1/attention/backends/gdn_attn.py",
        "vllm/v1/worker/gpu/model_runner.py",
        "vllm/v1/worker/gpu_model_runner.py",
    ]
    rows = run_builder_suite(root)
    assert [(r.name, r.passed) for r in rows if not r.passed] == []
    [new] = [r for r in rows if r.name == "new_one_token"]
    assert "decodes=0 prefills=1" in new.note


@pytest.mark.network
def test_release_without_the_fields_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.19.1 has is_prefilling but no seq_lens_cpu_upper_bound: refused,
    nothing written, the reason named (NOTES says what to do instead)."""
    from gdn_backport import sources

    root = sources.copy_release("0.19.1", tmp_path / "tree")
    builder = root / "vllm/v1/attention/backends/gdn_attn.py"
    before = builder.read_bytes()
    code, _, err = run(capsys, "apply", str(root), "--patchset", "pr51565")
    assert code == 2 and "no seq_lens_cpu_upper_bound" in err and "gdn_attn.py" in err
    assert builder.read_bytes() == before and not (root / ".gdn-backport").exists()
    # pr51812 alone still patches that release.
    code, _, _ = run(capsys, "apply", str(root), "--patchset", "pr51812")
    assert code == 0


@pytest.mark.network
@pytest.mark.slow
def test_both_patchsets_applied_pass_both_suites(tmp_path: Path) -> None:
    """0.27.1 (the Kimi K3 builder too) with both fixes in: the #51812
    mixed-batch scenarios and the #51565 builder scenarios all pass, and
    revert gives back every file."""
    from gdn_backport import sources
    from gdn_backport.patchsets.pr51812.scenarios import CI_SCENARIOS
    from gdn_backport.pipeline import apply as apply_fixes
    from gdn_backport.registry import selected
    from gdn_backport.verify import verify_tree
    from tests.harness_fixtures import interpreted

    interpreted()
    root = sources.copy_release("0.27.1", tmp_path / "tree")
    pristine = sources.release_tree("0.27.1")
    results = apply_fixes(root, selected(None))
    written = {fix.info.id: sorted(out.written) for fix, out in results}
    assert written == {
        "pr51812": ["vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"],
        "pr51565": [
            "vllm/models/kimi_k3/nvidia/kda_metadata.py",
            "vllm/v1/attention/backends/gdn_attn.py",
            "vllm/v1/worker/gpu/model_runner.py",
            "vllm/v1/worker/gpu_model_runner.py",
        ],
    }
    report = verify_tree(root, scenarios=[*CI_SCENARIOS, *STALE, "decode_new_prefill"])
    assert report.error == "" and report.rows
    assert [(r.name, r.note) for r in report.rows if not r.passed] == []
    assert {r.tag for r in report.rows} >= {"builder"}
    back = revert_tree(root)
    assert back.refused == [] and len(back.written) == 5
    for rel in [p for paths in written.values() for p in paths]:
        assert (root / rel).read_bytes() == (pristine / rel).read_bytes(), rel


def test_a_plugin_tree_that_replaces_the_builder_is_refused_not_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plugin's folder (its modules import vllm) whose module installs its
    own GDN build: scan says unknown (exit 2) and apply changes nothing."""
    plugin = _write(tmp_path / "plug", {})
    (plugin / "vllm" / "__init__.py").unlink()
    (plugin / "vllm").rmdir()
    (plugin / "myhw").mkdir()
    (plugin / "myhw" / "gdn.py").write_text(
        "from vllm.attn import GDNAttentionMetadataBuilder\n"
        "def _device_build(self, prefix, common):\n"
        "    return my_ops.build_gdn_metadata(common)\n"
        "GDNAttentionMetadataBuilder.build = _device_build\n"
    )
    code, out, _ = run(capsys, "scan", str(plugin), "--patchset", "pr51565")
    assert code == 2 and "_device_build" in out and "unknown" in out
    code, _, err = run(capsys, "apply", str(plugin), "--patchset", "pr51565")
    assert code == 2 and "gdn.py" in err and "_device_build" in err
