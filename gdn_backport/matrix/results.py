"""What a run of cells prints and leaves: a progress line per cell, the
summary table, JSON, Markdown and one JUnit XML file per cell."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TextIO

from gdn_backport import __version__, sources
from gdn_backport.matrix.model import Cell
from gdn_backport.matrix.runner import CellResult, RunOptions, format_err
from gdn_backport.report import table


class ProgressLine:
    """``[12/51] 0.25.1 gather: verify patched ...``: one live line per cell on
    a terminal, a start and an end line per cell otherwise (CI logs)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def __call__(self, i: int, n: int, cell: Cell, stage: str, res: CellResult | None) -> None:
        head = f"[{i}/{n}] {cell.target} {cell.strategy}"
        if res is None:
            if self.live:
                self._write(f"\r\x1b[2K{head}: {stage} ...")
            elif stage == "fetch":
                self._write(f"{head} ...\n")
            return
        verdict = res.result if res.result != "fail" else "FAIL"
        why = f": {res.problems[0]}" if res.problems else f": {res.skipped}" if res.skipped else ""
        line = f"{head}: {verdict} ({res.seconds:.1f} s){why}"
        self._write(f"\r\x1b[2K{line[:200]}\n" if self.live else f"{line[:300]}\n")


def environment(options: RunOptions) -> dict[str, object]:
    """What ran: versions first (printed before any cell), device, shapes."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    gpu = ""
    if options.device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(0)
    return {
        "gdn_backport": __version__,
        "python": platform.python_version(),
        "torch": version("torch"),
        "triton": version("triton"),
        "device": options.device,
        "gpu": gpu,
        "interpreter": options.device == "cpu",
        "heads": list(options.layer_heads() or ()) or "small CPU shape",
        "scenarios": list(options.scenario_names()),
        "cache": str(sources.cache_dir()),
        "offline": os.environ.get("GDN_BACKPORT_OFFLINE") == "1",
        "host": socket.gethostname(),
    }


def environment_line(env: dict[str, object]) -> str:
    device = f"cuda ({env['gpu']})" if env["device"] == "cuda" else "cpu (Triton interpreter)"
    heads = env["heads"]
    shape = ",".join(map(str, heads)) if isinstance(heads, list) else heads
    return (
        f"gdn-backport {env['gdn_backport']}, python {env['python']}, torch {env['torch']}, "
        f"triton {env['triton']}; device {device}; heads {shape}; "
        f"cache {env['cache']}{' (offline)' if env['offline'] else ''}"
    )


def _worst(res: CellResult) -> str:
    parts = []
    if res.unpatched and res.unpatched.worst is not None:
        parts.append(format_err(res.unpatched.worst))
    if res.patched and res.patched.worst is not None:
        parts.append(format_err(res.patched.worst))
    return " -> ".join(parts) or "-"


def _verdict(res: CellResult, width: int | None = 90) -> str:
    if res.result == "ok":
        return "ok"
    problems = "; ".join(res.problems)
    text = f"skip: {res.skipped}" if res.result == "skip" else f"FAIL: {problems}"
    return text if width is None or len(text) <= width else text[: width - 3] + "..."


def summary_rows(results: Sequence[CellResult], width: int | None = 90) -> list[list[str]]:
    rows = []
    for r in results:
        rows.append(
            [
                r.cell.id,
                r.status_before.value if r.status_before else "-",
                r.status_after.value if r.status_after else "-",
                r.unpatched.summary() if r.unpatched else "-",
                r.patched.summary() if r.patched else "-",
                _worst(r),
                f"{r.seconds:.1f} s",
                _verdict(r, width),
            ]
        )
    return rows


SUMMARY_HEAD = ["cell", "before", "after", "verify unpatched", "verify patched",
                "worst err", "time", "result"]  # fmt: skip


def counts(results: Sequence[CellResult]) -> dict[str, int]:
    return {k: sum(r.result == k for r in results) for k in ("ok", "fail", "skip")}


def render_cells(results: Sequence[CellResult], seconds: float | None = None) -> str:
    c = counts(results)
    tail = f"\n{c['ok']} ok, {c['fail']} failed, {c['skip']} skipped of {len(results)} cells"
    if seconds is not None:
        tail += f" in {seconds:.1f} s"
    return table(SUMMARY_HEAD, summary_rows(results)) + tail


def render_markdown(
    results: Sequence[CellResult], env: dict[str, object], seconds: float | None = None
) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "# gdn-backport matrix",
        "",
        environment_line(env),
        "",
        "| " + " | ".join(SUMMARY_HEAD) + " |",
        "|" + " --- |" * len(SUMMARY_HEAD),
    ]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in summary_rows(results, None)]
    c = counts(results)
    total = f" in {seconds:.1f} s" if seconds is not None else ""
    lines += ["", f"{c['ok']} ok, {c['fail']} failed, {c['skip']} skipped{total}."]
    failing = [r for r in results if r.result == "fail"]
    if failing:
        lines += ["", "## Failures", ""]
        for r in failing:
            lines += [f"- `{r.cell.id}`: " + cell("; ".join(r.problems))]
    return "\n".join(lines) + "\n"


def junit_xml(res: CellResult, env: dict[str, object]) -> ET.ElementTree:
    """One ``<testsuite>`` per cell, one ``<testcase>`` per check (each
    verify scenario is one), failures carrying the error size."""
    suite_name = f"cell({res.cell.id})"
    failures = sum(not c.ok for c in res.checks)
    skipped = sum(bool(c.skipped) for c in res.checks)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    root = ET.Element(
        "testsuites",
        name="gdn-backport matrix",
        tests=str(len(res.checks)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        time=f"{res.seconds:.3f}",
    )
    suite = ET.SubElement(
        root,
        "testsuite",
        name=suite_name,
        tests=str(len(res.checks)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        time=f"{res.seconds:.3f}",
        timestamp=stamp,
        hostname=str(env.get("host", "")),
    )
    props = ET.SubElement(suite, "properties")
    cell = res.cell
    info: dict[str, object] = {
        "release": cell.release.version if cell.release else "",
        "tree": cell.tree.path if cell.tree else "",
        "strategy": cell.strategy,
        "expected": cell.expectation.status.value if cell.expectation else "",
        "status_before": res.status_before.value if res.status_before else "",
        "status_after": res.status_after.value if res.status_after else "",
        "result": res.result,
        **{k: v for k, v in env.items() if k != "host"},
    }
    for k, v in info.items():
        value = ",".join(map(str, v)) if isinstance(v, list) else str(v)
        ET.SubElement(props, "property", name=k, value=value)
    for c in res.checks:
        case = ET.SubElement(suite, "testcase", classname=suite_name, name=c.name)
        if c.seconds is not None:
            case.set("time", f"{c.seconds:.3f}")
        if c.skipped:
            ET.SubElement(case, "skipped", message=c.skipped).text = c.detail or None
        elif not c.ok:
            fail = ET.SubElement(case, "failure", message=c.message, type="AssertionError")
            fail.text = c.detail or c.message
        elif c.message or c.detail:
            out = ET.SubElement(case, "system-out")
            out.text = "\n".join(x for x in (c.message, c.detail) if x)
    ET.indent(root)
    return ET.ElementTree(root)


def write_results(
    results: Sequence[CellResult],
    env: dict[str, object],
    directory: Path,
    seconds: float | None = None,
) -> list[Path]:
    """``<id>.xml`` (JUnit) per cell, ``summary.json`` and ``summary.md``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for res in results:
        path = directory / f"{res.cell.id}.xml"
        junit_xml(res, env).write(path, encoding="utf-8", xml_declaration=True)
        written.append(path)
    doc = {
        "environment": env,
        "seconds": round(seconds, 3) if seconds is not None else None,
        "counts": counts(results),
        "ok": all(r.result != "fail" for r in results),
        "cells": [r.to_json() for r in results],
    }
    summary = directory / "summary.json"
    summary.write_text(json.dumps(doc, indent=2) + "\n")
    markdown = directory / "summary.md"
    markdown.write_text(render_markdown(results, env, seconds))
    return [*written, summary, markdown]
