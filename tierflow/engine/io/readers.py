"""Readers: how the engine gets rows out of files, arrays and directories of files.

A reader gives rows ``[a, b)`` of its data (:meth:`read`) or, when row counts are not
known before loading (``from_files`` with a varying number of rows per file), its
``j``-th block (:meth:`read_block`). ``.npy`` and raw files and arrays reuse the storage
layer's sources (:mod:`tierflow.storage.sources`): a block is a view of the memory
map (of a file, under a read lease; a copy where no lease can be had, see
:mod:`tierflow.storage.leases`); ``readahead`` asks the kernel for the next block and
``release`` drops a finished block's pages (:mod:`tierflow.storage.pages`).

A file's identity (size, modification time, inode) is read when the array is built;
:meth:`FileReader.check` runs before every compute and refuses a file that changed
since, naming it: the array's shape and key describe the file as it was.

Readers pickle (see :mod:`tierflow.engine.graph.portable`): a file reader as its path and the
identity read at build, so another process refuses a file changed since the build too;
an array reader as its array; a files reader as its paths and its loader, by value.
"""

from __future__ import annotations

import abc
import datetime
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BlockError, SourceError
from ...operators import byteorder
from ...storage import identity, sharing
from ...storage.sources import ArraySource, FileSource
from ..graph import portable

__all__ = [
    "COSTLY_BYTES",
    "ArrayReader",
    "FileReader",
    "FilesReader",
    "Reader",
    "Unfit",
    "check_identity",
    "file_stat",
    "unfit",
]

# In-memory arrays above this size are told apart by identity within a compute, and
# hashed only when their key is asked for (hashing runs at about 1 GB/s).
COSTLY_BYTES = 16 << 20


class Reader(abc.ABC):
    """Base of the readers; see the module docstring for the contract.

    ``n_rows`` is None when the row count is known only after loading; then
    ``nblocks`` gives how many blocks :meth:`read_block` serves and
    :meth:`block_rows` about how many rows each holds. ``makes_blocks``: blocks are
    made when read (loaded, computed), not views of data already in memory or a file;
    ``computes``: they are the result of a computation, which the engine's cache keeps
    like any other result (sources that only read are not kept). ``picks_rows``: its
    rows are views (a memory map, an array in memory), so rows picked in any order are
    read block by block (:func:`tierflow.engine.graph.rewrites.take_below`).
    """

    dtype: np.dtype
    row_shape: tuple[int, ...]
    n_rows: int | None
    label: str = "source"
    file_backed = False
    makes_blocks = False
    computes = False
    picks_rows = False
    reads_ahead = False  # readahead fetches rows into this process (object storage)
    reads_into = False  # read_into fills a block it is given: the engine lends pooled ones

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row."""
        return self.dtype.itemsize * math.prod(self.row_shape)

    @abc.abstractmethod
    def read(self, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` (a view where the data allows)."""

    def read_into(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        """Rows ``a:b`` written into ``out`` (``(b - a, *row_shape)`` of this dtype, its
        bytes undefined until then); returns ``out``. Readers with ``reads_into`` only."""
        raise TypeError(f"{type(self).__name__} makes its own blocks; call read(a, b)")

    def read_block(self, j: int) -> np.ndarray:
        """Block ``j``: only readers whose row count is unknown serve blocks."""
        raise TypeError(
            f"{type(self).__name__} knows its {self.n_rows} rows and reads row ranges "
            "(read(a, b)); read_block is for readers whose row count is unknown"
        )

    def block_rows(self) -> int:
        """About how many rows a block of :meth:`read_block` holds (for the memory plan)."""
        return 1

    def readahead(self, a: int, b: int) -> None:
        """Ask for rows ``a:b`` ahead of use (a hint)."""
        return None  # nothing to do for data in memory

    def scratch_bytes(self, rows: int) -> int:
        """Bytes a read of ``rows`` rows needs beside the block (a codec's buffers)."""
        return 0

    def release(self, a: int, b: int, *, drop_cache: bool = False) -> None:
        """Drop the pages of rows ``a:b`` from this process (a hint)."""
        return None  # nothing to do for data in memory

    def check(self) -> None:
        """Raise :class:`~tierflow.errors.SourceError` if the data changed since build."""
        return None  # nothing to do for data in memory

    @abc.abstractmethod
    def token(self) -> str:
        """The canonical text this source's key is hashed from."""

    def files(self) -> list[str]:
        """The files this reader reads (for ``repr``)."""
        return []


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="milliseconds")


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


@dataclass(frozen=True)
class Unfit:
    """A value a cast would change: where it is (``index`` into the flattened values),
    the value, and why, as text that follows it in a message."""

    index: int
    value: Any
    why: str

    def text(self) -> str:
        """The value as a message gives it (``300``, ``2.5``, ``nan``, ``1e+300``)."""
        return str(self.value) if isinstance(self.value, int) else repr(self.value)


