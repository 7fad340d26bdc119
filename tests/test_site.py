"""site.py: the Site every patchset reports, its JSON, and the worst-of order."""

from __future__ import annotations

import json

from gdn_backport.site import ORDER, Site, Status, worst


def test_worst_is_unknown_then_affected_then_fixed_then_not_affected() -> None:
    assert worst([Status.NOT_AFFECTED, Status.FIXED]) is Status.FIXED
    assert worst([Status.FIXED, Status.AFFECTED, Status.NOT_AFFECTED]) is Status.AFFECTED
    assert worst(iter([Status.AFFECTED, Status.UNKNOWN])) is Status.UNKNOWN
    assert worst([]) is None
    assert set(ORDER) == set(Status)


def test_status_is_its_json_string() -> None:
    assert Status("not_affected") is Status.NOT_AFFECTED
    assert json.dumps(Status.AFFECTED) == '"affected"'


def test_json_leaves_out_via_and_target_when_unset() -> None:
    site = Site("vllm/a.py", 12, "L._forward_core", Status.AFFECTED, "why", patchset="p")
    assert site.to_json() == {
        "path": "vllm/a.py",
        "line": 12,
        "function": "L._forward_core",
        "status": "affected",
        "reason": "why",
        "patchset": "p",
    }
    assert site.chain == ""


def test_json_carries_the_chain_as_a_list_and_the_link_target() -> None:
    site = Site("a.py", 1, "f", Status.FIXED, "", via=("A.f", "A.g", "k"), target="b.py")
    d = site.to_json()
    assert d["via"] == ["A.f", "A.g", "k"] and d["target"] == "b.py"
    assert d["status"] == "fixed"
    assert site.chain == "A.f -> A.g -> k"
    json.dumps(d)  # plain JSON types only
    assert Site("a.py", 1, "f", Status.FIXED, "", via=()).to_json()["via"] == []


def test_sites_are_values() -> None:
    a = Site("a.py", 1, "f", Status.FIXED, "r")
    assert a == Site("a.py", 1, "f", Status.FIXED, "r")
    assert len({a, Site("a.py", 1, "f", Status.FIXED, "r")}) == 1
    assert a != Site("a.py", 2, "f", Status.FIXED, "r")
