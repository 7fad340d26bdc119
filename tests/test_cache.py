"""The analysis cache (gdn_backport/cache.py): a hit gives the result a fresh
analysis gives; a changed file, configuration or tool misses; a corrupt
entry or an unwritable cache folder costs only time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gdn_backport import cache
from gdn_backport.patchsets.pr51565 import scan as scan51565
from gdn_backport.patchsets.pr51812 import scan as scan51812
from tests.conftest import FIXED, run
from tests.test_chains import CALLER, DECLARATION, FORK, tree


@pytest.fixture
def cache_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache in a folder of this test, turned on."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(folder))
    monkeypatch.delenv("GDN_BACKPORT_NO_CACHE")
    monkeypatch.setitem(cache._state, "broken", False)
    return folder


@pytest.fixture
def analyses(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often each patchset really analysed (not read from the cache)."""
    counts = {"pr51812": 0, "pr51565": 0}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        scan51812, "analyse_modules", counting("pr51812", scan51812.analyse_modules)
    )
    monkeypatch.setattr(scan51565, "analyse_module", counting("pr51565", scan51565.analyse_module))
    return counts


def scan(capsys: pytest.CaptureFixture[str], root: Path, *argv: str) -> tuple[int, str]:
    code, out, err = run(capsys, "scan", str(root), "--json", *argv)
    # Exit 2 (an unknown site) comes with its one line; nothing else is said.
    assert err == "" if code != 2 else err.startswith("gdn-backport: ") and err.count("\n") == 1
    return code, out