def unfit(values: np.ndarray, dtype: np.dtype) -> Unfit | None:
    """The first of ``values`` that casting to ``dtype`` would not keep, or None: for an
    integer ``dtype``, a value outside its range, and a float that is NaN, infinite or
    not whole; for a float ``dtype``, a finite value beyond its largest (it would become
    infinite). Casts to bool keep NumPy's truth value; rounding to a float's precision is
    not a change of value here. Sources that cast what they read (``from_parquet``'s
    ``dtype``, ``from_files``' ``dtype``, ``from_dask``'s chunks of another dtype than the
    dask array's) refuse such values instead of wrapping them."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b" or values.size == 0 or np.can_cast(values.dtype, dtype, "safe"):
        return None
    flat = values.reshape(-1)
    if flat.dtype.kind == "b":
        return None
    if dtype.kind == "f":
        return _unfit_float(flat, dtype)
    info = np.iinfo(dtype)
    lo, past = int(info.min), int(info.max) + 1
    span = f"outside {dtype}'s range {lo}..{past - 1}"
    if flat.dtype.kind in "iu":
        if lo <= int(flat.min()) and int(flat.max()) < past:  # two passes, no scratch
            return None
        at = int(np.argmax((flat < lo) | (flat >= past)))
        return Unfit(at, int(flat[at]), span)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(flat) | (flat < float(lo)) | (flat >= float(past)) | (flat % 1 != 0)
    if not bad.any():
        return None
    at = int(np.argmax(bad))
    value = float(flat[at])
    if not np.isfinite(value):
        return Unfit(at, value, f"which {dtype} has no value for")
    if value < lo or value >= past:
        return Unfit(at, value, span)
    return Unfit(at, value, f"not a whole number, which {dtype} would truncate")


def _unfit_float(flat: np.ndarray, dtype: np.dtype) -> Unfit | None:
    largest = float(np.finfo(dtype).max)
    low, high = float(flat.min()), float(flat.max())  # NaN if there is one
    if -largest <= low and high <= largest:
        return None
    with np.errstate(invalid="ignore"):
        big = np.abs(flat) > largest  # NaN and infinities stay what they are
    big &= np.isfinite(flat)
    if not big.any():
        return None
    with np.errstate(over="ignore"):
        # Values within half a step of the largest round to it: only those that would
        # become infinite are refused.
        bad = np.flatnonzero(big)[~np.isfinite(flat[big].astype(dtype))]
    if not len(bad):
        return None
    at = int(bad[0])
    value = flat[at].item()
    return Unfit(at, value, f"beyond {dtype}'s largest value {largest:.6g}")


def file_stat(path: str) -> tuple[int, int, int, int]:
    """A file's identity: size, modification time (ns), inode, device."""
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def check_identity(path: str, stat: tuple[int, int, int, int], build: str) -> None:
    """Refuse ``path`` (``SourceError``, naming what changed) when its identity is no
    longer ``stat``, read when the array was built by ``build`` (``"tw.from_npy"``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SourceError(
            f"{path} was deleted or moved after the array was built from it; "
            "build the array again once the file is back"
        ) from None
    size, mtime, inode, device = stat
    if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) == stat:
        return
    changes = []
    if st.st_size != size:
        changes.append(f"size {size} -> {st.st_size} bytes")
    if st.st_mtime_ns != mtime:
        changes.append(f"modified {_when(mtime)} -> {_when(st.st_mtime_ns)}")
    if (st.st_ino, st.st_dev) != (inode, device):
        changes.append("replaced by another file (new inode)")
    raise SourceError(
        f"{path} changed after the array was built from it ({'; '.join(changes)}); "
        "its shape and key describe the old contents, so tierflow will not read it. "
        f"Build the array again ({build}) to use the new file"
    )


class ArrayReader(Reader):
    """An in-memory or memory-mapped array; blocks are slices (views)."""

    picks_rows = True

    def __init__(self, array: np.ndarray) -> None:
        self.source = ArraySource(array)
        self.array = array
        self.dtype = array.dtype
        self.row_shape = tuple(array.shape[1:])
        self.n_rows = int(array.shape[0])
        self.file_backed = self.source.file_backed
        self.label = "from_array"
        self._token: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The array by value (a spill file by path under multiprocessing), in its byte
        # order; the source is made again around what arrives, which may be in RAM
        # where this one was mapped.
        return {"array": sharing.in_byte_order(self.array), "_token": self._token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["array"])  # type: ignore[misc]
        self._token = state["_token"]

    def read(self, a: int, b: int) -> np.ndarray:
        return self.array[a:b]

    def readahead(self, a: int, b: int) -> None:
        if self.file_backed:
            self.source.readahead(a, b)

    def release(self, a: int, b: int, *, drop_cache: bool = False) -> None:
        if self.file_backed:
            self.source.release(a, b, drop_cache=drop_cache, count=False)

    def costly_token(self) -> bool:
        """Whether :meth:`token` would hash a big in-memory array (not done yet)."""
        return self._token is None and not self.file_backed and self.array.nbytes > COSTLY_BYTES

    def token(self) -> str:
        # Hashing reads the whole array once; it happens the first time the key is
        # needed and is remembered (the array must not change while it is in use).
        if self._token is None:
            self._token = f"array({identity.array_digest(self.array)})"
        return self._token


@dataclass(frozen=True)
class FileRows:
    """What ``load`` gives for each file: ``per_file`` rows of ``dtype`` and ``row_shape``.

    ``per_file`` is 1 (``load`` returns one row of ``row_shape``), a fixed number ``k``
    (``load`` returns ``k`` rows) or None (each file gives some number of rows, known
    once loaded).
    """

    per_file: int | None
    dtype: np.dtype
    row_shape: tuple[int, ...]


class FilesReader(Reader):
    """Rows loaded from many files by ``load(path)``, in the worker threads.

    Each file gives ``rows`` (:class:`FileRows`). ``files_per_block`` files make one
    block when the row count is unknown.
    """

    makes_blocks = True

    def __init__(
        self,
        paths: Sequence[str],
        load: Callable[[str], Any],
        rows: FileRows,
        files_per_block: int,
    ) -> None:
        self.paths = [os.fspath(p) for p in paths]
        self.load = load
        self.rows_per_file = rows.per_file
        self.dtype = rows.dtype
        self.row_shape = rows.row_shape
        self.files_per_block = files_per_block
        per_file = rows.per_file
        self.n_rows = None if per_file is None else per_file * len(self.paths)
        self.nblocks = math.ceil(len(self.paths) / files_per_block) if self.paths else 0
        name = getattr(load, "__qualname__", type(load).__name__)
        self.label = f"from_files({len(self.paths)} files, {name})"
        self._token: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "load": portable.by_value(self.load)}

    def _load(self, i: int) -> np.ndarray:
        path = self.paths[i]
        where = f"file {i} of {len(self.paths)} ({path})"
        try:
            value = np.asarray(self.load(path))
        except Exception as exc:
            name = getattr(self.load, "__qualname__", type(self.load).__name__)
            raise BlockError(
                f"from_files: {name} failed on {where}: {type(exc).__name__}: {exc}",
                index=i,
                start=i,
                stop=i + 1,
            ) from exc
        k = self.rows_per_file
        if k == 1:
            if value.shape != self.row_shape:
                raise BlockError(
                    f"from_files: load returned shape {value.shape} for {where}; every file "
                    f"must give one row of shape {self.row_shape} (from the first file or "
                    "row_shape=); pass rows_per_file=None if files hold several rows",
                    index=i,
                    start=i,
                    stop=i + 1,
                )
            value = value[np.newaxis]
        elif (
            value.ndim == 0
            or value.shape[1:] != self.row_shape
            or (k is not None and value.shape[0] != k)
        ):
            want = (
                f"({k}, {', '.join(map(str, self.row_shape))})"
                if k
                else (f"(rows, {', '.join(map(str, self.row_shape))})")
            )
            raise BlockError(
                f"from_files: load returned shape {value.shape} for {where}; every file must "
                f"give rows of shape {want}",
                index=i,
                start=i,
                stop=i + 1,
            )
        if value.dtype != self.dtype:
            if not np.can_cast(value.dtype, self.dtype, casting="same_kind"):
                raise BlockError(
                    f"from_files: load returned {value.dtype} for {where}, which does not "
                    f"cast to the array's {self.dtype}; return that dtype or pass dtype=",
                    index=i,
                    start=i,
                    stop=i + 1,
                )
            found = unfit(value, self.dtype)
            if found is not None:
                raise BlockError(
                    f"from_files: load returned {found.text()} for {where}, {found.why}; "
                    f"return values that fit, or pass dtype={value.dtype.name!r}",
                    index=i,
                    start=i,
                    stop=i + 1,
                )
            value = value.astype(self.dtype, casting="same_kind")
        return value

    def _stack(self, first: int, last: int) -> np.ndarray:
        parts = [self._load(i) for i in range(first, last)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.empty((0, *self.row_shape), self.dtype)
        return byteorder.join(parts)

    def read(self, a: int, b: int) -> np.ndarray:
        k = self.rows_per_file
        assert k is not None
        if b <= a:
            return np.empty((0, *self.row_shape), self.dtype)
        first, last = a // k, -(-b // k)
        block = self._stack(first, last)
        return block[a - first * k : b - first * k]

    def block_rows(self) -> int:
        return self.files_per_block

    def read_block(self, j: int) -> np.ndarray:
        first = j * self.files_per_block
        return self._stack(first, min(first + self.files_per_block, len(self.paths)))

    def token(self) -> str:
        if self._token is None:
            stats = []
            for p in self.paths:
                try:
                    st = os.stat(p)
                    stats.append(f"{p!r}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
                except OSError:
                    stats.append(f"{p!r}:missing")
            self._token = (
                f"files({identity.digest(','.join(stats))},{identity.function_token(self.load)},"
                f"{self.rows_per_file},{self.dtype.str},{self.row_shape})"
            )
        return self._token

    def files(self) -> list[str]:
        return self.paths
