"""Shims for compiled Triton that vLLM's kernels need when the harness runs them.

Used on the GPU (the interpreter's own gaps are :mod:`.interpreter`'s job):
a runtime allocator like the one vLLM installs at start-up, autotuners pinned
to their first config (the suite checks numbers, not speed), and
``do_not_specialize`` flags that newer Tritons refuse on constexprs.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["install_triton_allocator", "pin_autotuners", "unlist_specialized_constexprs"]


def install_triton_allocator(device: torch.device) -> bool:
    """Give Triton a torch-backed allocator for kernels' runtime scratch memory.

    Some FLA kernels (seen: ``merge_fn`` launched through the autotuner, on
    an H200 with triton 3.6) ask Triton for global scratch memory; without
    an allocator Triton raises "Kernel requires a runtime memory allocation,
    but no allocator was set". vLLM sets one at start-up; the harness does the
    same before the tree's kernels run on CUDA. Triton keeps it in a context
    variable, so it is (re)installed each time a tree becomes active; the
    allocation comes from torch's caching allocator on the harness's device.
    Older Tritons without ``set_allocator`` need none: returns False then.
    """
    import triton

    set_allocator = getattr(triton, "set_allocator", None)
    if set_allocator is None:
        return False

    def allocate(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, device=device, dtype=torch.int8)

    set_allocator(allocate)
    return True


def _triton_objects(modules: Iterable[types.ModuleType]) -> Iterator[Any]:
    """Every module global and what it wraps: ``@triton.heuristics`` /
    ``@triton.autotune`` / ``@triton.jit`` nest, so ``.fn`` is followed down."""
    seen: set[int] = set()
    for module in modules:
        for value in list(vars(module).values()):
            while value is not None and id(value) not in seen:
                seen.add(id(value))
                yield value
                value = getattr(value, "fn", None)


def pin_autotuners(modules: Iterable[types.ModuleType]) -> int:
    """Make every Triton autotuner of ``modules`` use its first config only.

    The suite checks numbers, not speed, and on a GPU each autotuned FLA
    kernel otherwise benchmarks all its configs for every new shape (about
    100 s per release and shape on an H200 with triton 3.6). The first config
    is one the kernel's authors list as valid; a config a shape cannot use
    fails loudly, never silently. ``GDN_BACKPORT_AUTOTUNE=1`` keeps tuning.
    Returns how many autotuners were pinned.
    """
    if os.environ.get("GDN_BACKPORT_AUTOTUNE") == "1":
        return 0
    from triton.runtime.autotuner import Autotuner

    pinned = 0
    for value in _triton_objects(modules):
        if isinstance(value, Autotuner) and len(value.configs) > 1:
            value.configs = value.configs[:1]
            pinned += 1
    return pinned


def unlist_specialized_constexprs(modules: Iterable[types.ModuleType]) -> int:
    """Take ``tl.constexpr`` parameters out of ``do_not_specialize`` lists.

    0.10.2's ``fused_recurrent_gated_delta_rule_fwd_kernel`` lists ``N: tl.constexpr``
    in ``do_not_specialize``, which the Triton of its day ignored (a constexpr
    is always specialised) and Triton 3.6 refuses to compile ("marked as
    constexpr and listed in do_not_specialize"). Dropping the flag compiles
    what the old Triton compiled. Returns how many parameters were changed.
    """
    from triton.runtime.jit import JITFunction

    changed = 0
    for value in _triton_objects(modules):
        if not isinstance(value, JITFunction):
            continue
        for param in value.params:
            if param.is_constexpr and (
                param.do_not_specialize or param.do_not_specialize_on_alignment
            ):
                param.do_not_specialize = param.do_not_specialize_on_alignment = False
                changed += 1
    return changed
