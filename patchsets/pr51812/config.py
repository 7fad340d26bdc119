"""Load a patchset definition (``patchsets/*.toml``) into frozen dataclasses.

Validation happens here, once: a malformed file is reported with its path
and the offending key, so the analysis can trust every field it reads.

A fork declares its own kernels in the same ``[[kernel]]`` format, in its
tree (``.gdn-backport.toml`` at the root, or ``[tool.gdn-backport]`` in its
``pyproject.toml``) or in a file given with ``--kernels``: see
:func:`declared_kernels`. A declaration only adds knowledge: it cannot
redefine a kernel or a benign call of the patchset.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gdn_backport.errors import UsageError

if TYPE_CHECKING:
    from gdn_backport.tree import Tree

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class KernelSpec:
    name: str  # the callee's name; a declaration may give a dotted one (torch.ops.x.y)
    params: tuple[str, ...]
    rows: tuple[str, ...]
    gates: tuple[str, ...]
    state_indices: str
    accepted: str | None
    fix_target: bool = False
    token_index: str | None = None
    declared_in: str | None = None  # the file that declared it (None: the patchset)

    def bind(self, position: int) -> str | None:
        return self.params[position] if position < len(self.params) else None

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    def matches(self, callee: str) -> bool:
        """``callee`` (a dotted name, import aliases resolved) is this kernel."""
        if "." not in self.name:
            return callee.rsplit(".", 1)[-1] == self.name
        return callee == self.name or callee.endswith("." + self.name)


@dataclass(frozen=True)
class Fields:
    spec_index: frozenset[str]
    non_spec_index: frozenset[str]
    spec_state: frozenset[str]
    non_spec_state: frozenset[str]


@dataclass(frozen=True)
class SweepNames:
    """What the sweep (:mod:`.sweep`) leaves out of the calls
    handed the spec index or slots, by callee name (``[sweep]``): calls that
    select rows (their result: rows), that move or view a value (their
    result: that value), that read a shape or a flag (their result: none)."""

    row_selection: frozenset[str] = frozenset()
    plumbing: frozenset[str] = frozenset()
    metadata: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Patchset:
    id: str
    upstream: str
    title: str
    trailer: str
    strategies: tuple[str, ...]
    codemods: dict[str, str]
    fields: Fields
    benign: frozenset[str]
    kernels: dict[str, KernelSpec]  # by short name
    # Functions that pick rows like ``x.index_select(0, index)`` and return
    # ``x`` itself for ``index=None``, by dotted name: the guarded kernel
    # call site's ``gather_token_rows``.
    row_gathers: frozenset[str] = frozenset()
    sweep: SweepNames = SweepNames()
    # Functions (by short name) that return per-token tensors shaped
    # ``[1, T, ...]`` (``fused_gdn_gating``): their token axis is dim 1.
    leading_one: frozenset[str] = frozenset()

    def kernel_for(self, callee: str | None) -> KernelSpec | None:
        """The kernel a call of ``callee`` is, if any."""
        if not callee:
            return None
        spec = self.kernels.get(callee.rsplit(".", 1)[-1])
        return spec if spec is not None and spec.matches(callee) else None

    def names(self) -> frozenset[str]:
        """Every field, kernel and benign name: text that marks code worth a look."""
        f = self.fields
        return frozenset({*f.spec_index, *f.spec_state, *(k.short for k in self.kernels.values())})

    def with_kernels(self, extra: Iterable[KernelSpec]) -> Patchset:
        """This patchset plus a fork's declared kernels."""
        kernels = dict(self.kernels)
        for spec in extra:
            where = spec.declared_in or "a declaration"
            if spec.short in self.kernels or spec.short in self.benign:
                raise UsageError(
                    f"{where}: kernel '{spec.name}' is already known to patchset "
                    f"{self.id}; a declaration cannot redefine it"
                )
            if spec.short in kernels:
                raise UsageError(f"{where}: kernel '{spec.name}' is declared twice")
            kernels[spec.short] = spec
        return replace(self, kernels=kernels)


