"""harness/standins.py: the stand-ins for the vLLM modules a tree imports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gdn_backport.harness.standins import HarnessContext, is_stub, make_stub, make_stub_module

# -- stand-ins ----------------------------------------------------------------


def test_stubs_are_inert_decorators_falsy_and_subclassable() -> None:
    stub = make_stub("vllm.x.Thing")
    assert is_stub(stub) and not stub

    def fn() -> int:
        return 1

    assert stub.register("name")(fn) is fn  # decorator factory, then decorator
    assert stub(fn) is fn

    class Derived(torch.nn.Module, stub):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.x = 3

    assert Derived().x == 3 and not is_stub(Derived)
    module = make_stub_module("vllm.fake")
    assert is_stub(module.Anything)
    assert (module.Anything | None) is not None


def test_config_standin_has_hf_config_and_names_missing_fields(tmp_path: Path) -> None:
    from gdn_backport.harness.standins import _config_module

    config = _config_module(HarnessContext(tmp_path, "cpu")).get_current_vllm_config()
    model = config.model_config
    assert getattr(model.hf_config, "linear_key_head_dim", None) is None
    assert getattr(model.hf_text_config, "linear_key_head_dim", None) is None
    with pytest.raises(AttributeError, match=r"no vllm_config\.model_config\.dtype"):
        _ = model.dtype
