"""matrix/model.py: the shipped matrix, parsing it (bad input names file and key), cells."""

from __future__ import annotations

from pathlib import Path

import pytest

from gdn_backport import matrix
from gdn_backport.errors import UsageError
from gdn_backport.site import Status


def test_shipped_matrix_loads() -> None:
    m = matrix.load()
    versions = [r.version for r in m.releases]
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))))
    with_sdist = [r for r in m.releases if not r.wheel_only]
    assert len(with_sdist) == 34
    layer = [r.expectation("pr51812") for r in with_sdist]
    assert sum(e is not None and e.status is Status.AFFECTED for e in layer) == 17
    assert {r.strategies for r in m.releases} == {
        ("none", "reclassify"),
        ("gather", "kernel", "reclassify"),
    }
    # pr51565: affected everywhere (0.31.0+ through the V1 runner's route),
    # refused where the metadata has no fields for a rule (before 0.20.0).
    split = {r.version: r.expectation("pr51565") for r in with_sdist}
    assert {e.status for e in split.values() if e} == {Status.AFFECTED}
    refused = [v for v, e in split.items() if e and e.apply == "refuse"]
    assert refused[0] == "0.10.2" and refused[-1] == "0.19.1" and len(refused) == 15


def test_bad_expectation_names_file_and_key() -> None:
    where = "patchsets/x/expected.toml"
    with pytest.raises(UsageError, match=r"x/expected.toml: release\[0\]: key 'status'.*'bad'"):
        matrix.model.parse_expectations({"release": [{"version": "1.0", "status": "bad"}]}, where)
    with pytest.raises(UsageError, match="key 'apply' must be 'patch' or 'refuse'"):
        matrix.model.parse_expectations(
            {"release": [{"version": "1.0", "status": "affected", "apply": "x"}]}, where
        )
    with pytest.raises(UsageError, match=r"release 9\.0 is not in matrix/releases\.toml"):
        matrix.parse(
            {"release": [{"version": "1.0"}]},
            expectations={"x": {"9.0": matrix.Expectation(Status.FIXED)}},
        )


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "no \\[\\[release\\]\\] tables"),
        ({"release": [{"path": "p"}]}, "missing key 'version'"),
        ({"release": [{"version": "x.y"}]}, "key 'version'"),
        ({"release": [{"version": "1.0", "wheel_only": "yes"}]}, "key 'wheel_only'"),
        ({"release": [{"version": "1.0"}] * 2}, "listed twice"),
    ],
)
def test_bad_matrix_names_file_and_key(doc: dict[str, object], message: str) -> None:
    with pytest.raises(UsageError, match=f"matrix/releases.toml: .*{message}"):
        matrix.parse(doc, expectations={})


# -- cells -----------------------------------------------------------------------


def test_cells_of_the_shipped_matrix() -> None:
    m = matrix.load()
    cells = matrix.cells(m)
    ids = [c.id for c in cells]
    # 17 affected releases x (gather, kernel) + 17 others x none, and every
    # release x reclassify (pr51565); no wheel_only.
    assert len(cells) == 85 and len(set(ids)) == 85
    assert "0.25.1-gather" in ids and "0.25.1-kernel" in ids and "0.28.0-none" in ids
    assert "0.25.1-reclassify" in ids and "0.10.2-reclassify" in ids
    assert {c.patchset for c in cells if c.strategy == "reclassify"} == {"pr51565"}
    assert {c.patchset for c in cells if c.strategy != "reclassify"} == {"pr51812"}
    assert not any(i.startswith("0.15.") for i in ids)
    assert all(c.selector() == ["--cell", c.id] for c in cells)
    named = matrix.cells(m, releases=["0.15.0", "0.25.1"])
    assert [c.id for c in named] == [
        "0.15.0-none",
        "0.15.0-reclassify",
        "0.25.1-gather",
        "0.25.1-kernel",
        "0.25.1-reclassify",
    ]
    assert [c.id for c in matrix.cells(m, strategies=["kernel"])][:2] == [
        "0.18.0-kernel",
        "0.18.1-kernel",
    ]
    assert len(matrix.cells(m, include_wheel_only=True)) == 89


