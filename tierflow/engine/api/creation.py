"""The constructors of lazy arrays: ``tw.from_npy``, ``tw.from_raw``, ``tw.from_zarr``,
``tw.from_hdf5``, ``tw.from_parquet``, ``tw.from_array`` and ``tw.from_files`` (and
``tw.from_dask``, in :mod:`tierflow.engine.api.dask`).

Each opens its source now (a header, metadata: no data is read) and returns an Array
over a source node cut into row blocks (:mod:`tierflow.engine.graph.blocksize`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import SourceError
from ...operators import selection
from ...storage import sources as storage_sources
from ...storage import stream
from .. import graph
from ..graph import blocksize
from ..io.files import FileRows, FilesReader
from ..io.indexed import IndexedReader
from ..io.npy import FileReader
from .build import array_node, is_array, wrap

if TYPE_CHECKING:
    from .array import Array

__all__ = [
    "from_array",
    "from_files",
    "from_hdf5",
    "from_npy",
    "from_parquet",
    "from_raw",
    "from_zarr",
]


def from_npy(path: str | os.PathLike[str], rows: int | None = None) -> Array:
    """A lazy array over a ``.npy`` file, in blocks of ``rows`` rows.

    Nothing is read but the header. ``rows`` defaults from the RAM budget: a block is
    ``budget / max(16, 4 x cores)`` bytes, clamped to [1 MB, 32 MB], and small enough
    that every core gets four blocks (:mod:`tierflow.engine.graph.blocksize`). Blocks are
    views of a read-only memory map: reading one faults in exactly its bytes, and
    finished blocks are dropped from the process.

    Raises :class:`~tierflow.errors.SourceError` for a file that is not a readable
    C-order ``.npy`` (naming the file and the numbers), ``FileNotFoundError`` if there
    is none. A file changed after this call makes a later compute raise SourceError.
    """
    source = storage_sources.open_npy(path, shared=True)
    reader = FileReader(source, "from_npy")
    return wrap(graph.Source(reader, blocksize.bounds(source.n_rows, rows, reader.row_nbytes)))


def from_zarr(
    path_or_url: str | os.PathLike[str],
    rows: int | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_incomplete: bool = False,
) -> Array:
    """A lazy array over a Zarr array (format 3 or 2; needs zarr: ``pip install -e
    '.[zarr]'`` in the checkout), in blocks of whole chunks along axis 0.

    ``path_or_url``: a folder, or an fsspec URL (``s3://bucket/x.zarr``; with
    ``storage_options`` for the filesystem, such as ``{"endpoint_url": ...}``; needs
    s3fs for ``s3://``). ``rows`` is rounded down to whole chunks (whole shards for a
    sharded array), at least one; the default is as in :func:`from_npy`, rounded the
    same way. The chunks along the other axes are read together. Blocks are read and
    decompressed in the process that runs the task. A chunk never written reads as the
    fill value; one that cannot be decoded raises :class:`~tierflow.errors.SourceError`
    naming its key. An array whose objects changed after this call is refused at the
    next compute; its cache key follows the store URL, the metadata and the objects'
    sizes and times (or ETags).

    An array that a ``to_zarr`` left unfinished (it failed or was killed: marked
    ``tierflow: {"complete": false}``) raises :class:`~tierflow.errors.IncompleteError`,
    which counts the chunks not stored and says how to finish it, unless
    ``allow_incomplete=True`` (its missing chunks then read as the fill value).
    """
    from ..io.zarr import ZarrReader

    reader = ZarrReader(path_or_url, storage_options, allow_incomplete=allow_incomplete)
    n_rows = int(reader.n_rows or 0)
    unit = reader.chunk_rows
    step = stream.check_rows(rows) or blocksize.default_rows(reader.row_nbytes, n_rows)
    step = max(1, step // unit) * unit
    return wrap(graph.Source(reader, blocksize.bounds(n_rows, step, reader.row_nbytes)))


def from_hdf5(path: str | os.PathLike[str], dataset: str, rows: int | None = None) -> Array:
    """A lazy array over dataset ``dataset`` of the HDF5 file ``path`` (needs h5py:
    ``pip install -e '.[hdf5]'`` in the checkout), in blocks of ``rows`` rows.

    Nothing is read but the dataset's metadata. ``rows`` defaults as in
    :func:`from_npy`, rounded to whole chunks along axis 0 for a chunked dataset (so no
    chunk is decompressed twice). Blocks are read with ``read_direct`` in the process
    that runs the task; chunked, compressed datasets are decompressed by h5py there.

    Raises :class:`~tierflow.errors.SourceError` for a file that is not HDF5, a missing
    dataset (listing those there), a group or a dataset that does not hold numbers. A
    file changed after this call makes a later compute raise SourceError.
    """
    from ..io.hdf5 import Hdf5Reader

    reader = Hdf5Reader(path, dataset)
    n_rows = int(reader.n_rows or 0)
    if rows is None and reader.chunk_rows:
        default = blocksize.default_rows(reader.row_nbytes, n_rows)
        rows = max(1, default // reader.chunk_rows) * reader.chunk_rows
    return wrap(graph.Source(reader, blocksize.bounds(n_rows, rows, reader.row_nbytes)))


def from_parquet(
    paths_or_glob: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    columns: Sequence[str] | None = None,
    dtype: Any = "float32",
    nulls: str = "nan",
    rows: int | None = None,
) -> Array:
    """A lazy ``[rows, columns]`` array of ``dtype`` over numeric columns of Parquet files
    (needs pyarrow: ``pip install -e '.[parquet]'`` in the checkout).

    ``paths_or_glob``: a file, a glob pattern (files in sorted order) or a list of
    files; their rows follow one another. ``columns``: the columns, in this order
    (default: every column of the first file). Blocks follow row groups across the
    files: a block is one row group, or consecutive small ones up to about ``rows`` rows
    (default as in :func:`from_npy`). ``nulls="nan"`` reads a null as NaN (a float
    ``dtype``); ``"raise"`` refuses it, naming the column, file and row group.

    Raises :class:`~tierflow.errors.SourceError` for a column that is missing or not
    numeric (naming it and the file) and for an unreadable file; ``FileNotFoundError``
    when no file matches. A file changed after this call makes a later compute raise
    SourceError.
    """
    from ..io.parquet import ParquetReader, parquet_paths

    reader = ParquetReader(parquet_paths(paths_or_glob), columns, dtype, nulls)
    step = stream.check_rows(rows) or blocksize.default_rows(reader.row_nbytes, reader.n_rows)
    return wrap(graph.Source(reader, reader.group_bounds(step)))


def from_raw(
    path: str | os.PathLike[str],
    dtype: Any,
    shape: int | tuple[int, ...],
    offset: int = 0,
    rows: int | None = None,
) -> Array:
    """A lazy array over a raw binary file of C-order ``dtype`` elements at ``offset``.

    ``shape`` is the full shape, or a row shape with the row count taken from the file
    size (``(-1, 8)``); see :func:`tierflow.storage.sources.open_raw`. ``rows`` defaults
    as in :func:`from_npy`. Raises :class:`~tierflow.errors.SourceError` when the size is
    not a whole number of rows.
    """
    source = storage_sources.open_raw(path, dtype, shape, offset, shared=True)
    if len(source.shape) == 0:
        raise SourceError(f"{path}: a 0-d raw array has no rows")
    reader = FileReader(source, "from_raw")
    return wrap(graph.Source(reader, blocksize.bounds(source.n_rows, rows, reader.row_nbytes)))


def from_array(a: Any, rows: int | Sequence[int] | None = None) -> Array:
    """A lazy array over an in-memory array, ``np.memmap`` or ``memory.array`` (no copy),
    or over any object that slices like an array (as ``dask.array.from_array`` takes it).

    A 0-d array or scalar becomes a constant. ``rows``: rows per block (defaults as in
    :func:`from_npy`), or the rows of each block (dask's chunks along axis 0, adding up
    to the array's rows). The array must not change while lazy arrays built on it are
    in use: its key is a digest of its contents, taken once.

    An object that is not a NumPy array but has a ``shape``, a NumPy ``dtype`` and
    rows by slice (``obj[a:b]``: an h5py or zarr array, xarray's lazily indexed
    variables) is read block by block when computed, in the workers, never whole; its
    key is its own (nothing is shared with another object in the cache). Anything else
    (lists, pandas objects) goes through ``np.asarray`` first.
    """
    if is_array(a):
        return a
    if _sliceable(a):
        reader = IndexedReader(a, f"from_array({type(a).__name__})")
        return wrap(graph.Source(reader, blocksize.bounds(reader.n_rows, rows, reader.row_nbytes)))
    array = a if isinstance(a, np.ndarray) else np.asarray(a)
    if array.dtype.hasobject:
        raise TypeError(
            f"cannot make a lazy array of dtype {array.dtype}: it holds Python objects; "
            "convert to a numeric dtype first"
        )
    return wrap(array_node(array, rows))


def _sliceable(a: Any) -> bool:
    """Whether ``a`` is read by row slices (see :func:`from_array`), not converted."""
    if isinstance(a, np.ndarray) or type(a).__module__.split(".")[0] == "pandas":
        return False
    shape = getattr(a, "shape", None)
    return (
        isinstance(getattr(a, "dtype", None), np.dtype)
        and isinstance(shape, tuple)
        and len(shape) > 0
        and hasattr(a, "__getitem__")
    )


def from_files(  # noqa: PLR0913 -- public: dtype and row_shape as map_blocks names them
    paths: Sequence[str | os.PathLike[str]],
    load: Callable[[str], Any],
    rows: int | None = None,
    *,
    rows_per_file: int | None = 1,
    dtype: Any = None,
    row_shape: tuple[int, ...] | None = None,
) -> Array:
    """A lazy array whose rows are loaded from many files by ``load(path)``, in the workers.

    ``rows_per_file=1`` (default): ``load`` returns one row (an array of ``row_shape``,
    or a scalar); the array has ``len(paths)`` rows. ``rows_per_file=k``: every file
    gives exactly ``k`` rows. ``rows_per_file=None``: each file gives an array of rows
    with the same row shape but any number of rows; the row count is unknown until the
    files are loaded (like after a boolean mask).

    ``dtype`` and ``row_shape`` default to those of ``load(paths[0])``, which is then
    called once now (the only work done before a compute; give both to skip it). What
    ``load`` returns is cast to ``dtype`` (``same_kind``); a value ``dtype`` cannot hold
    (300 for int8, 1e300 for float32) raises :class:`~tierflow.errors.BlockError`
    naming the file, rather than wrap.
    ``rows`` is rows per block (files per block when row counts are unknown); it
    defaults to the budget's block size, and to at most ``len(paths) / (4 x cores)``
    files per block, so every core gets files to load.
    """
    names = [os.fspath(p) for p in paths]
    if rows_per_file is not None:
        rows_per_file = stream.check_rows(rows_per_file)
    if dtype is None or row_shape is None:
        if not names:
            raise ValueError("from_files: no paths, and no dtype= and row_shape= to describe rows")
        probe = np.asarray(load(names[0]))
        if rows_per_file == 1:
            found_shape = tuple(probe.shape)
        else:
            if probe.ndim == 0:
                raise ValueError(
                    f"from_files: load returned a scalar for {names[0]}, but rows_per_file="
                    f"{rows_per_file} expects an array of rows; use rows_per_file=1"
                )
            found_shape = tuple(probe.shape[1:])
        dtype = probe.dtype if dtype is None else dtype
        row_shape = found_shape if row_shape is None else row_shape
    dt = np.dtype(dtype)
    shape_t = tuple(int(n) for n in row_shape)
    row_nbytes = dt.itemsize * math.prod(shape_t)
    per_file = rows_per_file or 1
    if rows is None:
        files = blocksize.files_per_block(len(names), row_nbytes * per_file)
    else:
        files = max(1, (stream.check_rows(rows) or 1) // per_file)
    reader = FilesReader(names, load, FileRows(rows_per_file, dt, shape_t), files)
    if rows_per_file is None:
        return wrap(graph.Source(reader, None))
    n_rows = rows_per_file * len(names)
    step = files * rows_per_file
    return wrap(graph.Source(reader, (0, *(s for _, s in selection.block_bounds(n_rows, step)))))
