"""Read leases: a file that shrinks under a mapping is an error, never SIGBUS.

Reading a page of a file mapping past the file's end raises SIGBUS. That is a signal,
not an exception: it kills the process without a traceback, and Python cannot catch
it safely. So another process truncating a ``.npy`` while tierflow streams it through
a mapping would kill the compute, or the notebook kernel. A size check before each
block cannot prevent it: the file can shrink between the check and the page fault,
and a truncate removes the mapped pages past the new end from every mapping.

A read lease (``fcntl(F_SETLEASE, F_RDLCK)``) can. While it is held, a truncate or an
open for writing of the file, by any process, first *breaks* the lease and waits
until the holder lets go (or ``/proc/sys/fs/lease-break-time``, 45 s by default, has
passed). The holder sees the break with ``F_GETLEASE``. tierflow maps a file only under
a lease (:func:`map_leased`), and lets go once no view of the mapping is left:

1. On a break, the mapping is no longer handed out (a watcher thread, :func:`watch`,
   polls the leases every :data:`POLL_S` seconds; readers also look at each block).
   Blocks are then read by copy (``pread``), which cannot fault.
2. Views already handed out stay valid: the writer is still waiting. When the last
   one is gone the mapping is unmapped, its finalizer closes the lease's descriptor,
   and the lease is gone with it. The truncate then goes ahead.
3. A later read sees the new size and raises an error naming the file and both sizes.

The lease is on a descriptor of its own, opened through ``/proc/self/fd`` from the
caller's descriptor: the same file even after a rename put another one at its path.

A lease break would signal the holder with SIGIO, whose default action ends the
process. So the signal is set to SIGURG (ignored by default; nothing else in tierflow
uses it) before the lease is taken, and no process is signalled once it is
(``F_SETOWN`` 0): breaks are seen by polling, not by a signal.

Where no lease can be had, reads go by copy: a file owned by another user (leases need
ownership or ``CAP_LEASE``), a file someone has open for writing, a file system without
leases. Copying cost 0.25x the speed of a plain column sum of a 4 GB file in the page
cache, 0.72x for ``sqrt(x * 2 + 1).sum(0)`` (docs/benchmarks.md): a computation that
does more per byte loses less.

What a lease cannot cover: a view kept more than the lease-break time after a break
(the kernel then takes the lease away and truncates anyway).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import mmap
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

__all__ = [
    "POLL_S",
    "acquire",
    "held",
    "held_by",
    "lease_of",
    "let_go",
    "map_leased",
    "read_into",
    "watch",
]

POLL_S = 0.01  # seconds between two looks of the watcher at the leases it holds
_SIGNAL = signal.SIGURG  # sent on a break only in the instant before F_SETOWN 0


def acquire(fd: int) -> int | None:
    """A new descriptor of ``fd``'s file holding a read lease, or None when the file
    cannot be leased (see the module docstring); the caller closes it."""
    try:
        lease = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.fcntl(lease, fcntl.F_SETSIG, _SIGNAL)
        fcntl.fcntl(lease, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(lease, fcntl.F_SETOWN, 0)
    except OSError:
        os.close(lease)
        return None
    return lease


def held(lease: int) -> bool:
    """Whether the read lease on ``lease`` still holds (False once a break began)."""
    try:
        return fcntl.fcntl(lease, fcntl.F_GETLEASE) == fcntl.F_RDLCK
    except OSError:
        return False


def map_leased(  # noqa: PLR0913 -- dtype, shape, offset, mode, order: np.memmap's own
    lease: int,
    path: str,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    offset: int,
    *,
    sequential: bool = True,
    mode: Literal["r", "c"] = "r",
    order: Literal["C", "F"] = "C",
) -> np.memmap[Any, Any]:
    """A read-only ``np.memmap`` of ``lease``'s file that owns the descriptor.

    The mapping is of ``lease``'s own open file, and ``lease`` is closed (the lease let
    go) when the mapping is unmapped, i.e. once no view of it is left. ``path`` is only
    the name the memmap reports (used to drop its pages from the page cache).
    ``sequential`` advises the kernel that it is read in order; ``mode="c"`` maps it
    copy-on-write (writes stay in this process).
    """
    fid = io.FileIO(lease, "rb", closefd=False)
    fid.name = path
    try:
        m: np.memmap[Any, Any] = np.memmap(
            fid, dtype=dtype, mode=mode, offset=offset, shape=shape, order=order
        )
    except BaseException:
        os.close(lease)
        raise
    mapping = m._mmap  # type: ignore[attr-defined]
    with _lock:
        _by_mapping[id(mapping)] = lease
    weakref.finalize(mapping, _let_go, lease, id(mapping))
    if sequential:
        m._mmap.madvise(mmap.MADV_SEQUENTIAL)  # type: ignore[attr-defined]
    return m


def read_into(fd: int, out: np.ndarray, offset: int) -> int:
    """Fill the C- or F-contiguous ``out`` from ``fd`` at ``offset`` by ``pread``;
    returns the bytes read, fewer than ``out.nbytes`` only when the file ended first."""
    view = out.reshape(-1, order="A").view(np.uint8).data
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def _mapping_of(x: np.ndarray | mmap.mmap) -> mmap.mmap | None:
    obj: Any = x
    for _ in range(64):  # a base chain is short
        mapping = getattr(obj, "_mmap", None) if isinstance(obj, np.memmap) else None
        if isinstance(mapping, mmap.mmap):
            return mapping
        if isinstance(obj, mmap.mmap):
            return obj
        obj = getattr(obj, "base", None)
        if obj is None:
            return None
    return None


def held_by(x: np.ndarray) -> bool | None:
    """Whether the lease under ``x``'s mapping still holds; None when ``x`` is not a
    view of a mapping made by :func:`map_leased` (or its lease was let go)."""
    mapping = _mapping_of(x)
    with _lock:
        lease = _by_mapping.get(id(mapping)) if mapping is not None else None
        return None if lease is None else held(lease)


def lease_of(x: np.ndarray) -> int | None:
    """The lease descriptor under ``x``'s mapping, None when it has none (any more)."""
    mapping = _mapping_of(x)
    with _lock:
        return _by_mapping.get(id(mapping)) if mapping is not None else None


