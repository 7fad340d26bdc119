"""pr51565's probe event: builds that call a row without prior state a decode.

Host data only (:mod:`gdn_backport.runtime.probe`); nothing heavy is imported.
"""

from __future__ import annotations

import itertools
from typing import Any

from gdn_backport.runtime.probe import ProbeEvent, ProbeSource, host_field, host_list

from . import PATCHSET


def new_row_decodes(metadata: Any, result: Any, drafts: Any) -> bool:
    """Whether the build classified a row without prior state as a decode.

    No prior state: ``seq_lens_cpu_upper_bound <= query_len`` (0.20 on), or
    no computed tokens (older fields), and still prefilling where the
    metadata says (``is_prefilling``, 0.19 on: capture dummies are not;
    before it they count too, at start-up only). Decodes: the first
    ``num_decodes`` rows without spec rows; beside spec rows the one-token
    non-spec rows where the builder still reports decodes (before 0.18)."""
    decodes = getattr(result, "num_decodes", None)
    spec = getattr(result, "num_spec_decodes", 0)
    if not isinstance(decodes, int) or decodes <= 0:
        return False
    starts = host_list(metadata.query_start_loc_cpu)
    lens = [b - a for a, b in itertools.pairwise(starts)]
    upper = host_field(metadata, "seq_lens_cpu_upper_bound")
    if upper is not None:
        fresh = [u <= q for u, q in zip(upper, lens, strict=False)]
    else:
        computed = host_field(metadata, "num_computed_tokens_cpu", "_num_computed_tokens_cpu")
        if computed is None:
            return False  # a fork's metadata without these fields: not counted
        fresh = [c == 0 for c in computed]
    prefilling = host_field(metadata, "is_prefilling")
    if prefilling is not None:
        fresh = [f and bool(p) for f, p in zip(fresh, prefilling, strict=False)]
    if isinstance(spec, int) and spec > 0:
        marks = host_list(drafts) if drafts is not None else []
        rows = [i for i, d in enumerate(marks) if d < 0 and lens[i] == 1]
    else:
        rows = list(range(min(decodes, len(lens))))
    return any(lens[i] > 0 and fresh[i] for i in rows if i < len(fresh))


SOURCE = ProbeSource(
    (
        ProbeEvent(
            "new_row_decodes", "new-row decodes", always=False, note=f"vLLM #{PATCHSET.info.number}"
        ),
    ),
    lambda builder, metadata, drafts, result: {
        "new_row_decodes": new_row_decodes(metadata, result, drafts)
    },
)
