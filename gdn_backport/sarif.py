"""SARIF 2.1.0 for code scanning (``scan``/``apply --check --format sarif``).

One run of the driver ``gdn-backport``; one rule per patchset (``ruleId``
= the patchset id, ``helpUri`` its upstream pull request); one result per
``affected`` or ``unknown`` site (:mod:`gdn_backport.findings`), both at
level ``error``: either makes the gate fail (exit 1 or 2). An affected
site's result carries its patchset's own rewrite as a SARIF ``fix``.

Paths are URIs relative to ``%SRCROOT%``: the current directory when the
tree lies inside it (a CI job runs in the repository's checkout, and
GitHub resolves relative URIs against the repository root), else the tree
root; ``originalUriBaseIds`` says which, as an absolute ``file:`` URI.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gdn_backport import __version__
from gdn_backport.findings import Finding, Span
from gdn_backport.site import Status

if TYPE_CHECKING:
    from gdn_backport.registry import Patchset

SCHEMA = (
    "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
)
BASE = "%SRCROOT%"
# Stable across line moves: GitHub matches alerts of two analyses by it.
FINGERPRINT = "gdnBackportSite/v1"


def base_of(root: Path, cwd: Path | None = None) -> Path:
    """What URIs are relative to: the current directory when ``root`` is in it."""
    here = Path(os.path.abspath(cwd or Path.cwd()))
    tree = Path(os.path.abspath(root))
    return here if tree == here or here in tree.parents else tree


def display_path(root: Path, rel: str, base: Path) -> str:
    """``rel`` (a site's tree-relative path) relative to ``base``."""
    tree = Path(os.path.abspath(root))
    prefix = tree.relative_to(base).as_posix()
    return rel if prefix == "." else f"{prefix}/{rel}"


def _region(span: Span) -> dict[str, int]:
    region = {"startLine": span.start_line}
    if span.start_column is not None:
        region["startColumn"] = span.start_column
    if span.end_line is not None:
        region["endLine"] = span.end_line
    if span.end_column is not None:
        region["endColumn"] = span.end_column
    return region


def _upstream(ps: Patchset) -> tuple[str, str]:
    repo, _, number = ps.info.upstream.rpartition("#")
    return repo, number


def help_uri(ps: Patchset) -> str:
    repo, number = _upstream(ps)
    return f"https://github.com/{repo}/pull/{number}"


def rule(ps: Patchset) -> dict[str, Any]:
    info = ps.info
    _, number = _upstream(ps)
    strategies = ", ".join(info.strategies)
    return {
        "id": info.id,
        # The summary is the short line (it is a commit subject's tail); the
        # upstream title says what the fix does.
        "shortDescription": {"text": f"vLLM #{number}: {info.summary}"},
        "fullDescription": {"text": info.title},
        "helpUri": help_uri(ps),
        "help": {
            "text": f"{info.title} (upstream: {info.upstream}). `gdn-backport apply "
            f"--patchset {info.id}` backports it in the tree's own names (strategies: "
            f"{strategies}); `gdn-backport revert` undoes it byte for byte.",
            "markdown": f"**{info.title}** ([{info.upstream}]({help_uri(ps)})).\n\n"
            f"`gdn-backport apply --patchset {info.id}` backports it in the tree's own "
            f"names (strategies: {strategies}); `gdn-backport revert` undoes it byte "
            "for byte.",
        },
        "defaultConfiguration": {"level": "error"},
        "properties": {"tags": ["correctness", "vllm"], "upstream": info.upstream},
    }


def _artifact(root: Path, rel: str, base: Path) -> dict[str, str]:
    return {"uri": quote(display_path(root, rel, base)), "uriBaseId": BASE}


def _message(f: Finding, ps: Patchset | None) -> str:
    s = f.site
    chain = ""
    if f.chain:
        links = " -> ".join(f"[{step.name}]({i})" for i, step in enumerate(f.chain, 1))
        chain = f" (through {links})"
    if s.status is Status.UNKNOWN:
        return (
            f"{s.function}{chain}: unknown: {s.reason}. `gdn-backport apply` refuses this tree "
            "(exit 2) until the analysis can decide (docs/refusals.md says what to do)."
        )
    fix = (
        f" The attached fix is `gdn-backport apply --patchset {s.patchset} --strategy "
        f"{f.strategy}`'s rewrite."
        if f.fix
        else f" No fix is attached: {f.no_fix}."
    )
    upstream = f" (upstream: {ps.info.upstream})" if ps is not None else ""
    return f"{s.function}{chain}: affected{upstream}: {s.reason}.{fix}"


def result(f: Finding, index: int, ps: Patchset | None, root: Path, base: Path) -> dict[str, Any]:
    s = f.site
    logical = [{"fullyQualifiedName": s.function, "kind": "function"}]
    out: dict[str, Any] = {
        "ruleId": s.patchset,
        "level": "error",
        "kind": "fail",
        "message": {"text": _message(f, ps)},
        "locations": [
            {
                "physicalLocation": {
                    "artifactLocation": _artifact(root, s.path, base),
                    "region": _region(f.where),
                },
                "logicalLocations": logical,
            }
        ],
        "partialFingerprints": {
            FINGERPRINT: hashlib.sha256(
                "\0".join((s.patchset, s.path, s.function)).encode("utf-8")
            ).hexdigest()[:32]
        },
        "properties": {
            **s.to_json(),
            # "call": the region is the call the fix changes; "site": the
            # site's own line (no call changed, or no fix).
            "location": f.at,
            **({"strategy": f.strategy} if f.fix else {}),
            **({"noFix": f.no_fix} if f.no_fix else {}),
        },
    }
    if index >= 0:
        out["ruleIndex"] = index
    if f.chain:
        related = []
        for i, step in enumerate(f.chain, 1):
            loc: dict[str, Any] = {
                "id": i,
                "message": {"text": f"step {i} of the call chain: {step.name}"},
                "logicalLocations": [{"fullyQualifiedName": step.name, "kind": "function"}],
            }
            if step.line is not None:
                loc["physicalLocation"] = {
                    "artifactLocation": _artifact(root, s.path, base),
                    "region": {"startLine": step.line},
                }
            related.append(loc)
        out["relatedLocations"] = related
    if f.fix:
        changes: dict[str, list[dict[str, Any]]] = {}
        for r in f.fix:
            changes.setdefault(r.path, []).append(
                {"deletedRegion": _region(r.deleted), "insertedContent": {"text": r.inserted}}
            )
        out["fixes"] = [
            {
                "description": {
                    "text": f"gdn-backport apply --patchset {s.patchset} --strategy {f.strategy}"
                },
                "artifactChanges": [
                    {"artifactLocation": _artifact(root, path, base), "replacements": reps}
                    for path, reps in changes.items()
                ],
            }
        ]
    return out


def document(
    root: Path,
    found: Sequence[Finding],
    patchsets: Sequence[Patchset],
    exit_code: int,
    *,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """The SARIF log of one run over ``root`` with the chosen ``patchsets``."""
    base = base_of(root, cwd)
    index = {ps.info.id: i for i, ps in enumerate(patchsets)}
    by_id = {ps.info.id: ps for ps in patchsets}
    return {
        "$schema": SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "gdn-backport",
                        "version": __version__,
                        "semanticVersion": __version__,
                        "rules": [rule(ps) for ps in patchsets],
                    }
                },
                "originalUriBaseIds": {BASE: {"uri": base.as_uri().rstrip("/") + "/"}},
                "columnKind": "unicodeCodePoints",
                # Python ends a line at a lone CR too.
                "newlineSequences": ["\r\n", "\n", "\r"],
                "invocations": [{"executionSuccessful": True, "exitCode": exit_code}],
                "results": [
                    result(
                        f, index.get(f.site.patchset, -1), by_id.get(f.site.patchset), root, base
                    )
                    for f in found
                ],
                "properties": {"tree": str(root)},
            }
        ],
    }
