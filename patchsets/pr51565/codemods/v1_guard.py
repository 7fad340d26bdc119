"""The V1 runner guard: no FULL decode CUDA graph for a batch with a new row."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from gdn_backport.errors import Refusal

from . import examples as ex
from .base import FindingCodemod, tight_equal


class V1GuardCodemod(FindingCodemod):
    """Keep a batch holding a row with no computed tokens off V1's FULL decode route.

    The dispatch call of a real step (``_determine_batch_execution_and_padding``
    without ``force_uniform_decode``; capture and dummy runs pass their own)
    gets ``force_uniform_decode=False if bool((self.input_batch.
    num_computed_tokens_cpu[:num_reqs] == 0).any()) else None``. The builder,
    once it calls such a row a prefill, does not fill the FULL decode
    graph's buffers for it; the rows the guard sees are a superset of the
    builder's (``seq_lens_cpu_upper_bound = num_computed + query_len``), so the
    route is never taken with a prefill. The new keyword takes the last
    argument's place in the call's layout.

    Alone (``python -m libcst.tool codemod``) the codemod cannot see the
    tree's builders, so it guards every open route in the file (in
    ``apply``, a route is guarded only with a builder fix, or where the
    builder already reclassifies: 0.31.0-0.33.0's half fix).
    """

    KIND = "runner_v1"
    DESCRIPTION: str = "no FULL decode CUDA graph for a batch with a new row (the V1 runner)"

    def missing(self) -> str:
        return f"the {self.cfg.v1_dispatch} call"

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        site = self.site()
        cfg = self.cfg
        func = updated_node.func
        if site is None or not (
            isinstance(func, cst.Attribute)
            and func.attr.value == cfg.v1_dispatch
            and isinstance(func.value, cst.Name)
            and func.value.value == "self"
        ):
            return updated_node
        if any(a.keyword is not None and a.keyword.value == cfg.v1_force
               for a in updated_node.args):  # fmt: skip
            return updated_node  # capture and dummy runs
        where = self.where(site)
        computed = f"self.input_batch.{cfg.v1_computed}"
        if computed not in self.source:
            raise Refusal(
                f"{where}: the runner never reads {computed}; the guard would read a field "
                "this tree may not have"
            )
        args = list(updated_node.args)
        reqs = next(
            (a.value for a in args if a.keyword is not None and a.keyword.value == "num_reqs"),
            args[1].value if len(args) > 1 and args[1].keyword is None else None,
        )
        if not isinstance(reqs, cst.Name):
            raise Refusal(f"{where}: num_reqs is not passed as a plain name")
        guard = cst.parse_expression(
            f"False if bool(({computed}[:{reqs.value}] == 0).any()) else None"
        )
        last = args[-1]
        # The last argument gets the separator the arguments before it have.
        between: cst.Comma | cst.MaybeSentinel = cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" ")
        )
        if len(args) > 1 and isinstance(args[-2].comma, cst.Comma):
            between = args[-2].comma
        args[-1] = last.with_changes(comma=between)
        args.append(
            cst.Arg(guard, keyword=cst.Name(cfg.v1_force), equal=tight_equal(), comma=last.comma)
        )
        self.fixed(site)
        return updated_node.with_changes(args=args)

    # Examples, run by tests/test_codemods.py and the libcst tool's test.
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.V1_RUNNER, ex.V1_RUNNER_GUARDED),
        (ex.V1_RUNNER_POSITIONAL, ex.V1_RUNNER_POSITIONAL_GUARDED),
    )
    UNCHANGED: ClassVar[tuple[str, ...]] = (
        ex.V1_RUNNER_GUARDED,
        ex.V1_DRAFTER,
        ex.V1_CAPTURE_ONLY,
    )
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.V1_RUNNER_REQS_EXPRESSION, "num_reqs is not passed as a plain name"),
        (ex.V1_RUNNER_NO_COMPUTED, "never reads self.input_batch.num_computed_tokens_cpu"),
        (ex.V1_RUNNER_OTHER_GUARD, "a guard the analysis cannot vouch for"),
    )
