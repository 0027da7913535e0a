"""The ``"processes"`` executor: block tasks on a pool of spawned worker processes.

A function written in plain Python holds the GIL, so threads run it one at a time.
Worker processes run it on every core. Block tasks travel as data
(:class:`~tierflow.engine.program.tasks.BlockTask`): the pool sends each worker a pass's
program once, then only ``(program hash, block index, rows)`` per task; a worker
reads its rows from the sources by path, and sends back partial results by value (and
the blocks of results held in the driver's RAM); a ``.npy`` file's rows it writes in
place. The driver (the process that called ``compute``) keeps the order, admission,
the combining of partials, and runs its own small tasks (finishing a reduction,
committing a file) on one thread of its own::

    driver: scheduler ──BlockTask──▶ worker 0: run_task ──BlockResult──▶ driver
                      ──BlockTask──▶ worker 1: ...        (partials, held blocks)

The pool is persistent: it starts with the first block task of the process and serves
every later compute that asks for the same number of workers, so a compute does not
pay the start of the workers (about half a second each, which they spend importing
NumPy and tierflow). Each worker runs with its share of the driver's RAM budget
(``budget / workers``) and the driver's spill and store folders. Workers ignore
SIGINT: a KeyboardInterrupt reaches the driver, whose scheduler cancels the compute;
cancelling kills the workers that were running its tasks (they are started afresh for
the next compute), so nothing keeps running.

A worker that dies while running a task (killed by the kernel's OOM killer, a
``SIGKILL``, a crash in native code) is replaced and its tasks are sent again. The death
counts against the task it was running, not against those queued behind it: after
:data:`TRIES` deaths a task fails with :class:`WorkerDied`. Several computes may share
the pool (threads of one process); one that fails or is interrupted cancels only its own
tasks. A worker never queues a task behind another compute's: that task could be long,
and a free worker would wait beside it; the task waits in the pool until a worker is free
or runs only its own compute's tasks. How no outcome is ever lost is in :class:`_Pool`'s
docstring.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from time import perf_counter
from typing import Any

import cloudpickle

from .... import config
from ....errors import PortabilityError, TierflowError
from ....system import budget as budget_module
from ....system import processes
from ...program import tasks as tasks_module
from ...types import Done
from .local import ThreadExecutor, default_workers, mark_running_tasks

__all__ = ["TRIES", "ProcessExecutor", "RemoteError", "WorkerDied", "shutdown_pools"]

log = logging.getLogger("tierflow.engine")

TRIES = 3  # times a task is sent before the deaths of its workers fail it
RUNTIME_KEEP = 64  # programs a worker keeps, least recently used dropped first
KNOWN_PROGRAMS = 32  # programs the driver counts on a worker having (fewer: a margin)
_SETTINGS = ("spill_dir", "store_dir", "proc_root")  # passed on to workers as they are
SWEEP_SECONDS = 0.5  # how often the pids of the workers are checked for a death unseen
_DRAIN = object()  # on the resend queue: send what waits in the backlog, if it has room now


class WorkerDied(TierflowError, RuntimeError):
    """A worker process died each time it ran a task."""


class RemoteError(TierflowError, RuntimeError):
    """An error raised in a worker process that could not be sent back as itself; its
    message holds the worker's traceback."""


