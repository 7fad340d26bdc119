"""pr51812's work done ahead in a forked child (``registry.Patchset.prepare``).

The scan's largest single cost is libcst's parse of each candidate function
(:func:`.locate.function_node`, 0.3 s of a cold scan of 0.33.0). The child
finds the same candidates the scan does (the same sieve, the same ``ast``
index) and parses them, offering each under :func:`.locate.feed_key`: the
function's whole text, so a parse taken from the feed is the parse the run
would make. It works from the last candidate back: the parent parses from
the first; past where they meet, the child skips what the parent has
asked for already (:meth:`gdn_backport.ahead.Feed.taken`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gdn_backport.ahead import Feed, Prepare
    from gdn_backport.tree import Tree


def prepare(tree: Tree) -> Prepare:
    # Imported here, before the fork, not at module level: a scan that needs
    # a parse imports libcst anyway, and the child then starts with it; a
    # rescan (a cache hit, no prepare: seam.py) never imports it.
    from gdn_backport.cst_nodes import pickled

    from . import locate

    def work(feed: Feed) -> None:
        for text, indented in _candidates(tree, feed):
            key = locate.feed_key(text, indented)
            if not feed.wanted():
                return
            if feed.taken(key):
                continue  # the parent parsed it (where they met, all before it)
            node = locate.parse_function(text, indented)
            if node is not None:
                feed.put_pickled(key, pickled(node))

    return work


def _candidates(tree: Tree, feed: Feed) -> Iterator[tuple[str, bool]]:
    """The texts the scan of ``tree`` parses first, last first
    (:func:`.scan.scan_tree_full`: the modules the sieve keeps, and in each
    the functions naming a spec field); a file that cannot be read or
    parsed is left to the run, which reports it."""
    from . import locate
    from .config import config_for
    from .resolve import TreeIndex

    patchset = config_for(tree)
    index = TreeIndex(tree.root, patchset, tree.overlay or None)
    for file in reversed(tree.walk().files):
        if not feed.wanted():
            return
        with contextlib.suppress(Exception):
            text = tree.overlay.get(file)
            if text is None:
                if not locate.may_hold_site(tree.read(file), patchset):
                    continue
                text = tree.text(file)
            module = index.add(file, text)
            for fn in reversed(index.candidates(module)):
                yield locate.function_text(module.lines, fn.candidate())
