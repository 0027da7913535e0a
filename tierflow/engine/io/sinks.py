"""Where results go: an array in the tiers (``compute``, ``persist``), a ``.npy`` file
(``to_npy``) or a Zarr array (``to_zarr``).

Known row counts: every block task writes its rows straight into the destination —
the output array's rows (a fused kernel writes there with ``out=``, no copy), or a
reused per-thread buffer that is then written to the file at the block's offset.
Unknown row counts (after a mask): blocks come back to the scheduler, which holds them
until they can be placed (a ``.npy`` file is appended to in row order; an array is
assembled once every block's size is known).

Outputs of ``compute`` are allocated with ``memory.array``: RAM while they fit the
budget, else a spill file; a spilled output's finished blocks are written back and
dropped from RAM as they are done.

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
into place at the end. :meth:`abort` removes the temporary file; nothing is ever written
under the final name but by the rename.

A process killed while writing (SIGKILL, a machine that lost power) cannot remove its
temporary file. Its name holds the writer's pid and start time
(:func:`tierflow.system.processes.token`), so the next ``to_npy`` into the same folder
removes the temporary files of writers that are gone (:func:`sweep_temps`), never one a
live process is writing, nor one whose writer cannot be told apart from a live one.
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
from ...operators import byteorder
from ...storage import pages, placement, spill
from ...system import budget as budget_module
from ...system import pressure
from ...system.types import Level
from ..graph import Chunked
from .destination import (
    check_npy,
    claim_zarr,
    inspect_zarr,
    install_file,
    local_path,
    remove_zarr,
    swap_zarr,
    sweep_temps,
    temp_file,
    temp_zarr_url,
)

__all__ = [
    "ArraySink",
    "FileRows",
    "NpySink",
    "ZarrRows",
    "ZarrSink",
    "npy_header",
    "sweep_temps",
    "temp_file",
]

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


class _Scratch:
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


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


class FileRows:
    """Where a worker process writes a sink's known rows: ``path`` from byte
    ``offset``, ``row_nbytes`` bytes a row of ``dtype`` (small and picklable)."""

    __slots__ = ("dtype", "offset", "path", "row_nbytes")

    def __init__(self, path: str, offset: int, row_nbytes: int, dtype: np.dtype) -> None:
        self.path = path
        self.offset = offset
        self.row_nbytes = row_nbytes
        self.dtype = dtype

    def __reduce__(self) -> tuple[Any, ...]:
        return (FileRows, (self.path, self.offset, self.row_nbytes, self.dtype))

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


class ArraySink:
    """The result of ``compute`` / ``persist``: an array made by ``memory.array``."""

    def __init__(self, node: Chunked) -> None:
        self.node = node
        self.known = node.n_rows is not None
        self.out: np.ndarray | None = None
        self.spilled = False

    def open(self) -> None:
        """Allocate the output (known row counts; unknown ones allocate in assemble)."""
        if self.known:
            self.out = placement.array(self.node.shape, self.node.dtype)  # type: ignore[arg-type]
            self.spilled = placement.on_disk(self.out)

    def task_bytes(self, rows: int) -> int:
        """Bytes a block task needs for this sink: none when it writes into the output
        (placement counts that), the block itself when it is held."""
        if self.known:
            return 0
        return rows * self.node.dtype.itemsize * math.prod(self.node.row_shape)  # type: ignore[union-attr]

    def place(self) -> FileRows | None:
        """Where another process writes rows: nowhere (they come back by value)."""
        return None

    def dest(self, a: int, b: int) -> np.ndarray:
        assert self.out is not None
        return self.out[a:b]

    def written(self, a: int, b: int, block: np.ndarray) -> None:
        if self.spilled and b > a:
            # Written back and dropped, so a result bigger than RAM never sits in it.
            pages.release(block, drop_cache=True)

    def assemble(self, blocks: list[np.ndarray]) -> np.ndarray:
        """The output from blocks of sizes known only now."""
        total = sum(len(b) for b in blocks)
        out = placement.array((total, *self.node.row_shape), self.node.dtype)
        self.out = out
        self.spilled = placement.on_disk(out)
        start = 0
        for block in blocks:
            stop = start + len(block)
            if stop > start:
                out[start:stop] = block
                self.written(start, stop, out[start:stop])
            start = stop
        return out

    def commit(self) -> np.ndarray:
        assert self.out is not None
        out, self.out = self.out, None
        return out

    def abort(self) -> None:
        """Free the output (its spill file is deleted now)."""
        if self.out is not None:
            placement.free(self.out)
            self.out = None


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
        self._scratch = _Scratch(self.dtype, self.row_shape)
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

    def place(self) -> FileRows | None:
        """Where another process writes known rows: the temporary file, by offset."""
        if not self.known or self.tmp is None:
            return None
        return FileRows(self.tmp, self.header_len, self.row_nbytes, self.dtype)

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


class ZarrRows:
    """Where a worker process writes a Zarr sink's known rows: the array at ``url``,
    opened once per process (small and picklable)."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self.storage_options = storage_options
        self._open: tuple[int, Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (ZarrRows, (self.url, self.storage_options))

    def array(self) -> Any:
        if self._open is None or self._open[0] != os.getpid():
            self._open = (os.getpid(), _open_zarr(self.url, self.storage_options, "r+"))
        return self._open[1]

    def write(self, row: int, block: np.ndarray) -> None:
        """Write ``block`` at row ``row``: whole chunks (the planner cut the tasks so)."""
        if len(block):
            self.array()[row : row + len(block)] = block


# Zarr leaves a chunk equal to the fill value unwritten, and takes a complex chunk of
# negative zeros for one (0j): it would read back as +0.0. A sink writes every chunk it
# computed, so what it wrote reads back as it was, and a chunk not there was not written.
WRITE_EVERY_CHUNK: Any = {"write_empty_chunks": True}  # zarr's ArrayConfigParams


def _open_zarr(url: str, storage_options: dict[str, Any], mode: str) -> Any:
    import zarr

    if "://" in url:
        array = zarr.open_array(url, mode=mode, storage_options=storage_options)
    else:
        array = zarr.open_array(url, mode=mode)
    return array.with_config(WRITE_EVERY_CHUNK)  # open_array leaves config= out


def _zarr_url(path_or_url: str | os.PathLike[str]) -> str:
    text = os.fspath(path_or_url)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return text if "://" in text else local_path(text)


class ZarrSink:
    """The result of ``to_zarr``: a Zarr array, written in whole chunks (or shards).

    The array is created at :meth:`open` with the attribute ``tierflow: {"complete":
    false, "key": ...}`` (the compute's key, when it has one that names its inputs'
    contents), set to ``complete: true`` by :meth:`commit` once the last block is in; a
    run that fails or is killed leaves it marked incomplete, with no torn chunk (each
    chunk is one object, written whole: zarr's local store writes a temporary file and
    renames it, an object store puts it at once). Where it is written follows
    :func:`~tierflow.engine.io.destination.claim_zarr`: in place where nothing was (or
    where this compute's own incomplete array was, its keys removed first), beside the
    destination and swapped in at :meth:`commit` where an array is replaced
    (``overwrite=True``). Known rows: each block task writes its rows, whole
    chunks, where it runs (:meth:`place`); :attr:`align` makes the planner cut tasks on
    chunk edges. Unknown rows (after a mask): blocks are appended in row order, whole
    chunks written as they fill, the array resized as it grows.
    """

    appends = True  # unknown row counts: appended in order, as a .npy file is

    def __init__(  # noqa: PLR0913 -- to_zarr's options, passed through
        self,
        node: Chunked,
        path_or_url: str | os.PathLike[str],
        *,
        chunks: Any = None,
        shards: Any = None,
        compressors: Any = "auto",
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        try:
            import zarr  # noqa: F401
        except ImportError:
            from ...errors import missing_dependency

            raise missing_dependency("zarr", "zarr", "to_zarr") from None
        self.node = node
        self.url = _zarr_url(path_or_url)
        self.storage_options = dict(storage_options or {})
        self.known = node.n_rows is not None
        self.dtype: np.dtype = node.dtype  # type: ignore[assignment]
        self.row_shape = tuple(node.row_shape)
        self.row_nbytes = self.dtype.itemsize * math.prod(self.row_shape)
        self.chunks = self._chunks(chunks)
        self.shards = None if shards is None else self._full(shards, "shards")
        if self.shards is not None and any(
            s % c for s, c in zip(self.shards, self.chunks, strict=True)
        ):
            raise ValueError(
                f"to_zarr: shards {self.shards} must be whole numbers of chunks {self.chunks}"
            )
        self.align = (self.shards or self.chunks)[0]  # rows of one stored object
        if self.known and node.bounds is not None:
            off = [a for a in node.bounds[1:-1] if a % self.align]
            if off:
                raise ValueError(
                    f"to_zarr: the array's blocks start at rows such as {off[0]}, which are not "
                    f"whole {'shards' if self.shards else 'chunks'} of {self.align} rows; pass "
                    f"chunks= (and shards=) dividing the block size, or build the array with "
                    f"rows= a multiple of {self.align}"
                )
        self.compressors = compressors
        self.overwrite = overwrite
        # The compute's key, recorded in the array's mark: a run of the same compute
        # finishes an array it left incomplete. A key that names an object of this
        # process only (a big in-memory array) is not recorded.
        self.key: str | None = None if node.ident.startswith("id:") else node.ident
        self.mode = ""  # how claim() found the destination: "new", "resume", "replace"
        self.write_url = self.url  # where the array is written: the url, or a temporary
        self.array: Any = None
        self._scratch = _Scratch(self.dtype, self.row_shape)
        self._tail: list[np.ndarray] = []  # appended rows not yet a whole object
        self._tail_rows = 0
        self._written = 0  # rows written by appends

    def _full(self, value: Any, what: str) -> tuple[int, ...]:
        if isinstance(value, (int, np.integer)):
            return (int(value), *self.row_shape)
        shape = tuple(int(n) for n in value)
        if len(shape) != 1 + len(self.row_shape) or min(shape, default=1) < 1:
            raise ValueError(
                f"to_zarr: {what}={value!r}: give rows per {what[:-1]} (an int), or a shape of "
                f"{1 + len(self.row_shape)} positive sizes"
            )
        return shape

    def _chunks(self, chunks: Any) -> tuple[int, ...]:
        if chunks is not None:
            return self._full(chunks, "chunks")
        bounds = self.node.bounds
        if self.known and bounds is not None and len(bounds) > 2:
            return (max(1, bounds[1] - bounds[0]), *self.row_shape)
        from ..graph import blocksize

        rows = blocksize.default_rows(self.row_nbytes, self.node.n_rows)
        if self.known:
            rows = min(rows, max(1, self.node.n_rows or 1))
        return (rows, *self.row_shape)

    def claim(self) -> None:
        """Refuse a destination this sink may not write (see
        :mod:`tierflow.engine.io.destination`), before anything is computed; remember how
        it will be written."""
        self.mode = claim_zarr(
            self.url, self.storage_options, overwrite=self.overwrite, key=self.key
        )

    def open(self) -> None:
        """Create the array, marked incomplete: at the destination, or beside it when an
        array there is replaced (see :meth:`claim`)."""
        import zarr

        self.claim()
        local = "://" not in self.url
        if local:
            sweep_temps(os.path.dirname(self.url))
        if self.mode == "resume":
            found = inspect_zarr(self.url, self.storage_options)
            remove_zarr(self.url, self.storage_options, list(found.keys))
        self.write_url = temp_zarr_url(self.url) if self.mode == "replace" else self.url
        mark: dict[str, Any] = {"complete": False}
        if self.key is not None:
            mark["key"] = self.key
        options: dict[str, Any] = {"config": WRITE_EVERY_CHUNK}
        if not local:
            options["storage_options"] = self.storage_options
        try:
            self.array = zarr.create_array(
                store=self.write_url,
                shape=(self.node.n_rows or 0, *self.row_shape),
                dtype=self.dtype,
                chunks=self.chunks,
                shards=self.shards,
                compressors=self.compressors,
                attributes={"tierflow": mark},
                **options,
            )
        except BaseException:
            self.abort()
            raise

    def place(self) -> ZarrRows | None:
        """Where another process writes known rows: the array, by URL."""
        return ZarrRows(self.write_url, self.storage_options) if self.known else None

    def task_bytes(self, rows: int) -> int:
        """The block a task writes from, and the encoder's copy of it."""
        return 2 * rows * self.row_nbytes

    def dest(self, a: int, b: int) -> np.ndarray:
        return self._scratch.get(b - a)

    def written(self, a: int, b: int, block: np.ndarray) -> None:
        if b > a:
            self.array[a:b] = block

    def append(self, row: int, block: np.ndarray) -> int:
        """Rows ``row:row + len(block)`` (unknown row counts, in order); the next row.
        Whole objects are written as they fill."""
        if len(block):
            self._tail.append(np.array(block, dtype=self.dtype))
            self._tail_rows += len(block)
            if self._tail_rows >= self.align:
                self._flush(whole=True)
        return row + len(block)

    def _flush(self, whole: bool) -> None:
        rows = byteorder.join(self._tail) if len(self._tail) > 1 else self._tail[0]
        take = (len(rows) // self.align) * self.align if whole else len(rows)
        start = self._written
        self.array.resize((start + take, *self.row_shape))
        self.array[start : start + take] = rows[:take]
        self._written += take
        rest = rows[take:]
        self._tail = [rest] if len(rest) else []
        self._tail_rows = len(rest)

    def commit(self, n_rows: int | None = None) -> None:
        """Write what is left, mark the array complete, and swap it into the place of
        the array it replaces (if any)."""
        self._scratch.clear()
        if not self.known and self._tail_rows:
            self._flush(whole=False)
        attributes = dict(self.array.attrs.asdict())
        attributes["tierflow"] = {**attributes.get("tierflow", {}), "complete": True}
        self.array.update_attributes(attributes)
        if self.write_url != self.url:
            swap_zarr(self.write_url, self.url, self.storage_options)
            self.write_url = self.url

    def abort(self) -> None:
        """Leave an array written in place as it is, marked incomplete (no chunk is
        torn); remove one written beside the destination (the destination is as it
        was)."""
        self._scratch.clear()
        self._tail = []
        if self.write_url != self.url:
            remove_zarr(self.write_url, self.storage_options)
            self.write_url = self.url
