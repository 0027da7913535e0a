"""Profiles: what a compute did, task by task, and how memory tracked the budget.

::

    with tw.profile() as p:               # every compute in the block is recorded
        mean, std = tw.compute(x.mean(axis=0), x.std(axis=0))
        ((x - mean) / std).to_npy("z.npy")
    p.plot()                              # task stream by worker over memory by tier
    p.save("run.html")                    # one self-contained file
    p.summary()                           # the figures

``compute(..., profile=True)`` (and ``to_npy``, ``to_zarr``, ``persist``) records one
compute into the profile of the enclosing ``with`` block, or into a new one that
:func:`last_profile` returns; ``profile=p`` records into the :class:`Profile` ``p``;
``profile=False`` records nothing, even inside a ``with`` block.

What is recorded
----------------
* Every task (:class:`TaskRecord`): its kind (``block``, ``append``, ``finish``, ...),
  the worker that ran it (a thread's name, a worker process's name, a Dask or Ray
  worker's host and pid), start and end, rows, projected bytes, the tier its result
  lives in (RAM, SSD, GPU; ``-`` for none, ``value`` for a small value), and what
  happened inside it: halvings (operator calls retried on halves after running out of
  memory), spills (arrays it made that went to the SSD, and its result moved there by
  the scheduler), cache hits. A task in another process is timed there; its end is when
  the driver received it, its start that less its duration.
* Every :data:`INTERVAL` seconds, on a sampler thread, and at the end of every compute
  (:class:`Sample`): this process's resident memory (:mod:`tierflow.system.resident`:
  RSS, anonymous, file-backed), what tierflow holds per tier (RAM: arrays of
  ``memory.array`` and the most bytes the schedulers admitted at once since the
  previous sample, as the budget counts them, so that a compute shorter than the
  interval still shows; SSD: live spill files; GPU: device tasks' bytes and blocks kept
  there), the RAM budget, the pressure level as last recorded, and the resident memory
  of the processes executor's worker processes. Dask and Ray workers are not sampled:
  only the driver is.
* Every compute (:class:`ComputeRecord`): what it computed, its executor and workers,
  its plan (stages, passes, :func:`~tierflow.engine.planning.plan.describe`), its peak, spills,
  halvings and error.

How it hooks in
---------------
A compute being recorded gets a :class:`Recorder` among its callbacks. It is a
:class:`~tierflow.engine.types.Tracer`: the scheduler hands it each task's function to
wrap (timed, its thread named, a :mod:`tierflow.system.tally` open around it), and the
outcome of each task another process ran. Without a recorder the scheduler only checks,
per task, that there is none: the cost of profiling when it is off is within noise
(docs/benchmarks.md). The sampler thread runs only while a profile records.

The pictures and figures are drawn by :mod:`tierflow.engine.observe.report`.
"""

from __future__ import annotations

import bisect
import contextvars
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np

from ...storage import device_store, placement, spill
from ...system import budget as budget_module
from ...system import device_budget, pressure, tally
from ...system.resident import resident
from ..program.roots import SharedBlock
from ..types import ComputeFinished, ComputeStarted, Task

__all__ = [
    "INTERVAL",
    "ComputeRecord",
    "Profile",
    "Recorder",
    "Sample",
    "TaskRecord",
    "last_profile",
    "profile",
    "recorder_for",
]

log = logging.getLogger("tierflow.engine")

INTERVAL = 0.05  # seconds between samples
KINDS = ("block", "prepare", "append", "commit", "assemble", "finish")  # else "value"


