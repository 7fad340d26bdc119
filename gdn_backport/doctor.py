"""``gdn-backport doctor``: which GDN code runs in this environment, and is it fixed?

Without starting a server: find vLLM (``find_spec``, no import first),
import it, load its general plugins the way vLLM does (so a hardware plugin's
replacement, or our own runtime patch, is what gets looked at), import every
module ``scan`` finds a GDN spec path in, and analyse each method *in effect
on its class* (:mod:`gdn_backport.runtime.live`). Per method: the module
file, the function in effect (file:line), its status, whether our runtime
patch is that function, and whether ``gdn-backport apply`` patched the file
on disk (its records in ``.gdn-backport/`` next to the ``vllm`` package).

Exit: 0 nothing affected is in effect, 1 an affected method is in effect,
2 vLLM cannot be imported or a method in effect is ``unknown``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gdn_backport import registry
from gdn_backport.errors import UsageError
from gdn_backport.records import Records, sha256
from gdn_backport.site import Status


@dataclass(frozen=True)
class Row:
    method: str  # Class.method
    module: str
    path: str  # vllm/... (the file the class is defined in)
    live: str  # file:line of the function in effect, or why none is
    status: str
    reason: str
    runtime_patch: bool  # our plugin's function is the one in effect
    on_disk: str  # what apply's records say about the file
    in_effect: bool = True  # False: the module cannot be imported here
    patchset: str = ""


def _named(rows: list[Row]) -> list[str]:
    """Each row's method, with its module where another row has the same
    name (vLLM's V1 and V2 runners both define
    ``GPUModelRunner.execute_model``)."""
    count: dict[str, int] = {}
    for r in rows:
        count[r.method] = count.get(r.method, 0) + 1
    return [f"{r.method} ({r.module})" if count[r.method] > 1 else r.method for r in rows]


@dataclass
class Report:
    vllm: str = ""  # version and where it is
    plugins: str = ""  # what loading the general plugins did
    rows: list[Row] = field(default_factory=list)
    error: str = ""

    @property
    def exit_code(self) -> int:
        # A method whose module cannot be imported here still counts: the
        # server that imports it runs it.
        if self.error or any(r.status == Status.UNKNOWN.value for r in self.rows):
            return 2
        return 1 if any(r.status == Status.AFFECTED.value for r in self.rows) else 0

    @property
    def verdict(self) -> str:
        if self.error:
            return f"cannot tell: {self.error}"
        bad = [r for r in self.rows if r.status == Status.AFFECTED.value]
        if bad:
            parts = []
            for ps in registry.discover():
                mine = [r for r in bad if r.patchset == ps.info.id]
                if not mine:
                    continue
                names = ", ".join(
                    name + ("" if r.in_effect else " (on disk; not importable here)")
                    for r, name in zip(mine, _named(mine), strict=True)
                )
                parts.append(
                    f"{names} has the vLLM #{ps.info.number} bug (fix: {ps.doctor_hint()})"
                )
            return "AFFECTED: " + "; ".join(parts)
        unknown = _named([r for r in self.rows if r.status == Status.UNKNOWN.value])
        if unknown:
            return f"UNKNOWN: {', '.join(unknown)} cannot be analysed; check it by hand"
        ours = _named([r for r in self.rows if r.runtime_patch])
        if ours:
            return f"ok: fixed in memory by the gdn-backport plugin ({', '.join(ours)})"
        return "ok: no affected GDN method is in effect"

    def table(self) -> str:
        out = [f"vllm: {self.vllm or '-'}", f"plugins: {self.plugins or '-'}"]
        if self.rows:
            head = ("patchset", "method", "file", "in effect", "status", "runtime patch",
                    "on disk")  # fmt: skip
            cells = [
                (
                    r.patchset,
                    r.method,
                    r.path,
                    r.live,
                    r.status,
                    "yes" if r.runtime_patch else "no",
                    r.on_disk,
                )
                for r in self.rows
            ]
            widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
            for line in [head, tuple("-" * w for w in widths), *cells]:
                out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)))
        out.append(f"verdict: {self.verdict}")
        return "\n".join(line.rstrip() for line in out)

    def to_json(self) -> str:
        doc = asdict(self)
        doc["verdict"] = self.verdict
        doc["exit_code"] = self.exit_code
        return json.dumps(doc, indent=2)


def on_disk(root: Path, rel: str) -> str:
    """What ``apply``'s records (``<root>/.gdn-backport``) say about ``rel``."""
    try:
        records = Records(root)
    except UsageError as exc:
        return f"unreadable record ({exc})"
    if not records.for_path(rel):
        return "no apply record"
    try:
        current = sha256((root / rel).read_bytes())
    except OSError:
        return "apply record, file missing"
    record = records.matching(rel, current)
    if record is not None:
        return f"patched by apply ({record.strategy})"
    if any(r.original_sha256 == current for r in records.for_path(rel)):
        return "apply record, the file holds its original"
    return "apply record, but the file changed since"


def _load_plugins() -> str:
    try:
        plugins = importlib.import_module("vllm.plugins")
    except ImportError as exc:
        return f"vllm.plugins not importable ({exc})"
    load = getattr(plugins, "load_general_plugins", None)
    if load is None:
        return "this vLLM has no load_general_plugins()"
    load()
    return "general plugins loaded (vllm.plugins.load_general_plugins)"


def _our_plugin() -> str:
    from gdn_backport.runtime import plugin

    if not plugin.loaded():
        return "; gdn-backport plugin not loaded (not installed here, or left out of VLLM_PLUGINS)"
    return "; gdn-backport plugin loaded"


def diagnose(load_plugins: bool = True) -> Report:
    """The report for the vLLM this Python imports (see module docs)."""
    report = Report()
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        report.error = f"vLLM is not importable from this Python ({sys.executable})"
        return report
    package = Path(next(iter(spec.submodule_search_locations)))
    root = package.parent
    try:
        vllm = importlib.import_module("vllm")
    except Exception as exc:
        report.error = f"{package}: importing vllm failed: {type(exc).__name__}: {exc}"
        return report
    report.vllm = f"{getattr(vllm, '__version__', '?')} ({package})"
    if load_plugins:
        report.plugins = _load_plugins()

    report.plugins += _our_plugin()
    for ps in registry.discover():
        report.rows += ps.doctor_rows(package, root)
    return report