def let_go(x: np.ndarray | mmap.mmap) -> None:
    """Let go of the lease under ``x``'s mapping now, for a caller that has taken the
    file away from the mapping itself (a spill file being discarded)."""
    mapping = _mapping_of(x)
    if mapping is not None:
        with _lock:
            lease = _by_mapping.get(id(mapping))
            if lease is not None:
                _let_go(lease, id(mapping))


def _let_go(lease: int, mapping_id: int) -> None:
    """Close ``lease`` unless it was let go already (the descriptor number may have
    been reused since)."""
    with _lock:
        if _by_mapping.get(mapping_id) != lease:
            return
        del _by_mapping[mapping_id]
        _watched.pop(lease, None)
        os.close(lease)


# -- the watcher ------------------------------------------------------------------------

# lease descriptor -> what to call once its lease is broken. A descriptor leaves this
# table before it is closed (under _lock), so a number reused by a later open is never
# looked at as a lease.
_watched: dict[int, Callable[[], None]] = {}
_by_mapping: dict[int, int] = {}  # id(mmap) of a leased mapping -> its lease descriptor
_lock = threading.RLock()
_wake = threading.Condition(_lock)
_thread: threading.Thread | None = None


def watch(lease: int, on_break: Callable[[], None]) -> None:
    """Call ``on_break()`` (from the watcher thread) once the lease on ``lease`` breaks.

    ``on_break`` must not wait for views of the mapping to go: the writer waits for
    that. The watcher runs while some lease is watched; it stops after its last.
    """
    global _thread
    with _lock:
        _watched[lease] = on_break
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_poll, name="tierflow-leases", daemon=True)
            _thread.start()
        _wake.notify()


def _poll() -> None:
    while True:
        with _lock:
            while not _watched:
                _wake.wait()
            broken = [(fd, fn) for fd, fn in _watched.items() if not held(fd)]
            for fd, _ in broken:
                del _watched[fd]
        for _, fn in broken:  # outside the lock: a callback takes its owner's lock
            with contextlib.suppress(Exception):
                fn()
        with _lock:
            _wake.wait(POLL_S)
