"""Devices: the CPU, GPUs through torch/cupy or a fake provider, best_device."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierflow import memory
from tierflow.errors import ConfigError
from tierflow.system import devices
from tierflow.system.devices import Device, DeviceList, FakeGpus, best_device, use_provider

GB = 1 << 30


@pytest.fixture(autouse=True)
def _default_provider() -> Iterator[None]:
    # Every test starts from the real detection and leaves it behind.
    with use_provider(None):
        yield


def fake(*free_total_gb: tuple[float, float], names: list[str] | None = None) -> FakeGpus:
    return FakeGpus([(int(f * GB), int(t * GB)) for f, t in free_total_gb], names=names)


# -- no GPU ---------------------------------------------------------------------------------


def test_this_machine_has_no_gpu_and_everything_still_works() -> None:
    if any(os.path.exists(p) for p in devices._DRIVER_FILES):
        pytest.skip("this machine has a GPU driver; the no-GPU path is tested with fakes")
    assert devices.gpus() == []
    found = memory.devices()
    assert [d.kind for d in found] == ["cpu"]
    assert memory.best_device(0) == "cpu"
    assert str(found).splitlines()[-1] == "no GPU"


@pytest.mark.torch
def test_torch_cpu_build_reports_no_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    assert devices.TorchGpus().gpus() == []


def test_without_driver_files_torch_is_not_imported(tmp_path: Path) -> None:
    if any(os.path.exists(p) for p in devices._DRIVER_FILES):
        pytest.skip("this machine has a GPU driver, so torch is rightly imported")
    code = (
        "import sys; from tierflow import memory; "
        "print(len(memory.devices()), memory.best_device(0), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.split() == ["1", "cpu", "False"]


@pytest.mark.torch
def test_driver_present_but_torch_sees_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(devices, "_DRIVER_FILES", (str(driver),))
    # cupy is not installed here; if it were, it too must answer "no GPU" without a GPU.
    with use_provider(None):
        assert devices.gpus() == []


def test_driver_error_means_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    driver = tmp_path / "nvidia0"
    driver.touch()
    monkeypatch.setattr(devices, "_DRIVER_FILES", (str(driver),))

    def broken(self: object) -> list[Device]:
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(devices.TorchGpus, "gpus", broken)
    monkeypatch.setattr(devices.CupyGpus, "gpus", broken)
    with caplog.at_level(logging.DEBUG, logger="tierflow.system.devices"), use_provider(None):
        assert devices.gpus() == []
        assert best_device(0) == "cpu"
    assert "CUDA driver version is insufficient" in caplog.text
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


@pytest.mark.torch
def test_torch_gpu_that_fails_is_skipped_and_the_others_listed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")

    def mem_get_info(i: int) -> tuple[int, int]:
        if i == 0:
            raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")
        return 3 * GB, 8 * GB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Test GPU {i}")
    assert devices.TorchGpus().gpus() == [
        Device("cuda", 1, "Test GPU 1", 3 * GB, 8 * GB, backend="torch")
    ]


def _fake_cupy(memory: list[tuple[int, int]], broken: int | None = None) -> SimpleNamespace:
    """A stand-in for the parts of cupy that devices.py reads; GPU ``broken`` raises."""

    class FakeDevice:
        def __init__(self, i: int) -> None:
            self.i = i

        @property
        def mem_info(self) -> tuple[int, int]:
            if self.i == broken:
                raise RuntimeError("cudaErrorDevicesUnavailable")
            return memory[self.i]

    runtime = SimpleNamespace(
        getDeviceCount=lambda: len(memory),
        getDeviceProperties=lambda i: {"name": f"Cupy GPU {i}".encode()},
    )
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=FakeDevice))


def test_cupy_provider_skips_a_failing_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = _fake_cupy([(1 * GB, 4 * GB), (2 * GB, 4 * GB), (3 * GB, 4 * GB)], broken=1)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert devices.CupyGpus().gpus() == [
        Device("cuda", 0, "Cupy GPU 0", 1 * GB, 4 * GB, backend="cupy"),
        Device("cuda", 2, "Cupy GPU 2", 3 * GB, 4 * GB, backend="cupy"),
    ]


@pytest.mark.torch
def test_cupy_answers_when_torch_sees_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here, so cupy is never asked")
    driver = tmp_path / "nvidia0"
    driver.touch()
    monkeypatch.setattr(devices, "_DRIVER_FILES", (str(driver),))
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy([(5 * GB, 8 * GB)]))
    with use_provider(None):
        assert [(d.id, d.backend) for d in devices.gpus()] == [("cuda:0", "cupy")]
        assert best_device(5) == "cuda:0"


# -- fake GPUs ------------------------------------------------------------------------------


def test_fake_gpus_are_listed_after_the_cpu() -> None:
    with use_provider(fake((5, 8), (7, 8), names=["NVIDIA A", "NVIDIA B"])):
        found = memory.devices()
    assert [d.id for d in found] == ["cpu", "cuda:0", "cuda:1"]
    gpu = found[2]
    assert (gpu.kind, gpu.index, gpu.name, gpu.backend) == ("cuda", 1, "NVIDIA B", "fake")
    assert (gpu.free, gpu.total, gpu.cores) == (7 * GB, 8 * GB, None)
    assert str(gpu) == "cuda:1 NVIDIA B: 7.0/8.0 GB free"
    assert str(found).splitlines()[1:] == [
        "cuda:0 NVIDIA A: 5.0/8.0 GB free",
        "cuda:1 NVIDIA B: 7.0/8.0 GB free",
    ]
    assert "no GPU" not in str(found)


def test_best_device_picks_the_gpu_with_most_free_memory() -> None:
    with use_provider(fake((2, 16), (6, 8), (4, 80))):
        assert best_device(5) == "cuda:1"
        assert best_device(6) == "cuda:1"  # exactly enough is enough
        assert best_device(0) == "cuda:1"
        assert best_device("6GB") == "cuda:1"
        assert best_device(6.01) == "cpu"  # the most free has too little: no other GPU helps
        assert best_device("7GB") == "cpu"


def test_best_device_breaks_ties_by_lower_index() -> None:
    with use_provider(fake((1, 8), (4, 8), (4, 8))):
        assert best_device(1) == "cuda:1"


def test_use_provider_is_a_context_manager_that_restores() -> None:
    first, second = fake((1, 2)), fake((3, 4), (5, 6))
    use_provider(first)
    with use_provider(second):
        assert len(devices.gpus()) == 2
    assert [d.free for d in devices.gpus()] == [1 * GB]


@pytest.mark.parametrize("gb", [-1, -0.5, math.nan, math.inf, True, "lots", None])
def test_best_device_refuses_a_bad_size(gb: object) -> None:
    with use_provider(fake((4, 8))), pytest.raises(ConfigError, match="best_device"):
        best_device(gb)  # type: ignore[arg-type]


def test_fake_gpus_check_their_figures() -> None:
    with pytest.raises(ConfigError, match=r"fake GPU 1: free=9 and total=8 bytes"):
        FakeGpus([(1, 2), (9, 8)])
    with pytest.raises(ConfigError, match="free=-1"):
        FakeGpus([(-1, 8)])
    with pytest.raises(ConfigError, match="got 1 names for 2 GPUs"):
        FakeGpus([(1, 2), (1, 2)], names=["only one"])


# -- a provider that misbehaves -------------------------------------------------------------


class Raising:
    def gpus(self) -> list[Device]:
        raise OSError("NVML: driver/library version mismatch")


class WrongType:
    def gpus(self) -> list[object]:
        return [("cuda", 0)]


@pytest.mark.parametrize(
    ("provider", "message"),
    [(Raising(), "version mismatch"), (WrongType(), "returned tuple, not Device")],
)
def test_failing_provider_means_no_gpu(
    provider: object, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="tierflow.system.devices"),
        use_provider(provider),  # type: ignore[arg-type]
    ):
        assert devices.gpus() == []
        assert [d.kind for d in memory.devices()] == ["cpu"]
        assert best_device(0) == "cpu"
    assert message in caplog.text


def test_use_provider_refuses_an_object_without_gpus() -> None:
    with pytest.raises(TypeError, match=r"needs a gpus\(\) method.*got int"):
        use_provider(42)  # type: ignore[arg-type]


# -- the CPU --------------------------------------------------------------------------------


def test_cpu_device_on_this_machine() -> None:
    cpu = memory.devices()[0]
    assert (cpu.kind, cpu.id, cpu.backend) == ("cpu", "cpu", None)
    assert cpu.cores is not None
    assert 1 <= cpu.cores <= len(os.sched_getaffinity(0))
    assert 0 <= cpu.free <= cpu.total
    assert cpu.name


def test_cpu_str() -> None:
    assert str(Device("cpu", 0, "x", int(21.3 * GB), 24 * GB, cores=2)) == (
        "cpu: 2 cores, 21.3 GB free"
    )
    assert str(Device("cpu", 0, "x", 0, GB, cores=1)) == "cpu: 1 core, 0.0 GB free"


def _fake_root(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> str:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(proc_cgroup)
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))


@pytest.mark.usefixtures("eight_cores")
def test_cores_follow_the_cgroup_v1_quota_rounded_up(tmp_path: Path) -> None:
    root = _fake_root(
        tmp_path,
        "4:memory:/job\n3:cpu,cpuacct:/job/step\n0::/\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/job/step/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/job/step/cpu.cfs_period_us": "100000\n",
            # The parent's quota binds the child too.
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us": "250000\n",
            "sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        },
    )
    assert devices.cpu_cores(root) == 3


@pytest.mark.usefixtures("eight_cores")
def test_cores_follow_the_cgroup_v2_cpu_max(tmp_path: Path) -> None:
    root = _fake_root(
        tmp_path,
        "0::/user.slice/app\n",
        {
            "sys/fs/cgroup/user.slice/app/cpu.max": "50000 100000\n",
            "sys/fs/cgroup/user.slice/cpu.max": "max 100000\n",
        },
    )
    assert devices.cpu_cores(root) == 1


@pytest.mark.usefixtures("eight_cores")
def test_container_sees_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    # Without a cgroup namespace /proc/self/cgroup names the host's path, which does
    # not exist inside the container's /sys/fs/cgroup.
    root = _fake_root(
        tmp_path,
        "0::/system.slice/docker-1234.scope\n",
        {"sys/fs/cgroup/cpu.max": "200000 100000\n"},
    )
    assert devices.cpu_cores(root) == 2


@pytest.mark.usefixtures("eight_cores")
@pytest.mark.parametrize(
    "files",
    [
        {},
        {"sys/fs/cgroup/cpu.max": "max 100000\n"},
        {"sys/fs/cgroup/cpu.max": "garbage\n"},
        {"sys/fs/cgroup/cpu.max": "2000000 100000\n"},  # 20 CPUs of quota, 8 allowed
    ],
)
def test_cores_without_a_usable_quota_are_the_affinity(
    tmp_path: Path, files: dict[str, str]
) -> None:
    assert devices.cpu_cores(_fake_root(tmp_path, "0::/\n", files)) == 8


# -- printing ---------------------------------------------------------------------------------


def test_device_list_html_and_dict() -> None:
    with use_provider(fake((5, 8), names=["<GPU & co>"])):
        found = memory.devices()
    page = found._repr_html_()
    assert page.startswith("<table>")
    assert page.count("<tr>") == 3  # header, cpu, one GPU
    assert "&lt;GPU &amp; co&gt;" in page
    assert "<GPU" not in page
    entry = found[1].as_dict()
    assert entry == {
        "id": "cuda:0",
        "kind": "cuda",
        "index": 0,
        "name": "<GPU & co>",
        "free": 5 * GB,
        "total": 8 * GB,
        "cores": None,
        "backend": "fake",
        "text": "cuda:0 <GPU & co>: 5.0/8.0 GB free",
    }
    assert isinstance(found, DeviceList)
    assert repr(found) == str(found)


def test_device_list_without_gpu_says_so_in_html() -> None:
    page = DeviceList([Device("cpu", 0, "x", GB, 2 * GB, cores=2)])._repr_html_()
    assert "no GPU" in page
