"""Which GPU the running task was given, and the CUDA stream of its slot.

The scheduler seats a device task on one slot of one GPU
(:mod:`tierflow.system.device_budget`) and runs it inside :func:`running_in_slot`:
:func:`current_device` then names that GPU to everything the task runs
(``map_blocks(device="cuda" | "auto")`` uses it rather than choosing for itself), and
:func:`current_slot` names the slot. Where torch sees CUDA each slot of each GPU has a
``torch.cuda.Stream`` of its own, made on first use, and the task runs under
``torch.cuda.stream(...)``: two tasks on two slots of a GPU can overlap their copies
and kernels. With simulated GPUs (:class:`tierflow.system.devices.FakeGpus`) there is
no stream; the slot is only recorded.

Both are context variables: each worker thread sees its own task's device.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ...system import devices

__all__ = ["current_device", "current_slot", "running_in_slot", "running_on", "slot_stream"]

_device: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tierflow_device", default=None
)
_slot: contextvars.ContextVar[int | None] = contextvars.ContextVar("tierflow_slot", default=None)

_streams_lock = threading.Lock()
_streams: dict[tuple[str, int], Any] = {}  # (device, slot) -> torch.cuda.Stream


def current_device() -> str | None:
    """The GPU (``"cuda:N"``) the running task was admitted on, or None."""
    return _device.get()


def current_slot() -> int | None:
    """The slot of :func:`current_device` the running task took, or None."""
    return _slot.get()


@contextlib.contextmanager
def running_on(device: str | None) -> Iterator[None]:
    """Make :func:`current_device` answer ``device`` inside the block (this context only)."""
    token = _device.set(device)
    try:
        yield
    finally:
        _device.reset(token)


def slot_stream(device: str, slot: int) -> Any:
    """The ``torch.cuda.Stream`` of ``slot`` on ``device``, made on first use; None where
    torch is not imported, sees no CUDA, or the GPUs are simulated."""
    torch = sys.modules.get("torch")
    if torch is None or devices.torch_device(device) == "cpu":
        return None
    if not torch.cuda.is_available():
        return None
    key = (device, slot)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(device=torch.device(device))
    return stream


@contextlib.contextmanager
def running_in_slot(device: str, slot: int) -> Iterator[None]:
    """Run the block as a task seated on ``slot`` of ``device``: :func:`current_device`
    and :func:`current_slot` answer them, and CUDA work goes to the slot's stream (which
    is synchronised before the block ends, so results read afterwards are complete)."""
    token = _slot.set(slot)
    try:
        with running_on(device):
            stream = slot_stream(device, slot)
            if stream is None:
                yield
                return
            import torch

            with torch.cuda.stream(stream):
                yield
            stream.synchronize()
    finally:
        _slot.reset(token)
