"""Declarative patch definitions (TOML), loaded by :mod:`gdn_backport.patchset`."""
