"""The scheduler: runs a plan's tasks through an executor, within the RAM and GPU budgets.

It knows tasks (:class:`~tierflow.engine.types.Task`) and one ``submit`` call of an
:class:`~tierflow.engine.types.Executor`; it does not know threads. All of its state
lives on the calling thread; workers only put ``(task, result, error)`` into an inbox.
The scheduler wakes for every finished task, except while a deep queue of small tasks
is in flight: then it wakes once half of the queue is done (the workers stay busy, and
a wake-up costs a thread hand-off); an error wakes it at once.

This module admits tasks against the RAM budget and runs the loop; the GPU seats are
:mod:`.devices`, the results held between tasks :mod:`.held`, and what the workers touch
(the inbox, the lane of tiny tasks) :mod:`.lane`.

Order
-----
Ready tasks run lowest index first. The plan numbers tasks depth-first
(:mod:`tierflow.engine.planning.plan`), so a block's follow-up work (an ``append`` of a masked
block to a file) outranks reading the next block, and a pass finishes before the next
stage starts::

    block 0 -> append 0           ready: {append 0, block 2}
    block 1 -> append 1     =>    runs append 0 first: the held block 0 is
    block 2 -> append 2           released before block 2 is read

Order alone does not stop blocks computed on every worker from outrunning appends that
run one after another; the plan also makes block ``j`` wait (``Task.after``) for the
append of block ``j - 2 x workers``.

Admission (backpressure)
------------------------
At most two tasks per worker are in flight: one running and one queued, whose source
rows are read ahead (``prefetch``) while the other runs (tasks projecting under 1 MB may
queue 16 deep when no task waits for their result: bounding them bounds nothing, and
each hand-off between threads costs as much as such a task; so may a cluster's block
tasks whose result nobody waits for, whatever their size, since the workers admit their
bytes: the cluster is handed every such task of a round at once, and packs short ones).
A task is admitted only when

* its projected bytes (inputs + outputs + scratch, see
  :meth:`tierflow.engine.program.program.Program.memory`) fit what is left of the budget:
  ``budget - RAM held by memory.array - admitted``;
* and the pressure level (:func:`tierflow.system.pressure.level_now`) is below ``high``.

``admitted`` is the process's, not the run's: the projections of running tasks and the
held results of *every* compute, kept in one ledger (:data:`tierflow.system.budget.ledger`).
A run reserves a task's bytes there before it submits the task (the check and the
reservation are one step under the ledger's lock, so two computes cannot both take the
last room), gives them back when the task finishes, and counts a result while it holds
it. Whatever a run still has admitted when it ends — it finished, failed or was
interrupted — it gives back. Two computes on two threads therefore share one budget::

    budget 8 MB, tasks of 4.2 MB       admitted
    compute A: block 0 admitted        4.2 MB
    compute B: block 0 refused         (8.4 MB would not fit; B waits)
    A: block 0 done -> block 1 ...     B runs when A's tasks leave room

Readers therefore never run ahead of consumers. A run with nothing in flight admits its
best ready task as above, and otherwise once no task of any compute is running, whatever
it projects and whatever the level: one task at a time always makes progress, and this
single task may exceed the budget (out-of-memory halving covers a projection that was
wrong). At ``high`` that makes one task at a time in the whole process. Results that
other computes hold do not make a run with nothing in flight wait (they leave only when
those computes run more tasks); their running tasks finish and give their bytes back,
and the ledger wakes the waiting run. A compute whose tasks do not fit beside another's runs after it rather
than beside it. Tasks that project nothing (finishing a reduction, committing a file)
are always admitted.

GPUs
----
A device task (``Task.device``: a block task running ``map_blocks`` on a GPU) is also
admitted against a GPU (:mod:`tierflow.system.device_budget`). Each GPU has a budget
(its free memory less the ``gpu_margin``), a pressure level from its free fraction, and
``gpu_slots`` worker slots (2) shared by every compute. The task is seated on a free
slot of the GPU it names, or for ``"cuda"`` of the GPU with the most room
(``budget - admitted``) at that moment, when its projected device bytes fit beside what
is admitted there and the GPU's level is below ``high`` (a GPU that holds nothing takes
one task at any level); otherwise it waits like a task whose RAM does not fit. The seat
is taken before its RAM (and given back if the RAM does not fit), and returned when the
task ends. Blocks of one array therefore spread over several GPUs by free memory::

    cuda:0 budget 40 MB, cuda:1 budget 20 MB, tasks of 10 MB, 8 slots each
    admitted:  0 -> cuda:0 (room 40)   1 -> cuda:0 (30)   2 -> cuda:0 (20, tie, first)
               3 -> cuda:1 (20)        4 -> cuda:0 (10)   5 -> cuda:1 (10) ... then wait

The task runs inside :func:`tierflow.engine.gpu.tier.running_in_slot`: it learns its GPU
(``current_device()``, which ``map_blocks(device="cuda")`` uses) and runs on its slot's
CUDA stream. A task that projects more than its GPU's whole budget (for ``"cuda"``: than
the largest) could never be admitted: the run refuses it before any task starts, with
the numbers. A nested run (below) with nothing in flight seats its task whatever is
taken: its caller holds a slot of that GPU and waits for it.

One wait could have no end: a running task that waits for a compute it started on
another thread, rather than in its own (see "Nested computes"). So a run that has
waited :data:`STARVED_SECONDS` with nothing in flight logs a warning and, from then on,
admits one task whenever it has nothing in flight, as a nested run does: at worst one
task beyond the budget, never a deadlock.

Nested computes
---------------
A compute started inside a task (a ``map_blocks`` function or a ``from_files`` loader
that calls ``compute``) runs on the thread of that task with the serial executor,
whatever executor it names (:func:`tierflow.engine.runtime.executors.in_task` tells): the
workers are busy with the outer compute, one of them with the very task that waits,
so queueing work for them could wait forever. Its first task is always admitted while
it has nothing in flight, even when the outer compute — whose running task is the one
waiting — holds the budget; so it runs one task at a time beyond the budget at worst,
and never waits for the ledger. Its error stops only itself (it shuts down its own
serial executor, not the outer compute's workers).

Tiny tasks
----------
A task that takes less than :data:`TINY_TASK_SECONDS` is mostly the interpreter's work,
done under the GIL. Two workers running such tasks take turns at the GIL at every NumPy
call and finish them more slowly than one does (measured here: 51 against 29 us per
block of 1,000 rows). So tasks projecting under :data:`SMALL_TASK` start on the *lane*:
one executor job that runs queued tasks one after another, taking each from a shared
queue without a thread hand-off. The first :data:`LANE_PROBE` tasks of a kind (one
``fn``) are timed there one at a time. If their median (leaving out the first, which
warms up) is below the threshold, the kind stays on the lane; otherwise it goes to the
workers (feature extraction that releases the GIL, loading many files), as soon as two
tasks after the first have taken more than twice the threshold. Afterwards a
running mean moves a kind on the lane to the workers above twice the threshold, and a
kind on the workers to the lane below half of it::

    probe t0..t6, median  60 us  ->  lane:     one job runs t7, t8, t9 ... in turn
    probe t0..t6, median   3 ms  ->  workers:  t7 | t8 run at once

Lane tasks are admitted like any other (the same windows and budget); the scheduler
tops the lane's queue up whenever it wakes.

Placement and release
---------------------
A result is held only while a task that takes it has not run; the last consumer
releases it. Results the caller asked for are kept. Source pages a block task read are
dropped from the process when it finishes (and from the page cache too at ``high``),
inside the task (:meth:`tierflow.engine.program.program.Program.run`). Held results are
counted against the budget; when the results held by every compute together outgrow
half of it, or the level reaches ``critical``, a run spills its own — copies them into
spill files on the SSD, drops them from RAM — largest first. A spilled result is mapped
read-only under a read lease (:func:`tierflow.storage.spill.write_array`): another
process truncating its file waits until the result's consumers are done, rather than
making them fault. A spilled result's pages leave the process when its last consumer
has run (they were read back through the mapping); its spill file is deleted when the
scheduler returns, whatever happened::

    held: [block 3: 120 MB RAM] [block 4: 120 MB RAM]     level -> critical
    held: [block 3: SSD]        [block 4: SSD]            RAM freed, files deleted at end

Out-of-memory halving
---------------------
Inside a task, an operator that raises ``MemoryError`` or a torch/cupy out-of-memory
error is retried on pieces of half its block, down to one row, the pieces' results
stitched; each failure remembers half its size at once, for the rest of the block and
for that operator's next blocks (:mod:`tierflow.engine.program.halving`). Operators on whole in-memory values cannot be split;
their out-of-memory errors are explained (:func:`tierflow.storage.oom.explain_oom`).

Profiling
---------
A callback that is a :class:`~tierflow.engine.types.Tracer` (the profiler,
:mod:`tierflow.engine.observe.profile`) wraps each task's function when it is submitted, sees the
outcome of each task another process ran, and hears of each held result spilled. With
none among the callbacks, the only cost is one check per task.

Failure and interruption
------------------------
The first error stops the compute: nothing more is submitted, tasks not started are
dropped (``shutdown(cancel=True)``), the scheduler waits for the running ones, deletes
its spill files and raises the error. ``KeyboardInterrupt`` — in the calling thread
while it waits, or raised by a task — does the same. The caller then aborts its sinks
(output freed, temporary ``.npy`` removed): no partial output is left.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import time
from collections.abc import Sequence
from time import perf_counter
from typing import Any

from ...config import format_bytes
from ...storage import placement
from ...system import budget as budget_module
from ...system import pressure
from ...system.types import Level
from ..gpu import tier
from ..program import float_errors, halving
from ..program import tasks as tasks_module
from ..program.tasks import BlockTask
from ..types import (
    ComputeFinished,
    ComputeStarted,
    Executor,
    Task,
    TaskExecutor,
    TaskFinished,
    Tracer,
)
from .devices import Seats
from .executors import SerialExecutor, in_task
from .held import Held
from .lane import LANE_PROBE, TINY_TASK_SECONDS, Inbox, Kind, Lane

__all__ = ["LANE_PROBE", "TASKS_PER_WORKER", "TINY_TASK_SECONDS", "Stats", "run"]

log = logging.getLogger("tierflow.engine")

TASKS_PER_WORKER = 2  # one running, one queued with its reads ahead
# Tasks projecting less than SMALL_TASK bytes whose results nobody waits for (blocks of a
# reduction or of a sink with known rows) may queue SMALL_TASKS_PER_WORKER deep: they
# cost no memory worth bounding, and a deeper queue saves a thread hand-off per task.
# An executor may ask for another depth (its ``small_tasks_per_worker``: a cluster's,
# whose round trip to a worker takes milliseconds, and which packs short tasks).
SMALL_TASK = 1 << 20
SMALL_TASKS_PER_WORKER = 16
_WAIT = 0.05  # seconds between pressure re-readings while admission is refused
# A run with nothing in flight that waited this long for other computes' tasks admits one
# task anyway, from then on (module docstring, "Admission"): those tasks may wait for it.
STARVED_SECONDS = 10.0
# Level comparisons parse names; set membership is what a per-task check can afford.
_HIGH = frozenset({Level.HIGH, Level.CRITICAL})


class Stats:
    """What one run did: tasks done, peak projected bytes, bytes spilled, halvings."""

    def __init__(self) -> None:
        self.done = 0
        self.peak_bytes = 0
        self.spilled_bytes = 0
        self.oom_retries = 0
        self.seconds = 0.0
        self.max_in_flight = 0


class _Run:
    """The state of one run; every method runs on the scheduler's thread."""

    def __init__(
        self,
        tasks: Sequence[Task],
        executor: Executor,
        keep: set[int],
        callbacks: Sequence[Any],
        what: str,
    ) -> None:
        self.tasks = tasks
        self.executor = executor
        self.keep = keep
        self.callbacks = callbacks
        self.what = what
        # Admits one task whenever it has nothing in flight, whatever other computes
        # run: a nested run, and one that starved (see the module docstring).
        self.one_always = False  # set by run() for a nested run
        self._room: int | None = None  # the budget's room, read once per _admit call
        self.waiting_since: float | None = None  # when it began waiting for others
        n = len(tasks)
        self.waiting = [len(t.deps) + len(t.after) for t in tasks]
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        self.consumers = [0] * n
        for i, t in enumerate(tasks):
            for d in t.deps:
                self.dependents[d].append(i)
                self.consumers[d] += 1
            for d in t.after:
                self.dependents[d].append(i)
        for i in keep:
            self.consumers[i] += 1
        self.ready = [i for i in range(n) if self.waiting[i] == 0]
        heapq.heapify(self.ready)
        self.running = 0
        self.in_flight = 0
        self.inbox = Inbox()
        window = TASKS_PER_WORKER * max(1, executor.workers)
        small_depth = getattr(executor, "small_tasks_per_worker", SMALL_TASKS_PER_WORKER)
        deep_window = small_depth * max(1, executor.workers)
        self.needs = [t.memory.total for t in tasks]
        # Block tasks travel to other processes when the executor runs tasks as data.
        self.remote = isinstance(executor, TaskExecutor)
        admits = self.remote and getattr(executor, "admits_memory", False)
        # How many tasks may be in flight when task i is admitted. A task's consumers
        # have not run before it has, so whether anything waits for its result is known
        # now: small tasks nobody waits for may queue deeper (see _admit), and so may
        # the block tasks of a cluster that admits them on its workers (their bytes are
        # held there, one task per slot at a time; queued, a task holds nothing), which
        # lets it pack short ones.
        self.limits = [
            deep_window
            if not self.consumers[i] and (need < SMALL_TASK or (admits and t.block))
            else window
            for i, (t, need) in enumerate(zip(tasks, self.needs, strict=True))
        ]
        # Remote tasks admitted in one round are handed over together when the executor
        # takes them so (its ``batch``: a cluster's, which reads ahead itself as it
        # launches them, a few per slot, not for the whole deep queue admitted).
        self.batch = getattr(executor, "batch", None) if self.remote else None
        if admits:
            # A cluster admits block tasks against the budget of the worker that runs
            # them (the task declares its bytes); this process's budget is not theirs.
            self.needs = [0 if t.block else need for t, need in zip(tasks, self.needs, strict=True)]
        # GPUs a task is admitted on (a worker process admits against its own GPUs).
        self.devices = [None if self.remote and t.block else t.device for t in tasks]
        self.seats = Seats(tasks, self.devices)
        # Kinds of tasks that may run on the lane: those projecting under SMALL_TASK
        # (no lane beside worker processes: the lane saves thread hand-offs; none for
        # device tasks, which run on their GPU's slots).
        kinds: dict[Any, Kind] = {}
        self.kinds: list[Kind | None] = [
            (kinds.get(t.fn) or kinds.setdefault(t.fn, Kind()))
            if need < SMALL_TASK and not (self.remote and t.block) and device is None
            else None
            for t, need, device in zip(tasks, self.needs, self.devices, strict=True)
        ]
        self.lane = Lane(self.inbox)
        # Callbacks' task_done methods, looked up once rather than for every task.
        self.task_done = [m for cb in callbacks if (m := getattr(cb, "task_done", None))]
        # A profiler follows each task where it runs (types.Tracer); None costs nothing.
        self.tracer: Tracer | None = next((cb for cb in callbacks if isinstance(cb, Tracer)), None)
        self.stats = Stats()
        self.held = Held(keep, self.tracer)  # results waiting for their consumers
        self.level = Level.OK

    # -- admission --------------------------------------------------------------------

    def _submit(self, i: int, task: Task, need: int, lane: list[Any] | None) -> None:
        """Hand task ``i`` to the executor, or append it to ``lane`` (the items
        :meth:`_admit` queues on the lane, and reads ahead for, when it returns).
        Scheduler thread only."""
        if task.deps:
            results = self.held.results
            args = (*task.args, *[results[d] for d in task.deps])
        else:
            args = task.args
        fn = task.fn if self.tracer is None else self.tracer.wrap(i, task, task.fn)
        in_flight = self.in_flight = self.in_flight + 1
        running = self.running = self.running + need
        stats = self.stats
        if in_flight > stats.max_in_flight:
            stats.max_in_flight = in_flight
        if running + self.held.bytes > stats.peak_bytes:
            stats.peak_bytes = running + self.held.bytes
        if lane is not None:
            lane.append((i, fn, args))
            return
        put = self.inbox.put
        if task.block and self.remote:
            self._submit_remote(i, task, args)
            if task.prefetch is not None and self.batch is None:
                self._prefetch(task, remote=True)
            return

        seat = self.seats.held.get(i)
        if seat is None:

            def call() -> tuple[Any, float]:
                start = perf_counter()
                return fn(*args), perf_counter() - start

        else:

            def call() -> tuple[Any, float]:
                start = perf_counter()
                with tier.running_in_slot(seat.device, seat.slot):
                    result = fn(*args)
                return result, perf_counter() - start

        def done(outcome: Any, error: BaseException | None) -> None:
            put((i, outcome, error))

        self.executor.submit(call, done)
        if task.prefetch is not None:
            self._prefetch(task)

    def _submit_remote(self, i: int, task: Task, args: tuple[Any, ...]) -> None:
        """Send block task ``i`` to a worker process as data. The worker's result is
        received (partials added, blocks placed) on the thread that reports it.
        Scheduler thread only."""
        program = task.program if task.program is not None else args[-1][0]
        index, req = task.args
        desc = BlockTask(tasks_module.ship(program), index, req, float_errors.modes())
        executor: Any = self.executor
        put = self.inbox.put
        tracer = self.tracer

        def done(outcome: Any, error: BaseException | None) -> None:
            if error is None:
                try:
                    if tracer is not None:
                        tracer.landed(i, task, outcome)
                    result, seconds = outcome
                    outcome = (program.receive(index, req, result), seconds)
                except BaseException as exc:
                    outcome, error = None, exc
            put((i, outcome, error))

        if getattr(executor, "admits_memory", False):
            executor.submit_task(desc, done, task.memory.total)
        else:
            executor.submit_task(desc, done)

    @staticmethod
    def _prefetch(task: Task, remote: bool = False) -> None:
        """Read ahead for a submitted task. After the submit: a task that waits in the
        queue has its rows read meanwhile; one that started at once reads them itself.
        ``remote``: the task runs in another process, which reads what this one would
        fetch into its own memory (object storage): only files are read ahead, for the
        page cache a worker on this machine shares."""
        assert task.prefetch is not None
        try:
            task.prefetch(remote=remote) if remote else task.prefetch()
        except Exception:  # a hint; the read itself reports real problems
            log.debug("readahead for %s failed", task.name, exc_info=True)

    def _admit(self) -> bool:
        """Submit ready tasks while admission allows; False if the best one waits.

        A task that projects nothing is admitted. One that projects bytes reserves them
        in the process's ledger (:data:`tierflow.system.budget.ledger`): when the level
        is below ``high`` and they fit the budget's room beside what every compute
        admitted; when this run has nothing in flight, also when no task of any compute
        runs; and always as the only task in flight of a nested run (see the module
        docstring). Small tasks may queue deeper (:data:`SMALL_TASK`); tasks of a kind
        on the lane are queued there, one at a time while the kind is probed. A device
        task is seated on a GPU first (module docstring, "GPUs"). A cluster's block
        tasks are handed over together at the end (see ``batch``)."""
        self._room = None
        self.seats.levels = None
        lane: list[Any] = []
        with self.batch() if self.batch is not None else contextlib.nullcontext():
            admitted = self._admit_ready(lane)
        if lane:
            if self.lane.extend(lane):
                self.executor.submit(self.lane.job, self.lane.done)
            for i, _, _ in lane:
                if self.tasks[i].prefetch is not None:
                    self._prefetch(self.tasks[i])
        return admitted

    def _admit_ready(self, lane: list[Any]) -> bool:
        """:meth:`_admit`'s loop: submits ready tasks (those of lane kinds to ``lane``);
        False if the best one waits."""
        ready, tasks, needs, limits, kinds, devices = (
            self.ready, self.tasks, self.needs, self.limits, self.kinds, self.devices,
        )  # fmt: skip
        admitted = True
        while ready:
            i = ready[0]
            need = needs[i]
            if self.in_flight >= limits[i]:
                break
            kind = kinds[i]
            if kind is not None and not kind.lane:
                kind = None  # runs on the workers
            if kind is not None and kind.probe_busy():
                break  # probed one at a time, so no other thread slows it down
            if devices[i] is not None and not self.seats.seat(
                i, alone=self.one_always and self.in_flight == 0
            ):
                admitted = False
                break
            if need and not self._reserve(need):
                self.seats.release(i)
                admitted = False
                break
            heapq.heappop(ready)
            if kind is None:
                self._submit(i, tasks[i], need, None)
            else:
                if kind.probing:
                    kind.admitted += 1
                self._submit(i, tasks[i], need, lane)
        return admitted

    def _reserve(self, need: int) -> bool:
        """Reserve ``need`` bytes in the process's ledger for a task, by the rules of
        :meth:`_admit`; False when the task must wait."""
        ledger = budget_module.ledger
        if self.in_flight == 0:
            if self.one_always:
                ledger.force(need)
                return True
            # Alone first: with no other compute running, no room to read.
            if ledger.admit(need, -1, alone=True):
                return True
        if self.level in _HIGH:
            return False
        room = self._room
        if room is None:  # read once per _admit call
            room = self._room = budget_module.budget_bytes() - placement.ram_held()
        return ledger.admit(need, room)

    # -- results ----------------------------------------------------------------------

    def _finished(self, i: int, outcome: Any) -> None:
        # Runs once per task: attributes read once into locals.
        task = self.tasks[i]
        stats = self.stats
        consumers = self.consumers
        self.in_flight -= 1
        need = self.needs[i]
        if need:
            self.running -= need
            budget_module.ledger.finish(need)
        if self.seats.held:
            self.seats.release(i)
        result, seconds = outcome
        held = self.held
        if consumers[i] > 0 and held.hold(i, result):
            stats.peak_bytes = max(stats.peak_bytes, self.running + held.bytes)
        for d in task.deps:
            consumers[d] -= 1
            if consumers[d] == 0:
                held.release(d)
        dependents = self.dependents[i]
        if dependents:
            waiting = self.waiting
            for k in dependents:
                waiting[k] -= 1
                if waiting[k] == 0:
                    heapq.heappush(self.ready, k)
        kind = self.kinds[i]
        if kind is not None:
            kind.observe(seconds)
        done = stats.done = stats.done + 1
        if self.task_done:
            event = TaskFinished(i, task.name, task.rows, seconds, done, len(self.tasks))
            for method in self.task_done:
                method(event)

    def _pressure(self) -> None:
        level = pressure.level_now()
        critical = level is not self.level and level == Level.CRITICAL
        self.level = level
        self.held.relieve(critical)

    # -- the loop ---------------------------------------------------------------------

    def loop(self) -> None:
        n = len(self.tasks)
        while self.stats.done < n:
            self._pressure()
            all_admitted = self._admit()
            if self.in_flight == 0:
                if not all_admitted:
                    # Other computes' tasks hold the budget: wait for them to finish.
                    self._starving()
                    budget_module.ledger.wait_for_room(_WAIT)
                    continue
                raise RuntimeError(
                    f"the scheduler is stuck: {n - self.stats.done} task(s) wait for tasks "
                    "that cannot run (a dependency cycle in the plan)"
                )
            # With a deep queue of small tasks, wake up once half of it is done rather
            # than for every task: the workers keep busy, and each wake-up costs a
            # thread hand-off. Otherwise wake up for every finished task.
            queued = self.in_flight - self.executor.workers
            wake = queued // 2 if queued > 2 * self.executor.workers else 1
            self.waiting_since = None
            for i, outcome, error in self.inbox.take(wake, None if all_admitted else _WAIT):
                if error is not None:
                    self.in_flight -= 1
                    raise error
                self._finished(i, outcome)

    def _starving(self) -> None:
        """Note a wait for other computes' tasks; after :data:`STARVED_SECONDS` of it,
        admit one task at a time whatever they run (they may be waiting for this one)."""
        now = time.perf_counter()
        if self.waiting_since is None:
            self.waiting_since = now
        elif now - self.waiting_since > STARVED_SECONDS:
            self.one_always = True
            log.warning(
                "%s waited %.0f s for other computes' tasks to leave room in the RAM budget "
                "(%s admitted of %s); it now runs one task at a time beyond the budget when "
                "it must. (A running task may be waiting for it: compute inside the task, "
                "not on a thread the task waits for.)",
                self.what or "a compute", now - self.waiting_since,
                format_bytes(budget_module.ledger.admitted),
                format_bytes(budget_module.budget_bytes()),
            )  # fmt: skip

    def cleanup(self) -> None:
        """Give back what the run still has admitted (tasks that did not report, held
        results) and delete its spill files."""
        budget_module.ledger.finish(self.running)
        self.running = 0
        self.seats.release_all()
        self.held.cleanup()


