"""dataclass_code.py: while cached() is active a dataclass's methods run from
code objects compiled once and kept beside the bytecode; each class is the
class it would be, and everything is put back."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from pathlib import Path

import pytest

from gdn_backport import ahead, dataclass_code

MARKER = "this module's globals"


def _made() -> type:
    @dataclasses.dataclass(frozen=True, order=True)
    class Point:
        x: int
        y: list[int] = dataclasses.field(default_factory=list)
        z: str = "z"

    return Point


def _same(a: type, b: type) -> None:
    for name in ("__init__", "__repr__", "__eq__", "__lt__", "__hash__", "__setattr__"):
        fa, fb = getattr(a, name), getattr(b, name)
        assert fa.__code__.co_code == fb.__code__.co_code, name
        assert fa.__annotations__ == fb.__annotations__, name
        assert fa.__qualname__ == fb.__qualname__, name
    assert str(inspect.signature(a)) == str(inspect.signature(b))
    p = a(1, [2])
    assert repr(p) == repr(b(1, [2])) and p == a(1, [2]) and p < a(2)
    assert a.__hash__ is not None and hash(a(1, ())) == hash(b(1, ()))  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.x = 3  # type: ignore[misc]


def _spy_compile(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    compiled: list[str] = []

    def spy(source: str, *args: object, **kwargs: object) -> object:
        compiled.append(source)
        return compile(source, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(dataclass_code, "compile", spy, raising=False)
    return compiled


def test_a_second_run_compiles_nothing_and_makes_the_same_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    compiled = _spy_compile(monkeypatch)
    plain = _made()
    where = lambda package: tmp_path / f"{package}.marshal"  # noqa: E731
    with dataclass_code.cached(where):
        assert "exec" in vars(dataclasses)
        first = _made()
    assert "exec" not in vars(dataclasses)
    assert compiled, "the first run compiles its sources"
    assert [p.suffix for p in tmp_path.iterdir()] == [".marshal"]  # this module's package
    compiled.clear()
    with dataclass_code.cached(where):
        second = _made()
    assert compiled == []  # every source came from the file
    # The methods are those exec() of the source makes: no ``from
    # __future__ import annotations`` of dataclass_code.py reaches them
    # (their annotations are the field types, not strings).
    _same(first, plain)
    _same(second, plain)
    assert plain.__init__.__annotations__["x"] == "int"  # this module's annotations
    assert "y" in second.__init__.__annotations__


def test_a_damaged_or_foreign_file_is_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = tmp_path / "store.marshal"
    for data in (b"", b"not ours", dataclass_code._MAGIC + b"\x00garbage", b"x" * 100):
        path.write_bytes(data)
        assert dataclass_code.load(path) == {}
        with dataclass_code.cached(lambda package: path):
            made = _made()
        _same(made, _made())
        assert dataclass_code.load(path)  # written again, whole
    # A file of another interpreter's bytecode version.
    path.write_bytes(b"gdn-backport dataclass code 1\n" + b"\x00\x00\r\n" + b"{")
    assert dataclass_code.load(path) == {}


def test_nothing_is_written_where_bytecode_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    with dataclass_code.cached(lambda package: tmp_path / f"{package}.marshal"):
        _made()
    assert list(tmp_path.iterdir()) == []


def test_it_is_removed_when_the_command_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), dataclass_code.cached(lambda package: tmp_path / "s"):
        raise RuntimeError("a command that fails")
    assert "exec" not in vars(dataclasses)
    assert ahead._child_exits == []


def test_exec_without_a_namespace_runs_in_its_callers() -> None:
    stores = dataclass_code._Stores(lambda package: None)
    run = dataclass_code._exec_from(stores)

    def caller() -> dict[str, object]:
        ns: dict[str, object] = {}
        run("found = MARKER", None, ns)
        return ns

    try:
        assert caller() == {"found": MARKER}
    finally:
        stores.unhook()  # outside cached(), nothing else takes its exit hook back
    assert ahead._child_exits == []


def test_the_file_is_named_as_bytecode_is() -> None:
    path = dataclass_code.store_path("libcst")
    assert path is not None and path.parent.name == "__pycache__"
    assert path.name == f"dataclass-code.libcst.{sys.implementation.cache_tag}.marshal"


def test_no_cache_tag_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.implementation, "cache_tag", None)
    assert dataclass_code.store_path("libcst") is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="a forked child")
def test_a_forked_child_keeps_what_it_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child of ahead.start ends with os._exit, never in the command's
    finally: it writes its own sources before it exits."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setenv("GDN_BACKPORT_JOBS", "2")
    where = lambda package: tmp_path / f"{package}.marshal"  # noqa: E731
    with dataclass_code.cached(where) as stores:
        _made()  # the parent's own compile hooks the child's exit

        def child() -> str:
            @dataclasses.dataclass
            class OnlyInTheChild:
                only_in_the_child: int

            return OnlyInTheChild(1).__repr__()

        got = ahead.start(child)
        assert got is not None
        taken = got.take()
        assert taken is not None and taken[0].endswith("OnlyInTheChild(only_in_the_child=1)")
        stores.new.clear()  # the parent writes nothing of its own
    kept = [s for p in tmp_path.iterdir() for s in dataclass_code.load(p)]
    assert any("only_in_the_child" in s for s in kept)


def test_the_cli_runs_its_own_command_with_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only a process's own command (cli.main with no argv)."""
    from gdn_backport import cli

    seen: list[bool] = []
    monkeypatch.setitem(
        cli.COMMANDS, "scan", lambda args: seen.append("exec" in vars(dataclasses)) or 0
    )
    monkeypatch.setattr("sys.argv", ["gdn-backport", "scan", str(tmp_path)])
    monkeypatch.setenv("GDN_BACKPORT_JOBS", "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert cli.main() == 0
    assert cli.main(["scan", str(tmp_path)]) == 0
    assert seen == [True, False]
    assert "exec" not in vars(dataclasses)
