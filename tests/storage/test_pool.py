"""memory.pool: reuse, bound, oldest first, pressure, relieve, zeroing."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tierflow import memory
from tierflow.errors import ConfigError
from tierflow.storage.pool import Pool
from tierflow.system import budget, pressure
from tierflow.system.types import Level

MB = 1 << 20


@pytest.fixture(autouse=True)
def calm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    pressure.reset()
    monkeypatch.setattr(pressure, "level_now", lambda: Level.OK)
    monkeypatch.setattr(budget, "budget_bytes", lambda: 1 << 30)
    yield
    pressure.reset()


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    return a.base is b.base and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def test_reuse_of_an_exact_size() -> None:
    p = memory.pool(max_gb=1)
    a = p.take((1000, 8))
    assert a.shape == (1000, 8) and a.dtype == np.float32 and not a.any()
    p.give(a)
    assert p.spares == 1 and p.spare_bytes == 32000
    b = p.take((8, 1000))
    assert _same_buffer(a, b)
    assert (p.reused, p.allocated) == (1, 1)
    assert p.spares == 0


def test_reuse_across_dtypes_of_the_same_size() -> None:
    p = memory.pool(max_gb=1)
    a = p.take(1000, "float64")
    p.give(a)
    b = p.take((2000,), "int32")
    assert _same_buffer(a, b) and b.dtype == np.int32


def test_exact_size_is_preferred_over_a_bigger_spare() -> None:
    p = memory.pool(max_gb=1)
    big, exact = p.take(MB + MB // 2, "uint8"), p.take(MB, "uint8")
    p.give(exact)
    p.give(big)
    assert _same_buffer(p.take(MB, "uint8"), exact)


def test_bigger_spare_serves_a_prefix_up_to_twice_the_size() -> None:
    p = memory.pool(max_gb=1)
    a = p.take(2 * MB, "uint8")
    a[:] = 9
    p.give(a)
    small = p.take(MB // 2, "uint8")  # a is 4x: not used
    assert p.reused == 0 and p.spares == 1
    b = p.take((MB + 8,), "uint8", zero=False)  # a is under 2x: a prefix of it
    assert b.base is a.base and b.nbytes == MB + 8 and (b == 9).all()
    p.give(b)
    assert p.spare_bytes == 2 * MB  # the whole buffer came back
    del small


def test_zero_fills_a_reused_buffer_and_zero_false_does_not() -> None:
    p = memory.pool(max_gb=1)
    a = p.take((256, 256), "float64")
    a[...] = 7
    p.give(a)
    b = p.take((256, 256), "float64", zero=False)
    assert (b == 7).all()
    p.give(b)
    c = p.take((256, 256), "float64")
    assert not c.any()


def test_bound_drops_the_oldest_first() -> None:
    p = memory.pool(max_gb="3MB")
    bufs = [p.take(MB, "uint8") for _ in range(4)]
    for b in bufs:
        p.give(b)
    assert p.spares == 3 and p.spare_bytes == 3 * MB
    again = [p.take(MB, "uint8") for _ in range(4)]
    assert p.reused == 3 and p.allocated == 5
    reused_from = {id(x.base) for x in again[:3]}
    assert id(bufs[0].base) not in reused_from
    assert {id(b.base) for b in bufs[1:]} == reused_from


def test_a_buffer_bigger_than_the_bound_is_not_kept() -> None:
    p = memory.pool(max_gb="1MB")
    p.give(p.take(2 * MB, "uint8"))
    assert p.spares == 0 and p.spare_bytes == 0


def test_high_pressure_drops_the_spares() -> None:
    p = memory.pool(max_gb=1)
    p.give(p.take(MB, "uint8"))
    p.give(p.take(2 * MB, "uint8"))
    pressure.notify(Level.MODERATE)
    assert p.spares == 2
    pressure.notify(Level.HIGH)
    assert p.spares == 0 and p.spare_bytes == 0


def test_no_spares_are_kept_while_pressure_is_high(monkeypatch: pytest.MonkeyPatch) -> None:
    p = memory.pool(max_gb=1)
    a = p.take(MB, "uint8")
    monkeypatch.setattr(pressure, "level_now", lambda: Level.CRITICAL)
    p.give(a)
    assert p.spares == 0


def test_relieve_drops_the_spares_and_counts_them() -> None:
    p = memory.pool(max_gb=1)
    p.give(p.take(MB, "uint8"))
    p.give(p.take(3 * MB, "uint8"))
    assert p.relieve() == 4 * MB
    assert p.spares == 0 and p.relieve() == 0
    p.give(p.take(MB, "uint8"))
    assert memory.relieve() >= MB
    assert p.spares == 0


def test_an_unreferenced_pool_leaves_the_registry() -> None:
    p = memory.pool(max_gb=1)
    assert p in pressure.subscribers()
    count = len(pressure.subscribers())
    del p
    gc.collect()
    assert len(pressure.subscribers()) == count - 1


def test_an_array_never_given_back_is_simply_freed() -> None:
    p = memory.pool(max_gb=1)
    a = p.take(MB, "uint8")
    assert len(p._out) == 1
    del a
    gc.collect()
    assert len(p._out) == 0 and len(p._known) == 0 and p.spares == 0


def test_give_errors() -> None:
    p, other = memory.pool(max_gb=1), memory.pool(max_gb=1)
    with pytest.raises(
        ValueError, match="take\\(\\) returned; got a ndarray of shape \\(3,\\) from elsewhere"
    ):
        p.give(np.zeros(3))
    with pytest.raises(ValueError, match="from elsewhere"):
        p.give(other.take(10))
    a = p.take((10, 10))
    with pytest.raises(ValueError, match="not a view of it"):
        p.give(a[2:])
    p.give(a)
    with pytest.raises(ValueError, match="already given back"):
        p.give(a)
    p.relieve()
    with pytest.raises(ValueError, match="already given back"):
        p.give(a)


def test_take_checks_the_request_like_memory_array() -> None:
    p = memory.pool(max_gb=1)
    with pytest.raises(ValueError, match="negative dimension"):
        p.take((-1, 2))
    with pytest.raises(TypeError, match="Python objects"):
        p.take(3, object)
    assert p.take((0, 5)).shape == (0, 5)


def test_max_gb_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "budget_bytes", lambda: 10 * MB)
    assert memory.pool().max_bytes == MB
    assert memory.pool(0.5).max_bytes == 512 * MB
    assert memory.pool("256MB").max_bytes == 256 * MB
    assert memory.pool(0).max_bytes == 0
    with pytest.raises(ValueError, match=r"max_gb=-1\): give a number of GB >= 0"):
        memory.pool(-1)
    with pytest.raises(ValueError, match="max_gb=nan"):
        memory.pool(float("nan"))
    with pytest.raises(ConfigError, match="is not a size"):
        memory.pool("lots")
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        Pool(-5)


def test_repr_says_what_is_held() -> None:
    p = memory.pool(max_gb=1)
    p.give(p.take(MB, "uint8"))
    kept = p.take(10)
    assert repr(p) == "Pool(max 1.000 GB: 1 spare of 1.000 MB, 1 taken; reused 0, allocated 2)"
    del kept


def test_threads_never_share_a_buffer() -> None:
    p = memory.pool(max_gb="8MB")
    errors: list[str] = []

    def work(tag: int) -> None:
        for _ in range(200):
            a = p.take(64 * 1024 // 8, "float64", zero=False)
            a[...] = tag
            if not (a == tag).all():
                errors.append("shared")
            p.give(a)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert p.reused + p.allocated == 1200 and p.allocated <= 6
