"""GPU placement with simulated GPUs (devices.FakeGpus) and the fake allocation backend."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tierflow import memory
from tierflow.errors import DependencyError
from tierflow.storage import gpu, placement
from tierflow.storage.gpu import FakeBackend, FakeGpuArray
from tierflow.system import budget, devices, pressure
from tierflow.system.devices import Device, FakeGpus
from tierflow.system.types import Level

MB = 1 << 20
GB = 1 << 30


@pytest.fixture(autouse=True)
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    gc.collect()
    monkeypatch.setattr(budget, "budget_bytes", lambda: placement.ram_held() + 64 * MB)
    monkeypatch.setattr(pressure, "level_now", lambda: Level.OK)
    yield
    gpu.use_backend(None)
    gc.collect()


@pytest.fixture
def two_gpus() -> Iterator[None]:
    # cuda:0: 8 GB free of 16; cuda:1: 12 GB free of 16 (margin 1.6 GB each)
    with devices.use_provider(FakeGpus([(8 * GB, 16 * GB), (12 * GB, 16 * GB)])):
        yield


def test_margin_is_the_larger_of_256_mb_and_a_tenth() -> None:
    assert placement.gpu_margin(1 * GB) == 256 * MB
    assert placement.gpu_margin(16 * GB) == int(1.6 * GB)


def test_auto_picks_the_gpu_with_the_most_free_memory(two_gpus: None) -> None:
    x = memory.array((1000, 8), "float32", device="auto")
    assert isinstance(x, FakeGpuArray) and x.device == "cuda:1"
    assert x.shape == (1000, 8) and x.dtype == np.float32 and not x.any()
    assert not memory.on_disk(x)
    assert memory.report()[-1].tier == "cuda:1"
    assert str(memory.report()[-1]) == "[1000, 8] float32 31.250 KB cuda:1"


def test_explicit_gpu(two_gpus: None) -> None:
    x = memory.array(10, device="cuda:0")
    assert x.device == "cuda:0"
    assert x[2:].device == "cuda:0"
    y = memory.array(10, device="cuda")  # the first GPU
    assert y.device == "cuda:0"


def test_gpu_arrays_do_not_count_against_the_ram_budget(two_gpus: None) -> None:
    held = placement.ram_held()
    memory.array((1000, 1000), device="auto")
    assert placement.ram_held() == held


def test_too_big_for_every_gpu_goes_to_the_host_with_a_log(
    two_gpus: None, caplog: pytest.LogCaptureFixture
) -> None:
    # 10.4 GB fits cuda:1 (12 GB - 1.6 GB margin) but nothing bigger
    with caplog.at_level(logging.DEBUG, logger="tierflow.storage.placement"):
        fits = placement._on_gpu((int(10.3 * GB),), np.dtype("uint8"), int(10.3 * GB), "auto")
        assert fits is not None and fits.device == "cuda:1"
        del fits
        x = memory.array((int(10.5 * GB),), "uint8", device="auto")
    assert not isinstance(x, FakeGpuArray)
    assert memory.on_disk(x)  # over the 64 MB RAM budget: on the SSD
    assert "fits no GPU; placing it on the host" in caplog.text
    assert "does not fit cuda:1" in caplog.text


def test_explicit_gpu_without_room_goes_to_the_host(two_gpus: None) -> None:
    x = memory.array((7 * GB,), "uint8", device="cuda:0")  # 8 GB - 1.6 GB margin < 7 GB
    assert type(x) is not FakeGpuArray
    assert memory.report()[-1].tier in ("RAM", "SSD")


def test_a_gpu_that_does_not_exist_is_an_error(two_gpus: None) -> None:
    with pytest.raises(
        ValueError, match=r"'cuda:7' does not exist: the GPUs here are cuda:0, cuda:1"
    ):
        memory.array(10, device="cuda:7")


def test_without_a_gpu_auto_is_the_host_and_cuda_is_an_error() -> None:
    with devices.use_provider(FakeGpus([])):
        x = memory.array(10, device="auto")
        assert type(x) is np.ndarray and memory.report()[-1].tier == "RAM"
        with pytest.raises(ValueError, match="'cuda:0' does not exist: this machine has no GPU"):
            memory.array(10, device="cuda:0")


def test_free_releases_a_gpu_array(two_gpus: None) -> None:
    released: list[Any] = []

    class Recording(FakeBackend):
        def release(self, owner: Any) -> None:
            released.append(owner)

    gpu.use_backend(Recording())
    x = memory.array((100, 100), device="cuda:1")
    count = len(memory.report())
    memory.free(x[10:])
    assert released and released[0] is x
    assert len(memory.report()) == count - 1
    memory.free(x)  # twice: nothing


def test_gpu_entry_leaves_the_report_when_collected(two_gpus: None) -> None:
    count = len(memory.report())
    x = memory.array(100, device="auto")
    assert len(memory.report()) == count + 1
    del x
    gc.collect()
    assert len(memory.report()) == count


class _Picky(FakeBackend):
    """Like torch: no string dtypes; out of memory past 1 GB."""

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any], index: int) -> Any:
        if dtype.kind in "SUV":
            raise TypeError(f"no GPU dtype for {dtype}")
        if int(np.prod(shape)) * dtype.itemsize > GB:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().zeros(shape, dtype, index)


def test_dtype_the_gpu_cannot_hold(two_gpus: None) -> None:
    gpu.use_backend(_Picky())
    assert type(memory.array(4, "S8", device="auto")) is np.ndarray
    with pytest.raises(TypeError, match="no GPU dtype for \\|S8"):
        memory.array(4, "S8", device="cuda:0")


def test_out_of_memory_at_allocation_falls_back(two_gpus: None) -> None:
    gpu.use_backend(_Picky())
    x = memory.array((2 * GB // 8,), "float64", device="cuda:1")
    assert not isinstance(x, FakeGpuArray)


def test_other_allocation_errors_propagate(two_gpus: None) -> None:
    class Broken(FakeBackend):
        def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any], index: int) -> Any:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    gpu.use_backend(Broken())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        memory.array(10, device="auto")


def test_backend_follows_the_device() -> None:
    fake = Device("cuda", 0, "Fake GPU 0", GB, 2 * GB, backend="fake")
    assert isinstance(gpu.backend_for(fake), FakeBackend)
    gpu.use_backend(_Picky())
    assert isinstance(gpu.backend_for(fake), _Picky)


def test_fake_owner_of_views() -> None:
    backend = FakeBackend()
    x = backend.zeros((4, 4), np.dtype("f4"), 3)
    assert x.device == "cuda:3"
    assert backend.owner(x[1:][:, 2]) is x
    assert backend.owner(np.zeros(3)) is None


@pytest.mark.torch
def test_torch_backend_on_cpu_tensors() -> None:
    torch = pytest.importorskip("torch")
    backend = gpu.TorchBackend()
    assert gpu.torch_dtype(np.dtype("float32")) == torch.float32
    with pytest.raises(TypeError, match="torch has no dtype for"):
        gpu.torch_dtype(np.dtype("S4"))
    t = torch.zeros(100)
    view = t[10:20]
    assert backend.owner(view) is t
    assert backend.owner(np.zeros(3)) is None
    backend.release(t)  # must leave the tensor usable: torch has no safe early free
    assert float(view.sum()) == 0.0


def test_missing_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_torch(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(
        DependencyError,
        match=r"^an array on a GPU needs the optional package 'torch': pip install -e '.*\[torch\]'$",
    ):
        gpu.TorchBackend()
