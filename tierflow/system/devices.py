"""Devices: the CPU this process may use and every GPU, with their free memory.

``devices()`` lists the CPU first (the cores this process may run on, its free usable
RAM from :func:`tierflow.system.limits.read_memory`, so inside a container these are the
container's figures), then one entry per GPU. ``best_device(gb)`` names the GPU with the
most free memory if it has ``gb`` free, else ``"cpu"``.

GPUs are read through a *provider*, an object with ``gpus() -> list[Device]``:

- by default torch (``torch.cuda.mem_get_info``) and, when torch sees no GPU, cupy
  (``Device(i).mem_info``), each imported lazily, on first use. Neither is imported on
  a machine without a GPU driver (no ``/dev/nvidiactl``, ``/dev/nvidia0``,
  ``/proc/driver/nvidia``, ``/dev/kfd`` or ``/dev/dxg``), because importing torch costs
  seconds and could only answer "no GPU"; a torch that is already imported is always
  asked. Any import failure or driver error means "no GPU" and is logged at debug level.
- ``use_provider(FakeGpus([(free, total), ...]))`` simulates GPUs for tests and docs.

Reading free memory through torch or cupy creates a CUDA context on every GPU it
reads (a few hundred MB of GPU memory each, for the life of the process), and a
process that has initialised CUDA must not fork children that use CUDA: call
``devices()`` in the process that will use the GPUs.

>>> from tierflow.system.devices import FakeGpus, best_device, use_provider
>>> with use_provider(FakeGpus([(2 << 30, 8 << 30), (6 << 30, 8 << 30)])):
...     best_device(4)
'cuda:1'
"""

from __future__ import annotations

import html
import importlib.util
import logging
import math
import numbers
import os
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .. import config
from ..errors import ConfigError
from . import limits

__all__ = [
    "Device",
    "DeviceList",
    "FakeGpus",
    "GpuProvider",
    "best_device",
    "cpu_cores",
    "cpu_device",
    "devices",
    "gpus",
    "provider",
    "torch_device",
    "use_provider",
]

logger = logging.getLogger(__name__)

GB = config.GB


