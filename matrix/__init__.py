"""The version matrix as data (TOML), loaded by :mod:`gdn_backport.matrix`."""
