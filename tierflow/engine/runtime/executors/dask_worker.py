"""The worker plugin of the Dask executor (imported only where Dask is).

It imports :mod:`.cluster` (the resource name, the node budget) and never :mod:`.dask`,
which imports this module when it installs the plugin on a client's workers.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil
from distributed.comm import get_address_host
from distributed.diagnostics.plugin import WorkerPlugin

from .... import config
from ....storage import filemaps
from . import cluster
from .cluster import RESOURCE, node_budget

__all__ = ["TierflowPlugin"]


TICK_MS = 1000  # the worker's event-loop tick (Dask's default: 20 ms)


class TierflowPlugin(WorkerPlugin):
    """Runs on every worker that has or gets it: the worker's budget as its tierflow
    budget and as the resource ``tierflow-bytes``, Dask's spilling off, its event loop
    woken less often, no more of files' pages kept mapped between scans than Dask's
    pause threshold leaves above the budget (see
    :mod:`tierflow.engine.runtime.executors.dask`)."""

    name = "tierflow"
    idempotent = True

    def __init__(self, settings: tuple[tuple[str, Any], ...]) -> None:
        self.settings = settings

    async def setup(self, worker: Any) -> None:
        slots = max(1, int(worker.state.nthreads))
        budget = node_budget(worker.memory_manager.memory_limit, 1)
        config.set(ram_budget=budget, **dict(self.settings))
        filemaps.keep_files(_room_for_files(worker, budget))
        with contextlib.suppress(AttributeError):
            worker.memory_manager.memory_spill_fraction = False
            worker.memory_manager.memory_target_fraction = False
        worker.tierflow_slots = slots
        _quieten(worker)
        # Placement is by machine: its page cache holds what any worker there read, and
        # a preference for one worker process would leave the others on it idle.
        cluster.here = get_address_host(worker.address)
        await worker.set_resources(**{RESOURCE: budget})


def _room_for_files(worker: Any, budget: int) -> int | None:
    """Bytes of files' pages the worker may keep mapped between scans
    (:func:`tierflow.storage.filemaps.keep_files`): Dask's memory monitor pauses a
    worker whose RSS, which counts mapped file pages, passes its pause threshold, so
    what that threshold leaves above the tierflow budget and what the process holds
    now; None (half the budget) where Dask polices no memory limit."""
    manager = worker.memory_manager
    limit = getattr(manager, "memory_limit", None)
    fraction = getattr(manager, "memory_pause_fraction", False) or getattr(
        manager, "memory_terminate_fraction", False
    )
    if not limit or not fraction:
        return None
    held = psutil.Process().memory_info().rss
    return max(0, int(limit * fraction) - budget - held)


def _quieten(worker: Any) -> None:
    """Wake the worker's event loop less: its statistical profiler (every 10 ms) off,
    its tick (every 20 ms) once a second. Each wake takes the GIL from the task thread,
    whose Python code (a ``map_blocks`` function) then waits for it: on 2 cores, a
    per-row Python function ran 1.1x faster than serial on Dask's defaults and 1.5-1.7x
    without these."""
    callbacks = getattr(worker, "periodic_callbacks", {})
    for name in ("profile", "profile-cycle"):
        if name in callbacks:
            callbacks[name].stop()
    if "tick" in callbacks:
        callbacks["tick"].callback_time = TICK_MS
