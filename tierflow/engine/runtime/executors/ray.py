"""``executor="ray"``: block tasks on a Ray cluster's workers.

``executor="ray"`` uses the Ray instance this process is connected to, or starts a
local one (saying so on the ``tierflow.engine`` logger); ``tw.RayExecutor(address=...)``
connects to a cluster. Its task slots are the cluster's CPUs. See :mod:`.cluster` for
what every cluster executor shares; what is Ray's:

* Each block task runs as a Ray task with ``num_cpus=1``, ``max_retries=0`` and
  ``retry_exceptions=False`` (tierflow retries), asking for its projected bytes as
  Ray's ``memory`` resource, so Ray places it on a node where it fits.
* A worker's tierflow budget is its node's memory per CPU
  (:func:`~.cluster.node_budget` of the node's usable memory, over the node's CPUs).
* Programs go to the object store once (``ray.put``); each worker process unpickles a
  program once.
* A task whose worker crashed (``WorkerCrashedError``, a node that died) is sent again;
  one Ray killed for memory (``OutOfMemoryError``) is sent again on halved blocks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import CancelledError
from time import perf_counter
from typing import Any

from .... import config
from ....errors import TierflowError, missing_dependency
from . import cluster
from .cluster import ClusterExecutor, Death, host_name, node_budget, probe_files, run_pack

__all__ = ["RayExecutor"]

log = logging.getLogger("tierflow.engine")

SEEN_EVERY = 0.25  # seconds between readings of the cluster's CPUs while tasks run


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise missing_dependency("ray", "ray", "executor='ray'") from None
    return ray


_node_cpus: int | None = None


def _ray_block(
    descs: Any, data: bytes, settings: tuple[tuple[str, Any], ...], cap: Any, stems: Any
) -> Any:
    """Block tasks in a Ray worker: this node's budget per CPU, then :func:`run_pack`."""
    global _node_cpus
    if _node_cpus is None:
        ray = _ray()
        node = ray.get_runtime_context().get_node_id()
        cpus = 1
        for n in ray.nodes():
            if n.get("NodeID") == node:
                cpus = max(1, int(n.get("Resources", {}).get("CPU", 1)))
        _node_cpus = cpus
        config.set(ram_budget=node_budget(None, cpus))
        cluster.here = str(node)
    return run_pack(descs, data, settings, cap, stems)


def _session(ray: Any) -> str | None:
    """Which Ray instance this process is connected to (None: none): its GCS address."""
    if not ray.is_initialized():
        return None
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:
        return None


def _ray_probe(paths: list[str]) -> tuple[str, list[str]]:
    ray = _ray()
    return ray.get_runtime_context().get_node_id(), probe_files(paths)


