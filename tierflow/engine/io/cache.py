"""The engine's cache: results kept in a two-tier store, across runs and crashes.

What is cached
--------------
A compute with a cache — ``compute(cache=True | "name" | path | Store)``, the same
option of ``to_npy`` and ``persist``, or the ``cache`` setting (``TIERFLOW_CACHE``) for
every compute — keeps in that store:

* every block of its chunked results, as it is computed;
* every value its results depend on (reductions and values computed from them), and
  every block's partial result of those reductions, so a reduction stopped halfway
  resumes too;
* every block of nodes marked with ``x.cache()`` (also in computes without a cache:
  then in the ``cache`` setting's store, or the store named ``"cache"``). A value
  under a marked node is kept with it.

Other chunked intermediates are not written: fusion keeps them in the CPU cache, and
writing them would put every temporary on the SSD. But a compute with a cache reads
every part of its graph that an earlier compute left in that store: a chunked node
whose first block the store holds is cached in this compute too (its blocks are read,
the missing ones computed and written). ``cache=False`` turns caching off for one
compute, marks included.

Keys
----
An entry's key is ``("tierflow", FORMAT, kind, node key, extent)``: ``kind`` is
``"block"``, ``"partial"`` or ``"value"``; the node key covers what is computed (see
:mod:`tierflow.storage.identity`: sources by path, size, mtime, inode, dtype and shape;
functions by code, constants, closure and global values; operators by parameters); the
extent is the block's rows ``(start, stop)``, or for rows unknown until computed (after
a mask) the block's index and a digest of the block boundaries it derives from. So a
changed file, an edited function, another parameter or other block boundaries miss;
the same computation built again in another process hits. Entries carry the tag
:data:`TAG`, which :func:`cache_clear` removes.

Where it hooks in
-----------------
::

    compute(cache=...) -> session(): which nodes are cached, in which store
        resolve():   cached values found in the store become constants; the graph
                     below them is not planned (a cached mean is never recomputed)
        build_plan:  a cached chunked node is not fused into its consumers; its step
                     is wrapped (program.CachedStep): a hit maps the block from the
                     store, a miss computes and writes it; a cached reduction looks
                     up each block's partial first; finishing a value writes it
        scheduler:   unchanged; readahead skips blocks the store already has
        finish():    warnings for writes that failed

A block read from the cache is a read-only memory map of the entry file (nothing is
copied until a consumer reads it); its pages are dropped from the process when the
task ends, like a source block's.

Memory
------
The engine opens its stores with no RAM tier: a written block costs no RAM beyond the
page cache, which the kernel reclaims. Under ``high`` or ``critical`` pressure a
written block's pages are written back and dropped from the page cache at once, so
cache writes go straight to the SSD.

Faults
------
The cache never fails a computation. A store that cannot be opened, a full disk, a
value that cannot be pickled or any other failed write is a :class:`CacheWarning`
(once per store per compute, on the calling thread, with the count and the first
error); after a full disk the compute stops writing to that store. An entry that fails
the store's checks (a file changed outside tierflow) is a miss: it is recomputed, and
never unpickled. A block whose dtype or shape is not what the node computes is a miss
too. Array data is not checksummed (see ``docs/store.md``).

Concurrency
-----------
Threads of one compute share the session (its counters and failure records are
guarded by a lock). Processes computing the same graph at once each compute what they
do not find and write the same entries: a write is atomic (a temporary file renamed
into place), so a reader sees a whole block or none.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ... import config
from ...config import GB, format_bytes
from ...storage import identity, intermediates, pages, spill
from ...storage.store import Store, store
from ...storage.store.objects import ObjectStore
from ...storage.store.tiers import resolve_path
from ...system import pressure, tally
from ...system.types import Level
from .. import graph
from ..graph import Chunked, Node
from ..types import Request, RowRange

__all__ = [
    "DEFAULT_STORE",
    "DISK_GB",
    "FORMAT",
    "MISS",
    "TAG",
    "CacheInfo",
    "CacheWarning",
    "Entry",
    "Session",
    "cache_clear",
    "cache_info",
    "close_all",
    "resolve_spec",
    "session",
]

log = logging.getLogger("tierflow.engine")

FORMAT = 1  # in every key: entries of another layout are never read
TAG = "tierflow.engine"  # the tag of every entry the engine writes
DEFAULT_STORE = "cache"  # the store of cache=True when the ``cache`` setting is unset
DISK_GB = 10.0  # SSD tier (2**30 bytes) of a store the engine opens by name or path
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})  # setting values meaning DEFAULT_STORE
_HIGH = frozenset({Level.HIGH, Level.CRITICAL})
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


class _Miss:
    def __repr__(self) -> str:
        return "MISS"


MISS: Any = _Miss()
"""What :class:`Entry` lookups return when the store has nothing usable."""


class CacheWarning(UserWarning):
    """The cache could not be used as asked (a store that did not open, writes that
    failed); the computation completed without it. The message says which store and why."""


@dataclass(frozen=True)
class CacheInfo:
    """One store the engine caches in: this process's hits and misses (blocks, partials
    and values, since the last :func:`cache_clear`), writes, and the store's contents.

    ``entries``: the engine's entries in the store (any process, any run);
    ``ram_*`` and ``ssd_*``: the store's tiers (entries, bytes, limit in bytes; the
    engine's handle has no RAM tier, so ``ram_*`` count what is held there only when
    it had to use a store object as given). Bytes are binary (1 MB = 2**20 bytes).
    """

    name: str
    path: str
    hits: int
    misses: int
    writes: int
    failed_writes: int
    bytes_read: int
    bytes_written: int
    entries: int
    ram_entries: int
    ram_bytes: int
    ssd_entries: int
    ssd_bytes: int
    ssd_limit: int

    def __str__(self) -> str:
        held = (
            f"{format_bytes(self.ssd_bytes)} in object storage"
            if intermediates.is_url(self.path)
            else f"SSD {format_bytes(self.ssd_bytes)} of {format_bytes(self.ssd_limit)}"
        )
        return (
            f"cache {self.name!r} ({self.path}): {self.hits} hits, {self.misses} misses, "
            f"{self.writes} writes ({format_bytes(self.bytes_written)}), "
            f"{self.failed_writes} failed; {self.entries} engine entries, {held}"
        )


# -- stores the engine caches in ------------------------------------------------------


class _Handle:
    """A store the engine caches in (opened once per process) and this process's
    counters of it. ``count`` takes ``lock``: workers of several computes share it."""

    def __init__(self, opened: Store | ObjectStore, owned: bool) -> None:
        self.store = opened
        self.owned = owned  # opened by the engine (closed by close_all), not the caller's
        self.lock = threading.Lock()
        self.hits = self.misses = self.writes = self.failed_writes = 0
        self.bytes_read = self.bytes_written = 0

    @property
    def name(self) -> str:
        return self.store.name

    def count(self, *, hit: int = 0, miss: int = 0, read: int = 0) -> None:
        if hit:
            tally.add("cache_hits", hit)  # counted in the running task's profile, if any
        with self.lock:
            self.hits += hit
            self.misses += miss
            self.bytes_read += read

    def wrote(self, nbytes: int, ok: bool) -> None:
        with self.lock:
            if ok:
                self.writes += 1
                self.bytes_written += nbytes
            else:
                self.failed_writes += 1

    def reset(self) -> None:
        with self.lock:
            self.reset_unlocked()

    def reset_unlocked(self) -> None:
        """Zero the counters; the caller holds ``lock``."""
        self.hits = self.misses = self.writes = self.failed_writes = 0
        self.bytes_read = self.bytes_written = 0

    def info(self) -> CacheInfo:
        use = self.store.usage()
        entries = self.store.count(TAG)
        with self.lock:
            return CacheInfo(
                self.name, str(self.store.path), self.hits, self.misses, self.writes,
                self.failed_writes, self.bytes_read, self.bytes_written, entries,
                use.ram_entries, use.ram_bytes, use.ssd_entries, use.ssd_bytes, use.ssd_limit,
            )  # fmt: skip


_registry: dict[str, _Handle] = {}  # store path -> handle; _registry_lock
_registry_lock = threading.Lock()


def resolve_spec(cache: Any) -> Any:
    """``cache`` as a store path, an object-storage URL or a Store (True: the setting's
    store, or the default).

    Raises ``TypeError`` for a value that names no store, ``ValueError`` for ``""``."""
    if isinstance(cache, (Store, ObjectStore)):
        return cache
    if isinstance(cache, str) and intermediates.is_url(cache):
        return cache.strip().rstrip("/")
    if cache is True or (isinstance(cache, str) and cache.strip().lower() in _TRUE_WORDS):
        setting = config.get("cache")
        if setting is None or setting is True or str(setting).strip().lower() in _TRUE_WORDS:
            return resolve_path(DEFAULT_STORE)
        return resolve_spec(setting)
    if isinstance(cache, (str, os.PathLike)):
        if not os.fspath(cache).strip():
            raise ValueError("cache='' names no store; give a store name or path, or True")
        return resolve_path(cache)
    raise TypeError(
        f"cache must be True, False, None, a store name, a path or a Store, not "
        f"{type(cache).__name__} ({cache!r})"
    )


def _handle(spec: Any) -> _Handle:
    """The engine's handle of the store ``spec`` (a path, a URL or a store), opened on
    first use with no RAM tier. Raises what opening the store raises."""
    if isinstance(spec, ObjectStore) or (isinstance(spec, str) and intermediates.is_url(spec)):
        return _object_handle(spec)
    given = spec if isinstance(spec, Store) else None
    path = Path(given.path if given is not None else spec)
    with _registry_lock:
        found = _registry.get(str(path))
        if found is not None and not found.store.closed:
            if given is None or found.store.disk_limit == given.disk_limit:
                return found
            if found.owned:
                found.store.close()
        if given is None:
            handle = _Handle(_open_by_path(path), owned=True)
        elif given.ram_limit == 0:
            handle = _Handle(given, owned=False)
        else:
            # The caller's store keeps a copy of every value in its RAM tier; the engine
            # keeps none, so it opens the folder again without one.
            try:
                opened = store(
                    given.path, ram_mb=0, disk_gb=given.disk_limit / GB, durable=given.durable
                )
                handle = _Handle(opened, owned=True)
            except Exception as exc:  # signed with another key file: use it as given
                log.debug("using store %s as given: %s", given.path, exc)
                handle = _Handle(given, owned=False)
        if found is not None:
            handle.hits, handle.misses = found.hits, found.misses
            handle.writes, handle.failed_writes = found.writes, found.failed_writes
            handle.bytes_read, handle.bytes_written = found.bytes_read, found.bytes_written
        _registry[str(path)] = handle
        return handle


def _where(spec: Any) -> Any:
    """The path or URL of a store spec (a path, a URL or a store)."""
    return spec.path if isinstance(spec, (Store, ObjectStore)) else spec


def _object_handle(spec: str | ObjectStore) -> _Handle:
    """The handle of the store in object storage at ``spec`` (a URL, or the store as a
    driver sent it: with its signing key), opened once per process."""
    url = spec.path if isinstance(spec, ObjectStore) else spec
    with _registry_lock:
        found = _registry.get(url)
        if found is not None and not found.store.closed:
            return found
        opened = spec if isinstance(spec, ObjectStore) else ObjectStore(url)
        handle = _registry[url] = _Handle(opened, owned=True)
        return handle


def _open_by_path(path: Path) -> Store:
    """The store at ``path`` with no RAM tier and :data:`DISK_GB` of SSD, or room for
    what it already holds when that is more: a store filled earlier under a larger
    limit is not evicted down to the default by the next write."""
    opened = store(path, ram_mb=0, disk_gb=DISK_GB)
    held = opened.usage().ssd_bytes
    if held <= opened.disk_limit:
        return opened
    opened.close()
    log.info("cache %s holds %s: keeping room for it", path, format_bytes(held))
    return store(path, ram_mb=0, disk_gb=held * 1.25 / GB)


def close_all() -> None:
    """Close the stores the engine opened (and forget its counters). The next cached
    compute opens them again; for tests, and before unmounting a cache's disk."""
    with _registry_lock:
        handles = list(_registry.values())
        _registry.clear()
    for h in handles:
        if h.owned:
            h.store.close()