def run(
    tasks: Sequence[Task],
    executor: Executor,
    *,
    keep: set[int] | None = None,
    callbacks: Sequence[Any] = (),
    what: str = "",
) -> tuple[dict[int, Any], Stats]:
    """Run ``tasks`` on ``executor``; the results of the tasks in ``keep`` and the stats.

    Calls ``executor.shutdown(cancel=True)`` on any error or interrupt before raising it
    (see the module docstring); the executor is left running otherwise.
    """
    nested = in_task()
    if nested:
        # A compute started by a task: the workers run that task (maybe this one is
        # one of them), so this compute's tasks run here, one after another.
        executor = SerialExecutor()
    state = _Run(tasks, executor, set(keep or ()), callbacks, what)
    state.one_always = nested
    retries_before = halving.retries()
    started = time.perf_counter()
    error: BaseException | None = None
    for cb in callbacks:
        method = getattr(cb, "start", None)
        if method is not None:
            method(
                ComputeStarted(
                    len(tasks), executor.workers, executor.name, budget_module.budget_bytes(), what
                )
            )
    try:
        state.seats.check()
        state.loop()
        results = state.held.results
        return {i: results[i] for i in state.keep if i in results}, state.stats
    except BaseException as exc:
        error = exc
        state.lane.stop()
        executor.shutdown(cancel=True)
        raise
    finally:
        state.cleanup()
        ended = getattr(executor, "compute_ended", None)
        if ended is not None:  # a cluster's: remove what its workers left in the shared place
            ended()
        state.stats.seconds = time.perf_counter() - started
        state.stats.oom_retries = halving.retries() - retries_before
        state.stats.spilled_bytes = state.held.spilled_bytes
        finished = ComputeFinished(
            len(tasks), state.stats.done, state.stats.seconds, state.stats.peak_bytes,
            state.stats.spilled_bytes, state.stats.oom_retries, error,
        )  # fmt: skip
        for cb in callbacks:
            method = getattr(cb, "finish", None)
            if method is not None:
                try:
                    method(finished)
                except Exception:
                    if error is None:
                        raise
                    log.exception("callback %r raised in finish()", cb)
