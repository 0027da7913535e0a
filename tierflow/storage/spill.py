"""Spill files: memory-mapped files on the SSD behind arrays the RAM budget cannot hold.

Layout::

    <spill_dir>/                  config "spill_dir", TIERFLOW_SPILL_DIR, ~/.tierflow/spill
        <pid>-<start>/            one folder per process, mode 0700
            tmpk3j9x2ab.bin       one file per array: raw bytes, C order, no header

``<pid>-<start>`` is the process's :func:`tierflow.system.processes.token` (its start
time in clock ticks since boot), so a folder whose pid was reused by a new process is
recognised as stale.
Folders tierflow creates, the root's missing parents included, are mode 0700. A file
name is random (``mkstemp``), never derived from shape or dtype: two arrays of the same
size never share a file. The file holds the array's bytes from offset 0, so byte ``k``
of the file is byte ``k`` of the array; the ``.bin`` suffix says it is not an ``.npy``.

Reserve before map. Every byte of a file is reserved with ``posix_fallocate`` before
the mapping is written. A sparse file the filesystem cannot back turns a full disk into
SIGBUS on some later page write: a signal, not an exception, that kills the process
without a traceback. So:

- ENOSPC/EDQUOT at reservation raise :class:`~tierflow.errors.SpillError` (an
  ``OSError`` with ``errno`` set) naming the folder, the bytes asked, the bytes free and
  the remedies (``TIERFLOW_SPILL_DIR`` on a bigger disk, or a larger RAM budget);
- a filesystem that cannot reserve (EOPNOTSUPP, EINVAL) is refused, never used
  unreserved;
- on every failure path the partial file is unlinked.

Freshly reserved blocks read as zeros, so a new spill-backed array starts zero-filled.

Cleanup. A file is deleted when its array is freed (:func:`discard`), when the last
view of it is garbage-collected (a ``weakref.finalize`` on the ``mmap`` object that
every view keeps alive), and at interpreter exit. The first spill file a process makes
under a root removes the folders of processes that are gone (no such pid, or the pid
now belongs to a process with another start time) and never touches the folder of a
live process, nor one whose start time cannot be read (the rule is
:func:`tierflow.system.processes.may_be_running`). Pids are only comparable within
one pid namespace: containers that share a spill folder should each use their own
``TIERFLOW_SPILL_DIR``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import re
import shutil
import sys
import tempfile
import threading
import weakref
from typing import Any

import numpy as np

from .. import config
from ..config import format_bytes
from ..errors import SpillError
from ..system import processes
from . import leases

__all__ = [
    "SUFFIX",
    "SpillFile",
    "clean_stale",
    "create",
    "describe_free",
    "discard",
    "free_bytes",
    "live_files",
    "map_array",
    "process_dir",
    "spill_file_of",
    "spill_root",
    "write_array",
]

logger = logging.getLogger(__name__)

PREFIX = "tmp"
SUFFIX = ".bin"

_DIR_RE = re.compile(r"(\d+)-(\d+)")
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_CANNOT_RESERVE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
_REMEDY_ROOM = (
    "Point TIERFLOW_SPILL_DIR (setting spill_dir) at a folder on a bigger disk, "
    "or raise the RAM budget (memory.budget() or TIERFLOW_RAM_BUDGET) so fewer arrays spill"
)


class SpillFile:
    """One reserved spill file, mapped by at most one array in this process.

    ``path`` is the file, ``nbytes`` its size in bytes (the array's ``nbytes``),
    ``address`` the start of its mapping in this process (0 until mapped), ``deleted``
    whether the file is gone. Byte ``k`` of the file is byte ``k`` of the array.
    """

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        self.address = 0
        self._pid = os.getpid()
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino), to recognise our fd
        self._map_fd: int | None = None  # the descriptor the mmap object holds, if found
        self._deleted = False
        self._lock = threading.Lock()

    @property
    def deleted(self) -> bool:
        """True once the file has been unlinked (freed, collected or at exit)."""
        return self._deleted

    def offset_of(self, x: np.ndarray) -> int:
        """The file offset in bytes of the first element of ``x``, a view of this file."""
        if not self.address:
            raise ValueError(f"{self.path} is not mapped in this process")
        offset = int(x.__array_interface__["data"][0]) - self.address
        if not 0 <= offset <= self.nbytes:
            raise ValueError(f"the array does not lie in the mapping of {self.path}")
        return offset

    def delete(self) -> bool:
        """Unlink the file now; True if this call removed it.

        Does nothing in a process that did not create the file (a forked child), and
        nothing the second time. A mapping of the file stays valid until it is closed;
        the disk space is released with the last mapping or descriptor.
        """
        with self._lock:
            if self._deleted or os.getpid() != self._pid:
                return False
            self._deleted = True
        _files.pop(self.path, None)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.warning("could not delete spill file %s: %s", self.path, exc)
            return False
        return True

    def __repr__(self) -> str:
        state = " deleted" if self._deleted else ""
        return f"SpillFile({self.path!r}, {format_bytes(self.nbytes, 3)}{state})"


# -- process folders ------------------------------------------------------------------

_dir_lock = threading.Lock()
_dirs: dict[tuple[str, int], str] = {}  # (root, pid) -> this process's folder; _dir_lock
_files: dict[str, SpillFile] = {}  # path -> live file made by this process
# id(mmap) -> (weak reference to it, its file). Entries go in the mmap's finalizer.
_maps: dict[int, tuple[weakref.ref[mmap.mmap], SpillFile]] = {}


def spill_root() -> str:
    """The spill root: setting ``spill_dir`` (``TIERFLOW_SPILL_DIR``), ``~`` expanded."""
    return os.path.abspath(os.path.expanduser(config.get("spill_dir")))


def clean_stale(root: str | None = None) -> list[str]:
    """Remove the folders of processes that are gone; returns the folders removed.

    A folder ``<pid>-<start>`` is stale when no process has that pid, or when the
    process with that pid started at another time (the pid was reused). Folders of live
    processes, and anything whose name does not follow the pattern, are left alone.
    ``root`` defaults to :func:`spill_root`. Never raises for an unreadable root.
    """
    root = spill_root() if root is None else root
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _DIR_RE.fullmatch(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        if processes.may_be_running(int(match.group(1)), int(match.group(2))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            removed.append(entry.path)
            logger.info("removed spill files of a process that is gone: %s", entry.path)
    return removed


def _make_dirs(path: str) -> None:
    """Create ``path`` and its missing parents, each mode 0700."""
    missing = []
    current = path
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            if not os.path.isdir(folder):
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", folder) from None
            continue
        os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask


def _unusable(folder: str, exc: OSError) -> SpillError:
    return SpillError(
        exc.errno or errno.EACCES,
        f"cannot create spill files in {folder}: {exc.strerror or exc}. "
        "Point TIERFLOW_SPILL_DIR (setting spill_dir) at a writable folder on a local disk",
    )


def process_dir() -> str:
    """This process's spill folder under :func:`spill_root`, created on first use.

    The first call for a root (per process) also runs :func:`clean_stale` on it.
    Raises :class:`~tierflow.errors.SpillError` when the folder cannot be created.
    """
    root = spill_root()
    key = (root, os.getpid())
    folder = _dirs.get(key)
    if folder is not None and os.path.isdir(folder):
        return folder
    with _dir_lock:
        first = key not in _dirs
        folder = os.path.join(root, processes.token())
        try:
            _make_dirs(root)
            if first:
                clean_stale(root)
            _make_dirs(folder)
        except OSError as exc:
            raise _unusable(folder, exc) from exc
        _dirs[key] = folder
    return folder


def free_bytes(folder: str) -> int | None:
    """Bytes an unprivileged writer can still take on ``folder``'s filesystem
    (``statvfs``: available blocks times their size); None if it cannot be read.

    Checked before a file is reserved: ``posix_fallocate`` on ext4 takes blocks as it
    goes and keeps them when it fails, so a reservation bigger than the free space
    fills the disk for every other process before it fails.
    """
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def describe_free(free: int | None) -> str:
    """``free`` bytes as an error message says them: ``"1.500 GB (1610612736 bytes)"``."""
    return "an unknown amount" if free is None else f"{format_bytes(free, 3)} ({free} bytes)"


# -- creating, mapping, deleting ------------------------------------------------------


def _no_room(folder: str, nbytes: int, code: int) -> SpillError:
    return SpillError(
        code,
        f"no room for a spill file of {format_bytes(nbytes, 3)} ({nbytes} bytes) in "
        f"{folder}: {describe_free(free_bytes(folder))} free there. {_REMEDY_ROOM}",
    )


def create(nbytes: int, folder: str | None = None) -> SpillFile:
    """Create a spill file of ``nbytes`` (> 0) bytes, every block reserved, not mapped.

    In ``folder`` when given (an existing folder under this or another tierflow
    process's spill folder, which its owner removes), else in :func:`process_dir`.

    Raises :class:`~tierflow.errors.SpillError`: no room (ENOSPC, EDQUOT, EFBIG, or
    ``nbytes`` above the free space), a filesystem that cannot reserve space, or a
    folder that cannot be written. Nothing is left behind on failure.
    """
    if nbytes <= 0:
        raise ValueError(f"a spill file needs a positive size, got {nbytes} bytes")
    folder = process_dir() if folder is None else folder
    free = free_bytes(folder)
    if free is not None and nbytes > free:
        raise _no_room(folder, nbytes, errno.ENOSPC)
    try:
        fd, path = tempfile.mkstemp(suffix=SUFFIX, prefix=PREFIX, dir=folder)
    except OSError as exc:
        raise _unusable(folder, exc) from exc
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno in _NO_ROOM:
                os.ftruncate(fd, 0)  # gives back what it took, so the free figure is true
                raise _no_room(folder, nbytes, exc.errno) from exc
            if exc.errno in _CANNOT_RESERVE:
                raise SpillError(
                    exc.errno,
                    f"the filesystem of {folder} cannot reserve space for spill files "
                    f"(posix_fallocate: {exc.strerror}). An unreserved file would crash "
                    "the process with SIGBUS when the disk fills, so tierflow does not use "
                    "it. Point TIERFLOW_SPILL_DIR (setting spill_dir) at a local "
                    "filesystem such as ext4, xfs, btrfs or tmpfs",
                ) from exc
            raise SpillError(
                exc.errno or errno.EIO,
                f"could not reserve {format_bytes(nbytes, 3)} ({nbytes} bytes) for a spill "
                f"file in {folder}: {exc.strerror or exc}",
            ) from exc
        record = SpillFile(path, nbytes)
        st = os.fstat(fd)
        record._inode = (st.st_dev, st.st_ino)
    except BaseException:
        _unlink_quietly(path)
        raise
    finally:
        os.close(fd)
    _files[path] = record
    return record


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def map_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.memmap[Any, Any]:
    """A new zero-filled ``np.memmap`` of ``shape`` and ``dtype`` over a reserved spill file.

    ``dtype`` must not hold Python objects and the array must not be empty (the caller
    checks both). The file is deleted when the last view of the array is collected, by
    :func:`discard`, or at exit. Raises :class:`~tierflow.errors.SpillError` as
    :func:`create` does, or when the mapping fails.
    """
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    record = create(nbytes)
    try:
        array = np.memmap(record.path, dtype=dtype, mode="r+", shape=shape)
    except BaseException as exc:
        record.delete()
        if isinstance(exc, (OSError, ValueError)):
            raise SpillError(
                getattr(exc, "errno", None) or errno.ENOMEM,
                f"could not map the spill file {record.path} ({format_bytes(nbytes, 3)}): {exc}",
            ) from exc
        raise
    _register(array, record)
    return array


def write_array(value: np.ndarray) -> np.memmap[Any, Any]:
    """A read-only copy of ``value`` (C-contiguous, not empty, no Python objects) in a
    new spill file, mapped under a read lease.

    For a block that is written once and then only read (a held result the scheduler
    moves out of RAM). The bytes go in with ``pwrite``, so the file is never mapped
    writable, and the mapping holds a read lease (:mod:`tierflow.storage.leases`): a
    process that truncates the file waits until the array's last view is gone instead
    of making its readers fault. Where no lease can be had, the file is mapped without
    one. The file is deleted as :func:`map_array`'s are. Raises
    :class:`~tierflow.errors.SpillError` as :func:`create` does, when writing fails,
    and naming the file and both sizes when it shrank before it could be mapped.
    """
    nbytes = value.nbytes
    record = create(nbytes)
    lease: int | None = None
    try:
        data = value.reshape(-1).view(np.uint8).data
        fd = os.open(record.path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            done = 0
            while done < nbytes:
                done += os.pwritev(fd, [data[done:]], done)
        finally:
            os.close(fd)  # a read lease needs the file open for writing nowhere
        fd = os.open(record.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            lease = leases.acquire(fd)
        finally:
            os.close(fd)
        if lease is None:
            array: np.memmap[Any, Any] = np.memmap(
                record.path, dtype=value.dtype, mode="r", shape=value.shape
            )
        else:
            size = os.fstat(lease).st_size
            if size < nbytes:
                os.close(lease)
                raise SpillError(
                    errno.EIO,
                    f"the spill file {record.path} shrank from {nbytes} to {size} bytes "
                    "before it was mapped: another process truncated it. Spill files "
                    "live in a folder of their own (setting spill_dir); leave them alone "
                    "while tierflow runs",
                )
            array = leases.map_leased(
                lease, record.path, value.dtype, value.shape, 0, sequential=False
            )
    except BaseException as exc:
        record.delete()
        if isinstance(exc, OSError) and not isinstance(exc, SpillError):
            raise SpillError(
                exc.errno or errno.EIO,
                f"could not write the spill file {record.path} ({format_bytes(nbytes, 3)}): {exc}",
            ) from exc
        raise
    _register(array, record, exclude=lease)
    return array


def _register(array: np.memmap[Any, Any], record: SpillFile, exclude: int | None = None) -> None:
    """Tie ``record`` to ``array``'s mapping: found by :func:`spill_file_of`, deleted
    once the mapping is collected."""
    mapping = getattr(array, "_mmap", None)
    assert isinstance(mapping, mmap.mmap)
    record.address = int(array.__array_interface__["data"][0])
    record._map_fd = _find_map_fd(record, exclude)
    _maps[id(mapping)] = (weakref.ref(mapping), record)
    weakref.finalize(mapping, _collected, id(mapping), record)


def _collected(key: int, record: SpillFile) -> None:
    """Finalizer of a spill mapping: its last view is gone and it has been unmapped."""
    entry = _maps.get(key)
    if entry is not None and entry[1] is record:
        del _maps[key]
    record.delete()


def spill_file_of(x: Any) -> SpillFile | None:
    """The spill file behind ``x``, a spill-backed array or any view of one; else None.

    Returns None for arrays in RAM, for memmaps tierflow did not make, and for an
    array whose file has been freed.
    """
    obj = x
    for _ in range(64):  # base chains are short; the bound only guards odd objects
        if obj is None:
            return None
        if isinstance(obj, mmap.mmap):
            entry = _maps.get(id(obj))
            if entry is None or entry[0]() is not obj or entry[1].deleted:
                return None
            return entry[1]
        mapping = getattr(obj, "_mmap", None) if isinstance(obj, np.memmap) else None
        if mapping is not None:
            obj = mapping
        elif isinstance(obj, np.ndarray):
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            return None
    return None


def live_files() -> list[SpillFile]:
    """The spill files this process has made and not yet deleted."""
    return [f for f in list(_files.values()) if not f.deleted]


# -- freeing now ----------------------------------------------------------------------
#
# A NumPy array keeps a raw pointer into its mapping, so closing the mapping while any
# view exists would leave dangling pointers (a segfault on next use). Instead `discard`
# maps fresh anonymous zero pages over the file's range (MAP_FIXED): the views stay
# valid memory, the file's pages leave this process, and the mmap object's own file
# descriptor is pointed at /dev/null. With the name unlinked, nothing in this process
# holds the file any more, so the kernel frees the disk space now; a mapping another
# process has of the same file keeps it alive and valid (no SIGBUS there).

_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_PROT_RW = 0x1 | 0x2
_libc: Any = None


def _libc_mmap() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc = libc
    return _libc.mmap


def _find_map_fd(record: SpillFile, exclude: int | None = None) -> int | None:
    """The descriptor Python's mmap object duplicated for ``record`` (Linux), or None.

    The file was just created under a random name in a 0700 folder and our own
    descriptors are closed (but ``exclude``, a lease's), so exactly one open descriptor
    of this inode is expected.
    """
    if not sys.platform.startswith("linux") or record._inode is None:
        return None
    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        if name == str(exclude):
            continue
        try:
            st = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if (st.st_dev, st.st_ino) == record._inode:
            found.append(int(name))
    return found[0] if len(found) == 1 else None


def _detach_mapping(record: SpillFile) -> bool:
    """Put anonymous zero pages over ``record``'s mapping and drop the mmap's descriptor."""
    if not sys.platform.startswith("linux") or not record.address:
        return False
    try:
        libc_mmap = _libc_mmap()
    except (OSError, AttributeError):
        return False
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED
    result = libc_mmap(record.address, record.nbytes, _PROT_RW, flags, -1, 0)
    if result is None or result != record.address:
        logger.debug("could not unmap spill file %s: errno %d", record.path, ctypes.get_errno())
        return False
    fd = record._map_fd
    if fd is not None:
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == record._inode:
                null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                try:
                    os.dup2(null, fd, inheritable=False)
                finally:
                    os.close(null)
        except OSError as exc:
            logger.debug("could not close the descriptor of %s: %s", record.path, exc)
    return True


def _mapping_of(record: SpillFile) -> mmap.mmap | None:
    for ref, found in list(_maps.values()):
        if found is record:
            return ref()
    return None


def discard(record: SpillFile) -> None:
    """Free a spill file now: unmap it from its array (views then read zeros) and delete it.

    The disk space comes back now unless another process maps the file. Using the array
    afterwards is a bug in the caller: it no longer holds the data (it reads zeros and
    writes go nowhere), though it does not crash. Does nothing for a deleted file.
    """
    with record._lock:
        if record._deleted or os.getpid() != record._pid:
            return
    mapping = _mapping_of(record)
    _detach_mapping(record)
    if mapping is not None:
        leases.let_go(mapping)  # the file left the mapping: nothing left to protect
    record.delete()


# -- exit -----------------------------------------------------------------------------


def _at_exit() -> None:
    pid = os.getpid()
    for record in list(_files.values()):
        record.delete()
    for (_, owner), folder in list(_dirs.items()):
        if owner == pid:
            shutil.rmtree(folder, ignore_errors=True)


atexit.register(_at_exit)
