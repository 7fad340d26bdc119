"""pr51565's scan of a tree: every site with its verdict (no libcst here:
``scan`` imports none of the codemod machinery)."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path

from gdn_backport import cache, files
from gdn_backport.site import Site, Status
from gdn_backport.tree import Tree

from . import ID
from .analysis import Finding, analyse_module, settle
from .config import Config, load


def markers(cfg: Config) -> tuple[bytes, ...]:
    """Text a module with a site holds: the split call, a runner route, or a
    GDN-family field (a builder that classifies without the split call)."""
    names = (cfg.split, cfg.v1_dispatch, cfg.v2_shape_only, *sorted(cfg.family))
    # ``X.build = fn``: a plugin installing its own builder.
    return (*(n.encode() for n in names), b".build =")


def sieve(cfg: Config) -> Callable[[bytes, Callable[[], str]], bool]:
    """Whether a module may hold a site, from its bytes (and, where they are
    not ASCII, its text): a function, a marker, and what
    :func:`~.analysis.analyse_module` needs to report anything. Most modules
    naming the split function are other backends' builders or GDN layers
    that read a family field: parsing them found nothing."""
    split, family = cfg.split.encode(), tuple(n.encode() for n in sorted(cfg.family))
    v1 = (cfg.v1_dispatch.encode(), cfg.v1_uniform.encode())
    v2 = (cfg.v2_shape_only.encode(), b"scheduler_output")
    # ``def build`` and ``.build`` as the tokenizer may space them.
    build_method = re.compile(rb"def[ \t\f\\\r\n]+build\b")
    build_attr = re.compile(rb"\.[ \t\f\\\r\n]*build\b")
    # A marker that ``build_attr`` finds inside it (``.build =``, its match
    # ending within the marker) is found by that one pass over the bytes:
    # a pass of its own cost a third of the sieve.
    marks = tuple(
        m
        for m in markers(cfg)
        if (inside := build_attr.search(m)) is None or inside.end() == len(m)
    )

    def needs(data: bytes) -> bool:
        fields = any(name in data for name in family)
        return (
            # A class's ``build`` where the module names the split function,
            # filling a family field.
            (fields and split in data and build_method.search(data) is not None)
            # A function put on a class as its ``build``: it fills a family
            # field, or the class expression names GDN or KDA.
            or (
                (fields or b"GDN" in data or b"KDA" in data) and build_attr.search(data) is not None
            )
            or all(name in data for name in v1)
            or all(name in data for name in v2)
        )

    def may_hold(data: bytes, text: Callable[[], str]) -> bool:
        if b"def " not in data:
            return False
        # The markers, and ``X.build=fn`` however it is spaced (the marker
        # ``.build =`` alone let a plugin's ``X.build=fn`` go unread).
        if not any(mark in data for mark in marks) and build_attr.search(data) is None:
            return False
        if needs(data):
            return True
        # A non-ASCII identifier may spell an ASCII name (Python reads
        # identifiers in NFKC form): the names are looked for there too.
        return not data.isascii() and needs(
            unicodedata.normalize("NFKC", text()).encode("utf-8", "surrogatepass")
        )

    return may_hold


def _texts(tree: Tree, scope: Path) -> dict[Path, str]:
    """The files below ``scope`` that may hold a site, decoded (the run's
    overlay first: what an earlier patchset of the run rewrote)."""
    out: dict[Path, str] = {}
    cfg = load()
    may_hold = sieve(cfg)
    # Once per run (a plan's proof reads the tree again): the rule depends
    # on the configuration and the bytes alone.
    name = cache.key(f"{ID}.sieve", cfg)
    walked = tree.walk() if scope == tree.path else files.walk(scope)
    for file in walked.files:
        if file in tree.overlay:
            out[file] = tree.overlay[file]
        elif tree.kept(name, file, functools.partial(_may_hold, may_hold, tree, file)):
            out[file] = tree.text(file)
    return out


def _may_hold(
    may_hold: Callable[[bytes, Callable[[], str]], bool], tree: Tree, file: Path, data: bytes
) -> bool:
    return may_hold(data, functools.partial(tree.text, file))


def findings(
    tree: Tree,
    scope: Path | None = None,
    rewrites: dict[Path, str] | None = None,
) -> dict[Path, list[Finding]]:
    """Every site below ``scope`` (default ``tree.path``), runner verdicts
    settled over them all; ``rewrites``: texts to judge instead (a proof).
    A module's findings depend on its text alone: within one command
    (``cache.run``) a text is analysed once."""
    cfg = load()
    texts = _texts(tree, scope or tree.path)
    texts.update({f: t for f, t in (rewrites or {}).items() if f in texts})
    per_file: dict[Path, list[Finding]] = {}
    for file, text in texts.items():
        found = _analysed(file, text, cfg)
        if found:
            per_file[file] = found
    flat = [f for fs in per_file.values() for f in fs]
    places = [f"{tree.relative(file)}:{f.line}" for file, fs in per_file.items() for f in fs]
    # A plugin's runner replays decode graphs for vLLM's builders too.
    theirs = _vllm_builders(tree, flat)
    flat = settle(flat + [f for _, f in theirs], places + [p for p, _ in theirs])[: len(flat)]
    _half_fix_note(tree, flat)
    it = iter(flat)
    return {file: [next(it) for _ in fs] for file, fs in per_file.items()}


def vllm_findings(tree: Tree) -> dict[Path, list[Finding]] | None:
    """The sites of the vLLM a plugin's tree runs on (``tree.vllm``), made
    once per run; None when there is none."""
    ctx = tree.vllm
    vtree = ctx.tree(tree.root) if ctx is not None else None
    if vtree is None:
        return None
    assert ctx is not None
    found = ctx.memo.get(ID)
    if found is None:
        found = ctx.memo[ID] = findings(vtree, vtree.path)
    assert isinstance(found, dict)
    return found


def _half_fix_note(tree: Tree, flat: list[Finding]) -> None:
    """A builder of the tree that calls a one-token row a prefill, served by
    a runner of vLLM whose FULL decode route is open, is upstream's half
    fix: that route is vLLM's site (its own scan reports it), said here so
    that a plugin reading ``fixed`` is not taken for the whole fix."""
    if tree.vllm is None or any(f.kind != "builder" for f in flat):
        return
    if not any(f.kind == "builder" and f.reclassifies for f in flat):
        return
    found = vllm_findings(tree)
    vtree = tree.vllm.tree(tree.root)
    open_ = [
        (file, f)
        for file, fs in (found or {}).items()
        for f in fs
        if f.kind != "builder" and not f.guarded
    ]
    if not open_ or vtree is None:
        return
    tree.vllm.used("the model runner")
    file, f = open_[0]
    tree.vllm.note(
        f"note: {ID}: this tree's builder calls a new one-token row a prefill, and "
        f"{vtree.relative(file)}:{f.line} {f.function} of that vLLM replays the FULL decode "
        "graph for it on stale buffers (a half fix): apply pr51565 to that vLLM too"
    )


def _vllm_builders(tree: Tree, flat: list[Finding]) -> list[tuple[str, Finding]]:
    """vLLM's builders (each with where it lies), where the tree has a
    runner route left open: its verdict depends on every builder the runner
    serves, and a plugin's tree holds few or none of them."""
    if tree.vllm is None or not any(f.kind != "builder" and not f.guarded for f in flat):
        return []
    found = vllm_findings(tree)
    vtree = tree.vllm.tree(tree.root)
    builders = [
        (f"{vtree.relative(file) if vtree is not None else file}:{f.line}", f)
        for file, fs in (found or {}).items()
        for f in fs
        if f.kind == "builder"
    ]
    if builders:
        assert tree.vllm is not None
        tree.vllm.used("the metadata builders")
    return builders


