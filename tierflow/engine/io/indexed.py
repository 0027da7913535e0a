"""Rows of any object that slices like an array: ``obj[a:b]`` gives rows ``a:b`` as
something ``np.asarray`` takes. xarray's lazily indexed backend arrays (a Zarr or
netCDF variable, decoded: scale factors, masks and times applied) reach the engine
this way, read block by block in the workers; an h5py or zarr array would too.

The object's contents have no cheap digest, so each reader has a key of its own (a
random token, made once and pickled with it): two lazy arrays over the same object
share nothing in the cache, and a result is never taken for another object's.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np

from ...errors import SourceError
from .readers import Reader

__all__ = ["IndexedReader", "RegionRows", "RegionSink", "place", "places_read"]


class IndexedReader(Reader):
    """Rows of ``obj`` (``shape``, ``dtype`` and ``obj[a:b]``), read when asked for."""

    makes_blocks = True

    def __init__(self, obj: Any, label: str = "from_indexed") -> None:
        shape = tuple(int(n) for n in obj.shape)
        if not shape:
            raise SourceError(f"{label}: a 0-d object has no rows")
        self.obj = obj
        self.dtype = np.dtype(obj.dtype)
        if self.dtype.hasobject:
            raise SourceError(
                f"{label}: the values are {self.dtype} (Python objects); tierflow reads "
                "numbers, booleans and datetimes"
            )
        self.row_shape = shape[1:]
        self.n_rows: int = shape[0]
        self.label = label
        self._token = f"indexed({uuid.uuid4().hex})"

    def read(self, a: int, b: int) -> np.ndarray:
        rows = np.asarray(self.obj[a:b])
        want = (b - a, *self.row_shape)
        if rows.shape != want:
            raise SourceError(
                f"{self.label}: rows {a}:{b} came back with shape {rows.shape}, not {want}; "
                "the data changed since the array was made"
            )
        return rows if rows.dtype == self.dtype else rows.astype(self.dtype)

    def token(self) -> str:
        return self._token


class RegionRows:
    """Where a task writes rows of a :class:`RegionSink`: ``target`` (pickled with it
    into a worker process), rows placed from ``row0`` on, ``trailing`` the rest of the
    region."""

    def __init__(self, target: Any, row0: int, trailing: tuple[Any, ...], lock: Any = None) -> None:
        self.target = target
        self.row0 = row0
        self.trailing = trailing
        self.lock = lock  # held around each write where the target needs it (netCDF)

    def write(self, row: int, block: np.ndarray) -> None:
        if len(block):
            start = self.row0 + row
            where = (slice(start, start + len(block)), *self.trailing)
            if self.lock is None:
                self.target[where] = block
                return
            with self.lock:
                self.target[where] = block


class RegionSink:
    """Rows written into an object that takes them by slice assignment (a Zarr, h5py
    or memory-mapped array; ``tw.store``, and xarray's ``to_zarr`` through the chunk
    manager): block rows ``a:b`` go to ``target[region]`` at rows ``row0 + a`` to
    ``row0 + b`` of the region's first axis, the trailing axes as the region says.

    Nothing is claimed or replaced but the region the caller names. The blocks are cut
    on the target's chunks (``align`` rows, counted from the region's first row), so
    two tasks never write parts of one stored chunk. A failed compute leaves the rows
    written so far: the target is the caller's, and only the region changes.
    """

    appends = False
    known = True

    def __init__(  # noqa: PLR0913 -- where the rows go, then how
        self,
        node: Any,
        target: Any,
        row0: int,
        trailing: tuple[Any, ...],
        align: int,
        lock: Any = None,
    ) -> None:
        self.node = node
        self.rows = RegionRows(target, row0, trailing, lock)
        self.align = align
        self.dtype = np.dtype(node.dtype)
        self.row_shape = tuple(node.row_shape)

    def claim(self) -> None:
        return None

    def open(self) -> None:
        return None

    def place(self) -> RegionRows:
        return self.rows

    def task_bytes(self, rows: int) -> int:
        """The block a task writes from, and a codec's copy of it."""
        return 2 * rows * self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))

    def dest(self, a: int, b: int) -> np.ndarray:
        return np.empty((b - a, *self.row_shape), self.dtype)

    def written(self, a: int, b: int, block: np.ndarray) -> None:
        self.rows.write(a, block)

    def commit(self, n_rows: int | None = None) -> None:
        flush = getattr(self.rows.target, "flush", None)
        if callable(flush):
            flush()

    def abort(self) -> None:
        return None


def place(obj: Any) -> str | None:
    """Where an array-like object's values are stored, as a string that two objects over
    the same stored array share: a Zarr array's folder (or its store's URL), an HDF5
    dataset's file and name, a memory-mapped file; through xarray's lazily indexed
    wrappers. None where it is not known (an array in memory)."""
    for _ in range(16):  # xarray's adapters hold the array they index as .array/._array
        inner = next((getattr(obj, a) for a in ("array", "_array") if hasattr(obj, a)), None)
        if inner is None or inner is obj:
            break
        obj = inner
    store_path = getattr(obj, "store_path", None)  # a Zarr array
    if store_path is not None:
        root = getattr(store_path.store, "root", None)
        if root is not None:
            return os.path.join(os.path.realpath(root), str(store_path.path)).rstrip("/")
        return str(store_path).rstrip("/")
    filename = getattr(getattr(obj, "file", None), "filename", None)  # an h5py dataset
    if isinstance(filename, str) and isinstance(getattr(obj, "name", None), str):
        return f"{os.path.realpath(filename)}::{obj.name}"
    if isinstance(obj, np.memmap) and obj.filename:
        return os.path.realpath(obj.filename)
    return None


def places_read(reader: Any) -> list[str]:
    """The places (:func:`place`) and files a source's reader reads."""
    found = [os.path.realpath(f) for f in getattr(reader, "files", list)()]
    if isinstance(reader, IndexedReader):
        found.append(place(reader.obj) or "")
    url = getattr(reader, "url", None)
    if isinstance(url, str):
        found.append(url if "://" in url else os.path.realpath(url))
    return [f for f in found if f]
