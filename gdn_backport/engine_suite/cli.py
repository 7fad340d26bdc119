"""``python -m gdn_backport.engine_suite`` and ``gdn-backport verify --engine``.

``main(argv) -> int`` over :func:`.suite.run_engine_suite`; exit codes as in
the package docs (0 all passed, 1 failed or inconclusive, 2 refusal).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "verify_engine"]

DEFAULT_WORKDIR = Path(".gdn-backport-engine")


def _report(args: Any) -> int:
    from gdn_backport.engine_suite.suite import run_engine_suite

    try:
        report = run_engine_suite(
            args.patchset or None,
            args.scenario or None,
            workdir=Path(args.workdir),
            python=args.python,
            json=args.json,
            reuse=getattr(args, "resume", False),
        )
    except ValueError as exc:  # an unknown scenario or patchset
        print(f"gdn-backport: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(report.to_json())
    elif report.refusal is None:
        print(report.table())
    if report.refusal is not None:
        print(report.refusal.line(), file=sys.stderr)
    return report.exit_code


def verify_engine(args: argparse.Namespace) -> int:
    """``gdn-backport verify --engine --installed``: the suite on this Python's vLLM."""
    if getattr(args, "path", None) is not None or getattr(args, "release", None):
        print(
            "gdn-backport: verify --engine drives the vLLM this Python imports: use --installed",
            file=sys.stderr,
        )
        return 2
    args.workdir = getattr(args, "workdir", None) or DEFAULT_WORKDIR
    args.python = None
    return _report(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gdn_backport.engine_suite",
        description="The real-engine suite: the installed vLLM on its GPU, a tiny seeded model, "
        "each patchset's engine scenarios scored token by token.",
    )
    parser.add_argument("--patchset", action="append", metavar="ID", help="only these patchsets")
    parser.add_argument("--scenario", action="append", metavar="NAME", help="only these scenarios")
    parser.add_argument("--workdir", default=str(DEFAULT_WORKDIR), help="models, logs, caches")
    parser.add_argument("--python", default=None, help="the Python whose vLLM to drive")
    parser.add_argument("--resume", action="store_true", help="reuse engine results already there")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.list:
        from gdn_backport.engine_suite.scenarios import collect

        for s in collect(args.patchset or None):
            print(f"{s.name:28} {s.patchset:8} {s.engine.graphs:18} {s.description}")
        return 0
    return _report(args)
