"""``from tierflow import memory``: the toolbox that makes memory visible and safe.

A thin facade: every name here is implemented in a layer below (``tierflow.system``,
``tierflow.storage``) and re-exported so that a notebook user needs one import.
The engine (``import tierflow as tw``) is built on exactly these parts.
"""

from __future__ import annotations

# -- system: limits, budget, pressure, devices, status (tierflow/system) ----------------
# -- storage: spill files, tier placement, pool (tierflow/storage) ----------------------
# -- storage: page release, sharing across processes, /dev/shm guard --------------------
# -- storage: streaming (chunks, map, fit_batch) -----------------------------------------
# -- storage: the two-tier store and @cached ---------------------------------------------

__all__: list[str] = []
