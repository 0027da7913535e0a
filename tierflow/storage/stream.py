"""Streaming: row blocks of a source in order (:func:`chunks`), or in parallel (:func:`map`).

How a scan keeps memory flat (``memory.chunks``)::

    block:      0        1        2        3
    kernel:   [read]   [read]   [read]   [read]        readahead: block i+1 is asked
    consumer:     [use 0]  [use 1]  [use 2]  [use 3]   for while block i is used
    process:      [ 0 ]    [ 1 ]    [ 2 ]    [ 3 ]     block i is released when the
                                                       consumer asks for block i+1

Releasing drops the block's pages from the process (``MADV_DONTNEED``): RSS stays at
about one block, and views handed out stay valid (their pages fault back in from the
file). ``drop_cache=True`` also drops the file's page cache behind the scan, so the
memory cgroup's charge (which counts page cache) stays flat too: for one-pass scans
of files bigger than RAM.

Release reaches one huge page behind the block (see :mod:`tierflow.storage.sources`
for why and what it measured to matter), so nothing is left mapped or cached behind
the scan.

How a parallel map keeps memory bounded (``memory.map``)::

    submitter:  readahead + submit block k while fewer than 2 x workers are in flight
    worker:     fn(block) -> check rows / trailing shape / dtype -> copy into the output
                -> release the input block -> (spilled output) write back + release
    done:       (spilled output) release the whole output once more: blocks finish out
                of order, so a folio straddling two blocks may have been skipped
    failure:    cancel queued blocks, wait for running ones, free the output, raise
                BlockError naming the block

Default block size (``rows=None``): ``budget / share`` bytes of rows, clamped to
[1 MB, 256 MB] and at least one row, where ``share`` is 16 for ``chunks`` and
``max(16, 4 x workers)`` for ``map`` (each running block holds its input, its result
and about two temporaries). See :func:`default_rows`.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import os
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from ..config import MB
from ..errors import BlockError
from ..system import budget as _budget
from . import pages, placement
from .sources import ArraySource, Source, as_source

__all__ = [
    "Chunks",
    "block_bounds",
    "check_rows",
    "chunks",
    "default_rows",
    "map",
]

MIN_BLOCK_BYTES = 1 * MB
MAX_BLOCK_BYTES = 256 * MB
CHUNKS_SHARE = 16  # chunks: one block is at most budget / 16


def check_rows(rows: Any) -> int | None:
    """Validate a ``rows=`` argument: None, or an integer >= 1 (returned as int).

    Raises ``TypeError`` for a non-integer (2.5, "10", True) and ``ValueError`` for 0 or
    a negative number.
    """
    if rows is None:
        return None
    if isinstance(rows, bool) or not hasattr(rows, "__index__"):
        raise TypeError(f"rows must be an integer number of rows per block, got {rows!r}")
    n = int(rows.__index__())
    if n < 1:
        raise ValueError(f"rows must be at least 1 row per block, got {n}")
    return n


def default_rows(row_nbytes: int, *, share: int = CHUNKS_SHARE, budget: int | None = None) -> int:
    """Rows per block when none is given: ``budget / share`` bytes, clamped to
    [1 MB, 256 MB], divided by ``row_nbytes``, and at least 1 row.

    ``budget`` defaults to the current RAM budget (``memory.budget()``), in bytes. Rows of
    0 bytes (a zero-width trailing axis) count as 1 byte each.
    """
    total = _budget.budget_bytes() if budget is None else budget
    block_bytes = min(MAX_BLOCK_BYTES, max(MIN_BLOCK_BYTES, total // share))
    return max(1, block_bytes // max(1, row_nbytes))


def block_bounds(n_rows: int, rows: int) -> list[tuple[int, int]]:
    """``[(0, rows), (rows, 2 rows), ..., (k rows, n_rows)]``: the row blocks of a scan.

    The last block holds the remainder; ``rows`` larger than ``n_rows`` gives one block;
    0 rows give no block.
    """
    return [(i, min(i + rows, n_rows)) for i in range(0, n_rows, rows)]


class Chunks(Iterator[np.ndarray]):
    """What ``memory.chunks`` returns: an iterator of row-block views, with extras.

    ``len()`` is the number of blocks; ``rows`` the rows per block; ``source`` the
    :class:`~tierflow.storage.sources.Source` read. :meth:`close` (or leaving a
    ``with`` block, exhausting the iterator, or dropping the last reference to it)
    releases the current block and drops the source's mapping.
    """

    def __init__(self, source: Source, rows: int, *, drop_cache: bool, owned: bool) -> None:
        self.source = source
        self.rows = rows
        self.drop_cache = drop_cache
        self.bounds = block_bounds(source.n_rows, rows)
        # The generator must not refer to self: a cycle would delay its cleanup from
        # "the moment the last reference goes" to "the next garbage collection".
        self._scan = _scan(source, self.bounds, drop_cache, owned)

    def __len__(self) -> int:
        return len(self.bounds)

    def __iter__(self) -> Chunks:
        return self

    def __next__(self) -> np.ndarray:
        return next(self._scan)

    def close(self) -> None:
        """Stop the scan now: release the current block and drop the mapping."""
        self._scan.close()

    def __enter__(self) -> Chunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Chunks({self.source!r}, rows={self.rows}, blocks={len(self.bounds)}, "
            f"drop_cache={self.drop_cache})"
        )


def _scan(
    source: Source, bounds: list[tuple[int, int]], drop_cache: bool, owned: bool
) -> Generator[np.ndarray, None, None]:
    try:
        if bounds:
            source.readahead(*bounds[0])
        for k, (i0, i1) in enumerate(bounds):
            view = source.block(i0, i1)
            if k + 1 < len(bounds):
                source.readahead(*bounds[k + 1])
            try:
                yield view
            finally:
                # Runs when the consumer asks for the next block, and also when it
                # stops early (close, break, garbage collection: GeneratorExit here).
                del view
                source.release(i0, i1, drop_cache=drop_cache)
    finally:
        if owned:
            source.close()


def chunks(  # noqa: PLR0913 -- public (memory.chunks): a raw file's dtype, shape, offset as np.memmap names them
    source: Any,
    rows: int | None = None,
    *,
    dtype: Any = None,
    shape: int | tuple[int, ...] | None = None,
    offset: int = 0,
    drop_cache: bool = False,
) -> Chunks:
    """Iterate over ``source`` in row blocks along axis 0: views, in order, no copies.

    ``source`` is a ``.npy`` path (str or Path), a raw binary file (``dtype=`` and
    ``shape=``: the full shape, or a row shape such as ``(-1, 8)`` or ``(8,)`` with the
    row count taken from the file size; ``offset=`` bytes skipped at the start), an
    ``np.ndarray`` / ``np.memmap``, or a ``memory.array``.

    ``rows`` is the rows per block (the last block holds the rest; more rows than the
    source has gives one block). Default: ``budget / 16`` bytes of rows, clamped to
    [1 MB, 256 MB] and at least one row (:func:`default_rows`).

    For a file (or a file-backed array) block ``i + 1`` is asked of the kernel while
    block ``i`` is used, and block ``i`` is dropped from the process when the consumer
    moves on; views stay valid (released pages fault back in from the file), but a
    view kept around costs its RAM again when read. ``drop_cache=True`` also drops the
    file's page cache behind the scan: for one-pass scans of files bigger than RAM, so
    the cgroup's charge stays flat too. An in-RAM array is only sliced.

    The file's mapping is dropped when the iterator is exhausted, closed, or garbage
    collected (breaking out of the loop early leaks nothing); it is unmapped once no
    view of it is left.

    Raises :class:`~tierflow.errors.SourceError` for a file that cannot be read as
    rows (corrupt or truncated ``.npy``, Fortran order, object dtype, a raw size that
    is not a whole number of rows), ``TypeError`` / ``ValueError`` for bad ``rows``.

    >>> import numpy as np
    >>> [int(b.sum()) for b in chunks(np.arange(10), rows=4)]
    [6, 22, 17]
    """
    n = check_rows(rows)
    owned = not isinstance(source, (np.ndarray, Source))
    src = as_source(source, dtype=dtype, shape=shape, offset=offset)
    if n is None:
        n = default_rows(src.row_nbytes)
    return Chunks(src, n, drop_cache=drop_cache, owned=owned)


def _workers(workers: Any) -> int:
    if workers is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)
    if isinstance(workers, bool) or not hasattr(workers, "__index__"):
        raise TypeError(f"workers must be an integer, got {workers!r}")
    n = int(workers.__index__())
    if n < 1:
        raise ValueError(f"workers must be at least 1, got {n}")
    return n


class _MapRun:
    """One ``memory.map`` call: the output, and how each block is computed and stored.

    ``out`` is allocated once (by :meth:`allocate`) and then written by several worker
    threads at disjoint row ranges, so no lock is needed.
    """

    def __init__(
        self,
        fn: Callable[[np.ndarray], Any],
        source: Source,
        bounds: list[tuple[int, int]],
        dtype: np.dtype[Any] | None,
        row_shape: tuple[int, ...] | None,
    ) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.source = source
        self.bounds = bounds
        self.dtype = dtype
        self.row_shape = row_shape
        self.out: np.ndarray | None = None
        self.spilled = False
        self.out_source: ArraySource | None = None

    def where(self, k: int, i0: int, i1: int) -> str:
        n = builtins.max(1, len(self.bounds))
        empty = ", an empty input" if i0 == i1 else ""
        return f"block {k} of {n} (rows {i0}:{i1}{empty})"

    def call(self, k: int, i0: int, i1: int) -> np.ndarray:
        """Run ``fn`` on one block; wrap its failure in a BlockError naming the block."""
        block = self.source.block(i0, i1)
        try:
            result = np.asarray(self.fn(block))
        except Exception as e:
            raise BlockError(
                f"memory.map: {self.name} failed on {self.where(k, i0, i1)}: "
                f"{type(e).__name__}: {e}",
                index=k,
                start=i0,
                stop=i1,
            ) from e
        if result.ndim == 0 or result.shape[0] != i1 - i0:
            got = "a scalar" if result.ndim == 0 else f"{result.shape[0]} rows"
            raise BlockError(
                f"memory.map: {self.name} returned {got} for {self.where(k, i0, i1)}; it must "
                f"return one row per input row ({i1 - i0}), with the same trailing "
                "shape for every block",
                index=k,
                start=i0,
                stop=i1,
            )
        if result.dtype.hasobject:
            raise BlockError(
                f"memory.map: {self.name} returned an object array for "
                f"{self.where(k, i0, i1)}; "
                "return a numeric array",
                index=k,
                start=i0,
                stop=i1,
            )
        return result

    def allocate(self, first: np.ndarray | None) -> None:
        """Allocate the output: trailing shape and dtype from the arguments, else from
        ``first`` (the result of the first block)."""
        row_shape = self.row_shape
        dtype = self.dtype
        if row_shape is None:
            assert first is not None
            row_shape = tuple(first.shape[1:])
        if dtype is None:
            assert first is not None
            dtype = first.dtype
        self.row_shape, self.dtype = row_shape, dtype
        self.out = placement.array((self.source.n_rows, *row_shape), dtype)
        self.spilled = placement.on_disk(self.out)
        if self.spilled:
            self.out_source = ArraySource(self.out)

    def store(self, k: int, i0: int, i1: int, result: np.ndarray) -> None:
        """Check ``result`` against the output, copy it in, release both blocks."""
        out = self.out
        assert out is not None and self.dtype is not None
        if tuple(result.shape[1:]) != self.row_shape:
            raise BlockError(
                f"memory.map: {self.name} returned rows of shape {tuple(result.shape[1:])} for "
                f"{self.where(k, i0, i1)}, but the output's rows have shape "
                f"{self.row_shape} (from the first block, or row_shape=)",
                index=k,
                start=i0,
                stop=i1,
            )
        if not np.can_cast(result.dtype, self.dtype, casting="same_kind"):
            raise BlockError(
                f"memory.map: {self.name} returned {result.dtype} for "
                f"{self.where(k, i0, i1)}, which "
                f"does not cast to the output's {self.dtype} (casting='same_kind': float to "
                "int or complex to float is refused); return that dtype or pass dtype=",
                index=k,
                start=i0,
                stop=i1,
            )
        if i1 > i0:
            np.copyto(out[i0:i1], result, casting="same_kind")
            self.source.release(i0, i1)
            if self.out_source is not None:
                # Written back, unmapped and uncached: the output's pages must not pile
                # up in RSS or in the cgroup's page cache charge while the map runs.
                # Reaching behind may touch a block another worker is writing: on a
                # shared file mapping that costs a refault, never data (dirty or mapped
                # pages are not dropped).
                self.out_source.release(i0, i1, drop_cache=True)

    def finish(self) -> None:
        """Drop what is left of a spilled output from RAM and the page cache."""
        if self.spilled and self.out is not None and self.out.size:
            pages.release(self.out, drop_cache=True)

    def block(self, k: int, i0: int, i1: int) -> None:
        self.store(k, i0, i1, self.call(k, i0, i1))


def map(  # noqa: PLR0913 -- public (memory.map): dtype and row_shape as map_blocks names them
    fn: Callable[[np.ndarray], Any],
    x: Any,
    rows: int | None = None,
    *,
    dtype: Any = None,
    row_shape: tuple[int, ...] | None = None,
    workers: int | None = None,
) -> np.ndarray:
    """Apply ``fn`` to the row blocks of ``x`` on a thread pool; return the stacked results.

    ``x`` is anything :func:`chunks` reads without extra arguments (a ``.npy`` path, an
    ``np.ndarray`` / ``np.memmap``, a ``memory.array``, a
    :class:`~tierflow.storage.sources.Source` such as ``open_raw(...)``). ``fn`` gets a
    view of rows ``i0:i1`` and must return one row per input row; NumPy and torch
    release the GIL, so ``workers`` threads (default: all cores) compute at once. At
    most ``2 x workers`` blocks are in flight, so memory does not grow with the input.

    The output is allocated with ``memory.array`` (RAM, or a spill file on the SSD when
    bigger than the budget allows) with trailing shape ``row_shape`` and ``dtype``,
    both taken from the first block's result unless given. Results are written with
    ``casting="same_kind"``: float64 into a float32 output is fine, float into int is
    refused. Finished input blocks are released, and so are output blocks of a
    spilled output (written back and dropped from RAM and the page cache).

    ``rows`` defaults to ``budget / max(16, 4 x workers)`` bytes of input rows, clamped
    to [1 MB, 256 MB] (:func:`default_rows`).

    Raises :class:`~tierflow.errors.BlockError` when ``fn`` raises (chained as
    ``__cause__``) or returns the wrong number of rows, trailing shape or dtype; the
    message names the block (index and row range). On any error the output is freed
    (its spill file deleted) before the error propagates.

    >>> import numpy as np
    >>> map(lambda b: b * 2, np.arange(6).reshape(3, 2), rows=2).tolist()
    [[0, 2], [4, 6], [8, 10]]
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    n_workers = _workers(workers)
    n = check_rows(rows)
    want_dtype = None if dtype is None else np.dtype(dtype)
    if want_dtype is not None and want_dtype.hasobject:
        raise TypeError(f"memory.map: dtype {want_dtype} holds Python objects; give a numeric one")
    want_shape = None if row_shape is None else tuple(int(d) for d in row_shape)
    owned = not isinstance(x, (np.ndarray, Source))
    src = as_source(x)
    try:
        if n is None:
            n = default_rows(src.row_nbytes, share=builtins.max(16, 4 * n_workers))
        run = _MapRun(fn, src, block_bounds(src.n_rows, n), want_dtype, want_shape)
        try:
            _execute(run, n_workers)
            run.finish()
        except BaseException:
            if run.out is not None:
                placement.free(run.out)
                run.out = None
            raise
        assert run.out is not None
        return run.out
    finally:
        if owned:
            src.close()