def _wire_error(exc: BaseException) -> tuple[bytes | None, str]:
    """``exc`` and the causes chained to it, pickled (None if they do not survive a
    round trip: pickling keeps no ``__cause__``), and the traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and len(chain) < 8:
        chain.append(link)
        link = link.__cause__
    try:
        data = cloudpickle.dumps(chain)
        pickle.loads(data)
    except Exception as why:
        return None, f"{text}(it does not pickle: {type(why).__name__}: {why})\n"
    return data, text


def _unwire_error(data: bytes | None, text: str) -> BaseException:
    if data is not None:
        with contextlib.suppress(Exception):
            chain: list[BaseException] = pickle.loads(data)
            for outer, inner in itertools.pairwise(chain):
                outer.__cause__ = inner
            exc = chain[0]
            if hasattr(exc, "add_note"):
                exc.add_note(f"raised in a tierflow worker process:\n{text}")
            return exc
    return RemoteError(f"a worker process raised an error that cannot be sent back:\n{text}")


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
    """A worker's loop: receive ``(tid, desc, program bytes, settings)``, run, reply."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A crash in native code, or a SIGABRT sent to see where a worker hangs, prints
    # every thread's stack on the worker's standard error.
    with contextlib.suppress(Exception):
        faulthandler.enable(all_threads=True)
    mark_running_tasks()  # a compute started inside a task runs serially, here
    runtime = tasks_module.Runtime(RUNTIME_KEEP)
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        tid, desc, data, settings = message
        start = perf_counter()
        try:
            if settings is not None:
                config.set(**dict(settings))
        except Exception:
            log.warning("a worker could not take the driver's settings", exc_info=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if data is not None:
                    runtime.add(desc.program, data)
                result = tasks_module.run_task(desc, runtime)
            reply = ("ok", tid, result, perf_counter() - start, _wire_warnings(caught))
            try:
                conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise PortabilityError(
                    f"block {desc.index}'s result cannot be sent back from a worker process: "
                    f"{type(exc).__name__}: {exc}. Results must pickle (a reduction's "
                    "partials, blocks of a custom dtype); run it with executor='threads'"
                ) from exc
        except BaseException as exc:
            conn.send(("error", tid, *_wire_error(exc)))


def _wire_warnings(caught: list[warnings.WarningMessage]) -> tuple[tuple[Any, ...], ...]:
    """The warnings a task raised, as (category, message, filename, lineno) that pickle."""
    found = []
    for w in caught:
        category = w.category
        try:
            pickle.dumps(category)
        except Exception:
            category = UserWarning
        found.append((category, str(w.message), str(w.filename), int(w.lineno)))
    return tuple(found)


class _Worker:
    """One worker process and what the driver knows of it."""

    def __init__(self, context: Any, number: int) -> None:
        here, there = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main, args=(there,), name=f"tierflow-worker-{number}", daemon=True
        )
        with _main_left_behind():
            self.process.start()
        there.close()
        # Its start time, so that a death is seen from the pid alone (see _Pool.sweep).
        self.start = processes.start_time(self.process.pid or 0) or processes.UNKNOWN
        self.ready = False  # it has said it is running
        self.conn = here
        # Hashes of the programs it holds, least recently used first: the worker's
        # runtime keeps more (RUNTIME_KEEP) in the same order, so all of these are there.
        self.programs: tasks_module.LRU[str, None] = tasks_module.LRU(KNOWN_PROGRAMS)
        self.settings: tuple[tuple[str, Any], ...] | None = None
        # Tasks sent and not answered, in the order sent: the worker runs them in that
        # order, so the first is the one running.
        self.inflight: dict[int, _Pending] = {}
        self.send_lock = threading.Lock()
        self.retired = False  # killed on purpose (a cancelled compute), not to be mourned
        self.mourned = False  # its death has been dealt with (guarded by the pool's lock)

    def has_ended(self) -> bool:
        """Whether the process has exited (a zombie counts), however its end is seen."""
        pid = self.process.pid
        return pid is None or not processes.may_be_running(pid, self.start)

    def kill(self) -> None:
        self.retired = True
        with contextlib.suppress(Exception):
            self.process.kill()
        self.process.join(timeout=10)
        with contextlib.suppress(Exception):
            self.conn.close()


_main_lock = threading.Lock()


