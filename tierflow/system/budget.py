"""The RAM budget: how many bytes tierflow's big arrays and engine blocks may hold in RAM.

What counts against it: arrays that tierflow places (``memory.array``, spill-backed or
not, decides RAM versus SSD against it) and the blocks the engine holds in flight (the
scheduler admits a task only while its projected bytes fit). Memory the program allocates
on its own, Python objects and the page cache do not count; that is why the default leaves
30 % of the free memory alone.

Where it comes from, first match wins:

1. ``memory.budget(16)`` / ``memory.budget("512MB")`` or ``config.set(ram_budget=...)``;
2. the ``TIERFLOW_RAM_BUDGET`` environment variable (``12GB``, ``512MB`` or bytes);
3. ``budget_fraction`` (0.7) of the free usable memory (:func:`~tierflow.system.limits.read_memory`)
   at first use, then fixed for the process: a budget that followed free memory would
   shrink as tierflow itself fills it. It is at least 64 MB, or half the usable memory
   if that is less (with a warning that memory is short).

:func:`budget_bytes` is called on allocation paths: after the first call it returns a
cached number; a change of ``ram_budget``, ``budget_fraction`` or ``proc_root`` (including
``config.reset()``) drops the cached number.

The budget is one for the process, however many computes run at once: :data:`ledger`
(a :class:`Ledger`) holds the bytes every compute's scheduler admitted against it — the
projections of running tasks and the results held for later tasks — so two computes on
two threads share the budget instead of each filling it (see the scheduler's Admission,
:mod:`tierflow.engine.runtime.scheduler`).
"""

from __future__ import annotations

import logging
import math
import threading

from .. import config
from ..config import GB, MB, format_bytes
from ..errors import ConfigError
from .limits import read_memory

__all__ = ["Ledger", "budget", "budget_bytes", "ledger"]

logger = logging.getLogger("tierflow.system")

# Below this the engine's blocks would be too small to be worth scheduling; a machine
# that is this short of free memory is better served by a small budget than by none.
MIN_DEFAULT_BUDGET = 64 * MB

_SETTINGS = ("ram_budget", "budget_fraction", "proc_root")

_lock = threading.Lock()  # guards _cached; held while the default is computed
_cached: int | None = None


def budget(gb: float | str | None = None) -> int:
    """Read the RAM budget, or set it; returns the budget in bytes.

    ``budget()`` reads it (computing the default at first use). ``budget(16)`` sets 16 GB
    (binary: 16 * 2**30 bytes); a string is a size, ``budget("512MB")``. Setting a budget
    above the usable memory is allowed and logs a warning with both figures. Raises
    :class:`~tierflow.errors.ConfigError` for a value that is not a positive size. Setting
    is the same as ``config.set(ram_budget=...)``: ``config.set(ram_budget=None)`` goes
    back to the default.

    >>> from tierflow import memory
    >>> memory.budget("512MB")
    536870912
    """
    if gb is not None:
        config.set(ram_budget=_to_bytes(gb))
    return budget_bytes()


def budget_bytes() -> int:
    """The current budget in bytes; cheap after the first call (a global read).

    The first call reads the setting, or the free memory for the default; a malformed
    ``TIERFLOW_RAM_BUDGET`` raises :class:`~tierflow.errors.ConfigError` then.
    """
    cached = _cached
    return cached if cached is not None else _compute()


def _to_bytes(gb: float | str) -> int:
    if isinstance(gb, str):
        return config.parse_size(gb, "memory.budget")
    if isinstance(gb, bool) or not isinstance(gb, (int, float)):
        raise ConfigError(
            f"memory.budget({gb!r}): give a number of GB, such as memory.budget(16), "
            f"or a size, such as memory.budget('512MB')"
        )
    if not (gb > 0 and math.isfinite(gb)) or gb * GB < 1:
        raise ConfigError(
            f"memory.budget({gb!r}): the budget must be a positive number of GB, "
            f"such as memory.budget(16) or memory.budget(0.5)"
        )
    return int(gb * GB)


