"""The ``[builder]`` and ``[runner]`` tables of ``patchsets/pr51565.toml``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from gdn_backport.errors import UsageError


@dataclass(frozen=True)
class Config:
    split: str
    family: frozenset[str]
    seq_lens: frozenset[str]
    computed: frozenset[str]
    needs_fields: tuple[str, ...]
    needs_param: str
    v1_uniform: str
    v1_dispatch: str
    v1_force: str
    v1_computed: str
    v2_shape_only: str

    @property
    def prior_state(self) -> frozenset[str]:
        return self.seq_lens | self.computed


def _table(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    table = data.get(key)
    if not isinstance(table, dict):
        raise UsageError(f"{where}: missing table [{key}]")
    return table


def _str(table: dict[str, Any], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value.isidentifier():
        raise UsageError(f"{where}: key '{key}' must be an identifier")
    return value


def _strs(table: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = table.get(key)
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where}: key '{key}' must list identifiers")
    if not all(isinstance(v, str) and v.isidentifier() for v in value):
        raise UsageError(f"{where}: key '{key}' must list identifiers")
    return tuple(value)


def parse(data: dict[str, Any], where: str) -> Config:
    b = _table(data, "builder", where)
    r = _table(data, "runner", where)
    wb, wr = f"{where}: builder", f"{where}: runner"
    return Config(
        split=_str(b, "split", wb),
        family=frozenset(_strs(b, "family", wb)),
        seq_lens=frozenset(_strs(b, "seq_lens", wb)),
        computed=frozenset(_strs(b, "computed", wb)),
        needs_fields=_strs(b, "needs_fields", wb),
        needs_param=_str(b, "needs_param", wb),
        v1_uniform=_str(r, "v1_uniform", wr),
        v1_dispatch=_str(r, "v1_dispatch", wr),
        v1_force=_str(r, "v1_force", wr),
        v1_computed=_str(r, "v1_computed", wr),
        v2_shape_only=_str(r, "v2_shape_only", wr),
    )


@cache
def load() -> Config:
    """The ``[builder]`` and ``[runner]`` tables of this patchset's file."""
    from . import PATCHSET

    return parse(PATCHSET.info.data, PATCHSET.info.where)
