"""tomlfile.py: the one TOML loader and its typed getters (bad input names file and key)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gdn_backport import tomlfile
from gdn_backport.errors import UsageError

W = "x.toml"


def test_load_reads_a_file_and_names_it_in_every_error(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('a = 1\n[t]\nb = "c"\n')
    assert tomlfile.load(good) == {"a": 1, "t": {"b": "c"}}
    bad = tmp_path / "bad.toml"
    bad.write_text("a = = 1\n")
    with pytest.raises(UsageError, match=r"bad\.toml: not valid TOML"):
        tomlfile.load(bad)
    with pytest.raises(UsageError, match=r"^named: not valid TOML"):
        tomlfile.load(bad, "named")
    with pytest.raises(UsageError, match=r"missing\.toml: no such file"):
        tomlfile.load(tmp_path / "missing.toml")
    with pytest.raises(UsageError, match="not a regular file"):
        tomlfile.load(tmp_path)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'a = "\xe9"\n')
    with pytest.raises(UsageError, match="not UTF-8"):
        tomlfile.load(latin)


def test_load_takes_a_package_resource_too() -> None:
    class Resource:
        def read_text(self, encoding: str = "utf-8") -> str:
            return "k = true\n"

    assert tomlfile.load(Resource(), "pkg/res.toml") == {"k": True}


def test_get_checks_kind_and_keeps_bool_apart_from_int() -> None:
    t: dict[str, Any] = {"n": 3, "flag": True, "s": "x"}
    assert tomlfile.get(t, "n", int, W) == 3
    assert tomlfile.get(t, "flag", bool, W) is True
    assert tomlfile.get(t, "nope", int, W, default=7) == 7
    assert tomlfile.get(t, "nope", str, W, default=None) is None
    with pytest.raises(UsageError, match=r"x\.toml: missing key 'nope'"):
        tomlfile.get(t, "nope", int, W)
    with pytest.raises(UsageError, match="key 'flag' must be an integer"):
        tomlfile.get(t, "flag", int, W)
    with pytest.raises(UsageError, match="key 'n' must be true or false"):
        tomlfile.get(t, "n", bool, W)
    with pytest.raises(UsageError, match="key 's' must be a list"):
        tomlfile.get(t, "s", list, W)


@pytest.mark.parametrize(
    ("fn", "value", "message"),
    [
        (tomlfile.text, "", "must be a non-empty string"),
        (tomlfile.identifier, "1abc", "must be an identifier"),
        (tomlfile.identifiers, ["a", "b-c"], "must list identifiers"),
        (tomlfile.dotted_names, ["a.b", "a..b"], "must list dotted names"),
        (tomlfile.strings, [], "must list non-empty strings"),
        (tomlfile.strings, ["a", ""], "must list non-empty strings"),
    ],
)
def test_typed_getters_refuse_bad_values(fn: Any, value: object, message: str) -> None:
    with pytest.raises(UsageError, match=f"x.toml: key 'k' {message}"):
        fn({"k": value}, "k", W)


def test_typed_getters_return_good_values() -> None:
    assert tomlfile.text({"k": "v"}, "k", W) == "v"
    assert tomlfile.identifier({"k": "ok_1"}, "k", W) == "ok_1"
    assert tomlfile.identifiers({"k": ["a", "b"]}, "k", W) == ("a", "b")
    assert tomlfile.identifiers({"k": []}, "k", W) == ()
    with pytest.raises(UsageError, match="must list identifiers"):
        tomlfile.identifiers({"k": []}, "k", W, allow_empty=False)
    assert tomlfile.dotted_names({"k": ["a.b.C", "d"]}, "k", W) == ("a.b.C", "d")
    assert tomlfile.strings({"k": ["a b"]}, "k", W) == ("a b",)
    assert tomlfile.dotted("a.b") and not tomlfile.dotted(3) and not tomlfile.dotted("a.")


def test_tables_and_arrays_of_tables() -> None:
    assert tomlfile.table({"t": {"a": 1}}, "t", W) == {"a": 1}
    with pytest.raises(UsageError, match=r"x.toml: missing table \[t\]"):
        tomlfile.table({"t": 3}, "t", W)
    assert tomlfile.tables({}, "r", W) == []
    assert tomlfile.tables({"r": [{"a": 1}]}, "r", W) == [{"a": 1}]
    with pytest.raises(UsageError, match=r"'r' must be an array of tables \(\[\[r\]\]\)"):
        tomlfile.tables({"r": {"a": 1}}, "r", W)
    with pytest.raises(UsageError, match="array of tables"):
        tomlfile.tables({"r": [1]}, "r", W)


def test_loads_names_where_it_came_from() -> None:
    assert tomlfile.loads("[[r]]\nx = 1\n[[r]]\nx = 2\n", W) == {"r": [{"x": 1}, {"x": 2}]}
    with pytest.raises(UsageError, match=r"^x\.toml: not valid TOML"):
        tomlfile.loads("[r\n", W)