def _compute() -> int:
    global _cached
    with _lock:
        if _cached is not None:
            return _cached
        configured = config.get("ram_budget")
        figures = read_memory()
        if configured is not None:
            value = int(configured)
            if value > figures.usable:
                logger.warning(
                    "memory budget %s is larger than the %s of usable memory (%s); "
                    "the kernel may kill the process before tierflow spills to disk. "
                    "Lower it with memory.budget() or TIERFLOW_RAM_BUDGET",
                    format_bytes(value),
                    format_bytes(figures.usable),
                    figures.source,
                )
        else:
            fraction = config.get("budget_fraction")
            value = int(figures.free * fraction)
            floor = min(MIN_DEFAULT_BUDGET, figures.usable // 2)
            if value < floor:
                logger.warning(
                    "only %s of %s usable memory is free; the RAM budget is %s instead of "
                    "%.0f %% of it. Free memory or set TIERFLOW_RAM_BUDGET",
                    format_bytes(figures.free),
                    format_bytes(figures.usable),
                    format_bytes(floor),
                    fraction * 100,
                )
                value = floor
        _cached = value
        return value


def _on_setting_changed(name: str) -> None:
    global _cached
    if name in _SETTINGS:
        # Under the lock: a computation running now finishes first, then is dropped.
        with _lock:
            _cached = None


config.on_change(_on_setting_changed)


class Ledger:
    """Bytes admitted against the budget by every compute in the process.

    Two kinds: ``running`` (the projections of tasks that run or are queued) and
    ``held`` (results kept for the tasks that take them). A scheduler reserves a task's
    projection before it submits the task (:meth:`admit`, or :meth:`force`), gives it
    back when the task finishes (:meth:`finish`), and moves a result it keeps in and out
    of ``held`` (:meth:`hold`, :meth:`drop`). Every method takes ``_lock`` once: a
    scheduler calls two of them per task. ``peak`` is the most ever admitted at once
    (:meth:`reset_peak` starts it again; tests read it).

    A sampler that reads what is admitted now and then misses what a task held between
    two readings: a compute shorter than the interval would read as nothing. A reader
    that :meth:`watch` es gets, from :meth:`most_since`, the most admitted at once since
    its previous reading instead.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when running bytes go
        self._waiting = 0  # threads in wait_for_room; _lock
        self.running = 0  # _lock
        self.held = 0  # _lock
        self.peak = 0  # _lock
        self._marks: dict[object, int] = {}  # watching reader -> most since it read; _lock

    @property
    def admitted(self) -> int:
        """Bytes admitted now, running and held together."""
        return self.running + self.held

    def admit(self, nbytes: int, room: int, *, alone: bool = False) -> bool:
        """Reserve ``nbytes`` for a task if what is admitted stays within ``room``
        (the budget less RAM held by ``memory.array``), or, with ``alone``, if no task
        of any compute is running; False (nothing reserved) otherwise."""
        with self._lock:
            total = self.running + self.held + nbytes
            if total > room and not (alone and self.running == 0):
                return False
            self.running += nbytes
            self._reached(total)
            return True

    def force(self, nbytes: int) -> None:
        """Reserve ``nbytes`` for a task whatever is admitted already."""
        with self._lock:
            self.running += nbytes
            self._reached(self.running + self.held)

    def finish(self, nbytes: int) -> None:
        """Give back the ``nbytes`` a finished (or dropped) task reserved."""
        with self._lock:
            self.running -= nbytes
            if self._waiting:
                self._idle.notify_all()

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` of a result kept for the tasks that take it."""
        with self._lock:
            self.held += nbytes
            self._reached(self.running + self.held)

    def drop(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` of held results (released, or spilled to the SSD)."""
        with self._lock:
            self.held -= nbytes
            if self._waiting:
                self._idle.notify_all()

    def wait_for_room(self, timeout: float) -> None:
        """Wait until some task's bytes are given back, or ``timeout`` seconds pass
        (a compute with nothing running waits here for the others' tasks)."""
        with self._lock:
            if self.running == 0:
                return
            self._waiting += 1
            try:
                self._idle.wait(timeout)
            finally:
                self._waiting -= 1

    def reset_peak(self) -> None:
        """Start :attr:`peak` again from what is admitted now."""
        with self._lock:
            self.peak = self.running + self.held

    def _reached(self, total: int) -> None:
        """``total`` bytes are admitted now: raise the peak and the readers' marks.
        Caller holds ``_lock``."""
        if total > self.peak:
            self.peak = total
        for reader, most in self._marks.items():  # values change, not keys: safe
            if total > most:
                self._marks[reader] = total

    def watch(self, reader: object) -> None:
        """Keep, for ``reader``, the most admitted at once between its readings (until
        :meth:`unwatch`)."""
        with self._lock:
            self._marks[reader] = self.running + self.held

    def unwatch(self, reader: object) -> None:
        """Stop keeping ``reader``'s mark."""
        with self._lock:
            self._marks.pop(reader, None)

    def most_since(self, reader: object) -> int:
        """The most bytes admitted at once since ``reader``'s previous reading (or its
        :meth:`watch`), what is admitted now included; the next interval starts now.
        For a reader that does not watch: what is admitted now."""
        with self._lock:
            now = self.running + self.held
            most = self._marks.get(reader)
            if most is None:
                return now
            self._marks[reader] = now
            return max(most, now)


ledger = Ledger()  # the process's; every scheduler run admits through it
