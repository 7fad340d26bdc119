"""pr51812's parses made ahead in a forked child (``preparse.py``), and the
scan taking them (``locate._function_parse``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import libcst as cst
import pytest

from gdn_backport import ahead, registry
from gdn_backport.patchsets.pr51812 import locate
from gdn_backport.patchsets.pr51812.preparse import prepare
from gdn_backport.patchsets.pr51812.scan import scan_tree_full
from gdn_backport.tree import Tree


@pytest.fixture
def feed() -> Iterator[ahead.Feed]:
    made = ahead.Feed.create()
    assert made is not None
    locate._function_parse.cache_clear()
    try:
        yield made
    finally:
        made.close()
        locate._function_parse.cache_clear()


def _offered(feed: ahead.Feed) -> list[int]:
    """The hashes of the keys of the records in ``feed``, in the order put."""
    feed._index()
    return [h for h, _ in sorted(((h, at) for h, recs in feed._where.items() for at, *_ in recs),
                                 key=lambda pair: pair[1])]  # fmt: skip


def test_the_child_parses_what_the_scan_parses_last_first(
    affected_tree: Path, feed: ahead.Feed
) -> None:
    (affected_tree / "vllm" / "zz_second.py").write_text(
        "def later(x, spec_token_indx):\n    return x[spec_token_indx]\n"
    )
    tree = Tree.of(affected_tree)
    prepare(tree)(feed)
    asked: list[tuple[str, bool]] = []
    real = locate.parse_function

    def spy(text: str, indented: bool) -> cst.FunctionDef | None:
        asked.append((text, indented))
        return real(text, indented)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(locate, "parse_function", spy)
        scan_tree_full(tree.path, tree=tree)
    candidates = [key for key in asked if "spec_token_indx" in key[0]]
    assert len(candidates) >= 2
    # Every candidate the scan parsed was offered, the last file's first, and
    # each value is the parse of its key's text.
    digests = [hash(locate.feed_key(*key)) for key in candidates]
    order = _offered(feed)
    assert set(digests) <= set(order)
    assert order.index(digests[-1]) < order.index(digests[0])
    for text, indented in candidates:
        node = feed.offered(locate.feed_key(text, indented))
        expected = real(text, indented)
        assert isinstance(node, cst.FunctionDef) and expected is not None
        assert node.deep_equals(expected)


def test_the_scan_takes_a_parse_from_the_feed(affected_tree: Path, feed: ahead.Feed) -> None:
    """The parent asks the feed before parsing: a planted parse (another
    function's, so it shows) is the one the scan gets."""
    tree = Tree.of(affected_tree)
    analysis = scan_tree_full(tree.path, tree=tree).analysis
    fn = next(f for m in analysis.index.modules.values() for f in analysis.index.candidates(m))
    text, indented = locate.function_text(fn.module.lines, fn.candidate())
    planted = locate.parse_function("def planted():\n    pass\n", False)
    feed.put(locate.feed_key(text, indented), planted)
    locate._function_parse.cache_clear()
    ahead._feed.append(feed)
    try:
        got = locate.function_node(fn.module.lines, fn.candidate())
    finally:
        ahead._feed.remove(feed)
    assert got.name.value == "planted"
    locate._function_parse.cache_clear()
    assert locate.function_node(fn.module.lines, fn.candidate()).name.value == fn.node.name


def test_the_child_skips_what_the_parent_parsed_and_stops_when_it_is_done(
    affected_tree: Path, feed: ahead.Feed
) -> None:
    tree = Tree.of(affected_tree)
    analysis = scan_tree_full(tree.path, tree=tree).analysis
    keys = [
        locate.feed_key(*locate.function_text(f.module.lines, f.candidate()))
        for m in analysis.index.modules.values()
        for f in analysis.index.candidates(m)
    ]
    assert keys
    for key in keys:
        feed.offered(key)  # the parent asked for each: it parsed them itself
    prepare(tree)(feed)
    assert _offered(feed) == []
    fresh = ahead.Feed.create()
    assert fresh is not None
    try:
        fresh.done()
        prepare(tree)(fresh)
        assert _offered(fresh) == []
    finally:
        fresh.close()


def test_only_the_patchset_that_has_work_ahead_offers_it(affected_tree: Path) -> None:
    tree = Tree.of(affected_tree)
    offered = [ps for ps in registry.discover() if ps.prepare(tree) is not None]
    assert offered and all(callable(ps.prepare(tree)) for ps in offered)


def test_no_work_ahead_where_the_scan_is_a_cache_hit(
    affected_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rescan reads its sites from the cache and parses nothing: a child
    # that parsed anyway would be what the run waits for (0.25 -> 0.5 s).
    monkeypatch.setenv("GDN_BACKPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GDN_BACKPORT_NO_CACHE")
    (pr51812,) = [ps for ps in registry.discover() if ps.prepare(Tree.of(affected_tree))]
    assert callable(pr51812.prepare(Tree.of(affected_tree)))  # nothing stored yet
    pr51812.scan(Tree.of(affected_tree))  # stores the scan
    assert pr51812.prepare(Tree.of(affected_tree)) is None
    (affected_tree / "vllm" / "added.py").write_text("x = 1\n")
    assert callable(pr51812.prepare(Tree.of(affected_tree)))  # another tree: parse ahead
