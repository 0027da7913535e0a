"""Contracts of the engine layer: executors, callbacks, tasks and their events.

The scheduler (:mod:`tierflow.engine.runtime.scheduler`) runs a :class:`Task` graph; it does not
know how tasks run. An :class:`Executor` runs them: ``submit(fn, done)`` starts ``fn()``
somewhere and calls ``done(result, error)`` when it has finished (from any thread);
``shutdown(cancel=True)`` drops tasks not started yet and returns once none is running.
Threads (the default), a serial executor for debugging and one that raises if anything
computes (laziness tests) live in :mod:`tierflow.engine.runtime.executors`; a distributed engine
plugs in the same way.

A :class:`Callback` sees a compute start, every task finish, and the compute finish;
the progress bar is one (:mod:`tierflow.engine.observe.progress`). Callbacks are called on the
thread that called ``compute``, one at a time, so they need no lock. A callback that is
also a :class:`Tracer` (the profiler, :mod:`tierflow.engine.observe.profile`) follows each task
where it runs: its worker, its start and end, what happened inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BlockIndex",
    "Callback",
    "ComputeFinished",
    "ComputeStarted",
    "Done",
    "Executor",
    "Request",
    "RowRange",
    "Task",
    "TaskExecutor",
    "TaskFinished",
    "TaskMemory",
    "Tracer",
]

Done = Callable[[Any, "BaseException | None"], None]
"""``done(result, error)``: how an executor reports a finished task (error None on success)."""


@runtime_checkable
class Executor(Protocol):
    """Runs the scheduler's tasks.

    ``workers`` is how many tasks run at once (the scheduler keeps about two per worker
    in flight). ``submit`` must not run ``done`` before ``fn`` has returned or raised,
    and must report every submitted task exactly once unless ``shutdown(cancel=True)``
    dropped it. ``fn`` catches nothing itself: an exception it raises, including
    ``KeyboardInterrupt``, goes to ``done`` as ``error``.
    """

    name: str
    workers: int

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        """Run ``fn()`` and then ``done(result, error)``."""
        ...

    def shutdown(self, *, cancel: bool = False) -> None:
        """Stop: drop unstarted tasks when ``cancel``; return once nothing runs."""
        ...


@runtime_checkable
class TaskExecutor(Executor, Protocol):
    """An executor that also runs block tasks described as data, in other processes.

    ``submit_task(desc, done)`` runs the :class:`~tierflow.engine.program.tasks.BlockTask`
    ``desc`` somewhere that sees the same paths (shipping its program there first,
    from :func:`~tierflow.engine.program.tasks.program_bytes`) and calls ``done(outcome,
    error)`` with ``outcome = (BlockResult, seconds)``. ``submit(fn, done)`` runs the
    driver's own tasks (finishing a reduction, committing a file) in this process.

    An executor whose ``admits_memory`` is true (a cluster's,
    :mod:`tierflow.engine.runtime.executors.cluster`) admits block tasks itself, against the
    budget of the worker that runs each: the scheduler does not count them against
    this process's budget and calls ``submit_task(desc, done, need)`` with the task's
    projected bytes.
    """

    def submit_task(self, desc: Any, done: Done) -> None:
        """Run the block task ``desc`` and then ``done((result, seconds), error)``."""
        ...


@dataclass(frozen=True, slots=True)
class RowRange:
    """Rows ``start:stop`` of a node whose row counts are known."""

    start: int
    stop: int

    def __reduce__(self) -> tuple[Any, ...]:  # a slotted dataclass pickles slowly
        return (RowRange, (self.start, self.stop))


@dataclass(frozen=True, slots=True)
class BlockIndex:
    """Block ``index`` of a node whose row counts are known only once it is computed."""

    index: int

    def __reduce__(self) -> tuple[Any, ...]:
        return (BlockIndex, (self.index,))


Request = RowRange | BlockIndex
"""What a step is asked for: rows by position, or a block by number."""


@dataclass(frozen=True, slots=True)
class TaskMemory:
    """The projected bytes of one task, as the scheduler admits it.

    ``inputs``: blocks the task reads (file pages it faults in, blocks held for it);
    ``outputs``: blocks it creates (its result, or scratch it writes a sink from);
    ``temps``: scratch its operators allocate while they run (``temp_bytes``).
    """

    inputs: int = 0
    outputs: int = 0
    temps: int = 0

    @property
    def total(self) -> int:
        """``inputs + outputs + temps`` in bytes."""
        return self.inputs + self.outputs + self.temps

    def __add__(self, other: TaskMemory) -> TaskMemory:
        return TaskMemory(
            self.inputs + other.inputs, self.outputs + other.outputs, self.temps + other.temps
        )


@dataclass(eq=False, slots=True)
class Task:
    """One unit of work of a compute.

    ``fn(*args, *results)`` gets ``args`` and the results of ``deps`` (task indices, in
    that order) and
    returns this task's result, which the scheduler holds until every task that depends
    on it has finished. ``after`` are tasks that must finish first without passing
    their results (so they are not held for this one). ``memory`` is the projection
    admission uses. ``prefetch``, if
    any, is called when the task is submitted (readahead of its source blocks;
    ``remote=True`` when the task runs in another process).
    ``rows`` is for progress reports; ``name`` says what the task does (``"block 3 of
    sum"``).

    A block task (``block`` True, ``args == (index, request)``) can also travel as data
    to another process (:mod:`tierflow.engine.program.tasks`): ``program`` is the pass's
    program, or None when it is the first item of the result of the task's only
    dependency (a pass whose program binds computed values is made by a ``prepare``
    task).

    A device task (``device`` set) runs on a GPU and is also admitted against that
    GPU's budget (:mod:`tierflow.system.device_budget`): ``device`` is ``"cuda"`` (any
    GPU, the one with the most room at admission) or ``"cuda:N"``; ``device_bytes`` is
    what it projects there (blocks in, result out, the function's own tensors).
    """

    name: str
    fn: Callable[..., Any]
    deps: tuple[int, ...] = ()
    memory: TaskMemory = field(default_factory=TaskMemory)
    prefetch: Callable[..., None] | None = None
    rows: int = 0
    after: tuple[int, ...] = ()
    args: tuple[Any, ...] = ()
    block: bool = False
    program: Any = None
    device: str | None = None
    device_bytes: int = 0


@dataclass(frozen=True)
class ComputeStarted:
    """A compute is about to run ``tasks`` tasks on ``workers`` workers of ``executor``,
    within ``budget`` bytes of RAM; ``what`` names the results."""

    tasks: int
    workers: int
    executor: str
    budget: int
    what: str


@dataclass(slots=True)
class TaskFinished:
    """Task ``index`` (``name``, ``rows`` rows) finished after ``seconds``; ``done`` of
    ``total`` tasks have finished so far.

    Not frozen: one is built per task, and a frozen dataclass's ``__init__`` costs four
    times as much (2 us against 0.5 us). Treat it as read-only all the same."""

    index: int
    name: str
    rows: int
    seconds: float
    done: int
    total: int


@dataclass(frozen=True)
class ComputeFinished:
    """A compute ended after ``seconds``: ``done`` of ``tasks`` tasks ran, ``error`` is
    what stopped it (None on success). ``peak_bytes`` is the most projected memory that
    was admitted at once (running tasks plus held results), ``spilled_bytes`` what was
    moved to the SSD under pressure, ``oom_retries`` how many operator calls were
    retried on halves after running out of memory."""

    tasks: int
    done: int
    seconds: float
    peak_bytes: int
    spilled_bytes: int
    oom_retries: int
    error: BaseException | None = None


@runtime_checkable
class Callback(Protocol):
    """Custom reporting of computes: ``start``, ``task_done`` per task, ``finish``.

    Called on the thread that called ``compute``; a callback that raises stops the
    compute like a failing task.
    """

    def start(self, event: ComputeStarted) -> None: ...

    def task_done(self, event: TaskFinished) -> None: ...

    def finish(self, event: ComputeFinished) -> None: ...


@runtime_checkable
class Tracer(Protocol):
    """A callback that follows every task where it runs (the profiler).

    The scheduler looks for one among a compute's callbacks; with none, it does nothing
    more per task. ``wrap(index, task, fn)`` is called on the scheduler's thread when
    task ``index`` is submitted to run in this process, and returns what runs instead
    of ``fn`` (on a worker: it must be thread-safe and call ``fn`` with the same
    arguments). ``landed(index, task, outcome)`` is called, on the thread that received
    it, for a block task another process ran: ``outcome`` is ``(BlockResult, seconds)``
    as the executor reported it (the result's ``trace`` names the worker and what
    happened in the task). ``spilled(index, nbytes)``: the scheduler moved the held
    result of task ``index`` to the SSD.
    """

    def wrap(self, index: int, task: Task, fn: Callable[..., Any]) -> Callable[..., Any]: ...

    def landed(self, index: int, task: Task, outcome: Any) -> None: ...

    def spilled(self, index: int, nbytes: int) -> None: ...


def callback_list(callbacks: Any) -> Sequence[Any]:
    """``callbacks`` as a list: None, one callback, or an iterable of them."""
    if callbacks is None:
        return []
    if isinstance(callbacks, (list, tuple)):
        return list(callbacks)
    return [callbacks]
