"""runtime/hook.py: post-import callbacks, one finder per process, watches by key."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from gdn_backport.runtime import hook
from gdn_backport.runtime.hook import Watch

PREFIX = "gdnhooktest_"


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path for made-up modules; no watch or module is left behind."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(hook.installed().watches) if hook.installed() else set()
    yield tmp_path
    finder = hook.installed()
    for key in set(finder.watches) - before if finder else ():
        hook.unwatch(key)
    for name in [n for n in sys.modules if n.startswith(PREFIX)]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _module(folder: Path, name: str, body: str = "VALUE = 1\n") -> str:
    (folder / f"{PREFIX}{name}.py").write_text(body)
    importlib.invalidate_caches()
    return PREFIX + name


def _ours(name: str) -> bool:
    return name.startswith(PREFIX)


def test_a_callback_runs_right_after_the_module_executes(modules: Path) -> None:
    name = _module(modules, "a", "VALUE = 1\n")
    seen: list[tuple[str, int]] = []

    def callback(module: types.ModuleType) -> None:
        seen.append((module.__name__, module.VALUE))
        module.VALUE = 2  # before anyone else can read it

    hook.watch("t-a", Watch(_ours, callback))
    assert hook.watching("t-a") and not hook.watching("t-other")
    mod = importlib.import_module(name)
    assert seen == [(name, 1)] and mod.VALUE == 2
    # The wrapped loader is the real one for everything else.
    assert mod.__spec__ is not None and mod.__spec__.loader is not None
    assert "VALUE = 1" in mod.__spec__.loader.get_source(name)  # type: ignore[attr-defined]


def test_names_and_accepts_select_what_is_watched(modules: Path) -> None:
    a, b = _module(modules, "b1"), _module(modules, "b2")
    seen: list[str] = []
    hook.watch("t-b", Watch(lambda n: n == a, lambda m: seen.append(m.__name__)))
    hook.watch(
        "t-c",
        Watch(_ours, lambda m: seen.append("c:" + m.__name__), accepts=lambda s: s.name == b),
    )
    importlib.import_module(a)
    importlib.import_module(b)
    assert seen == [a, "c:" + b]


def test_one_finder_serves_every_watch_and_goes_with_the_last(modules: Path) -> None:
    had = hook.installed() is not None
    first = hook.watch("t-d1", Watch(_ours, lambda m: None))
    second = hook.watch("t-d2", Watch(_ours, lambda m: None))
    assert first is second
    assert had or sys.meta_path[0] is first
    assert sum(isinstance(f, hook.PostImportFinder) for f in sys.meta_path) == 1
    assert hook.unwatch("t-d1") and not hook.unwatch("t-d1")
    assert hook.installed() is first
    hook.unwatch("t-d2")
    assert (hook.installed() is None) is not had
    assert not hook.unwatch("never-watched")


def test_replacing_a_watch_keeps_one_callback_per_key(modules: Path) -> None:
    name = _module(modules, "e")
    seen: list[str] = []
    hook.watch("t-e", Watch(_ours, lambda m: seen.append("old")))
    hook.watch("t-e", Watch(_ours, lambda m: seen.append("new")))
    importlib.import_module(name)
    assert seen == ["new"]


def test_a_callback_that_raises_fails_the_import_loudly(modules: Path) -> None:
    name = _module(modules, "f")

    def broken(module: types.ModuleType) -> None:
        raise RuntimeError("the patch broke")

    hook.watch("t-f", Watch(_ours, broken))
    with pytest.raises(RuntimeError, match="the patch broke"):
        importlib.import_module(name)
    assert name not in sys.modules


def test_a_module_no_finder_knows_is_still_not_found(modules: Path) -> None:
    hook.watch("t-g", Watch(_ours, lambda m: None))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(PREFIX + "missing")