# -- one compute ----------------------------------------------------------------------


def _entry_key(kind: str, node_key: str, extent: tuple[Any, ...]) -> tuple[Any, ...]:
    """The store key of an entry (see the module docstring)."""
    return ("tierflow", FORMAT, kind, node_key, *extent)


def _partition_token(node: Node) -> str:
    """The block boundaries block ``j`` of ``node`` follows, when its rows are unknown."""
    if isinstance(node, Chunked) and node.bounds is not None:
        return "rows:" + identity.digest(",".join(map(str, node.bounds)))
    if isinstance(node, graph.Source):
        return f"files:{getattr(node.reader, 'files_per_block', 1)}"
    if isinstance(node, graph.Concat):
        return "concat(" + ",".join(_partition_token(i) for i in node.inputs) + ")"
    first = next(i for i in node.inputs if isinstance(i, Chunked))
    return _partition_token(first)


class Entry:
    """The cache entries of one node in one compute: its blocks, its partials (a
    reduction) or its value. Methods run on workers; counters go to the handle, failures
    to the session."""

    __slots__ = ("_partition", "dtype", "handle", "key", "node", "row_shape", "session")

    def __init__(self, session: Session, handle: _Handle, node: Node) -> None:
        self.session = session
        self.handle = handle
        self.node = node
        self.key = node.key
        self.dtype = node.dtype
        self.row_shape = tuple(node.shape[1:])
        self._partition: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # To a worker process: the store by path (opened there with the same SSD limit),
        # or an object-storage store itself (its URL, options and signing key), and the
        # node; what the worker counts and what fails there comes back with the task's
        # result (take_reports / add_reports).
        store_ = self.handle.store
        where = store_ if isinstance(store_, ObjectStore) else str(store_.path)
        return (_entry_here, (where, store_.disk_limit, self.node, self._partition))

    # -- keys --

    def _extent(self, req: Request) -> tuple[Any, ...]:
        if isinstance(req, RowRange):
            return (int(req.start), int(req.stop))
        if self._partition is None:
            of = self.node.inputs[0] if isinstance(self.node, graph.Reduce) else self.node
            self._partition = identity.digest(_partition_token(of))
        return ("b", int(req.index), self._partition)

    def _key(self, kind: str, req: Request | None = None) -> tuple[Any, ...]:
        return _entry_key(kind, self.key, () if req is None else self._extent(req))

    # -- store access --

    def _get(self, key: tuple[Any, ...]) -> Any:
        try:
            return self.handle.store.get(key, MISS)
        except Exception as exc:  # a closed store, a damaged index: computed instead
            self.session.failed(self.handle, "read", exc)
            return MISS

    def _has(self, key: tuple[Any, ...]) -> bool:
        try:
            return key in self.handle.store
        except Exception:  # only a hint for readahead
            return False

    def _put(self, key: tuple[Any, ...], value: Any, nbytes: int) -> bool:
        if self.session.stopped(self.handle):
            return False
        try:
            self.handle.store.set(key, value, tag=TAG)
        except Exception as exc:
            self.handle.wrote(nbytes, ok=False)
            self.session.failed(self.handle, "write", exc)
            return False
        self.handle.wrote(nbytes, ok=True)
        return True

    # -- blocks --

    def get_block(self, req: Request) -> np.ndarray | None:
        """Block ``req`` of the node, memory-mapped read-only from the store; None on a
        miss (also for an entry whose dtype or shape is not the node's)."""
        found = self._get(self._key("block", req))
        usable = (
            isinstance(found, np.ndarray)
            and found.dtype == self.dtype
            and found.shape[1:] == self.row_shape
            and (not isinstance(req, RowRange) or found.shape[0] == req.stop - req.start)
        )
        if not usable:
            if found is not MISS:
                log.warning(
                    "cache %s: the entry for a block of %s is not an array of its dtype and "
                    "shape; computing it again",
                    self.handle.name,
                    self.node.label(),
                )
            self.handle.count(miss=1)
            return None
        self.handle.count(hit=1, read=found.nbytes)
        return found

    def has_block(self, req: Request) -> bool:
        """Whether the store has block ``req`` (a file check, for readahead)."""
        return self._has(self._key("block", req))

    def put_block(self, req: Request, block: np.ndarray) -> None:
        """Keep ``block``; a failure is recorded and warned about at the end."""
        key = self._key("block", req)
        if self._put(key, block, int(block.nbytes)) and block.nbytes:
            self._settle(key)

    def _settle(self, key: tuple[Any, ...]) -> None:
        """Under high pressure, write the new entry back and drop it from the page cache."""
        if pressure.level_now() not in _HIGH or isinstance(self.handle.store, ObjectStore):
            return  # (an object's local copy is gone already)
        try:
            mapped = self.handle.store.get(key)
            if isinstance(mapped, np.memmap):
                pages.release(mapped, drop_cache=True)
        except Exception:  # a hint; the entry is written either way
            log.debug("could not drop the pages of a cache entry", exc_info=True)

    # -- partials of a reduction --

    def get_partial(self, req: Request) -> Any:
        """The partial result of block ``req``, or :data:`MISS`. Arrays come back as
        writable copies (a combine may update a partial in place)."""
        found = self._get(self._key("partial", req))
        if found is MISS:
            self.handle.count(miss=1)
            return MISS
        self.handle.count(hit=1)
        return np.array(found) if isinstance(found, np.ndarray) else found

    def has_partial(self, req: Request) -> bool:
        return self._has(self._key("partial", req))

    def put_partial(self, req: Request, partial: Any) -> None:
        nbytes = int(partial.nbytes) if isinstance(partial, np.ndarray) else 0
        self._put(self._key("partial", req), partial, nbytes)

    # -- values --

    def get_value(self) -> Any:
        """The node's value, or :data:`MISS`; arrays come back as writable copies."""
        found = self._get(self._key("value"))
        if found is MISS:
            self.handle.count(miss=1)
            return MISS
        self.handle.count(hit=1)
        return np.array(found) if isinstance(found, np.ndarray) else found

    def put_value(self, value: Any) -> None:
        nbytes = int(value.nbytes) if isinstance(value, np.ndarray) else 0
        self._put(self._key("value"), value, nbytes)


