"""Contracts of the storage layer: where an array lives, and how a GPU array is made.

:class:`Placement` is one line of ``memory.report()``: an array made by
``memory.array`` with its tier (``"RAM"``, ``"SSD"`` or a GPU such as ``"cuda:0"``).
:class:`GpuBackend` is what :mod:`tierflow.storage.placement` asks to allocate on a GPU;
torch, cupy and a fake backend for tests implement it in :mod:`tierflow.storage.gpu`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..config import format_bytes

__all__ = ["RAM", "SSD", "GpuBackend", "Placement"]

RAM = "RAM"
SSD = "SSD"


@dataclass(frozen=True)
class Placement:
    """Where one live array made by ``memory.array`` lives.

    ``tier`` is ``"RAM"``, ``"SSD"`` or a GPU id (``"cuda:0"``); ``nbytes`` is the size
    of the whole array in bytes; ``path`` is the spill file of an SSD array, else None.
    ``str()`` gives the line ``memory.report()`` prints::

        [200000000, 8] float32 5.960 GB SSD ~/.tierflow/spill/4242-9876/tmpab12cd.bin
    """

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    nbytes: int
    tier: str
    path: str | None = None

    @property
    def shown_path(self) -> str:
        """The spill file with the home folder written as ``~`` ('' when in RAM/GPU)."""
        if self.path is None:
            return ""
        home = os.path.expanduser("~")
        if home not in ("", "/") and self.path.startswith(home + os.sep):
            return "~" + self.path[len(home) :]
        return self.path

    def __str__(self) -> str:
        line = f"{list(self.shape)} {self.dtype} {format_bytes(self.nbytes, 3)} {self.tier}"
        return f"{line} {self.shown_path}" if self.path else line


@runtime_checkable
class GpuBackend(Protocol):
    """How arrays are made on, and given back by, one GPU library.

    ``zeros`` allocates a zero-filled array of ``shape`` and NumPy ``dtype`` on GPU
    ``index`` and raises ``TypeError`` for a dtype the library cannot hold and
    ``MemoryError`` (or the library's out-of-memory error) when it does not fit.
    ``owner`` returns the object a view of such an array keeps alive (the one that
    carries the device memory), or None if ``x`` is not an array of this library.
    ``release`` gives the memory of ``owner`` back to the device now if the library
    can do that safely (none of the built-in backends can: a tensor's memory stays
    until its last view is collected), else does nothing.
    """

    name: str

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any], index: int) -> Any: ...

    def owner(self, x: Any) -> Any | None: ...

    def release(self, owner: Any) -> None: ...
