"""``executor="dask"``: block tasks on a Dask distributed cluster's workers.

``tw.DaskExecutor(client)`` uses a client; ``executor="dask"`` the current one
(``distributed.get_client()``). Its task slots are the workers' threads. What it does to
the cluster, once per client (see :mod:`.cluster` for what every cluster executor
shares):

* A worker plugin named ``tierflow`` runs on every worker, now and when one (re)starts:
  it gives the worker's tierflow the budget of that worker
  (:func:`~.cluster.node_budget`: ``budget_fraction`` of the smaller of its
  ``memory_limit`` and its cgroup's memory), declares it as the worker resource
  ``tierflow-bytes`` (:data:`~.cluster.RESOURCE`), and turns off Dask's spilling in
  that worker (tierflow's blocks never sit in Dask's memory; the pause and terminate
  thresholds stay, as a backstop).
  Each block task asks for its projected bytes of that resource, so Dask runs it only
  on a worker where it fits beside the others (a task under :data:`DECLARED_SHARE` of
  the smallest worker's budget asks for nothing: see ``DaskExecutor._resources``).
  The plugin also wakes the worker's event loop less (its profiler off, its tick once a
  second): each wake takes the GIL from the task thread. And it lets the worker keep
  files' pages mapped between computes only within what Dask's pause threshold leaves
  above its budget (:func:`tierflow.storage.filemaps.keep_files`), since Dask's memory
  monitor counts mapped file pages in the worker's RSS.
* The scheduler's ``allowed-failures`` is set to 0: Dask does not send a task whose
  worker died to another at the same size; tierflow does, on halved blocks when the
  worker died of memory: its nanny restarted it for going over its limit (the
  ``worker-restart-memory`` event), or the memory it last reported (read from the
  scheduler while tasks run) was near its limit. The client's copy of a dead worker
  carries no memory figures.
* Programs are scattered once to every worker (``scatter(broadcast=True)``), and again
  after a worker died (it may have held the only copy); tasks are submitted with
  ``retries=0`` and ``pure=False``. A straggler's backup copy is sent to the workers
  that do not run it (loosely: ``allow_other_workers=True``).
* Results are fetched in batches (:class:`_Results`). Dask runs every done callback on
  one thread, one after another, and fetching a result there is a round trip to the
  worker that holds it: tasks' ends were handled one round trip at a time. The callback
  only queues its future; one thread gathers all the futures queued meanwhile at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from time import perf_counter
from typing import Any

from ....errors import TierflowError, missing_dependency
from .cluster import (
    RESOURCE,
    ClusterExecutor,
    Death,
    discard_shared,
    host_name,
    probe_files,
    run_pack,
)

__all__ = ["RESOURCE", "DaskExecutor", "current_client"]

log = logging.getLogger("tierflow.engine")

MEMORY_DEATH = 0.7  # a worker last seen above this share of its limit died of memory
RESTART_TOPIC = "worker-restart-memory"  # the event a nanny logs when it kills for memory
RESTART_EVENT_WAIT = 1.0  # seconds a death waits for that event at most
# The scheduler's events for a worker it retires (Scheduler.retire_workers) ...
RETIRE_ACTIONS = frozenset({"retire-workers", "retired"})
# ... and the reasons a worker gives for closing (its "closing-worker" event) when it was
# asked to leave: its nanny told to close (a cluster's scale(n) down, which in
# distributed 2025 closes the worker without retiring it), an adaptive deployment's
# removal, an idle timeout, a lifetime reached.
LEFT_ON_REQUEST = frozenset(
    {
        "nanny-close",
        "nanny-close-gracefully",
        "adaptive-deleted",
        "idle-timeout-exceeded",
        "worker-lifetime-reached",
    }
)
SEEN_EVERY = 0.25  # seconds between readings of the workers' reported memory
# A task declares its bytes as the worker resource when they are at least this share of
# the smallest worker's budget (see DaskExecutor._resources).
DECLARED_SHARE = 1 / 16


def current_client() -> Any:
    """The current Dask client (``distributed.get_client()``), with errors that say
    what to do."""
    return _client(None)


def _client(client: Any) -> Any:
    try:
        import distributed
    except ImportError:
        raise missing_dependency("distributed", "dask", "executor='dask'") from None
    if client is not None:
        return client
    try:
        return distributed.get_client()
    except ValueError as exc:
        raise TierflowError(
            "executor='dask' found no Dask client: start one first "
            "(from distributed import Client; client = Client() for a local cluster, or "
            "Client('tcp://scheduler:8786')), or pass tw.DaskExecutor(client)"
        ) from exc


def _outcome(future: Any) -> tuple[Any, BaseException | None]:
    if future.cancelled():  # it lands too, so that its shared-folder files go
        return None, CancelledError()
    try:
        return future.result(), None
    except BaseException as exc:
        return None, exc


Landed = Callable[[Any, BaseException | None], None]


class _Results:
    """Fetches finished tasks' results in batches, on a thread of its own.

    :meth:`put` queues a future whose task ended and what to call with its outcome
    (``landed(result, error)``; a cancelled task's error is a ``CancelledError``). The thread takes every
    future queued meanwhile and gathers the finished ones with one ``client.gather``;
    an erred future, or a batch whose gather fails (a worker lost meanwhile), is
    fetched one future at a time. ``landed`` runs on this thread."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._queue: list[tuple[Any, Landed]] = []
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, future: Any, landed: Landed) -> None:
        with self._lock:
            self._queue.append((future, landed))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tierflow-dask-results", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                batch, self._queue = self._queue, []
            if not batch and self._closed:
                return
            self._handle(batch)
            del batch  # holding a future keeps its task and result on the cluster

    def _handle(self, batch: list[tuple[Any, Landed]]) -> None:
        finished = [(f, landed) for f, landed in batch if f.status == "finished"]
        one_by_one = [(f, landed) for f, landed in batch if f.status != "finished"]
        values: list[Any] | None = None
        if finished:
            try:
                values = self.client.gather([f for f, _ in finished])
            except BaseException:  # a cancelled future too: fetched one by one
                one_by_one += finished
        if values is not None:
            for (_, landed), value in zip(finished, values, strict=True):
                _call(landed, value, None)
        for future, landed in one_by_one:
            _call(landed, *_outcome(future))