def test_cell_ids_name_exact_cells_even_off_the_matrix() -> None:
    m = matrix.load()
    (mutation,) = matrix.cells(m, ids=["0.25.1-none"])
    assert mutation.expectation is not None and mutation.expectation.status is Status.AFFECTED
    assert mutation.strategy == "none"
    for bad, message in [
        ("0.25.1-sideways", "expected <release or tree>-"),
        ("9.9.9-gather", "not in matrix/releases.toml"),
        ("nope-gather", "no release or tree 'nope'"),
    ]:
        with pytest.raises(UsageError, match=message):
            matrix.cells(m, ids=[bad])
    with pytest.raises(UsageError, match="not in matrix"):
        matrix.cells(m, releases=["9.9.9"])
    with pytest.raises(UsageError, match="exclude each other"):
        matrix.cells(m, releases=["0.25.1"], ids=["0.25.1-gather"])


def test_tree_entries_and_adhoc_trees(tmp_path: Path) -> None:
    base = {"release": [{"version": "1.0"}]}
    layer = {"pr51812": {"1.0": matrix.Expectation(Status.FIXED, "p", "f")}}
    doc = {**base, "tree": [{"name": "fork", "path": "~/fork", "strategies": ["gather", "kernel"]}]}
    m = matrix.parse(doc, expectations=layer)
    assert m.trees == (matrix.Tree("fork", "~/fork", "", ("gather", "kernel")),)
    assert [c.id for c in matrix.cells(m)] == ["1.0-none", "fork-gather", "fork-kernel"]
    assert matrix.cells(m, ids=["fork-kernel"])[0].selector() == ["--cell", "fork-kernel"]
    # An adhoc --tree runs alone, with the strategies asked for (default:
    # every patchset's default strategy).
    (tmp_path / "my-fork" / "vllm").mkdir(parents=True)
    (tmp_path / "my-fork" / "vllm" / "__init__.py").write_text("")
    adhoc = matrix.adhoc_tree(tmp_path / "my-fork", ref="main")
    cells = matrix.cells(m, trees=[adhoc])
    assert [c.id for c in cells] == ["my-fork-gather", "my-fork-reclassify"]
    only = cells[0]
    assert only.adhoc
    assert only.selector() == ["--tree", str(tmp_path / "my-fork"), "--ref", "main",
                               "--cell", "my-fork-gather"]  # fmt: skip
    with pytest.raises(UsageError, match="no such file or directory"):
        matrix.adhoc_tree(tmp_path / "missing")
    for tree, message in [
        ({"name": "1x", "path": "p"}, "key 'name'"),
        ({"name": "a", "path": ""}, "key 'path'"),
        (
            {"name": "a", "path": "p", "strategies": ["gather", "magic"]},
            "key 'strategies': 'magic'",
        ),
        ({"name": "a", "path": "p", "ref": 3}, "key 'ref'"),
    ]:
        with pytest.raises(UsageError, match=r"matrix/releases.toml: tree\[0\]: " + message):
            matrix.parse({**base, "tree": [tree]}, expectations=layer)


_SKIPPED = {"version": "0.9.0", "skip_verify": "harness cannot drive this layout"}


def test_skip_verify_is_data() -> None:
    # The harness drives every release of the matrix (both layouts).
    assert not [r.version for r in matrix.load().releases if r.skip_verify]
    (release,) = matrix.parse({"release": [_SKIPPED]}, expectations={}).releases
    assert release.skip_verify == "harness cannot drive this layout"
    bad = {**_SKIPPED, "skip_verify": 1}
    with pytest.raises(UsageError, match="key 'skip_verify'"):
        matrix.parse({"release": [bad]}, expectations={})
