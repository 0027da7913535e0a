"""``.npy`` and raw files: :class:`FileReader` (``tw.from_npy``, ``tw.from_raw``: blocks
are views of a read-only memory map) and :class:`NpySink` (``to_npy``).

Known row counts: every block task writes its rows into a reused per-thread buffer
that is then written to the file at the block's offset (from another process through
:class:`NpyRows`). Unknown row counts (after a mask): blocks come back to the scheduler,
which appends them to the file in row order.

What a file sink may replace at its destination, and how its output takes the place,
is :mod:`tierflow.engine.io.destination`'s: an existing destination is refused unless
``overwrite=True``, and then only the sink's own kind of output is replaced, once the
new one is complete. ``to_npy`` writes under a temporary name in the target's folder
(``.name.tf<pid>-<start>-XXXX.tmp``, its mode following the umask as ``np.save``'s files
do), reserves the whole file first when its size is known (after a ``statvfs`` check, so
a disk too small fails before any work and without filling up for a moment, with the
true free space in the message), starts the write-back of blocks once ``budget / 8``
bytes are dirty, or at once under memory pressure (``sync_file_range``), so dirty pages
stay bounded without making a machine with room wait for the disk, and renames the file
into place at the end. :meth:`NpySink.abort` removes the temporary file; nothing is ever
written under the final name but by the rename.

A process killed while writing (SIGKILL, a machine that lost power) cannot remove its
temporary file. Its name holds the writer's pid and start time
(:func:`tierflow.system.processes.token`), so the next ``to_npy`` into the same folder
removes the temporary files of writers that are gone
(:func:`tierflow.engine.io.destination.sweep_temps`), never one a live process is
writing, nor one whose writer cannot be told apart from a live one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import struct
import threading
from typing import Any

import numpy as np
from numpy.lib.format import dtype_to_descr

from ...config import format_bytes
from ...storage import spill
from ...storage.pool import Scratch
from ...storage.sources import FileSource
from ...system import budget as budget_module
from ...system import pressure
from ...system.types import Level
from ..graph import Chunked
from .destination import (
    check_npy,
    install_file,
    local_path,
    sweep_temps,
    temp_file,
)
from .readers import Reader, check_identity, file_stat

__all__ = [
    "KICK_MIN",
    "KICK_SHARE",
    "FileReader",
    "NpyRows",
    "NpySink",
    "npy_header",
]


class FileReader(Reader):
    """A ``.npy`` or raw file through :class:`~tierflow.storage.sources.FileSource`."""

    file_backed = True
    picks_rows = True

    def __init__(self, source: FileSource, what: str) -> None:
        self.source = source
        self.dtype = source.dtype
        self.row_shape = tuple(source.row_shape)
        self.n_rows = source.n_rows
        self.path = os.path.abspath(source.path)
        self.stat = file_stat(self.path)
        self.label = f"{what}({os.path.basename(self.path)!r})"

    def read(self, a: int, b: int) -> np.ndarray:
        return self.source.block(a, b)

    def readahead(self, a: int, b: int) -> None:
        self.source.readahead(a, b)

    def release(self, a: int, b: int, *, drop_cache: bool = False) -> None:
        """Drop rows ``a:b`` from this process, unless the file's mapping is kept
        (:meth:`~tierflow.storage.sources.FileSource.kept`: the most recently used files
        up to half the RAM budget) and memory pressure is ``ok`` (``drop_cache``: high,
        and from the page cache too). A kept file's pages fit the budget, are the page
        cache's own (shared, and counted as free by the pressure level), and dropping
        them only to fault them back in made the next scan of a cached file 1.1x to 2x
        slower (docs/benchmarks.md)."""
        if drop_cache or pressure.level_now() != Level.OK or not self.source.kept():
            self.source.release(a, b, drop_cache=drop_cache, count=False)

    def check(self) -> None:
        check_identity(self.path, self.stat, "tw." + self.label.split("(")[0])

    def token(self) -> str:
        size, mtime, inode, device = self.stat
        src = self.source
        return (
            f"file({self.path!r},{size},{mtime},{inode},{device},{src.kind},"
            f"{src.dtype.str},{src.shape},{src.offset})"
        )

    def files(self) -> list[str]:
        return [self.path]


_MAGIC = b"\x93NUMPY"
_ALIGN = 64
_MAX_ROWS = 10**19 - 1  # the widest row count a header may need to hold (19 digits)
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start write-back, do not wait
KICK_SHARE = 8  # start write-back once budget / 8 bytes are dirty ...
KICK_MIN = 64 << 20  # ... but not in pieces smaller than 64 MB
_TIGHT = frozenset({Level.MODERATE, Level.HIGH, Level.CRITICAL})


def npy_header(dtype: np.dtype, shape: tuple[int, ...], length: int | None = None) -> bytes:
    """The ``.npy`` header NumPy writes for ``dtype`` and ``shape`` (C order), padded with
    spaces to ``length`` bytes when given (a multiple of 64, as NumPy aligns it).

    >>> len(npy_header(np.dtype("<f4"), (1000, 8)))
    128
    """
    fields = {
        "descr": dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": tuple(int(n) for n in shape),
    }
    text = "{" + "".join(f"'{k}': {v!r}, " for k, v in sorted(fields.items())) + "}"
    body = text.encode("latin1")
    for version, fmt in (((1, 0), "<H"), ((2, 0), "<I")):
        prefix = len(_MAGIC) + 2 + struct.calcsize(fmt)
        natural = prefix + len(body) + 1
        total = natural + (-natural % _ALIGN) if length is None else length
        if total - prefix - 1 > (0xFFFF if fmt == "<H" else 0xFFFFFFFF) - 1:
            continue
        if total < natural:
            raise ValueError(f"a header of {natural} bytes does not fit the {length} reserved")
        pad = total - natural
        return (
            _MAGIC + bytes(version) + struct.pack(fmt, total - prefix) + body + b" " * pad + b"\n"
        )
    raise ValueError("the .npy header is too long")


def _sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_start_writeback = _sync_file_range()


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


class NpyRows:
    """Where a worker process writes a sink's known rows: ``path`` from byte
    ``offset``, ``row_nbytes`` bytes a row of ``dtype`` (small and picklable)."""

    __slots__ = ("dtype", "offset", "path", "row_nbytes")

    def __init__(self, path: str, offset: int, row_nbytes: int, dtype: np.dtype) -> None:
        self.path = path
        self.offset = offset
        self.row_nbytes = row_nbytes
        self.dtype = dtype

    def __reduce__(self) -> tuple[Any, ...]:
        return (NpyRows, (self.path, self.offset, self.row_nbytes, self.dtype))

    def write(self, row: int, block: np.ndarray) -> None:
        """Write ``block`` at row ``row`` (the file exists: the driver created it)."""
        data = np.ascontiguousarray(block, dtype=self.dtype)
        if not data.size:
            return
        fd = os.open(self.path, os.O_WRONLY)
        try:
            _pwrite_all(fd, data, self.offset + row * self.row_nbytes)
        finally:
            os.close(fd)


class NpySink:
    """The result of ``to_npy``: a ``.npy`` file, renamed into place at the end."""

    appends = True  # unknown row counts: blocks appended in row order

    def __init__(
        self,
        node: Chunked,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        overwrite: bool = False,
    ) -> None:
        self.node = node
        self.path = local_path(path)
        self.known = node.n_rows is not None
        self.fsync = fsync
        self.overwrite = overwrite
        self.dtype: np.dtype = node.dtype  # type: ignore[assignment]
        self.row_shape = node.row_shape
        self.row_nbytes = self.dtype.itemsize * math.prod(self.row_shape)
        self.fd: int | None = None
        self.tmp: str | None = None
        self.header_len = 0
        self._scratch = Scratch(self.dtype, self.row_shape)
        self._lock = threading.Lock()
        # Written ranges whose write-back has not been started, and their bytes; past
        # _kick_bytes (or under pressure) write-back starts, so dirty pages stay bounded
        # while a machine with room lets the page cache absorb the file.
        self._dirty: list[tuple[int, int]] = []
        self._dirty_bytes = 0
        self._kicked: list[tuple[int, int]] = []
        self._kick_bytes = max(KICK_MIN, budget_module.budget_bytes() // KICK_SHARE)

    def claim(self) -> None:
        """Refuse a destination this sink may not write (see
        :mod:`tierflow.engine.io.destination`), before anything is computed."""
        folder = os.path.dirname(self.path)
        if not os.path.isdir(folder):
            raise FileNotFoundError(errno.ENOENT, f"cannot write {self.path}: no folder {folder}")
        check_npy(self.path, self.overwrite)

    def open(self) -> None:
        """Create the temporary file, reserve it (known size) and write the header."""
        folder = os.path.dirname(self.path)
        self.claim()
        if self.dtype.hasobject:
            raise TypeError(f"cannot write {self.dtype} values to a .npy file without pickling")
        sweep_temps(folder)
        fd, tmp = temp_file(self.path)
        self.fd, self.tmp = fd, tmp
        try:
            if self.known:
                header = npy_header(self.dtype, self.node.shape)  # type: ignore[arg-type]
                total = len(header) + (self.node.n_rows or 0) * self.row_nbytes
                self._reserve(total)
            else:
                header = npy_header(self.dtype, (_MAX_ROWS, *self.row_shape))
            self.header_len = len(header)
            self._pwrite(header, 0)
        except BaseException:
            self.abort()
            raise

    def _reserve(self, total: int) -> None:
        """Reserve the whole file, after checking that the disk has room for it: ext4's
        ``posix_fallocate`` takes every free block before it fails, so asking for more
        than is free would fill the disk for every other process for a moment."""
        assert self.fd is not None
        folder = os.path.dirname(self.path)
        free = spill.free_bytes(folder)
        if free is not None and total > free:
            raise self._no_room(total, free, errno.ENOSPC)
        try:
            os.posix_fallocate(self.fd, 0, total)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                os.ftruncate(self.fd, 0)  # gives back what it took: the free figure is true
                raise self._no_room(total, spill.free_bytes(folder), exc.errno) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self.fd, total)  # pwrite needs no reservation against SIGBUS

    def _no_room(self, total: int, free: int | None, code: int) -> OSError:
        return OSError(
            code,
            f"no room to write {self.path}: it needs {format_bytes(total, 3)} ({total} bytes) "
            f"and {spill.describe_free(free)} are free there; free space or write elsewhere",
        )

    def _pwrite(self, data: Any, offset: int) -> None:
        assert self.fd is not None
        _pwrite_all(self.fd, data, offset)

    def place(self) -> NpyRows | None:
        """Where another process writes known rows: the temporary file, by offset."""
        if not self.known or self.tmp is None:
            return None
        return NpyRows(self.tmp, self.header_len, self.row_nbytes, self.dtype)

    def task_bytes(self, rows: int) -> int:
        """The block buffer a task writes from."""
        return rows * self.row_nbytes

    def dest(self, a: int, b: int) -> np.ndarray:
        return self._scratch.get(b - a)

    def written(self, a: int, b: int, block: np.ndarray) -> None:
        self._write(a, np.ascontiguousarray(block))

    def _write(self, row: int, block: np.ndarray) -> None:
        if block.size == 0:
            return
        offset = self.header_len + row * self.row_nbytes
        self._pwrite(block, offset)
        tight = pressure.level_now() in _TIGHT
        with self._lock:
            self._dirty.append((offset, block.nbytes))
            self._dirty_bytes += block.nbytes
            if self._dirty_bytes < self._kick_bytes and not tight:
                return
            kick, self._dirty, self._dirty_bytes = self._dirty, [], 0
            drop, self._kicked = self._kicked, kick
        assert self.fd is not None
        if _start_writeback is not None:
            for start, length in kick:
                _start_writeback(self.fd, start, length, _WRITE)
        if tight:
            # Ranges kicked earlier are (mostly) written by now; dropping their clean
            # pages keeps the memory cgroup's page cache charge flat.
            for start, length in drop:
                os.posix_fadvise(self.fd, start, length, os.POSIX_FADV_DONTNEED)

    def append(self, row: int, block: np.ndarray) -> int:
        """Write ``block`` at row ``row`` (unknown row counts, in order); the next row."""
        self._write(row, np.ascontiguousarray(block, dtype=self.dtype))
        return row + len(block)

    def commit(self, n_rows: int | None = None) -> None:
        """Finish the file and rename it to its final name."""
        assert self.fd is not None and self.tmp is not None
        self._scratch.clear()
        if not self.known:
            assert n_rows is not None
            header = npy_header(self.dtype, (n_rows, *self.row_shape), self.header_len)
            self._pwrite(header, 0)
            os.ftruncate(self.fd, self.header_len + n_rows * self.row_nbytes)
        if self.fsync:
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        install_file(self.tmp, self.path, self.overwrite)
        self.tmp = None

    def abort(self) -> None:
        """Remove the temporary file; the final name is left as it was."""
        self._scratch.clear()
        if self.fd is not None:
            try:
                os.close(self.fd)
            finally:
                self.fd = None
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.tmp = None
