"""Errors the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input or a refusal: message names the file and the reason."""
