"""Path-sensitive row-provenance data flow over a function and its helpers (libcst).

The walker executes the function body abstractly: every local name maps to
the set of :class:`~gdn_backport.provenance.Val` it may hold. An ``if``
forks the environment and tags what each arm assigns with the arm's
condition, so a value set in the pure-spec fast path and a value set in the
mixed branch stay apart and are only ever combined with values from the same
arm. Conditions are normalised into atoms (``x is not None`` is ``x is
None`` negated, ``not c`` is ``c`` negated, ``a and b`` holds both), so
contradicting tests never combine; an arm that contradicts the path so far
is not walked, and after an early ``return``/``raise`` the other arm's
condition holds for the rest of the block. ``x is None`` narrows ``x`` in
each arm: a local staged as ``None`` only takes the arm where it is None.

Calls into helpers of the same tree (``self.method``, module functions,
functions imported from other modules of the tree, resolved by a
:class:`Resolver` and never executed) are followed when they can touch the
spec path: the helper is walked in a new *frame* with its parameters bound
to the caller's argument values (by position, keyword and default), so a
kernel call inside it sees the rows the caller selected. Frames nest up to
:data:`MAX_DEPTH` deep; recursion is cut.

Nothing here knows about vLLM besides the names the patchset gives: which
attributes are spec/non-spec token indices and state slots, which callees
are kernels (never followed). Every call is recorded with the values of its
arguments; :mod:`gdn_backport.analysis` decides which calls are kernels and
whether their rows line up.

The walker is split along its jobs: :mod:`.statements`, :mod:`.expressions`,
:mod:`.calls` (following helpers, the resolver seam), :mod:`.conditions`
and :mod:`.state`, composed in :mod:`.walker`; :mod:`.model` holds what a
walk records.
"""

from __future__ import annotations

from .calls import Callee, NoResolver, Resolver, object_params
from .model import MAX_DEPTH, TENSOR_ATTRS, CallRecord, Def, Env, Flow, Frame, Scope, Vals
from .walker import FlowWalker

__all__ = [
    "MAX_DEPTH",
    "TENSOR_ATTRS",
    "CallRecord",
    "Callee",
    "Def",
    "Env",
    "Flow",
    "FlowWalker",
    "Frame",
    "NoResolver",
    "Resolver",
    "Scope",
    "Vals",
    "object_params",
]