@dataclass(frozen=True)
class Device:
    """One place a block can live and be computed on.

    ``kind`` is ``"cpu"`` or ``"cuda"``; ``index`` is the GPU number (0 for the CPU);
    ``free`` and ``total`` are bytes (for the CPU: free and usable RAM of this process,
    cgroup limits included); ``cores`` is set for the CPU only; ``backend`` says who
    measured a GPU (``"torch"``, ``"cupy"``, ``"fake"``), None for the CPU.
    """

    kind: str
    index: int
    name: str
    free: int
    total: int
    cores: int | None = None
    backend: str | None = None

    @property
    def id(self) -> str:
        """``"cpu"`` or ``"cuda:N"``, the string ``best_device`` and torch use."""
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    def as_dict(self) -> dict[str, Any]:
        """The fields plus ``id`` and the one-line text, sizes in bytes (for JSON)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "index": self.index,
            "name": self.name,
            "free": self.free,
            "total": self.total,
            "cores": self.cores,
            "backend": self.backend,
            "text": str(self),
        }

    def __str__(self) -> str:
        if self.kind == "cpu":
            cores = f"{self.cores} core" + ("" if self.cores == 1 else "s")
            return f"cpu: {cores}, {self.free / GB:.1f} GB free"
        return f"{self.id} {self.name}: {self.free / GB:.1f}/{self.total / GB:.1f} GB free"


class DeviceList(list[Device]):
    """A list of :class:`Device` that prints one device a line and as a table in notebooks."""

    def __str__(self) -> str:
        if not self:
            return "no devices"
        lines = [str(d) for d in self]
        if not any(d.kind != "cpu" for d in self):
            lines.append("no GPU")
        return "\n".join(lines)

    # The list's own repr would be a wall of dataclass fields; the lines read better.
    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = []
        for d in self:
            cores = "" if d.cores is None else str(d.cores)
            rows.append(
                "<tr>"
                f"<td>{html.escape(d.id)}</td><td>{html.escape(d.name)}</td>"
                f"<td>{d.free / GB:.1f} GB</td><td>{d.total / GB:.1f} GB</td>"
                f"<td>{cores}</td><td>{html.escape(d.backend or '')}</td>"
                "</tr>"
            )
        if not any(d.kind != "cpu" for d in self):
            rows.append('<tr><td colspan="6">no GPU</td></tr>')
        return (
            "<table><thead><tr><th>device</th><th>name</th><th>free</th><th>total</th>"
            "<th>cores</th><th>backend</th></tr></thead><tbody>"
            + "".join(rows)
            + "</tbody></table>"
        )


@runtime_checkable
class GpuProvider(Protocol):
    """Anything that can list GPUs: ``gpus()`` returns one :class:`Device` per GPU."""

    def gpus(self) -> list[Device]: ...


class FakeGpus:
    """Simulated GPUs, for tests and docs: ``FakeGpus([(free, total), ...], names=None)``.

    Sizes are bytes. ``names`` defaults to ``"Fake GPU 0"``, ``"Fake GPU 1"``, ...
    Raises ``ConfigError`` for a negative size, free above total, or a wrong number of
    names.
    """

    backend = "fake"

    def __init__(
        self, memory: Iterable[tuple[int, int]], names: Sequence[str] | None = None
    ) -> None:
        self._memory = [(int(free), int(total)) for free, total in memory]
        for i, (free, total) in enumerate(self._memory):
            if free < 0 or total < 0 or free > total:
                raise ConfigError(
                    f"fake GPU {i}: free={free} and total={total} bytes must satisfy "
                    "0 <= free <= total"
                )
        if names is None:
            names = [f"Fake GPU {i}" for i in range(len(self._memory))]
        if len(names) != len(self._memory):
            raise ConfigError(
                f"FakeGpus got {len(names)} names for {len(self._memory)} GPUs; "
                "give one name per GPU or none"
            )
        self._names = list(names)

    def gpus(self) -> list[Device]:
        return [
            Device("cuda", i, name, free, total, backend=self.backend)
            for i, ((free, total), name) in enumerate(zip(self._memory, self._names, strict=True))
        ]

    def __repr__(self) -> str:
        return f"FakeGpus({self._memory!r}, names={self._names!r})"


class TorchGpus:
    """GPUs as torch sees them (``torch.cuda``); imports torch on first call."""

    backend = "torch"

    def gpus(self) -> list[Device]:
        import torch

        if not torch.cuda.is_available():
            return []
        found = []
        for i in range(torch.cuda.device_count()):
            # One unusable GPU (exclusive mode, busy, fallen off the bus) must not hide
            # the others.
            try:
                free, total = torch.cuda.mem_get_info(i)
                name = torch.cuda.get_device_name(i)
            except Exception as exc:
                logger.debug("torch cannot read cuda:%d: %s", i, exc)
                continue
            found.append(Device("cuda", i, name, int(free), int(total), backend=self.backend))
        return found


class CupyGpus:
    """GPUs as cupy sees them (``cupy.cuda``); imports cupy on first call."""

    backend = "cupy"

    def gpus(self) -> list[Device]:
        import cupy

        found = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            try:
                free, total = cupy.cuda.Device(i).mem_info
                raw = cupy.cuda.runtime.getDeviceProperties(i)["name"]
            except Exception as exc:
                logger.debug("cupy cannot read cuda:%d: %s", i, exc)
                continue
            name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            found.append(Device("cuda", i, name, int(free), int(total), backend=self.backend))
        return found


_DRIVER_FILES = (
    "/dev/nvidiactl",
    "/dev/nvidia0",
    "/proc/driver/nvidia/version",
    "/dev/kfd",  # ROCm builds of torch answer through torch.cuda too
    "/dev/dxg",  # GPUs inside WSL2
)


class AutoGpus:
    """The default provider: torch if it sees a GPU, else cupy, else no GPU.

    Never raises: an import failure or a driver error is logged at debug level and
    counts as "no GPU".
    """

    backend = None

    def __init__(self) -> None:
        self._driver: bool | None = None

    def _driver_present(self) -> bool:
        if self._driver is None:
            self._driver = any(os.path.exists(p) for p in _DRIVER_FILES)
            if not self._driver:
                logger.debug("no GPU driver files (%s): no GPU", ", ".join(_DRIVER_FILES))
        return self._driver

    def gpus(self) -> list[Device]:
        for module, provider in (("torch", TorchGpus()), ("cupy", CupyGpus())):
            if module not in sys.modules:
                if not self._driver_present():
                    return []
                if importlib.util.find_spec(module) is None:
                    continue
            try:
                found = provider.gpus()
            except Exception as exc:  # ImportError, CUDA driver errors, broken installs
                logger.debug("%s cannot list GPUs: %s: %s", module, type(exc).__name__, exc)
                continue
            if found:
                return found
        return []


_lock = threading.Lock()
_provider: GpuProvider = AutoGpus()


class _Restore:
    """What ``use_provider`` returns: a context manager that puts the previous one back."""

    def __init__(self, previous: GpuProvider) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        global _provider
        with _lock:
            _provider = self._previous


def use_provider(provider: GpuProvider | None) -> _Restore:
    """Read GPUs through ``provider`` from now on; None goes back to torch/cupy detection.

    Side effect: process-wide. Works as a context manager that restores the previous
    provider. Raises ``TypeError`` if ``provider`` has no ``gpus()`` method.
    """
    global _provider
    if provider is not None and not callable(getattr(provider, "gpus", None)):
        raise TypeError(
            f"a GPU provider needs a gpus() method returning a list of Device; "
            f"got {type(provider).__name__}"
        )
    with _lock:
        previous = _provider
        _provider = AutoGpus() if provider is None else provider
    return _Restore(previous)


def provider() -> GpuProvider:
    """The provider GPUs are read through now (see :func:`use_provider`)."""
    return _provider


def torch_device(device: str) -> str:
    """The torch device that holds the tensors of ``device`` (``"cpu"``, ``"cuda"``,
    ``"cuda:N"``): ``device`` itself, or ``"cpu"`` while the GPUs are simulated
    (a provider whose ``backend`` is ``"fake"``), so that their tensors are CPU tensors
    accounted as the fake device's."""
    if device != "cpu" and getattr(_provider, "backend", None) == "fake":
        return "cpu"
    return device


