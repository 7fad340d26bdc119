"""Named scenarios, each tagged with the bug it guards.

A scenario is one or more consecutive steps (batches) of the same requests;
state carries over from step to step, so a second step with other accepted
counts checks that the first wrote the right slots. ``expect_unpatched`` says
what the scenario must do on an affected, unpatched tree (the mutation
check): "fail" where a non-spec row precedes a spec row, "pass" where the
spec tokens form a leading prefix (the bug cannot show).
"""

from __future__ import annotations

from dataclasses import dataclass

from gdn_backport.harness.batch import Batch, Row

__all__ = ["EXTRA_SCENARIOS", "SCENARIOS", "Scenario", "ci_scenarios", "scenario"]

TAG_GATES = "vllm#51812 spec gates gathered by spec_token_indx"
TAG_ZERO_COPY = "vllm#51812 pure-spec fast path aliases the gates (zero-copy)"
TAG_NON_SPEC = "non-spec paths unchanged by the fix"
TAG_STATE = "spec state slots across steps (num_accepted_tokens)"


@dataclass(frozen=True)
class Scenario:
    name: str
    tag: str
    steps: tuple[Batch, ...]
    expect_unpatched: str  # "fail" | "pass"
    strided_gates: bool = False
    description: str = ""

    def layout(self) -> str:
        return " -> ".join(step.describe() for step in self.steps)


def _b(*rows: Row, num_spec: int = 3) -> Batch:
    return Batch(rows=tuple(rows), num_spec=num_spec)


S, N = True, False

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "pr_layout",
        TAG_GATES,
        (_b(Row(N, 1), Row(S, 3, num_accepted=2)),),
        "fail",
        description="upstream PR's layout: one non-spec token before a 3-token spec row "
        "(spec_token_indx (1, 2, 3), non_spec_token_indx (0,))",
    ),
    Scenario(
        "production",
        TAG_GATES,
        (
            _b(
                *(Row(S, 4, num_accepted=1 + i % 4) for i in range(5)),
                Row(N, 4),
                Row(S, 4, num_accepted=2),
            ),
        ),
        "fail",
        description="five 4-token spec rows, a 4-token prefill chunk, one more spec row",
    ),
    Scenario(
        "pure_spec",
        TAG_ZERO_COPY,
        (_b(Row(S, 4, num_accepted=1), Row(S, 4, num_accepted=3)),),
        "pass",
        description="spec rows only: the fast path, gates must reach the kernel uncopied",
    ),
    Scenario(
        "no_spec",
        TAG_NON_SPEC,
        (_b(Row(N, 1), Row(N, 1), Row(N, 5), Row(N, 3, has_initial_state=False)),),
        "pass",
        description="decodes then prefills, no spec rows",
    ),
    Scenario(
        "spec_first",
        TAG_GATES,
        (_b(Row(S, 4, num_accepted=2), Row(S, 4, num_accepted=4), Row(N, 1), Row(N, 3)),),
        "pass",
        description="spec rows before non-spec rows: spec tokens are a leading prefix",
    ),
    Scenario(
        "interleaved_snns",
        TAG_GATES,
        (_b(Row(S, 4, num_accepted=3), Row(N, 1), Row(N, 2), Row(S, 4, num_accepted=1)),),
        "fail",
        description="[spec, non, non, spec]",
    ),
    Scenario(
        "interleaved_nssn",
        TAG_GATES,
        (_b(Row(N, 2), Row(S, 4, num_accepted=2), Row(S, 4, num_accepted=4), Row(N, 1)),),
        "fail",
        description="[non, spec, spec, non]",
    ),
    Scenario(
        "long_prefill_first",
        TAG_GATES,
        (_b(Row(N, 70, has_initial_state=False), Row(S, 4, num_accepted=2), Row(S, 4)),),
        "fail",
        description="a 70-token prefill chunk (more than one FLA chunk) before spec rows",
    ),
    Scenario(
        "two_steps",
        TAG_STATE,
        (
            _b(Row(N, 1, request=0), Row(S, 4, num_accepted=1, request=1), Row(S, 4, request=2)),
            _b(
                Row(N, 1, request=0),
                Row(S, 4, num_accepted=3, request=1),
                Row(S, 4, num_accepted=4, request=2),
            ),
        ),
        "fail",
        description="two consecutive mixed steps, other accepted counts in the second",
    ),
    Scenario(
        "two_steps_spec_first",
        TAG_STATE,
        (
            _b(Row(S, 4, num_accepted=2, request=0), Row(N, 2, request=1)),
            _b(Row(S, 4, num_accepted=4, request=0), Row(N, 1, request=1)),
        ),
        "pass",
        description="two consecutive steps, spec rows first, accepted counts 2 then 4",
    ),
)

# Beyond the caller's contract: vLLM makes b and a contiguous before
# _forward_core, and the 0.11-0.18 prefill gating kernel reads them as
# contiguous, so strided gates fail there with or without the fix. The
# upstream fix (index_select) and the kernel strategy must still cope.
EXTRA_SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "strided_gates",
        TAG_GATES,
        (_b(Row(N, 1), Row(S, 4, num_accepted=2), Row(N, 3)),),
        "fail",
        strided_gates=True,
        description="mixed batch, gates as strided views from ba.chunk(2, dim=-1)",
    ),
)

# Small and fast: what CI runs per release on CPU (each kind of layout once).
CI_SCENARIOS = ("pr_layout", "production", "pure_spec", "no_spec", "spec_first", "two_steps")


def scenario(name: str) -> Scenario:
    for item in SCENARIOS + EXTRA_SCENARIOS:
        if item.name == name:
            return item
    known = ", ".join(s.name for s in SCENARIOS + EXTRA_SCENARIOS)
    raise KeyError(f"no scenario named {name!r}; known: {known}")


def ci_scenarios() -> tuple[Scenario, ...]:
    return tuple(scenario(name) for name in CI_SCENARIOS)
