"""Progress of a compute: a tqdm bar for computes longer than about a second.

:class:`ProgressBar` is a :class:`~tierflow.engine.types.Callback`. It waits ``delay``
seconds (1 by default) before showing a bar, so quick computes print nothing; it uses
``tqdm.auto``, which is a widget in Jupyter and text in a terminal. ``progress=False``
silences it, ``progress=True`` shows it from the start. Without tqdm installed the
default stays silent, and ``progress=True`` raises an error naming the extra.
"""

from __future__ import annotations

import time
from typing import Any

from ...config import format_bytes
from ...errors import missing_dependency
from ..types import ComputeFinished, ComputeStarted, TaskFinished

__all__ = ["DELAY", "ProgressBar", "progress_callbacks"]

DELAY = 1.0  # seconds a compute runs before its bar appears


def _tqdm() -> Any:
    from tqdm.auto import tqdm

    return tqdm


class ProgressBar:
    """A progress bar over the tasks of a compute, shown after ``delay`` seconds.

    ``file`` is where a text bar goes (stderr by default).
    """

    def __init__(self, delay: float = DELAY, file: Any = None) -> None:
        self.delay = delay
        self.file = file
        self._bar: Any = None
        self._start = 0.0
        self._started: ComputeStarted | None = None

    def start(self, event: ComputeStarted) -> None:
        self._start = time.perf_counter()
        self._started = event
        self._bar = None
        if self.delay <= 0:
            self._open(0)

    def _open(self, done: int) -> None:
        event = self._started
        assert event is not None
        self._bar = _tqdm()(
            total=event.tasks,
            initial=done,
            desc=event.what[:40] or "tierflow",
            unit="task",
            file=self.file,
            leave=True,
            dynamic_ncols=True,
        )

    def task_done(self, event: TaskFinished) -> None:
        if self._bar is None:
            if time.perf_counter() - self._start < self.delay:
                return
            self._open(event.done - 1)
        self._bar.update(1)

    def finish(self, event: ComputeFinished) -> None:
        bar, self._bar = self._bar, None
        if bar is None:
            return
        if event.error is None:
            bar.set_postfix_str(
                f"peak {format_bytes(event.peak_bytes)}"
                + (f", spilled {format_bytes(event.spilled_bytes)}" if event.spilled_bytes else "")
            )
        bar.close()


def progress_callbacks(progress: bool | None) -> list[Any]:
    """The callbacks ``progress=`` asks for: None (a bar after a second, if tqdm is
    installed), True (a bar at once; tqdm required) or False (none)."""
    if progress is False:
        return []
    try:
        _tqdm()
    except ImportError:
        if progress:
            raise missing_dependency("tqdm", "progress", "a progress bar") from None
        return []
    return [ProgressBar(0.0 if progress else DELAY)]