def listing(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def entries(folder: Path) -> list[Path]:
    return sorted((folder / "analysis").rglob("*.json"))


def test_a_rescan_is_a_hit_with_the_same_result(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    cache_on: Path,
    analyses: dict[str, int],
) -> None:
    before = listing(affected_tree)
    first = scan(capsys, affected_tree)
    # pr51565's byte sieve may pass over this module without analysing it.
    once = dict(analyses)
    assert once["pr51812"] == 1 and once["pr51565"] <= 1
    assert entries(cache_on)
    second = scan(capsys, affected_tree)
    assert second == first
    assert analyses == once  # nothing analysed again
    assert json.loads(first[1])["sites"][0]["status"] == "affected"
    # scan never writes into the tree it reads.
    assert listing(affected_tree) == before


def test_the_cache_gives_what_no_cache_gives(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    cache_on: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cached = [scan(capsys, affected_tree) for _ in range(2)]
    monkeypatch.setenv("GDN_BACKPORT_NO_CACHE", "1")
    assert cached == [scan(capsys, affected_tree)] * 2


def test_a_changed_file_misses(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    cache_on: Path,
    analyses: dict[str, int],
) -> None:
    _, out = scan(capsys, affected_tree)
    assert json.loads(out)["sites"][0]["status"] == "affected"
    (affected_tree / "vllm/model_executor/layers/mamba/gdn_linear_attn.py").write_text(FIXED)
    _, out = scan(capsys, affected_tree)
    assert json.loads(out)["sites"][0]["status"] == "fixed"
    assert analyses["pr51812"] == 2
    # A new file anywhere in the tree is a change too (a helper may be in it).
    (affected_tree / "vllm/helper.py").write_text("def f():\n    return 1\n")
    scan(capsys, affected_tree)
    assert analyses["pr51812"] == 3


def test_a_changed_configuration_misses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache_on: Path
) -> None:
    root = tree(tmp_path, {"vllm/gdn.py": "import torch\n\n\n" + CALLER.format(call=FORK)})
    _, out = scan(capsys, root)
    [site] = [s for s in json.loads(out)["sites"] if s["function"] == "Layer._forward_core"]
    assert site["status"] == "unknown"
    # The fork declares its kernel: the same files, another verdict.
    (root / ".gdn-backport.toml").write_text(DECLARATION)
    _, out = scan(capsys, root)
    [site] = [s for s in json.loads(out)["sites"] if s["function"] == "Layer._forward_core"]
    assert site["status"] == "affected"
    # ... and --kernels instead of the tree's file.
    (root / ".gdn-backport.toml").unlink()
    (tmp_path / "k.toml").write_text(DECLARATION)
    _, out = scan(capsys, root, "--kernels", str(tmp_path / "k.toml"))
    [site] = [s for s in json.loads(out)["sites"] if s["function"] == "Layer._forward_core"]
    assert site["status"] == "affected"


def test_another_tool_version_or_source_misses(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    cache_on: Path,
    analyses: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    first = scan(capsys, affected_tree)
    monkeypatch.setattr(cache, "__version__", "99.0.0")
    cache.fingerprint.cache_clear()
    assert scan(capsys, affected_tree) == first
    assert analyses["pr51812"] == 2
    # An edited module of the tool, its version unchanged, misses too.
    extra = tmp_path / "edited.py"
    extra.write_text("A = 1\n")
    real = cache._tool_files
    monkeypatch.setattr(cache, "_tool_files", lambda: [*real(), extra])
    cache.fingerprint.cache_clear()
    scan(capsys, affected_tree)
    assert analyses["pr51812"] == 3
    extra.write_text("A = 2\n")
    cache.fingerprint.cache_clear()
    scan(capsys, affected_tree)
    assert analyses["pr51812"] == 4
    cache.fingerprint.cache_clear()
    scan(capsys, affected_tree)
    assert analyses["pr51812"] == 4  # unchanged again: a hit
    monkeypatch.undo()
    cache.fingerprint.cache_clear()


@pytest.mark.parametrize(
    "garbage",
    [b"", b"{not json", b'{"key": "other", "value": []}', b"[1, 2]", b"\xff\xfe", "wrong shape"],
)
def test_a_corrupt_entry_is_recomputed(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    cache_on: Path,
    analyses: dict[str, int],
    garbage: bytes | str,
) -> None:
    first = scan(capsys, affected_tree)
    found = entries(cache_on)
    assert found
    for entry in found:
        if isinstance(garbage, str):  # a well-formed entry holding nonsense
            doc = json.loads(entry.read_text())
            entry.write_text(json.dumps({"key": doc["key"], "value": [[1, "x"]]}))
        else:
            entry.write_bytes(garbage)
    assert scan(capsys, affected_tree) == first
    assert analyses["pr51812"] == 2
    # The entries were written again: the next run is a hit.
    assert scan(capsys, affected_tree) == first
    assert analyses["pr51812"] == 2


def test_a_cache_folder_that_cannot_be_written_is_not_used(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    analyses: dict[str, int],
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache should be\n")
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(blocker))
    monkeypatch.delenv("GDN_BACKPORT_NO_CACHE")
    monkeypatch.setitem(cache._state, "broken", False)
    monkeypatch.setenv("GDN_BACKPORT_NO_CACHE", "1")
    expected = scan(capsys, affected_tree)
    monkeypatch.delenv("GDN_BACKPORT_NO_CACHE")
    assert scan(capsys, affected_tree) == expected
    assert scan(capsys, affected_tree) == expected
    assert blocker.read_text() == "a file where the cache should be\n"
    # Read-only folder (chmod; root ignores it, so also checked as a file above).
    folder = tmp_path / "ro"
    (folder / "analysis").mkdir(parents=True)
    os.chmod(folder / "analysis", 0o500)
    try:
        monkeypatch.setenv("GDN_BACKPORT_CACHE", str(folder))
        monkeypatch.setitem(cache._state, "broken", False)
        assert scan(capsys, affected_tree) == expected
    finally:
        os.chmod(folder / "analysis", 0o700)


def test_apply_reads_no_stale_scan(
    capsys: pytest.CaptureFixture[str], affected_tree: Path, cache_on: Path
) -> None:
    """A scan after apply sees the patched file (another entry), and one
    after revert the original again (its entry, a hit)."""
    _, before = scan(capsys, affected_tree)
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    _, after = scan(capsys, affected_tree)
    assert json.loads(after)["sites"][0]["status"] == "fixed"
    assert run(capsys, "revert", str(affected_tree))[0] == 0
    assert scan(capsys, affected_tree)[1] == before


def test_the_reason_of_another_callee_is_the_same_in_every_process(release: Any) -> None:
    """A reason naming the rows of a call's arguments read "the first" value
    of a set, whose order follows the process's string hashes: vLLM 0.27.1's
    KDA builder read "all rows" or "conflict rows" by PYTHONHASHSEED (5:
    conflict) before the values were ordered."""
    file = release("0.27.1") / "vllm/models/kimi_k3/nvidia/kda_metadata.py"
    reasons = set()
    for seed in range(6):
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "GDN_BACKPORT_NO_CACHE": "1"}
        argv = [sys.executable, "-m", "gdn_backport", "scan", "--json", "--patchset", "pr51812"]
        done = subprocess.run(
            [*argv, str(file)], env=env, capture_output=True, text=True, check=False
        )
        reasons.add(tuple(s["reason"] for s in json.loads(done.stdout)["sites"]))
    assert len(reasons) == 1
    assert "carries all rows" in " ".join(next(iter(reasons)))


def test_one_command_analyses_each_content_once(
    release: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``apply`` proves pr51565's rewrite by analysing the tree again: the
    modules it did not rewrite are read back from the run's memory (the
    cache off, as in every test), only the rewritten texts analysed anew;
    the outcome is the one a run without that memory gives."""
    tree = release("0.25.1")
    seen: list[str] = []
    real = scan51565.analyse_module

    def counting(module: Any, text: str, cfg: Any) -> Any:
        seen.append(text)
        return real(module, text, cfg)

    monkeypatch.setattr(scan51565, "analyse_module", counting)
    code, out, _ = run(capsys, "apply", "--dry-run", "--json", "--patchset", "pr51565", str(tree))
    assert code == 0 and json.loads(out)["diff"]
    assert seen and len(seen) == len(set(seen))  # no text analysed twice
    # The same outcome without the run's memory: every analysis afresh.
    monkeypatch.setattr(cache, "run", lambda: __import__("contextlib").nullcontext())
    code_alone, out_alone, _ = run(
        capsys, "apply", "--dry-run", "--json", "--patchset", "pr51565", str(tree)
    )
    assert (code_alone, out_alone) == (code, out)


def test_the_run_memory_is_named_by_content(tmp_path: Path) -> None:
    """Within one command a result is read back only under its own name (the
    module's text): another text is analysed, never handed the first one's
    findings; outside a command nothing is kept (the cache off)."""
    from gdn_backport.patchsets.pr51565.codemods.builder_rule import BuilderRuleCodemod
    from gdn_backport.patchsets.pr51565.config import load

    cfg = load()
    affected, fixed = BuilderRuleCodemod.REWRITES[0]
    calls: list[str] = []
    real = scan51565.analyse_module

    def counting(module: Any, text: str, c: Any) -> Any:
        calls.append(text)
        return real(module, text, c)

    file = tmp_path / "m.py"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scan51565, "analyse_module", counting)
        with cache.run():
            first = scan51565._analysed(file, affected, cfg)
            assert [f.status.value for f in first] == ["affected"]
            first.clear()  # the reader's own list: the memory keeps its document
            again = scan51565._analysed(file, affected, cfg)
            changed = scan51565._analysed(file, fixed, cfg)
        assert calls == [affected, fixed]
        assert [f.status.value for f in again] == ["affected"]
        assert [f.status.value for f in changed] == ["fixed"]
        assert scan51565._analysed(file, affected, cfg) == again  # outside: afresh
        assert calls == [affected, fixed, affected]
