"""Load a tree's GDN module and its kernel modules from source, without vLLM.

A :class:`LoadedTree` owns a private set of ``vllm.*`` modules: the GDN
module, every kernel module it imports (any module with an ``ops`` package
on its path: Triton causal conv1d, the FLA ops), vLLM's small pure helpers,
the hand-written stand-ins of :mod:`.standins` and auto-stubs for the rest.
The modules live in ``sys.modules`` only inside :meth:`LoadedTree.active`,
so several trees (or an installed vLLM) can be used in one process.

On CPU the Triton kernels run under the interpreter: ``TRITON_INTERPRET=1``
must be in the environment before the tree is loaded (``triton.jit`` decides
at decoration time); :func:`load_tree` refuses otherwise.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gdn_backport import files
from gdn_backport.errors import UsageError
from gdn_backport.harness.standins import (
    STANDIN_BUILDERS,
    HarnessContext,
    make_stub,
    make_stub_module,
    module_constants,
)
from gdn_backport.harness.triton_runtime import (
    install_triton_allocator,
    pin_autotuners,
    unlist_specialized_constexprs,
)

__all__ = [
    "GdnSite",
    "HarnessError",
    "LoadedTree",
    "find_gdn_sites",
    "load_tree",
]

# Third-party packages the GDN modules import only for class definitions.
_STUBBED_TOP_LEVEL = ("transformers",)
# Pure helper modules of vLLM loaded from the tree as they are.
_REAL_HELPERS = ("vllm.utils.math_utils",)
_CORE_PARAMS = ("mixed_qkv", "b", "a", "core_attn_out")
# Before 0.11.1 one method ran the input projections, the GDN core and the
# gated norm / output projection: _forward(hidden_states, output).
_FORWARD_PARAMS = ("hidden_states", "output")


class HarnessError(RuntimeError):
    """The harness cannot drive this tree; the message names the missing piece."""


@dataclass(frozen=True)
class GdnSite:
    """One GDN layer class whose ``_forward_core`` (or, before 0.11.1,
    ``_forward``) the harness can drive."""

    path: Path  # the file, inside the tree
    module: str  # its dotted module name
    cls: str  # the class defining the method
    method: str = "_forward_core"

    def __str__(self) -> str:
        return f"{self.module}.{self.cls}.{self.method}"


def _module_name(tree: Path, path: Path) -> str:
    rel = path.relative_to(tree).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _forward_core_params(fn: ast.FunctionDef) -> tuple[str, ...]:
    return tuple(arg.arg for arg in fn.args.args[1:])


def _site_method(methods: dict[str, ast.FunctionDef]) -> str | None:
    if "rearrange_mixed_qkv" not in methods:
        return None
    core = methods.get("_forward_core")
    if core is not None and _forward_core_params(core) == _CORE_PARAMS:
        return "_forward_core"
    whole = methods.get("_forward")
    if (
        whole is not None
        and _forward_core_params(whole) == _FORWARD_PARAMS
        and "fix_query_key_value_ordering" in methods
    ):
        return "_forward"
    return None


def find_gdn_sites(tree: Path) -> list[GdnSite]:
    """Classes in ``tree/vllm`` with ``_forward_core(self, mixed_qkv, b, a, core_attn_out)``
    that gather rows by ``spec_token_indx`` and whose layer splits packed QKV
    with ``rearrange_mixed_qkv``: the Qwen GDN layer in every release that has
    it (OLMo and Kimi layers take other inputs). Before 0.11.1 the layer had
    ``_forward(self, hidden_states, output)`` around the same core, selecting
    rows by ``spec_token_masks``, and ``fix_query_key_value_ordering``; such
    a class is a site with method ``_forward``. Qwen-named files come first.
    """
    root = tree / "vllm"
    if not root.is_dir():
        raise HarnessError(f"{tree}: no vllm/ package below it")
    sites: list[GdnSite] = []
    # scan's own walk: no records (.gdn-backport/originals hold the affected
    # originals of a patched tree), no VCS or cache folders; links followed.
    # Decoded as scan and Python decode it (PEP 263).
    for path in files.python_files(root):
        try:
            text = files.decode(path, path.read_bytes())
        except (OSError, UsageError):
            continue
        if not (
            ("def _forward_core" in text and "spec_token_indx" in text)
            or ("def _forward(" in text and "spec_token_masks" in text)
        ):
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
            method = _site_method(methods)
            if method is None:
                continue
            sites.append(GdnSite(path, _module_name(tree, path), node.name, method))
    sites.sort(key=lambda s: ("qwen" not in s.path.name, str(s.path)))
    return sites


def _is_real(name: str, gdn_module: str) -> bool:
    parts = name.split(".")
    return name == gdn_module or "ops" in parts[1:] or name in _REAL_HELPERS


def _intermediate_package(name: str, base: Path) -> types.ModuleType:
    """A package whose ``__init__`` is skipped: submodules load from ``base``,
    other names (what the real ``__init__`` re-exports) are auto-stubs."""
    package = types.ModuleType(name, "harness: package without its __init__")
    package.__path__ = [str(base)]

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        if (base / attr).is_dir() or (base / f"{attr}.py").is_file():
            return importlib.import_module(f"{name}.{attr}")
        stub = make_stub(f"{name}.{attr}")
        setattr(package, attr, stub)
        return stub

    package.__getattr__ = __getattr__  # type: ignore[method-assign]
    return package


def _owned(name: str) -> bool:
    top = name.split(".", 1)[0]
    return top == "vllm" or top in _STUBBED_TOP_LEVEL


class _StandinLoader(importlib.abc.Loader):
    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _TreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, loaded: LoadedTree) -> None:
        self._loaded = loaded

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if _owned(fullname):
            return self._loaded._spec_for(fullname)
        return None


@dataclass
class LoadedTree:
    """A tree's GDN module and kernels, loaded privately (see module docs)."""

    tree: Path
    site: GdnSite
    context: HarnessContext
    interpreted: bool
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    stubbed: set[str] = field(default_factory=set)
    real: set[str] = field(default_factory=set)
    module: types.ModuleType | None = None
    layer_class: type | None = None
    _depth: int = field(default=0, repr=False)

    def _spec_for(self, name: str) -> importlib.machinery.ModuleSpec:
        builder = STANDIN_BUILDERS.get(name)
        if builder is not None:
            module = builder(self.context)
            is_pkg = hasattr(module, "__path__")
            return importlib.machinery.ModuleSpec(name, _StandinLoader(module), is_package=is_pkg)
        if name.split(".", 1)[0] == "vllm":
            base = self.tree.joinpath(*name.split("."))
            if _is_real(name, self.site.module):
                init = base / "__init__.py"
                if init.is_file():
                    self.real.add(name)
                    return importlib.util.spec_from_file_location(  # type: ignore[return-value]
                        name, init, submodule_search_locations=[str(base)]
                    )
                source = base.with_suffix(".py")
                if source.is_file():
                    self.real.add(name)
                    return importlib.util.spec_from_file_location(name, source)  # type: ignore[return-value]
            elif base.is_dir():
                # An intermediate package: its __init__ is not run.
                package = _intermediate_package(name, base)
                return importlib.machinery.ModuleSpec(
                    name, _StandinLoader(package), is_package=True
                )
        self.stubbed.add(name)
        stub = make_stub_module(name)
        if name.split(".", 1)[0] == "vllm":
            # Module-level literal constants are real values from the tree's
            # file (e.g. PAD_SLOT_ID, which older kernels import from
            # vllm.attention.backends.utils and compare against slot indices).
            base = self.tree.joinpath(*name.split("."))
            for source in (base.with_suffix(".py"), base / "__init__.py"):
                stub.__dict__.update(module_constants(source))
        return importlib.machinery.ModuleSpec(name, _StandinLoader(stub), is_package=True)

    @contextlib.contextmanager
    def active(self) -> Iterator[LoadedTree]:
        """Put this tree's modules in ``sys.modules`` (and take them out after).

        Re-entrant: a nested ``active()`` of the same tree changes nothing
        (swapping the modules walks all of ``sys.modules``, twice)."""
        if self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _owned(name)}
        sys.modules.update(self.modules)
        finder = _TreeFinder(self)
        sys.meta_path.insert(0, finder)
        cuda_device = torch.cuda.device
        if self.context.device.type == "cuda":
            install_triton_allocator(self.context.device)
        if self.context.device.type == "cpu":
            # Older FLA wrappers enter torch.cuda.device(t.device.index), None
            # for a CPU tensor, which a CPU-only torch refuses.
            torch.cuda.device = _cpu_device  # type: ignore[misc,assignment]
        # The tree under test is the user's (a fork's checkout, a patched
        # copy): loading it must leave no __pycache__ in it.
        writes_bytecode = sys.dont_write_bytecode
        sys.dont_write_bytecode = True
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            sys.dont_write_bytecode = writes_bytecode
            torch.cuda.device = cuda_device  # type: ignore[misc]
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if _owned(n)]:
                self.modules[name] = sys.modules.pop(name)
            sys.modules.update(saved)

    def load_source(self, name: str) -> types.ModuleType | None:
        """One more of the tree's modules run from its source, in place of
        its stand-in (for a suite that drives more of the tree than the
        layer, such as its metadata builder); None where the tree
        has no such file (older layouts). Call it with the tree active; a
        module that fails to import leaves ``sys.modules`` as it was."""
        path = self.tree.joinpath(*name.split(".")).with_suffix(".py")
        if not path.is_file():
            return None
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        previous = sys.modules.get(name)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
            raise
        self.real.add(name)
        return module

    def global_(self, name: str) -> Any:
        assert self.module is not None
        return self.module.__dict__[name]


