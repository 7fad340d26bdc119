"""errors.py: the two errors the CLI turns into one line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_backport.errors import Refusal, UsageError


def test_a_refusal_is_a_usage_error_that_names_its_file() -> None:
    exc = Refusal("the kernel call has keyword arguments", Path("vllm/x.py"))
    assert isinstance(exc, UsageError)
    assert str(exc) == "vllm/x.py: the kernel call has keyword arguments"
    assert exc.reason == "the kernel call has keyword arguments"
    assert exc.path == Path("vllm/x.py")


def test_a_refusal_without_a_path_is_its_reason_alone() -> None:
    exc = Refusal("no such call")
    assert str(exc) == "no such call" and exc.path is None
    with pytest.raises(UsageError, match=r"^no such call$"):
        raise exc
