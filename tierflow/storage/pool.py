"""A pool of RAM buffers for temporaries, so big scratch arrays are not faulted in anew.

A fresh ``np.empty`` of 256 MB costs a page fault (and a page of zeroing by the
kernel) for every 4 KB the first time it is touched; a buffer taken back from a pool is
already mapped. ``take`` hands out an array, ``give`` returns it as a *spare*:

- reuse: a spare of exactly the bytes asked is taken first (the most recently given
  one, its pages are the likeliest to be in cache); else the smallest spare up to twice
  the size, of which a prefix is used. A spare holds raw bytes, so any shape and dtype
  of that size can reuse it.
- bound: spares total at most ``max_bytes``; the oldest are dropped first, and a buffer
  bigger than the bound is not kept.
- pressure: at level ``high`` or above all spares are dropped (the pool subscribes to
  :mod:`tierflow.system.pressure`), and ``memory.relieve()`` drops them too.
- an array never given back is freed by garbage collection like any other.

``zero=True`` (default) hands out zeros; ``zero=False`` skips the zeroing of a reused
buffer (its bytes are whatever the last user left), which is the point for
temporaries that are written before they are read.

>>> from tierflow import memory
>>> p = memory.pool(max_gb=1)
>>> a = p.take((1000, 8))
>>> p.give(a)
>>> b = p.take((8, 1000), zero=False)  # reuses a's buffer
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ..config import GB, format_bytes, parse_size
from ..system import budget, pressure
from ..system.types import Level
from .placement import ShapeLike, request

__all__ = ["Pool", "Scratch", "pool"]

# A spare up to this many times the request may serve it: a bigger one would pin far
# more memory than the caller uses.
_MAX_OVERSIZE = 2


class Pool:
    """Reusable RAM buffers: ``take`` an array, ``give`` it back when done.

    ``max_bytes`` bounds the bytes kept as spares (not the arrays handed out).
    Thread-safe. Subscribes itself to the pressure registry (held weakly, so an
    unreferenced pool drops out by itself).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"a pool's max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._spares: OrderedDict[int, np.ndarray] = OrderedDict()  # oldest first; _lock
        self._spare_bytes = 0  # _lock
        # Buffers this pool made (id -> buffer) and, for those handed out, the array
        # handed out (id(buffer) -> array). Weak: a lost array frees its buffer.
        self._known: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self._out: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self.reused = 0  # takes served by a spare; _lock
        self.allocated = 0  # takes that allocated a new buffer; _lock
        pressure.subscribe(self)

    @property
    def spare_bytes(self) -> int:
        """Bytes held as spares now."""
        with self._lock:
            return self._spare_bytes

    @property
    def spares(self) -> int:
        """Number of spare buffers held now."""
        with self._lock:
            return len(self._spares)

    def _pick_locked(self, nbytes: int) -> np.ndarray | None:
        """Remove and return the best spare for ``nbytes``, or None. Needs ``_lock``."""
        best_key = None
        for key, buf in reversed(self._spares.items()):  # newest first
            if buf.nbytes == nbytes:
                best_key = key
                break
            if nbytes < buf.nbytes <= _MAX_OVERSIZE * max(nbytes, 1) and (
                best_key is None or buf.nbytes < self._spares[best_key].nbytes
            ):
                best_key = key
        if best_key is None:
            return None
        buf = self._spares.pop(best_key)
        self._spare_bytes -= buf.nbytes
        return buf

    def take(self, shape: ShapeLike, dtype: Any = "float32", zero: bool = True) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` in RAM, reusing a spare buffer if one fits.

        ``zero=True`` fills it with zeros; ``zero=False`` leaves whatever bytes the
        buffer held. Give it back with :meth:`give` when done (or just drop it).
        Raises ``TypeError``/``ValueError`` for a bad shape or dtype, like
        ``memory.array``.
        """
        shape_t, dt, nbytes = request(shape, dtype)
        with self._lock:
            buf = self._pick_locked(nbytes)
            if buf is None:
                self.allocated += 1
            else:
                self.reused += 1
        if buf is None:
            buf = np.zeros(nbytes, np.uint8) if zero else np.empty(nbytes, np.uint8)
        elif zero:
            buf[:nbytes].fill(0)
        out = buf[:nbytes].view(dt).reshape(shape_t)
        with self._lock:
            self._known[id(buf)] = buf
            self._out[id(buf)] = out
        return out

    def give(self, a: np.ndarray) -> None:
        """Hand back an array that :meth:`take` returned; it becomes a spare.

        The caller must not use ``a`` afterwards: the next ``take`` may hand its bytes
        out again. Raises ``ValueError`` for an array this pool did not hand out, one
        given back already, or a view of one instead of the array itself.
        """
        level = pressure.level_now()
        buf = a.base if isinstance(a, np.ndarray) else None
        with self._lock:
            known = buf is not None and self._known.get(id(buf)) is buf
            handed = self._out.get(id(buf)) if known else None
            if not known:
                raise ValueError(
                    f"give() takes an array this pool's take() returned; got a "
                    f"{type(a).__name__} of shape {getattr(a, 'shape', '?')} from elsewhere"
                )
            if handed is None:
                raise ValueError(
                    f"this array ({format_bytes(a.nbytes, 3)}) was already given back to "
                    "the pool; give each array back once, and do not use it afterwards"
                )
            if handed is not a:
                raise ValueError(
                    "give() takes the array take() returned, not a view of it "
                    f"(got shape {a.shape}, taken as {handed.shape})"
                )
            del self._out[id(buf)]
            assert buf is not None
            if level >= Level.HIGH or buf.nbytes > self.max_bytes:
                return  # not kept: it is freed when the caller drops it
            self._spares[id(buf)] = buf
            self._spare_bytes += buf.nbytes
            while self._spare_bytes > self.max_bytes:
                _, old = self._spares.popitem(last=False)
                self._spare_bytes -= old.nbytes

    def relieve(self) -> int:
        """Drop every spare now; returns the bytes dropped."""
        with self._lock:
            dropped = self._spare_bytes
            self._spares.clear()
            self._spare_bytes = 0
        return dropped

    def on_pressure(self, level: Level) -> None:
        """Pressure subscriber: at ``high`` or above, drop every spare."""
        if level >= Level.HIGH:
            self.relieve()

    def __repr__(self) -> str:
        with self._lock:
            spares, held = len(self._spares), self._spare_bytes
            out = len(self._out)
        return (
            f"Pool(max {format_bytes(self.max_bytes, 3)}: {spares} spare"
            f"{'' if spares == 1 else 's'} of {format_bytes(held, 3)}, {out} taken; "
            f"reused {self.reused}, allocated {self.allocated})"
        )


def pool(max_gb: float | str | None = None) -> Pool:
    """A new :class:`Pool` keeping at most ``max_gb`` of spare buffers.

    ``max_gb`` is a number of GB (binary: 2**30 bytes), a size string such as
    ``"512MB"``, or None for a tenth of the RAM budget (read now). Raises
    :class:`~tierflow.errors.ConfigError` for a malformed size, ``ValueError`` for a
    negative number.
    """
    if max_gb is None:
        max_bytes = budget.budget_bytes() // 10
    elif isinstance(max_gb, str):
        max_bytes = parse_size(max_gb, "memory.pool(max_gb)")
    else:
        if isinstance(max_gb, bool) or not (max_gb >= 0 and math.isfinite(max_gb)):
            raise ValueError(
                f"memory.pool(max_gb={max_gb!r}): give a number of GB >= 0, such as 2, "
                "or a size such as '512MB'"
            )
        max_bytes = int(max_gb * GB)
    return Pool(max_bytes)


class Scratch:
    """Reused per-thread output buffers (a fresh block-sized array costs page faults
    and zeroing on every block; a reused one does not)."""

    def __init__(self, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.row_shape = row_shape
        self._lock = threading.Lock()
        self._buffers: dict[int, np.ndarray] = {}

    def get(self, rows: int) -> np.ndarray:
        ident = threading.get_ident()
        with self._lock:
            buffer = self._buffers.get(ident)
        if buffer is None or buffer.shape[0] < rows:
            buffer = np.empty((rows, *self.row_shape), self.dtype)
            with self._lock:
                self._buffers[ident] = buffer
        return buffer[:rows]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
