"""pr51565's ``doctor`` rows: builders and runner routes as the files on disk
have them (no runtime patch exists for them: the file is what runs)."""

from __future__ import annotations

from pathlib import Path

from gdn_backport.doctor import Row, on_disk

from .scan import scan_sites


def rows(package: Path, root: Path) -> list[Row]:
    return [
        Row(
            s.function,
            "vllm." + s.path.removesuffix(".py").replace("/", "."),
            f"vllm/{s.path}",
            f"vllm/{s.path}:{s.line} (the file on disk)",
            s.status.value,
            s.reason,
            False,
            on_disk(root, f"vllm/{s.path}"),
            patchset=s.patchset,
        )
        for s in scan_sites(package)
    ]