def _execute(run: _MapRun, n_workers: int) -> None:
    bounds = run.bounds
    start = 0
    if run.dtype is not None and run.row_shape is not None:
        run.allocate(None)
    else:
        # The first block's result says what the output looks like; with no rows at
        # all, fn on an empty block says it.
        i0, i1 = bounds[0] if bounds else (0, 0)
        run.source.readahead(i0, i1)
        first = run.call(0, i0, i1)
        run.allocate(first)
        run.store(0, i0, i1, first)
        del first
        start = 1
    if start >= len(bounds):
        return
    if n_workers == 1:
        run.source.readahead(*bounds[start])
        for k in range(start, len(bounds)):
            if k + 1 < len(bounds):
                run.source.readahead(*bounds[k + 1])
            run.block(k, *bounds[k])
        return
    window = 2 * n_workers
    with cf.ThreadPoolExecutor(n_workers, thread_name_prefix="tierflow-map") as pool:
        pending: dict[cf.Future[None], int] = {}
        try:
            for k in range(start, len(bounds)):
                while len(pending) >= window:
                    _collect(pending, cf.FIRST_COMPLETED)
                i0, i1 = bounds[k]
                run.source.readahead(i0, i1)
                pending[pool.submit(run.block, k, i0, i1)] = k
            while pending:
                _collect(pending, cf.ALL_COMPLETED)
        except BaseException:
            # Blocks not started yet are dropped; running ones finish before the
            # executor exits, so nothing writes into the output once it is freed.
            for future in pending:
                future.cancel()
            raise


def _collect(pending: dict[cf.Future[None], int], when: str) -> None:
    """Wait for finished blocks and raise the error of the lowest failed one, if any."""
    done, _ = cf.wait(pending, return_when=when)
    for future in sorted(done, key=pending.__getitem__):
        del pending[future]
        future.result()
