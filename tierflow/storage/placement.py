"""Tier placement: ``memory.array`` puts an array in RAM, on the SSD or on a GPU.

Policy, for ``memory.array(shape, dtype, device=...)`` (sizes in bytes):

1. ``device="cuda:N"`` or ``"auto"``: a GPU if the array fits its free memory less a
   margin of ``max(256 MB, 10 % of the GPU's total)`` (room for CUDA contexts, library
   workspaces and the allocator's rounding). ``"auto"`` tries the GPUs with the most
   free memory first; with no GPU it means the host. An array that fits no GPU goes to
   the host, with a debug log line. ``"cuda:N"`` for a GPU that does not exist raises.
2. The host: RAM (``np.zeros``) while the array fits the *remaining budget* (the
   budget, :func:`tierflow.system.budget.budget_bytes`, less the RAM held by live arrays
   made here) and the pressure level (:func:`tierflow.system.pressure.level_now`) is
   below ``high``. Arrays smaller than :data:`SMALL` (1 MB) ignore the pressure level:
   a spill file per tiny array would cost a descriptor and a mapping each for nothing.
3. Otherwise a zero-filled ``np.memmap`` over a reserved spill file
   (:mod:`tierflow.storage.spill`); the same NumPy code runs on both.

Accounting: a RAM array counts against the budget from its creation until
:func:`free` or until its last view is garbage-collected. The table of live arrays is
guarded by ``_lock``; garbage-collection callbacks never take it (they may run inside
a collection on a thread that holds it): they queue the entry, and the next call that
takes the lock settles the queue.
"""

from __future__ import annotations

import functools
import html
import logging
import operator
import re
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex

import numpy as np

from ..config import MB, format_bytes
from ..system import budget, device_budget, devices, pressure, tally
from ..system.types import Level
from . import gpu, spill
from .types import RAM, SSD, GpuBackend, Placement

__all__ = [
    "SMALL",
    "Report",
    "array",
    "free",
    "gpu_margin",
    "on_disk",
    "ram_held",
    "report",
    "request",
]

logger = logging.getLogger(__name__)

SMALL = 1 * MB

_MAX_BYTES = int(np.iinfo(np.intp).max)
_DEVICE_RE = re.compile(r"cuda(?::(\d+))?")

ShapeLike = SupportsIndex | Sequence[SupportsIndex]


def request(shape: ShapeLike, dtype: Any = "float64") -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """Check an allocation request; returns ``(shape, dtype, nbytes)``.

    Raises ``TypeError`` for an unknown dtype, a dtype that holds Python objects (they
    cannot be spilled to a file) or has no size, or a shape that is not integers;
    ``ValueError`` for a negative dimension or more bytes than an array can address.
    """
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"unknown dtype {dtype!r} ({exc}); use a NumPy dtype such as 'float32' or np.int64"
        ) from None
    if dt.hasobject:
        raise TypeError(
            f"dtype {dt} holds Python objects, which cannot be placed in a spill file; "
            "memory.array takes numeric, bool, fixed-size string and structured dtypes "
            "without objects (use np.empty for object arrays)"
        )
    if dt.itemsize == 0:
        raise TypeError(f"dtype {dt} has no size; give one, such as 'S16' or 'U8'")
    dims: Sequence[SupportsIndex]
    if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
        dims = shape
    else:
        dims = (shape,)  # type: ignore[assignment]
    try:
        normal = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(
            f"shape {shape!r} is not an int or a tuple of ints, such as (1000, 8)"
        ) from None
    for d in normal:
        if d < 0:
            raise ValueError(f"negative dimension {d} in shape {normal}")
    count = 1
    for d in normal:
        count *= d
    nbytes = count * dt.itemsize
    if nbytes > _MAX_BYTES:
        raise ValueError(
            f"shape {normal} of {dt} needs {nbytes} bytes, more than the {_MAX_BYTES} "
            "bytes (2**63 - 1) an array can address"
        )
    return normal, dt, nbytes


