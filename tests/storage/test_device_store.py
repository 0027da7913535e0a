"""Blocks on a (simulated) GPU within its budget, spilled GPU -> RAM -> SSD."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tierflow.storage import gpu, placement
from tierflow.storage.device_store import DeviceStore
from tierflow.storage.gpu import FakeGpuArray
from tierflow.system import budget, devices, pressure
from tierflow.system.devices import FakeGpus
from tierflow.system.types import Level

KB = 1 << 10
MB = 1 << 20
GB = 1 << 30


@pytest.fixture(autouse=True)
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    gc.collect()
    monkeypatch.setattr(budget, "budget_bytes", lambda: placement.ram_held() + 64 * MB)
    monkeypatch.setattr(pressure, "level_now", lambda: Level.OK)
    with devices.use_provider(FakeGpus([(8 * GB, 16 * GB)])):
        yield
    gpu.use_backend(None)
    gc.collect()


def _block(kb: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(kb * KB // 8)


def _store(budget_kb: int = 100) -> DeviceStore:
    return DeviceStore("cuda:0", budget=lambda: budget_kb * KB)


def test_the_default_budget_is_the_free_memory_less_the_margin() -> None:
    store = DeviceStore("cuda:0")
    assert store.budget() == 8 * GB - placement.gpu_margin(16 * GB)
    with pytest.raises(ValueError, match=r"no GPU 'cuda:3' \(GPUs here: cuda:0\)"):
        DeviceStore("cuda:3")


def test_blocks_that_fit_stay_on_the_device() -> None:
    store = _store()
    a = _block(40, 1)
    assert store.put("a", a) == "gpu"
    on_device = store.get("a")
    assert isinstance(on_device, FakeGpuArray) and on_device.device == "cuda:0"
    np.testing.assert_array_equal(store.host("a"), a)
    assert store.held() == 40 * KB and store.totals() == {"gpu": 40 * KB, "ram": 0, "ssd": 0}


def test_room_is_made_by_spilling_the_largest_blocks_first() -> None:
    store = _store(100)
    blocks = {k: _block(kb, i) for i, (k, kb) in enumerate([("a", 40), ("b", 30), ("c", 20)])}
    for key, block in blocks.items():
        assert store.put(key, block) == "gpu"
    blocks["d"] = _block(40, 9)
    assert store.put("d", blocks["d"]) == "gpu"  # 90 + 40 > 100: a (the largest) goes
    assert {k: store.where(k) for k in blocks} == {"a": "ram", "b": "gpu", "c": "gpu", "d": "gpu"}
    assert store.held() == 90 * KB and store.spilled == 1
    # Read back when used: d (now the largest on the device besides a) makes room.
    assert isinstance(store.get("a"), FakeGpuArray)
    assert {k: store.where(k) for k in blocks} == {"a": "gpu", "b": "gpu", "c": "gpu", "d": "ram"}
    assert store.read_back == 1 and store.held() <= 100 * KB
    for key, block in blocks.items():  # every byte survived the moves
        np.testing.assert_array_equal(store.host(key), block)


def test_a_block_bigger_than_the_budget_goes_to_the_host() -> None:
    store = _store(100)
    big = _block(200, 3)
    assert store.put("big", big) == "ram"
    assert store.held() == 0
    with pytest.raises(MemoryError, match=r"does not fit cuda:0's budget of 100.0 KB"):
        store.get("big")
    np.testing.assert_array_equal(store.host("big"), big)


def test_spill_to_spills_the_largest_until_the_device_holds_what_is_asked() -> None:
    store = _store(100)
    for key, kb in [("a", 10), ("b", 30), ("c", 20), ("d", 25)]:
        store.put(key, _block(kb, len(key)))
    assert store.spill_to(40 * KB) == 55 * KB  # b (30) then d (25): 85 -> 30
    assert [k for k in "abcd" if store.where(k) == "gpu"] == ["a", "c"]
    assert store.spill_to(40 * KB) == 0


def test_spilled_blocks_go_to_the_ssd_when_ram_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(50)
    a, b = _block(40, 1), _block(40, 2)
    store.put("a", a)
    monkeypatch.setattr(budget, "budget_bytes", lambda: placement.ram_held())  # no RAM left
    store.put("b", b)  # a is spilled, and RAM has no room for it
    assert store.where("a") == "ssd" and store.where("b") == "gpu"
    np.testing.assert_array_equal(store.host("a"), a)


def test_relieve_moves_ram_copies_to_the_ssd_largest_first() -> None:
    store = _store(10)
    blocks = {"a": _block(40, 1), "b": _block(20, 2)}
    for key, block in blocks.items():
        assert store.put(key, block) == "ram"
    assert store.relieve() == 60 * KB
    assert store.totals() == {"gpu": 0, "ram": 0, "ssd": 60 * KB}
    for key, block in blocks.items():
        np.testing.assert_array_equal(store.host(key), block)
    store.clear()
    assert len(store) == 0


class _TorchOnCpu:
    """torch tensors on the CPU standing for device memory (the copies go through
    torch's ``copy_``, as on a GPU)."""

    name = "torch"

    def zeros(self, shape: tuple[int, ...], dtype: Any, index: int) -> Any:
        import torch

        return torch.zeros(shape, dtype=gpu.torch_dtype(dtype))

    def owner(self, x: Any) -> Any:
        return x

    def release(self, owner: Any) -> None:
        return None


def test_torch_tensors_are_copied_in_and_out() -> None:
    torch = pytest.importorskip("torch")
    gpu.use_backend(_TorchOnCpu())
    store = _store(30)  # room for one of the two 20 KB blocks
    a, b = _block(40, 1).astype(np.float32), _block(40, 2).astype(np.float32)
    store.put("a", a)
    assert isinstance(store.get("a"), torch.Tensor)
    store.put("b", b)  # a spilled through torch into a host array
    assert store.where("a") == "ram"
    np.testing.assert_array_equal(store.host("a"), a)
    assert torch.equal(store.get("a"), torch.from_numpy(a))  # read back
    np.testing.assert_array_equal(store.host("b"), b)


def test_blocks_in_the_other_byte_order_go_through_torch_and_come_back_in_it() -> None:
    """Tensors have only the native byte order: a ``'>f4'`` block is swapped on its way
    to the device and back, and the host copy keeps the block's dtype."""
    torch = pytest.importorskip("torch")
    gpu.use_backend(_TorchOnCpu())
    store = _store(30)
    swapped = np.dtype(np.float32).newbyteorder()
    a, b = _block(40, 1).astype(swapped), _block(40, 2).astype(swapped)
    store.put("a", a)
    assert torch.equal(store.get("a"), torch.from_numpy(a.astype(np.float32)))
    store.put("b", b)  # a spilled into a host array of its own dtype
    assert store.where("a") == "ram"
    for key, block in (("a", a), ("b", b)):
        back = store.host(key)
        assert back.dtype == swapped
        np.testing.assert_array_equal(back, block)


def test_threads_never_take_the_device_over_its_budget() -> None:
    store = _store(100)
    seen: list[int] = []
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(40):
                key = (t, i % 5)
                store.put(key, np.full(10 * KB // 8, float(t * 100 + i)))
                np.testing.assert_array_equal(
                    np.asarray(store.get(key)), np.full(10 * KB // 8, float(t * 100 + i))
                )
                seen.append(store.held())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert max(seen) <= 100 * KB
    assert store.spilled > 0


def test_ram_pressure_moves_the_spilled_blocks_to_the_ssd() -> None:
    store = _store(10)
    block = _block(40, 5)
    assert store.put("a", block) == "ram"
    pressure.notify("high")
    assert store.where("a") == "ssd"
    np.testing.assert_array_equal(store.host("a"), block)


def test_other_users_of_the_gpu_see_what_stores_hold_and_can_have_it_spilled() -> None:
    from tierflow.storage.device_store import held_on, make_room

    one, two = _store(100), _store(100)
    one.put("a", _block(30, 1))
    two.put("b", _block(50, 2))
    one.put("c", _block(10, 3))
    assert held_on("cuda:0") == 90 * KB and held_on("cuda:1") == 0
    assert make_room("cuda:0", 40 * KB) == 50 * KB  # b, the largest of all, is enough
    assert two.where("b") == "ram" and one.where("a") == "gpu"
    assert make_room("cuda:0", 100 * KB) == 40 * KB  # then a, then c: all there was
    assert held_on("cuda:0") == 0
