"""patchsets/pr51812/patchset.toml: loading and validation."""

from __future__ import annotations

import copy

import pytest

from gdn_backport.errors import UsageError
from gdn_backport.patchsets.pr51812.config import load, parse


def test_shipped_patchset() -> None:
    ps = load()
    assert ps.upstream == "vllm-project/vllm#51812"
    assert ps.trailer == "Backport-Of: vllm-project/vllm#51812"
    fused = ps.kernels["fused_sigmoid_gating_delta_rule_update"]
    # b before a in the layer's signature, a before b in the kernel's: the
    # positional order is the kernel's own.
    assert fused.params[:3] == ("A_log", "a", "b") and fused.fix_target
    assert "spec_token_indx" in ps.fields.spec_index


def _raw() -> dict[str, object]:
    import sys
    from importlib import resources

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    text = resources.files("gdn_backport.patchsets.pr51812").joinpath("patchset.toml").read_text()
    return tomllib.loads(text)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("fields"), "missing key 'fields'"),
        (lambda d: d["kernel"][0].pop("gates"), "kernel\\[0\\]: missing key 'gates'"),
        (lambda d: d["kernel"][0].__setitem__("rows", ["q k"]), "must list identifiers"),
        (lambda d: d["kernel"].append(copy.deepcopy(d["kernel"][0])), "defined twice"),
    ],
)
def test_bad_patchset_names_file_and_key(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    data = _raw()
    mutate(data)
    with pytest.raises(UsageError, match=f"pr51812/patchset.toml: .*{message}"):
        parse(data, "patchsets/pr51812/patchset.toml")


def test_row_gather_table() -> None:
    assert load().row_gathers == {"gdn_backport_kernels.gather_token_rows"}
    data = _raw()
    data["row_gather"] = {"names": ["x y"], "params": ["x", "index"]}  # type: ignore[index]
    with pytest.raises(UsageError, match="row_gather: key 'names' must list dotted names"):
        parse(data, "patchsets/pr51812/patchset.toml")
    data["row_gather"] = {"names": ["m.f"], "params": ["index", "x"]}  # type: ignore[index]
    with pytest.raises(UsageError, match="row_gather: params must be"):
        parse(data, "patchsets/pr51812/patchset.toml")
