"""pr51565's scan and plan of a tree; nothing is written here.

The plan always analyses the whole tree, whatever PATH names: a builder fix
is whole only with every FULL decode route of the tree's runners guarded,
so a run that would rewrite a builder with a runner it cannot see (a single
file, a tree with no runner) refuses. Every rewrite is analysed again with
the tree before the plan goes through; :mod:`gdn_backport.pipeline` writes
it with the same records, lock and all-or-nothing replacement as any other.
"""

from __future__ import annotations

import ast
import contextlib
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from gdn_backport import cache, files
from gdn_backport.errors import Refusal, UsageError
from gdn_backport.pipeline import Mode, Outcome, Plan, SiteChange, Staged, conclude, unified_diff
from gdn_backport.result import Failure, Success
from gdn_backport.site import Status
from gdn_backport.tree import Tree, relative

from . import ID, PATCHSET
from .analysis import Finding
from .config import Config, load
from .scan import _kind, _kind_of, _site, findings, sieve, vllm_findings
from .scan import markers as markers
from .scan import scan as scan
from .scan import scan_sites as scan_sites

if TYPE_CHECKING:
    # libcst's codemod framework costs a cold run 0.2-0.3 s to import: only
    # a run that rewrites a file pays it (``tree_facts``, ``_rewrite``).
    from .codemods.base import TreeFacts

STRATEGY = "reclassify"


def _may_define_facts(data: bytes, cfg: Config) -> bool:
    return b"class CommonAttentionMetadata" in data or f"def {cfg.split}(".encode() in data


def _defining(tree: Tree, root: Path, cfg: Config) -> list[ast.Module]:
    """The modules below ``root`` that define the metadata class or the
    split function at their top (a sieve on the text first)."""
    walked = tree.walk() if root == tree.path else files.walk(root)
    out = []
    for file in walked.files:
        with contextlib.suppress(OSError, UsageError):
            if _may_define_facts(tree.read(file), cfg):
                out.append(tree.parse(file))
    return out


def unaffected_by(changed: Mapping[Path, tuple[bytes, str]]) -> bool:
    """The plan reads a module only through its two sieves (``scan.sieve``:
    may it hold a site; :func:`_may_define_facts`): a file that fails both,
    as it is on disk and as rewritten, changes nothing of it (its analysis
    of such a text finds nothing: the sieve's promise)."""
    cfg = load()
    may_hold = sieve(cfg)
    for file, (disk, text) in changed.items():
        new = text.encode("utf-8", "surrogatepass")
        readings = (
            (disk, functools.partial(files.decode, file, disk)),
            (new, functools.partial(str, text)),
        )
        for data, decoded in readings:
            if may_hold(data, decoded) or _may_define_facts(data, cfg):
                return False
    return True


def _defined(modules: list[ast.Module], cfg: Config) -> set[str]:
    names = {"CommonAttentionMetadata", cfg.split}
    return {
        node.name
        for module in modules
        for node in module.body
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name in names
    }


def tree_facts(tree: Tree, root: Path, cfg: Config) -> TreeFacts | None:
    """The fields of ``CommonAttentionMetadata`` and the parameters of the
    split function, from their definitions below ``root``; None if either
    is not found (several definitions: what all of them offer). What the
    tree lacks is read from the vLLM it runs on (``tree.vllm``: a plugin's
    tree imports both from vLLM), with the same reading."""
    from .codemods.base import facts_of

    modules = _defining(tree, root, cfg)
    lacking = [n for n in ("CommonAttentionMetadata", cfg.split) if n not in _defined(modules, cfg)]
    vtree = tree.vllm.tree(tree.root) if lacking and tree.vllm is not None else None
    if vtree is not None:
        assert tree.vllm is not None
        extra = _defining(vtree, vtree.path, cfg)
        for name in lacking:
            if name in _defined(extra, cfg):
                tree.vllm.used(name)
        modules += extra
    return facts_of(modules, cfg.split)


def _no_facts(tree: Tree, cfg: Config, where: str) -> str:
    """The refusal where no rule can be read: what is missing, from where,
    and the option that supplies it."""
    names = f"CommonAttentionMetadata and {cfg.split}"
    ctx = tree.vllm
    if ctx is not None and ctx.package(tree.root) is not None:
        return (
            f"{where}: no definition of {names} found in the tree nor in {ctx.where()}; "
            "cannot tell which fields a rule may read (--vllm PATH: the vLLM this tree runs "
            "on, a source tree or its vllm package folder)"
        )
    return (
        f"{where}: no definition of {names} found in the tree; cannot tell which fields a "
        "rule may read (a plugin's tree: pass --vllm PATH, the vLLM it runs on, a source "
        "tree or its vllm package folder)"
    )


def _vllm_runners(tree: Tree) -> tuple[str, list[tuple[str, Finding]]] | None:
    """The FULL decode routes of the vLLM a plugin's tree runs on, each as
    (its path in that vLLM, the finding), with the vLLM's words; None when
    there is no such vLLM."""
    found = vllm_findings(tree)
    if found is None:
        return None
    ctx, vtree = tree.vllm, tree.vllm.tree(tree.root) if tree.vllm is not None else None
    assert ctx is not None and vtree is not None
    routes = [
        (relative(file, vtree.root), f)
        for file, fs in found.items()
        for f in fs
        if f.kind != "builder"
    ]
    if routes:
        ctx.used("the model runner")
    return ctx.where(), routes


