"""Command line: ``main(argv) -> int`` over the library API.

Exit codes: 0 done or nothing to do; 1 a check failed or affected sites
remain; 2 bad usage or a refusal (one line on stderr naming the file and
the reason; nothing changed on disk).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport import __version__, registry
from gdn_backport.errors import UsageError

if TYPE_CHECKING:
    from gdn_backport import matrix, vllm_version
    from gdn_backport.context import Vllm
    from gdn_backport.pipeline import Mode, Outcome
    from gdn_backport.site import Site
    from gdn_backport.tree import Tree


DESCRIPTION = """\
Find, prove and backport fixes of the Gated DeltaNet family in any vLLM tree
(a checkout or fork, an unpacked sdist, the vllm package itself, or the vllm
this Python imports). Sites are found by analysing the code, never by
version number; nothing of the target is executed. The fixes (patchsets):"""


def _description() -> str:
    lines = [DESCRIPTION]
    for p in registry.discover():
        lines.append(f"  {p.info.id}: vLLM PR #{p.info.number}: {p.info.summary}")
    return "\n".join(lines)


EPILOG = """\
commands:
  scan PATH                  GDN sites: affected / fixed / not_affected / unknown
  apply PATH                 rewrite affected sites in place, print the diff
  apply --check PATH         CI gate: exit 1 while an affected site remains
  apply --dry-run PATH       the diff only
  apply --commit PATH        git: the fix as one commit on a new branch
  revert PATH                the original bytes back
  verify PATH                the mixed-batch regression suite on that tree
  fetch X.Y.Z                a release's sources from PyPI into the cache
  matrix check               scan every release of matrix/, compare with what it expects
  matrix run                 run its cells: fetch, patch a copy, scan, verify
  matrix export github|buildkite  the cells as a CI document
  doctor                     which GDN code this Python's vLLM runs, and its status

--patchset NAME (repeatable; scan, apply, revert, verify): only these
patchsets (default all of them).

PATH: a folder holding vllm/ (or one folder down), the vllm package itself,
a plugin importing vllm, or one file. Instead of PATH: --installed (the vllm
this Python imports) or --release X.Y.Z (fetched from PyPI; apply/revert
work on a copy, --workdir, default ./vllm-X.Y.Z).

exit codes:
  0  done, or nothing to do
  1  a check failed, or affected sites remain
  2  bad usage or a refusal: one line on stderr naming the file and the
     reason; nothing was changed on disk (README: "What a refusal means")

`gdn-backport COMMAND --help` shows a command's options."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # main() prints "gdn-backport: " once: name only the command here.
        command = self.prog.removeprefix("gdn-backport").strip()
        raise UsageError(f"{command}: {message}" if command else message)


def _target(p: argparse.ArgumentParser, write: bool = False) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("path", nargs="?", type=Path, help="vLLM checkout, unpacked sdist or one file")
    g.add_argument("--release", metavar="X.Y.Z", help="fetch this vLLM release from PyPI first")
    g.add_argument("--installed", action="store_true",
                   help="the vllm this Python imports (site-packages), found without "
                   "importing it")  # fmt: skip
    if write:
        p.add_argument(
            "--workdir",
            type=Path,
            help="with --release: the copy to patch (default ./vllm-X.Y.Z); "
            "the cached release itself is never modified",
        )
    p.add_argument("--json", action="store_true", help="print one JSON document")


def _kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kernels",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a TOML file of [[kernel]] tables declaring the fork's own kernels "
        "(added to .gdn-backport.toml / [tool.gdn-backport] in the tree)",
    )


def _vllm_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vllm",
        type=Path,
        metavar="PATH",
        help="a plugin's tree: the vLLM it runs on (a source tree or its vllm package "
        "folder), read, never written, for the definitions the tree lacks; default the vllm "
        "this Python imports",
    )


def _vllm(args: argparse.Namespace) -> Vllm | None:
    """The vLLM a PATH's tree is read against (``--vllm`` checked here: bad
    input stops the run before anything is read or written)."""
    from gdn_backport.context import Vllm

    given = getattr(args, "vllm", None)
    if args.path is None:
        if given is not None:
            raise UsageError(f"{args.command}: --vllm goes with PATH (a plugin's tree)")
        return None
    return Vllm(given)


def _inherited(tree: Tree, chosen: Sequence[registry.Patchset]) -> None:
    """Notes on the vLLM's sites a plugin's classes run by inheritance."""
    from gdn_backport.context import inherited_notes

    inherited_notes(tree, chosen)


