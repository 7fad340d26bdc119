"""Patchset pr51565 (vLLM PR #51565): rows without prior state must not take the decode path.

- :mod:`.config`: the ``[builder]`` and ``[runner]`` tables of ``patchset.toml``;
- :mod:`.analysis`: builders and runner routes found and judged, by reading code;
- :mod:`.codemods`: the builder rule and the runner guards (libcst);
- :mod:`.plan`: scan and plan over a tree;
- :mod:`.builder`: the tree's own metadata builder, driven as its runner drives it;
- :mod:`.suite`: the scenarios (new rows) and their oracle, on that builder and the layer.
"""

from __future__ import annotations

from gdn_backport.registry import Patchset

from .seam import Pr51565

PATCHSET: Patchset = Pr51565(__name__)
ID = PATCHSET.info.id
