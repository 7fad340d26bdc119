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
    marks = markers(cfg)
    split, family = cfg.split.encode(), tuple(n.encode() for n in sorted(cfg.family))
    v1 = (cfg.v1_dispatch.encode(), cfg.v1_uniform.encode())
    v2 = (cfg.v2_shape_only.encode(), b"scheduler_output")
    # ``def build`` and ``.build`` as the tokenizer may space them.
    build_method = re.compile(rb"def[ \t\f\\\r\n]+build\b")
    build_attr = re.compile(rb"\.[ \t\f\\\r\n]*build\b")

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
    may_hold = sieve(load())
    walked = tree.walk() if scope == tree.path else files.walk(scope)
    for file in walked.files:
        if file in tree.overlay:
            out[file] = tree.overlay[file]
            continue
        if may_hold(tree.read(file), functools.partial(tree.text, file)):
            out[file] = tree.text(file)
    return out


def findings(
    tree: Tree,
    scope: Path | None = None,
    rewrites: dict[Path, str] | None = None,
    memo: dict[tuple[Path, str], list[Finding]] | None = None,
) -> dict[Path, list[Finding]]:
    """Every site below ``scope`` (default ``tree.path``), runner verdicts
    settled over them all; ``rewrites``: texts to judge instead (a proof);
    ``memo``: the modules one run analysed already (a proof re-analyses only
    what it rewrote; the findings of a module depend on its text alone)."""
    cfg = load()
    texts = _texts(tree, scope or tree.path)
    texts.update({f: t for f, t in (rewrites or {}).items() if f in texts})
    per_file: dict[Path, list[Finding]] = {}
    for file, text in texts.items():
        known = None if memo is None else memo.get((file, text))
        found = _analysed(file, text, cfg) if known is None else known
        if memo is not None:
            memo[(file, text)] = found
        if found:
            per_file[file] = found
    flat = settle([f for fs in per_file.values() for f in fs])
    it = iter(flat)
    return {file: [next(it) for _ in fs] for file, fs in per_file.items()}


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