def _get(table: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in table:
        raise UsageError(f"{where}: missing key '{key}'")
    value = table[key]
    if not isinstance(value, kind):
        raise UsageError(f"{where}: key '{key}' must be {kind.__name__}")
    return value


def _names(table: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = _get(table, key, list, where)
    if not all(isinstance(v, str) and v.isidentifier() for v in value):
        raise UsageError(f"{where}: key '{key}' must list identifiers")
    return tuple(value)


_KERNEL_KEYS = frozenset(
    {"name", "params", "rows", "gates", "state_indices", "accepted", "fix_target", "token_index"}
)


def parse_kernel(k: Any, where: str, declared_in: str | None = None) -> KernelSpec:
    """One ``[[kernel]]`` table, checked: every role names a parameter."""
    if not isinstance(k, dict):
        raise UsageError(f"{where}: must be a table")
    unknown = sorted(set(k) - _KERNEL_KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown key '{unknown[0]}'")
    name = _get(k, "name", str, where)
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise UsageError(f"{where}: key 'name' must be a (dotted) identifier")
    params = _names(k, "params", where)
    accepted = k.get("accepted") or None
    if accepted is not None and not isinstance(accepted, str):
        raise UsageError(f"{where}: key 'accepted' must be str")
    fix_target = k.get("fix_target", False)
    if not isinstance(fix_target, bool):
        raise UsageError(f"{where}: key 'fix_target' must be true or false")
    spec = KernelSpec(
        name=name,
        params=params,
        rows=_names(k, "rows", where),
        gates=_names(k, "gates", where),
        state_indices=_get(k, "state_indices", str, where),
        accepted=accepted,
        fix_target=fix_target,
        token_index=k.get("token_index"),
        declared_in=declared_in,
    )
    if len(set(params)) != len(params):
        raise UsageError(f"{where}: key 'params' names a parameter twice")
    if not spec.rows or not spec.gates:
        raise UsageError(f"{where}: keys 'rows' and 'gates' must each name a parameter")
    roles = [*spec.rows, *spec.gates, spec.state_indices]
    if spec.accepted:
        roles.append(spec.accepted)
    # The shipped table may name keyword-only parameters beyond the
    # positional order it lists (``fused_recurrent_kda``'s g/beta); a fork's
    # declaration must name parameters it lists.
    for role in roles if declared_in is not None else ():
        if role not in params:
            raise UsageError(f"{where}: '{role}' is not one of its params")
    return spec


def parse(data: dict[str, Any], where: str) -> Patchset:
    fields = _get(data, "fields", dict, where)
    kernels: dict[str, KernelSpec] = {}
    for i, k in enumerate(_get(data, "kernel", list, where)):
        kw = f"{where}: kernel[{i}]"
        spec = parse_kernel(k, kw)
        if spec.short in kernels:
            raise UsageError(f"{kw}: kernel '{spec.name}' defined twice")
        kernels[spec.short] = spec
    return Patchset(
        id=_get(data, "id", str, where),
        upstream=_get(data, "upstream", str, where),
        title=_get(data, "title", str, where),
        trailer=_get(data, "trailer", str, where),
        strategies=_names(data, "strategies", where),
        codemods=dict(_get(data, "codemods", dict, where)),
        fields=Fields(
            spec_index=frozenset(_names(fields, "spec_index", f"{where}: fields")),
            non_spec_index=frozenset(_names(fields, "non_spec_index", f"{where}: fields")),
            spec_state=frozenset(_names(fields, "spec_state", f"{where}: fields")),
            non_spec_state=frozenset(_names(fields, "non_spec_state", f"{where}: fields")),
        ),
        benign=frozenset(_names(_get(data, "benign", dict, where), "names", where)),
        kernels=kernels,
        row_gathers=_row_gathers(data, where),
        sweep=_sweep(data, where),
        leading_one=frozenset(
            _names(_get(data, "layout", dict, where), "leading_one", f"{where}: layout")
        )
        if "layout" in data
        else frozenset(),
    )


def _row_gathers(data: dict[str, Any], where: str) -> frozenset[str]:
    table = data.get("row_gather")
    if table is None:
        return frozenset()
    if not isinstance(table, dict):
        raise UsageError(f"{where}: key 'row_gather' must be a table")
    names = _get(table, "names", list, f"{where}: row_gather")
    if not all(isinstance(n, str) and all(p.isidentifier() for p in n.split(".")) for n in names):
        raise UsageError(f"{where}: row_gather: key 'names' must list dotted names")
    if _names(table, "params", f"{where}: row_gather") != ("x", "index"):
        raise UsageError(f'{where}: row_gather: params must be ["x", "index"]')
    return frozenset(names)


def _sweep(data: dict[str, Any], where: str) -> SweepNames:
    table = data.get("sweep")
    if table is None:
        return SweepNames()
    if not isinstance(table, dict):
        raise UsageError(f"{where}: key 'sweep' must be a table")
    keys = ("row_selection", "plumbing", "metadata")
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise UsageError(f"{where}: sweep: unknown key '{unknown[0]}'")
    lists = {k: frozenset(_names(table, k, f"{where}: sweep")) for k in keys if k in table}
    return SweepNames(**lists)


@cache
def load() -> Patchset:
    """This patchset's ``patchset.toml``, parsed and checked."""
    from . import PATCHSET

    return parse(PATCHSET.info.data, PATCHSET.info.where)


# --- a fork's own kernels --------------------------------------------------

OVERLAY = ".gdn-backport.toml"


def _regular(path: Path) -> None:
    """UsageError (naming ``path``) unless it is a regular file, through a
    link or not: a folder, a dangling link or a FIFO of a declaration's
    name is a broken declaration, never one that is not there."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        why = "a symbolic link to nothing" if path.is_symlink() else "no such file"
        raise UsageError(f"{path}: {why}") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
    if stat.S_ISDIR(mode):
        raise UsageError(f"{path}: a folder, not a TOML file of kernel declarations")
    if not stat.S_ISREG(mode):
        raise UsageError(f"{path}: not a regular file")


def _read_toml(path: Path) -> dict[str, Any]:
    _regular(path)
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror})") from exc
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: not valid TOML ({exc})") from exc
    return data


# What a declaration holds: ``[[kernel]]`` tables, nothing else (a typo of a
# key, ``kernels`` or ``[kernal]``, would be a declaration silently not there).
_DECLARATION_KEYS = frozenset({"kernel"})


def _kernels_in(table: dict[str, Any], where: str, file: Path) -> list[KernelSpec]:
    unknown = sorted(set(table) - _DECLARATION_KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown key '{unknown[0]}'")
    kernels = table.get("kernel", [])
    if not isinstance(kernels, list):
        raise UsageError(f"{where}: 'kernel' must be an array of tables ([[kernel]])")
    return [parse_kernel(k, f"{where}: kernel[{i}]", str(file)) for i, k in enumerate(kernels)]


def declaration_files(root: Path) -> list[Path]:
    """Where a tree declares its kernels: ``.gdn-backport.toml`` and
    ``pyproject.toml`` in ``root`` (the folder scanned, or for one file its
    folder and the folders above it up to the git work tree's top)."""
    # Whatever holds a declaration's name counts (lexists): read, it is
    # refused unless it is a readable regular file.
    folders = [root]
    if not os.path.lexists(root / OVERLAY) and not os.path.lexists(root / "pyproject.toml"):
        for parent in root.parents:
            folders.append(parent)
            if (parent / ".git").exists() or os.path.lexists(parent / OVERLAY):
                break
    for folder in folders:
        found = [p for p in (folder / OVERLAY, folder / "pyproject.toml") if os.path.lexists(p)]
        if found:
            return found
    return []


def declared_kernels(root: Path | None, files: Sequence[Path] = ()) -> list[KernelSpec]:
    """The kernels a tree declares, plus those of ``--kernels`` files."""
    out: list[KernelSpec] = []
    for file in [*(declaration_files(root) if root is not None else []), *files]:
        data = _read_toml(file)
        if file.name == "pyproject.toml":
            tool = data.get("tool", {})
            table = tool.get("gdn-backport") if isinstance(tool, dict) else None
            if table is None:
                continue
            if not isinstance(table, dict):
                raise UsageError(f"{file}: [tool.gdn-backport] must be a table")
            out += _kernels_in(table, f"{file}: [tool.gdn-backport]", file)
        else:
            out += _kernels_in(data, str(file), file)
    return out


def for_tree(root: Path | None, files: Sequence[Path] = ()) -> Patchset:
    """The shipped patchset with the kernels ``root`` (and ``files``) declare."""
    extra = declared_kernels(root, files)
    return load().with_kernels(extra) if extra else load()


def config_for(tree: Tree) -> Patchset:
    """The patchset's data with the kernels the tree (and ``--kernels``) declares."""
    return for_tree(tree.path if tree.path.is_dir() else tree.root, tree.kernels)
