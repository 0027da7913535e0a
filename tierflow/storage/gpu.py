"""Allocating arrays on a GPU: torch, cupy, and a fake backend for tests.

:func:`backend_for` picks the :class:`~tierflow.storage.types.GpuBackend` for a
:class:`~tierflow.system.devices.Device` from the library that measured it
(``device.backend``): ``"torch"`` gives torch tensors, ``"cupy"`` cupy arrays,
``"fake"`` (GPUs simulated with ``devices.FakeGpus``) gives :class:`FakeGpuArray`, a
NumPy array tagged with its device, so placement, accounting and ``memory.report()``
are testable without a GPU. ``use_backend`` overrides the choice (tests).

torch and cupy are imported lazily, on the first GPU allocation.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import missing_dependency
from ..system.devices import Device
from .types import GpuBackend

__all__ = [
    "CupyBackend",
    "FakeBackend",
    "FakeGpuArray",
    "TorchBackend",
    "backend_for",
    "use_backend",
]


class FakeGpuArray(np.ndarray):
    """A NumPy array that stands for an array on a simulated GPU; ``device`` says which."""

    _fake_device = "cuda:0"

    @property
    def device(self) -> str:  # type: ignore[override]
        """The simulated GPU, such as ``"cuda:1"`` (NumPy's own ``device`` is ``"cpu"``)."""
        return self._fake_device

    def __array_finalize__(self, obj: Any) -> None:
        self._fake_device = getattr(obj, "_fake_device", "cuda:0")


class FakeBackend:
    """Allocates :class:`FakeGpuArray` in host memory, tagged ``cuda:N``."""

    name = "fake"

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any], index: int) -> Any:
        array = np.zeros(shape, dtype).view(FakeGpuArray)
        array._fake_device = f"cuda:{index}"
        return array

    def owner(self, x: Any) -> Any | None:
        if not isinstance(x, FakeGpuArray):
            return None
        # A view's base is the array it was made from (NumPy stops collapsing at the
        # plain ndarray underneath); the owner is the last FakeGpuArray in the chain.
        while isinstance(x.base, FakeGpuArray):
            x = x.base
        return x

    def release(self, owner: Any) -> None:
        """Nothing to give back: host memory returns when the array is collected."""


def torch_dtype(dtype: np.dtype[Any]) -> Any:
    """The torch dtype of a NumPy dtype, in either byte order (tensors have only the
    native one); ``TypeError`` when torch has none."""
    import torch

    try:
        return torch.from_numpy(np.zeros(0, np.dtype(dtype).newbyteorder("="))).dtype
    except TypeError:
        raise TypeError(f"torch has no dtype for {dtype}; use a numeric dtype") from None


class TorchBackend:
    """``torch.zeros(shape, dtype=..., device="cuda:N")``."""

    name = "torch"

    def __init__(self) -> None:
        try:
            import torch
        except ImportError:
            raise missing_dependency("torch", "torch", "an array on a GPU") from None
        self._torch = torch

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any], index: int) -> Any:
        return self._torch.zeros(shape, dtype=torch_dtype(dtype), device=f"cuda:{index}")

    def owner(self, x: Any) -> Any | None:
        if not isinstance(x, self._torch.Tensor):
            return None
        while x._base is not None:
            x = x._base
        return x

    def release(self, owner: Any) -> None:
        """Nothing safe to do: torch frees the memory when the last view is collected.

        (Shrinking the storage would free it now, but torch does not check a view
        against its storage's size: a later use of the tensor would read freed memory.)
        """


class CupyBackend:
    """``cupy.zeros(shape, dtype)`` on ``cupy.cuda.Device(N)``."""

    name = "cupy"

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError:
            raise missing_dependency("cupy", "cupy", "an array on a GPU") from None
        self._cupy = cupy

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any], index: int) -> Any:
        with self._cupy.cuda.Device(index):
            return self._cupy.zeros(shape, np.dtype(dtype).newbyteorder("="))

    def owner(self, x: Any) -> Any | None:
        if not isinstance(x, self._cupy.ndarray):
            return None
        while x.base is not None:
            x = x.base
        return x

    def release(self, owner: Any) -> None:
        """Nothing safe to do: cupy frees the memory when the last view is collected."""


_lock = threading.Lock()
_override: GpuBackend | None = None
_made: dict[str, GpuBackend] = {}


def use_backend(backend: GpuBackend | None) -> None:
    """Allocate every GPU array through ``backend`` (None: choose by the device).

    Process-wide; tests use it to combine real device figures with a fake allocator.
    """
    global _override
    with _lock:
        _override = backend


def backend_for(device: Device) -> GpuBackend:
    """The allocation backend for ``device``: the override, else by ``device.backend``.

    Raises :class:`~tierflow.errors.DependencyError` when torch or cupy is needed and
    missing. A device measured by an unknown library is allocated through torch.
    """
    with _lock:
        if _override is not None:
            return _override
        name = device.backend or "torch"
        backend = _made.get(name)
        if backend is None:
            if name == "fake":
                backend = FakeBackend()
            elif name == "cupy":
                backend = CupyBackend()
            else:
                backend = TorchBackend()
            _made[name] = backend
        return backend


def all_backends() -> list[GpuBackend]:
    """The backends made so far (and the override), to recognise their arrays."""
    with _lock:
        found = list(_made.values())
        if _override is not None and _override not in found:
            found.append(_override)
        return found
