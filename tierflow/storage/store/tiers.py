"""The two-tier store: a bounded RAM tier over a bounded SSD tier, shared by processes.

Layout of a store folder::

    .tierflow-store     marker: format version and the id of the key that signs entries
    index.sqlite        the index (+ -wal, -shm): one row per entry, running totals
    lock                flock()ed around every change of files (see Concurrency)
    data/3f/3fa4...     one file per entry, named by a digest of the key (.keys)
    tmp/                files being written: <pid>-<process start>-<n>.tmp

Tiers
-----
Every value is on the SSD; the RAM tier holds some of them too. ``set`` writes the file,
then keeps a read-only copy of an array or an unpickled copy of any other value in RAM
(tensors stay out: see :mod:`.serial`). ``get`` answers from RAM when it can, else reads
the file: a pickled value is unpickled and kept in RAM; an array or tensor is
memory-mapped and not kept, since mapping again costs microseconds and no RAM.

The RAM tier holds at most ``ram_mb``; least recently used values leave first. The
SSD tier holds at most ``disk_gb``: a ``set`` that takes the total past it removes the
least recently used entries (never the one being set) until the total is at most 90 %
of the limit, so eviction runs once per tenth of the tier rather than on every set. A
value larger than the whole tier is refused before anything is evicted.

Access times drive both LRU orders. A RAM hit records its time in memory; the times
are written to the index in one transaction every 512 accesses, every 2 s, before any
eviction and on close, so a hit costs microseconds and the order survives restarts
(roughly: times not yet written when a process dies are lost).

Atomicity and durability
------------------------
A value is written to a temporary file in ``tmp/``, the index row is committed, and
only then is the file renamed over ``data/xx/<name>``. A reader sees the old file or the
new one, never a torn one, and a killed writer leaves at worst a temporary file (removed
when the store is next opened, once its process is gone) or an index row whose file is
missing or older (a miss, or the previous value; the row is dropped when noticed).
Evicted and deleted files are unlinked before their rows are committed, so no crash
leaves a file the index does not count. A memory-mapped array handed out earlier stays
valid when its entry is replaced or evicted (the file is unlinked, not rewritten).

By default nothing is fsync'ed: that would cost more than the whole ``set`` of a small
value. What is promised is safety against process crashes (the page cache survives
them). A power loss may lose recent sets, and leave a file whose content did not reach
the disk: its checks (see :mod:`.serial`) turn it into a miss, not a wrong value, except
array data, which is not checksummed. ``durable=True`` fsyncs each file before it is
renamed, the folder after, and commits with ``synchronous=FULL``.

Concurrency
-----------
``_lock`` (a re-entrant thread lock) guards the RAM tier, the pending access times and
the index connection; files are written and read outside it. Across processes, every
change of the files under ``data/``, and of the sizes in the index, happens with
``lock`` flock()ed, so a commit and the rename that follows it are never split by
another process, and a process that removes a damaged file cannot remove a good one
another process has just renamed in its place. A set that fits is one SQLite statement
whose limit check runs inside it (see :meth:`.index.Index.put_within`); a set that does
not fit, and every delete, is one ``BEGIN IMMEDIATE`` transaction. So "total <= limit"
holds after every commit: two processes filling one store stay within the limit, give
or take the temporary file each is writing. A RAM hit checks (one ``stat``) that the
file is still the one the value came from, so a value replaced or removed by another
process is not served from RAM.

A process that forks keeps using the store in the child with its own connection and
lock file (SQLite connections must not cross a fork).

What a ``set`` costs
--------------------
A small untagged ``set`` that evicts nothing makes 19 system calls: the temporary
file's ``open``, ``write``, ``fstat`` (its identity, for the RAM tier) and ``close``;
``flock`` and its release; the SQLite statement's 12 (six ``fcntl`` locks on the WAL
index, and a header and a page written to the WAL for each of the three pages it
changes: the entry's B-tree leaf, the access-time index's last leaf and the totals);
and the ``rename``. Nothing is read back, nothing is fsync'ed unless the store is
durable, no folder is checked (a missing fan-out folder is made when a rename first
fails for it), and access times of hits are written later, in batches.

Pressure
--------
Each store subscribes to :mod:`tierflow.system.pressure`: ``high`` halves the RAM tier,
``critical`` empties it (the registry then collects garbage), back to ``ok`` restores
``ram_mb``; ``moderate`` changes nothing. :func:`tierflow.memory.relieve` empties it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import sqlite3
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import config
from ...config import GB, MB, format_bytes
from ...errors import StoreError
from ...system import pressure, processes
from ...system.types import Level
from .index import Index, IndexDamaged, Row, is_damage
from .keys import Key, decode_key, encode_key, name_of, relative_path
from .ram import RamTier
from .serial import EntryDamaged, StoreWarning, file_ident, read_entry, read_meta, write_entry
from .signing import load_signer

__all__ = ["FORMAT", "MARKER", "Store", "StoreUsage", "resolve_path", "store"]

log = logging.getLogger(__name__)

MARKER = ".tierflow-store"
FORMAT = 1
_INDEX = "index.sqlite"
_DAMAGED = "index.damaged"
_EVICT_TO = 0.9  # evict down to this share of the SSD limit
_TOUCH_BATCH = 512  # write access times after this many accesses...
_TOUCH_EVERY = 2.0  # ...or after this many seconds
_NAME_RE = re.compile(r"[0-9a-f]{32}")
_TEMP_RE = re.compile(r"(\d+)-(\d+)-\d+\.tmp")

_MISSING: Any = object()

# -- processes: temporary-file counter, forks ------------------------------------------

_fork_generation = 0
_counter = itertools.count()
# Connections and lock files inherited over a fork: never used again, never closed (closing
# a SQLite connection in a child can disturb the parent's locks).
_abandoned: list[object] = []


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _unlink(path: str | os.PathLike[str]) -> bool:
    """Remove a file; False if it was not there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _fsync_folder(folder: str | os.PathLike[str]) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- where a store lives ---------------------------------------------------------------


