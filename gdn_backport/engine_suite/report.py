"""The engine suite's report: one table (``--json``: one document).

Exit codes: 0 every scenario passed; 1 one failed or was inconclusive;
2 a refusal.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from gdn_backport.engine_suite.preflight import Refusal
from gdn_backport.engine_suite.rules import PASS
from gdn_backport.engine_suite.scoring import Aggregate, TokenScore

__all__ = ["EngineReport", "ScenarioResult"]

_EMPTY = Aggregate.of(())


@dataclass
class ScenarioResult:
    scenario: str
    patchset: str
    result: str
    reason: str
    variant: str = "installed"
    graphs: str = "eager"
    builds: int = 0
    other_builds: dict[str, int] = field(default_factory=dict)
    mixed: int = 0
    misordered: int = 0
    new_rows: dict[str, int] = field(default_factory=dict)  # builder class -> requests
    stale_replays: int = 0  # builds (one per GDN KV-cache group and step)
    stale_steps: int = 0  # engine steps with a stale FULL replay
    recycled: int = 0
    tagged: Aggregate = _EMPTY
    clean: Aggregate = _EMPTY
    ratio: float | None = None
    post_mixed: Aggregate = _EMPTY
    tags: dict[str, Aggregate] = field(default_factory=dict)
    worst: list[TokenScore] = field(default_factory=list)
    gates: str = ""
    live: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def per_1000(self) -> float:
        return 1000.0 * self.misordered / self.builds if self.builds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "patchset": self.patchset,
            "variant": self.variant,
            "graphs": self.graphs,
            "result": self.result,
            "reason": self.reason,
            "builds": self.builds,
            "other_builds": self.other_builds,
            "mixed": self.mixed,
            "misordered": self.misordered,
            "misordered_per_1000": round(self.per_1000, 2),
            "new_rows": self.new_rows,
            "stale_replays": self.stale_replays,
            "stale_steps": self.stale_steps,
            "recycled": self.recycled,
            "tagged": self.tagged.to_json(),
            "clean": self.clean.to_json(),
            "ratio": self.ratio,
            "post_mixed": self.post_mixed.to_json(),
            "tags": {k: v.to_json() for k, v in self.tags.items()},
            "worst": [w.to_json() for w in self.worst],
            "gates": self.gates,
            "live": self.live,
            "seconds": self.seconds,
            "logs": self.logs,
        }


def _num(value: float | None, digits: int = 4) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


@dataclass
class EngineReport:
    results: list[ScenarioResult] = field(default_factory=list)
    refusal: Refusal | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.refusal is not None:
            return 2
        return 0 if self.results and all(r.result == PASS for r in self.results) else 1

    def table(self) -> str:
        if self.refusal is not None:
            return self.refusal.line()
        head = [
            "scenario",
            "patchset",
            "variant",
            "result",
            "builds",
            "misord/1k",
            "tagged n",
            "tagged mean",
            "tagged max",
            "clean mean",
            "ratio",
            "note",
        ]
        rows = [head]
        for r in self.results:
            note = r.reason if len(r.reason) <= 60 else r.reason[:57] + "..."
            rows.append(
                [
                    r.scenario,
                    r.patchset,
                    r.variant,
                    r.result,
                    str(r.builds),
                    _num(r.per_1000, 1),
                    str(r.tagged.count),
                    _num(r.tagged.mean),
                    _num(r.tagged.max),
                    _num(r.clean.mean),
                    _num(r.ratio, 1),
                    note,
                ]
            )
        lines = [_grid(rows), ""]
        for r in self.results:
            lines.append(f"{r.scenario} [{r.variant}, {r.graphs}]: {r.result}: {r.reason}")
            lines.append(f"  {r.gates}")
            lines.append(
                f"  builds {r.builds} in steps ({r.other_builds.get('capture', 0)} capture, "
                f"{r.other_builds.get('other', 0)} other), {r.mixed} mixed, {r.misordered} "
                f"misordered ({r.per_1000:.1f}/1000); new one-token rows {r.new_rows or 0}, "
                f"recycled slots {r.recycled}, stale FULL replays {r.stale_replays} builds in "
                f"{r.stale_steps} steps"
            )
            if r.post_mixed.count:
                lines.append(
                    f"  from the first misordered step on: n={r.post_mixed.count} mean "
                    f"{_num(r.post_mixed.mean)} max {_num(r.post_mixed.max)}"
                )
            for live in r.live:
                patch = live.get("runtime_patch")
                where = f"{live.get('file')}:{live.get('line')} sha256 {live.get('sha256')}"
                lines.append(
                    f"  live _forward_core: {where}"
                    + (f" (in-memory patch {patch})" if patch else "")
                )
            for w in r.worst[:3]:
                lines.append(
                    f"  worst: {w.request}#{w.index} step {w.step} [{w.tag}] |{w.lp_run:.4f} - "
                    f"{w.lp_ref:.4f}| = {w.error:.4f}"
                )
        return "\n".join(lines).rstrip()

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            "refusal": self.refusal.to_json() if self.refusal else None,
            "results": [r.to_json() for r in self.results],
            "facts": self.facts,
            "seconds": round(self.seconds, 1),
            "exit_code": self.exit_code,
        }
        return json.dumps(doc, indent=2)