class RayExecutor(ClusterExecutor):
    """Block tasks on a Ray cluster: the one this process is connected to, the one at
    ``address``, or a local one started now; ``workers``: the task slots counted
    (default: the cluster's CPUs). See the module docstring."""

    name = "ray"

    def __init__(self, address: str | None = None, *, workers: int | None = None) -> None:
        ray = self._ray = _ray()
        if not ray.is_initialized():
            if address is None:
                log.warning(
                    "executor='ray' started a local Ray instance (connect to a cluster "
                    "with tw.RayExecutor(address='ray://host:10001') or ray.init first)"
                )
                # "local": a new instance, as the warning says, never a Ray that another
                # program left running on this machine (which ray.init() would join).
                ray.init(address="local", include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        resources = ray.cluster_resources()
        cpus = int(resources.get("CPU", 0))
        super().__init__(
            int(workers) if workers is not None else max(1, cpus), counted=workers is None
        )
        self._seen_at = 0.0
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self._largest = max((int(n["Resources"].get("memory", 0)) for n in nodes), default=0)
        here = {host_name(), "127.0.0.1", "localhost", ray.util.get_node_ip_address()}
        self.one_host = all(n.get("NodeManagerAddress") in here for n in nodes)
        self._nodes = [n["NodeID"] for n in nodes]
        self._task = ray.remote(num_cpus=1, max_retries=0, retry_exceptions=False)(_ray_block)
        self.session = _session(ray)

    def connected(self) -> bool:
        """Whether the Ray instance this executor was made on still runs in this process.

        After ``ray.shutdown()`` any call into Ray ends the process at once (Ray's core
        worker exits it, with no exception to catch), so an executor whose Ray is gone
        makes none: a launch raises :class:`~tierflow.errors.TierflowError`, a cancel does
        nothing (the shutdown stopped the tasks)."""
        return bool(self._ray.is_initialized()) and _session(self._ray) == self.session

    def _refuse_unless_connected(self) -> None:
        if not self.connected():
            raise TierflowError(
                "the Ray instance this RayExecutor was made on has been shut down "
                "(ray.shutdown()); make a new executor (executor='ray' does) after ray.init"
            )

    # -- ClusterExecutor --------------------------------------------------------------

    def _send_program(self, data: bytes) -> Any:
        self._refuse_unless_connected()
        return self._ray.put(data)

    def _launch(
        self, pack: list[Any], stems: list[str | None], cap: int | None, prefer: str | None
    ) -> Any:
        need = max(int(p.need) for p in pack)
        need = min(need, self._largest) if self._largest else 0
        options: dict[str, Any] = {"memory": need} if need else {}
        if prefer is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(prefer, soft=True)
        self._refuse_unless_connected()
        task = self._task.options(**options) if options else self._task
        program = self._program(pack[0].desc.program)
        ref = task.remote([p.desc for p in pack], program, self._settings(), cap, stems)

        def landed(future: Any) -> None:
            # A cancelled attempt lands too, so that its shared-folder files go.
            error = CancelledError() if future.cancelled() else future.exception()
            self._landed(pack, ref, None if error else future.result(), error)

        ref.future().add_done_callback(landed)
        return ref

    def _cancel(self, handles: Sequence[Any]) -> None:
        if not self.connected():
            return
        for ref in handles:
            with contextlib.suppress(Exception):
                self._ray.cancel(ref, force=True)

    def _death(self, error: BaseException) -> Death | None:
        exceptions = self._ray.exceptions
        if isinstance(error, exceptions.OutOfMemoryError):
            return Death("a Ray worker", True, "Ray killed it for memory")
        if isinstance(error, (exceptions.WorkerCrashedError, exceptions.NodeDiedError)):
            return Death("a Ray worker", False, f"{type(error).__name__}")
        if isinstance(error, exceptions.TaskCancelledError):
            return None
        return None

    def _landed(self, pack: list[Any], handle: Any, outcomes: Any, error: Any) -> None:
        exceptions = self._ray.exceptions
        if isinstance(error, exceptions.RayTaskError):
            cause = getattr(error, "cause", None)
            if isinstance(cause, BaseException):
                error = cause
        super()._landed(pack, handle, outcomes, error)

    def _probe(self, paths: Sequence[str]) -> dict[str, list[str]]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._refuse_unless_connected()
        probe = self._ray.remote(_ray_probe)
        # The nodes alive now: some may have joined or left since the executor was made.
        nodes = [n["NodeID"] for n in self._ray.nodes() if n.get("Alive")] or self._nodes
        refs = [
            probe.options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(list(paths))
            for node in nodes
        ]
        return {f"on node {node[:12]}": missing for node, missing in self._ray.get(refs)}

    def _observe(self) -> None:
        """The slots of the nodes there now (at most every :data:`SEEN_EVERY` s): a
        cluster that gained or lost nodes (autoscaling) gets as many engine tasks in
        flight as it has CPUs."""
        now = perf_counter()
        if not self._counted or now - self._seen_at < SEEN_EVERY or not self.connected():
            return
        self._seen_at = now
        with contextlib.suppress(Exception):
            self._follow_slots(int(self._ray.cluster_resources().get("CPU", 0)))

    def __repr__(self) -> str:
        return f"RayExecutor(workers={self.workers})"
