"""The one TOML loader: patchset files, the matrix, a fork's declarations.

Data is read into plain dicts here and checked by typed getters that name the
file and the key of anything wrong (a :class:`UsageError`, exit 2), so the
code that reads a field can trust it. Behaviour stays in code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gdn_backport.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

T = TypeVar("T")
_MISSING: Any = object()


class Readable(Protocol):
    def read_text(self, encoding: str = ...) -> str: ...


def loads(text: str, where: str) -> dict[str, Any]:
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{where}: not valid TOML ({exc})") from exc
    return data


def load(source: Path | Readable, where: str | None = None) -> dict[str, Any]:
    """A TOML document from a file (or a package resource), checked to be one."""
    where = where or str(source)
    if isinstance(source, Path) and source.exists() and not source.is_file():
        raise UsageError(f"{where}: not a regular file")
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise UsageError(f"{where}: no such file") from exc
    except OSError as exc:
        raise UsageError(f"{where}: cannot read ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: not valid TOML (not UTF-8: {exc.reason})") from exc
    return loads(text, where)


def get(table: dict[str, Any], key: str, kind: type[T], where: str, default: Any = _MISSING) -> T:
    """``table[key]``, which must be a ``kind`` (``default`` when missing,
    if one is given)."""
    if key not in table:
        if default is not _MISSING:
            return default  # type: ignore[no-any-return]
        raise UsageError(f"{where}: missing key '{key}'")
    value = table[key]
    # bool is an int: a flag is not a count, and a count is not a flag.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UsageError(f"{where}: key '{key}' must be {_kind_name(kind)}")
    return value


def _kind_name(kind: type) -> str:
    return {str: "a string", int: "an integer", bool: "true or false", list: "a list",
            dict: "a table"}.get(kind, kind.__name__)  # fmt: skip


def text(table: dict[str, Any], key: str, where: str) -> str:
    """A non-empty string."""
    value = get(table, key, str, where)
    if not value:
        raise UsageError(f"{where}: key '{key}' must be a non-empty string")
    return value


def table(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise UsageError(f"{where}: missing table [{key}]")
    return value


def identifier(table_: dict[str, Any], key: str, where: str) -> str:
    value = get(table_, key, str, where)
    if not value.isidentifier():
        raise UsageError(f"{where}: key '{key}' must be an identifier")
    return value


def identifiers(
    table_: dict[str, Any], key: str, where: str, allow_empty: bool = True
) -> tuple[str, ...]:
    value = get(table_, key, list, where)
    if not all(isinstance(v, str) and v.isidentifier() for v in value) or (
        not value and not allow_empty
    ):
        raise UsageError(f"{where}: key '{key}' must list identifiers")
    return tuple(value)


def dotted(value: object) -> bool:
    return isinstance(value, str) and all(p.isidentifier() for p in value.split("."))


def dotted_names(table_: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = get(table_, key, list, where)
    if not all(dotted(v) for v in value):
        raise UsageError(f"{where}: key '{key}' must list dotted names")
    return tuple(value)


def strings(table_: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = get(table_, key, list, where)
    if not value or not all(isinstance(v, str) and v for v in value):
        raise UsageError(f"{where}: key '{key}' must list non-empty strings")
    return tuple(value)


def tables(data: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    """``[[key]]``: an array of tables (none when missing)."""
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise UsageError(f"{where}: '{key}' must be an array of tables ([[{key}]])")
    return value
