"""GitHub Actions annotations (``--format github``): one workflow command per site.

``::error file=F,line=L,endLine=E,title=T::MESSAGE`` for every ``affected``
or ``unknown`` site, at the place its SARIF result names
(:mod:`gdn_backport.findings`), the file relative to the current directory
(the job's checkout) when the tree lies in it. Escaping is the one of
GitHub's toolkit (``@actions/core``, ``command.ts``): in the message ``%``,
CR and LF; in a property also ``:`` and ``,``, which would end the value.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gdn_backport.findings import Finding
from gdn_backport.sarif import base_of, display_path
from gdn_backport.site import Status


def escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def command(kind: str, properties: dict[str, object], message: str) -> str:
    props = ",".join(f"{k}={escape_property(str(v))}" for k, v in properties.items())
    return (
        f"::{kind} {props}::{escape_data(message)}"
        if props
        else f"::{kind}::{escape_data(message)}"
    )


def line(f: Finding, root: Path, base: Path) -> str:
    s = f.site
    props: dict[str, object] = {
        "file": display_path(root, s.path, base),
        "line": f.where.start_line,
    }
    if f.where.end_line is not None and f.where.end_line != f.where.start_line:
        props["endLine"] = f.where.end_line
    props["title"] = f"gdn-backport {s.patchset}: {s.status.value}"
    chain = f" (through {s.chain})" if s.via else ""
    if s.status is Status.UNKNOWN:
        tail = "gdn-backport apply refuses this tree until the analysis can decide"
    elif f.fix:
        tail = f"fix: gdn-backport apply --patchset {s.patchset} --strategy {f.strategy}"
    else:
        tail = f"no fix: {f.no_fix}"
    return command("error", props, f"{s.function}{chain}: {s.reason} ({tail})")


def lines(found: Sequence[Finding], root: Path, cwd: Path | None = None) -> list[str]:
    base = base_of(root, cwd)
    return [line(f, root, base) for f in found]