@dataclass(slots=True)
class TaskRecord:
    """One task as it ran; times in seconds since the profile started, sizes in bytes."""

    compute: int  # which compute of the profile (0, 1, ...)
    index: int  # the task's number in its plan
    name: str
    kind: str
    worker: str
    start: float
    end: float
    rows: int
    projected: int  # inputs + outputs + scratch, as admission counted them
    inputs: int  # of which the blocks it reads
    tier: str  # where its result lives: RAM, SSD, GPU, "value" or "-"
    halvings: int = 0
    spills: int = 0
    spilled_bytes: int = 0
    cache_hits: int = 0
    error: bool = False


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading, ``t`` seconds after the profile started; sizes in bytes.

    ``rss``, ``anon`` and ``file``: this process's resident memory
    (:mod:`tierflow.system.resident`); ``ram``, ``ssd``, ``gpu``: what tierflow holds
    there (in RAM, what the schedulers admitted is the most at once since the previous
    sample); ``budget``: the RAM budget; ``level``: the pressure level's name;
    ``workers_rss``: the resident memory of the worker processes of a processes
    executor (0 for others)."""

    t: float
    rss: int
    anon: int
    file: int
    ram: int
    ssd: int
    gpu: int
    budget: int
    level: str
    workers_rss: int = 0


@dataclass
class ComputeRecord:
    """One compute: what it computed, how it ran and its plan."""

    number: int
    what: str = ""
    executor: str = ""
    workers: int = 0
    budget: int = 0
    tasks: int = 0  # in its plan
    start: float = 0.0
    end: float = 0.0
    stages: int = 0
    passes: list[tuple[str, int]] = field(default_factory=list)  # (name, blocks)
    plan: str = ""  # describe(plan)
    stage_starts: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    spilled_bytes: int = 0
    oom_retries: int = 0
    error: str | None = None
    # Each fused reduction's compiled kernel: how it ran, or why it did not; and the
    # kernels' generated sources by key.
    kernels: list[str] = field(default_factory=list)
    kernel_sources: dict[str, str] = field(default_factory=dict)

    def stage_of(self, index: int) -> int:
        """The stage of task ``index`` of this compute's plan."""
        return max(0, bisect.bisect_right(self.stage_starts, index) - 1)


