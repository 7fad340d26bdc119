"""The vLLM a plugin's tree runs on, read for what the tree itself lacks.

A plugin's modules import vLLM: its builder's ``CommonAttentionMetadata``,
its split function and the model runner that replays decode graphs for it
live in vLLM, not in the plugin's tree. A patchset reads those definitions
from the vLLM named with ``--vllm PATH`` (a source tree, an unpacked sdist
or the ``vllm`` package folder) or, when none is named and the tree is a
plugin's, from the ``vllm`` this Python would import, found with
``importlib.util.find_spec`` (nothing of vLLM runs). That vLLM is read,
never written: plans rewrite the tree's own files only.

Reading a tree that is itself vLLM's code against another vLLM would mix two
versions, so the importable vLLM is only consulted for a plugin's tree (no
``vllm`` package at, above or just below its root); a vLLM named with
``--vllm`` is what the user asked for and is read for any tree.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport.errors import UsageError

if TYPE_CHECKING:
    from gdn_backport.registry import Patchset
    from gdn_backport.tree import Tree

__all__ = ["Vllm", "inherited_notes", "is_plugin_tree", "vllm_package"]

GIVEN = "--vllm"
INSTALLED = "installed"


def _package(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def vllm_package(path: Path) -> Path:
    """The ``vllm`` package folder PATH names (itself, ``PATH/vllm``, or one
    folder down as in an unpacked sdist); UsageError naming PATH and why."""
    if not path.exists():
        why = "symbolic link to nothing" if path.is_symlink() else "no such file or directory"
        raise UsageError(f"--vllm {path}: {why}")
    if not path.is_dir():
        raise UsageError(
            f"--vllm {path}: not a folder (name a vLLM source tree or its vllm package folder)"
        )
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as exc:
        raise UsageError(f"--vllm {path}: cannot read ({exc.strerror})") from exc
    found: Path | None = None
    if path.name == "vllm" and _package(path):
        found = path
    elif _package(path / "vllm"):
        found = path / "vllm"
    else:
        with contextlib.suppress(OSError):
            down = [Path(e.path) / "vllm" for e in entries if e.is_dir()]
            found = next((d for d in down if _package(d)), None)
    if found is None:
        raise UsageError(
            f"--vllm {path}: not a vLLM (no vllm/__init__.py in it or one folder down, and it "
            "is not the vllm package itself)"
        )
    try:
        os.listdir(found)
        (found / "__init__.py").read_bytes()
    except OSError as exc:
        raise UsageError(f"--vllm {path}: cannot read {found} ({exc.strerror})") from exc
    return found.resolve()


def _importable() -> Path | None:
    """The folder ``import vllm`` would load, or None (not importable, a
    namespace package, a module): nothing to read then."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    locations = list(spec.submodule_search_locations or ())
    if len(locations) != 1:
        return None
    folder = Path(locations[0])
    return folder.resolve() if _package(folder) else None


def is_plugin_tree(root: Path) -> bool:
    """``root`` holds no vLLM of its own: no ``vllm`` package at it, above
    it (a folder inside vLLM) or just below it (a checkout, an sdist)."""
    if _package(root / "vllm"):
        return False
    if any(p.name == "vllm" and _package(p) for p in [root, *root.parents]):
        return False
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if entry.is_dir() and _package(Path(entry.path) / "vllm"):
                return False
    return True


class Vllm:
    """The vLLM a tree is read against: the one named (``given``, checked
    now: bad input is a usage error before anything runs) or, on first
    use, the importable one. ``read`` lists what was taken from it, in the
    order asked, for the output's line."""

    def __init__(self, given: Path | None = None) -> None:
        self.given = given
        self._package = vllm_package(given) if given is not None else None
        self._looked = given is not None
        self._tree: Tree | None = None
        self.read: list[str] = []
        # What a patchset made of this vLLM, kept for the run (by patchset id).
        self.memo: dict[str, object] = {}
        # What a patchset has to say of this vLLM and the tree together.
        self.notes: list[str] = []

    @property
    def source(self) -> str:
        return GIVEN if self.given is not None else INSTALLED

    def package(self, root: Path) -> Path | None:
        """The package to read for the tree at ``root``; None when there is
        none (nothing named, and the tree is vLLM's own or no vllm is
        importable)."""
        if self.given is None and not is_plugin_tree(root):
            return None
        if not self._looked:
            self._looked = True
            self._package = _importable()
        return self._package

    def tree(self, root: Path) -> Tree | None:
        """The package as a tree of its own (paths relative to the folder
        holding it), made once."""
        package = self.package(root)
        if package is None:
            return None
        if self._tree is None:
            from gdn_backport.tree import Tree

            self._tree = Tree.of(package, package.parent)
        return self._tree

    def used(self, what: str) -> None:
        if what not in self.read:
            self.read.append(what)

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def where(self) -> str:
        """The vLLM in a refusal's words."""
        return f"the vLLM at {self._package} ({self._origin()})"

    def _origin(self) -> str:
        return f"--vllm {self.given}" if self.given is not None else "the vllm this Python imports"

    def lines(self) -> list[str]:
        """The human output: where the facts came from, then the notes;
        nothing when nothing was read and nothing was named."""
        if not self.read and self.given is None:
            return []
        from gdn_backport import vllm_version

        assert self._package is not None
        found = vllm_version.detect(self._package)
        version = f"vLLM {found.version}" if found is not None else "version unknown"
        what = ", ".join(self.read) if self.read else "nothing needed from it"
        return [f"vllm read: {self._package} ({self._origin()}; {version}): {what}", *self.notes]

    def to_json(self) -> dict[str, object] | None:
        """The JSON addition (``vllm_context``); None as for :meth:`lines`."""
        if not self.read and self.given is None:
            return None
        from gdn_backport import vllm_version

        assert self._package is not None
        return {
            "package": str(self._package),
            "source": self.source,
            "vllm_version": vllm_version.to_json(vllm_version.detect(self._package)),
            "read": list(self.read),
            "notes": list(self.notes),
        }


