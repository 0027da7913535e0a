"""The device the running task was admitted on.

The scheduler admits a task that runs on a GPU against that device's budget and runs it
inside :func:`running_on`; the task's operators read :func:`current_device` to place
their tensors on the same device. The value lives in a context variable, so threads and
nested computes each see their own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["current_device", "running_on"]

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tierflow_current_device", default=None
)


def current_device() -> str | None:
    """``"cuda:N"`` for a task admitted on that GPU, else None."""
    return _current.get()


@contextlib.contextmanager
def running_on(device: str | None) -> Iterator[None]:
    """Run the body as a task admitted on ``device`` (None: on no GPU)."""
    token = _current.set(device)
    try:
        yield
    finally:
        _current.reset(token)
