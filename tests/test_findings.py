"""findings.py: a Finding per reported site, its place and its fix cut from the diff.

The diff reader's tests came from tests/test_sarif.py (they test this
module); the SARIF log over the findings stays there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_backport import findings
from gdn_backport.findings import REPORTED, FixRun, Replacement, Span, Step
from gdn_backport.pipeline import Outcome, unified_diff
from gdn_backport.site import Site, Status

_OLD = """\
import k


class L:
    def helper(self, x):
        return x

    def _forward_core(self, x):
        y = self.helper(x)
        return k.kernel(y, 1)
"""
# The fix changes the kernel call's arguments (line 10).
_NEW = _OLD.replace("k.kernel(y, 1)", "k.kernel(y, 2)")
REL = "vllm/layer.py"


def _tree(tmp_path: Path, text: str = _OLD) -> Path:
    (tmp_path / "vllm").mkdir()
    (tmp_path / REL).write_text(text)
    return tmp_path


def _site(status: Status = Status.AFFECTED, **kw: object) -> Site:
    return Site(REL, 8, "L._forward_core", status, "why", patchset="ps", **kw)  # type: ignore[arg-type]


def _run(root: Path, diff: str) -> FixRun:
    return FixRun("gather", Outcome(root, diff=diff))


def test_an_affected_site_is_placed_at_the_call_its_fix_changes(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (found,) = findings.findings(root, [_site()], {"ps": _run(root, unified_diff(REL, _OLD, _NEW))})
    assert found.at == "call"
    assert found.where == Span(10, 16, 10, 30)  # k.kernel(y, 1), end exclusive
    assert found.fix == (Replacement(REL, Span(10, 1, 11, 1), "        return k.kernel(y, 2)\n"),)
    assert found.strategy == "gather" and found.no_fix == "" and found.chain == ()


def test_only_affected_and_unknown_sites_are_reported_in_order(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    sites = [_site(Status.FIXED), _site(Status.UNKNOWN), _site(Status.NOT_AFFECTED), _site()]
    got = findings.findings(root, sites, {})
    assert [f.site.status for f in got] == [Status.UNKNOWN, Status.AFFECTED]
    assert set(REPORTED) == {Status.UNKNOWN, Status.AFFECTED}
    unknown, affected = got
    # Neither has a fix: both sit at the site's own (def) line.
    assert unknown.at == affected.at == "site" and unknown.where == Span(8)
    assert unknown.no_fix == "" and unknown.fix == ()
    assert affected.no_fix == "no fix was asked for" and affected.strategy == ""


@pytest.mark.parametrize(
    ("outcome", "error", "why"),
    [
        (None, "git refused", "the fix could not be computed (git refused)"),
        (Outcome(Path("."), refused=[("vllm/layer.py", "keyword args")]), "",
         "apply refuses this tree (vllm/layer.py: keyword args)"),
        (Outcome(Path("."), message="nothing to do"), "",
         "the patchset's dry run wrote no diff (nothing to do)"),
        (Outcome(Path("."), diff="--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n"), "",
         "the fix's diff could not be read"),
    ],
)  # fmt: skip
def test_an_affected_site_without_a_fix_says_why(
    tmp_path: Path, outcome: Outcome | None, error: str, why: str
) -> None:
    root = _tree(tmp_path)
    run = FixRun("gather", outcome, error)
    (found,) = findings.findings(root, [_site()], {"ps": run})
    assert found.fix == () and found.no_fix.startswith(why) and found.at == "site"


def test_a_fix_outside_every_site_function_goes_to_the_first_site_of_its_file(
    tmp_path: Path,
) -> None:
    root = _tree(tmp_path)
    new = _OLD.replace("import k\n", "import k\nimport j\n")
    (found,) = findings.findings(root, [_site()], {"ps": _run(root, unified_diff(REL, _OLD, new))})
    # The import is the fix (kept), but it changes no call of the function.
    assert found.fix == (Replacement(REL, Span(2, 1, 2, 1), "import j\n"),)
    assert found.at == "site" and found.where == Span(8) and found.no_fix == ""


def test_the_chain_names_helpers_with_their_def_lines_in_this_file(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    site = _site(Status.UNKNOWN, via=("L._forward_core", "L.helper", "other.fn"))
    (found,) = findings.findings(root, [site], {})
    assert found.chain == (Step("L._forward_core", 8), Step("L.helper", 5), Step("other.fn"))


def test_an_unreadable_or_unparsable_file_still_gets_a_finding(tmp_path: Path) -> None:
    root = _tree(tmp_path, "def (:\n")
    missing = Site("vllm/gone.py", 3, "f", Status.UNKNOWN, "r", via=("f", "g"), patchset="ps")
    got = findings.findings(root, [_site(Status.UNKNOWN), missing], {})
    assert [(f.at, f.where, f.chain) for f in got] == [
        ("site", Span(8), ()),
        ("site", Span(3), (Step("f"), Step("g"))),
    ]


# -- the diff reader --------------------------------------------------------------------


def test_changes_of_a_diff_with_insertions_deletions_and_an_empty_file() -> None:
    from gdn_backport.pipeline import unified_diff

    old = "a\nb\nc\nd\ne\nf\ng\nh\ni\nj\n"
    new = "a\nB\nc\nd\ne\nf\ng\nh\nnew\ni\nj\n"
    diff = unified_diff("x.py", old, new) + unified_diff("y.py", "", "one\n")
    changes = findings._changes(diff)
    assert [(c.path, c.start, c.deleted, c.inserted) for c in changes] == [
        ("x.py", 2, ("b\n",), ("B\n",)),
        ("x.py", 9, (), ("new\n",)),
        ("y.py", 1, (), ("one\n",)),
    ]
    with pytest.raises(ValueError):
        findings._changes("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n")


def test_lines_are_counted_as_python_counts_them() -> None:
    # str.splitlines (the diff's) cuts at a form feed; Python and SARIF do not.
    text = findings._Text("a = 1\x0cb = 2\nc\r\nd\re\n")
    assert text.pieces == ["a = 1\x0c", "b = 2\n", "c\r\n", "d\r", "e\n"]
    assert [text.position(i) for i in range(1, 6)] == [(1, 1), (1, 7), (2, 1), (3, 1), (4, 1)]
    assert text.position(6) == (5, 1)
    assert text.column(1, len(b"a = 1\x0cb")) == 8
    # An ast byte offset after a multi-byte character is a code-point column.
    assert findings._Text("é = f(x)\n").column(1, len("é = ".encode())) == 5
