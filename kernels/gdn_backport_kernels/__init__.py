"""gdn_backport_kernels: the ABI-stable Triton op behind ``--strategy kernel``.

The public contract is exactly ``__all__`` plus the integer ``ABI_VERSION``;
the op ``gdn_backport::gated_delta_rule_spec_update_v1`` is registered with
``torch.library`` on import (importing compiles nothing and needs no GPU, nor
the ``gdn_backport`` tool). ``gated_delta_rule_spec_update`` is the drop-in
for vLLM's spec-path ``fused_sigmoid_gating_delta_rule_update`` call that takes
the ungathered gates plus ``spec_token_indx``; ``spec_update_supported`` says
whether a call can be served; ``use_spec_update`` and ``gather_token_rows``
are what a rewritten call site uses to fall back to the upstream gathered-gate
path where it cannot (see ``guard``). Names are only ever added here.
"""

from .guard import gather_token_rows, use_spec_update
from .naive import gated_delta_rule_spec_update_naive
from .op import SPEC_UPDATE_OP, gated_delta_rule_spec_update_v1
from .spec_update import gated_delta_rule_spec_update, spec_update_supported

# Bumped only when a name in __all__ changes incompatibly; ops carry their own
# _vN suffix and are never edited once released.
ABI_VERSION = 1

__all__ = [
    "ABI_VERSION",
    "SPEC_UPDATE_OP",
    "gated_delta_rule_spec_update",
    "gated_delta_rule_spec_update_naive",
    "gated_delta_rule_spec_update_v1",
    "gather_token_rows",
    "spec_update_supported",
    "use_spec_update",
]
