"""One leased mapping of a file per process, shared by every source that reads it.

Each ``tw.from_npy(path)`` builds a new :class:`~tierflow.storage.sources.FileSource`,
and so does each program a Dask or Ray worker unpickles. Were each to map the file on
its own, every compute would fault the whole file into a fresh mapping again, even
with every page in the page cache (a scan of a cached 1 GB file took 1.1x to 2x as
long: a fault maps one folio of the page cache, up to 2 MB or only 4 KB); and a
process that keeps a scanned file's pages
mapped would count them in its RSS once per mapping. So shared sources (those of
``tw.from_npy`` and ``tw.from_raw``) ask :func:`share` for the mapping: one per (file,
inode, size, mtime, offset, dtype, shape, advice) in a process, made under a read lease
(:mod:`tierflow.storage.leases`) and handed to every source that asks while the lease
holds. Other sources (``memory.chunks``, whose stream lets go of the file when it ends)
get a mapping of their own, under a lease of its own.

Which mappings outlive their sources: the most recently used ones, up to
:func:`keep_limit` bytes of file data in all (half the RAM budget unless set by
:func:`keep_files`), and at most :data:`MAX_KEPT` files. They are *kept*: a reader may
leave their pages mapped after a scan (:meth:`FileSource.kept`), so the next scan
finds them mapped. The others live as long as a source or a view holds them, as any
mapping does.

A kept mapping is let go (its pages leave this process, its lease with the last view):

- when its lease breaks: another process, or this one, opens the file for writing or
  truncates it (the lease watcher calls back within :data:`leases.POLL_S`);
- when newer mappings push it past the limit, or past :data:`MAX_KEPT` files;
- within :data:`SWEEP_S` of its file's deletion (a thread looks while some mapping is
  kept), so a deleted file's disk space is not held;
- by :func:`forget_all`.

A forked child starts with none kept: it maps a file anew, and leaves alone what it
inherited.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..system import budget as budget_module
from . import leases

__all__ = ["KEEP_SHARE", "MAX_KEPT", "forget_all", "keep_files", "keep_limit", "kept", "share"]

KEEP_SHARE = 2  # by default, kept mappings hold at most budget / 2 bytes of file data
MAX_KEPT = 32  # and at most this many files (a lease and a descriptor each)
SWEEP_S = 1.0  # how often a deleted file's kept mapping is looked for

Key = tuple[Any, ...]


@dataclass(eq=False)
class _Entry:
    key: Key
    nbytes: int
    lease: int
    ref: weakref.ref[np.memmap[Any, Any]]
    strong: np.memmap[Any, Any] | None = None  # set while kept
    users: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)


_entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
_lock = threading.Lock()
_limit: int | None = None  # see keep_files
_sweeper: threading.Thread | None = None  # runs _sweep_while_kept


def keep_files(limit: int | None) -> None:
    """Set how many bytes of file data this process keeps mapped between scans: None
    (the default) for half the RAM budget, 0 to keep none. A Dask worker sets what
    Dask's pause threshold leaves above its budget, because Dask's memory monitor
    counts mapped file pages in the worker's RSS."""
    global _limit
    with _lock:
        _limit = None if limit is None else max(0, int(limit))
        _trim()


def keep_limit() -> int:
    """Bytes of file data kept mapped at most (see :func:`keep_files`)."""
    return budget_module.budget_bytes() // KEEP_SHARE if _limit is None else _limit