def _cpu_device(index: Any = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _check_interpreter(device: str) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.startswith("cpu") and not interpreted:
        raise HarnessError(
            "device cpu needs TRITON_INTERPRET=1 in the environment before the tree "
            "is loaded (gdn_backport.verify.verify_tree sets it for you)"
        )
    return interpreted


def load_tree(tree: Path, device: str = "cpu", site: GdnSite | None = None) -> LoadedTree:
    """Load ``tree``'s GDN module (the first site of :func:`find_gdn_sites`);
    ``tree`` holds ``vllm/``, or is that ``vllm/`` package itself."""
    tree = Path(tree).resolve()
    if not (tree / "vllm").is_dir() and tree.name == "vllm" and (tree / "__init__.py").is_file():
        tree = tree.parent
    interpreted = _check_interpreter(device)
    if interpreted:
        from gdn_backport.harness.interpreter import patch_interpreter

        patch_interpreter()
    if site is None:
        sites = find_gdn_sites(tree)
        if not sites:
            raise HarnessError(
                f"{tree}: no class with _forward_core(self, {', '.join(_CORE_PARAMS)}) "
                "that gathers by spec_token_indx, nor one with "
                f"_forward(self, {', '.join(_FORWARD_PARAMS)}) that masks by spec_token_masks"
            )
        site = sites[0]
    loaded = LoadedTree(
        tree=tree, site=site, context=HarnessContext(tree, device), interpreted=interpreted
    )
    with loaded.active():
        try:
            module = importlib.import_module(site.module)
        except Exception as exc:
            raise HarnessError(
                f"{site.path}: cannot import {site.module} with the harness stand-ins: "
                f"{type(exc).__name__}: {exc} (auto-stubbed: {sorted(loaded.stubbed)})"
            ) from exc
    loaded.module = module
    layer_class = module.__dict__.get(site.cls)
    if not isinstance(layer_class, type):
        raise HarnessError(f"{site.path}: class {site.cls} not found after import")
    loaded.layer_class = layer_class
    if not loaded.interpreted:
        pin_autotuners(loaded.modules.values())
        unlist_specialized_constexprs(loaded.modules.values())
    return loaded
