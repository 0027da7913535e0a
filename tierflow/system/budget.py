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
"""

from __future__ import annotations

import logging
import math
import threading

from .. import config
from ..config import GB, MB, format_bytes
from ..errors import ConfigError
from .limits import read_memory

__all__ = ["budget", "budget_bytes"]

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
