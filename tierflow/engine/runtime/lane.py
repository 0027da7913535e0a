"""The scheduler's threads: the inbox workers report to, and the lane of tiny tasks.

Workers touch only what is here: they put ``(task, result, error)`` into an
:class:`Inbox`, and a :class:`Lane` job runs queued tiny tasks one after another. A
:class:`Kind` times the tasks of one ``fn`` to tell whether they belong on the lane
(:mod:`tierflow.engine.runtime.scheduler`'s docstring, "Tiny tasks").
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from time import perf_counter
from typing import Any

__all__ = ["LANE_PROBE", "NOBODY", "TINY_TASK_SECONDS", "Inbox", "Kind", "Lane"]

# Tasks faster than this run one at a time on the lane (the scheduler's docstring, "Tiny
# tasks"). As the probe times ((x + 1) * 2 - 3).sum(0) on a worker: blocks of 1,000 rows
# take 60-100 us and 16,000 rows 85-110 us (both faster on one worker), 64,000 rows
# 140-180 us (faster on two).
TINY_TASK_SECONDS = 150e-6
LANE_PROBE = 7  # tasks of a kind timed, one at a time, before the kind is judged
NOBODY = 1 << 62  # the inbox's ``wanted`` while the scheduler is not waiting
# The longest the scheduler's thread waits at once: a signal (Ctrl-C) is handled in the
# main thread, which must wake up to run it when the kernel delivered it to another.
_SIGNAL_SLICE = 0.25


class Inbox:
    """Finished tasks, put by workers and taken by the scheduler in batches.

    A put is a deque append (atomic under the GIL) and takes no lock unless the
    scheduler waits for enough items to have come in, or the item is an error: a worker
    finishing a small task while the scheduler is busy pays no lock and no wake-up.
    ``take(n, timeout)`` waits until ``n`` items (or one error) are in, or ``timeout``
    seconds have passed. No wake-up is lost: the scheduler publishes ``wanted`` before
    it counts the items, a worker appends before it reads ``wanted``, so one of them sees
    the other; and the notify needs the condition's lock, which the scheduler holds from
    publishing until ``wait`` releases it.
    """

    def __init__(self) -> None:
        self.items: collections.deque[tuple[int, Any, BaseException | None]] = collections.deque()
        self.wanted = NOBODY
        self.failed = False
        self.cond = threading.Condition(threading.Lock())

    def put(self, item: tuple[int, Any, BaseException | None]) -> None:
        self.items.append(item)
        if item[2] is not None:
            self.failed = True
            with self.cond:
                self.cond.notify()
        elif len(self.items) >= self.wanted:
            with self.cond:
                self.cond.notify()

    def take(self, n: int, timeout: float | None) -> list[tuple[int, Any, BaseException | None]]:
        items = self.items
        if len(items) < n and not self.failed:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self.cond:
                self.wanted = n
                while len(items) < n and not self.failed:
                    left = _SIGNAL_SLICE if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        break
                    # In slices: a Ctrl-C that the kernel hands to another thread runs
                    # its handler here only once this thread runs Python code again.
                    self.cond.wait(min(left, _SIGNAL_SLICE))
                self.wanted = NOBODY
        pop = items.popleft
        return [pop() for _ in range(len(items))]


class Kind:
    """Tasks of one ``fn`` that may run on the lane: where they run and how long they take.

    Scheduler thread only."""

    __slots__ = ("admitted", "lane", "mean", "probing", "samples")

    def __init__(self) -> None:
        self.lane = True  # probed on the lane first
        self.probing = True
        self.samples: list[float] = []
        self.admitted = 0
        self.mean = 0.0

    def probe_busy(self) -> bool:
        """Whether a probed task of this kind is still running (probes run one at a time)."""
        return self.probing and self.admitted > len(self.samples)

    def observe(self, seconds: float) -> None:
        """Time one finished task: judge the kind after :data:`LANE_PROBE` tasks, then
        move it when its running mean leaves a wide band around the threshold (times on
        the workers are longer: they share the GIL)."""
        if self.probing:
            samples = self.samples
            samples.append(seconds)
            # The first task of a kind pays for warming up (buffers, caches): left out.
            slow = sum(1 for t in samples[1:] if t > 2 * TINY_TASK_SECONDS)
            if len(samples) >= LANE_PROBE or slow >= 2:  # slow kinds need no full probe
                self.probing = False
                self.mean = statistics.median(samples[1:])
                self.lane = self.mean < TINY_TASK_SECONDS
            return
        self.mean += (seconds - self.mean) / 8
        if self.lane:
            if self.mean > 2 * TINY_TASK_SECONDS:
                self.lane = False
        elif self.mean < TINY_TASK_SECONDS / 2:
            self.lane = True


class Lane:
    """Tiny tasks, run in turn by one executor job at a time (the scheduler's docstring).

    The scheduler appends with :meth:`extend`; the job pops until the queue is empty.
    ``lock`` guards ``active``: a job that finds the queue empty ends under it, so a
    task appended meanwhile makes the scheduler submit a new job rather than wait in a
    queue nobody runs. A task's error ends the job and the lane (no job starts again);
    :meth:`stop` drops the tasks left.
    """

    def __init__(self, inbox: Inbox) -> None:
        self.queue: collections.deque[tuple[int, Any, tuple[Any, ...]]] = collections.deque()
        self.lock = threading.Lock()
        self.active = False
        self.put = inbox.put

    def extend(self, items: list[tuple[int, Any, tuple[Any, ...]]]) -> bool:
        """Queue ``items``; True when no job runs them yet and one must be submitted."""
        with self.lock:
            self.queue.extend(items)
            if self.active:
                return False
            self.active = True
            return True

    def job(self) -> None:
        """Run queued tasks until none is left (on an executor's worker)."""
        queue, put = self.queue, self.put
        while True:
            try:
                i, fn, args = queue.popleft()
            except IndexError:
                with self.lock:
                    if not queue:
                        self.active = False
                        return
                continue
            start = perf_counter()
            try:
                result = fn(*args)
            except BaseException as exc:  # KeyboardInterrupt too: the scheduler re-raises it
                # ``active`` stays set: the run ends with this error, and no new job
                # may start on the tasks still queued.
                put((i, None, exc))
                return
            put((i, (result, perf_counter() - start), None))

    def done(self, result: Any, error: BaseException | None) -> None:
        """The job's report: tasks report themselves; only a failing job is news."""
        if error is not None:
            self.put((-1, None, error))

    def stop(self) -> None:
        """Drop the tasks not started; the running one finishes."""
        self.queue.clear()