def share(  # noqa: PLR0913 -- the mapping's description, as np.memmap takes it
    fd: int,
    path: str,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    offset: int,
    *,
    sequential: bool,
    user: Any,
    short: Callable[[int], Exception],
    shared: bool = True,
) -> tuple[np.memmap[Any, Any], int] | None:
    """This process's leased read-only mapping of ``fd``'s file and its lease descriptor,
    mapped now unless a source mapped the same data before and the lease still holds;
    None while no lease can be had (the caller reads by copy). With ``shared=False`` a
    mapping of the caller's own, never kept nor handed to another.

    ``user`` (held weakly) gets ``user._lost(mapping)`` from the lease watcher when the
    lease breaks, and must then hand the mapping out no more. ``short(size)`` is the
    error raised when the leased file has fewer bytes than the data needs.
    """
    needed = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def fresh() -> tuple[np.memmap[Any, Any], int] | None:
        """A new mapping of the file under a lease of its own, and the lease."""
        lease = leases.acquire(fd)
        if lease is None:
            return None
        size = os.fstat(lease).st_size
        if size < needed:
            os.close(lease)
            raise short(size)
        return leases.map_leased(lease, path, dtype, shape, offset, sequential=sequential), lease

    if not shared:
        got = fresh()
        if got is not None:
            _watch(_Entry((), needed - offset, got[1], weakref.ref(got[0])), user)
        return got
    key = _key(os.fstat(fd), dtype, shape, offset, sequential)
    with _lock:
        _sweep()
        found = _entries.get(key)
        m = found.ref() if found is not None else None
        if found is not None and m is not None and leases.held(found.lease):
            found.users.add(user)
            _entries.move_to_end(key)
            _trim()
            return m, found.lease
        got = fresh()
        if got is None:
            return None
        m, lease = got
        key = _key(os.fstat(lease), dtype, shape, offset, sequential)  # as leased
        entry = _Entry(key, needed - offset, lease, weakref.ref(m))
        old = _entries.pop(key, None)
        if old is not None:
            old.strong = None
        _entries[key] = entry
        _trim()
    _watch(entry, user)
    return m, lease


def _watch(entry: _Entry, user: Any) -> None:
    entry.users.add(user)
    leases.watch(entry.lease, _on_break(entry))


def kept(mapping: np.memmap[Any, Any]) -> bool:
    """Whether ``mapping`` (one :func:`share` returned) is kept right now."""
    with _lock:
        return any(e.strong is mapping for e in _entries.values())


def forget_all() -> None:
    """Keep no mapping any more (each lives on while a source or a view holds it)."""
    with _lock:
        for entry in _entries.values():
            entry.strong = None
        _entries.clear()


def _key(
    st: os.stat_result, dtype: np.dtype[Any], shape: tuple[int, ...], offset: int, sequential: bool
) -> Key:
    return (
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
        offset,
        dtype.str,
        tuple(shape),
        sequential,
    )


def _trim() -> None:
    """Keep the most recently used mappings that fit the limit (needs ``_lock``)."""
    room, count = keep_limit(), 0
    for entry in reversed(_entries.values()):
        m = entry.strong if entry.strong is not None else entry.ref()
        if m is None:
            continue
        if entry.nbytes <= room and count < MAX_KEPT:
            room -= entry.nbytes
            count += 1
            entry.strong = m
        else:
            entry.strong = None
    if count:
        _start_sweeper()


def _sweep() -> None:
    """Drop the entries whose mapping is gone or whose file was deleted (needs
    ``_lock``): a deleted file's kept mapping would hold its disk space."""
    for key, entry in list(_entries.items()):
        if entry.ref() is None or _deleted(entry.lease):
            entry.strong = None
            del _entries[key]


def _start_sweeper() -> None:
    """Sweep every :data:`SWEEP_S` seconds while some mapping is kept (needs ``_lock``)."""
    global _sweeper
    if _sweeper is None or not _sweeper.is_alive():
        _sweeper = threading.Thread(target=_sweep_while_kept, name="tierflow-filemaps", daemon=True)
        _sweeper.start()


def _sweep_while_kept() -> None:
    global _sweeper
    while True:
        time.sleep(SWEEP_S)
        with _lock:
            _sweep()
            if all(e.strong is None for e in _entries.values()):
                _sweeper = None
                return


def _deleted(lease: int) -> bool:
    try:
        return os.fstat(lease).st_nlink == 0
    except OSError:
        return True


def _on_break(e: _Entry) -> Callable[[], None]:
    """What the lease watcher calls when ``e``'s lease breaks. It holds ``e`` (not its
    mapping) until the lease is let go, when the watcher drops it."""

    def lost() -> None:
        with _lock:
            e.strong = None
            if e.key and _entries.get(e.key) is e:
                del _entries[e.key]
            users = list(e.users)
        m = e.ref()
        if m is not None:
            for user in users:
                user._lost(m)

    return lost


# Entries inherited over a fork: never handed out nor let go in the child. Letting go
# would unmap, whose finalizer takes the leases' lock, which another thread of the
# parent may have held at the fork; the mappings cost the child nothing untouched.
_abandoned: list[OrderedDict[Key, _Entry]] = []


def _after_fork() -> None:
    global _entries, _lock, _sweeper
    _lock = threading.Lock()  # another thread may have held it at the fork
    _sweeper = None  # threads do not survive a fork
    _abandoned.append(_entries)
    _entries = OrderedDict()


os.register_at_fork(after_in_child=_after_fork)
