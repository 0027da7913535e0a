"""Executors in this process: threads (the default), serial (for debugging), and one
that refuses to run.

All three follow :class:`~tierflow.engine.types.Executor`. NumPy and torch release the
GIL inside their loops, so threads compute in parallel without copying blocks between
processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ....errors import TierflowError
from ....system import devices
from ...types import Done

__all__ = [
    "ComputeForbidden",
    "RaisingExecutor",
    "SerialExecutor",
    "ThreadExecutor",
    "default_workers",
    "in_task",
    "mark_running_tasks",
    "running_task",
]

_task = threading.local()  # .running: this thread runs a task (a worker, or serial submit)


def mark_running_tasks() -> None:
    """Mark the calling thread as one that runs tasks (a worker's)."""
    _task.running = True


@contextlib.contextmanager
def running_task() -> Iterator[None]:
    """Mark the calling thread as running a task while in the block (as it was after)."""
    outer, _task.running = in_task(), True
    try:
        yield
    finally:
        _task.running = outer


def in_task() -> bool:
    """Whether the calling thread is running a task of a compute (then a compute it
    starts is nested in that one)."""
    return getattr(_task, "running", False)


class ComputeForbidden(TierflowError, RuntimeError):
    """Raised by the ``"raise"`` executor: something tried to compute."""


def default_workers() -> int:
    """Cores this process may use (affinity and cgroup CPU quota)."""
    try:
        return max(1, devices.cpu_cores())
    except Exception:
        import os

        return max(1, os.cpu_count() or 1)


class ThreadExecutor:
    """``workers`` threads (default: the usable cores) pulling tasks from one queue.

    Threads start with the first task. ``shutdown(cancel=True)`` drops queued tasks
    without running them and joins the threads once their current task returns. A task
    runs in a copy of the context of the thread that submitted it: context variables
    set there, NumPy's errstate among them, hold in the task.
    """

    name = "threads"

    def __init__(self, workers: int | None = None, *, prefix: str = "tierflow-worker") -> None:
        self.workers = int(workers) if workers is not None else default_workers()
        self.prefix = prefix
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Done] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._cancelled = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        for k in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"{self.prefix}-{k}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        with self._lock:
            if not self._threads:
                self._cancelled = False
                self._start()
        self._queue.put((functools.partial(contextvars.copy_context().run, fn), done))

    def _work(self) -> None:
        _task.running = True
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._cancelled:
                continue
            fn, done = item
            try:
                result = fn()
            except BaseException as exc:  # KeyboardInterrupt too: the scheduler re-raises it
                done(None, exc)
                continue
            done(result, None)

    def shutdown(self, *, cancel: bool = False) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
            if cancel:
                self._cancelled = True
            for _ in threads:
                self._queue.put(None)
        for thread in threads:
            thread.join()

    def __repr__(self) -> str:
        return f"ThreadExecutor(workers={self.workers})"


class SerialExecutor:
    """Runs each task at once, in the calling thread (tracebacks and debuggers work)."""

    name = "serial"
    workers = 1

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        outer, _task.running = in_task(), True
        try:
            result = fn()
        except BaseException as exc:
            done(None, exc)
            return
        finally:
            _task.running = outer
        done(result, None)

    def shutdown(self, *, cancel: bool = False) -> None:
        return None


class RaisingExecutor:
    """Refuses every task with :class:`ComputeForbidden`: proves that nothing computes."""

    name = "raise"
    workers = 1

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        raise ComputeForbidden(
            "a compute started while computing is forbidden (executor 'raise', set by "
            "use_executor('raise')): building a pipeline must not run it"
        )

    def shutdown(self, *, cancel: bool = False) -> None:
        return None
