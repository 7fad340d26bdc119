"""dataclass_docs.py: while skipped() is active a docless dataclass gets its
name as its docstring (no ``inspect.signature``), and everything is put back."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from gdn_backport import dataclass_docs


def _made() -> type:
    @dataclasses.dataclass
    class Point:
        x: int
        y: int = 0

    return Point


def test_a_docless_dataclass_gets_its_name_while_skipped() -> None:
    assert _made().__doc__ == "Point(x: 'int', y: 'int' = 0)"
    with dataclass_docs.skipped():
        made = _made()
        assert dataclasses.inspect is not inspect  # type: ignore[attr-defined]
        assert inspect.signature(made)  # only dataclasses' reference changes
    assert made.__doc__ == "Point"
    assert made(1).y == 0 and made(1) == made(1, 0)  # the class itself is whole
    assert dataclasses.inspect is inspect  # type: ignore[attr-defined]
    assert _made().__doc__ == "Point(x: 'int', y: 'int' = 0)"


def test_it_is_put_back_when_the_command_raises() -> None:
    with pytest.raises(RuntimeError), dataclass_docs.skipped():
        raise RuntimeError("a command that fails")
    assert dataclasses.inspect is inspect  # type: ignore[attr-defined]


def test_the_cli_runs_a_tree_command_with_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """Only a process's own scan/apply/revert (cli.main with no argv)."""
    from gdn_backport import cli

    seen: list[bool] = []
    monkeypatch.setitem(
        cli.COMMANDS, "scan", lambda args: seen.append(dataclasses.inspect is inspect) or 0
    )
    monkeypatch.setattr("sys.argv", ["gdn-backport", "scan", str(tmp_path)])
    monkeypatch.setenv("GDN_BACKPORT_JOBS", "1")
    assert cli.main() == 0
    assert cli.main(["scan", str(tmp_path)]) == 0
    assert seen == [False, True]
    assert dataclasses.inspect is inspect  # type: ignore[attr-defined]