def tier_of(value: Any) -> str:
    """Where ``value``'s bytes live: ``RAM``, ``SSD`` (a spill file or another mapped
    file), ``GPU``, ``value`` (something else: a partial result), or ``-`` (nothing).
    For a tuple, where its biggest array lives."""
    if value is None:
        return "-"
    if isinstance(value, np.ndarray):
        if isinstance(value, np.memmap) or spill.spill_file_of(value) is not None:
            return "SSD"
        return "RAM"
    if isinstance(value, (tuple, list)):
        arrays = [v for v in value if v is not None]
        if not arrays:
            return "-"
        return tier_of(max(arrays, key=lambda v: int(getattr(v, "nbytes", 0) or 0)))
    device = getattr(value, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        return "GPU"
    if isinstance(value, SharedBlock):  # a block a cluster worker wrote to a file
        return "SSD"
    if hasattr(value, "__array__") and hasattr(value, "nbytes"):
        return "RAM"
    return "value"


def _kind(name: str) -> str:
    head = name.split(" ", 1)[0]
    return head if head in KINDS else "value"


def _record(  # noqa: PLR0913 -- one task's facts, each from a different place
    number: int,
    index: int,
    task: Task,
    worker: str,
    when: tuple[float, float],
    tier: str,
    counts: dict[str, int],
) -> TaskRecord:
    get = counts.get
    return TaskRecord(  # by position: a record per task, and keywords cost twice as much
        number, index, task.name, _kind(task.name), worker, when[0], when[1], task.rows,
        task.memory.total, task.memory.inputs, tier,
        get("halvings", 0), get("spills", 0), get("spilled_bytes", 0), get("cache_hits", 0),
    )  # fmt: skip


def kernel_report(programs: list[Any]) -> tuple[list[str], dict[str, str]]:
    """One line per fused reduction of ``programs``: its compiled kernel's state and the
    blocks each path ran (in this process: worker processes keep their own counts), or
    why it ran on the NumPy path; and the kernels' sources by key."""
    lines: list[str] = []
    sources: dict[str, str] = {}
    for program in programs:
        found = [(s.label(), s.op) for s in program.steps() if hasattr(s, "op")]
        found += [(r.label, r.chunker) for r in program.reductions]
        for label, op in found:
            slot = getattr(op, "compiled", None)
            if slot is not None:
                counts = ", ".join(f"{n} {what}" for what, n in slot.counts.items())
                lines.append(f"{label}: kernel {slot.key} {slot.describe()}; blocks: {counts}")
                sources[slot.key] = slot.source.text
            elif getattr(op, "not_compiled", None):
                lines.append(f"{label}: NumPy path: {op.not_compiled}")
    return lines, sources


class Recorder:
    """Records one compute into a :class:`Profile`: a callback and a tracer
    (:class:`~tierflow.engine.types.Tracer`; see the module docstring)."""

    def __init__(self, owner: Profile, record: ComputeRecord, executor: Any) -> None:
        self.profile = owner
        self.record = record
        self.executor = executor
        self._programs: list[Any] = []
        self._spilled: dict[int, int] = {}  # task -> bytes the scheduler spilled

    # -- the plan, from the compute --

    def planned(self, plan: Any, text: str) -> None:
        """Keep the plan's shape: stages, passes and its description."""
        r = self.record
        r.what = plan.what
        r.stages = plan.stages
        r.passes = [(p.name, p.count) for p in plan.programs]
        r.plan = text
        r.stage_starts = list(getattr(plan, "stage_starts", []))
        self._programs = list(plan.programs)

    # -- callback --

    def start(self, event: ComputeStarted) -> None:
        r = self.record
        r.start = self.profile.now()
        r.executor, r.workers, r.budget = event.executor, event.workers, event.budget
        r.tasks = event.tasks
        r.what = r.what or event.what
        pids = getattr(self.executor, "worker_pids", None)
        self.profile._worker_pids = pids if callable(pids) else None

    def task_done(self, event: Any) -> None:
        return None  # tasks are recorded where they run

    def finish(self, event: ComputeFinished) -> None:
        self.profile.sample_quietly()  # every compute's end, its worker processes still here
        r = self.record
        r.kernels, r.kernel_sources = kernel_report(self._programs)
        r.end = self.profile.now()
        r.peak_bytes, r.spilled_bytes = event.peak_bytes, event.spilled_bytes
        r.oom_retries = event.oom_retries
        r.error = None if event.error is None else f"{type(event.error).__name__}: {event.error}"
        if self._spilled:
            for t in self.profile.tasks:
                if t.compute == r.number and t.index in self._spilled:
                    t.spills += 1
                    t.spilled_bytes += self._spilled[t.index]
        self.profile._worker_pids = None

    # -- tracer --

    def wrap(self, index: int, task: Task, fn: Callable[..., Any]) -> Callable[..., Any]:
        records = self.profile.tasks
        number, t0 = self.record.number, self.profile.t0

        def traced(*args: Any) -> Any:
            start = perf_counter()
            result: Any = None
            failed = True
            try:
                with tally.counting() as counts:
                    result = fn(*args)
                failed = False
                return result
            finally:
                end = perf_counter()
                tier = "-" if failed else tier_of(result)
                worker = threading.current_thread().name
                record = _record(number, index, task, worker, (start - t0, end - t0), tier, counts)
                record.error = failed
                records.append(record)  # atomic: workers need no lock

        return traced

    def landed(self, index: int, task: Task, outcome: Any) -> None:
        end = self.profile.now()
        result, seconds = outcome
        worker, counts = "worker process", ()
        trace = getattr(result, "trace", ())
        if trace:
            worker, counts = trace
        blocks = getattr(result, "blocks", ())
        tier = tier_of(tuple(blocks)) if blocks else "-"
        when = (max(0.0, end - float(seconds)), end)
        self.profile.tasks.append(
            _record(self.record.number, index, task, str(worker), when, tier, dict(counts))
        )

    def spilled(self, index: int, nbytes: int) -> None:
        self._spilled[index] = self._spilled.get(index, 0) + nbytes


class Profile:
    """What computes did: tasks, memory samples and plans (see the module docstring).

    Use it as ``with tw.profile() as p:`` (or ``with Profile() as p:``), or pass it as
    ``profile=p`` to computes. ``interval`` is the seconds between memory samples.
    ``plot()``, ``save(path)``, ``summary()`` and the notebook view read what was
    recorded so far (:mod:`tierflow.engine.observe.report`).
    """

    def __init__(self, interval: float = INTERVAL) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval}")
        self.interval = interval
        self.t0 = perf_counter()
        self.tasks: list[TaskRecord] = []
        self.samples: list[Sample] = []
        self.computes: list[ComputeRecord] = []
        self._lock = threading.Lock()  # guards _users, _thread, _stop
        self._users = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._worker_pids: Callable[[], list[int]] | None = None
        self._gpus: list[str] | None = None
        self._token: contextvars.Token[Profile | None] | None = None

    def now(self) -> float:
        """Seconds since the profile started."""
        return perf_counter() - self.t0

    # -- recording --

    def recorder(self, executor: Any) -> Recorder:
        """A recorder for the next compute (run on ``executor``)."""
        record = ComputeRecord(len(self.computes))
        self.computes.append(record)
        return Recorder(self, record, executor)

    def sample(self) -> Sample:
        """Take one sample now and keep it."""
        if self._gpus is None:
            try:
                self._gpus = list(device_budget.budgets())
            except Exception:  # a GPU library that fails to answer: no GPU column
                self._gpus = []
        mine = resident()
        ledger = budget_module.ledger
        workers_rss = 0
        pids = self._worker_pids
        if pids is not None:
            try:
                workers_rss = sum(resident(pid).rss for pid in pids())
            except Exception:  # a pool that is shutting down
                workers_rss = 0
        gpu = sum(device_budget.ledger.admitted(d) + device_store.held_on(d) for d in self._gpus)
        taken = Sample(
            self.now(),
            mine.rss,
            mine.anon,
            mine.file,
            placement.ram_held() + ledger.most_since(self),
            sum(f.nbytes for f in spill.live_files()),
            gpu,
            budget_module.budget_bytes(),
            pressure.recorded_level().value,
            workers_rss,
        )
        self.samples.append(taken)
        return taken

    def sample_quietly(self) -> None:
        """Take a sample; a reading that fails is logged, never raised: a profile must
        not fail the compute it watches."""
        try:
            self.sample()
        except Exception:
            log.debug("a profile sample failed", exc_info=True)

    def _sampling(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample_quietly()

    def start(self) -> None:
        """Start sampling (again counted: :meth:`stop` as many times ends it)."""
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            self._stop.clear()
            budget_module.ledger.watch(self)
            self.sample_quietly()
            self._thread = threading.Thread(
                target=self._sampling, name="tierflow-profile-sampler", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop sampling once every :meth:`start` has been stopped; takes a last sample."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None:
            thread.join()
        self.sample_quietly()
        with self._lock:
            if self._users == 0:  # not started again meanwhile
                budget_module.ledger.unwatch(self)

    def __enter__(self) -> Profile:
        self.start()
        self._token = _active.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _active.reset(self._token)
            self._token = None
        self.stop()
        global _last
        _last = self

    # -- what you get --

    def summary(self) -> Any:
        """The figures (:class:`~tierflow.engine.observe.report.Summary`): time per stage,
        bytes read and spilled, halvings, peaks per tier and of the RSS."""
        from .report import summarize

        return summarize(self)

    def plot(self, *, width: float = 10.0) -> Any:
        """A matplotlib figure: the task stream by worker over memory by tier, with the
        budget line and pressure bands. Needs matplotlib (the ``plot`` extra)."""
        from .report import plot

        return plot(self, width=width)

    def save(self, path: Any) -> str:
        """Write one self-contained HTML file (the picture inline, the figures, the
        plans; nothing fetched from the network); returns its absolute path."""
        from .report import save

        return save(self, path)

    def _repr_html_(self) -> str:
        from .report import html_fragment

        return html_fragment(self)

    def __repr__(self) -> str:
        return (
            f"<Profile: {len(self.computes)} compute(s), {len(self.tasks)} tasks, "
            f"{len(self.samples)} samples>"
        )


_active: contextvars.ContextVar[Profile | None] = contextvars.ContextVar(
    "tierflow_profile", default=None
)
_last: Profile | None = None


def profile(interval: float = INTERVAL) -> Profile:
    """A profile of every compute in a ``with`` block (see the module docstring).

    >>> import tierflow as tw
    >>> with tw.profile() as p:
    ...     _ = tw.compute(tw.from_array(__import__("numpy").ones((4, 2))).sum())
    >>> len(p.computes)
    1
    """
    return Profile(interval)


def last_profile() -> Profile | None:
    """The profile ``compute(profile=True)`` made last (or the last ``with`` block's)."""
    return _last


def recorder_for(option: Any, executor: Any) -> tuple[Recorder | None, Profile | None]:
    """The recorder a compute with ``profile=option`` uses, and the profile it must
    start and stop itself (one it made, or one passed in); (None, None) when it is not
    recorded. ``option``: None (the enclosing ``with`` block's profile, if any), True
    (that, or a new one), False (none), or a :class:`Profile`."""
    global _last
    if option is False:
        return None, None
    if isinstance(option, Profile):
        return option.recorder(executor), option
    active = _active.get()
    if active is not None:
        return active.recorder(executor), None
    if option is None:
        return None, None
    if option is not True:
        raise TypeError(
            f"profile must be True, False, None or a Profile, got {type(option).__name__}"
        )
    made = _last = Profile()
    return made.recorder(executor), made
