"""The ``gdn-backport-check`` pre-commit hook: ``apply --check`` over the files a commit changes.

pre-commit passes every changed Python file; most hold no site, and
``apply --check FILE`` refuses a file without one (exit 2: a CI gate must
not pass on nothing). A site's verdict also depends on modules the commit
may not touch (a helper it calls, the kernel's module). So the hook checks
each *tree* that holds a passed file, whole: the nearest folder above the
file (up to the repository's top, the current directory) that holds
``vllm/__init__.py``, else the top itself when it is a vLLM plugin (its
modules import vllm). A file in no tree is no concern of this hook.

Exit code: the worst of the trees' (2 refusal, 1 affected, 0 fine); 0 when
no passed file lies in a tree.

    python -m gdn_backport.precommit [--patchset NAME] [--kernels FILE] [--format F] FILE...
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gdn_backport import cli
from gdn_backport.errors import UsageError
from gdn_backport.tree import check_vllm_tree


def _holds_vllm(folder: Path) -> bool:
    return (folder / "vllm" / "__init__.py").is_file()


def _plugin(top: Path) -> bool:
    """``top`` is a vLLM plugin: it holds no ``vllm`` package (at its top
    or one folder down: a file beside that one is in no tree) and its
    modules import vllm."""
    if _holds_vllm(top) or any(_holds_vllm(d) for d in top.iterdir() if d.is_dir()):
        return False
    try:
        check_vllm_tree(top)
    except UsageError:
        return False
    return True


def trees_of(paths: Sequence[Path], top: Path) -> list[Path]:
    """The trees holding ``paths`` (files below ``top``), each once, in order."""
    top = Path(os.path.abspath(top))
    found: dict[Path, None] = {}
    plugin: bool | None = None
    for path in paths:
        file = Path(os.path.abspath(top / path))
        if top != file and top not in file.parents:
            continue
        tree = next((d for d in file.parents if _holds_vllm(d) and (d == top or top in d.parents)),
                    None)  # fmt: skip
        if tree is None:
            if plugin is None:
                plugin = _plugin(top)
            if not plugin:
                continue
            tree = top
        found[tree] = None
    return list(found)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gdn-backport-check",
        description="apply --check on every vLLM tree that holds one of FILES",
    )
    parser.add_argument("--patchset", action="append", default=[], metavar="NAME")
    parser.add_argument("--kernels", action="append", default=[], metavar="FILE")
    parser.add_argument("--format", choices=["table", "github"], default=None)
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    top = Path.cwd()
    options = [
        *(x for name in args.patchset for x in ("--patchset", name)),
        *(x for file in args.kernels for x in ("--kernels", file)),
        *(("--format", args.format) if args.format else ()),
    ]
    worst = 0
    for tree in trees_of(args.files, top):
        shown = os.path.relpath(tree, top)
        code = cli.main(["apply", "--check", shown, *options])
        # 2 (a refusal: the tree cannot be proven) outranks 1 (affected).
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main())