def _entry_here(
    path: str | ObjectStore, disk_limit: int, node: Node, partition: str | None
) -> Entry:
    """An entry sent from the driver, in this (worker) process: the same store, opened
    here by path (or as sent, in object storage), and this process's session of reports
    (see :func:`take_reports`)."""
    if isinstance(path, ObjectStore):
        handle = _object_handle(path)
    else:
        with _registry_lock:
            found = _registry.get(path)
            if found is None or found.store.closed:
                opened = store(path, ram_mb=0, disk_gb=disk_limit / GB)
                found = _registry[path] = _Handle(opened, owned=True)
        handle = found
    entry = Entry(_here, handle, node)
    entry._partition = partition
    return entry


def take_reports() -> list[tuple[str, tuple[int, ...], list[tuple[str, BaseException]]]]:
    """In a worker process: per store, the counters (hits, misses, bytes read, writes,
    failed writes, bytes written) and failures since the last call, which are reset.
    The driver adds them to its own with :func:`add_reports`."""
    reports: list[tuple[str, tuple[int, ...], list[tuple[str, BaseException]]]] = []
    with _registry_lock:
        handles = list(_registry.values())
    failures = _here.take_failures()
    for h in handles:
        with h.lock:
            counts = (h.hits, h.misses, h.bytes_read, h.writes, h.failed_writes, h.bytes_written)
            h.reset_unlocked()
        mine = [(what, exc) for handle, what, exc in failures if handle is h]
        if any(counts) or mine:
            reports.append((str(h.store.path), counts, mine))
    return reports


