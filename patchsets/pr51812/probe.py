"""pr51812's probe events: builds whose spec rows are not a leading prefix.

A build is *mixed* when the builder took its gather branch (spec rows and
non-spec rows with tokens in one batch), and *spec-not-prefix* when, in
addition, some non-spec token comes before a spec token, so the gathered
``spec_token_indx`` is not ``0..n-1``: exactly the batches where an
affected release hands the spec kernel other tokens' gates. Host data only
(:mod:`gdn_backport.runtime.probe`); nothing heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gdn_backport.runtime.probe import ProbeEvent, ProbeSource, host_list


@dataclass(frozen=True)
class Layout:
    """What one build's batch looks like to the GDN layer."""

    mixed: bool  # spec rows and non-spec tokens together: the gather branch
    spec_not_prefix: bool  # a non-spec token precedes a spec token


_NOT_MIXED = Layout(mixed=False, spec_not_prefix=False)


def classify(query_start_loc_cpu: Any, num_decode_draft_tokens_cpu: Any) -> Layout:
    """Classify a batch whose spec rows are ``num_decode_draft_tokens_cpu >= 0``.

    Mirrors the builder's gather branch: spec rows are those with a draft
    count ``>= 0``; non-spec rows without tokens (padding) do not count; the
    builder gathers spec tokens in row order (a stable argsort of the token
    mask), so ``spec_token_indx`` is ``0..n-1`` iff no non-spec token precedes
    a spec token. Accepts CPU tensors, numpy arrays or sequences; a device
    tensor raises instead of being read.
    """
    starts = host_list(query_start_loc_cpu)
    drafts = host_list(num_decode_draft_tokens_cpu)
    if len(starts) != len(drafts) + 1:
        raise ValueError(
            f"{len(starts) - 1} rows in query_start_loc_cpu, "
            f"{len(drafts)} in num_decode_draft_tokens_cpu"
        )
    # A plain loop: batches are at most a few hundred rows, and numpy's
    # per-call overhead would cost more than the loop (bench/bench_probe.py).
    any_spec = nonspec_seen = False
    for row, draft in enumerate(drafts):
        tokens = starts[row + 1] - starts[row]
        if draft >= 0:
            if nonspec_seen and tokens > 0:
                return Layout(mixed=True, spec_not_prefix=True)
            any_spec = True
        elif tokens > 0:
            nonspec_seen = True
    return Layout(mixed=any_spec and nonspec_seen, spec_not_prefix=False)


def _mixed_from_result(result: Any) -> bool | None:
    """Whether the version's own builder took its gather branch, from the
    returned metadata's ``int`` counts; None when it has no such counts (a
    fork's metadata class). The layer branches on the same counts."""
    spec = getattr(result, "num_spec_decodes", None)
    prefills = getattr(result, "num_prefills", None)
    decodes = getattr(result, "num_decodes", None)
    if isinstance(spec, int) and isinstance(prefills, int) and isinstance(decodes, int):
        return spec > 0 and prefills + decodes > 0
    return None


def observe(builder: Any, metadata: Any, drafts: Any, result: Any) -> Layout:
    mixed = _mixed_from_result(result)
    if mixed is False:
        return _NOT_MIXED
    if mixed is None:
        # Without the builder's counts, its inputs decide as 0.18-0.31 do: no
        # spec rows unless spec decoding is on and some spec row drafted.
        if not getattr(builder, "use_spec_decode", True) or drafts is None:
            return _NOT_MIXED
        if sum(d for d in host_list(drafts) if d >= 0) == 0:
            return _NOT_MIXED
    layout = classify(metadata.query_start_loc_cpu, drafts)
    if mixed and not layout.mixed:
        raise ValueError("the builder mixed spec and non-spec rows, the host tensors do not")
    return layout


def _counts(builder: Any, metadata: Any, drafts: Any, result: Any) -> dict[str, bool]:
    layout = observe(builder, metadata, drafts, result)
    return {"mixed": layout.mixed, "spec_not_prefix": layout.spec_not_prefix}


SOURCE = ProbeSource(
    (ProbeEvent("mixed", "mixed", digits=1), ProbeEvent("spec_not_prefix", "spec-not-prefix")),
    _counts,
)
