"""What the Dask and Ray executors share: tierflow drives, the cluster lends task slots.

tierflow stays the driver (the process that called ``compute``): it plans, admits,
orders, and combines partials. A cluster engine is a pool of task slots that runs block
tasks described as data (:class:`~tierflow.engine.program.tasks.BlockTask`), through
:func:`run_block` in its worker processes::

    driver: scheduler ──BlockTask + program ref──▶ Dask / Ray ──▶ worker: run_block
                      ◀── BlockResult (partials, small blocks; big ones by path) ──

* **Through the engine:** only task descriptions, the program once per worker (Dask's
  ``scatter(broadcast=True)``, Ray's object store), and small results: partials, and
  blocks under :data:`~tierflow.engine.program.roots.SHARED_MIN`. A bigger block the driver
  holds is written by the worker to the shared folder and travels by path
  (:class:`~tierflow.engine.program.roots.SharedBlock`); a ``.npy`` output's rows are written
  by the workers in place.
* **Memory per slot:** each task declares its projected bytes to the engine (the Dask
  resource :data:`RESOURCE`, Ray's ``memory``), counted against the budget of the
  worker that runs it; the worker's own tierflow runs with that worker's budget. The
  driver does not count block tasks that run elsewhere against its own RAM.
* **Retries are tierflow's** (the engine's own are turned off): a task whose worker
  died is sent again, up to :data:`TRIES` times; when it died of memory, on halved
  blocks (every operator of its program is capped at half the rows that died, in the
  worker, and the size that worked is used for every later task of the program). A
  ``MemoryError`` inside a worker is halved there, as in a local run.
* **Stragglers get a backup copy**: once at least :data:`STRAGGLER_MIN_TASKS` tasks of a
  pass are known, at least half of them done, a task running over
  :data:`STRAGGLER_FACTOR` times their median (as the workers timed them), and over
  :data:`STRAGGLER_MIN_SECONDS`, gets a second copy; the first result wins. A task's
  clock starts when it is among the oldest ``workers`` tasks not done (the engine runs
  tasks about in the order they were sent; the younger ones wait in its queue).
  Duplicates are harmless: a file's rows are the same bytes, a partial is counted once,
  and the shared block of the copy that lost is deleted, as is one that comes back
  after its compute was stopped.
* **Short tasks travel in packs** (:data:`PACK_TASK_SECONDS`): several block tasks of a
  pass run one after another as one engine task (:func:`run_pack`), each with its own
  outcome, error, retry and shared-folder stem. A pack whose worker died has each task
  sent again alone; a backup copy is sent alone, and the pack carrying its twin runs on.
* **Attempts are launched on a thread of their own**, never on the computing thread,
  so that a Ctrl-C there cannot fall between an engine's submit and the driver's record
  of the attempt. A stop waits for an attempt on its way and cancels it with the
  others; no attempt is launched for a task that has ended (an engine told to run a
  task and to cancel it at once may run it all the same).
* **Sources are probed**: before a program's first task, every node checks that it sees
  each file the program reads; a compute whose source a node cannot see is refused, with
  the file and the worker named.

Subclasses (:mod:`.dask`, :mod:`.ray`) say how a task is launched and cancelled, how a
death is told apart from an error, and how a program reaches the workers.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import statistics
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from .... import config
from ....errors import SourceError, TierflowError
from ....storage import intermediates
from ...program import tasks as tasks_module
from ...program.roots import SharedBlock
from ...types import Done
from .local import ThreadExecutor, running_task

__all__ = [
    "RESOURCE",
    "STRAGGLER_FACTOR",
    "STRAGGLER_MIN_SECONDS",
    "STRAGGLER_MIN_TASKS",
    "TRIES",
    "ClusterExecutor",
    "Death",
    "WorkerLost",
    "discard_shared",
    "probe_files",
    "run_block",
    "run_pack",
]

log = logging.getLogger("tierflow.engine")

# The Dask worker resource a block task asks for its projected bytes of, and that the
# worker plugin declares as its budget (Ray's tasks ask for Ray's own ``memory``).
RESOURCE = "tierflow-bytes"
TRIES = 4  # times a task is sent before the deaths of its workers fail it
STRAGGLER_MIN_TASKS = 10  # tasks of a pass before a straggler gets a backup copy ...
STRAGGLER_DONE = 0.5  # ... at least this share of them done ...
STRAGGLER_FACTOR = 3.0  # ... and it has run this many times their median ...
STRAGGLER_MIN_SECONDS = 1.0  # ... and this long (a copy of a shorter task gains nothing)
WATCH_SECONDS = 0.1  # how often the driver looks for stragglers
GRAVE_SWEEP_SECONDS = 2.0  # a stopped attempt's files are removed again after this ...
GRAVE_SECONDS = 60.0  # ... every as long again, and at every submit, for this long
# Tasks whose median time (as the workers timed the program's recent ones) is under
# PACK_TASK_SECONDS are sent in packs: several block tasks of the program run one after
# another as one engine task, at most about PACK_SECONDS of work and PACK_MAX of them. An
# engine's own cost per task (Dask's scheduler: about 2.5 ms on 2 cores, which the
# workers share with it on one machine) would otherwise be much of such a task's time: a
# 32 MB block of a compiled column sum takes 4 ms.
PACK_TASK_SECONDS = 0.03
PACK_SECONDS = 0.12
PACK_MAX = 16
PACK_WINDOW = 32  # the recent tasks whose times decide
# Engine tasks (packs or single tasks) in flight per slot, at most: one running and one
# queued behind it. The others wait in the driver, where they can still be packed, and
# are handed out as slots free up: an engine that was given every task at once (Dask
# places a task that asks for a resource at once) could not move them to a slot that
# finished early.
ENGINE_TASKS_PER_SLOT = 2
PROGRAMS_KEPT = 32  # programs kept on the cluster per executor, least recent dropped
READ_BY_KEPT = 100_000  # blocks whose reader is remembered, least recent dropped
# Settings the driver passes to its workers: the store folder, beside which the store's
# signing key lives (a cache's entries are trusted only under the driver's key), and the
# storage options of a shared_dir URL. Each worker keeps its own node's spill folder
# (TIERFLOW_SPILL_DIR there); the rest that must be shared travels by path or URL:
# sources, outputs, cache entries, shared blocks.
_SETTINGS: tuple[str, ...] = ("store_dir", "shared_options")


class WorkerLost(TierflowError, RuntimeError):
    """A cluster worker died each time it ran a task (or could not run it)."""


@dataclass(frozen=True)
class Death:
    """How a task's worker died: ``memory`` when it ran out of memory (the engine said
    so, or its last reported memory was near its limit); ``worker`` names it.
    ``retired``: it did not die but left the cluster on request (scaled down, an
    adaptive deployment's retirement): its tasks are sent again, not counted as tries."""

    worker: str
    memory: bool
    why: str
    retired: bool = False


# -- in the worker ----------------------------------------------------------------------

_runtime_lock = threading.Lock()
_runtime: tasks_module.Runtime | None = None
_applied: dict[str, Any] = {}
_capture = threading.local()  # .caught: the list the running task's warnings go to
here: str | None = None  # this worker's machine, as its engine names it (set by its hook)


def _worker_runtime() -> tasks_module.Runtime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = tasks_module.Runtime(64)
            original = warnings.showwarning

            def show(
                message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any
            ) -> None:
                caught = getattr(_capture, "caught", None)
                if caught is None:
                    original(message, category, filename, lineno, *args, **kwargs)
                else:
                    caught.append((category, str(message), str(filename), int(lineno)))

            warnings.showwarning = show
        return _runtime


def _forget_warnings_shown() -> None:
    """Let the next task's warnings be shown again (and so reach the driver).

    A worker process outlives its tasks, and Python's default filter shows a warning
    once per place in a process: a later compute's would be dropped here. Leaving a
    ``catch_warnings()`` block puts the filters back as they were and bumps their
    version, which empties every module's record of what was shown when it is next
    consulted. The driver applies its own filters to what comes back."""
    with warnings.catch_warnings():
        pass


def _apply(settings: tuple[tuple[str, Any], ...]) -> None:
    """The driver's settings (and this worker's budget), applied once each."""
    changed = {k: v for k, v in settings if _applied.get(k, _applied) != v}
    if changed:
        with _runtime_lock:
            config.set(**changed)
            _applied.update(changed)


def run_block(
    desc: tasks_module.BlockTask,
    data: bytes,
    settings: tuple[tuple[str, Any], ...],
    cap: int | None,
    shared: str | None,
) -> tuple[Any, float, tuple[tuple[Any, ...], ...], str | None]:
    """Run block task ``desc`` in a cluster worker: ``(BlockResult, seconds, warnings,
    where)``, ``where`` naming the worker (its engine's name for it: a Dask worker's
    host, a Ray node's id), so that later tasks on the same rows can prefer it.

    ``data`` is the pickled program (kept by hash: unpickled once per worker process),
    ``settings`` the driver's folders and this worker's budget, ``cap`` the rows every
    operator is called on at most (after a worker died of memory on this program), and
    ``shared`` the folder bigger held blocks are written to."""
    _apply(settings)
    program = _program_here(desc.program, data)
    if cap is not None:
        program.cap_rows(cap)
    caught: list[tuple[Any, ...]] = []
    _capture.caught = caught
    _forget_warnings_shown()
    start = perf_counter()
    try:
        with running_task():  # a compute started inside the task runs serially, here
            result = program.run_remote(desc.index, desc.request, shared, desc.errstate)
    finally:
        _capture.caught = None
    return result, perf_counter() - start, tuple(caught), here


@dataclass(frozen=True)
class Raised:
    """A packed block task's error, in its place among the pack's outcomes (the other
    tasks of the pack ran on)."""

    error: BaseException


def _program_here(key: str, data: bytes) -> Any:
    """Program ``key`` in this worker, unpickled from ``data`` the first time."""
    runtime = _worker_runtime()
    if not runtime.has(key):
        with _runtime_lock:
            if not runtime.has(key):
                runtime.add(key, data)
    return runtime.program(key)


def run_pack(
    descs: Sequence[tasks_module.BlockTask],
    data: bytes,
    settings: tuple[tuple[str, Any], ...],
    cap: int | None,
    stems: Sequence[str | None],
) -> list[Any]:
    """Run the block tasks ``descs`` of one program one after another in a cluster
    worker (one engine task; see :data:`PACK_TASK_SECONDS`): each one's
    :func:`run_block` outcome, or :class:`Raised` with the error it raised. ``stems``:
    each task's path stem in the shared folder. Before each task the worker asks its
    kernel for the next one's file rows (the driver reads ahead only for workers on its
    own machine)."""
    outcomes: list[Any] = []
    for k, (desc, stem) in enumerate(zip(descs, stems, strict=True)):
        if k + 1 < len(descs):
            _read_ahead(lambda key: _program_here(key, data), descs[k + 1])
        try:
            outcomes.append(run_block(desc, data, settings, cap, stem))
        except Exception as exc:
            outcomes.append(Raised(exc))
    return outcomes


def _read_ahead(program: Callable[[str], Any], desc: tasks_module.BlockTask) -> None:
    """Ask the kernel for the file rows block task ``desc`` reads (``program(key)``
    gives its program); a hint, so a failure is logged only (the task's own read
    reports real problems)."""
    try:
        program(desc.program).prefetch(desc.request, remote=True)
    except Exception:
        log.debug("readahead for block %s failed", desc.index, exc_info=True)


def discard_shared(outcome: Any) -> None:
    """Delete the shared-folder blocks of an attempt's ``(BlockResult, seconds,
    warnings, where)`` that nobody will take (its twin won, or its compute was stopped)."""
    if isinstance(outcome, list):  # a pack's outcomes
        for one in outcome:
            discard_shared(one)
        return
    result = outcome[0] if isinstance(outcome, tuple) and outcome else None
    for block in getattr(result, "blocks", ()):
        if isinstance(block, SharedBlock):
            intermediates.remove(block.path)


def _remove_stem(stem: str) -> None:
    """Delete the shared files of one attempt (``{stem}-{k}.npy`` or ``.tmp``). Best
    effort: object storage out of reach (or a process on its way out) leaves them for
    the next sweep, and for the compute's end (:meth:`ClusterExecutor.compute_ended`)."""
    try:
        intermediates.remove_matching(stem + "-")
    except Exception as exc:  # a sweep runs on a timer: log it, try again later
        log.debug("could not remove the shared files of %s: %s", stem, exc)


def probe_files(paths: Sequence[str]) -> list[str]:
    """The files among ``paths`` this process cannot open for reading."""
    missing = []
    for path in paths:
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            missing.append(f"{path} ({type(exc).__name__}: {exc.strerror or exc})")
    return missing


# -- in the driver ----------------------------------------------------------------------


@dataclass(eq=False)
class _Pending:
    """A block task the driver waits for, and its attempts (a backup is a second)."""

    desc: tasks_module.BlockTask
    need: int
    done: Done
    tries: int = 0
    finished: bool = False
    handles: list[Any] = field(default_factory=list)
    started: float = 0.0
    cap: int | None = None  # the rows its latest attempt capped operators at
    backed_up: bool = False
    deaths: list[Death] = field(default_factory=list)
    # Each attempt's path stem in the shared folder (by id of its handle), and the one
    # chosen for the attempt being launched: the driver removes the files of an
    # attempt that failed or was stopped.
    stems: dict[int, str] = field(default_factory=dict)
    # Handles (by id) of attempts this task shares with others (a pack): never cancelled
    # for this task's sake, as the others still need them.
    packed: set[int] = field(default_factory=set)


@dataclass
class _Kind:
    """The tasks of one program (one pass): their durations, for stragglers."""

    count: int
    seconds: list[float] = field(default_factory=list)
    cap: int | None = None  # rows per operator call after a death of memory
    probed: bool = False
    files: tuple[str, ...] = ()  # the source files its tasks read


class ClusterExecutor(abc.ABC):
    """The driver's side of a cluster engine (see the module docstring)."""

    name = "cluster"
    workers: int
    admits_memory = True  # block tasks are admitted by the engine, per worker
    one_host = False  # every worker runs on the driver's machine (a subclass finds out)
    # Small tasks nobody waits for may be in flight this deep per slot (the scheduler's
    # SMALL_TASKS_PER_WORKER is 16): a round trip to a worker takes milliseconds, and
    # each slot should hold a pack running and packs queued behind it.
    small_tasks_per_worker = 4 * PACK_MAX

    def __init__(self, workers: int, *, counted: bool = False) -> None:
        self.workers = workers
        # The slots were counted from the cluster (not given): they follow its workers
        # as they come and go (see _follow_slots).
        self._counted = counted
        self._local = ThreadExecutor(1, prefix="tierflow-driver")
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}  # id(pending) -> pending
        self._kinds: dict[str, _Kind] = {}
        self._closed = False
        self._watch: threading.Thread | None = None
        self._wake = threading.Event()
        # Which machine (a Dask worker's host, a Ray node) last read the rows of a task,
        # by (source files, request): a later task on the same rows prefers it (its page
        # cache holds them).
        self._read_by: tasks_module.LRU[Any, Any] = tasks_module.LRU(READ_BY_KEPT)
        # Each pass's program as sent to the cluster (by hash): the engine's reference.
        self._programs: tasks_module.LRU[str, Any] = tasks_module.LRU(PROGRAMS_KEPT)
        self._programs_lock = threading.Lock()
        self.backups = 0  # backup copies launched for stragglers
        self.resent = 0  # tasks sent again after their worker died
        self.moved = 0  # tasks sent again after their worker left on request (retired)
        self.packed = 0  # tasks sent in packs (several to one engine task)
        # Path stems of stopped attempts, and when: a worker being killed may still
        # write its block after the engine reported the attempt over, so their files
        # are removed again a while later (and at every submit) for GRAVE_SECONDS.
        self._graves: dict[str, float] = {}
        self._sweeping = False  # a timer will sweep them
        # Every shared file of this executor's attempts is named with this prefix, so
        # that what is left at a compute's end can be listed and removed
        # (compute_ended); the folders (or prefixes) used already.
        self._prefix = f".tf-block-{uuid.uuid4().hex[:12]}-"
        self._made: set[str] = set()
        # Attempts are launched on a thread of their own, never on the computing
        # thread: a Ctrl-C there (KeyboardInterrupt at any bytecode) between an
        # engine's submit and the handle being recorded would leave an attempt nobody
        # cancels, and its shared-folder files nobody removes.
        self._launches: list[_Pending] = []
        # Held from the check that a task still runs until its attempt is recorded, and
        # by a cancelling shutdown while it collects the attempts: an attempt is either
        # recorded before the shutdown (which cancels it) or never launched. Launching
        # and cancelling at once would race in the engine (a cancel that reaches it
        # before the task is known cancels nothing, and the task runs on).
        self._launch_lock = threading.Lock()
        self._flying: set[int] = set()  # ids of the engine tasks in flight
        self._launch_wake = threading.Event()
        self._launcher: threading.Thread | None = None
        self._batching = threading.local()  # inside batch() on this thread

    # -- what a subclass provides -----------------------------------------------------

    @abc.abstractmethod
    def _launch(
        self,
        pack: list[_Pending],
        stems: list[str | None],
        cap: int | None,
        prefer: str | None,
    ) -> Any:
        """Start one engine task running an attempt of each task of ``pack`` (one
        program's) through :func:`run_pack`, on machine ``prefer`` if it can (None:
        anywhere), asking for the largest ``need`` among them; its handle. Its end must
        reach :meth:`_landed` (a cancelled one's too, with an error)."""

    @abc.abstractmethod
    def _cancel(self, handles: Sequence[Any]) -> None:
        """Stop these attempts (running or queued), best effort."""

    @abc.abstractmethod
    def _death(self, error: BaseException) -> Death | None:
        """``error`` as a worker's death, or None when the task itself raised it."""

    @abc.abstractmethod
    def _probe(self, paths: Sequence[str]) -> dict[str, list[str]]:
        """Per worker (or node), the files among ``paths`` it cannot read."""

    @abc.abstractmethod
    def _send_program(self, data: bytes) -> Any:
        """Send a pickled program to the cluster once for every worker; the reference
        tasks carry."""

    def _program_lost(self, sent: Any) -> bool:
        """Whether a program sent earlier is gone from the cluster (its every holder
        died). Not by default."""
        return False

    def _program(self, key: str) -> Any:
        """The cluster's reference to program ``key``, sent now if it was not, or was
        lost."""
        with self._programs_lock:
            sent = self._programs.get(key)
            if sent is None or self._program_lost(sent):
                sent = self._send_program(tasks_module.program_bytes(key))
            self._programs[key] = sent  # the most recent now
            return sent

    def _forget_programs(self) -> None:
        """Send every program again when next used (a worker that died may have held
        the only copy)."""
        with self._programs_lock:
            self._programs.clear()

    def _observe(self) -> None:
        """Called by the straggler watch while tasks run: a subclass notes what it
        needs to tell a death of memory later (the workers' reported memory), and the
        cluster's slots (:meth:`_follow_slots`). Nothing by default."""
        return None

    def _follow_slots(self, slots: int) -> None:
        """The cluster has ``slots`` task slots now (workers joined or left, an
        adaptive deployment, autoscaling): as many engine tasks per slot in flight from
        now on, unless the executor was given its ``workers``."""
        if self._counted and slots > 0 and slots != self.workers:
            self.workers = slots
            self._launch_wake.set()  # more room for engine tasks, maybe

    def shared_dir(self) -> str | None:
        """The folder workers write bigger held blocks to: the ``shared_dir`` setting,
        else the driver's spill folder when every worker is on this machine (None:
        blocks come back by value)."""
        shared = config.get("shared_dir")
        if shared:
            return str(shared)
        if self.one_host:
            return os.path.expanduser(str(config.get("spill_dir")))
        return None

    def scratch_place(self) -> str | None:
        """Where scratch every node reads goes (an external sort's runs): the
        ``shared_dir`` setting, a folder or an object-storage URL; None where it is not
        set (each process's spill folder: on one host, every worker sees it)."""
        shared = config.get("shared_dir")
        return str(shared) if shared else None

    def _bury(self, stem: str) -> None:
        """Remove a stopped attempt's files now, and again later (see ``_graves``)."""
        _remove_stem(stem)
        with self._lock:
            self._graves[stem] = perf_counter()
            if self._sweeping:
                return
            self._sweeping = True
        self._sweep_later()

    def _sweep_later(self) -> None:
        timer = threading.Timer(GRAVE_SWEEP_SECONDS, self._sweep, kwargs={"again": True})
        timer.daemon = True
        timer.start()

    def _sweep(self, again: bool = False) -> None:
        """Remove the stopped attempts' files again; forget those stopped long ago.
        ``again``: a timer's sweep, which sets the next one while graves remain."""
        now = perf_counter()
        with self._lock:
            graves = list(self._graves.items())
        for stem, when in graves:
            _remove_stem(stem)
            if now - when > GRAVE_SECONDS:
                with self._lock:
                    self._graves.pop(stem, None)
        if again:
            with self._lock:
                self._sweeping = bool(self._graves)
            if self._sweeping:
                self._sweep_later()

    def _stems(self, count: int) -> list[str | None]:
        """A path (or URL) stem in the shared folder for each of ``count`` attempts
        being launched (None: blocks come back by value)."""
        folder = self.shared_dir()
        if folder is None:
            return [None] * count
        if folder not in self._made or not intermediates.is_url(folder):
            intermediates.makedirs(folder)  # a folder again each time: it may be gone
            self._made.add(folder)
        return [
            intermediates.join(folder, f"{self._prefix}{uuid.uuid4().hex}") for _ in range(count)
        ]

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        return tuple((n, config.get(n)) for n in _SETTINGS)

    # -- the executor protocol --------------------------------------------------------

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        self._local.submit(fn, done)

    def submit_task(self, desc: tasks_module.BlockTask, done: Done, need: int = 0) -> None:
        if self._graves:
            self._sweep()
        self._kind(desc.program)  # probes the sources first: a SourceError is raised here
        pending = _Pending(desc, need, done)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} executor was shut down")
            self._pending[id(pending)] = pending
            self._launches.append(pending)
            if self._launcher is None:
                self._launcher = threading.Thread(
                    target=self._launching, name=f"tierflow-{self.name}-launch", daemon=True
                )
                self._launcher.start()
        if not getattr(self._batching, "on", False):
            self._launch_wake.set()
        self._start_watch()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Tasks submitted on this thread inside it are launched together when it ends
        (the scheduler hands over a round of admitted tasks so), which lets short ones
        travel in packs from the first: one at a time, each would be launched alone
        while there is room."""
        self._batching.on = True
        try:
            yield
        finally:
            self._batching.on = False
            self._launch_wake.set()

    def _launching(self) -> None:
        """The launch thread: launches the tasks submitted, while fewer than
        :data:`ENGINE_TASKS_PER_SLOT` engine tasks per slot are in flight; an engine
        task that ends wakes it."""
        while True:
            self._launch_wake.wait()
            with self._lock:
                self._launch_wake.clear()
                if self._closed and not self._launches:
                    self._launcher = None
                    return
                room = ENGINE_TASKS_PER_SLOT * self.workers - len(self._flying)
                if room <= 0 or not self._launches:
                    continue
                batch, self._launches = self._launches, []
            left = self._launch_all([p for p in batch if not p.finished], room)
            if left:
                with self._lock:
                    self._launches[:0] = left  # first in line still

    def _launch_all(self, batch: list[_Pending], room: int) -> list[_Pending]:
        """Launch the first attempt of tasks of ``batch``, in order, as at most ``room``
        engine tasks: in packs where their program's tasks are short (see
        :data:`PACK_TASK_SECONDS`), a pack's tasks preferring the same machine; the
        tasks left. A task whose launch fails gets the error. The pack size of a program
        (and machine) is decided once, on all of its tasks in ``batch``."""
        sizes: dict[tuple[str, str | None], int] = {}
        while batch and room > 0:
            first = batch[0]
            kind = self._kinds[first.desc.program]
            prefer = self._prefer(kind, first)
            same = [
                p
                for p in batch
                if p.desc.program == first.desc.program and self._prefer(kind, p) == prefer
            ]
            size = sizes.get((first.desc.program, prefer))
            if size is None:
                size = sizes[first.desc.program, prefer] = self._pack_size(kind, len(same))
            pack = same[:size]
            taken = {id(p) for p in pack}
            batch = [p for p in batch if id(p) not in taken]
            room -= 1
            try:
                self._attempt(pack, kind)
            except BaseException as exc:
                for pending in pack:
                    self._fail(pending, exc)
        return batch

    def _prefer(self, kind: _Kind, pending: _Pending) -> str | None:
        """The machine that last read the rows of ``pending`` (None: not known, or
        every worker is on one machine, whose page cache they share: a preference
        there only unbalances the engine's placement)."""
        if self.one_host or not kind.files:
            return None
        return self._read_by.get((kind.files, pending.desc.request))

    def _flew(self, handle: Any) -> None:
        """Engine task ``handle`` is no longer in flight: there is room for another."""
        with self._lock:
            self._flying.discard(id(handle))
        self._launch_wake.set()

    def _pack_size(self, kind: _Kind, queued: int) -> int:
        """How many of ``queued`` tasks of ``kind`` go in one engine task: 1 until the
        workers timed enough of them; then, while the median is under
        :data:`PACK_TASK_SECONDS`, the queue cut into packs of one size, at most about
        :data:`PACK_SECONDS` of work each, as many as the slots hold in flight at least
        (:data:`ENGINE_TASKS_PER_SLOT`: the next pack waits at a slot while one runs)
        and a multiple of the slots (32 tasks of 4 ms on 2 slots: 4 packs of 8, not 16
        and 16, nor 14, 14 and 4, whose last would leave a slot idle)."""
        recent = kind.seconds[-PACK_WINDOW:]
        if len(recent) < min(PACK_WINDOW, 2 * self.workers):
            return 1
        median = statistics.median(recent)
        if median >= PACK_TASK_SECONDS:
            return 1
        most = max(1, min(PACK_MAX, int(PACK_SECONDS / max(median, 1e-6))))
        packs = max(-(-queued // most), ENGINE_TASKS_PER_SLOT * self.workers)
        packs = -(-packs // self.workers) * self.workers
        return max(1, -(-queued // packs))

    def _fail(self, pending: _Pending, error: BaseException) -> None:
        """End ``pending`` with ``error`` unless it has ended."""
        with self._lock:
            if pending.finished:
                return
            pending.finished = True
            self._pending.pop(id(pending), None)
        pending.done(None, error)

    def _kind(self, key: str) -> _Kind:
        kind = self._kinds.get(key)
        if kind is None:
            program = tasks_module.shipped_program(key)
            files = tuple(sorted(set(program.files())))
            kind = self._kinds.setdefault(key, _Kind(max(1, int(program.count)), files=files))
        if not kind.probed:
            self._check_sources(key)
            kind.probed = True
        return kind

    def _check_sources(self, key: str) -> None:
        paths = sorted(set(tasks_module.shipped_program(key).files()))
        if not paths:
            return
        missing = {w: m for w, m in self._probe(paths).items() if m}
        if missing:
            worker, files = next(iter(missing.items()))
            more = f" (and {len(missing) - 1} more workers)" if len(missing) > 1 else ""
            raise SourceError(
                f"worker {worker}{more} cannot read {len(files)} of the compute's "
                f"{len(paths)} source files: {'; '.join(files[:3])}. Workers read sources "
                "by path: put them on storage every node mounts at the same path"
            )

    def _attempt(self, pack: list[_Pending], kind: _Kind) -> None:
        """Launch one attempt of each task of ``pack`` (one program's) that has not
        ended, as one engine task."""
        with self._launch_lock:
            with self._lock:
                pack = [p for p in pack if not p.finished]  # stopped, or a twin won
            if not pack:
                return
            prefer = self._prefer(kind, pack[0])
            for pending in pack:
                pending.tries += 1
                pending.cap = kind.cap
                if pending.tries > 1:
                    prefer = None  # sent again: wherever there is room
            if self.one_host and pack[0].tries == 1:
                # Into the page cache the workers share, as the engine task leaves (at
                # most ENGINE_TASKS_PER_SLOT per slot ahead); a pack's worker reads its
                # later tasks' rows ahead itself.
                _read_ahead(tasks_module.shipped_program, pack[0].desc)
            stems = self._stems(len(pack))
            handle = self._launch(pack, stems, kind.cap, prefer)
            if len(pack) > 1:
                self.packed += len(pack)
            buried: list[str] = []
            with self._lock:
                self._flying.add(id(handle))
                for pending, stem in zip(pack, stems, strict=True):
                    if pending.finished:  # a backup's twin won while this one started
                        if stem is not None:
                            buried.append(stem)
                        continue
                    pending.handles.append(handle)
                    if len(pack) > 1:
                        pending.packed.add(id(handle))
                    if stem is not None:
                        pending.stems[id(handle)] = stem
                self._clock_front(perf_counter())
        if len(buried) == len(pack):
            self._cancel([handle])
            self._flew(handle)
        for stem in buried:
            self._bury(stem)

    def _clock_front(self, now: float) -> None:
        """Start the clocks of the oldest ``workers`` tasks not done: the engine runs
        tasks about in the order they were sent, so those are the ones running (the
        others wait in its queue, and waiting is not straggling). Needs ``_lock``."""
        for k, pending in enumerate(self._pending.values()):
            if k >= self.workers:
                return
            if not pending.started:
                pending.started = now

    def _landed(self, pack: list[_Pending], handle: Any, outcomes: Any, error: Any) -> None:
        """An engine task ended: ``outcomes`` is :func:`run_pack`'s list, one
        ``(result, seconds, warnings, where)`` (or :class:`Raised`) per task of
        ``pack``; ``error`` what the engine task raised instead. Whatever goes wrong
        here reaches the tasks' ``done``: a task never goes unreported."""
        try:
            self._settle_all(pack, handle, outcomes, error)
        finally:
            # Only now: a death has capped the program, so what is launched in the
            # room this frees runs capped.
            self._flew(handle)

    def _settle_all(self, pack: list[_Pending], handle: Any, outcomes: Any, error: Any) -> None:
        # Told apart once (a subclass may ask the engine), outside the lock.
        try:
            death = self._death(error) if error is not None else None
        except BaseException as exc:
            death, error = None, exc
        if error is None and (not isinstance(outcomes, list) or len(outcomes) != len(pack)):
            error = TierflowError(f"a {self.name} task returned {type(outcomes).__name__}")
        for k, pending in enumerate(pack):
            outcome: Any = None if error is not None else outcomes[k]
            failed, died = error, death
            if isinstance(outcome, Raised):  # this task raised; the pack ran on
                outcome, failed, died = None, outcome.error, None
            try:
                self._settle(pending, handle, outcome, failed, died)
            except BaseException as exc:
                self._fail(pending, exc)

    def _settle(
        self, pending: _Pending, handle: Any, outcome: Any, error: Any, death: Death | None
    ) -> None:
        stem = pending.stems.pop(id(handle), None)
        pending.packed.discard(id(handle))
        if stem is not None and (error is not None or pending.finished):
            self._bury(stem)  # what a failed or stopped attempt may have left
        if pending.finished:
            discard_shared(outcome)  # a backup's twin won, or the compute was stopped
            return
        with self._lock:
            if pending.finished:
                discard_shared(outcome)
                return
            with contextlib.suppress(ValueError):
                pending.handles.remove(handle)
            if death is not None and pending.handles:
                return  # its backup still runs
            if death is None:
                pending.finished = True
                others, pending.handles = pending.handles, []
                self._pending.pop(id(pending), None)
                self._clock_front(perf_counter())
        if death is not None:
            self._died(pending, death)
            return
        others = [h for h in others if id(h) not in pending.packed]  # packs run on
        if others:
            self._cancel(others)
        if error is not None:
            pending.done(None, error)
            return
        result, seconds, caught, where = outcome
        kind = self._kinds.get(pending.desc.program)
        if kind is not None:
            kind.seconds.append(seconds)
            if where is not None and kind.files:
                self._read_by[(kind.files, pending.desc.request)] = where
        try:  # the task's warnings, at the lines that raised them
            tasks_module.reissue(pending.desc, caught)
        except Exception as exc:  # a filter made one an error: the task's error
            pending.done(None, exc)
            return
        pending.done((result, seconds), None)

    def _died(self, pending: _Pending, death: Death) -> None:
        kind = self._kinds[pending.desc.program]
        if death.retired and not self._closed:
            log.info(
                "a %s worker left running block %d (%s); sending it to another",
                self.name, pending.desc.index, death.why,
            )  # fmt: skip
            self.moved += 1
            pending.tries -= 1  # the attempt ends here; not a try that failed
            pending.started = 0.0
            self._attempt([pending], kind)
            return
        pending.deaths.append(death)
        if death.memory:
            # Halved from the size this attempt ran at: the tasks that died with it
            # (one death, many tasks) halve the cap once, not once each.
            rows = _rows(pending.desc.request, pending.cap)
            if rows is not None:
                half = max(1, (rows + 1) // 2)
                kind.cap = half if kind.cap is None else min(kind.cap, half)
        if pending.tries >= TRIES or self._closed:
            with self._lock:
                pending.finished = True
                self._pending.pop(id(pending), None)
            whys = "; ".join(f"{d.worker}: {d.why}" for d in pending.deaths)
            pending.done(
                None,
                WorkerLost(
                    f"block {pending.desc.index} was sent {pending.tries} times and the "
                    f"worker died each time ({whys}). The operator may crash the process, "
                    "or the workers' memory is too small for one block: give the workers "
                    "more memory or lower the block size"
                ),
            )
            return
        log.warning(
            "a %s worker died running block %d (%s); sending it again%s",
            self.name,
            pending.desc.index,
            death.why,
            f" with operators capped at {kind.cap} rows" if death.memory else "",
        )
        self.resent += 1
        pending.started = 0.0  # its clock starts again with the new attempt
        self._attempt([pending], kind)

    # -- stragglers -------------------------------------------------------------------

    def _start_watch(self) -> None:
        """Start the straggler watch unless it runs (it stops when nothing is pending)."""
        with self._lock:
            if self._watch is None:
                self._watch = threading.Thread(
                    target=self._watching, name=f"tierflow-{self.name}-watch", daemon=True
                )
                self._watch.start()

    def _watching(self) -> None:
        while True:
            self._wake.wait(WATCH_SECONDS)
            with self._lock:
                if self._closed or not self._pending:
                    self._watch = None
                    return
            self._observe()
            for pending in self.stragglers(perf_counter()):
                kind = self._kinds.get(pending.desc.program)
                if kind is None or pending.finished:
                    continue
                pending.backed_up = True
                self.backups += 1
                log.info("block %d runs long: a backup copy starts", pending.desc.index)
                with contextlib.suppress(Exception):
                    self._attempt([pending], kind)

    def stragglers(self, now: float) -> list[_Pending]:
        """Tasks that deserve a backup copy now (see the module docstring)."""
        with self._lock:
            running = [p for p in self._pending.values() if not p.backed_up and p.handles]
        found = []
        medians: dict[str, float | None] = {}
        for pending in running:
            key = pending.desc.program
            if key not in medians:
                kind = self._kinds.get(key)
                medians[key] = _median_if_enough(kind)
            median = medians[key]
            if median is None or not pending.started:
                continue
            ran = now - pending.started
            if ran > STRAGGLER_FACTOR * median and ran > STRAGGLER_MIN_SECONDS:
                found.append(pending)
        return found

    # -- stopping ---------------------------------------------------------------------

    def shutdown(self, *, cancel: bool = False) -> None:
        if cancel:
            with self._launch_lock, self._lock:
                dropped = list(self._pending.values())
                self._pending.clear()
                self._launches = []
                handles = [h for p in dropped for h in p.handles]
                self._flying.difference_update(id(h) for h in handles)
                stems = [s for p in dropped for s in p.stems.values()]
                for p in dropped:
                    p.finished = True
                    p.handles = []
            if handles:
                self._cancel(handles)
            for stem in stems:  # what the stopped attempts may still write
                self._bury(stem)
        self._local.shutdown(cancel=cancel)

    def compute_ended(self) -> None:
        """A compute on this executor ended (done, failed or stopped): where no other
        compute has tasks in flight, remove every shared file or object under this
        executor's prefix that is still there (a block nobody took, a temporary one a
        stopped attempt wrote), listed in the shared folder or prefix."""
        folder = self.shared_dir()
        with self._lock:
            busy = bool(self._pending)
        if folder is None or busy or folder not in self._made:
            return
        try:
            intermediates.remove_matching(intermediates.join(folder, self._prefix))
        except Exception as exc:  # never in place of the compute's own error
            log.warning("could not remove the shared blocks left in %s: %s", folder, exc)

    def close(self) -> None:
        """Stop the straggler watch; the cluster itself is left running."""
        self._closed = True
        self._wake.set()
        self._launch_wake.set()
        self.shutdown(cancel=True)


def _median_if_enough(kind: _Kind | None) -> float | None:
    if kind is None:
        return None
    done = len(kind.seconds)
    if done < STRAGGLER_MIN_TASKS or done < STRAGGLER_DONE * kind.count:
        return None
    return statistics.median(kind.seconds)


def _rows(request: Any, cap: int | None) -> int | None:
    """The rows a task's operators were called on at most: its request's, or the cap."""
    rows = getattr(request, "stop", None)
    if rows is not None:
        rows = request.stop - request.start
    if cap is not None:
        rows = cap if rows is None else min(rows, cap)
    if rows is None:  # a block of unknown rows: halve from the default block size
        rows = 1 << 16
    return int(rows)


def node_budget(memory_limit: int | None, slots: int = 1) -> int:
    """The tierflow budget of one of ``slots`` task slots of this worker process:
    ``budget_fraction`` of the smaller of its memory limit (None: none) and the usable
    memory of its machine or cgroup, shared by the slots. ``TIERFLOW_RAM_BUDGET`` in the
    worker's own environment (the node started with it) lowers that whole: a node
    given 1 GB gets 1 GB, shared by its slots, never more than it can hold."""
    from ....system.limits import read_memory

    limits = [int(read_memory().usable)]
    if memory_limit:
        limits.append(int(memory_limit))
    fraction = float(config.get("budget_fraction"))
    whole = int(min(limits) * fraction)
    given = os.environ.get("TIERFLOW_RAM_BUDGET", "").strip()
    if given:
        whole = min(whole, config.parse_size(given, "TIERFLOW_RAM_BUDGET"))
    return max(1 << 20, whole // max(1, slots))


def host_name() -> str:
    """This machine's name, as workers on it report it."""
    return os.uname().nodename