def add_reports(
    reports: list[tuple[str, tuple[int, ...], list[tuple[str, BaseException]]]],
    session: Session | None,
) -> None:
    """In the driver: what workers counted and what failed there, as if it happened here."""
    for path, counts, failures in reports:
        with _registry_lock:
            handle = _registry.get(path)
        if handle is None:
            continue
        hits, misses, read, writes, failed, written = counts
        with handle.lock:
            handle.hits += hits
            handle.misses += misses
            handle.bytes_read += read
            handle.writes += writes
            handle.failed_writes += failed
            handle.bytes_written += written
        if session is not None:
            for what, exc in failures:
                session.failed(handle, what, exc)


class Session:
    """What one compute caches and where (``handles``: node ident -> store), the values
    found before planning (:attr:`resolved`), and the failures to warn about.

    The failure records are guarded by ``_lock`` (workers report them)."""

    def __init__(self, handles: dict[str, _Handle]) -> None:
        self._handles = handles
        self._entries: dict[str, Entry] = {}
        self._entries_lock = threading.Lock()
        self.resolved: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._failures: dict[int, tuple[_Handle, str, int, BaseException]] = {}
        self._stopped: set[int] = set()
        self._reported: list[tuple[_Handle, str, BaseException]] = []

    def entry(self, node: Node) -> Entry | None:
        """The entries of ``node`` if this compute caches it, else None."""
        handle = self._handles.get(node.ident)
        if handle is None:
            return None
        with self._entries_lock:
            found = self._entries.get(node.ident)
            if found is None:
                found = self._entries[node.ident] = Entry(self, handle, node)
        return found

    def resolve(self, roots: Iterable[Node]) -> dict[str, Any]:
        """Look up cached values from the roots down, and stop below each one found:
        what it was computed from is not needed. Returns :attr:`resolved`."""
        seen: set[str] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node.ident in seen:
                continue
            seen.add(node.ident)
            if isinstance(node, graph.Value):
                entry = self.entry(node)
                if entry is not None:
                    value = entry.get_value()
                    if value is not MISS:
                        self.resolved[node.ident] = value
                        continue
            stack.extend(node.inputs)
        return self.resolved

    def stopped(self, handle: _Handle) -> bool:
        """Whether writes to ``handle`` stopped in this compute (its disk is full)."""
        return id(handle) in self._stopped

    def take_failures(self) -> list[tuple[_Handle, str, BaseException]]:
        """Every failure recorded since the last call (a worker's session sends them to
        the driver), forgotten here."""
        with self._lock:
            taken, self._reported = self._reported, []
        return taken

    def failed(self, handle: _Handle, what: str, exc: BaseException) -> None:
        """Record a failed ``what`` ("read" or "write"); a full disk stops the writes."""
        with self._lock:
            if self is _here:
                self._reported.append((handle, what, exc))
            found = self._failures.get(id(handle))
            if found is None:
                self._failures[id(handle)] = (handle, what, 1, exc)
            else:
                self._failures[id(handle)] = (handle, found[1], found[2] + 1, found[3])
            if _disk_full(exc):
                self._stopped.add(id(handle))
        log.debug("cache %s: %s failed", handle.name, what, exc_info=exc)

    def finish(self) -> None:
        """Warn (on the calling thread) about what failed in this compute."""
        with self._lock:
            failures = list(self._failures.values())
            self._failures.clear()
        for handle, what, count, exc in failures:
            warnings.warn(CacheWarning(_failure_message(handle, what, count, exc)), stacklevel=4)


