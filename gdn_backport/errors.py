"""Errors the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input or a refusal: message names the file and the reason."""


class Refusal(UsageError):
    """The tool will not change a file, and why: nothing is written.

    Raised without a path where the file is not known (inside a codemod);
    the caller that knows it reads ``reason`` and names the file itself.
    """

    def __init__(self, reason: str, path: object = None) -> None:
        self.reason = reason
        self.path = path
        super().__init__(reason if path is None else f"{path}: {reason}")
