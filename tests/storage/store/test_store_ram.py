"""The RAM tier: bounded in bytes, least recently used leave first."""

from __future__ import annotations

from tierflow.storage.store.ram import RamTier

ID = (0, 0, 0, 0)


def test_least_recently_used_values_leave_first() -> None:
    ram = RamTier(30)
    for name in "abc":
        ram.put(name, name.upper(), 10, ID)
    assert ram.get("a") is not None  # a is now the most recent
    dropped = ram.put("d", "D", 10, ID)
    assert dropped == 10 and "b" not in ram
    assert [n for n in "acd" if n in ram] == ["a", "c", "d"]
    assert ram.nbytes == 30 and len(ram) == 3


def test_a_value_larger_than_the_tier_is_not_held_and_drops_its_old_value() -> None:
    ram = RamTier(10)
    ram.put("a", 1, 5, ID)
    assert ram.put("a", 2, 11, ID) == 5
    assert "a" not in ram and ram.nbytes == 0


def test_replacing_a_value_counts_it_once() -> None:
    ram = RamTier(100)
    ram.put("a", 1, 40, ID)
    ram.put("a", 2, 30, ID)
    held = ram.get("a")
    assert held is not None and held.value == 2 and ram.nbytes == 30


def test_resize_and_clear_report_bytes_dropped() -> None:
    ram = RamTier(100)
    for i, name in enumerate("abcd"):
        ram.put(name, i, 20, ID)
    assert ram.resize(50) == 40 and ram.capacity == 50
    assert "a" not in ram and "b" not in ram
    assert ram.clear() == 40 and len(ram) == 0
    assert ram.resize(0) == 0
    ram.put("x", 1, 1, ID)
    assert "x" not in ram


def test_discard_is_quiet_for_missing_names() -> None:
    ram = RamTier(10)
    assert ram.discard("nothing") == 0