# Entries sent to this process (a worker's) report to this session: see take_reports.
_here = Session({})


def _disk_full(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return True
        text = str(seen).lower()
        if "no space left" in text or "disk is full" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _failure_message(handle: _Handle, what: str, count: int, exc: BaseException) -> str:
    where = f"cache store {handle.name!r} ({handle.store.path})"
    first = f"{type(exc).__name__}: {exc}"
    if what == "read":
        return (
            f"{where}: {count} read(s) failed, the first with {first}. Those blocks were "
            "computed instead; the results are complete"
        )
    if _disk_full(exc):
        return (
            f"{where}: the disk is full ({count} write(s) failed, the first with {first}); "
            "this compute stopped writing to the cache and completed without it. Free "
            "space on that disk, clear old entries (tw.cache_clear()), or point the cache "
            "at a bigger disk (cache=path, or TIERFLOW_CACHE)"
        )
    return (
        f"{where}: {count} write(s) failed, the first with {first}. The results are "
        "complete; what was not written will be computed again next time"
    )


def _cacheable(node: Node) -> bool:
    # Sources that read are already on disk or in memory, constants in memory: nothing
    # to save. A source that computes its rows (from_dask) is kept like any result.
    if isinstance(node, graph.Source):
        return bool(node.reader.computes)
    if not getattr(node, "cacheable", True):  # an external sort's runs: files of one compute
        return False
    return not isinstance(node, graph.Const)


def _open_quietly(spec: Any) -> _Handle | None:
    try:
        return _handle(spec)
    except Exception as exc:
        where = _where(spec)
        warnings.warn(
            CacheWarning(
                f"cannot open the cache store at {where} ({type(exc).__name__}: {exc}); "
                "computing without it"
            ),
            stacklevel=5,
        )
        return None


def session(cache: Any, roots: Sequence[Node]) -> Session | None:
    """The cache session of a compute of ``roots``, or None when nothing is cached.

    ``cache``: None (the ``cache`` setting; nodes marked with ``x.cache()`` either
    way), False (nothing, marks included), True (the setting's store, or
    :data:`DEFAULT_STORE`), a store name or path, or a :class:`Store`. Raises
    ``TypeError`` for anything else; a store that cannot be opened is a
    :class:`CacheWarning`. Also removes spill folders of processes that are gone (a
    compute killed before this one).
    """
    if cache is False:
        return None
    if cache is None:
        setting = config.get("cache")
        spec = None if setting is None or setting is False else resolve_spec(setting)
    else:
        spec = resolve_spec(cache)
    default = _open_quietly(spec) if spec is not None else None
    marked: dict[int, _Handle | None] = {}

    def mark_handle(mark: Any) -> _Handle | None:
        if mark is True and default is not None:
            return default
        found = marked.get(id(mark), MISS)
        if found is MISS:
            found = marked[id(mark)] = _open_quietly(resolve_spec(mark))
        return found

    handles: dict[str, _Handle] = {}
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[Node, _Handle | None, bool]] = [(r, default, True) for r in roots]
    while stack:
        node, inherited, is_root = stack.pop()
        mark = node.cache_mark
        here = mark_handle(mark) if mark is not None and mark is not False else None
        if here is None and (is_root or isinstance(node, graph.Value)):
            here = inherited
        if here is not None and _cacheable(node):
            handles.setdefault(node.ident, here)
        below = here or inherited
        if (id(node), id(below)) in seen:
            continue
        seen.add((id(node), id(below)))
        stack.extend((child, below, False) for child in node.inputs)
    if default is not None:
        _adopt_cached(roots, handles, default)
    if not handles:
        return None
    spill.clean_stale()
    return Session(handles)