def _vllm_lines(ctx: Vllm | None) -> tuple[list[str], dict[str, object]]:
    """Which vLLM the facts came from: the human line, the JSON addition."""
    doc = ctx.to_json() if ctx is not None else None
    lines = ctx.lines() if ctx is not None else []
    return lines, ({"vllm_context": doc} if doc is not None else {})


def _format(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--format",
        choices=["table", "json", "sarif", "github"],
        help="table (default), json (as --json), sarif (SARIF 2.1.0 for code scanning, each "
        "affected site with its fix) or github (one ::error annotation per affected or "
        "unknown site); exit codes are the same (docs/ci.md)",
    )


def _output_format(args: argparse.Namespace) -> str:
    """``--format``, with ``--json`` as its ``json``."""
    fmt = args.format or ("json" if args.json else "table")
    if args.json and fmt != "json":
        raise UsageError(f"{args.command}: --json and --format {fmt} exclude each other")
    args.json = fmt == "json"
    return str(fmt)


def _ci_report(
    args: argparse.Namespace,
    path: Path,
    root: Path,
    sites: Sequence[Site],
    chosen: Sequence[registry.Patchset],
    code: int,
    fmt: str,
) -> int:
    """``--format sarif|github``: the sites, each affected one with the fix
    of its patchset's dry run alone; ``code`` is the command's exit code."""
    from gdn_backport import ci_formats, installed, pipeline
    from gdn_backport.pipeline import Mode

    def dry_run(ps: registry.Patchset, strategy: str) -> Outcome:
        if args.installed:
            inst = installed.locate_vllm()
            return installed.apply(inst, strategy, Mode.DRY_RUN, args.kernels, [ps])[0]
        return pipeline.apply(path, [ps], strategy, Mode.DRY_RUN, kernels=args.kernels)[0][1]

    strategy = getattr(args, "strategy", None)
    print(ci_formats.render(fmt, root, sites, chosen, code, dry_run, strategy), end="")
    return code


