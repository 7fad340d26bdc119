"""``--format github``: one GitHub Actions ``::error`` workflow command per site (issue 22).

The escaping is GitHub's toolkit's (``@actions/core``'s ``command.ts``):
the message escapes ``%``, CR and LF; a property value also ``:`` and
``,``. The tests read the lines back the way the runner does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gdn_backport import github_annotations
from gdn_backport.findings import Finding, Span
from gdn_backport.site import Site, Status
from tests.conftest import run

SITE = "vllm/model_executor/layers/mamba/gdn_linear_attn.py"
COMMAND = re.compile(r"^::(?P<kind>\w+)(?: (?P<props>[^:]*))?::(?P<message>.*)$")


def _unescape(text: str) -> str:
    for code, char in (("%0D", "\r"), ("%0A", "\n"), ("%3A", ":"), ("%2C", ","), ("%25", "%")):
        text = text.replace(code, char)
    return text


def parse(line: str) -> tuple[str, dict[str, str], str]:
    """A workflow command as the runner reads it: the properties end at the
    first ``::``, each is ``key=value`` split at ``,``."""
    m = COMMAND.match(line)
    assert m, line
    props = {}
    for item in (m["props"] or "").split(","):
        if item:
            key, _, value = item.partition("=")
            props[key] = _unescape(value)
    return m["kind"], props, _unescape(m["message"])


def test_escaping_is_the_toolkits() -> None:
    assert github_annotations.escape_data("50% a:b,c\r\nd") == "50%25 a:b,c%0D%0Ad"
    assert github_annotations.escape_property("50% a:b,c\r\nd") == "50%25 a%3Ab%2Cc%0D%0Ad"
    # % first: an escape is never escaped twice.
    assert github_annotations.escape_data("%0A") == "%250A"


def test_a_line_reads_back_whole() -> None:
    site = Site("vllm/a,b:c.py", 7, "L.f", Status.UNKNOWN, "100% odd:\nreason, here", patchset="p")
    f = Finding(site, Span(9, 5, 12, 6), "call")
    line = github_annotations.line(f, Path("/tree"), Path("/tree"))
    assert "\n" not in line and "\r" not in line
    kind, props, message = parse(line)
    assert kind == "error"
    assert props == {"file": "vllm/a,b:c.py", "line": "9", "endLine": "12",
                     "title": "gdn-backport p: unknown"}  # fmt: skip
    assert message.startswith("L.f: 100% odd:\nreason, here (")


def test_one_line_per_affected_or_unknown_site(
    capsys: pytest.CaptureFixture[str], affected_tree: Path
) -> None:
    for argv, want in ((["scan"], 1), (["apply", "--check"], 1), (["apply", "--dry-run"], 0)):
        plain = run(capsys, *argv, str(affected_tree))
        code, out, err = run(capsys, *argv, str(affected_tree), "--format", "github")
        assert (code, err) == (plain[0], plain[2]) and code == want
        [line] = out.splitlines()
        kind, props, message = parse(line)
        assert kind == "error" and props["file"] == SITE
        # The spec kernel's call, as in the SARIF result.
        sarif = json.loads(run(capsys, *argv, str(affected_tree), "--format", "sarif")[1])
        region = sarif["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]
        assert props["line"] == str(region["startLine"])
        assert props["endLine"] == str(region["endLine"])
        assert props["title"] == "gdn-backport pr51812: affected"
        assert message.startswith("Layer._forward_core: fused_sigmoid_gating_delta_rule_update")
        assert message.endswith("(fix: gdn-backport apply --patchset pr51812 --strategy gather)")
    assert run(capsys, "apply", str(affected_tree))[0] == 0
    assert run(capsys, "apply", "--check", str(affected_tree), "--format", "github")[:2] == (0, "")


def test_paths_are_relative_to_the_checkout(
    capsys: pytest.CaptureFixture[str],
    affected_tree: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GitHub places an annotation by its path in the repository: the job's
    current directory is the checkout."""
    monkeypatch.chdir(tmp_path)
    _, out, _ = run(capsys, "scan", "tree", "--format", "github")
    assert parse(out.strip())[1]["file"] == f"tree/{SITE}"