def _analysed(file: Path, text: str, cfg: Config) -> list[Finding]:
    """:func:`analyse_module` of one module's text, through the analysis
    cache (keyed by the text and the configuration: the result depends on
    nothing else)."""
    name = cache.key(
        f"{ID}.module", cache.stable(cfg), cache.digest(text.encode("utf-8", "surrogatepass"))
    )

    def compute() -> list[Finding]:
        return analyse_module(files.parse_ast(file, text), text, cfg)

    def dump(found: list[Finding]) -> object:
        return [
            [f.kind, f.function, f.line, f.status.value, f.reason, f.reclassifies, f.guarded]
            for f in found
        ]

    def read(doc: object) -> list[Finding]:
        assert isinstance(doc, list)
        out = []
        for kind, function, line, status, reason, reclassifies, guarded in doc:
            assert isinstance(line, int) and isinstance(reclassifies, bool)
            assert isinstance(kind, str) and isinstance(function, str) and isinstance(reason, str)
            assert isinstance(guarded, bool)
            out.append(Finding(kind, function, line, Status(status), reason, reclassifies, guarded))
        return out

    return cache.cached(name, compute, dump, read)


def _kind(kind: str) -> str:
    return "builder" if kind == "builder" else "runner"


def _kind_of(site: Site) -> str:
    """The kind a site of ours was reported as (its reason says it first)."""
    return site.reason.split(":", 1)[0]


def _site(rel: str, f: Finding) -> Site:
    return Site(rel, f.line, f.function, f.status, f"{_kind(f.kind)}: {f.reason}", None, None, ID)


def scan(tree: Tree) -> list[Site]:
    """The sites below ``tree.path`` (through the analysis cache: the
    result depends on those files, the run's overlay and the configuration
    alone)."""

    def compute() -> list[Site]:
        return [_site(tree.relative(file), f) for file, fs in findings(tree).items() for f in fs]

    name = _scan_key(tree)
    if name is None:
        return compute()
    return cache.cached(name, compute, cache.dump_sites, cache.read_sites)


def _scan_key(tree: Tree) -> str | None:
    if not cache.enabled():
        return None
    if tree.vllm is not None and tree.vllm.package(tree.root) is not None:
        # Read against a vLLM: its modules' analyses are cached, this is not.
        return None
    try:
        overlay = sorted(
            (str(p), cache.digest(t.encode("utf-8", "surrogatepass")))
            for p, t in tree.overlay.items()
        )
        return cache.key(
            f"{ID}.scan",
            str(tree.root),
            str(tree.path),
            tree.listing(),
            overlay,
            cache.stable(load()),
        )
    except Exception:  # an unreadable file: the scan itself reports it
        return None


def scan_sites(path: Path, root: Path | None = None) -> list[Site]:
    """The sites below ``path`` of the tree at ``root``."""
    return scan(Tree.of(path, root))
