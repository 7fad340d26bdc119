"""engine_suite/cache.py: results kept across runs, one JSON file per key."""

from __future__ import annotations

from pathlib import Path

from gdn_backport.engine_suite.cache import JsonCache, key


def test_key_is_stable_order_free_for_mappings_and_tells_parts_apart() -> None:
    k = key("ref", {"a": 1, "b": [1, 2]}, 3)
    assert k == key("ref", {"b": [1, 2], "a": 1}, 3)
    assert len(k) == 64 and int(k, 16) >= 0
    assert k != key("ref", {"a": 1, "b": [2, 1]}, 3)
    assert key("a", "b") != key("ab")
    assert key(Path("/x")) == key("/x")  # what JSON cannot hold is its str()


def test_put_then_get_round_trips_and_a_miss_is_none(tmp_path: Path) -> None:
    cache = JsonCache(tmp_path / "cache")
    k = key("one")
    assert cache.get(k) is None
    cache.put(k, {"score": 1.5, "tokens": [1, 2]})
    assert cache.get(k) == {"score": 1.5, "tokens": [1, 2]}
    assert (tmp_path / "cache" / k[:2] / f"{k}.json").is_file()
    cache.put(k, [3])
    assert cache.get(k) == [3]
    assert [p.name for p in (tmp_path / "cache" / k[:2]).iterdir()] == [f"{k}.json"]


def test_a_damaged_entry_is_a_miss_not_an_error(tmp_path: Path) -> None:
    cache = JsonCache(tmp_path)
    k = key("two")
    cache.put(k, 1)
    (tmp_path / k[:2] / f"{k}.json").write_text("{not json")
    assert cache.get(k) is None
    cache.put(k, 2)
    assert cache.get(k) == 2
