"""``persist(device=...)`` on a simulated GPU: blocks kept there within its budget,
spilled largest first to the host, read back when used."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.io.persisted import DeviceReader
from tierflow.storage import gpu, placement
from tierflow.system import devices
from tierflow.system.devices import FakeGpus

MB = 1 << 20
GB = 1 << 30

pytestmark = pytest.mark.executors("threads")


@pytest.fixture(autouse=True)
def fake_gpus() -> Iterator[None]:
    gc.collect()
    with devices.use_provider(FakeGpus([(4 * GB, 16 * GB), (10 * GB, 16 * GB)])):
        yield
    gpu.use_backend(None)


def _reader(y: tw.Array) -> DeviceReader:
    reader = y._node.reader
    assert isinstance(reader, DeviceReader)
    return reader


def test_a_persisted_result_lives_on_the_roomiest_gpu_and_reads_the_same() -> None:
    data = np.arange(40_000, dtype=np.float32).reshape(10_000, 4)
    x = tw.from_array(data, rows=1000)
    y = (x * 2 + 1).persist(device="cuda")
    reader = _reader(y)
    assert reader.store.device == "cuda:1"  # 10 GB free against 4 GB
    assert reader.where() == ["gpu"] * 10
    assert y.key == (x * 2 + 1).key
    np.testing.assert_array_equal(y.compute(), data * 2 + 1)
    want = (data * 2 + 1).astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(y.sum(axis=0).compute(), want, rtol=1e-6)
    np.testing.assert_array_equal(y[2500:2600].compute(), (data * 2 + 1)[2500:2600])


def test_blocks_over_the_gpu_budget_spill_largest_first_and_come_back_when_used() -> None:
    # cuda:0 has 4 GB free; a margin of 1.6 GB leaves 2.4 GB: make it tight instead.
    data = np.random.default_rng(0).random((8_000, 16))  # 1 MB, blocks of 128 KB
    y = tw.from_array(data, rows=1000).persist(device="cuda:0")
    reader = _reader(y)
    assert reader.where() == ["gpu"] * 8
    reader.store.budget = lambda: 3 * 128 * 1024  # the device now has room for three
    reader.store.spill_to(reader.store.budget())
    assert reader.where().count("gpu") == 3
    np.testing.assert_array_equal(y.compute(), data)  # read from wherever they are
    reader.on_device(0)  # used on the device: read back, another spilled
    assert reader.where()[0] == "gpu" and reader.where().count("gpu") == 3
    assert reader.store.read_back == 1 and reader.store.spilled == 6


def test_auto_without_a_gpu_persists_on_the_host_and_cuda_says_what_to_do() -> None:
    data = np.ones((100, 2))
    with devices.use_provider(FakeGpus([])):
        y = tw.from_array(data, rows=10).persist(device="auto")
        assert not isinstance(y._node.reader, DeviceReader)
        np.testing.assert_array_equal(y.compute(), data)
        with pytest.raises(ValueError, match=r"no GPU here .*; use device='auto'"):
            tw.from_array(data, rows=10).persist(device="cuda")
    with pytest.raises(ValueError, match=r"'cuda:7': no such GPU \(GPUs here: cuda:0, cuda:1\)"):
        tw.from_array(data, rows=10).persist(device="cuda:7")


def test_a_gpu_persisted_array_goes_to_worker_processes_by_value() -> None:
    data = np.arange(600.0).reshape(300, 2)
    y = tw.from_array(data, rows=50).persist(device="cuda")
    np.testing.assert_array_equal((y * 3).compute(executor="processes"), data * 3)
    assert placement.ram_held() >= 0


def test_an_empty_result_persists_on_the_gpu_with_its_dtype_and_row_shape() -> None:
    y = tw.from_array(np.zeros((0, 3), np.int16), rows=10).persist(device="cuda")
    assert y.shape == (0, 3) and y.dtype == np.int16
    assert y.compute().shape == (0, 3)


def test_status_counts_the_blocks_kept_on_a_gpu() -> None:
    from tierflow import memory

    data = np.ones((4000, 8), np.float32)  # 128 KB
    y = tw.from_array(data, rows=1000).persist(device="cuda:0")
    (gpu0,) = [g for g in memory.status().as_dict()["gpu_budgets"] if g["id"] == "cuda:0"]
    assert gpu0["kept"] == data.nbytes
    assert "tierflow holds 125.0 KB (125.0 KB of kept blocks)" in gpu0["text"]
    del y
