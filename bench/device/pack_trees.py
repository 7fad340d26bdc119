"""Pack a trimmed copy of the release cache for a GPU machine without network.

The device tool of this workplace carries at most 64 MiB per call, and whole
extracted releases are ~1 GB; the regression suite needs only each release's
GDN layer, the kernels it imports and the small modules the harness loads.
This writes ``.gpu/trees.tar.xz`` (about 26 MB for 0.10.2-0.33.0) holding
``trees/<version>/...`` plus each tree's completeness marker, so that on the
device ``GDN_BACKPORT_CACHE=/tmp/cache GDN_BACKPORT_OFFLINE=1`` finds them.

    python bench/device/pack_trees.py [--out .gpu/trees.tar.xz]
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

from packaging.version import Version

from gdn_backport import matrix, sources

# Folders the harness loads modules from (stand-ins cover the rest of vLLM).
FOLDERS = (
    "vllm/model_executor/layers",
    "vllm/v1/attention",
    "vllm/third_party",
    "vllm/attention",
    "vllm/utils",
    "vllm/platforms",
    "vllm/config",
    "vllm/triton_utils",
    "vllm/distributed",
)
MARKERS = (
    b"spec_token_indx",
    b"spec_token_masks",
    b"def fused_sigmoid_gating_delta_rule_update(",
    # pr51565: builders, runners and the metadata class its analysis reads.
    b"split_decodes_and_prefills",
    b"_is_uniform_decode",
    b"get_uniform_token_count",
    b"class CommonAttentionMetadata",
)


def files_of(tree: Path) -> set[Path]:
    files = set(tree.glob("vllm/*.py")) | set(tree.glob("vllm/v1/*.py"))
    for sub in FOLDERS:
        if (tree / sub).is_dir():
            files.update((tree / sub).rglob("*.py"))
    files.update(f for f in tree.rglob("*.py") if any(m in f.read_bytes() for m in MARKERS))
    # Every package __init__ on the way: the harness builds packages from folders.
    for f in list(files):
        for parent in f.relative_to(tree).parents:
            init = tree / parent / "__init__.py"
            if init.is_file():
                files.add(init)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(".gpu/trees.tar.xz"))
    ap.add_argument("--since", default="0.10.2")
    ap.add_argument("--release", action="append", help="only these releases")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.out, "w:xz") as out:
        for r in matrix.load().releases:
            if r.wheel_only or Version(r.version) < Version(args.since):
                continue
            if args.release and r.version not in args.release:
                continue
            tree = sources.release_tree(r.version)
            files = sorted(files_of(tree))
            for f in files:
                out.add(f, f"trees/{r.version}/{f.relative_to(tree)}")
            out.add(tree / ".gdn-backport-complete", f"trees/{r.version}/.gdn-backport-complete")
            print(r.version, len(files), sum(f.stat().st_size for f in files))
    print(args.out, args.out.stat().st_size)


if __name__ == "__main__":
    main()