def _runner_refusal(tree: Tree, scope: Path) -> str | None:
    """Why a builder fix of a tree with no runner of its own is not whole,
    or None: the runner that replays decode graphs for it is vLLM's, and a
    fix is whole only when every FULL decode route there is guarded (the
    vLLM is never written here: it is patched on its own)."""
    base = (
        f"no model runner with a FULL decode CUDA-graph route found in {scope}: "
        "cannot prove the builder fix is whole (a runner replaying decode graphs for "
        "a batch holding a new row would run on stale buffers)"
    )
    found = _vllm_runners(tree)
    if found is None:
        return (
            f"{base}; apply to the tree holding vllm/v1/worker, or, for a plugin's tree, "
            "pass --vllm PATH (the vLLM it runs on)"
        )
    where, routes = found
    if not routes:
        return f"{base} nor in {where}"
    open_ = [(rel, f) for rel, f in routes if not f.guarded]
    if not open_:
        return None
    rel, f = open_[0]
    state = (
        f"has a guard the analysis cannot vouch for ({f.reason})"
        if f.status is Status.UNKNOWN
        else "is open (a decode graph replayed for a batch holding a new row would run on "
        "stale buffers)"
    )
    return (
        f"the builder fix needs every FULL decode route of {where} guarded, and "
        f"{rel}:{f.line} {f.function} {state}; apply pr51565 to that vLLM first "
        "(gdn-backport apply --installed, or apply its tree), then to this one"
    )


def _here(path: Path, root: Path) -> str:
    return relative(path, root) if path != root else "."


def plan(tree: Tree, strategy: str, mode: Mode) -> Plan:
    # One command's analyses (cache.run, entered here too for a caller that
    # plans alone): the proof re-analyses only the modules it rewrote.
    with cache.run():
        return _plan(tree, strategy, mode)


def _plan(tree: Tree, strategy: str, mode: Mode) -> Plan:
    if strategy != STRATEGY:
        raise UsageError(f"--strategy {strategy}: patchset {ID} has only {STRATEGY}")
    path, root = tree.path, tree.root
    cfg = load()
    out = Outcome(root)
    # A folder is analysed whole; one file, with the folder it is in (its tree).
    scope = path if path.is_dir() else root
    before = findings(tree, scope)
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
        return Plan(out, strategy=strategy)
    if outside:
        why = (
            f"the fix also rewrites {', '.join(outside)}; apply it to the tree holding "
            "them (a builder fix needs the runner's guard)"
        )
        out.refused.append((_here(path, root), why))
        conclude(out, mode, False)
        return Plan(out, strategy=strategy)
    facts = tree_facts(tree, scope, cfg)
    staged: list[Staged] = []
    texts: dict[Path, str] = {}
    for file, fs in todo.items():
        rel = relative(file, root)
        disk = tree.read(file)
        text = tree.text(file)
        # An earlier patchset of this run rewrote the file: this layer starts there.
        original = files.encode(file, text, disk) if file in tree.overlay else disk
        builder = next((f for f in fs if f.kind == "builder"), None)
        if facts is None and builder is not None:
            where = f"{builder.function} (line {builder.line})"
            out.refused.append((rel, _no_facts(tree, cfg, where)))
            continue
        new = _rewrite(file, text, fs, facts, strategy)
        if isinstance(new, Failure):
            out.refuse(rel, new)
            continue
        try:
            data = files.encode(file, new, disk)
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
        whole = _runner_refusal(tree, scope)
        if whole is not None:
            out.refused.append((_here(path, root), whole))
    if not out.refused:
        _prove(tree, scope, texts, out)
    conclude(out, mode, bool(staged))
    if out.refused:
        return Plan(out, strategy=strategy)
    return Plan(out, staged, strategy, texts)


def _rewrite(
    file: Path, text: str, sites: list[Finding], facts: TreeFacts | None, strategy: str
) -> str | Failure:
    """``text`` with every site of ``sites`` fixed, each codemod of the
    strategy in turn fixing its own kind; the first refusal otherwise.
    libcst reads only the methods a codemod rewrites (:mod:`.codemods.segments`)."""
    from .codemods.base import FindingCodemod, InTree
    from .codemods.segments import run_on_methods

    for codemod in PATCHSET.codemods()[strategy]:
        assert issubclass(codemod, FindingCodemod), codemod
        mine = tuple(f for f in sites if f.kind == codemod.KIND)
        if not mine:
            continue
        result = run_on_methods(codemod, InTree(mine, facts, text), files.parse_ast(file, text))
        if isinstance(result, Failure):
            return result
        if not isinstance(result, Success):
            # Handed sites of its kind, a codemod that skips has missed them.
            return Failure(f"{codemod.__name__} found none of the sites it was given")
        text = result.value
    return text


def _prove(
    tree: Tree,
    scope: Path,
    texts: dict[Path, str],
    out: Outcome,
) -> None:
    """Every rewrite compiles, and the tree analysed again with all of them
    in place has no site left affected or unknown."""
    root = tree.root
    for file, text in texts.items():
        try:
            compile(files.parse_ast(file, text), str(file), "exec")
        except (SyntaxError, UsageError) as exc:
            out.refused.append((relative(file, root), f"the rewrite does not compile: {exc}"))
    if out.refused:
        return
    after = findings(tree, scope, texts)
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


def apply_tree(
    path: Path, strategy: str = STRATEGY, mode: Mode = Mode.WRITE, *, root: Path | None = None
) -> Outcome:
    """This patchset alone over the tree at ``path``, written by the pipeline."""
    from gdn_backport import pipeline

    return pipeline.apply(path, [PATCHSET], strategy, mode, root=root)[0][1]