def gpu_margin(total: int) -> int:
    """Bytes of a GPU's memory that placement leaves free: the ``gpu_margin`` setting,
    by default max(256 MB, 10 % of total) (the scheduler's GPU budgets leave the same,
    :func:`tierflow.system.device_budget.margin_bytes`)."""
    return device_budget.margin_bytes(total)


# -- the table of live arrays ---------------------------------------------------------


@dataclass
class _Entry:
    placement: Placement
    owner: weakref.ref[Any]
    serial: int
    finalizer: weakref.finalize
    spill: spill.SpillFile | None = None
    backend: GpuBackend | None = None


_lock = threading.Lock()
_entries: dict[int, _Entry] = {}  # id(owner) -> entry, in creation order; _lock
_ram = 0  # bytes of RAM held by live entries; _lock
_serial = 0  # _lock
_collected: deque[tuple[int, int]] = deque()  # (key, serial) of collected owners
# id(owner) -> weak reference, for arrays already freed (free twice is a no-op)
_freed: dict[int, weakref.ref[Any]] = {}


def _settle_locked() -> None:
    """Drop the entries of collected owners. Needs ``_lock``."""
    global _ram
    while _collected:
        key, serial = _collected.popleft()
        entry = _entries.get(key)
        if entry is not None and entry.serial == serial:
            del _entries[key]
            if entry.placement.tier == RAM:
                _ram -= entry.placement.nbytes


def _on_collected(key: int, serial: int) -> None:
    _collected.append((key, serial))  # deque.append is atomic; no lock here


def _register(
    owner: Any,
    placement: Placement,
    *,
    counted: bool = False,
    spill_file: spill.SpillFile | None = None,
    backend: GpuBackend | None = None,
) -> None:
    """Add ``owner`` to the table; ``counted``: its RAM was already added to ``_ram``."""
    global _serial, _ram
    with _lock:
        _settle_locked()
        _serial += 1
        key = id(owner)
        finalizer = weakref.finalize(owner, _on_collected, key, _serial)
        finalizer.atexit = False
        _entries[key] = _Entry(
            placement, weakref.ref(owner), _serial, finalizer, spill_file, backend
        )
        if placement.tier == RAM and not counted:
            _ram += placement.nbytes


def _chain(x: Any) -> list[Any]:
    """``x`` and the objects it keeps alive that may own its memory."""
    found = [x]
    obj = x
    for _ in range(64):
        obj = obj.base if isinstance(obj, np.ndarray) else None
        if obj is None:
            break
        found.append(obj)
    for backend in gpu.all_backends():
        owner = backend.owner(x)
        if owner is not None:
            found.append(owner)
    return found


def _find_locked(x: Any) -> tuple[Any, _Entry] | None:
    """The owner of ``x`` and its entry, if ``x`` was made by :func:`array`. Needs _lock."""
    for obj in _chain(x):
        entry = _entries.get(id(obj))
        if entry is not None and entry.owner() is obj:
            return obj, entry
    record = spill.spill_file_of(x)
    if record is not None:
        for entry in _entries.values():
            owner = entry.owner()
            if entry.spill is record and owner is not None:
                return owner, entry
    return None


def _forget_freed(key: int, _ref: object) -> None:
    _freed.pop(key, None)


def _was_freed(obj: Any) -> bool:
    ref = _freed.get(id(obj))
    return ref is not None and ref() is obj


def ram_held() -> int:
    """Bytes of RAM held by live arrays made by :func:`array` (what the budget counts)."""
    with _lock:
        _settle_locked()
        return _ram


# -- placing --------------------------------------------------------------------------


def _parse_device(device: Any) -> str | int:
    text = str(device)
    if text in ("cpu", "auto"):
        return text
    match = _DEVICE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"device={device!r}: use 'cpu', 'auto' or 'cuda:N' such as 'cuda:0'")
    return int(match.group(1) or 0)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


