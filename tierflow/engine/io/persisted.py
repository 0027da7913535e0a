"""``persist(device="cuda")``: a result's blocks kept on a GPU while they fit its budget.

The result is computed as by ``persist()``; then each of its blocks goes into a
:class:`~tierflow.storage.device_store.DeviceStore` of the chosen GPU: on the device
while the blocks fit its budget, the largest spilled to RAM (and on to the SSD under RAM
pressure) when they do not, and read back when used on the device. The returned array
reads its blocks through :class:`DeviceReader`: a CPU consumer gets a host copy of each
block (a spilled block as it is), without moving it; :meth:`DeviceReader.on_device`
gives a block on the device.

``device``: ``"cuda"`` (the GPU with the most free memory), ``"cuda:N"``, or ``"auto"``
(``"cuda"`` when there is a GPU, else a plain ``persist()`` on the host).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...operators import byteorder
from ...storage.device_store import DeviceStore
from ...system import devices
from .memory import ArrayReader
from .readers import Reader

__all__ = ["DeviceReader", "place"]


class DeviceReader(Reader):
    """Rows of blocks kept in ``store`` under their block numbers, ``bounds`` the
    blocks' first rows and the end (see the module docstring)."""

    computes = True
    makes_blocks = True  # a block on the GPU is copied out when a CPU consumer reads it

    def __init__(
        self, store: DeviceStore, bounds: tuple[int, ...], like: np.ndarray, token: str
    ) -> None:
        self.store = store
        self.bounds = tuple(bounds)
        self.dtype = like.dtype
        self.row_shape = tuple(like.shape[1:])
        self.n_rows = int(self.bounds[-1])
        self.label = f"persist({store.device})"
        self._token = token

    def __reduce__(self) -> tuple[Any, ...]:
        # Another process cannot see this one's GPU memory: it gets the rows by value.
        return (ArrayReader, (self.read(0, int(self.bounds[-1])),))

    def token(self) -> str:
        return self._token

    def _block_of(self, row: int) -> int:
        import bisect

        return bisect.bisect_right(self.bounds, row) - 1

    def read(self, a: int, b: int) -> np.ndarray:
        if a >= b:
            return np.empty((0, *self.row_shape), self.dtype)
        first, last = self._block_of(a), self._block_of(b - 1)
        pieces = []
        for k in range(first, last + 1):
            start = self.bounds[k]
            block = self.store.host(k)
            pieces.append(block[max(a, start) - start : min(b, self.bounds[k + 1]) - start])
        return pieces[0] if len(pieces) == 1 else byteorder.join(pieces)

    def on_device(self, k: int) -> Any:
        """Block ``k`` on the device (read back if it was spilled)."""
        return self.store.get(k)

    def where(self) -> list[str]:
        """The tier of each block: ``"gpu"``, ``"ram"`` or ``"ssd"``."""
        return [self.store.where(k) for k in range(len(self.bounds) - 1)]


def place(result: np.ndarray, bounds: tuple[int, ...], device: str, token: str) -> Reader | None:
    """``result``'s blocks (rows ``bounds[k]:bounds[k+1]``) kept on ``device``; None
    when ``device`` is ``"auto"`` and there is no GPU."""
    chosen = _choose(device)
    if chosen is None:
        return None
    store = DeviceStore(chosen)
    for k in range(len(bounds) - 1):
        store.put(k, result[bounds[k] : bounds[k + 1]])
    return DeviceReader(store, bounds, result[:0], token)


def _choose(device: str) -> str | None:
    found = devices.gpus()
    text = str(device)
    if text in ("cuda", "auto"):
        if not found:
            if text == "auto":
                return None
            raise ValueError(
                "persist(device='cuda'): there is no GPU here; use device='auto' to keep the "
                "result on the host when there is none"
            )
        return max(found, key=lambda d: (d.free, -d.index)).id
    if text.startswith("cuda:") and text in {d.id for d in found}:
        return text
    have = ", ".join(d.id for d in found) or "none"
    raise ValueError(
        f"persist(device={device!r}): use 'cuda', 'cuda:N' or 'auto' (GPUs here: {have})"
    )
