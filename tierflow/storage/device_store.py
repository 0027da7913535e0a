"""Blocks kept on a GPU while they fit its budget, spilled to RAM and the SSD when not.

A :class:`DeviceStore` holds the blocks of one device (``persist(device="cuda")``
keeps a result's blocks in one). Its tiers, from fast to slow:

1. **the device**, while the blocks fit the device's budget (``budget()``, bytes: the
   device's free memory less a margin when the store was made, unless given);
2. **RAM**, then **the SSD**: a block that does not fit goes to the host, into an array
   of :func:`tierflow.storage.placement.array` (RAM while the RAM budget and pressure
   allow, else a spill file), and so does every block spilled from the device.

Rules:

* :meth:`put` makes room on the device by spilling the largest device blocks first (the
  fewest copies free the most memory); a block bigger than the whole budget goes
  straight to the host.
* :meth:`spill_to` spills the largest blocks until the device holds at most the bytes
  asked (for a device under pressure). The store is a RAM pressure subscriber
  (:func:`tierflow.system.pressure.subscribe`): at ``high`` or above, and when asked to
  :meth:`relieve`, it moves its RAM copies to the SSD, largest first.
* :meth:`get` gives a block on the device, reading a spilled one back (making room the
  same way) and keeping it there; :meth:`host` gives a NumPy block without moving it
  (a device block is copied out, a host one returned as it is).

A host copy is never freed explicitly: the store lets go of it, and its RAM (or spill
file) goes with its last view, so an array :meth:`host` handed out stays valid after its
block moved. Copies go through the allocation backend of the device
(:func:`tierflow.storage.gpu.backend_for`): torch tensors, cupy arrays, or the fake
backend's tagged NumPy arrays (tests). The store is thread-safe; copies run outside its
lock, and a block being moved is never handed out half-copied.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import format_bytes
from ..system import device_budget, devices, pressure
from ..system.types import Level
from . import gpu, placement, spill
from .types import GpuBackend

__all__ = ["DEVICE", "DeviceStore", "held_on", "make_room"]

DEVICE = "gpu"  # the tier name of a block on the device (beside placement's RAM, SSD)

# Every live store, so that the GPU's other users (the scheduler's device tasks) count
# what the stores hold there and can have it spilled (held_on, make_room).
_stores: weakref.WeakSet[DeviceStore] = weakref.WeakSet()
_stores_lock = threading.Lock()


def _live(device: str) -> list[DeviceStore]:
    with _stores_lock:
        return [s for s in _stores if s.device == device]


def held_on(device: str) -> int:
    """Bytes every live store holds on GPU ``device``."""
    return sum(s.held() for s in _live(device))


device_budget.add_holder(held_on)  # shown as kept by status


def make_room(device: str, nbytes: int) -> int:
    """Spill blocks of the live stores on GPU ``device`` to the host, the largest first
    across the stores, until ``nbytes`` are freed or none is left there; the bytes
    freed (the GPU under pressure from its other users)."""
    freed = 0
    while freed < nbytes:
        best: tuple[int, DeviceStore, Hashable] | None = None
        for store in _live(device):
            with store._lock:
                key = store._largest_locked(None)
                if key is not None:
                    size = store._blocks[key].nbytes
                    if best is None or size > best[0]:
                        best = (size, store, key)
        if best is None:
            return freed
        freed += best[1]._spill(best[2])
    return freed


@dataclass
class _Block:
    """One block: on the device (``device`` set) or on the host (``host`` set)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    nbytes: int
    device: Any = None
    host: np.ndarray | None = None
    moving: bool = False  # being spilled: still usable on the device meanwhile


