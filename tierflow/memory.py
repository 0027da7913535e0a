"""``from tierflow import memory``: the toolbox that makes memory visible and safe.

A thin facade: every name here is implemented in a layer below (``tierflow.system``,
``tierflow.storage``) and re-exported so that a notebook user needs one import.
The engine (``import tierflow as tw``) is built on exactly these parts.
"""

from __future__ import annotations

__all__: list[str] = []

# -- system: limits, budget, pressure, devices, status (tierflow/system) ----------------
from .system.budget import budget
from .system.limits import limits

__all__ += ["budget", "limits"]

from .system.devices import best_device, devices
from .system.status import status

__all__ = [*__all__, "best_device", "devices", "status"]

from .system.pressure import pressure, relieve
from .system.watch import on_pressure

__all__ = [*__all__, "on_pressure", "pressure", "relieve"]

# -- storage: spill files, tier placement, pool (tierflow/storage) ----------------------
from .storage.placement import array, free, on_disk, report
from .storage.pool import pool

__all__ += ["array", "free", "on_disk", "pool", "report"]

# -- storage: page release, sharing across processes, /dev/shm guard --------------------
from .storage.pages import file_resident_bytes, readahead, release, release_path, resident_bytes
from .storage.sharing import to_tensor
from .storage.shm import share_tensor, shared_array

__all__ += [
    "file_resident_bytes",
    "readahead",
    "release",
    "release_path",
    "resident_bytes",
    "share_tensor",
    "shared_array",
    "to_tensor",
]

# -- storage: streaming (chunks, map, fit_batch) -----------------------------------------
# `map` shadows the builtin in this module only (memory.map is the public name).
from .storage.oom import fit_batch
from .storage.stream import chunks, map

__all__ += ["chunks", "fit_batch", "map"]

# -- storage: the two-tier store and @cached ---------------------------------------------
from .storage.store import cached, store

__all__ += ["cached", "store"]