def _call(landed: Landed, result: Any, error: BaseException | None) -> None:
    try:
        landed(result, error)
    except Exception:  # the thread must go on for the other tasks
        log.exception("handling a Dask task's result failed")


class DaskExecutor(ClusterExecutor):
    """Block tasks on the workers of a Dask distributed ``client`` (default: the
    current client); ``workers``: the task slots counted (default: the workers'
    threads). See the module docstring."""

    name = "dask"

    def __init__(self, client: Any = None, *, workers: int | None = None) -> None:
        self.client = _client(client)
        info = self.client.scheduler_info(n_workers=-1)
        threads = sum(int(w.get("nthreads", 1)) for w in info["workers"].values())
        if not threads:
            raise TierflowError(
                f"the Dask cluster at {info.get('address', '?')} has no workers; start "
                "some (or wait for them: client.wait_for_workers(n))"
            )
        super().__init__(int(workers) if workers is not None else threads, counted=workers is None)
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        hosts = {w.get("host") for w in info["workers"].values()}
        self.one_host = hosts <= {"127.0.0.1", "localhost", host_name(), _my_ip()}
        self._seen: dict[str, int] = {}  # worker -> its last reported memory (bytes)
        self._seen_at = 0.0
        # The workers' threads, and the engine tasks this executor placed on each that
        # have not landed (see _spread); _placed_lock guards both.
        self._threads = _running_threads(info)
        self._placed: dict[str, int] = {}
        self._placed_lock = threading.Lock()
        self._paused: set[str] = set()  # workers seen paused (warned about once a pause)
        self._results = _Results(self.client)
        self._setup()

    def _setup(self) -> None:
        settings = self._settings()
        from .dask_worker import TierflowPlugin

        self.client.register_plugin(TierflowPlugin(settings), name="tierflow")
        with contextlib.suppress(Exception):
            self.client.run_on_scheduler(_no_engine_retries)
        info = self.client.scheduler_info(n_workers=-1)
        budgets = [int(w.get("resources", {}).get(RESOURCE, 0)) for w in info["workers"].values()]
        self._largest = max(budgets, default=0)
        self._smallest = min(budgets, default=0)

    # -- ClusterExecutor --------------------------------------------------------------

    def _send_program(self, data: bytes) -> Any:
        return self.client.scatter(data, broadcast=True, hash=False)

    def _program_lost(self, sent: Any) -> bool:
        return bool(sent.status != "finished")

    def _launch(
        self, pack: list[Any], stems: list[str | None], cap: int | None, prefer: str | None
    ) -> Any:
        # A backup copy goes to another worker than its twin's, when there is one.
        first = pack[0]
        elsewhere = self._elsewhere(list(first.handles)) if first.handles else None
        spread = None if elsewhere or prefer else self._spread()
        future = self.client.submit(
            _dask_block,
            [p.desc for p in pack],
            self._program(first.desc.program),
            self._settings(),
            cap,
            stems,
            key=f"tierflow-block-{first.desc.index}-{uuid.uuid4().hex[:12]}",
            pure=False,
            retries=0,
            resources=self._resources(max(int(p.need) for p in pack)),
            workers=elsewhere or ([prefer] if prefer else None) or ([spread] if spread else None),
            allow_other_workers=bool(elsewhere or prefer or spread),
        )

        def landed(result: Any, error: BaseException | None) -> None:
            if spread is not None:
                with self._placed_lock:
                    self._placed[spread] = self._placed.get(spread, 1) - 1
            self._landed(pack, future, result, error)

        future.add_done_callback(lambda f: self._results.put(f, landed))
        return future

    def _spread(self) -> str | None:
        """The worker with the fewest of this executor's engine tasks in flight per
        thread (None: one worker), counted as placed there.

        Dask places a task whose only input (the program) every worker holds by its
        estimate of each worker's queue, and when those tie (tasks it has no timings
        for) by the bytes each holds: all of a compute's packs went to one of two
        workers in half the computes measured, the other idle. A task placed here keeps
        ``allow_other_workers``: Dask sends it elsewhere when that worker is gone, and
        may steal it for an idle one."""
        with self._placed_lock:
            if len(self._threads) < 2:
                return None
            chosen = min(
                self._threads, key=lambda a: self._placed.get(a, 0) / max(1, self._threads[a])
            )
            self._placed[chosen] = self._placed.get(chosen, 0) + 1
            return chosen

    def _resources(self, need: int) -> dict[str, int] | None:
        """What a task projecting ``need`` bytes asks of the ``tierflow-bytes``
        resource: ``need`` (at most the largest worker's), or nothing when it is under
        :data:`DECLARED_SHARE` of the smallest worker's budget. A task that small fits
        any worker beside the others the driver sends it (and the worker's own tierflow
        admits it against its budget); declaring it would only send it through Dask's
        resource accounting, which work stealing unbalances (used resources seen
        drifting apart between workers, and a worker left idle)."""
        if not self._largest or need < DECLARED_SHARE * self._smallest:
            return None
        return {RESOURCE: min(need, self._largest)}

    def _elsewhere(self, handles: Sequence[Any]) -> list[str] | None:
        """The workers that run none of ``handles`` (None: every worker runs one, or
        the scheduler did not say)."""
        keys = {h.key for h in handles}
        with contextlib.suppress(Exception):
            processing = self.client.processing()
            others = [w for w, running in processing.items() if not keys & set(running)]
            if others and len(others) < len(processing):
                return others
        return None

    def _cancel(self, handles: Sequence[Any]) -> None:
        with contextlib.suppress(Exception):
            self.client.cancel(list(handles), force=True)

    def close(self) -> None:
        super().close()
        self._results.close()

    def _death(self, error: BaseException) -> Death | None:
        from distributed.scheduler import KilledWorker

        if isinstance(error, CancelledError):
            # Not by this executor (it cancels only attempts whose task has ended): the
            # scheduler dropped it when the only workers holding its program died.
            self._forget_programs()
            return Death("?", False, "Dask dropped it: the workers holding its program died")
        if not isinstance(error, KilledWorker):
            return None
        # The client's copy of the worker's state has no metrics: what it used comes
        # from its nanny's restart event, or from what this executor last saw.
        # The dead worker may have held the only copy of a program; the client learns
        # that later than this, so they are scattered again.
        self._forget_programs()
        ws = error.last_worker
        address = str(getattr(ws, "address", "?"))
        if self._retired(address):
            return Death(address, False, "it retired: the cluster was scaled down", retired=True)
        limit = int(getattr(ws, "memory_limit", 0) or 0)
        if not limit:
            return Death(address, False, "it died (it had no memory limit)")
        restarted = self._restarted_for_memory(address)
        if restarted is not None:
            why = f"its nanny restarted it at {restarted >> 20} MB of its {limit >> 20} MB limit"
            return Death(address, True, why)
        seen = self._seen.get(address)
        if seen is None:
            return Death(address, False, "it died before this compute saw its memory")
        why = f"its last reported memory was {seen >> 20} MB of its {limit >> 20} MB limit"
        return Death(address, seen >= MEMORY_DEATH * limit, why)

    def _retired(self, address: str) -> bool:
        """Whether worker ``address`` left on request (see :data:`LEFT_ON_REQUEST`):
        Dask reports the tasks it was running as killed all the same. Not when its
        nanny restarted it for memory."""
        if self._restart_event(address) is not None:
            return False
        with contextlib.suppress(Exception):
            for _, event in self.client.get_events(address):
                if not isinstance(event, dict):
                    continue
                if event.get("action") in RETIRE_ACTIONS or (
                    event.get("action") == "closing-worker"
                    and event.get("reason") in LEFT_ON_REQUEST
                ):
                    return True
        return False

    def _restarted_for_memory(self, address: str) -> int | None:
        """The memory at which the nanny of worker ``address`` restarted it for going
        over its limit (its ``worker-restart-memory`` event), or None. The event may
        reach the scheduler just after the worker's death does: asked a few times."""
        for wait in (0.0, *[RESTART_EVENT_WAIT / 4] * 4):
            if wait:
                threading.Event().wait(wait)
            event = self._restart_event(address)
            if event is not None:
                return int(event.get("rss", 0))
        return None

    def _restart_event(self, address: str) -> dict[str, Any] | None:
        """The nanny's event of restarting worker ``address`` for memory, if the
        scheduler has it now."""
        with contextlib.suppress(Exception):
            for _, event in self.client.get_events(RESTART_TOPIC):
                if isinstance(event, dict) and event.get("worker") == address:
                    return event
        return None

    def _observe(self) -> None:
        """Note each worker's reported memory (at most every :data:`SEEN_EVERY` s), and
        the slots of the workers there now: a cluster scaled up or down (an adaptive
        deployment) gets as many engine tasks in flight as it has threads."""
        now = perf_counter()
        if now - self._seen_at < SEEN_EVERY:
            return
        self._seen_at = now
        with contextlib.suppress(Exception):
            info = self.client.scheduler_info(n_workers=-1)
            for address, w in info["workers"].items():
                memory = w.get("metrics", {}).get("memory")
                if memory is not None:
                    self._seen[str(address)] = int(memory)
            threads = _running_threads(info)
            with self._placed_lock:
                self._threads = threads
            self._note_paused(info["workers"])
            self._follow_slots(sum(int(w.get("nthreads", 1)) for w in info["workers"].values()))

    def _note_paused(self, workers: dict[str, Any]) -> None:
        """Log a warning, once per pause, about each worker Dask paused: it runs nothing
        until its memory falls below Dask's pause threshold, and a compute whose tasks
        wait there waits with it (Dask neither fails nor moves them). New engine tasks
        are placed on the running workers meanwhile (:meth:`_spread`)."""
        paused = {str(a) for a, w in workers.items() if w.get("status") == "paused"}
        for address in sorted(paused - self._paused):
            w = workers[address]
            used = int(w.get("metrics", {}).get("memory") or 0)
            limit = int(w.get("memory_limit") or 0)
            of = f" of its {limit >> 20} MB limit" if limit else ""
            log.warning(
                "Dask paused worker %s (its process uses %d MB%s; Dask pauses a worker past "
                "distributed.worker.memory.pause, 80 %% by default): it runs no task until "
                "that falls, and tierflow places no new task there. Memory the worker's own "
                "code keeps (not tierflow's blocks) is the usual cause; restart the worker "
                "or give it a bigger memory_limit",
                address,
                used >> 20,
                of,
            )
        self._paused = paused

    def _probe(self, paths: Sequence[str]) -> dict[str, list[str]]:
        found = self.client.run(probe_files, list(paths))
        return {str(k): list(v) for k, v in found.items()}

    def __repr__(self) -> str:
        return f"DaskExecutor(workers={self.workers}, scheduler={self.client.scheduler.address})"


def _running_threads(info: dict[str, Any]) -> dict[str, int]:
    """The threads of each worker in ``scheduler_info()`` that runs tasks now (not
    paused, closing or retiring)."""
    return {
        str(a): int(w.get("nthreads", 1))
        for a, w in info["workers"].items()
        if w.get("status", "running") == "running"
    }


def _dask_block(
    descs: Any, data: bytes, settings: tuple[tuple[str, Any], ...], cap: Any, stems: Any
) -> Any:
    """Block tasks in a Dask worker: :func:`run_pack`, whose shared-folder blocks are
    deleted when the task was cancelled while it ran (its result goes nowhere)."""
    outcomes = run_pack(descs, data, settings, cap, stems)
    if _cancelled():
        discard_shared(outcomes)
    return outcomes


def _cancelled() -> bool:
    """Whether the client cancelled the task this worker thread runs."""
    from distributed import get_worker

    with contextlib.suppress(Exception):
        worker = get_worker()
        state = worker.state.tasks.get(worker.get_current_task())
        return state is None or state.state in ("cancelled", "released", "forgotten")
    return False


def _no_engine_retries(dask_scheduler: Any) -> None:
    dask_scheduler.allowed_failures = 0


def _my_ip() -> str:
    import socket

    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"
