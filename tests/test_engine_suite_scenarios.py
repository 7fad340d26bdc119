"""The scenario registry: found by pkgutil, filtered by patchset, and the
core names no patchset."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gdn_backport.engine_suite as package
from gdn_backport.engine_suite.scenarios import collect, patchsets


def test_both_patchsets_declare_scenarios() -> None:
    assert patchsets() == ["pr51565", "pr51812"]
    names = [s.name for s in collect()]
    assert len(names) == len(set(names))
    assert {s.patchset for s in collect(["pr51565"])} == {"pr51565"}
    assert [s.name for s in collect(names=["pr51812-recipe"])] == ["pr51812-recipe"]
    with pytest.raises(ValueError, match="engine scenario 'nope': unknown"):
        collect(names=["nope"])


def test_the_recipe_and_the_graph_variants() -> None:
    recipe = collect(names=["pr51812-recipe"])[0]
    e = recipe.engine
    assert (e.num_speculative_tokens, e.max_model_len, e.enforce_eager) == (2, 128, True)
    assert [len(r.prompt) for r in recipe.workload.requests] == [120, 64]
    graphs = {s.name: s.engine.cudagraph_mode for s in collect() if not s.engine.enforce_eager}
    assert graphs == {
        "pr51812-misorder-graphs": "FULL_AND_PIECEWISE",
        "pr51565-full-graphs": "FULL_AND_PIECEWISE",
        "pr51565-piecewise": "PIECEWISE",
    }
    for s in collect(["pr51565"]):
        assert (
            s.engine.num_speculative_tokens == 0 and s.alone is not None and s.alone.enforce_eager
        )
    production = collect(names=["pr51812-production"])[0].engine
    assert production.enable_prefix_caching and production.mamba_cache_mode == "align"
    assert production.num_speculative_tokens == 3


def test_the_core_names_no_patchset() -> None:
    root = Path(package.__file__).parent
    ids = "|".join(map(re.escape, patchsets()))
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.parent.name != "scenarios" and re.search(ids, p.read_text())
    ]
    assert offenders == []


def test_llm_kwargs() -> None:
    s = collect(names=["pr51812-misorder-graphs"])[0]
    kw = s.engine.llm_kwargs("/m", 0, "bfloat16")
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    assert kw["enforce_eager"] is False and kw["async_scheduling"] is False
    assert kw["load_format"] == "dummy" and kw["gdn_prefill_backend"] == "triton"
    assert kw["language_model_only"] and kw["skip_tokenizer_init"]
    p = collect(names=["pr51812-production"])[0].engine.llm_kwargs("/m", 0, "bfloat16")
    assert p["mamba_cache_mode"] == "align" and p["max_num_batched_tokens"] == 512
