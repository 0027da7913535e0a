"""The worker plugin of the Dask executor (imported only where Dask is)."""

from __future__ import annotations

import contextlib
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from ... import config
from . import cluster
from .cluster import node_budget
from .dask import RESOURCE

__all__ = ["TierflowPlugin"]


class TierflowPlugin(WorkerPlugin):
    """Runs on every worker that has or gets it: the worker's budget as its tierflow
    budget and as the resource ``tierflow-bytes``, Dask's spilling off (see
    :mod:`tierflow.engine.executors.dask`)."""

    name = "tierflow"
    idempotent = True

    def __init__(self, settings: tuple[tuple[str, Any], ...]) -> None:
        self.settings = settings

    async def setup(self, worker: Any) -> None:
        slots = max(1, int(worker.state.nthreads))
        budget = node_budget(worker.memory_manager.memory_limit, 1)
        config.set(ram_budget=budget, **dict(self.settings))
        with contextlib.suppress(AttributeError):
            worker.memory_manager.memory_spill_fraction = False
            worker.memory_manager.memory_target_fraction = False
        worker.tierflow_slots = slots
        cluster.here = str(worker.address)
        await worker.set_resources(**{RESOURCE: budget})
