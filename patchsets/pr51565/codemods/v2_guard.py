"""The V2 runner guard: no uniform token count for a step with a new request."""

from __future__ import annotations

from typing import ClassVar

import libcst as cst

from gdn_backport.errors import Refusal

from ..analysis import Finding
from . import examples as ex
from .base import TAG, FindingCodemod, assignment, assigns_call


class V2GuardCodemod(FindingCodemod):
    """Keep a step with a request that has no computed tokens off V2's FULL decode route.

    After ``count = get_uniform_token_count(...)`` (the count from shapes
    only, in a step function: one taking ``scheduler_output``), ``count =
    None`` when a scheduled request has no computed tokens, read from the
    scheduler output's own counts (the source the runner's are made from).
    Without a uniform count the step replays no FULL decode graph, whose
    buffers the builder leaves unfilled for a row it calls a prefill.

    Alone (``python -m libcst.tool codemod``) it guards every open count
    in the file: the tree's builders are out of sight (see
    :class:`~.v1_guard.V1GuardCodemod`).
    """

    KIND = "runner_v2"
    DESCRIPTION: str = "no uniform token count for a step with a new request (the V2 runner)"

    def missing(self) -> str:
        return f"the {self.cfg.v2_shape_only} assignment"

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        site = self.site()
        if site is None:
            return updated_node
        body: list[cst.BaseStatement] = []
        for stmt in updated_node.body:
            body.append(stmt)
            if assigns_call(stmt, self.cfg.v2_shape_only):
                body.append(self._guard(stmt, site))
        return updated_node.with_changes(body=body)

    def _guard(self, stmt: cst.BaseStatement, site: Finding) -> cst.BaseStatement:
        a = assignment(stmt)
        assert a is not None
        where = self.where(site)
        if len(a.targets) != 1 or not isinstance(a.targets[0].target, cst.Name):
            raise Refusal(f"{where}: the uniform token count is not assigned to one name")
        name = a.targets[0].target.value
        fn = self.method()
        params = {p.name.value for p in [*fn.params.params, *fn.params.kwonly_params]}
        if "scheduler_output" not in params:
            raise Refusal(f"{where}: no scheduler_output parameter to read computed tokens from")
        self.fixed(site)
        return cst.parse_statement(
            f"# {TAG}: a request with no computed tokens is a\n"
            "# prefill for the GDN builder, which then fills no decode buffer: no FULL\n"
            "# decode graph for this batch.\n"
            f"if {name} is not None and (\n"
            "    any(r.num_computed_tokens == 0 for r in scheduler_output.scheduled_new_reqs)\n"
            "    or 0 in scheduler_output.scheduled_cached_reqs.num_computed_tokens\n"
            "):\n"
            f"    {name} = None\n"
        )

    # Examples, run by tests/test_codemods.py and the libcst tool's test.
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = ((ex.V2_RUNNER, ex.V2_RUNNER_GUARDED),)
    UNCHANGED: ClassVar[tuple[str, ...]] = (
        ex.V2_RUNNER_GUARDED,
        ex.V2_SPECULATOR,
    )
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.V2_RUNNER_OTHER_GUARD, "a guard of uniform_tok_count the analysis cannot vouch for"),
        (ex.V2_RUNNER_ONE_LINE_IF, "is not a statement of the method's body this rewrite knows"),
    )
