"""scan and apply on a folder of real fork files, side by side with a hand judgement.

    python bench/bench_forks.py FOLDER [--manifest FILE] [--json OUT]

FOLDER holds one folder per repository, ``<owner>__<repo>/<repo-relative
path>``, with the files saved from it (fork code is vLLM-derived: it stays
out of this repository, like the releases). Each repository folder is
copied to a scratch tree and run through ``scan --json`` and ``apply
--dry-run --json`` as a whole, so helpers imported from other saved files
resolve. ``--manifest`` is a JSON list of ``{"repo", "path", "commit",
"status"}`` (the hand judgement: affected / fixed / not_affected / unknown /
"no spec path"); the table then says where the tool agrees.

What counts as a disagreement: a file judged affected that the tool does not
report affected (or unknown) is **silent**; one the tool reports affected
or fixed against the judgement is **wrong**; unknown where a verdict was
possible is a refusal (safe, not silent).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

from gdn_backport.cli import main as cli
from gdn_backport.report import table

ORDER = ["unknown", "affected", "fixed", "not_affected"]


def _run(*argv: str) -> tuple[int, dict[str, object], str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(argv))
    text = out.getvalue()
    return code, json.loads(text) if text.strip().startswith("{") else {}, err.getvalue()


def _worst(statuses: list[str]) -> str:
    return min(statuses, key=ORDER.index) if statuses else "no spec path"


def verdict(judged: str, tool: str) -> str:
    if judged == tool:
        return "ok"
    if judged == "affected" and tool not in ("affected", "unknown"):
        return "SILENT"
    if tool in ("affected", "fixed") or (tool == "not_affected" and judged == "affected"):
        return "WRONG"
    if tool == "unknown":
        return "refused"
    return "differs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--manifest", type=Path)
    p.add_argument("--json", type=Path, help="write every row here")
    args = p.parse_args(argv)
    judged: dict[tuple[str, str], dict[str, str]] = {}
    if args.manifest:
        for entry in json.loads(args.manifest.read_text()):
            judged[(entry["repo"].replace("/", "__"), entry["path"])] = entry
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="gdn-forks-") as tmp:
        for repo in sorted(p for p in args.folder.iterdir() if p.is_dir()):
            tree = Path(tmp) / repo.name
            shutil.copytree(repo, tree)
            code, scan, err = _run("scan", str(tree), "--json")
            sites = scan.get("sites", []) if isinstance(scan, dict) else []
            _, applied, _ = _run("apply", "--dry-run", str(tree), "--json")
            refused = {r["path"]: r["reason"] for r in applied.get("refused", [])}  # type: ignore[union-attr]
            diff = str(applied.get("diff", ""))
            files = sorted(
                f.relative_to(tree).as_posix() for f in tree.rglob("*.py") if f.is_file()
            )
            for rel in files:
                mine = [s for s in sites if s["path"] == rel]  # type: ignore[index]
                entry = judged.get((repo.name, rel))
                if entry is None and not mine:
                    continue
                tool = _worst([str(s["status"]) for s in mine])
                if code == 2 and not sites:
                    tool = f"error: {err.strip()[:80]}"
                patch = (
                    "refused" if rel in refused else "patched" if f"+++ b/{rel}" in diff else "-"
                )
                want = entry["status"] if entry else "-"
                rows.append(
                    {
                        "repo": repo.name.replace("__", "/"),
                        "path": rel,
                        "commit": (entry or {}).get("commit", "")[:10],
                        "judged": want,
                        "scan": tool,
                        "apply --dry-run": patch,
                        "via": " | ".join(
                            " -> ".join(s["via"])
                            for s in mine
                            if "via" in s  # type: ignore[index,operator]
                        ),
                        "verdict": verdict(want, tool) if entry else "not judged",
                        "reason": (refused.get(rel) or (mine[0]["reason"] if mine else ""))[:160],  # type: ignore[index]
                    }
                )
    heads = ["repo", "path", "commit", "judged", "scan", "apply --dry-run", "verdict"]
    print(table(heads, [[r[h] for h in heads] for r in rows]))
    counts: dict[str, int] = {}
    for r in rows:
        counts[str(r["verdict"])] = counts.get(str(r["verdict"]), 0) + 1
    print()
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if counts.get("SILENT") or counts.get("WRONG") else 0


if __name__ == "__main__":
    sys.exit(main())
