"""libcst codemods, one per module."""