def _on_gpu(
    shape: tuple[int, ...], dtype: np.dtype[Any], nbytes: int, target: str | int
) -> Any | None:
    """Allocate on a GPU if one fits; None means: use the host."""
    found = devices.gpus()
    if target == "auto":
        candidates = sorted(found, key=lambda d: (-d.free, d.index))
    else:
        candidates = [d for d in found if d.index == target]
        if not candidates:
            here = (
                "this machine has no GPU"
                if not found
                else "the GPUs here are " + ", ".join(d.id for d in found)
            )
            raise ValueError(
                f"device 'cuda:{target}' does not exist: {here}; use one of them, 'auto' or 'cpu'"
            )
    for device in candidates:
        room = device.free - gpu_margin(device.total)
        if nbytes > room:
            logger.debug(
                "%s of %s does not fit %s: %s free less a %s margin",
                format_bytes(nbytes, 3),
                dtype,
                device.id,
                format_bytes(device.free, 3),
                format_bytes(gpu_margin(device.total), 3),
            )
            continue
        backend = gpu.backend_for(device)
        try:
            x = backend.zeros(shape, dtype, device.index)
        except TypeError:
            if target != "auto":
                raise
            logger.debug("%s cannot hold %s; placing on the host", backend.name, dtype)
            return None
        except Exception as exc:
            if not _is_oom(exc):
                raise
            logger.debug("%s ran out of memory on %s: %s", backend.name, device.id, exc)
            continue
        _register(x, Placement(shape, dtype, nbytes, device.id), backend=backend)
        return x
    if found:
        logger.debug("%s fits no GPU; placing it on the host", format_bytes(nbytes, 3))
    return None


def _on_host(shape: tuple[int, ...], dtype: np.dtype[Any], nbytes: int) -> np.ndarray:
    global _ram
    limit = budget.budget_bytes()
    level = pressure.level_now() if nbytes >= SMALL else Level.OK
    with _lock:
        _settle_locked()
        room = limit - _ram
        in_ram = nbytes <= room and level < Level.HIGH
        if in_ram:
            _ram += nbytes  # reserve now, so two threads cannot both take the last room
    if in_ram:
        try:
            x = np.zeros(shape, dtype)
        except MemoryError:
            with _lock:
                _ram -= nbytes
            logger.debug("no RAM for %s; spilling it", format_bytes(nbytes, 3))
        else:
            _register(x, Placement(shape, dtype, nbytes, RAM), counted=True)
            return x
    else:
        logger.debug(
            "%s of %s to the SSD: %s of the %s budget left, pressure %s",
            format_bytes(nbytes, 3),
            dtype,
            format_bytes(max(room, 0), 3),
            format_bytes(limit, 3),
            level,
        )
    m = spill.map_array(shape, dtype)
    record = spill.spill_file_of(m)
    assert record is not None
    _register(m, Placement(shape, dtype, nbytes, SSD, record.path), spill_file=record)
    tally.add("spills")  # counted in the running task's profile, if any
    tally.add("spilled_bytes", nbytes)
    return m


def array(shape: ShapeLike, dtype: Any = "float64", *, device: Any = "cpu") -> Any:
    """A zero-filled array of ``shape`` and ``dtype`` where it fits: RAM, SSD or GPU.

    On the host the result is an ``np.ndarray`` in RAM or an ``np.memmap`` over a spill
    file (see the module docstring for the rules); on a GPU a torch tensor (or a cupy
    array). ``device`` is ``"cpu"`` (default), ``"auto"`` or ``"cuda:N"``. RAM arrays
    count against the budget until :func:`free` or garbage collection.

    Raises ``TypeError``/``ValueError`` for a bad shape, dtype or device (see
    :func:`request`), :class:`~tierflow.errors.SpillError` when a spill file cannot be
    reserved (full disk, unwritable folder).

    >>> from tierflow import memory
    >>> memory.array((1000, 8), "float32").sum()
    np.float32(0.0)
    """
    shape_t, dt, nbytes = request(shape, dtype)
    target = _parse_device(device)
    if target != "cpu":
        placed = _on_gpu(shape_t, dt, nbytes, target)
        if placed is not None:
            return placed
    if nbytes == 0:
        x = np.zeros(shape_t, dt)  # nothing to spill, nothing to count
        _register(x, Placement(shape_t, dt, 0, RAM))
        return x
    return _on_host(shape_t, dt, nbytes)