class DeviceStore:
    """The blocks of one GPU, ``device`` (``"cuda:N"``), within ``budget()`` bytes on it
    (default: its free memory less :func:`~tierflow.storage.placement.gpu_margin`, read
    now). See the module docstring."""

    def __init__(self, device: str, budget: Callable[[], int] | None = None) -> None:
        found = {d.id: d for d in devices.gpus()}
        if device not in found:
            have = ", ".join(found) or "none"
            raise ValueError(f"no GPU {device!r} (GPUs here: {have})")
        self.device = device
        self._index = found[device].index
        self._backend: GpuBackend = gpu.backend_for(found[device])
        if budget is None:
            room = max(0, found[device].free - placement.gpu_margin(found[device].total))
            budget = lambda: room  # noqa: E731 - read once, at the start
        self.budget = budget
        self._lock = threading.Lock()
        self._blocks: dict[Hashable, _Block] = {}
        self._held = 0  # bytes of the blocks on the device
        self.spilled = 0  # blocks moved from the device to the host
        self.read_back = 0  # blocks moved from the host back to the device
        pressure.subscribe(self)  # RAM under pressure: host copies go to the SSD
        with _stores_lock:
            _stores.add(self)

    # -- what is where ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._blocks

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._blocks))

    def held(self) -> int:
        """Bytes of blocks on the device."""
        return self._held

    def where(self, key: Hashable) -> str:
        """The tier of block ``key``: ``"gpu"``, ``"ram"`` or ``"ssd"``."""
        block = self._blocks[key]
        if block.device is not None:
            return DEVICE
        return "ssd" if placement.on_disk(block.host) else "ram"

    def totals(self) -> dict[str, int]:
        """Bytes held per tier (``gpu``, ``ram``, ``ssd``)."""
        out = {DEVICE: 0, "ram": 0, "ssd": 0}
        for key in list(self._blocks):
            block = self._blocks.get(key)
            if block is not None:
                out[self.where(key)] += block.nbytes
        return out

    def __repr__(self) -> str:
        t = self.totals()
        return (
            f"DeviceStore({self.device}: {len(self)} blocks, {format_bytes(t[DEVICE])} on "
            f"the device of a {format_bytes(self.budget())} budget, {format_bytes(t['ram'])} "
            f"in RAM, {format_bytes(t['ssd'])} on the SSD)"
        )

    # -- in and out -------------------------------------------------------------------

    def put(self, key: Hashable, block: np.ndarray) -> str:
        """Keep a copy of the host block ``block`` under ``key`` (replacing one): on the
        device when it fits the budget (spilling the largest blocks to make room),
        else on the host. The tier it went to."""
        block = np.asarray(block)
        self.discard(key)
        nbytes = int(block.nbytes)
        if nbytes <= self.budget() and self._make_room(nbytes):
            try:
                placed = self._upload(block)
            except BaseException:
                with self._lock:
                    self._held -= nbytes  # the room reserved for it is not taken
                raise
            with self._lock:
                self._blocks[key] = _Block(block.shape, block.dtype, nbytes, device=placed)
            return DEVICE
        host = placement.array(block.shape, block.dtype)
        host[...] = block
        with self._lock:
            self._blocks[key] = _Block(block.shape, block.dtype, nbytes, host=host)
        return self.where(key)

    def get(self, key: Hashable) -> Any:
        """Block ``key`` on the device (read back from the host if it was spilled, when
        it fits the budget; else ``MemoryError`` with the numbers)."""
        with self._lock:
            block = self._blocks[key]
            if block.device is not None:
                return block.device
        if block.nbytes > self.budget() or not self._make_room(block.nbytes, keep=key):
            raise MemoryError(
                f"block {key!r} ({format_bytes(block.nbytes)}) does not fit {self.device}'s "
                f"budget of {format_bytes(self.budget())} beside the blocks kept there; "
                "use host(key) to read it on the CPU, or free blocks of this store"
            )
        assert block.host is not None
        try:
            placed = self._upload(block.host)
        except BaseException:
            with self._lock:
                self._held -= block.nbytes
            raise
        with self._lock:
            if block.device is None:
                # The host copy goes with its last view.
                block.device, block.host = placed, None
                self.read_back += 1
            else:  # another thread read it back meanwhile
                self._held -= block.nbytes
        return block.device

    def host(self, key: Hashable) -> np.ndarray:
        """Block ``key`` as a NumPy array, without moving it (a device block is
        copied out into a new array)."""
        with self._lock:
            block = self._blocks[key]
            device, host = block.device, block.host
        if host is not None:
            return host
        out = np.empty(block.shape, block.dtype)
        _copy_out(device, out)
        return out

    def discard(self, key: Hashable) -> None:
        """Forget block ``key`` (nothing when it is not here)."""
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is not None and block.device is not None:
                self._held -= block.nbytes

    def clear(self) -> None:
        """Forget every block."""
        for key in list(self._blocks):
            self.discard(key)

    # -- spilling ---------------------------------------------------------------------

    def spill_to(self, keep_bytes: int) -> int:
        """Spill the largest device blocks to the host until the device holds at most
        ``keep_bytes`` (the device under pressure); the bytes spilled."""
        spilled = 0
        while True:
            with self._lock:
                if self._held <= keep_bytes:
                    return spilled
                victim = self._largest_locked(None)
            if victim is None:
                return spilled
            spilled += self._spill(victim)

    def relieve(self) -> int:
        """Move the blocks spilled to RAM onto the SSD, largest first (RAM under
        pressure: :func:`tierflow.system.pressure.relieve` calls it); the RAM bytes
        given back."""
        moved = 0
        ram = sorted(
            ((b.nbytes, k) for k, b in list(self._blocks.items()) if b.host is not None),
            key=lambda item: -item[0],
        )
        for nbytes, key in ram:
            block = self._blocks.get(key)
            if block is None or block.host is None or placement.on_disk(block.host):
                continue
            copy = spill.write_array(np.ascontiguousarray(block.host))
            with self._lock:
                block.host = copy  # the RAM copy goes with its last view
            moved += nbytes
        return moved

    # -- pressure (a subscriber of tierflow.system.pressure, for RAM) ----------------------

    def on_pressure(self, level: Level) -> None:
        """RAM at ``high`` or above: the blocks spilled to RAM move to the SSD."""
        if level >= Level.HIGH:
            self.relieve()

    def _largest_locked(self, keep: Hashable | None) -> Hashable | None:
        best, size = None, -1
        for key, block in self._blocks.items():
            usable = block.device is not None and not block.moving
            if usable and key != keep and block.nbytes > size:
                best, size = key, block.nbytes
        return best

    def _make_room(self, nbytes: int, keep: Hashable | None = None) -> bool:
        """Reserve ``nbytes`` on the device, spilling the largest blocks (not ``keep``)
        until they fit; False when they cannot."""
        while True:
            with self._lock:
                if self._held + nbytes <= self.budget():
                    self._held += nbytes
                    return True
                victim = self._largest_locked(keep)
            if victim is None:
                return False
            self._spill(victim)

    def _spill(self, key: Hashable) -> int:
        """Move device block ``key`` to the host; its bytes (0 if it was not there)."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None or block.device is None or block.moving:
                return 0
            block.moving = True
            device = block.device
        host = placement.array(block.shape, block.dtype)
        _copy_out(device, host)
        with self._lock:
            block.host, block.device, block.moving = host, None, False
            self._held -= block.nbytes
            self.spilled += 1
        return block.nbytes

    def _upload(self, host: np.ndarray) -> Any:
        placed = self._backend.zeros(tuple(host.shape), host.dtype, self._index)
        _copy_in(placed, host)
        return placed


def _copy_in(device: Any, host: np.ndarray) -> None:
    """Copy the host array ``host`` into the device array ``device`` (same shape); a
    host array in the other byte order is swapped on the way (device arrays have only
    the native one)."""
    if isinstance(device, np.ndarray):  # the fake backend's
        device[...] = host
        return
    native = np.ascontiguousarray(host, dtype=host.dtype.newbyteorder("="))
    if hasattr(device, "copy_"):  # torch
        import torch

        device.copy_(torch.from_numpy(native))
    else:  # cupy
        device.set(native)


def _copy_out(device: Any, host: np.ndarray) -> None:
    """Copy the device array ``device`` into the host array ``host`` (RAM or a map), in
    the host array's byte order."""
    if isinstance(device, np.ndarray):
        host[...] = device.view(np.ndarray)
    elif hasattr(device, "copy_") and not host.dtype.isnative:
        host[...] = device.cpu().numpy()
    elif hasattr(device, "copy_"):
        import torch

        torch.from_numpy(host.view(np.ndarray)).copy_(device)
    else:
        host[...] = device.get()