def gpus() -> DeviceList:
    """Every GPU with its free and total memory in bytes; an empty list means no GPU.

    Never raises: a provider that fails is logged (debug for the built-in detection,
    warning for one installed with ``use_provider``) and counts as no GPU.
    """
    provider = _provider
    try:
        found = list(provider.gpus())
        bad = [d for d in found if not isinstance(d, Device)]
        if bad:
            raise TypeError(f"gpus() returned {type(bad[0]).__name__}, not Device")
    except Exception as exc:
        level = logging.DEBUG if isinstance(provider, AutoGpus) else logging.WARNING
        logger.log(level, "GPU provider %r failed, assuming no GPU: %s", provider, exc)
        return DeviceList()
    return DeviceList(found)


def cpu_cores(root: str | None = None) -> int:
    """The number of cores this process may use: its CPU affinity and cgroup CPU quota.

    A quota of 1.5 CPUs counts as 2 cores (both may run, just not all the time). The
    cgroup files are read under ``root`` (default ``config.get("proc_root")``); a quota
    that cannot be read is ignored. Always at least 1.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cpu_quota(Path(root if root is not None else config.get("proc_root")))
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _cpu_quota(root: Path) -> float | None:
    """The smallest CPU quota (in CPUs) over this process's cgroup and its ancestors."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip("/")
        if controllers == "":
            mounts = [root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"]
            reader = _read_cpu_max
        elif "cpu" in controllers.split(","):
            mounts = [root / "sys/fs/cgroup" / controllers, root / "sys/fs/cgroup/cpu"]
            reader = _read_cfs_quota
        else:
            continue
        for mount in mounts:
            # Without a cgroup namespace the path names the host's tree while the
            # container sees its own cgroup at the mount root: try both.
            folder = mount / rel if rel else mount
            for candidate in [folder, *folder.parents]:
                if len(candidate.parts) < len(mount.parts):
                    break
                quota = reader(candidate)
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def _read_cpu_max(folder: Path) -> float | None:
    try:
        limit, period = (folder / "cpu.max").read_text().split()[:2]
        if limit == "max":
            return None
        return int(limit) / int(period)
    except (OSError, ValueError):
        return None


def _read_cfs_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:  # -1 means no quota
        return None
    return quota / period


def _cpu_name(root: Path) -> str:
    try:
        for line in (root / "proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def cpu_device(root: str | None = None) -> Device:
    """The CPU as a :class:`Device`: usable cores, free and usable RAM in bytes."""
    base = root if root is not None else config.get("proc_root")
    figures = limits.read_memory(base)
    return Device(
        "cpu",
        0,
        _cpu_name(Path(base)),
        figures.free,
        figures.usable,
        cores=cpu_cores(base),
    )


def devices() -> DeviceList:
    """The CPU, then every GPU (see :func:`gpus`); sizes in bytes.

    ``str()`` gives one device a line, e.g. ``cpu: 2 cores, 21.3 GB free`` and
    ``cuda:0 NVIDIA H200: 130.1/139.8 GB free``. May initialise CUDA (see the module
    docstring).
    """
    return DeviceList([cpu_device(), *gpus()])


def best_device(gb: float | str = 0) -> str:
    """``"cuda:N"`` for the GPU with the most free memory if it has ``gb`` free, else ``"cpu"``.

    ``gb`` is binary gigabytes (2**30 bytes) or a size string such as ``"512MB"``;
    0 means any GPU. Ties go to the lower index. Raises ``ConfigError`` for a
    negative, NaN or infinite ``gb``.
    """
    need = _needed_bytes(gb)
    found = gpus()
    if not found:
        return "cpu"
    best = max(found, key=lambda d: (d.free, -d.index))
    return best.id if best.free >= need else "cpu"


def _needed_bytes(gb: float | str) -> float:
    if isinstance(gb, str):
        return config.parse_size(gb, "best_device(gb)")
    if isinstance(gb, bool) or not isinstance(gb, numbers.Real):
        raise ConfigError(f"best_device(gb) expects a number of GB such as 4, got {gb!r}")
    gb = float(gb)
    if not math.isfinite(gb) or gb < 0:
        raise ConfigError(
            f"best_device(gb={gb!r}): gb must be a finite number of GB >= 0, such as 4"
        )
    return gb * GB