def _adopt_cached(roots: Sequence[Node], handles: dict[str, _Handle], handle: _Handle) -> None:
    """Cache also the chunked nodes whose first block ``handle``'s store already holds
    (an earlier compute cached them), so this compute reads their blocks instead of
    computing them: how a compute that shares part of a cached graph reuses it."""
    for node in graph.walk(roots):
        if node.ident in handles or not isinstance(node, Chunked) or not _cacheable(node):
            continue
        if node.nblocks == 0:
            continue
        if node.bounds is not None:
            extent: tuple[Any, ...] = (node.bounds[0], node.bounds[1])
        else:
            extent = ("b", 0, identity.digest(_partition_token(node)))
        try:
            found = _entry_key("block", node.key, extent) in handle.store
        except Exception:  # the compute finds out, and warns, when it reads
            found = False
        if found:
            handles[node.ident] = handle


# -- the public calls -----------------------------------------------------------------


def _handles_for(cache: Any) -> list[_Handle]:
    """The stores ``cache_info`` / ``cache_clear`` look at (see :func:`cache_info`)."""
    if cache is not None:
        return [_handle(resolve_spec(cache))]
    specs: list[Any] = []
    setting = config.get("cache")
    if setting is not None and setting is not False:
        specs.append(resolve_spec(setting))
    default = resolve_path(DEFAULT_STORE)
    if default.is_dir():
        specs.append(default)
    with _registry_lock:
        known = [h for h in _registry.values() if not h.store.closed]
    found = {str(h.store.path): h for h in known}
    for spec in specs:
        path = str(_where(spec))
        if path not in found:
            with contextlib.suppress(Exception):
                found[path] = _handle(spec)
    return list(found.values())


