"""Sources: files and arrays read as row blocks along axis 0.

A *source* is anything tierflow can cut into row blocks ``[i0:i1]`` along axis 0:

- :class:`FileSource`: a row-major file — a ``.npy`` file (:func:`open_npy`) or a raw
  binary file with a known dtype and shape (:func:`open_raw`). The whole data range is
  mapped read-only once (a mapping costs address space, not RAM), under a read lease
  that keeps the file from shrinking under the mapping (:mod:`tierflow.storage.leases`);
  a block is a view of the mapping, so reading block ``i`` faults in exactly its byte
  range, and :meth:`FileSource.readahead` / :meth:`FileSource.release` can ask the
  kernel to load or drop that range (see :mod:`tierflow.storage.pages`). Where no
  lease can be had, or once another process asks to write or truncate the file, blocks
  are read by copy (``pread``); a file that shrank is a
  :class:`~tierflow.errors.SourceError` naming it and both sizes, never SIGBUS. The
  file is opened once: one renamed onto the path later is not read.
- :class:`ArraySource`: an ``np.ndarray``, an ``np.memmap`` or a ``memory.array``. A
  block is a slice. Readahead and release act only on file-backed shared mappings;
  a RAM array, or a copy-on-write (``mode="c"``) memmap whose private pages would be
  lost, is never released.

Both follow the :class:`Source` protocol, which is what ``memory.chunks``,
``memory.map`` and the engine's readers are written against.

Releasing rows ``i0:i1`` reaches *behind* them by one huge page (:func:`behind_bytes`,
the PMD size: 2 MB on x86-64), because two kernel mechanisms leave pages there that the
previous release could not drop, measured with ``mincore`` (Linux 6.18, ext4):

- a page fault maps a whole aligned fault-around window (64 KB by default), so reading
  block ``i`` maps pages of block ``i - 1`` again after that block was released;
- the page cache holds large folios (up to the PMD size), and ``FADV_DONTNEED`` skips a
  folio unless it lies wholly inside the range, so a folio straddling a block boundary
  is dropped only by a range that also covers its start.

Without the reach-back, of a 96 MB file a scan in 1 MB blocks with ``drop_cache=True``
left 62 MB cached, and one in 0.3 MB blocks left 12 MB mapped (growing with the file);
with it, nothing is left behind. Released pages that are read again fault back in, so
reaching into a block still in use costs at most a refault, never data.

Only C-order (row-major) layouts are accepted: a row block of a Fortran-order array is
scattered over the whole file, which defeats readahead and release.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import os
import struct
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Union, runtime_checkable

import numpy as np
from numpy.lib.format import descr_to_dtype

from ..errors import SourceError
from . import filemaps, leases, pages

__all__ = [
    "ArraySource",
    "FileSource",
    "Source",
    "as_source",
    "behind_bytes",
    "behind_rows",
    "open_npy",
    "open_raw",
]

PathLike = Union[str, "os.PathLike[str]"]

_MAGIC = b"\x93NUMPY"
_PMD_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
# Larger headers are not written by NumPy (its own reader refuses > 10,000 bytes by
# default); a bigger length field means the file is not what it claims to be.
_MAX_HEADER = 1 << 20


@runtime_checkable
class Source(Protocol):
    """Row blocks along axis 0 of an array-like, with page hints for file-backed data.

    ``block`` may be called from several threads at once. ``readahead`` and
    ``release`` are hints: on data that is not file-backed they do nothing.
    """

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def n_rows(self) -> int: ...

    @property
    def row_shape(self) -> tuple[int, ...]: ...

    @property
    def row_nbytes(self) -> int: ...

    def block(self, i0: int, i1: int) -> np.ndarray: ...

    def readahead(self, i0: int, i1: int) -> None: ...

    def release(self, i0: int, i1: int, *, drop_cache: bool = False) -> int: ...

    def close(self) -> None: ...


@functools.lru_cache(maxsize=1)
def behind_bytes() -> int:
    """How far behind its rows a release reaches, in bytes: the huge page (PMD) size.

    The largest page-cache folio and the largest fault-around mapping are at most this
    big (see the module docstring). Read from the kernel; 2 MB where it does not say.
    """
    try:
        with open(_PMD_SIZE_FILE) as f:
            return max(2 << 20, int(f.read()))
    except (OSError, ValueError):
        return 2 << 20


def behind_rows(row_nbytes: int) -> int:
    """:func:`behind_bytes` in whole rows of ``row_nbytes`` bytes (at least 1)."""
    return max(1, -(-behind_bytes() // max(1, row_nbytes)))


def _check_range(n_rows: int, i0: int, i1: int) -> None:
    if not 0 <= i0 <= i1 <= n_rows:
        raise IndexError(f"row block {i0}:{i1} is outside 0:{n_rows}")


@dataclass(eq=False)
class FileSource:
    """A C-order array stored in a file at byte ``offset``: ``.npy`` data or a raw file.

    ``path``, ``dtype``, ``shape`` and ``offset`` (bytes from the start of the file to
    the first element) describe the data; ``kind`` is ``"npy"`` or ``"raw"``. Build one
    with :func:`open_npy`, :func:`open_raw` or :func:`as_source` rather than by hand:
    they validate the file. The file is opened and mapped on first use (and refused
    if another file has been put at the path since the source was made, or it is too
    short) and dropped by :meth:`close`; views already handed out keep the mapping, and
    its lease, alive until they are gone (and see ``shared``). It pickles as its
    description: another process opens the file on first use.

    ``sequential`` (default True) advises the kernel that the mapping is read in order
    (``MADV_SEQUENTIAL``). Without it a page fault that misses the page cache reads
    *around* the fault, half a readahead window behind it, and re-reads pages a scan
    has already released and will never release again (measured: a 96 MB scan in 4 MB
    blocks with ``drop_cache=True`` ended with 28 MB cached instead of none). Pass
    False for random access.

    ``shared`` (default False): the mapping is the process's one for this data, shared
    with every other shared source of it, and the most recently used ones outlive their
    sources (:mod:`tierflow.storage.filemaps`; the engine's ``tw.from_npy`` and
    ``tw.from_raw`` share). Otherwise the mapping is this source's own, and goes once
    the source is closed or gone and no view of it is left.
    """

    path: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    offset: int = 0
    kind: str = "raw"
    sequential: bool = True
    shared: bool = False
    _map: np.memmap[Any, Any] | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    # (size, inode, device) when the source was made; see _opened.
    _stat: tuple[int, int, int] | None = field(default=None, init=False, repr=False)
    _fd: int | None = field(default=None, init=False, repr=False)
    _lease: int | None = field(default=None, init=False, repr=False)
    _closer: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        st = os.stat(self.path)
        self._stat = (st.st_size, st.st_ino, st.st_dev)

    @property
    def n_rows(self) -> int:
        """Number of rows (length of axis 0)."""
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row (the trailing axes)."""
        return self.shape[1:]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row; a block ``[i0:i1]`` is the byte range
        ``offset + i0 * row_nbytes`` to ``offset + i1 * row_nbytes``."""
        return self.dtype.itemsize * math.prod(self.row_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the data (header and trailing bytes excluded)."""
        return self.n_rows * self.row_nbytes

    @property
    def leased(self) -> bool:
        """Whether blocks are views of a mapping under a read lease right now (else
        they are read by copy; see :mod:`tierflow.storage.leases`)."""
        with self._lock:
            return self._map is not None and self._lease is not None and leases.held(self._lease)

    def identity(self) -> tuple[object, ...]:
        """What identifies this data for caching: path, size, mtime, dtype, shape, offset.

        A file rewritten in place gets a new mtime (or size), hence a new identity.
        """
        st = os.stat(self.path)
        return (self.path, st.st_size, st.st_mtime_ns, self.dtype.str, self.shape, self.offset)

    def __getstate__(self) -> dict[str, Any]:
        # Descriptors, the mapping and its lock belong to this process; a receiver opens
        # the file on first use and checks it is still the file described here.
        return {k: v for k, v in self.__dict__.items() if k not in _PER_PROCESS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def _shrunk(self, size: int) -> SourceError:
        built = self._stat[0] if self._stat is not None else "?"
        return SourceError(
            f"{self.path} shrank while tierflow read it: it had {built} bytes and now has "
            f"{size} ({self.offset + self.nbytes} needed for {_describe(self.dtype, self.shape)} "
            f"at offset {self.offset}). Another process truncated or rewrote it; build the "
            "array again once the file is complete"
        )

    def _opened(self) -> int:
        """This source's descriptor of its file, opened on first use (needs ``_lock``).

        Opened once, it reads the same file to the end, even if another is renamed onto
        the path meanwhile. Raises SourceError when the file at the path is not the one
        this source was made from, or is too short now.
        """
        if self._fd is not None:
            return self._fd
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SourceError(
                f"{self.path} was deleted or moved after tierflow read its header "
                f"({_describe(self.dtype, self.shape)}); open it again once the file is back"
            ) from None
        st = os.fstat(fd)
        if self._stat is not None and (st.st_ino, st.st_dev) != self._stat[1:]:
            os.close(fd)
            raise SourceError(
                f"{self.path} was replaced by another file (new inode) after tierflow "
                f"read its header ({_describe(self.dtype, self.shape)}); open it again to "
                "read the new file"
            )
        if st.st_size < self.offset + self.nbytes:
            os.close(fd)
            raise self._shrunk(st.st_size)
        self._fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        return fd

    def _mapping(self) -> np.memmap[Any, Any] | None:
        """The leased mapping of the data (:func:`tierflow.storage.filemaps.share`), got
        on first use; None while no lease can be had (then blocks are read by copy)."""
        with self._lock:
            m = self._map
            if m is not None:
                if self._lease is not None and leases.held(self._lease):
                    return m
                self._map = None  # broken: views in flight keep it until they are done
            fd = self._opened()
            got = filemaps.share(
                fd,
                self.path,
                self.dtype,
                self.shape,
                self.offset,
                sequential=self.sequential,
                user=self,
                short=self._shrunk,
                shared=self.shared,
            )
            if got is None:
                return None
            self._map, self._lease = got
            return self._map

    def _lost(self, mapping: np.memmap[Any, Any]) -> None:
        """The lease under ``mapping`` broke: hand it out no more (the lease watcher
        calls this, and must not wait for views of the mapping to go)."""
        with self._lock:
            if self._map is mapping:
                self._map = None

    def kept(self) -> bool:
        """Whether this source's mapping outlives it, so a scan may leave its pages
        mapped for the next (:mod:`tierflow.storage.filemaps`)."""
        with self._lock:
            m = self._map
        return m is not None and filemaps.kept(m)

    def _read(self, i0: int, i1: int) -> np.ndarray:
        """Rows ``i0:i1`` read by copy (``pread``) into a new array."""
        out = np.empty((i1 - i0, *self.row_shape), dtype=self.dtype)
        with self._lock:
            fd = self._opened()
        if leases.read_into(fd, out, self.offset + i0 * self.row_nbytes) < out.nbytes:
            raise self._shrunk(os.fstat(fd).st_size)
        return out

    def block(self, i0: int, i1: int) -> np.ndarray:
        """Rows ``i0:i1``: a read-only view of the leased mapping (pages fault in when
        read), or a copy while no lease can be had.

        Raises :class:`~tierflow.errors.SourceError` naming the file and its sizes
        when it shrank, and when another file was put at the path before this source
        first opened it.
        """
        _check_range(self.n_rows, i0, i1)
        if self.nbytes == 0 or i0 == i1:
            # mmap refuses a zero-length range; an empty block needs no file at all.
            return np.empty((i1 - i0, *self.row_shape), dtype=self.dtype)
        m = self._mapping()
        return m[i0:i1] if m is not None else self._read(i0, i1)

    def _file_range(self, i0: int, i1: int) -> tuple[int, int]:
        return self.offset + i0 * self.row_nbytes, (i1 - i0) * self.row_nbytes

    def readahead(self, i0: int, i1: int) -> None:
        """Ask the kernel to start reading rows ``i0:i1`` (returns at once)."""
        if i1 <= i0 or not self.nbytes:
            return
        _check_range(self.n_rows, i0, i1)
        m = self._mapping()
        if m is not None:
            pages.readahead(m[i0:i1])
            return
        with self._lock:
            fd = self._opened()
        os.posix_fadvise(fd, *self._file_range(i0, i1), os.POSIX_FADV_WILLNEED)

    def release(self, i0: int, i1: int, *, drop_cache: bool = False, count: bool = True) -> int:
        """Drop rows ``i0:i1`` from this process; with ``drop_cache`` also from the page cache.

        The range reaches :func:`behind_rows` rows before ``i0`` (see the module
        docstring). Views stay valid: their pages fault back in from the file. Returns
        the bytes that were resident (see :func:`tierflow.storage.pages.release`; 0
        with ``count=False``, and 0 for blocks read by copy). Maps nothing.
        """
        if i1 <= i0 or not self.nbytes:
            return 0
        _check_range(self.n_rows, i0, i1)
        start = max(0, i0 - behind_rows(self.row_nbytes))
        with self._lock:
            m, fd = self._map, self._fd
        if m is not None:
            return pages.release(m[start:i1], drop_cache=drop_cache, count=count)
        if drop_cache and fd is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing to drop
                os.posix_fadvise(fd, *self._file_range(start, i1), os.POSIX_FADV_DONTNEED)
        return 0

    def close(self) -> None:
        """Drop this source's mapping and descriptor.

        The mapping is unmapped (and its lease let go) once no view of it is left (and,
        for a ``shared`` source, :mod:`tierflow.storage.filemaps` keeps it no more); a
        later :meth:`block` opens the file again, and refuses it if another file was
        put at the path meanwhile. Not to be called while another thread reads blocks.
        """
        with self._lock:
            self._map = self._lease = None
            closer, self._closer, self._fd = self._closer, None, None
        if closer is not None:
            closer()

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ArraySource:
    """Row blocks of an in-memory or memory-mapped array (``np.ndarray``, ``np.memmap``,
    ``memory.array``).

    Readahead and release act only when the array is a view of a shared file mapping
    (an ``np.memmap`` opened ``"r"``, ``"r+"`` or ``"w+"``, which includes spill-backed
    ``memory.array`` results): releasing an anonymous RAM mapping or a copy-on-write
    memmap would discard data, so those are left alone.
    """

    def __init__(self, array: np.ndarray) -> None:
        if array.ndim == 0:
            raise SourceError(
                "a 0-d array has no rows to stream; wrap it as np.atleast_1d(x) first"
            )
        self.array = array
        self.file_backed = _shared_file_mapping(array)

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        # ``file_backed`` is worked out again: what arrives may be a copy in RAM.
        return ArraySource, (self.array,)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The array's dtype."""
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return tuple(self.array.shape)

    @property
    def n_rows(self) -> int:
        """Number of rows (length of axis 0)."""
        return int(self.array.shape[0])

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row (the trailing axes)."""
        return tuple(self.array.shape[1:])

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row."""
        return self.dtype.itemsize * math.prod(self.row_shape)

    def block(self, i0: int, i1: int) -> np.ndarray:
        """Rows ``i0:i1`` as a view (no copy)."""
        _check_range(self.n_rows, i0, i1)
        return self.array[i0:i1]

    def readahead(self, i0: int, i1: int) -> None:
        """Ask the kernel to start reading rows ``i0:i1`` if the array is file-backed."""
        if self.file_backed and i1 > i0 and self.row_nbytes:
            pages.readahead(self.block(i0, i1))

    def release(self, i0: int, i1: int, *, drop_cache: bool = False, count: bool = True) -> int:
        """Write back and drop rows ``i0:i1`` from this process if the array is file-backed.

        Like :meth:`FileSource.release` the range reaches :func:`behind_rows` rows before
        ``i0``. Returns the bytes that were resident (0 with ``count=False``); 0 for RAM
        arrays (nothing to drop safely).
        """
        if not self.file_backed or i1 <= i0 or not self.row_nbytes:
            return 0
        start = max(0, i0 - behind_rows(self.row_nbytes))
        return pages.release(self.block(start, i1), drop_cache=drop_cache, count=count)

    def close(self) -> None:
        """Nothing to close: the caller owns the array."""

    def __repr__(self) -> str:
        where = "file-backed" if self.file_backed else "in RAM"
        return f"ArraySource(shape={self.shape}, dtype={self.dtype}, {where})"


_PER_PROCESS = frozenset({"_map", "_lock", "_fd", "_lease", "_closer"})


def _shared_file_mapping(array: np.ndarray) -> bool:
    """True if ``array`` is, or is a view of, an ``np.memmap`` over a shared file mapping."""
    obj: Any = array
    while obj is not None:
        if isinstance(obj, np.memmap) and getattr(obj, "_mmap", None) is not None:
            return obj.mode in ("r", "r+", "w+")
        obj = getattr(obj, "base", None)
    return False


def _describe(dtype: np.dtype[Any], shape: tuple[int, ...]) -> str:
    return f"{shape} {dtype}"


def read_npy_header(path: PathLike) -> tuple[np.dtype[Any], tuple[int, ...], bool, int]:
    """Parse a ``.npy`` header: ``(dtype, shape, fortran_order, data_offset)``.

    Raises :class:`~tierflow.errors.SourceError` naming the file when the magic bytes,
    the version, the header length or the header dictionary are not valid.
    """
    name = os.fspath(path)
    with open(name, "rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[:6] != _MAGIC:
            raise SourceError(
                f"{name}: not a .npy file: it does not start with the NumPy magic bytes "
                f"(first bytes {head!r}); for a raw binary file give its dtype and shape: "
                "memory.chunks(path, dtype=..., shape=...) or, for memory.map, "
                "tierflow.storage.sources.open_raw(path, dtype, shape)"
            )
        major, minor = head[6], head[7]
        if major == 1:
            length_format, length_size, encoding = "<H", 2, "latin1"
        elif major in (2, 3):
            length_format, length_size, encoding = "<I", 4, "latin1" if major == 2 else "utf8"
        else:
            raise SourceError(
                f"{name}: .npy format version {major}.{minor} is not one tierflow reads "
                "(1.0, 2.0 or 3.0); the header is corrupt or the file was written by a "
                "newer NumPy — re-save it with np.save"
            )
        raw_length = f.read(length_size)
        if len(raw_length) < length_size:
            raise SourceError(f"{name}: corrupt .npy header: the file ends inside the header")
        (header_len,) = struct.unpack(length_format, raw_length)
        start = 8 + length_size
        if header_len > _MAX_HEADER:
            raise SourceError(
                f"{name}: corrupt .npy header: it claims a {header_len}-byte header "
                f"(NumPy writes at most a few KB)"
            )
        raw_header = f.read(header_len)
    if len(raw_header) < header_len:
        raise SourceError(
            f"{name}: corrupt .npy header: it claims {header_len} header bytes but the "
            f"file ends after {len(raw_header)}"
        )
    try:
        header = ast.literal_eval(raw_header.decode(encoding))
    except (SyntaxError, ValueError, UnicodeDecodeError, MemoryError, RecursionError) as e:
        raise SourceError(
            f"{name}: corrupt .npy header: {raw_header[:80]!r} is not a Python dict literal "
            f"({type(e).__name__})"
        ) from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise SourceError(
            f"{name}: corrupt .npy header: expected a dict with the keys 'descr', "
            f"'fortran_order' and 'shape', got {header!r:.200}"
        )
    shape = header["shape"]
    if not (
        isinstance(shape, tuple)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise SourceError(
            f"{name}: corrupt .npy header: shape {shape!r} is not a tuple of non-negative ints"
        )
    fortran = header["fortran_order"]
    if not isinstance(fortran, bool):
        raise SourceError(
            f"{name}: corrupt .npy header: fortran_order {fortran!r} is not True or False"
        )
    try:
        dtype = descr_to_dtype(header["descr"])
    except (TypeError, ValueError) as e:
        raise SourceError(
            f"{name}: corrupt .npy header: descr {header['descr']!r} is not a dtype ({e})"
        ) from None
    return dtype, shape, fortran, start + header_len


def open_npy(path: PathLike, *, shared: bool = False) -> FileSource:
    """Open a ``.npy`` file as a :class:`FileSource` (no data is read yet; ``shared``:
    see there).

    Raises :class:`~tierflow.errors.SourceError` naming the file and the numbers for a
    corrupt header, a file shorter than its header says, Fortran order, an object dtype
    or a 0-d array; ``FileNotFoundError`` if there is no such file.
    """
    name = os.fspath(path)
    dtype, shape, fortran, offset = read_npy_header(name)
    what = _describe(dtype, shape)
    if dtype.hasobject:
        raise SourceError(
            f"{name}: holds an object array ({what}): its elements are pickled Python "
            "objects, not fixed-size rows; load it with np.load(allow_pickle=True) and "
            "convert it to a numeric dtype"
        )
    if len(shape) == 0:
        raise SourceError(f"{name}: holds a 0-d array ({what}): there are no rows to stream")
    if fortran and sum(n > 1 for n in shape) > 1:
        raise SourceError(
            f"{name}: is stored in Fortran order ({what}): a block of rows is scattered "
            "over the whole file, so it cannot be streamed; rewrite it in C order, e.g. "
            "np.save(path, np.ascontiguousarray(np.load(path, mmap_mode='r')))"
        )
    nbytes = dtype.itemsize * math.prod(shape)
    size = os.path.getsize(name)
    if size < offset + nbytes:
        raise SourceError(
            f"{name}: is truncated: its header says {what}, {nbytes} data bytes after a "
            f"{offset}-byte header ({offset + nbytes} bytes in all), but the file has "
            f"{size} bytes ({offset + nbytes - size} missing)"
        )
    return FileSource(name, dtype, tuple(shape), offset, kind="npy", shared=shared)


def _as_shape(shape: int | tuple[int, ...] | list[int], name: str) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    out = []
    for i, n in enumerate(dims):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"{name}: shape {shape!r} must hold ints, got {n!r}")
        if int(n) < 0 and not (i == 0 and int(n) == -1):
            raise SourceError(
                f"{name}: shape {shape!r} has a negative size; only a leading -1 is "
                "allowed (the row count taken from the file size)"
            )
        out.append(int(n))
    return tuple(out)


def open_raw(
    path: PathLike,
    dtype: Any,
    shape: int | tuple[int, ...] | list[int],
    offset: int = 0,
    *,
    shared: bool = False,
) -> FileSource:
    """Open a raw binary file of C-order ``dtype`` elements starting at byte ``offset``
    (``shared``: see :class:`FileSource`).

    ``shape`` is either the full shape, which must account for every byte after
    ``offset`` exactly, or a row shape with the row count taken from the file size:
    ``shape=(-1, 8)`` says so explicitly, and a shape that does not match the file's
    size is read as a row shape too, so ``shape=(8,)`` over a file of 800 float32 is
    ``(100, 8)``. (A shape that matches exactly is always the full shape: ``(8,)`` over
    32 bytes of float32 is 8 elements, not one row of 8; write ``(-1, 8)`` to mean rows.)

    Raises :class:`~tierflow.errors.SourceError` naming the file and the numbers when
    the size is not a whole number of rows, the offset is past the end, or the dtype
    holds Python objects; ``FileNotFoundError`` if there is no such file.
    """
    name = os.fspath(path)
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise SourceError(f"{name}: dtype {dt} holds Python objects, which a raw file cannot")
    if dt.itemsize == 0:
        raise SourceError(f"{name}: dtype {dt} has no size; give a sized dtype such as 'S8'")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise SourceError(f"{name}: offset must be a non-negative number of bytes, got {offset!r}")
    offset = int(offset)
    dims = _as_shape(shape, name)
    size = os.path.getsize(name)
    if offset > size:
        raise SourceError(f"{name}: offset {offset} is past the end of the {size}-byte file")
    data = size - offset
    derive = bool(dims) and dims[0] == -1
    row = dims[1:] if derive else dims
    full_nbytes = dt.itemsize * math.prod(dims)
    if not derive and full_nbytes == data:
        return FileSource(name, dt, dims, offset, kind="raw", shared=shared)
    row_nbytes = dt.itemsize * math.prod(row)
    if row_nbytes == 0:
        raise SourceError(
            f"{name}: rows of shape {row} hold no bytes, so the row count cannot be "
            "taken from the file size; give the full shape"
        )
    n_rows, rest = divmod(data, row_nbytes)
    if rest:
        full = "" if derive else (f"it is not the full shape {dims} either ({full_nbytes} bytes); ")
        raise SourceError(
            f"{name}: {data} bytes after offset {offset} are not a whole number of "
            f"{dt} rows of shape {row} ({row_nbytes} bytes each): {n_rows} rows and "
            f"{rest} bytes left over; {full}check dtype, shape and offset"
        )
    return FileSource(name, dt, (n_rows, *row), offset, kind="raw", shared=shared)


def as_source(
    source: Any,
    *,
    dtype: Any = None,
    shape: int | tuple[int, ...] | list[int] | None = None,
    offset: int = 0,
) -> Source:
    """Turn what a user passes to ``memory.chunks`` / ``memory.map`` into a :class:`Source`.

    - a :class:`Source` is returned as is;
    - an ``np.ndarray`` (including ``np.memmap`` and ``memory.array`` results) becomes
      an :class:`ArraySource`;
    - a path with ``dtype`` given is a raw file (:func:`open_raw`, ``shape`` required);
    - a path without ``dtype`` is a ``.npy`` file (:func:`open_npy`).

    ``dtype``, ``shape`` and ``offset`` describe raw files only; giving them for an array
    or a ``.npy`` file (which carry their own) raises ``TypeError``.
    """
    raw_args = dtype is not None or shape is not None or offset != 0
    if isinstance(source, (FileSource, ArraySource)):
        if raw_args:
            raise TypeError("dtype=, shape= and offset= only apply to raw files")
        return source
    if isinstance(source, np.ndarray):
        if raw_args:
            raise TypeError(
                "dtype=, shape= and offset= only apply to raw files; an array carries its "
                "own (use x.view(dtype) or x.reshape(shape) to reinterpret it)"
            )
        return ArraySource(source)
    if isinstance(source, (str, Path, os.PathLike)):
        if dtype is not None:
            if shape is None:
                raise TypeError(
                    f"{os.fspath(source)}: a raw file needs shape= as well as dtype= "
                    "(the full shape, or a row shape such as (-1, 8))"
                )
            name = os.fspath(source)
            with open(name, "rb") as f:
                if f.read(6) == _MAGIC:
                    raise TypeError(
                        f"{name}: is a .npy file, which carries its own dtype and shape; "
                        "drop dtype=, shape= and offset="
                    )
            return open_raw(name, dtype, shape, offset)
        if shape is not None or offset != 0:
            raise TypeError(
                f"{os.fspath(source)}: shape= and offset= describe a raw file and need dtype= "
                "too; a .npy file carries its own"
            )
        return open_npy(source)
    if isinstance(source, Source):
        if raw_args:
            raise TypeError("dtype=, shape= and offset= only apply to raw files")
        return source
    raise TypeError(
        f"cannot read rows from {type(source).__name__}: pass a .npy path, a raw file path "
        "with dtype= and shape=, an np.ndarray / np.memmap, or a memory.array"
    )
