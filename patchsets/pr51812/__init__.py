"""Patchset pr51812 (vLLM PR #51812): the spec kernel must read the spec tokens' gate rows.

- :mod:`.config`: ``patchset.toml`` (fields, kernels, benign calls) and a
  fork's own kernel declarations;
- :mod:`.locate`, :mod:`.resolve`, :mod:`.dataflow`, :mod:`.provenance`,
  :mod:`.analysis`, :mod:`.sites`, :mod:`.scan`: where the spec paths are and
  what rows each kernel argument carries;
- :mod:`.codemods`: ``gather`` (upstream's fix in the site's own names) and
  ``kernel`` (the ABI-stable op of ``gdn_backport_kernels``);
- :mod:`.plan`: the plan of a tree (analyse, rewrite, prove);
- :mod:`.suite`, :mod:`.scenarios`, :mod:`.metadata`: the mixed-batch suite
  on the tree's own layer and kernels;
- :mod:`.runtime`: the in-memory patch of the runtime plugin, and the
  analysis of the method in effect (``doctor``).
"""

from __future__ import annotations

from gdn_backport.registry import Patchset

from .seam import Pr51812

PATCHSET: Patchset = Pr51812(__name__)
ID = PATCHSET.info.id