def cache_info(cache: Any = None) -> dict[str, CacheInfo]:
    """Hits, misses, writes and bytes per tier of the engine's cache stores, by name.

    ``cache`` None: every store this process cached in, the ``cache`` setting's store
    and the default store (``"cache"``) if it exists; else the one store it names
    (True, a name, a path or a Store, as for ``compute(cache=...)``). Counters are this
    process's since the last :func:`cache_clear`; entries and bytes are the store's.
    Two stores with the same name are told apart by path.

    >>> import tierflow as tw
    >>> info = tw.cache_info()            # doctest: +SKIP
    >>> info["cache"].hits                # doctest: +SKIP
    """
    out: dict[str, CacheInfo] = {}
    for h in _handles_for(cache):
        info = h.info()
        out[info.path if info.name in out else info.name] = info
    return out


def cache_clear(cache: Any = None) -> int:
    """Remove the engine's entries from its cache stores; the number removed.

    ``cache`` as for :func:`cache_info`. Only entries the engine wrote (tag
    :data:`TAG`) are removed: other values in a shared store stay. The counters of
    those stores start again from zero. Raises :class:`~tierflow.errors.StoreError`
    when a store cannot be opened or changed.
    """
    removed = 0
    for h in _handles_for(cache):
        removed += h.store.clear(tag=TAG)
        h.reset()
    return removed
