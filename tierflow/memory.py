"""``from tierflow import memory``: the toolbox that makes memory visible and safe.

A thin facade: every name here is implemented in a layer below (``tierflow.system``,
``tierflow.storage``) and re-exported so that a notebook user needs one import.
The engine (``import tierflow as tw``) is built on exactly these parts.

``memory.map`` shadows the builtin inside this module only; it is the public name.
"""

from __future__ import annotations

# system: limits, budget, pressure, devices, status
# storage: spill files and tier placement, the pool, page release, sharing across
# processes and the /dev/shm guard, streaming, the two-tier store and @cached
from .storage.oom import fit_batch
from .storage.pages import file_resident_bytes, readahead, release, release_path, resident_bytes
from .storage.placement import array, free, on_disk, report
from .storage.pool import pool
from .storage.sharing import to_tensor
from .storage.shm import share_tensor, shared_array
from .storage.store import cached, store
from .storage.stream import chunks, map
from .system.budget import budget
from .system.devices import best_device, devices
from .system.pressure import pressure, relieve
from .system.status import limits, status
from .system.watch import on_pressure

__all__ = [
    "array",
    "best_device",
    "budget",
    "cached",
    "chunks",
    "devices",
    "file_resident_bytes",
    "fit_batch",
    "free",
    "limits",
    "map",
    "on_disk",
    "on_pressure",
    "pool",
    "pressure",
    "readahead",
    "release",
    "release_path",
    "relieve",
    "report",
    "resident_bytes",
    "share_tensor",
    "shared_array",
    "status",
    "store",
    "to_tensor",
]
