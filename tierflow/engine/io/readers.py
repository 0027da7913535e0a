"""Readers: how the engine gets rows out of its sources. This module holds what every
reader shares: the :class:`Reader` contract, the file identity check, and the check
that values fit a dtype. Each source has its module, its reader beside its sink:
:mod:`.npy` (``.npy`` and raw files), :mod:`.memory` (arrays in memory),
:mod:`.files` (directories of files), :mod:`.zarr`, :mod:`.hdf5`, :mod:`.parquet`.

A reader gives rows ``[a, b)`` of its data (:meth:`Reader.read`) or, when row counts
are not known before loading (``from_files`` with a varying number of rows per file),
its ``j``-th block (:meth:`Reader.read_block`). ``.npy`` and raw files and arrays reuse
the storage layer's sources (:mod:`tierflow.storage.sources`): a block is a view of the
memory map (of a file, under a read lease; a copy where no lease can be had, see
:mod:`tierflow.storage.leases`); ``readahead`` asks the kernel for the next block and
``release`` drops a finished block's pages (:mod:`tierflow.storage.pages`).

A file's identity (size, modification time, inode) is read when the array is built;
a reader's ``check`` runs before every compute and refuses a file that changed since,
naming it (:func:`check_identity`): the array's shape and key describe the file as it
was.

Readers pickle (see :mod:`tierflow.engine.graph.portable`): a file reader as its path
and the identity read at build, so another process refuses a file changed since the
build too; an array reader as its array; a files reader as its paths and its loader, by
value.
"""

from __future__ import annotations

import abc
import datetime
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import SourceError

__all__ = [
    "COSTLY_BYTES",
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
