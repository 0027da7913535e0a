"""A background watcher: read the pressure every few seconds and call back when it is high.

:func:`level_now` only reads when something allocates. A long computation that
allocates nothing new (a torch model over a memory-mapped file, another process filling
the container) needs somebody to look: ``on_pressure`` starts a daemon thread that does.

Each tick the watcher takes a fresh reading, passes its level to
:func:`tierflow.system.pressure.notify` (so pools and stores react as they would to
:func:`~tierflow.system.pressure.level_now`), and calls ``fn(reading)`` when the level is
at least the one asked for: at once, then every ``repeat`` seconds while it lasts. When
the level drops below, the episode ends and the next one calls ``fn`` at once again.
"""

from __future__ import annotations

import html
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from . import pressure as _pressure
from .pressure import Pressure
from .types import Level

__all__ = ["Watcher", "on_pressure"]

log = logging.getLogger(__name__)


def _seconds(name: str, value: object, hint: str = "") -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name}={value!r} must be a positive number of seconds{hint}")
    return float(value)


class Watcher:
    """A running pressure watcher; :func:`on_pressure` makes one.

    ``stop()`` ends it; used as a context manager it stops on exit. ``calls`` counts
    the calls of ``fn``, ``errors`` those that raised, ``last`` is the latest reading
    (None before the first). The thread is a daemon, so it never keeps the process alive.
    """

    def __init__(
        self,
        fn: Callable[[Pressure], Any],
        level: Level,
        every: float,
        repeat: float | None,
    ) -> None:
        self.fn = fn
        self.level = level
        self.every = every
        self.repeat = repeat
        self.calls = 0
        self.errors = 0
        self.last: Pressure | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tierflow-pressure-watch({level})", daemon=True
        )

    def _start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the watcher thread is alive."""
        return self._thread.is_alive()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the watcher and wait up to ``timeout`` seconds for its thread to end.

        Returns at once between ticks; waits only for a call of ``fn`` in progress.
        Safe to call twice, and from within ``fn`` (it then does not wait for itself).
        Logs a warning if ``fn`` is still running after ``timeout``.
        """
        self._stop.set()
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "pressure watcher still running %.1f s after stop(): %r has not returned",
                timeout,
                self.fn,
            )

    def __enter__(self) -> Watcher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _describe(self) -> str:
        repeat = "once per episode" if self.repeat is None else f"repeat {self.repeat:g} s"
        state = "running" if self.running else "stopped"
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        return (
            f"{name} at level >= {self.level.value}, every {self.every:g} s, {repeat}; "
            f"{state}, {self.calls} calls, {self.errors} errors"
        )

    def __repr__(self) -> str:
        return f"<Watcher {self._describe()}>"

    def _repr_html_(self) -> str:
        last = "no reading yet" if self.last is None else str(self.last)
        return (
            f"<b>pressure watcher</b>: {html.escape(self._describe())}<br>"
            f"last reading: {html.escape(last)}"
        )

    def _run(self) -> None:
        fired_at: float | None = None  # time of the last call of fn in this episode
        failing = False
        while not self._stop.is_set():
            try:
                reading = _pressure.pressure()
            except Exception:
                # read_memory does not raise for bad files; this is unexpected, so say it
                # once per failure streak and keep watching
                log.log(
                    logging.DEBUG if failing else logging.WARNING,
                    "pressure watcher cannot read memory pressure; retrying in %g s",
                    self.every,
                    exc_info=True,
                )
                failing = True
                self._stop.wait(self.every)
                continue
            failing = False
            self.last = reading
            _pressure.notify(reading.level)
            if reading.level >= self.level:
                now = time.monotonic()
                due = fired_at is None or (
                    self.repeat is not None and now - fired_at >= self.repeat
                )
                if due:
                    fired_at = now
                    self._call(reading)
            else:
                fired_at = None
            self._stop.wait(self.every)

    def _call(self, reading: Pressure) -> None:
        self.calls += 1
        try:
            self.fn(reading)
        except Exception:
            self.errors += 1
            log.exception("pressure watcher: %r raised; the watcher keeps running", self.fn)


def on_pressure(
    fn: Callable[[Pressure], Any],
    level: Level | str = "high",
    every: float = 1,
    repeat: float | None = 10,
) -> Watcher:
    """Call ``fn(reading)`` from a background thread whenever memory pressure is high.

    Reads the pressure every ``every`` seconds; when its level is ``level`` or worse,
    calls ``fn`` with the :class:`~tierflow.system.pressure.Pressure` reading at once and
    again every ``repeat`` seconds while it lasts (``repeat=None``: once per episode).
    Every reading's level is also passed to :func:`tierflow.system.pressure.notify`, so
    subscribers react to it. An exception in ``fn`` is logged and the watcher keeps
    running. Returns the started :class:`Watcher`; call ``.stop()`` or use it in a
    ``with`` block.

    Raises ``TypeError`` if ``fn`` is not callable and ``ValueError`` for an unknown
    level name or a non-positive ``every``/``repeat``.

    >>> with on_pressure(print, level="critical", every=5):  # doctest: +SKIP
    ...     run_big_job()
    """
    if not callable(fn):
        raise TypeError(
            f"on_pressure needs a function fn(reading) to call, got {type(fn).__name__} {fn!r}"
        )
    watched = Level.parse(level)
    every_s = _seconds("every", every)
    repeat_s = None if repeat is None else _seconds("repeat", repeat, " (or None: once)")
    watcher = Watcher(fn, watched, every_s, repeat_s)
    watcher._start()
    return watcher