def _supers(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The methods ``fn`` calls on ``super()``."""
    return {
        n.func.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Call)
        and isinstance(n.func.value.func, ast.Name)
        and n.func.value.func.id == "super"
    }


def _module_file(package: Path, dotted: str) -> Path | None:
    """The file of vLLM module ``dotted`` (``vllm.a.b``) in ``package``."""
    parts = dotted.split(".")
    if parts[0] != "vllm" or len(parts) < 2:
        return None
    base = package.joinpath(*parts[1:])
    for file in (base.with_suffix(".py"), base / "__init__.py"):
        if file.is_file():
            return file
    return None


def inherited_notes(tree: Tree, chosen: Sequence[Patchset]) -> None:
    """Classes of a plugin's tree that run a site of the vLLM by
    inheritance: the method not overridden, or overridden and handed on
    with ``super().method(...)``. The site is vLLM's (only that vLLM's
    tree can be patched): a note names it and its status where it is not
    clean. One level: the base's own bases are not followed."""
    ctx = tree.vllm
    package = ctx.package(tree.root) if ctx is not None else None
    # vLLM's own tree holds its bases: the patchsets' scans see them there.
    if ctx is None or package is None or not is_plugin_tree(tree.root):
        return
    from gdn_backport import files
    from gdn_backport.site import Status

    # (module, class) -> its subclasses: (name, methods defined, methods handed on)
    bases: dict[tuple[str, str], set[tuple[str, frozenset[str], frozenset[str]]]] = {}
    for file in tree.walk().files:
        with contextlib.suppress(OSError, UsageError, SyntaxError):
            data = tree.read(file)
            if b"vllm" not in data or b"class " not in data:
                continue
            module = tree.parse(file)
            imports = files.module_imports(module)
            for cls in ast.walk(module):
                if not isinstance(cls, ast.ClassDef):
                    continue
                defs = [
                    f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                user = (
                    cls.name,
                    frozenset(f.name for f in defs),
                    frozenset(m for f in defs for m in _supers(f)),
                )
                for base in cls.bases:
                    dotted = imports.get(base.id, "") if isinstance(base, ast.Name) else ""
                    if not dotted.startswith("vllm."):
                        continue
                    where, name = dotted.rsplit(".", 1)
                    bases.setdefault((where, name), set()).add(user)
    for (where, name), users in sorted(bases.items()):
        source = _module_file(package, where)
        if source is None:
            continue
        for ps in chosen:
            key = f"inherited:{ps.info.id}:{source}"
            if key not in ctx.memo:
                from gdn_backport.tree import Tree

                try:
                    ctx.memo[key] = ps.scan(Tree.of(source, package.parent))
                except UsageError as exc:
                    # After an apply wrote: a note, never a refusal of what is done.
                    ctx.memo[key] = []
                    ctx.note(f"note: {ps.info.id}: {name} of that vLLM not read: {exc}")
            sites = ctx.memo[key]
            assert isinstance(sites, list)
            ctx.used(f"{name} (a base class)")
            for site in sites:
                cls_name, _, method = site.function.partition(".")
                if cls_name != name or site.status in (Status.FIXED, Status.NOT_AFFECTED):
                    continue
                for sub, own, handed in sorted(users, key=lambda u: u[0]):
                    if method in own and method not in handed:
                        continue
                    how = "hands on to" if method in own else "inherits"
                    ctx.note(
                        f"note: {ps.info.id}: {sub}.{method} {how} {site.function} of that "
                        f"vLLM ({site.path}:{site.line}), {site.status.value}: {site.reason}; "
                        f"apply {ps.info.id} to that vLLM"
                    )