@contextlib.contextmanager
def _main_left_behind() -> Any:
    """Start a spawned worker without running the driver's ``__main__`` in it.

    ``multiprocessing`` re-runs the main script (or module) in a spawned child so that
    functions defined there can be found by name. Workers do not need that: cloudpickle
    sends ``__main__``'s functions by value. Running it could even start the user's
    compute again in every worker (a script without ``if __name__ == "__main__"``), or
    fail (``python -``, a notebook). So the main module hides its file and spec while
    a worker starts."""
    main = sys.modules.get("__main__")
    with _main_lock:
        if main is None:
            yield
            return
        saved: dict[str, Any] = {
            k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
        }
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class _Owner:
    """The compute a task belongs to (one per :class:`ProcessExecutor`); once cancelled,
    its tasks are dropped wherever they are met."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False


class _Pending:
    """A task in the pool: what to run, whom to tell, whose it is, and how many times a
    worker died while running it."""

    __slots__ = ("deaths", "desc", "done", "owner")

    def __init__(self, desc: tasks_module.BlockTask, done: Done, owner: _Owner) -> None:
        self.desc = desc
        self.done = done
        self.owner = owner  # the executor (one compute) that submitted it
        self.deaths = 0


def _died(how: str, pending: _Pending) -> WorkerDied:
    return WorkerDied(
        f"a worker process died ({how}) each of the {pending.deaths} times it ran block "
        f"{pending.desc.index}; the operator may crash the process, or the machine runs "
        "out of memory (the kernel's OOM killer): lower the RAM budget or the block size, "
        "or run with executor='threads' to see the error"
    )


class _Pool:
    """``size`` spawned workers, the thread that receives their replies, and the thread
    that sends again the tasks of workers that died.

    No outcome is lost. Every task is in the pool's ``backlog`` or in exactly one
    worker's ``inflight`` until its reply comes, its worker's death sends it again (or
    fails it), or its own compute cancels it. Tasks leave the backlog first come first,
    each to the least busy worker that is free or holds only tasks of its own compute
    (its scheduler bounds how many); the first waits, and those behind it, until a
    reply, a death or a cancel makes room (:meth:`_drain`). A death is seen three ways,
    whichever comes first: the process's sentinel, the end of its pipe, and a sweep of
    the workers' pids every :data:`SWEEP_SECONDS` (a worker's pipe or sentinel can
    outlive it: a process it started keeps them open). The receiving thread never sends
    (a worker blocked on a full pipe would wait for it) and never dies of an error;
    resends go through the resending thread.

    A death is charged to the task the worker was running (the first sent); the tasks
    queued behind it are sent again uncharged. Cancelling a compute kills only the
    workers holding its tasks and sends the other computes' tasks there again.

    ``_lock`` guards ``_workers``, ``_backlog``, every worker's ``inflight`` and
    ``mourned``; a worker's ``send_lock`` orders the messages sent to it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._numbers = itertools.count()
        self._tids = itertools.count()
        self._wake_r, self._wake_w = self._context.Pipe(duplex=False)
        self._backlog: collections.deque[_Pending] = collections.deque()
        self._resends: queue.SimpleQueue[Any] = queue.SimpleQueue()  # _Pending, _DRAIN, None
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.shipped = 0  # programs sent to workers (each once per worker)

    # -- workers ----------------------------------------------------------------------

    def _fill(self) -> None:
        """Start workers up to ``size``. Caller holds ``_lock``."""
        started = False
        while len(self._workers) < self.size:
            self._workers.append(_Worker(self._context, next(self._numbers)))
            started = True
        if not self._threads:
            for target, name in (
                (self._receive, "tierflow-process-results"),
                (self._resend_loop, "tierflow-process-resends"),
            ):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        elif started:
            self._wake_w.send_bytes(b"w")

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        share = max(1, budget_module.budget_bytes() // self.size)
        return (("ram_budget", share), *((n, config.get(n)) for n in _SETTINGS))

    # -- sending ----------------------------------------------------------------------

    def submit(self, desc: tasks_module.BlockTask, done: Done, owner: _Owner) -> None:
        if self._closed:
            raise RuntimeError("the process pool was shut down")
        self._send(_Pending(desc, done, owner))

    def _send(self, pending: _Pending) -> None:
        """Queue ``pending`` behind the tasks waiting in the backlog, and send what has
        room."""
        with self._lock:
            self._backlog.append(pending)
        self._drain()

    def _drain(self) -> None:
        """Send the backlog's tasks, first come first, while a worker has room for one."""
        while True:
            with self._lock:
                if not self._backlog:
                    return
                self._fill()
                placed = self._place()
            if placed is None:
                return
            self._transmit(*placed)

    def _place(self) -> tuple[_Worker, int, _Pending] | None:
        """Take the backlog's first task if a worker has room for it (free, or holding
        only tasks of its compute), into the least busy such worker's ``inflight``.
        First come first: a compute's tasks never overtake another's that waits, so
        neither starves the other. Caller holds ``_lock``."""
        backlog = self._backlog
        while backlog and backlog[0].owner.cancelled:
            backlog.popleft()  # its compute has ended
        if not backlog:
            return None
        owner = backlog[0].owner
        fits = [w for w in self._workers if all(p.owner is owner for p in w.inflight.values())]
        if not fits:
            return None
        pending = backlog.popleft()
        worker = min(fits, key=lambda w: len(w.inflight))
        tid = next(self._tids)
        worker.inflight[tid] = pending
        return worker, tid, pending

    def _transmit(self, worker: _Worker, tid: int, pending: _Pending) -> None:
        """Send ``pending`` to ``worker``. A task that cannot be pickled fails; one whose
        worker died on the way is the death's to send again."""
        desc = pending.desc
        settings = self._settings()
        with worker.send_lock:
            known = worker.programs
            data = None
            if desc.program not in known:
                data = tasks_module.program_bytes(desc.program)
            changed = settings if settings != worker.settings else None
            try:
                message = ForkingPickler.dumps((tid, desc, data, changed))
            except Exception as exc:
                with self._lock:
                    worker.inflight.pop(tid, None)
                pending.done(
                    None,
                    PortabilityError(
                        f"block {desc.index}'s task cannot be sent to a worker process: "
                        f"{type(exc).__name__}: {exc}. Run it with executor='threads'"
                    ),
                )
                return
            try:
                worker.conn.send_bytes(message)
            except (OSError, ValueError):
                return  # it died (or was closed): its death sends the task again
            known[desc.program] = None  # the most recent now
            worker.settings = settings
            if data is not None:
                self.shipped += 1

    def _resend_loop(self) -> None:
        """The resending thread: the tasks of dead workers go out again from here."""
        while True:
            pending = self._resends.get()
            if pending is None:
                return
            if pending is _DRAIN:
                try:
                    self._drain()
                except Exception:  # a task's own failure is told to it; never give up
                    log.debug("the process pool could not send its backlog", exc_info=True)
                continue
            if pending.owner.cancelled:
                continue
            try:
                if self._closed:
                    raise RuntimeError("the process pool was shut down")
                self._send(pending)
            except BaseException as exc:
                pending.done(None, exc)

    # -- receiving --------------------------------------------------------------------

    def _receive(self) -> None:
        """The receiving thread: replies to ``done``, dead workers replaced."""
        next_sweep = perf_counter() + SWEEP_SECONDS
        while not self._closed:
            try:
                self._receive_once()
                if perf_counter() >= next_sweep:
                    next_sweep = perf_counter() + SWEEP_SECONDS
                    self.sweep()
            except Exception:  # a connection closed under it, say: never give up
                log.debug("the process pool's receiving thread met an error", exc_info=True)
                threading.Event().wait(0.05)

    def _receive_once(self) -> None:
        with self._lock:
            workers = [w for w in self._workers if not w.mourned]
        by_conn = {w.conn: w for w in workers if not w.conn.closed}
        by_sentinel = {w.process.sentinel: w for w in workers}
        ready = multiprocessing.connection.wait(
            [self._wake_r, *by_conn, *by_sentinel], timeout=SWEEP_SECONDS
        )
        for item in ready:
            if item is self._wake_r:
                with contextlib.suppress(EOFError, OSError):
                    self._wake_r.recv_bytes()
            elif item in by_conn:
                self._reply(by_conn[item])
            else:
                self._mourn(by_sentinel[item], exited=True)

    def sweep(self) -> None:
        """Mourn every worker whose process has ended though neither its sentinel nor its
        pipe said so."""
        with self._lock:
            workers = [w for w in self._workers if not w.mourned]
        for worker in workers:
            if worker.has_ended():
                self._mourn(worker, exited=False)

    def _reply(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            return  # the sentinel tells the rest
        except Exception as exc:  # a reply that does not unpickle here
            log.debug("a worker's reply could not be read", exc_info=True)
            message = ("error", None, None, f"{type(exc).__name__}: {exc}")
        if message[0] == "ready":
            worker.ready = True
            return
        tid = message[1]
        with self._lock:
            pending = worker.inflight.pop(tid, None) if tid is not None else None
            if pending is None and tid is None and worker.inflight:
                # Which task it was is lost with the reply: fail the one it was running.
                pending = worker.inflight.pop(next(iter(worker.inflight)))
        if pending is None:
            return  # cancelled meanwhile
        if self._backlog:
            self._resends.put(_DRAIN)  # room on this worker: never sent from this thread
        if message[0] == "ok":
            try:  # the task's warnings, at the lines that raised them
                tasks_module.reissue(pending.desc, message[4])
            except Exception as exc:  # a filter made one an error: the task's error
                pending.done(None, exc)
                return
            pending.done((message[2], message[3]), None)
        else:
            pending.done(None, _unwire_error(message[2], message[3]))

    def _mourn(self, worker: _Worker, *, exited: bool) -> None:
        """``worker`` died: replace it, send its tasks again or fail them. ``exited``:
        its sentinel says the process is gone (else the sweep found it ended)."""
        with self._lock:
            if worker.mourned:
                return
            worker.mourned = True
            if worker in self._workers:
                self._workers.remove(worker)
            orphans = list(worker.inflight.values())
            worker.inflight.clear()
            if orphans and not self._closed:
                self._fill()
        # The exit status; a sentinel held open by a process the worker started never
        # comes, so the sweep waits for it only a moment.
        worker.process.join(timeout=10 if exited else 1)
        code = worker.process.exitcode
        with contextlib.suppress(Exception):
            worker.conn.close()
        how = (
            "exit status unknown"
            if code is None
            else f"signal {-code}"
            if code < 0
            else f"exit status {code}"
        )
        if not worker.retired:
            log.warning("tierflow worker %s died (%s)", worker.process.name, how)
        for k, pending in enumerate(orphans):
            if pending.owner.cancelled:
                continue
            if not worker.ready:
                pending.done(
                    None,
                    WorkerDied(
                        f"a worker process could not start ({how}); its error is on this "
                        "process's standard error. Run with executor='threads' meanwhile"
                    ),
                )
                continue
            if k == 0 and not worker.retired:
                pending.deaths += 1  # the task it was running
            if pending.deaths >= TRIES:
                pending.done(None, _died(how, pending))
            else:
                self._resends.put(pending)
        if self._backlog:
            self._resends.put(_DRAIN)  # its replacement has room

    # -- stopping ---------------------------------------------------------------------

    def cancel(self, owner: _Owner) -> None:
        """Drop the tasks of ``owner`` (one compute) and kill the workers holding them,
        so that none of them runs on; the other computes' tasks on those workers are
        sent again."""
        owner.cancelled = True
        with self._lock:
            doomed = [
                w for w in self._workers if any(p.owner is owner for p in w.inflight.values())
            ]
            others: list[_Pending] = []
            for w in doomed:
                others.extend(p for p in w.inflight.values() if p.owner is not owner)
                w.inflight.clear()
                self._workers.remove(w)
            kept = [p for p in self._backlog if p.owner is not owner]
            self._backlog.clear()
            self._backlog.extend(kept)
        for w in doomed:
            w.kill()
        for pending in others:
            self._resends.put(pending)
        self._resends.put(_DRAIN)  # workers started afresh have room

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._workers = self._workers, []
            left = [*self._backlog, *(p for w in workers for p in w.inflight.values())]
            self._backlog.clear()
            for w in workers:
                w.inflight.clear()
        for w in workers:
            with contextlib.suppress(Exception), w.send_lock:
                w.conn.send(None)
        for w in workers:
            w.process.join(timeout=5)
            if w.process.is_alive():
                w.kill()
        for pending in left:
            pending.done(None, RuntimeError("the process pool was shut down"))
        self._resends.put(None)
        with contextlib.suppress(Exception):
            self._wake_w.send_bytes(b"x")
        for thread in self._threads:
            thread.join(timeout=5)

    def pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in self._workers if w.process.pid is not None]


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()


def _pool(size: int) -> _Pool:
    with _pools_lock:
        found = _pools.get(size)
        if found is None or found._closed:
            found = _pools[size] = _Pool(size)
        return found


@atexit.register
def shutdown_pools() -> None:
    """Stop every worker process of this process's pools (run at exit)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for p in pools:
        p.close()


class ProcessExecutor:
    """Block tasks on ``workers`` worker processes (default: the usable cores); the
    driver's own tasks on one thread here. See the module docstring."""

    name = "processes"

    def __init__(self, workers: int | None = None) -> None:
        self.workers = int(workers) if workers is not None else default_workers()
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._local = ThreadExecutor(1, prefix="tierflow-driver")
        self._pool = _pool(self.workers)
        self._owner = _Owner()

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        self._local.submit(fn, done)

    def submit_task(self, desc: tasks_module.BlockTask, done: Done) -> None:
        self._pool.submit(desc, done, self._owner)

    def shutdown(self, *, cancel: bool = False) -> None:
        if cancel:
            self._pool.cancel(self._owner)
        self._local.shutdown(cancel=cancel)

    @property
    def shipped(self) -> int:
        """How many times a program was sent to a worker (once per worker and program,
        unless the worker was replaced or dropped it)."""
        return self._pool.shipped

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes (none before the first block task)."""
        return self._pool.pids()

    def __repr__(self) -> str:
        return f"ProcessExecutor(workers={self.workers})"


def _reset_after_fork() -> None:  # a forked child must not use its parent's workers
    _pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
