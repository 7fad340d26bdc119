"""Load a patchset definition (``patchsets/*.toml``) into frozen dataclasses.

Validation happens here, once: a malformed file is reported with its path
and the offending key, so the analysis can trust every field it reads.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from gdn_backport.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class KernelSpec:
    name: str
    params: tuple[str, ...]
    rows: tuple[str, ...]
    gates: tuple[str, ...]
    state_indices: str
    accepted: str
    fix_target: bool = False
    token_index: str | None = None

    def bind(self, position: int) -> str | None:
        return self.params[position] if position < len(self.params) else None


@dataclass(frozen=True)
class Fields:
    spec_index: frozenset[str]
    non_spec_index: frozenset[str]
    spec_state: frozenset[str]
    non_spec_state: frozenset[str]


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
    kernels: dict[str, KernelSpec]


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


def parse(data: dict[str, Any], where: str) -> Patchset:
    fields = _get(data, "fields", dict, where)
    kernels: dict[str, KernelSpec] = {}
    for i, k in enumerate(_get(data, "kernel", list, where)):
        kw = f"{where}: kernel[{i}]"
        spec = KernelSpec(
            name=_get(k, "name", str, kw),
            params=_names(k, "params", kw),
            rows=_names(k, "rows", kw),
            gates=_names(k, "gates", kw),
            state_indices=_get(k, "state_indices", str, kw),
            accepted=_get(k, "accepted", str, kw),
            fix_target=bool(k.get("fix_target", False)),
            token_index=k.get("token_index"),
        )
        if spec.name in kernels:
            raise UsageError(f"{kw}: kernel '{spec.name}' defined twice")
        kernels[spec.name] = spec
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
    )


@cache
def load(name: str = "pr51812") -> Patchset:
    """The patchset shipped with the package (``patchsets/<name>.toml``)."""
    res = resources.files("gdn_backport._patchsets").joinpath(f"{name}.toml")
    where = f"patchsets/{name}.toml"
    try:
        data = tomllib.loads(res.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise UsageError(f"{where}: no such patchset") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{where}: {exc}") from exc
    return parse(data, where)
