"""Fixes for gaps in Triton's CPU interpreter that vLLM's kernels run into.

Only used under ``TRITON_INTERPRET=1``; the compiled GPU path is untouched.

* Comparisons (``create_icmp*``/``create_fcmp*``) are typed with the operand
  type instead of ``int1`` (triton 3.6 - 3.9). A scalar comparison later
  splatted into a block then becomes an int64 mask and ``tl.load`` refuses it
  ("mask has unsupported dtype"); vLLM's ``_causal_conv1d_update_kernel``
  does exactly that (``conv_states_input_coord < num_cache_lines``). The
  patch gives comparison results the ``int1`` type the compiler gives them.
* A grid callable receives the very dict the kernel is then called with, so
  a grid that writes into its ``META`` argument (vLLM's ``causal_conv1d_fn``
  does ``META["batch_ptr"] = ...``) replaces a kernel argument by a raw
  tensor. Compiled Triton hands the grid a copy; so does the patch. And
  compiled Triton's grid sees the launch's torch tensors where the
  interpreter's sees converted pointers: ``causal_conv1d_fn`` before 0.11.1
  (no ``metadata``) fills ``META["batch_ptr"]`` from its grid
  (``nelement()``, ``copy_``). The patch gives the grid the torch tensors;
  on the CPU the interpreter's host copies share their storage, so what
  the grid writes is what the kernel reads.
* ``triton.autotune`` benchmarks each config through the GPU driver, which
  does not exist under the interpreter. Timing interpreted kernels would be
  meaningless anyway: every config scores the same, so the first one runs.
* ``tensor.__index__`` calls ``int()`` on a one-element 1-D array, which
  NumPy 2 refuses (triton 3.6); ``tl.range(seqlen)`` over a loaded length
  needs it. The patch takes the single element.
* The interpreter swaps ``tl.exp`` & co. for interpreted versions on the
  ``tl`` modules, but a kernel module that aliased a builtin
  (``exp = tl.exp`` in FLA's ``op.py``) still holds the original, which
  refuses to run outside a compiled kernel. The patch rebinds such aliases in
  the kernel's globals for the duration of the call.
* A compiled ``for i in range(n)`` gives the loop body a tensor ``i``; the
  interpreter runs the builtin ``range`` and gives an int, so FLA's
  ``i_t.to(tl.int64)`` fails. While an interpreted kernel runs, ``range`` in
  the kernel's module yields scalar tensors.
"""

from __future__ import annotations

import builtins
import threading
from typing import Any

__all__ = ["patch_interpreter"]

_MARK = "_gdn_backport_patched"


class _State(threading.local):
    depth = 0


_STATE = _State()


def _launch_tensors(executor: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """The torch tensors the kernel was launched with, by parameter name."""
    import inspect

    import torch

    args, kwargs = getattr(executor, "_gdn_launch_args", ((), {}))
    names = inspect.getfullargspec(executor.fn).args
    bound = dict(zip(names, args, strict=False))
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    return {k: v for k, v in bound.items() if k in meta and isinstance(v, torch.Tensor)}


def _kernel_range(*args: Any, **kwargs: Any) -> Any:
    """``range`` for kernel modules: scalar tensors inside a kernel, ints outside."""
    values = builtins.range(*(int(a) for a in args))
    if _STATE.depth == 0:
        return values
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    return (
        tl.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32) for i in values
    )


class _GlobalsAttr:
    """Attribute access onto a globals dict, for the interpreter's patch scope."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        object.__setattr__(self, "_ns", namespace)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._ns[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._ns[name] = value

    def __delattr__(self, name: str) -> None:
        del self._ns[name]


def patch_interpreter() -> list[str]:
    """Apply the fixes once per process; the names of the patched builders."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle
    patched: list[str] = []
    for name in dir(builder):
        if not name.startswith(("create_icmp", "create_fcmp")):
            continue
        original = getattr(builder, name)
        if getattr(original, _MARK, False):
            continue

        def compare(self: Any, lhs: Any, rhs: Any, _original: Any = original) -> Any:
            result = _original(self, lhs, rhs)
            return handle(np.asarray(result.data).astype(np.bool_), tl.int1)

        setattr(compare, _MARK, True)
        setattr(builder, name, compare)
        patched.append(name)

    executor = interpreter.GridExecutor
    init = executor.__init__
    if not getattr(init, _MARK, False):
        call = executor.__call__

        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            _STATE.depth += 1
            self._gdn_launch_args = (args, kwargs)
            try:
                return call(self, *args, **kwargs)
            finally:
                _STATE.depth -= 1
                self._gdn_launch_args = ((), {})

        executor.__call__ = __call__

        def __init__(self: Any, fn: Any, arg_names: Any, grid: Any, *rest: Any, **kw: Any) -> None:
            if callable(grid):
                original_grid = grid

                def grid(meta: Any) -> Any:
                    # Host code: the builtin range there (causal_conv1d_fn's grid
                    # builds its program list with it), not the kernel's.
                    depth, _STATE.depth = _STATE.depth, 0
                    try:
                        return original_grid({**meta, **_launch_tensors(self, meta)})
                    finally:
                        _STATE.depth = depth

            init(self, fn, arg_names, grid, *rest, **kw)

        setattr(__init__, _MARK, True)
        executor.__init__ = __init__
        patched.append("GridExecutor.__init__")

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is not None and not getattr(patch_tensor, _MARK, False):

        def _patch_lang_tensor(tensor: Any, scope: Any, _original: Any = patch_tensor) -> None:
            _original(tensor, scope)
            scope.set_attr(
                tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
            )

        setattr(_patch_lang_tensor, _MARK, True)
        interpreter._patch_lang_tensor = _patch_lang_tensor
        patched.append("_patch_lang_tensor")

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is not None and not getattr(patch_lang, _MARK, False):

        def _patch_lang(fn: Any, _original: Any = patch_lang) -> Any:
            scope = _original(fn)
            changes = getattr(scope, "_changes", None)
            if changes is None:
                return scope
            originals = {id(old): (obj, name) for obj, name, old in changes if callable(old)}
            holder = _GlobalsAttr(fn.__globals__)
            for name, value in list(fn.__globals__.items()):
                hit = originals.get(id(value)) if callable(value) else None
                if hit is not None:
                    scope.set_attr(holder, name, getattr(hit[0], hit[1]))
            if "range" not in fn.__globals__:
                fn.__globals__["range"] = _kernel_range
            return scope

        setattr(_patch_lang, _MARK, True)
        interpreter._patch_lang = _patch_lang
        patched.append("_patch_lang")

    from triton.runtime import autotuner

    bench = autotuner.Autotuner._bench
    if not getattr(bench, _MARK, False):

        def _bench(self: Any, *args: Any, config: Any, **meta: Any) -> list[float]:
            return [0.0, 0.0, 0.0]

        setattr(_bench, _MARK, True)
        autotuner.Autotuner._bench = _bench
        patched.append("Autotuner._bench")
    return patched
