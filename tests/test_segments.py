"""pr51812 reads a huge module only around what can matter (issue 24 D14),
and what it reads so gives the answers of the whole module."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from gdn_backport.errors import UsageError
from gdn_backport.patchsets.pr51812 import segments
from gdn_backport.patchsets.pr51812.codemods import examples as ex
from gdn_backport.patchsets.pr51812.codemods.gather_gates import GatherGatesCodemod
from gdn_backport.patchsets.pr51812.codemods.kernel_op import KernelOpCodemod
from gdn_backport.patchsets.pr51812.scan import scan_tree_full
from tests.conftest import AFFECTED, run

REPO = Path(__file__).resolve().parent.parent


def filler(count: int) -> str:
    return "".join(
        f"def helper_{i}(x, y):\n    z = x + y * {i}\n    if z > {i}:\n        return [z, x, y]\n"
        f"    return {{'a': z, 'b': {i}}}\n\n\n"
        for i in range(count)
    )


def test_a_huge_module_is_parsed_only_around_its_site(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24 D14: ``ast.parse`` of a 10 MB module took tens of seconds
    and 2 GB; nothing of the module but its site is parsed now, and the
    verdict is the site's alone, at its line."""

    def sites(text: str, name: str) -> list[dict[str, object]]:
        root = tmp_path / name
        (root / "vllm").mkdir(parents=True)
        (root / "vllm/__init__.py").write_text("")
        (root / "vllm/gdn.py").write_text(text)
        code, out, _ = run(capsys, "scan", str(root), "--patchset", "pr51812", "--json")
        assert code == 1
        found: list[dict[str, object]] = json.loads(out)["sites"]
        return found

    alone = sites(AFFECTED, "alone")
    head = filler(11000)
    text = head + AFFECTED + "\n\n" + filler(11000)
    assert len(text) > segments.SEGMENT_CHARS
    parsed: list[int] = []
    real_parse = ast.parse

    def spy(source: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(len(source))
        return real_parse(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", spy)
    big = sites(text, "big")
    shift = head.count("\n")
    assert [{**s, "line": int(str(s["line"])) + shift} for s in alone] == big
    assert parsed and max(parsed) < 10 * len(AFFECTED)


# Module text around the examples that a splitter reading lines alone would
# cut in the wrong places: ``def`` in strings, decorators, clauses, brackets
# and continuations over lines starting at column 0.
TRICKY = '''\
"""A module docstring naming spec_token_indx.
def _forward_core(self, a):
    return a
"""
import torch
from functools import partial as _partial

TABLE = {
    "a": 1,
}
x = (1 +
2)
y = 1 + \\
3
if TABLE:
    pass
else:
    pass
try:
    import numpy
except ImportError:
    numpy = None
finally:
    pass


def _decorate(f):
    return f


@_decorate
@_decorate
def decorated(q):
    return q
'''

# A module-level name holding the slots, a stored attribute read elsewhere,
# and helpers defined far from their callers: the sweep and the walk must
# see them all.
REACH = """\
SLOTS = get_forward_context().attn_metadata.spec_state_indices_tensor


def far_caller(x):
    return my_kernel(x, SLOTS)


class Holder:
    def keep(self, md):
        self._slots = md.spec_state_indices_tensor


def reader(holder, x):
    return other_kernel(x, holder._slots)
"""

CASES = {
    "upstream": ex.UPSTREAM_SHAPE,
    "upstream_fixed": ex.UPSTREAM_SHAPE_FIXED,
    "renamed": ex.RENAMED_POSITIONAL,
    "masked": ex.MASKED,
    "staged": ex.STAGED_GATES,
    "wrapped": ex.WRAPPED_KERNEL,
    "starred": ex.STARRED,
    "reach": REACH,
    **{f"gather_refuses_{i}": src for i, (src, _) in enumerate(GatherGatesCodemod.REFUSES)},
    **{f"kernel_refuses_{i}": src for i, (src, _) in enumerate(KernelOpCodemod.REFUSES)},
}


def _analysed(root: Path) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    result = scan_tree_full(root / "vllm")
    sites = [(s.path, s.line, s.function, s.status, s.reason, s.via) for s in result.sites]
    swept = [(r.module, r.line, r.col, r.callee, how) for r, how in result.analysis.swept]
    return sites, swept


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_module_read_in_segments_reads_as_the_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every module read in segments (the threshold at 0) gives the sites
    and the sweep's calls of the module parsed whole: the helpers a site
    calls from far below, the readers of a module-level name or a stored
    attribute holding the slots, a helper imported from the module."""
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm/__init__.py").write_text("")
    (root / "vllm/gdn.py").write_text(TRICKY + "\n\n" + CASES[name] + "\n\n" + TRICKY)
    # A caller in another module of a helper the segmented module defines.
    (root / "vllm/user.py").write_text(
        "from vllm.gdn import decorated\n\n\n"
        "def use(md, x):\n    return decorated(md.spec_token_indx)\n"
    )
    whole = _analysed(root)
    monkeypatch.setattr(segments, "SEGMENT_CHARS", 0)
    assert _analysed(root) == whole
    assert whole[0] or whole[1]


def test_the_split_finds_every_top_level_statement_of_the_repository() -> None:
    """Each start the split gives is a statement's own (its first decorator's
    line), and every statement starting with a name or a decorator at column
    0 is one (those starting otherwise join the statement before)."""
    checked = 0
    for path in sorted([*REPO.glob("gdn_backport/**/*.py"), *REPO.glob("patchsets/**/*.py")]):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        body = ast.parse(text).body
        truth = [
            min([s.lineno, *(d.lineno for d in getattr(s, "decorator_list", ()))]) for s in body
        ]
        split = segments._split(text)
        assert split is not None, path
        assert set(split.lines) <= {1, *truth}, path
        named = {n for n in truth if lines[n - 1][:1].isalpha() or lines[n - 1][:1] in "_@"}
        assert named <= set(split.lines), path
        checked += 1
    assert checked > 100


def test_a_syntax_error_in_a_statement_read_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement read that does not parse is the file's syntax error, with
    the file's line (the whole text is parsed then)."""
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm/__init__.py").write_text("")
    (root / "vllm/m.py").write_text(filler(3) + "def f(:\n    spec_token_indx\n")
    monkeypatch.setattr(segments, "SEGMENT_CHARS", 0)
    with pytest.raises(UsageError, match=r"m\.py:22: syntax error"):
        scan_tree_full(root / "vllm")


def test_brackets_that_do_not_balance_read_the_whole_module() -> None:
    assert segments._split("x = (1,\ndef f():\n    pass\n") is None
    assert segments._split("x = 1)\ndef f():\n    pass\n") is None
