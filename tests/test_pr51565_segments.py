"""The plan's codemods over the methods they rewrite give the whole module's
result, byte for byte (``codemods/segments.py``), and libcst reads only those
methods."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from gdn_backport.codemod import run
from gdn_backport.patchsets.pr51565.analysis import analyse_module, settle
from gdn_backport.patchsets.pr51565.codemods import examples as ex
from gdn_backport.patchsets.pr51565.codemods import segments
from gdn_backport.patchsets.pr51565.codemods.base import FindingCodemod, InTree, facts_of
from gdn_backport.patchsets.pr51565.codemods.builder_rule import BuilderRuleCodemod
from gdn_backport.patchsets.pr51565.codemods.v1_guard import V1GuardCodemod
from gdn_backport.patchsets.pr51565.codemods.v2_guard import V2GuardCodemod
from gdn_backport.patchsets.pr51565.config import load
from gdn_backport.pipeline import Mode
from gdn_backport.site import Status
from gdn_backport.tree import Tree
from tests import test_prior_state as prior

CODEMODS: list[type[FindingCodemod]] = [BuilderRuleCodemod, V1GuardCodemod, V2GuardCodemod]

NESTED = ex.BUILDER + (
    "\n\nclass Outer:\n"
    "    class GDNAttentionMetadataBuilder:\n"
    "        def build(self, common_prefix_len, m):\n"
    "            num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (\n"
    "                split_decodes_and_prefills(m, decode_threshold=1)\n"
    "            )\n"
    "            return non_spec_state_indices_tensor\n"
)

TWO_SPACE_FIRST = "if TYPE_CHECKING:\n  import typing\n" + ex.BUILDER

CASES = {
    "builder": ex.BUILDER,
    "builder_replace_method": ex.BUILDER_REPLACE_METHOD,
    "builder_own_replace": ex.BUILDER_OWN_REPLACE,
    "builder_counts_in_one_name": ex.BUILDER_COUNTS_IN_ONE_NAME,
    "builder_docstring": '"""A builder."""\n# the imports\n' + ex.BUILDER,
    "builder_tabs": ex.BUILDER.replace("    ", "\t"),
    "builder_crlf": ex.BUILDER.replace("\n", "\r\n"),
    "builder_two_space_first_block": TWO_SPACE_FIRST,
    "builder_decorated": ex.BUILDER.replace(
        "    def build(", "    @some.decorator(1)\n    # a comment\n    def build("
    ),
    "builder_nested_class_of_the_same_name": NESTED,
    "builder_class_first": ex.BUILDER[ex.BUILDER.index("class GDNAttentionMetadataBuilder") :],
    "builder_one_line_if_else_first": "if x: pass\nelse:\n  y = 1\n" + ex.BUILDER,
    "builder_no_trailing_newline": ex.BUILDER.rstrip("\n"),
    "v1": ex.V1_RUNNER,
    "v1_positional": ex.V1_RUNNER_POSITIONAL,
    "v1_reqs_expression": ex.V1_RUNNER_REQS_EXPRESSION,
    "v1_no_computed": ex.V1_RUNNER_NO_COMPUTED,
    "v1_crlf": ex.V1_RUNNER.replace("\n", "\r\n"),
    "v1_after_imports": "import torch\n\n" + ex.V1_RUNNER,
    "v2": ex.V2_RUNNER,
    "v2_tabs": ex.V2_RUNNER.replace("    ", "\t"),
    "v2_one_line_if": ex.V2_RUNNER_ONE_LINE_IF,
    "v2_in_a_branch_of_the_class": ex.V2_RUNNER.replace(
        "class GPUModelRunner:\n    def execute_model",
        "class GPUModelRunner:\n  if 1:\n    def execute_model",
    ),
}


def _within(text: str, kind: str) -> InTree:
    """What the plan hands a codemod: its affected sites (an open route as
    with a builder fix), the facts the module defines."""
    found = settle(analyse_module(ast.parse(text), text, load()))
    mine = tuple(
        f
        for f in found
        if f.kind == kind and (f.status is Status.AFFECTED or (kind != "builder" and not f.guarded))
    )
    return InTree(mine, facts_of([ast.parse(text)], load().split), text)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("codemod", CODEMODS, ids=lambda c: c.__name__)
def test_the_methods_alone_give_the_whole_modules_result(
    name: str, codemod: type[FindingCodemod]
) -> None:
    text = CASES[name]
    within = _within(text, codemod.KIND)
    whole = run(codemod(within=within), text)
    alone = segments.run_on_methods(codemod, within, ast.parse(text))
    assert alone == whole


def test_a_rewrite_is_made_and_kept_exactly_where_libcst_would() -> None:
    # The cases above rewrite: not all of them Skip or Failure.
    within = _within(NESTED, "builder")
    result = segments.run_on_methods(BuilderRuleCodemod, within, ast.parse(NESTED))
    assert result == run(BuilderRuleCodemod(within=within), NESTED)
    assert str(getattr(result, "value", "")).count("no_prior_state &= m.is_prefilling") == 2


def test_libcst_reads_the_methods_not_the_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner module of a thousand lines: libcst parses the step method,
    not the module (it parsed all of it)."""
    filler = "".join(
        f"    def helper_{i}(self, x):\n        return x + {i}\n\n" for i in range(400)
    )
    runner = prior.V1_RUNNER.replace("class Runner:\n", "class Runner:\n" + filler)
    assert runner != prior.V1_RUNNER
    root = prior._tree(tmp_path, **{"vllm__worker__runner.py": runner})
    parsed: list[int] = []
    real = cst.parse_module

    def parse(source: str | bytes, *args: object, **kwargs: object) -> cst.Module:
        parsed.append(len(source))
        return real(source, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(segments.cst, "parse_module", parse)
    monkeypatch.setattr("libcst.codemod._runner.parse_module", parse)
    from gdn_backport.patchsets.pr51565 import plan

    result = plan.plan(Tree.of(root), "reclassify", Mode.DRY_RUN)
    assert result.outcome.refused == []
    assert "force_uniform_decode=False if" in result.outcome.diff
    assert (root / "vllm/worker/runner.py").read_text() == textwrap.dedent(runner).lstrip()
    assert parsed and max(parsed) < len(runner) // 10
