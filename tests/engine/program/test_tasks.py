"""The programs a worker keeps, and the driver's record of them: one LRU on both sides."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from tierflow.engine.program.tasks import LRU, Runtime

pytestmark = pytest.mark.executors("serial")  # nothing is computed


def test_the_least_recently_used_item_leaves_first() -> None:
    kept: LRU[str, int] = LRU(3)
    for i, key in enumerate("abc"):
        kept[key] = i
    assert kept.use("a") == 0  # a read with use() makes "a" the most recent
    kept["b"] = 10  # so does setting "b" again
    kept["d"] = 3
    assert list(kept) == ["a", "b", "d"]  # "c" was the least recent
    kept["e"] = 4
    assert list(kept) == ["b", "d", "e"]
    assert kept["b"] == 10


def test_a_plain_read_leaves_the_order_and_use_of_a_missing_key_raises() -> None:
    kept: LRU[str, int] = LRU(2)
    kept["a"], kept["b"] = 1, 2
    assert kept["a"] == 1 and kept.get("a") == 1
    kept["c"] = 3
    assert list(kept) == ["b", "c"]
    with pytest.raises(KeyError):
        kept.use("a")


def test_a_worker_runtime_keeps_its_most_recently_used_programs() -> None:
    runtime = Runtime(keep=2)
    for key in ("p1", "p2"):
        runtime.add(key, cloudpickle.dumps(key.upper()))
    assert runtime.program("p1") == "P1"  # p1 used: p2 is now the least recent
    runtime.add("p3", cloudpickle.dumps("P3"))
    assert runtime.has("p1") and runtime.has("p3") and not runtime.has("p2")
    with pytest.raises(KeyError, match="program p2 has not been shipped to this process"):
        runtime.program("p2")


def test_a_program_that_does_not_unpickle_raises_again_for_each_task() -> None:
    runtime = Runtime(keep=2)
    with pytest.raises(pickle.UnpicklingError) as first:
        runtime.add("bad", b"not a pickle")
    with pytest.raises(pickle.UnpicklingError) as again:
        runtime.program("bad")
    assert again.value is first.value