def _patchsets(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--patchset",
        action="append",
        metavar="NAME",
        help=f"only this patchset (repeatable; default all: {', '.join(registry.available())})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gdn-backport",
        description=_description(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gdn-backport {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("scan", help="list GDN spec paths: affected / fixed / not_affected")
    _target(p)
    _vllm_option(p)
    _kernels(p)
    _patchsets(p)
    _format(p)

    p = sub.add_parser("apply", help="rewrite affected sites in place, print the diff")
    _target(p, write=True)
    _vllm_option(p)
    _kernels(p)
    _patchsets(p)
    _format(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 while an affected site remains")
    mode.add_argument("--dry-run", action="store_true", help="print the diff, change nothing")
    mode.add_argument(
        "--commit",
        action="store_true",
        help="git work tree: commit the fix on a new branch (checked out)",
    )
    p.add_argument(
        "--strategy",
        help="a patchset's strategy; the patchsets that do not have it use their own "
        "default ("
        + "; ".join(f"{p.info.id}: {', '.join(p.info.strategies)}" for p in registry.discover())
        + ")",
    )
    p.add_argument(
        "--branch",
        metavar="NAME",
        help="with --commit: the branch (default gdn-backport/ and the ids of the patchsets "
        "that change something, joined by +)",
    )
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="with --commit: other uncommitted changes are allowed (and never committed)",
    )
    p.add_argument(
        "--format-patch",
        type=Path,
        metavar="FILE",
        help="write the fix as a `git am` patch; without --commit the tree and branches "
        "are left unchanged",
    )

    p = sub.add_parser("revert", help="restore the original bytes of patched files")
    _target(p, write=True)
    _patchsets(p)
    p.add_argument("--dry-run", action="store_true", help="print the diff, change nothing")

    p = sub.add_parser("verify", help="run the mixed-batch regression suite against a tree")
    _target(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu runs the tree's Triton kernels under the interpreter")  # fmt: skip
    p.add_argument("--scenario", action="append", metavar="NAME", help="only these scenarios")
    _patchsets(p)
    p.add_argument(
        "--heads",
        metavar="H,HV,D",
        help="layer shape: key heads, value heads, head dim (default: small CPU shape)",
    )
    p.add_argument(
        "--engine",
        action="store_true",
        help="the real-engine suite on the vLLM and GPU of this Python (with --installed)",
    )

    p = sub.add_parser("fetch", help="a release's sources from PyPI into the cache")
    p.add_argument("versions", nargs="*", metavar="X.Y.Z")
    p.add_argument("--matrix", action="store_true", help="every release in matrix/")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("matrix", help="the version matrix: check, run or export its cells")
    msub = p.add_subparsers(dest="matrix_command", metavar="{check,run,export}")
    m = msub.add_parser("check", help="scan every release, compare with matrix/releases.toml")
    m.add_argument("--release", action="append", metavar="X.Y.Z", help="only these releases")
    m.add_argument(
        "--roundtrip",
        action="store_true",
        help="also patch a copy of each affected release: fixed after apply, "
        "idempotent, byte-identical after revert",
    )
    m.add_argument("--json", action="store_true", help="print one JSON document")
    m = msub.add_parser("run", help="run the cells: fetch, patch a copy, scan, verify")
    _matrix_cells(m)
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when torch sees a GPU, else the CPU interpreter")  # fmt: skip
    m.add_argument("--scenario", action="append", metavar="NAME", help="only these scenarios")
    m.add_argument("--heads", metavar="H,HV,D", help="layer shape (GPU default 16,32,128)")
    m.add_argument("--results", "--junit-dir", type=Path, default=Path(".nox-results"),
                   help="JUnit XML per cell, summary.json and .md (.nox-results)")  # fmt: skip
    m.add_argument("--json", action="store_true", help="print one JSON document")
    m = msub.add_parser("export", help="the cells as a CI document (one job per cell)")
    m.add_argument("format", choices=["github", "buildkite"],
                   help="github: a strategy.matrix (JSON); buildkite: a pipeline")  # fmt: skip
    _matrix_cells(m)
    m.add_argument("--queue", default="gpu", help="buildkite: the agent queue")
    m.add_argument("--setup", default="", metavar="CMD",
                   help="buildkite: run CMD before each cell (an install); every $ is written "
                   "$$ so Buildkite's upload leaves $VAR for the step's shell")  # fmt: skip

    p = sub.add_parser(
        "doctor", help="which GDN code this Python's vLLM runs, and whether it is fixed"
    )
    p.add_argument("--no-plugins", action="store_true",
                   help="do not load vLLM's general plugins first")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def _matrix_cells(p: argparse.ArgumentParser) -> None:
    """Which cells: all of matrix/ by default."""
    p.add_argument("--cell", action="append", metavar="ID", help="only this cell: 0.25.1-gather")
    p.add_argument("--release", action="append", metavar="X.Y.Z", help="only these releases")
    p.add_argument("--strategy", action="append", metavar="S", help="none, gather or kernel")
    p.add_argument("--tree", action="append", type=Path, metavar="PATH",
                   help="a fork's own tree (the directory holding vllm/) as a target")  # fmt: skip
    p.add_argument("--ref", default="", help="with --tree: the tree at this git ref")


_MATRIX_COMMANDS = ("check", "run", "export", "-h", "--help")


def _legacy_matrix(argv: list[str]) -> list[str]:
    """``matrix`` as it was before its subcommands (CI files exported then
    still call it): ``--run`` is ``run``, ``--format github|buildkite`` is
    ``export``, ``--format json`` is ``--json``, and a bare ``matrix
    [--release X]`` is ``matrix check``. The old spellings say what they are
    now."""
    if not argv or argv[0] != "matrix" or (len(argv) > 1 and argv[1] in _MATRIX_COMMANDS):
        return argv
    rest, fmt = [], None
    tokens = iter(argv[1:])
    for tok in tokens:
        if tok == "--format":
            fmt = next(tokens, None)
        elif tok.startswith("--format="):
            fmt = tok.split("=", 1)[1]
        else:
            rest.append(tok)
    run = "--run" in rest
    if run:
        rest.remove("--run")
    new = ["export", fmt] if fmt in ("github", "buildkite") else ["run"] if run else ["check"]
    if fmt == "json":
        rest.append("--json")
    if run or fmt is not None:
        old = " ".join([*(["--run"] if run else []), *([f"--format {fmt}"] if fmt else [])])
        print(f"gdn-backport: `matrix {old} ...` is now `matrix {' '.join(new)} ...`",
              file=sys.stderr)  # fmt: skip
    return ["matrix", *new, *rest]


def _resolve(args: argparse.Namespace, write: bool, create: bool = True) -> Path | None:
    """The tree a command works on. ``write``: it will be written (a PATH in
    the release cache is refused; ``--release`` means the --workdir copy);
    ``create``: make that copy if missing (else None when there is none)."""
    from gdn_backport.tree import check_vllm_tree

    if getattr(args, "workdir", None) is not None and args.release is None:
        raise UsageError(f"{args.command}: --workdir goes with --release")
    if args.path is not None:
        check_vllm_tree(Path(args.path), records=args.command == "revert")
        if write:
            from gdn_backport import sources  # the release machinery: 10 ms a scan need not pay

            sources.check_outside_cache(Path(args.path))
        return Path(args.path)
    from gdn_backport import sources

    if args.installed:
        from gdn_backport import installed

        return installed.locate_vllm().root
    if not write:
        return sources.release_tree(args.release)
    work = args.workdir or Path(f"vllm-{args.release}")
    existed = os.path.lexists(work)
    made = not existed or (work.is_dir() and not any(work.iterdir()))
    tree = sources.workdir(args.release, work, create=create)
    if tree is not None and made:
        print(f"copied vllm {args.release} to {work}", file=sys.stderr)
        # A run that refuses must leave the disk as it found it: this copy too.
        args.made_workdir = (work, existed)
    return tree


def _drop_made_workdir(args: argparse.Namespace) -> None:
    """Remove the --workdir copy this run made (and only that)."""
    made = getattr(args, "made_workdir", None)
    if made is None:
        return
    work, existed = made
    import shutil

    if existed:
        # It was an empty folder: empty it again.
        for child in work.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    else:
        shutil.rmtree(work, ignore_errors=True)


def _tree(args: argparse.Namespace, write: bool) -> Path:
    tree = _resolve(args, write)
    assert tree is not None
    return tree


def _where(site: Site) -> str:
    """``path:line``, and where a symbolic link on the way really leads."""
    at = f"{site.path}:{site.line}"
    return f"{at} -> {site.target}" if site.target else at


def _print_sites(
    root: Path, sites: Sequence[Site], several: bool = False, notes: Sequence[str] = ()
) -> None:
    """``notes``: what the patchsets looked at and accounted for (printed
    when no site was found: why "nothing" is an answer)."""
    from gdn_backport import vllm_version
    from gdn_backport.report import table

    print(f"tree: {root}")
    print(vllm_version.line(vllm_version.detect(root)))
    if not sites:
        print("no GDN spec path, metadata builder or runner route found" + "".join(notes))
        return
    chains = any(s.via for s in sites)
    rows: list[tuple[str, ...]] = [
        ((s.patchset,) if several else ())
        + (_where(s), s.function, s.status.value)
        + ((s.chain or "-",) if chains else ())
        + (s.reason,)
        for s in sites
    ]
    head = [
        *(["patchset"] if several else []),
        "site",
        "function",
        "status",
        *(["via"] if chains else []),
        "reason",
    ]
    print(table(head, rows))


def _scan_target(args: argparse.Namespace) -> tuple[Path, Path]:
    """(path, root) of what ``scan``/``verify`` read."""
    from gdn_backport.tree import tree_root

    if args.installed:
        from gdn_backport import installed

        inst = installed.locate_vllm()
        return inst.package, inst.root
    path = _tree(args, write=False)
    return path, tree_root(path)


def _check_single_file(
    path: Path, sites: Sequence[Site], chosen: Sequence[registry.Patchset]
) -> None:
    """A single FILE named for a gate must hold a site of the chosen
    patchsets: a file with none (a text file, an unrelated module, the old
    path of a layer that moved in a rebase) would make the gate pass on
    nothing. A folder may hold none (an older vLLM has no GDN code)."""
    if path.is_file() and not sites:
        which = ", ".join(p.info.id for p in chosen)
        raise UsageError(
            f"{path}: no site of {which} in this file (no GDN spec path, metadata builder or "
            "runner route); name the file that holds one, or the tree"
        )


def _cmd_scan(args: argparse.Namespace) -> int:
    from gdn_backport import pipeline, vllm_version
    from gdn_backport.tree import Tree

    fmt = _output_format(args)
    chosen = registry.selected(args.patchset)
    ctx = _vllm(args)
    path, root = _scan_target(args)
    tree = Tree.of(path, root, args.kernels, vllm=ctx)
    sites = pipeline.scan(tree, chosen)
    _check_single_file(path, sites, chosen)
    _inherited(tree, chosen)
    left = [tree.relative(p) for p in tree.leftovers()]
    lines, extra = _vllm_lines(ctx)
    if fmt in ("sarif", "github"):
        _warn(_leftovers_warning(root, left))
        statuses = {s.status.value for s in sites}
        code = 2 if "unknown" in statuses else 1 if "affected" in statuses else 0
        code = _ci_report(args, path, root, sites, chosen, code, fmt)
        _warn(_unknown_line(sites))
        return code
    if args.json:
        version = vllm_version.to_json(vllm_version.detect(root))
        doc = {
            "tree": str(root),
            "patchsets": [p.info.id for p in chosen],
            "sites": [s.to_json() for s in sites],
            "vllm_version": version,
            "leftovers": left,
            **extra,
        }
        print(json.dumps(doc, indent=2))
    else:
        _print_sites(root, sites, len(chosen) > 1, tree.notes)
        for line in lines:
            print(line)
    _warn(_leftovers_warning(root, left))
    bad = {s.status.value for s in sites}
    # Exit 2 comes with its line on stderr (a gate's log shows why it failed).
    _warn(_unknown_line(sites))
    return 2 if "unknown" in bad else 1 if "affected" in bad else 0


def _unknown_line(sites: Sequence[Site]) -> str:
    """The stderr line of a scan that exits 2 for its ``unknown`` sites
    (none: no line); the reasons are in the report on stdout."""
    unknown = [s for s in sites if s.status.value == "unknown"]
    if not unknown:
        return ""
    where = ", ".join(f"{s.path}:{s.line} {s.function}" for s in unknown)
    return (
        f"gdn-backport: {len(unknown)} unknown site(s): {where}; "
        "apply refuses them (the reasons are in the report)"
    )


def exit_code(out: Outcome, dry_run: bool = False, preview: bool = False) -> int:
    """The process's exit code for an outcome: 2 refused; 1 affected sites
    remain, except where the run only previews (``--dry-run``, a patch file
    without ``--commit``, ``revert``): there that is expected, not a failure."""
    code = out.exit_code
    return 0 if code == 1 and (dry_run or preview) else code


def _print_outcome(
    out: Outcome,
    as_json: bool,
    extra: dict[str, object] | None = None,
    notes: Sequence[str] = (),
    version: vllm_version.VllmVersion | None = None,
    *,
    dry_run: bool = False,
    preview: bool = False,
) -> int:
    """Print the outcome; its exit code (:func:`exit_code`), which is also
    the JSON document's ``exit_code``. ``extra``: more JSON fields; ``notes``:
    more human lines after the message; ``version``: the tree's vLLM version,
    if known before the run."""
    from gdn_backport import vllm_version
    from gdn_backport.report import table

    version = version or vllm_version.detect(out.tree)
    code = exit_code(out, dry_run, preview)
    if as_json:
        doc = {**out.to_json(), "vllm_version": vllm_version.to_json(version), **(extra or {})}
        doc["exit_code"] = code
        print(json.dumps(doc, indent=2))
    else:
        print(f"tree: {out.tree}")
        print(vllm_version.line(version))
        chains = any(c.site.via for c in out.changes)
        several = len({c.site.patchset for c in out.changes}) > 1
        rows: list[tuple[str, ...]] = [
            ((c.site.patchset,) if several else ())
            + (_where(c.site), c.site.function)
            + ((c.site.chain or "-",) if chains else ())
            + (c.site.status.value, c.rewritten.status.value, "yes" if c.changed else "no")
            for c in out.changes
        ]
        head = [
            *(["patchset"] if several else []),
            "site",
            "function",
            *(["via"] if chains else []),
            "before",
            "after",
            "changed",
        ]
        if rows:
            print(table(head, rows))
        if out.diff:
            print(out.diff, end="" if out.diff.endswith("\n") else "\n")
        print(out.message)
        for note in notes:
            print(note)
    for path, reason in out.refused:
        print(f"gdn-backport: {out.tree / path}: {reason}", file=sys.stderr)
    if out.tracebacks and _show_tracebacks():
        for trace in out.tracebacks.values():
            print(trace, end="" if trace.endswith("\n") else "\n", file=sys.stderr)
    if out.leftovers_removed:
        if not as_json:
            n = len(out.leftovers)
            print(f"removed {n} leftover temporary file(s) of an interrupted gdn-backport run: "
                  + ", ".join(out.leftovers))  # fmt: skip
    elif not out.refused:
        _warn(_leftovers_warning(out.tree, out.leftovers))
    return code


def _show_tracebacks() -> bool:
    from gdn_backport.result import show_tracebacks

    return show_tracebacks()


def _leftovers_warning(root: Path, left: Sequence[str]) -> str:
    if not left:
        return ""
    return (
        f"gdn-backport: warning: {len(left)} leftover temporary file(s) of an interrupted "
        f"gdn-backport run in {root}: {', '.join(left)}; the next `gdn-backport apply` or "
        "`revert` of this tree removes them"
    )


def _cmd_apply(args: argparse.Namespace) -> int:
    from gdn_backport import installed, pipeline
    from gdn_backport.pipeline import Mode
    from gdn_backport.tree import tree_root

    mode = Mode.CHECK if args.check else Mode.DRY_RUN if args.dry_run else Mode.WRITE
    fmt = _output_format(args)
    if fmt in ("sarif", "github") and mode is Mode.WRITE:
        raise UsageError(f"apply: --format {fmt} goes with --check or --dry-run")
    ctx = _vllm(args)
    if args.commit or args.format_patch:
        return _apply_git(args, mode, ctx)
    if args.branch or args.allow_dirty:
        raise UsageError("apply: --branch and --allow-dirty go with --commit")
    chosen = registry.selected(args.patchset)
    if args.strategy is not None:
        _check_strategy(args.strategy, chosen)
    if args.installed:
        inst = installed.locate_vllm()
        out, caches = installed.apply(inst, args.strategy, mode, args.kernels, chosen)
        if fmt in ("sarif", "github"):
            return _ci_outcome(args, inst.package, out, chosen, mode, fmt)
        code = _print_outcome(out, args.json, dry_run=mode is Mode.DRY_RUN)
        _warn(installed.caches_warning(out.tree, caches))
    else:
        path = _tree(args, write=mode is Mode.WRITE)
        try:
            results = pipeline.apply(
                path, chosen, args.strategy, mode, kernels=args.kernels, vllm=ctx
            )
            out = pipeline.merged(results, tree_root(path))
            _check_single_file(path, [c.site for c in out.changes], chosen)
            if ctx is not None:
                from gdn_backport.tree import Tree

                _inherited(Tree.of(path, vllm=ctx), chosen)
        except UsageError:
            _drop_made_workdir(args)
            raise
        if out.refused:
            _drop_made_workdir(args)
        if fmt in ("sarif", "github"):
            return _ci_outcome(args, path, out, chosen, mode, fmt)
        # --dry-run previews: affected sites remaining is expected, not a failure.
        lines, extra = _vllm_lines(ctx)
        code = _print_outcome(out, args.json, extra, lines, dry_run=mode is Mode.DRY_RUN)
    return code


def _ci_outcome(
    args: argparse.Namespace,
    path: Path,
    out: Outcome,
    chosen: Sequence[registry.Patchset],
    mode: Mode,
    fmt: str,
) -> int:
    """``apply --check/--dry-run --format sarif|github``: the exit code and
    the stderr lines of the run as they are; the report on stdout."""
    from gdn_backport.pipeline import Mode

    for rel, reason in out.refused:
        print(f"gdn-backport: {out.tree / rel}: {reason}", file=sys.stderr)
    if not out.refused:
        _warn(_leftovers_warning(out.tree, out.leftovers))
    code = exit_code(out, dry_run=mode is Mode.DRY_RUN)
    sites = [c.site for c in out.changes]
    return _ci_report(args, path, out.tree, sites, chosen, code, fmt)


def _check_strategy(strategy: str, chosen: Sequence[registry.Patchset]) -> None:
    """A strategy no chosen patchset has is a usage error (one that some
    have, e.g. ``kernel``, applies to those; the others use their own)."""
    if not any(strategy in p.info.strategies for p in chosen):
        known = sorted({s for p in chosen for s in p.info.strategies})
        raise UsageError(f"apply: --strategy {strategy}: unknown (choose from {', '.join(known)})")


def _apply_git(args: argparse.Namespace, mode: Mode, ctx: Vllm | None = None) -> int:
    from gdn_backport import gitflow, sources
    from gdn_backport.pipeline import Mode
    from gdn_backport.tree import check_vllm_tree

    if mode is not Mode.WRITE:
        other = "--check" if args.check else "--dry-run"
        raise UsageError(f"apply: --commit/--format-patch and {other} exclude each other")
    if args.path is None:
        raise UsageError("apply: --commit/--format-patch take a PATH in a git work tree")
    check_vllm_tree(args.path)
    sources.check_outside_cache(args.path)
    if args.branch and not args.commit:
        raise UsageError("apply: --branch goes with --commit")
    result = gitflow.apply_git(
        args.path,
        args.strategy,
        commit=args.commit,
        branch=args.branch,
        allow_dirty=args.allow_dirty,
        patch=args.format_patch,
        kernels=args.kernels,
        fixes=registry.selected(args.patchset),
        vllm=ctx,
    )
    lines, extra = _vllm_lines(ctx)
    # The version as it was before the commit (after it, git describe says 0.25.1-1-g...).
    # --format-patch alone leaves the tree as it was: affected, as intended.
    return _print_outcome(
        result.outcome,
        args.json,
        {"git": result.to_json(), **extra},
        [*result.lines(), *lines],
        result.vllm_version,
        preview=not args.commit,
    )


def _warn(line: str) -> None:
    if line:
        print(line, file=sys.stderr)


def _cmd_revert(args: argparse.Namespace) -> int:
    from gdn_backport import installed
    from gdn_backport.pipeline import Mode, Outcome, revert_tree

    mode = Mode.DRY_RUN if args.dry_run else Mode.WRITE
    upstreams = (
        frozenset(p.info.upstream for p in registry.selected(args.patchset))
        if args.patchset
        else None
    )
    if args.installed:
        out, caches = installed.revert(installed.locate_vllm(), mode, upstreams)
        # revert reports the sites as they are afterwards: affected is its aim.
        code = _print_outcome(out, args.json, preview=True)
        _warn(installed.caches_warning(out.tree, caches))
    else:
        tree = _resolve(args, write=True, create=False)
        if tree is None:
            # --release with no copy made yet: nothing was ever patched there.
            work = args.workdir or Path(f"vllm-{args.release}")
            out = Outcome(work, message=f"nothing to revert: {work} does not exist (no copy "
                          f"of vllm {args.release} was made)")  # fmt: skip
        else:
            out = revert_tree(tree, mode, upstreams=upstreams)
        code = _print_outcome(out, args.json, preview=True)
    return code


def _cmd_fetch(args: argparse.Namespace) -> int:
    from gdn_backport import matrix, sources
    from gdn_backport.report import table

    versions = list(args.versions)
    if args.matrix:
        # wheel_only releases (0.15.x: ~500 MB wheels) only when named.
        versions += [r.version for r in matrix.load().releases if not r.wheel_only]
    if not versions:
        raise UsageError("fetch: name a release (X.Y.Z) or --matrix")
    trees = {v: str(sources.release_tree(v)) for v in versions}
    if args.json:
        print(json.dumps({"cache": str(sources.cache_dir()), "trees": trees}, indent=2))
    else:
        print(table(["release", "tree"], list(trees.items())))
    return 0


def _cmd_matrix(args: argparse.Namespace) -> int:
    from gdn_backport import matrix
    from gdn_backport.matrix import export

    if args.matrix_command == "check":
        results = matrix.run(matrix.load(), only=args.release, with_roundtrip=args.roundtrip)
        if args.json:
            print(json.dumps([r.to_json() for r in results], indent=2))
        else:
            print(matrix.render(results))
        return 0 if all(r.ok for r in results) else 1
    trees = [matrix.adhoc_tree(t, args.ref) for t in args.tree or ()]
    cells = matrix.cells(matrix.load(), args.release, args.strategy, args.cell, trees)
    if not cells:
        raise UsageError(f"matrix {args.matrix_command}: no cell matches")
    if args.matrix_command == "export":
        if args.format == "github":
            print(export.github_json(cells))
        else:
            print(export.buildkite_yaml(cells, args.queue, args.setup), end="")
        return 0
    return _run_cells(args, cells)


def _run_cells(args: argparse.Namespace, cells: Sequence[matrix.Cell]) -> int:
    """``matrix run``: versions first, a live line per cell, the summary last."""
    import time

    from gdn_backport import matrix

    device = matrix.resolve_device(args.device)
    heads = matrix.parse_heads(args.heads) if args.heads else None
    options = matrix.RunOptions(device, tuple(args.scenario or ()), heads)
    env = matrix.environment(options)
    print(matrix.environment_line(env), file=sys.stderr)
    names = options.scenario_names({c.patchset for c in cells})
    print(f"{len(cells)} cell(s); scenarios: {', '.join(names)}", file=sys.stderr)
    t0 = time.perf_counter()
    results = matrix.run_cells(cells, options, matrix.ProgressLine(sys.stderr))
    seconds = time.perf_counter() - t0
    files = matrix.write_results(results, env, args.results, seconds)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        print(matrix.render_cells(results, seconds))
    print(f"results: {files[-2]}, {files[-1]}, JUnit XML per cell in {args.results}",
          file=sys.stderr)  # fmt: skip
    return matrix.exit_code(results)


def _cmd_verify(args: argparse.Namespace) -> int:
    if args.engine:
        from gdn_backport.engine_suite.cli import verify_engine

        return verify_engine(args)
    from gdn_backport.verify import verify_tree

    heads = None
    if args.heads:
        try:
            h, hv, dim = (int(x) for x in args.heads.split(","))
        except ValueError as exc:
            raise UsageError(f"--heads {args.heads}: expected H,HV,D (three integers)") from exc
        heads = (h, hv, dim)
    chosen = [p.info.id for p in registry.selected(args.patchset)] if args.patchset else None
    path, root = _scan_target(args)
    report = verify_tree(
        root if args.installed else path,
        device=args.device,
        scenarios=args.scenario,
        heads=heads,
        patchsets=chosen,
    )
    print(report.to_json() if args.json else report.table())
    if report.error:
        print(f"gdn-backport: {report.tree}: {report.error}", file=sys.stderr)
    return report.exit_code


def _cmd_doctor(args: argparse.Namespace) -> int:
    from gdn_backport.doctor import diagnose

    report = diagnose(load_plugins=not args.no_plugins)
    print(report.to_json() if args.json else report.table())
    if report.error:
        print(f"gdn-backport: {report.error}", file=sys.stderr)
    return report.exit_code


COMMANDS = {
    "scan": _cmd_scan,
    "apply": _cmd_apply,
    "revert": _cmd_revert,
    "verify": _cmd_verify,
    "fetch": _cmd_fetch,
    "matrix": _cmd_matrix,
    "doctor": _cmd_doctor,
}


def _tune_gc() -> None:
    """A run builds many long-lived objects (parse trees, libcst nodes, the
    analysis) and frees few: the cyclic collector's default thresholds make
    it rescan them over and over. Freeze what the imports made and collect
    the youngest generation far less often (docs/decisions.md: speed)."""
    import gc

    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


# Commands that read a tree and end: their cyclic garbage is a few thousand
# objects (vLLM 0.33.0: peak RSS the same with the collector off), while
# collecting costs 10 % of their time. ``verify`` and ``matrix`` run models
# (tensors in cycles) and keep the collector.
_NO_GC = frozenset({"scan", "apply", "revert"})


def _leave_gc() -> None:
    """Everything the command made goes to the permanent generation: the
    collection the interpreter runs at exit would traverse it all (3 s of
    a 7 s cold ``scan`` of vLLM 0.33.0 on a loaded 2-CPU machine; it frees
    nothing the exit does not)."""
    import gc

    gc.freeze()


def main(argv: Sequence[str] | None = None) -> int:
    # The process's own command (a caller's process keeps its gc).
    own = argv is None
    if own:
        _tune_gc()
    from gdn_backport import dataclass_code

    # The process's own command: its imports' dataclass methods compiled once.
    code = dataclass_code.cached() if own else contextlib.nullcontext()
    try:
        with code:
            return _main(argv, own)
    finally:
        if own:
            _leave_gc()


def _main(argv: Sequence[str] | None, own: bool) -> int:
    args: argparse.Namespace | None = None
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(_legacy_matrix(argv))
        quick = own and args.command in _NO_GC
        if quick:
            import gc

            from gdn_backport import ahead

            gc.disable()
            # A command that reads a tree and ends may fork (verify and
            # matrix run models: their threads are not the fork's to copy).
            ahead.allow(True)
        from gdn_backport import cache, dataclass_docs

        docs = dataclass_docs.skipped() if quick else contextlib.nullcontext()
        with cache.run(), docs:  # one command: each content analysed once
            code = COMMANDS[args.command](args)
        # What is still buffered is written here, where a failure can be told
        # from the run's verdict (at exit it would become Python's code 120).
        sys.stdout.flush()
        return code
    except UsageError as exc:
        print(f"gdn-backport: {exc}", file=sys.stderr)
        if args is not None and getattr(args, "json", False):
            # A program reading --json gets a document on a refusal too.
            print(json.dumps({"command": args.command, "error": str(exc), "exit_code": 2}))
        return 2
    except SystemExit as exc:
        # --help and --version: argparse exits; a caller of main() gets the code.
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        # Every file but standard output is opened by name, and its errors
        # are UsageErrors: a nameless one that reaches here is the output's.
        out = sys.__stdout__
        if exc.filename is not None or out is None or sys.stdout is not out:
            raise
        where, gone = "standard output", False
        with contextlib.suppress(OSError, ValueError):
            fd = out.fileno()
            with contextlib.suppress(OSError):
                name = os.readlink(f"/proc/self/fd/{fd}")
                where = name if name.startswith("/") else where
            poll = select.poll()
            poll.register(fd, select.POLLOUT)
            gone = any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
            # Output still buffered goes nowhere: the flush at exit must not
            # fail again.
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        if isinstance(exc, BrokenPipeError) and gone:
            # The reader left (`| head -1`) with what it wanted: exit as a
            # process killed by SIGPIPE does, never with a verdict's code.
            return 141
        print(f"gdn-backport: {where}: cannot write the output ({exc.strerror})", file=sys.stderr)
        return 2