def on_disk(x: Any) -> bool:
    """True if ``x`` (or the array it is a view of) lives in a spill file on the SSD."""
    return spill.spill_file_of(x) is not None


def free(x: Any) -> None:
    """Release an array made by :func:`array` now, whichever view of it is passed.

    RAM and GPU: stops counting it (against the budget, in :func:`report`); the memory
    itself returns when the last view is collected, since NumPy and torch cannot free
    memory a view still points at. SSD: the file is unmapped from the array and deleted
    now, so its disk space comes back now. Using the array after ``free`` is a bug in
    the caller (a freed spill-backed array reads zeros and its writes are lost; it does
    not crash). Freeing twice does nothing; raises ``ValueError`` for an array not made
    by :func:`array`.
    """
    global _ram
    with _lock:
        _settle_locked()
        found = _find_locked(x)
        if found is None:
            if any(_was_freed(o) for o in _chain(x)):
                return
            raise ValueError(
                f"memory.free() takes an array made by memory.array, or a view of one; "
                f"got a {type(x).__name__} made elsewhere"
            )
        owner, entry = found
        del _entries[id(owner)]
        entry.finalizer.detach()
        if entry.placement.tier == RAM:
            _ram -= entry.placement.nbytes
        key = id(owner)
        _freed[key] = weakref.ref(owner, functools.partial(_forget_freed, key))
    if entry.spill is not None:
        spill.discard(entry.spill)
    if entry.backend is not None:
        entry.backend.release(owner)


# -- report ---------------------------------------------------------------------------


class Report(list[Placement]):
    """The live arrays made by ``memory.array``: one :class:`Placement` each, oldest first.

    Prints one line per array and the totals per tier; renders as a table in notebooks.
    """

    def totals(self) -> dict[str, tuple[int, int]]:
        """Per tier (``"RAM"``, ``"SSD"``, ``"cuda:0"``, ...): (bytes, number of arrays)."""
        sums: dict[str, tuple[int, int]] = {}
        for p in self:
            size, count = sums.get(p.tier, (0, 0))
            sums[p.tier] = (size + p.nbytes, count + 1)
        return sums

    def _total_line(self) -> str:
        parts = [
            f"{tier} {format_bytes(size, 3)} in {count} array{'' if count == 1 else 's'}"
            for tier, (size, count) in self.totals().items()
        ]
        return "total: " + ", ".join(parts)

    def __str__(self) -> str:
        if not self:
            return "no arrays placed by memory.array"
        return "\n".join([*(str(p) for p in self), self._total_line()])

    # The list's repr would be a wall of dataclass fields; the lines read better.
    __repr__ = __str__

    def _repr_html_(self) -> str:
        rows = "".join(
            "<tr>"
            f"<td>{html.escape(str(list(p.shape)))}</td><td>{html.escape(str(p.dtype))}</td>"
            f"<td>{format_bytes(p.nbytes, 3)}</td><td>{html.escape(p.tier)}</td>"
            f"<td>{html.escape(p.shown_path)}</td>"
            "</tr>"
            for p in self
        )
        totals = "".join(
            f"<tr><th colspan='2'>total {html.escape(tier)}</th>"
            f"<td>{format_bytes(size, 3)}</td><td colspan='2'>{count} array"
            f"{'' if count == 1 else 's'}</td></tr>"
            for tier, (size, count) in self.totals().items()
        )
        return (
            "<table><thead><tr><th>shape</th><th>dtype</th><th>size</th><th>tier</th>"
            "<th>file</th></tr></thead><tbody>" + rows + totals + "</tbody></table>"
        )


def report() -> Report:
    """Where every live array made by :func:`array` lives (a snapshot).

    >>> from tierflow import memory
    >>> a = memory.array((1000, 8), "float32")
    >>> print(memory.report())  # doctest: +SKIP
    [1000, 8] float32 31.250 KB RAM
    total: RAM 31.250 KB in 1 array
    """
    with _lock:
        _settle_locked()
        return Report(e.placement for e in _entries.values() if e.owner() is not None)