def resolve_path(name_or_path: str | os.PathLike[str]) -> Path:
    """The folder of a store: a name is a folder under the ``store_dir`` setting; a
    ``Path``, or a string with a path separator, is used as it is (``~`` expanded).

    Raises ``ValueError`` for an empty name, ``.``, ``..`` or a name with a NUL byte,
    and ``TypeError`` for anything but a string or path.

    >>> resolve_path("/data/embeddings")
    PosixPath('/data/embeddings')
    """
    if isinstance(name_or_path, os.PathLike):
        return Path(name_or_path).expanduser().absolute()
    if not isinstance(name_or_path, str):
        raise TypeError(
            f"a store is named by a string or a path, not {type(name_or_path).__name__}"
        )
    separators = [os.sep] + ([os.altsep] if os.altsep else [])
    if any(s in name_or_path for s in separators):
        return Path(name_or_path).expanduser().absolute()
    if name_or_path in ("", ".", "..") or "\0" in name_or_path:
        raise ValueError(
            f"{name_or_path!r} is not a store name; use a word such as 'embeddings', or a path"
        )
    return Path(config.get("store_dir")).expanduser().absolute() / name_or_path


def _prepare_folder(root: Path, key_id: str, key_file: str) -> None:
    """Make sure ``root`` is a tierflow store signed with ``key_id``, creating it when
    it is missing or empty. Raises :class:`StoreError` otherwise: eviction deletes
    files, so a store only ever works in a folder it owns."""
    if root.exists() and not root.is_dir():
        raise StoreError(
            f"{root} is a file; a store needs a folder that is missing, empty, or a store"
        )
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create the store folder {root}: {exc}") from exc
    marker = root / MARKER
    for _ in range(3):
        names = os.listdir(root)
        if MARKER in names or marker.exists():
            break
        others = sorted(n for n in names if not n.startswith(MARKER + "."))
        if others:
            shown = ", ".join(others[:5]) + (
                f" and {len(others) - 5} more" if len(others) > 5 else ""
            )
            raise StoreError(
                f"{root} is not empty ({shown}) and is not a tierflow store (no {MARKER} "
                "file). A store deletes files in its folder when it evicts, so it only opens a "
                "missing or empty folder, or one it created: choose another path"
            )
        _create_marker(marker, key_id)
    _check_marker(marker, key_id, key_file)


