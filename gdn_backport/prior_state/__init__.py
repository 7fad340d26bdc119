"""Patchset pr51565: rows without prior state must not take the decode path.

- :mod:`.config`: the patchset file's ``[builder]`` and ``[runner]`` tables;
- :mod:`.analysis`: builders and runners found and judged, by reading code;
- :mod:`.codemods`: the builder rule and the runner guards (libcst);
- :mod:`.engine`: scan and apply over a tree, the seam of
  :mod:`gdn_backport.fixes`.
"""
