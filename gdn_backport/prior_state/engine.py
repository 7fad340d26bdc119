"""Scan and apply patchset pr51565 over a tree (the seam of :mod:`gdn_backport.fixes`).

``apply`` always analyses the whole tree, whatever PATH names: a builder
fix is whole only with every FULL decode route of the tree's runners
guarded, so a run that would rewrite a builder with a runner it cannot see
(a single file, a tree with no runner) refuses. Every rewrite is analysed
again with the tree before anything is written, and written through the
same records, lock and all-or-nothing replacement as pr51812.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Sequence
from pathlib import Path

from gdn_backport import atomic, locate
from gdn_backport.analysis import Status
from gdn_backport.engine import (
    BeforeWrite,
    Mode,
    Outcome,
    SiteChange,
    Staged,
    conclude,
    unified_diff,
    write_staged,
)
from gdn_backport.errors import Refusal, UsageError
from gdn_backport.fixes import load_fix
from gdn_backport.prior_state import codemods
from gdn_backport.prior_state.analysis import PATCHSET, Finding, analyse_module, settle
from gdn_backport.prior_state.codemods import TreeFacts
from gdn_backport.prior_state.config import Config, load
from gdn_backport.scan import Site, relative, tree_root

STRATEGY = "reclassify"


def markers(cfg: Config) -> tuple[bytes, ...]:
    """Text a module with a site holds: the split call, a runner route, or a
    GDN-family field (a builder that classifies without the split call)."""
    names = (cfg.split, cfg.v1_dispatch, cfg.v2_shape_only, *sorted(cfg.family))
    # ``X.build = fn``: a plugin installing its own builder.
    return (*(n.encode() for n in names), b".build =")


def _texts(path: Path, cfg: Config, overrides: dict[Path, str]) -> dict[Path, str]:
    """The files below ``path`` that may hold a site, decoded."""
    out: dict[Path, str] = {}
    marks = markers(cfg)
    for file in locate.walk(path).files:
        if file in overrides:
            out[file] = overrides[file]
            continue
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise UsageError(f"{file}: cannot read ({exc.strerror})") from exc
        if b"def " in data and any(mark in data for mark in marks):
            out[file] = locate.decode(file, data)
    return out


def findings(
    path: Path, cfg: Config, overrides: dict[Path, str] | None = None
) -> dict[Path, list[Finding]]:
    """Every site below ``path``, runner verdicts settled over them all."""
    per_file: dict[Path, list[Finding]] = {}
    for file, text in _texts(path, cfg, overrides or {}).items():
        found = analyse_module(locate.parse_ast(file, text), text, cfg)
        if found:
            per_file[file] = found
    flat = settle([f for fs in per_file.values() for f in fs])
    it = iter(flat)
    return {file: [next(it) for _ in fs] for file, fs in per_file.items()}


def _kind(kind: str) -> str:
    return "builder" if kind == "builder" else "runner"


def _kind_of(site: Site) -> str:
    """The kind a site of ours was reported as (its reason says it first)."""
    return site.reason.split(":", 1)[0]


def _site(rel: str, f: Finding) -> Site:
    return Site(
        rel, f.line, f.function, f.status, f"{_kind(f.kind)}: {f.reason}", None, None, PATCHSET
    )


def scan_sites(path: Path, root: Path | None = None, kernels: Sequence[Path] = ()) -> list[Site]:
    """The sites below ``path`` (``kernels`` is pr51812's and has no say here)."""
    root = root or tree_root(path)
    return [
        _site(relative(file, root), f) for file, fs in findings(path, load()).items() for f in fs
    ]


def tree_facts(root: Path, cfg: Config) -> TreeFacts | None:
    """The fields of the tree's ``CommonAttentionMetadata`` and the parameters
    of its split function, from their definitions; None if either is not
    found (several definitions: what all of them offer)."""
    fields: set[str] | None = None
    params: set[str] | None = None
    replace_method = True
    cls_mark, fn_mark = b"class CommonAttentionMetadata", f"def {cfg.split}(".encode()
    for file in locate.walk(root).files:
        with contextlib.suppress(OSError):
            data = file.read_bytes()
            if cls_mark not in data and fn_mark not in data:
                continue
            tree = locate.parse_ast(file, locate.decode(file, data))
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == "CommonAttentionMetadata":
                    names = {
                        s.target.id
                        for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    }
                    names |= {s.name for s in node.body if isinstance(s, ast.FunctionDef)}
                    replace_method &= "replace" in names
                    fields = names if fields is None else fields & names
                elif isinstance(node, ast.FunctionDef) and node.name == cfg.split:
                    a = node.args
                    have = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
                    params = have if params is None else params & have
    if fields is None or params is None:
        return None
    return TreeFacts(frozenset(fields), frozenset(params), replace_method)


def _here(path: Path, root: Path) -> str:
    return relative(path, root) if path != root else "."


def apply_tree(
    path: Path,
    strategy: str = STRATEGY,
    mode: Mode = Mode.WRITE,
    *,
    root: Path | None = None,
    before_write: BeforeWrite | None = None,
    within: str | None = None,
    kernels: Sequence[Path] = (),
) -> Outcome:
    root = root or tree_root(path)
    if strategy != STRATEGY:
        raise UsageError(f"--strategy {strategy}: patchset {PATCHSET} has only {STRATEGY}")
    lock: contextlib.AbstractContextManager[None] = (
        atomic.tree_lock(root) if mode is Mode.WRITE else contextlib.nullcontext()
    )
    with lock:
        return _apply(path, mode, root, before_write, within)


def _apply(
    path: Path, mode: Mode, root: Path, before_write: BeforeWrite | None, within: str | None
) -> Outcome:
    cfg = load()
    fix = load_fix(PATCHSET)
    out = Outcome(root)
    # A folder is analysed whole; one file, with the folder it is in (its tree).
    scope = path if path.is_dir() else root
    before = findings(scope, cfg)
    below = path.resolve()

    def shown(file: Path) -> bool:
        return file.resolve() == below or below in file.resolve().parents

    sites = [(file, f) for file, fs in before.items() for f in fs]
    for file, f in sites:
        if shown(file):
            out.changes.append(
                SiteChange(_site(relative(file, root), f), _site(relative(file, root), f), False)
            )
    for file, f in sites:
        if f.status is Status.UNKNOWN and shown(file):
            out.refused.append((relative(file, root), f"{f.function}: {f.reason}"))
    # A builder fix makes every open FULL decode route a half fix: they go with it.
    fixing = any(f.kind == "builder" and f.status is Status.AFFECTED for _, f in sites)
    todo = {
        file: [
            f
            for f in fs
            if f.status is Status.AFFECTED or (fixing and f.kind != "builder" and not f.guarded)
        ]
        for file, fs in before.items()
    }
    todo = {file: fs for file, fs in todo.items() if fs}
    # PATH names what to patch: a site outside it is not this run's, unless a
    # builder inside needs it (a runner's guard) to be whole.
    outside = sorted(relative(file, root) for file in todo if not shown(file))
    here = {file: fs for file, fs in todo.items() if shown(file)}
    if not any(f.kind == "builder" for fs in here.values() for f in fs):
        outside = []
    todo = here
    if out.refused or not todo or mode is Mode.CHECK:
        conclude(out, mode, False)
        return out
    if outside:
        why = (
            f"the fix also rewrites {', '.join(outside)}; apply it to the tree holding "
            "them (a builder fix needs the runner's guard)"
        )
        out.refused.append((_here(path, root), why))
        conclude(out, mode, False)
        return out
    facts = tree_facts(scope, cfg)
    staged: list[Staged] = []
    texts: dict[Path, str] = {}
    for file, fs in todo.items():
        rel = relative(file, root)
        original = file.read_bytes()
        text = locate.decode(file, original)
        try:
            new = codemods.rewrite(text, fs, cfg, facts)
            data = locate.encode(file, new, original)
        except Refusal as exc:
            out.refused.append((rel, exc.reason))
            continue
        texts[file] = new
        staged.append((file, rel, original, data))
        out.diff += unified_diff(rel, text, new)
    if (
        not out.refused
        and any(f.kind == "builder" for fs in todo.values() for f in fs)
        and not any(f.kind != "builder" for fs in before.values() for f in fs)
    ):
        why = (
            f"no model runner with a FULL decode CUDA-graph route found in {scope}: "
            "cannot prove the builder fix is whole (a runner replaying decode graphs for "
            "a batch holding a new row would run on stale buffers); apply to the tree "
            "holding vllm/v1/worker"
        )
        out.refused.append((_here(path, root), why))
    if not out.refused:
        _prove(scope, root, texts, out)
    if before_write is not None and staged and not out.refused:
        before_write(out, [(file, new) for file, _, _, new in staged])
    if conclude(out, mode, bool(staged)):
        write_staged(root, staged, STRATEGY, fix.upstream, out, within)
        for c in out.changes:
            c.changed = c.site.path in out.written and c.rewritten.status is not c.site.status
    return out


def _prove(scope: Path, root: Path, texts: dict[Path, str], out: Outcome) -> None:
    """Every rewrite compiles, and the tree analysed again with all of them
    in place has no site left affected or unknown."""
    for file, text in texts.items():
        try:
            compile(locate.parse_ast(file, text), str(file), "exec")
        except (SyntaxError, UsageError) as exc:
            out.refused.append((relative(file, root), f"the rewrite does not compile: {exc}"))
    if out.refused:
        return
    after = findings(scope, load(), texts)
    by_key = {
        (relative(file, root), f.function, f.kind): f for file, fs in after.items() for f in fs
    }
    for c in out.changes:
        match = [
            f
            for (rel, fn, k), f in by_key.items()
            if rel == c.site.path and fn == c.site.function and _kind(k) == _kind_of(c.site)
        ]
        if match:
            c.rewritten = _site(c.site.path, min(match, key=lambda f: abs(f.line - c.site.line)))
    for (rel, fn, _), f in by_key.items():
        if f.status in (Status.AFFECTED, Status.UNKNOWN):
            out.refused.append((rel, f"{fn}: after the rewrite still {f.status.value}: {f.reason}"))