def _create_marker(marker: Path, key_id: str) -> None:
    tmp = marker.with_name(f"{MARKER}.{os.getpid()}.{secrets.token_hex(6)}")
    data = json.dumps({"format": FORMAT, "key_id": key_id}).encode() + b"\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        # link() publishes the marker with its content in one step and fails if another
        # process published one first; theirs is then the marker.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, marker)
            _fsync_folder(marker.parent)
    finally:
        _unlink(tmp)


def _check_marker(marker: Path, key_id: str, key_file: str) -> None:
    try:
        fields = json.loads(marker.read_bytes())
        version = int(fields["format"])
        their_key = str(fields["key_id"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(
            f"the store marker {marker} is unreadable ({exc}); the folder was changed outside "
            "tierflow. Remove the folder to start over"
        ) from exc
    if version > FORMAT:
        raise StoreError(
            f"{marker.parent} is a store of format {version}, written by a newer tierflow; "
            f"this version reads format {FORMAT}: upgrade tierflow"
        )
    if their_key != key_id:
        raise StoreError(
            f"{marker.parent} was created with another signing key (key id {their_key}; the key "
            f"{key_file} has id {key_id}), so none of its entries could be trusted. Restore the "
            "key file it was created with, or remove the folder to start over"
        )


# -- the store -------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreUsage:
    """How full a store is: entries and bytes in each tier, and the limits (bytes)."""

    ram_entries: int
    ram_bytes: int
    ram_limit: int
    ssd_entries: int
    ssd_bytes: int
    ssd_limit: int


class _Handles:
    """What a store holds open in one process: the flock()ed lock file, the index, and
    the access times not yet written. Closed by the store or, if it is never closed,
    when it is garbage-collected or the process exits (``weakref.finalize``)."""

    def __init__(self, lock_fd: int, index: Index) -> None:
        self.lock_fd = lock_fd
        self.index = index
        self.pending: dict[str, float] = {}
        self.last_flush = time.monotonic()
        self.generation = _fork_generation

    def close(self) -> None:
        if self.generation != _fork_generation:
            return  # inherited over a fork: the parent owns these
        if self.pending:
            times = [(t, n) for n, t in self.pending.items()]
            self.pending.clear()
            try:
                with self.index.write():
                    self.index.touch(times)
            except sqlite3.Error:
                log.debug("access times not written at close", exc_info=True)
        with contextlib.suppress(sqlite3.Error):
            self.index.close()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)


class Store(MutableMapping[Any, Any]):
    """A persistent key-value store with a RAM tier over an SSD tier.

    Open one with :func:`store` (``memory.store``). ``path`` must be a missing or empty
    folder, or a folder this class created (:class:`~tierflow.errors.StoreError`
    otherwise). ``ram_mb`` bounds the RAM tier (MB, 0 for none); ``disk_gb`` bounds the
    SSD tier (GB; binary units). ``durable=True`` fsyncs every write (see the module
    docstring). ``key_file`` is the signing key (default ``store.key`` next to the
    ``store_dir`` folder, created on first use).

    Keys are ``str``, ``bytes``, ``int`` or tuples of them (``TypeError`` otherwise).
    NumPy arrays come back memory-mapped and read-only, torch tensors as tensors, other
    values unpickled — only from files whose signature checks out. Values held in the
    RAM tier are returned as the same object on every hit: do not modify them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        ram_mb: float = 256,
        disk_gb: float = 10,
        durable: bool = False,
        key_file: str | os.PathLike[str] | None = None,
    ) -> None:
        for name, value, low in (("ram_mb", ram_mb, 0), ("disk_gb", disk_gb, None)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise TypeError(f"{name} must be a number, got {value!r}")
            if (low is None and value <= 0) or value < 0:
                raise ValueError(f"{name}={value!r} must be {'>= 0' if low == 0 else '> 0'}")
        self.path = Path(path).expanduser().absolute()
        self.name = self.path.name
        self.ram_limit = int(ram_mb * MB)
        self.disk_limit = int(disk_gb * GB)
        self.durable = bool(durable)
        self._signer = load_signer(key_file)
        self._key_path = None if key_file is None else os.fspath(key_file)
        self._key_file = str(key_file) if key_file is not None else "the default store.key"
        self._lock = threading.RLock()
        self._ram = RamTier(self.ram_limit)
        self._closed = False
        self._data = str(self.path / "data")
        self._tmp = str(self.path / "tmp")
        _prepare_folder(self.path, self._signer.key_id, self._key_file)
        self._h = self._open_handles(first=True)
        self._finalizer = weakref.finalize(self, self._h.close)
        pressure.subscribe(self)

    # -- opening, rebuilding ---------------------------------------------------------

    def _open_handles(self, *, first: bool) -> _Handles:
        lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not first:
                index = self._open_index()
            else:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                try:
                    os.makedirs(self._data, exist_ok=True)
                    os.makedirs(self._tmp, exist_ok=True)
                    self._remove_stale_temps()
                    index = self._open_or_rebuild_index()
                finally:
                    fcntl.flock(lock_fd, fcntl.LOCK_UN)
            try:
                index.limit(self.disk_limit)
            except BaseException:
                index.close()
                raise
            return _Handles(lock_fd, index)
        except BaseException:
            os.close(lock_fd)
            raise

    def _open_index(self) -> Index:
        try:
            return Index(self.path / _INDEX, durable=self.durable)
        except (IndexDamaged, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the index of store {self.path}: {exc}") from exc

    def _open_or_rebuild_index(self) -> Index:
        """Open the index, or rebuild it from the entry files when it is missing,
        unreadable, or was found damaged while in use. Needs the flock."""
        flag = self.path / _DAMAGED
        reason = "it was found damaged while in use" if flag.exists() else None
        index = None
        if reason is None:
            try:
                index = Index(self.path / _INDEX, durable=self.durable)
            except IndexDamaged as exc:
                reason = f"it was unreadable ({exc})"
            except sqlite3.Error as exc:
                raise StoreError(f"cannot open the index of store {self.path}: {exc}") from exc
        if index is None:
            for suffix in ("", "-wal", "-shm", "-journal"):
                _unlink(self.path / (_INDEX + suffix))
            index = self._open_index()
        if index.created:
            try:
                found, dropped = self._fill(index)
            except BaseException:
                index.close()
                raise
            if reason is not None or found or dropped:
                why = reason or "it was missing"
                warnings.warn(
                    StoreWarning(
                        f"store {self.name!r}: the index {self.path / _INDEX} was rebuilt from "
                        f"the entry files because {why}: {found} entries found"
                        + (f", {dropped} damaged files removed" if dropped else "")
                    ),
                    stacklevel=5,
                )
        _unlink(flag)
        return index

    def _fill(self, index: Index) -> tuple[int, int]:
        """Replace the index's rows by what the entry files' trailers say; removes files
        that fail their checks. Returns (entries found, files removed). Needs the flock."""
        rows = []
        dropped = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self._data) as folders:
            for folder in folders:
                if not (len(folder.name) == 2 and folder.is_dir()):
                    continue
                with os.scandir(folder.path) as files:
                    for entry in files:
                        if not _NAME_RE.fullmatch(entry.name):
                            continue  # not a file this store writes: leave it alone
                        try:
                            meta, size = read_meta(entry.path, self._signer)
                            if name_of(meta.key) != entry.name or folder.name != entry.name[:2]:
                                raise EntryDamaged("it is not where its key belongs")
                            atime = entry.stat().st_mtime
                        except FileNotFoundError:
                            continue
                        except EntryDamaged as exc:
                            log.warning("store %s: removing %s: %s", self.name, entry.path, exc)
                            _unlink(entry.path)
                            dropped += 1
                            continue
                        rows.append(Row(entry.name, meta.key, meta.tag, meta.kind, size, atime))
        with index.write():
            index.remove_all()
            index.put_many(rows)
        return len(rows), dropped

    def _remove_stale_temps(self) -> None:
        """Remove temporary files whose writing process is gone. Needs the flock."""
        with os.scandir(self._tmp) as entries:
            for entry in entries:
                match = _TEMP_RE.fullmatch(entry.name)
                if match and not processes.may_be_running(int(match.group(1)), int(match.group(2))):
                    _unlink(entry.path)

    def rebuild(self) -> int:
        """Re-read the index from the entry files (after a power loss, a non-durable
        store may hold files whose commit was lost); the number of entries found.
        Files that fail their checks are removed."""
        with self._lock:
            self._check_usable()
            with self._flock():
                self._h.pending.clear()
                index = self._h.index
                try:
                    index.limit(None)  # the files are what they are, even over the limit
                    try:
                        found, _ = self._fill(index)
                    finally:
                        index.limit(self.disk_limit)
                except sqlite3.DatabaseError as exc:
                    raise self._index_error(exc) from exc
            return found

    # -- small helpers ---------------------------------------------------------------

    def _file(self, name: str) -> str:
        return f"{self._data}/{relative_path(name)}"

    def _check_usable(self) -> None:
        """Raise if closed; after a fork, reopen this process's own handles. Needs _lock."""
        if self._closed:
            raise StoreError(f"store {self.name!r} at {self.path} is closed; open it again")
        if self._h.generation != _fork_generation:
            _abandoned.append(self._h)
            self._finalizer.detach()
            self._h = self._open_handles(first=False)
            self._finalizer = weakref.finalize(self, self._h.close)

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        """The cross-process lock on changes of entry files. Needs _lock: a flock belongs
        to an open file, so threads of this process would all pass it at once."""
        fcntl.flock(self._h.lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._h.lock_fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[Index]:
        """The cross-process lock plus a write transaction. Needs _lock."""
        with self._flock(), self._write() as index:
            yield index

    @contextlib.contextmanager
    def _write(self) -> Iterator[Index]:
        """A write transaction; a damaged database becomes a StoreError and is flagged
        for rebuilding at the next open. Needs _lock."""
        try:
            with self._h.index.write():
                yield self._h.index
        except sqlite3.DatabaseError as exc:
            raise self._index_error(exc) from exc

    def _index_error(self, exc: sqlite3.Error) -> StoreError:
        if is_damage(exc):
            with contextlib.suppress(OSError):
                (self.path / _DAMAGED).touch()
            return StoreError(
                f"the index of store {self.path} is damaged ({exc}); close the store and open "
                "it again to rebuild the index from the entry files"
            )
        return StoreError(f"the index of store {self.path} failed: {exc}")

    def _touch_locked(self, name: str) -> None:
        """Record an access to ``name``; written to the index in batches. Needs _lock."""
        h = self._h
        h.pending[name] = time.time()
        if len(h.pending) >= _TOUCH_BATCH or time.monotonic() - h.last_flush >= _TOUCH_EVERY:
            self._flush_locked()

    def _flush_locked(self, *, in_transaction: bool = False) -> None:
        """Write pending access times. Needs _lock. Failures are logged: the times are
        hints for eviction, never a reason for a read to fail."""
        h = self._h
        h.last_flush = time.monotonic()
        if not h.pending:
            return
        times = [(t, n) for n, t in h.pending.items()]
        h.pending.clear()
        if in_transaction:
            h.index.touch(times)
            return
        try:
            with h.index.write():
                h.index.touch(times)
        except sqlite3.Error:
            log.warning("store %s: could not record access times", self.name, exc_info=True)

    # -- the mapping -----------------------------------------------------------------

    def set(self, key: Key, value: Any, *, tag: str | None = None) -> None:
        """Store ``value`` under ``key`` (replacing any value), on the SSD and, if it
        fits, in RAM. ``tag`` labels the entry for :meth:`count` and :meth:`clear`.

        May evict least recently used entries. Raises ``TypeError`` for a bad key,
        what pickling raises for an unpicklable value, and
        :class:`~tierflow.errors.StoreError` for a value larger than the SSD tier
        (nothing is evicted for it) or a failed write (full disk: the previous value
        of ``key`` is kept).
        """
        encoded = encode_key(key)
        name = name_of(encoded)
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"tag must be a string or None, not {type(tag).__name__}")
        if self._closed or self._h.generation != _fork_generation:
            with self._lock:
                self._check_usable()
        tmp = f"{self._tmp}/{processes.token()}-{next(_counter)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise self._write_error(exc, key) from exc
        try:
            try:
                written = write_entry(fd, value, encoded, tag, self._signer)
                if self.durable:
                    os.fsync(fd)
                ident = file_ident(os.fstat(fd))
            finally:
                os.close(fd)
        except BaseException as exc:
            _unlink(tmp)
            if isinstance(exc, OSError):
                raise self._write_error(exc, key) from exc
            raise
        try:
            if written.size > self.disk_limit:
                raise StoreError(
                    f"the value for key {key!r} takes {format_bytes(written.size)} on disk, "
                    f"more than the whole SSD tier of store {self.name!r} "
                    f"({format_bytes(self.disk_limit)}, disk_gb={self.disk_limit / GB:g}); "
                    "nothing was evicted for it. Open the store with a larger disk_gb"
                )
            held = _MISSING
            if written.holder is not None and written.held_nbytes <= self._ram.capacity:
                held = written.holder()
            with self._lock:
                self._check_usable()
                row = Row(name, encoded, tag, written.kind, written.size, time.time())
                victims = self._commit(row, tmp)
                for victim in victims:
                    self._ram.discard(victim)
                if held is _MISSING:
                    self._ram.discard(name)
                else:
                    self._ram.put(name, held, written.held_nbytes, ident)
        except BaseException:
            _unlink(tmp)  # a no-op once renamed; otherwise the key keeps its previous value
            raise

    def _commit(self, row: Row, tmp: str) -> list[str]:
        """Record the entry's ``row``, evicting for it if the SSD tier would overflow, then
        rename its file ``tmp`` into place; the names evicted. Needs _lock; takes the flock.

        A set that fits is one SQLite statement, its own transaction: the index's limit
        guard checks the total inside it. One that does not fit records this process's
        access times, removes entries and records the row in one transaction. Either way
        the total is at most the limit after every commit."""
        lock_fd = self._h.lock_fd
        index = self._h.index
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            victims: list[str] = []
            try:
                if not index.put_within(row):
                    with index.write():
                        victims = self._make_room(row.name, row.size)
                        index.put(row._replace(atime=time.time()))
            except sqlite3.DatabaseError as exc:
                raise self._index_error(exc) from exc
            self._place(tmp, row.name)
            return victims
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)

    def _make_room(self, name: str, size: int) -> list[str]:
        """Remove least recently used entries (never ``name``) until an entry of ``size``
        bytes under ``name`` leaves the total at most 90 % of the limit; the names
        removed. Their files are unlinked before the caller commits, so no crash leaves
        a file the index does not count. Needs _lock, the flock and a write transaction."""
        index = self._h.index
        self._flush_locked(in_transaction=True)  # eviction sees this process's hits
        _, total = index.totals()
        after = total - (index.size_of(name) or 0) + size
        victims: list[str] = []
        if after <= self.disk_limit:
            return victims
        excess = after - int(self.disk_limit * _EVICT_TO)
        freed = 0
        for victim, victim_size in index.oldest(exclude=name):
            victims.append(victim)
            freed += victim_size
            if freed >= excess:
                break
        index.remove(victims)
        for victim in victims:
            _unlink(self._file(victim))
        return victims

    def _place(self, tmp: str, name: str) -> None:
        """Rename the written file ``tmp`` over the entry file of ``name``. Needs the flock."""
        target = f"{self._data}/{name[:2]}/{name}"  # self._file(name), inlined: a set's hot path
        try:
            os.replace(tmp, target)
        except FileNotFoundError:
            if not os.path.exists(tmp):
                raise StoreError(
                    f"the file being written for store {self.name!r} ({tmp}) was removed "
                    "by another process before it was complete; set the value again"
                ) from None
            # The first entry of its folder: folders are made when first needed, not
            # checked on every set.
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(tmp, target)
        if self.durable:
            _fsync_folder(os.path.dirname(target))

    def _write_error(self, exc: OSError, key: Key) -> StoreError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = format_bytes(shutil.disk_usage(self.path).free)
            except OSError:
                free = "unknown"
            return StoreError(
                f"no space left to store the value for key {key!r} in {self.path} ({free} free "
                "on that filesystem); the previous value of the key is unchanged. Free some "
                "space, or give the store a smaller disk_gb so that it evicts earlier"
            )
        return StoreError(f"could not write the value for key {key!r} to store {self.path}: {exc}")

    def get(self, key: Key, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` if the store does not have it.

        A file that fails its checks is a miss: it is removed, never unpickled, and a
        :class:`~tierflow.storage.store.serial.StoreWarning` says why. Raises
        ``TypeError`` for a bad key.
        """
        encoded = encode_key(key)
        name = name_of(encoded)
        path = self._file(name)
        with self._lock:
            self._check_usable()
            held = self._ram.get(name)
            if held is not None:
                try:
                    same = file_ident(os.stat(path)) == held.ident
                except FileNotFoundError:
                    same = False
                if same:
                    self._touch_locked(name)
                    return held.value
                self._ram.discard(name)  # replaced or removed by another process
        return self._load(name, encoded, path, default)

    def _load(self, name: str, encoded: bytes, path: str, default: Any) -> Any:
        try:
            loaded = read_entry(path, encoded, self._signer)
        except FileNotFoundError:
            self._forget_missing(name)
            return default
        except EntryDamaged as exc:
            self._remove_damaged(name, path, exc)
            return default
        with self._lock:
            if loaded.held and loaded.nbytes <= self._ram.capacity:
                self._ram.put(name, loaded.value, loaded.nbytes, loaded.ident)
            self._touch_locked(name)
        return loaded.value

    def _forget_missing(self, name: str) -> None:
        """Drop the row of an entry whose file is gone (a crash between commit and rename)."""
        with self._lock:
            try:
                if not self._h.index.has(name):
                    return
            except sqlite3.Error:
                return
            with self._exclusive() as index:
                if not os.path.exists(self._file(name)):
                    index.remove([name])

    def _remove_damaged(self, name: str, path: str, exc: EntryDamaged) -> None:
        ident = getattr(exc, "ident", None)
        with self._lock, self._exclusive() as index:
            try:
                current = file_ident(os.stat(path))
            except FileNotFoundError:
                current = None
            # Only the file that failed: another process may have just renamed a good one here.
            if current is not None and (ident is None or current == ident):
                _unlink(path)
                index.remove([name])
            self._ram.discard(name)
        warnings.warn(
            StoreWarning(
                f"store {self.name!r}: dropped the entry in {path}: {exc}. It was not loaded, "
                "and the file has been removed"
            ),
            stacklevel=4,
        )

    def delete(self, key: Key) -> bool:
        """Remove ``key``; whether it was there. ``TypeError`` for a bad key."""
        encoded = encode_key(key)
        name = name_of(encoded)
        with self._lock:
            self._check_usable()
            with self._exclusive() as index:
                had_row = index.has(name)
                index.remove([name])
                had_file = _unlink(self._file(name))
            self._ram.discard(name)
            self._h.pending.pop(name, None)
        return had_row or had_file

    def __getitem__(self, key: Key) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __setitem__(self, key: Key, value: Any) -> None:
        self.set(key, value)

    def __delitem__(self, key: Key) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        name = name_of(encode_key(key))
        with self._lock:
            self._check_usable()
        return os.path.exists(self._file(name))

    def __iter__(self) -> Iterator[Key]:
        """The keys, least recently used first (a snapshot taken now)."""
        with self._lock:
            self._check_usable()
            encoded = self._h.index.keys()
        return (decode_key(k) for k in encoded)

    def __len__(self) -> int:
        return self.count()

    def count(self, tag: str | None = None) -> int:
        """The number of entries, or of entries with ``tag``."""
        with self._lock:
            self._check_usable()
            try:
                return self._h.index.count(tag)
            except sqlite3.DatabaseError as exc:
                raise self._index_error(exc) from exc

    def clear(self, tag: str | None = None) -> int:  # type: ignore[override]
        """Remove every entry, or every entry with ``tag``; the number removed."""
        with self._lock:
            self._check_usable()
            with self._exclusive() as index:
                names = index.names(tag)
                for name in names:
                    _unlink(self._file(name))
                index.remove_all(tag)
                if tag is None:
                    self._remove_unindexed()
            if tag is None:
                self._ram.clear()
                self._h.pending.clear()
            else:
                for name in names:
                    self._ram.discard(name)
                    self._h.pending.pop(name, None)
            return len(names)

    def _remove_unindexed(self) -> None:
        """Unlink entry files the (now empty) index does not know. Needs the flock."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self._data) as folders:
            for folder in folders:
                if len(folder.name) == 2 and folder.is_dir():
                    with os.scandir(folder.path) as files:
                        for entry in files:
                            if _NAME_RE.fullmatch(entry.name):
                                _unlink(entry.path)

    def __eq__(self, other: object) -> bool:
        return self is other  # Mapping's __eq__ would read every value

    __hash__ = object.__hash__

    # -- state, pressure, closing ----------------------------------------------------

    def usage(self) -> StoreUsage:
        """Entries and bytes in each tier now, with the limits."""
        with self._lock:
            self._check_usable()
            try:
                count, size = self._h.index.totals()
            except sqlite3.DatabaseError as exc:
                raise self._index_error(exc) from exc
            return StoreUsage(
                len(self._ram), self._ram.nbytes, self._ram.capacity, count, size, self.disk_limit
            )

    def flush(self) -> None:
        """Write the access times recorded in memory to the index now."""
        with self._lock:
            self._check_usable()
            self._flush_locked()

    def on_pressure(self, level: Level | str) -> None:
        """React to a pressure level: ``high`` halves the RAM tier, ``critical`` empties
        it, ``ok`` restores ``ram_mb``, ``moderate`` changes nothing. Values stay on the SSD."""
        level = Level.parse(level)
        capacity = {
            Level.OK: self.ram_limit,
            Level.HIGH: self.ram_limit // 2,
            Level.CRITICAL: 0,
        }.get(level)
        if capacity is None:
            return
        with self._lock:
            if not self._closed:
                self._ram.resize(capacity)

    def relieve(self) -> int:
        """Empty the RAM tier now (values stay on the SSD); the bytes dropped."""
        with self._lock:
            return 0 if self._closed else self._ram.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Write pending access times, drop the RAM tier and close the index. Using the
        store afterwards raises :class:`~tierflow.errors.StoreError`; closing twice is fine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ram.clear()
            if self._h.generation == _fork_generation:
                self._finalizer()
            else:
                self._finalizer.detach()
                _abandoned.append(self._h)
        pressure.unsubscribe(self)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Another process opens the same folder with the same settings (its own handles,
        # its own RAM tier): what a lazy array marked with ``cache(store)`` carries.
        return _reopen, (
            str(self.path), self.ram_limit / MB, self.disk_limit / GB, self.durable,
            self._key_path,
        )  # fmt: skip

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<store {self.name}: closed>"
        try:
            use = self.usage()
        except (StoreError, sqlite3.Error):
            return f"<store {self.name}: index unreadable>"
        return (
            f"<store {self.name}: {use.ram_entries} in RAM ({use.ram_bytes / MB:.1f} MB), "
            f"{use.ssd_entries} on SSD ({use.ssd_bytes / MB:.1f} MB)>"
        )


def _reopen(path: str, ram_mb: float, disk_gb: float, durable: bool, key_file: str | None) -> Store:
    return Store(path, ram_mb=ram_mb, disk_gb=disk_gb, durable=durable, key_file=key_file)


def store(
    name_or_path: str | os.PathLike[str],
    ram_mb: float = 256,
    disk_gb: float = 10,
    *,
    durable: bool = False,
    key_file: str | os.PathLike[str] | None = None,
) -> Store:
    """Open (or create) a two-tier store.

    A name is a folder under the ``store_dir`` setting (``~/.tierflow/store``, or
    ``TIERFLOW_STORE_DIR``); a ``Path`` or a string with a path separator is used as
    it is. ``ram_mb`` bounds the RAM tier (MB), ``disk_gb`` the SSD tier (GB).
    ``durable=True`` fsyncs every write; ``key_file`` is the signing key (default
    ``store.key`` next to the ``store_dir`` folder). Raises
    :class:`~tierflow.errors.StoreError` for a folder that is not empty and not a
    store. See :class:`Store` for the API and :mod:`tierflow.storage.store.tiers` for
    the policy.

    >>> from tierflow import memory
    >>> with memory.store("embeddings", ram_mb=512, disk_gb=40) as s:  # doctest: +SKIP
    ...     s["doc-1"] = vector
    ...     s.get("doc-1")
    """
    return Store(
        resolve_path(name_or_path),
        ram_mb=ram_mb,
        disk_gb=disk_gb,
        durable=durable,
        key_file=key_file,
    )
