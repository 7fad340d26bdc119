"""The patchset packages, one folder per fix (shipped as ``gdn_backport.patchsets``).

Each holds its ``patchset.toml`` and the code that analyses, rewrites and
proves its fix, and exposes ``PATCHSET``; :mod:`gdn_backport.registry` finds
them. Nothing outside a patchset's folder names it.
"""
