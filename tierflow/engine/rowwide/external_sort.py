"""Sorting along the rows: an external merge sort in two passes, with the sorted runs
spilled to the SSD.

``np.sort(x, axis=0)``, ``np.argsort(x, axis=0)`` and ``tw.sort_rows(x, by=...)`` need
every row before their first output row is known. They run as two passes of the plan
(:mod:`tierflow.engine.planning.plan`), each over blocks, each with bounded memory::

    stage 0:  [block 0] [block 1] ... [block n]  -> [finish sort runs]
              sort the block by its key, write it to a run file (one per block)
    stage 1:  [prepare merge]  -> [block 0] ... [block n]  -> [commit file]
              output rows [a, b): split every run at ranks a and b, merge the slices

1. **Runs.** A reduction (:class:`SortRuns`) sorts each block in memory (NumPy's stable
   order, NaN last: :mod:`tierflow.operators.sorting`) and writes it to one spill file
   (:func:`tierflow.storage.spill.create`: a unique name in the process's spill folder,
   reserved before it is written). Its partial is the list of runs (paths and lengths);
   runs are combined in row order, so run ``i`` holds rows before run ``i + 1``'s.
2. **Merge.** Output rows ``[a, b)`` are global ranks ``a`` to ``b`` of the stable
   merge. :class:`MergeStep` finds in each run the position of ranks ``a`` and ``b``
   (:func:`~tierflow.operators.sorting.split_sampled`: a selection across the runs,
   ties by run then position, which keeps the sort stable; every
   :data:`SAMPLE_STEP`-th key of each run, kept in memory with the run, narrows it to
   a few pages of each run), reads only those slices from the memory-mapped run files
   and merges them. Output blocks are independent: they run
   on every worker, and a ``.npy`` output is written block by block. A block of unknown
   size (the input came through a mask) holds an equal share of the rows, known once the
   runs are: ranks ``[j * n // blocks, (j + 1) * n // blocks)``.

Memory. Pass 1 holds one block and its sorted copy per task; pass 2 one output block,
the slices it merges (as many rows) and their order; the runs themselves are on the
SSD, and their pages leave the process with the mapping after each block. The planner
cuts blocks that would not fit (``temp_bytes`` and :meth:`MergeStep.memory`).

Files. The run files of one sorted array go to the folder of its :class:`RunFiles`,
which the plan opens when its compute starts and closes when it ends, whatever
happened (:meth:`tierflow.engine.planning.plan.Plan.close`): success, an error,
``KeyboardInterrupt``. Closing removes the folder. Worker processes write their runs
into the same folder (they get it with the program).

Kinds of sort (:class:`Sorting`): ``"values"`` sorts every column by itself
(``np.sort``: the run stores its columns sorted, column-major, so a column is
contiguous for the binary searches); ``"indices"`` stores each column's sorted values
and their rows (``np.argsort``); ``"rows"`` sorts whole rows by a key
(``sort_rows``: the run stores the key and the rows in key order).
"""

from __future__ import annotations

import math
import operator
import os
import secrets
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...operators import byteorder, sorting
from ...operators.types import block_bytes, combine_partials
from ...storage import intermediates, spill
from .. import graph
from ..graph import Blocks, Chunked, Node, specs
from ..graph.keyed import NOT_KEY, Keyed
from ..graph.specs import Dtypes, Shapes, Values
from ..program.context import Context
from ..program.steps import Step
from ..types import BlockIndex, Request, RowRange, TaskMemory

__all__ = [
    "MergeStep",
    "Run",
    "RunFiles",
    "Runs",
    "RunsSpec",
    "SortRuns",
    "SortedRows",
    "Sorting",
    "check_kth",
    "sorted_node",
]

_ALIGN = 64  # bytes: where each array of a run file starts
# Every SAMPLE_STEP-th key of a run is kept in memory (4 KB of float32 keys a step): a
# 125M-row sort keeps 0.5 MB of them, and reads about 3 steps of each run per split.
SAMPLE_STEP = 1024
_INDEX = np.dtype(np.int64)


@dataclass(frozen=True)
class Sorting(Keyed):
    """What is sorted: ``mode`` ``"values"`` (each column by itself, ``np.sort``),
    ``"indices"`` (``np.argsort`` of each column) or ``"rows"`` (whole rows by the key
    columns ``by``, or by the values of a 1-D array when ``by`` is empty), ascending or
    ``descending`` (``"rows"`` only; NaN last either way)."""

    mode: str
    by: tuple[int, ...] = ()
    descending: bool = False
    # np.partition's kth, checked against the rows once the runs are counted (an
    # array whose rows are unknown when it is built, after a mask)
    kth: tuple[int, ...] = ()

    def check(self, rows: int, row_shape: tuple[int, ...]) -> None:
        """NumPy's ValueError for a ``kth`` out of bounds for ``rows`` rows (none for an
        array without elements, which NumPy partitions as it is)."""
        if self.kth and rows and math.prod(row_shape):
            check_kth(self.kth, rows)

    def label(self) -> str:
        if self.kth:
            return f"partition(kth={list(self.kth)}, axis=0)"
        if self.mode == "values":
            return "sort(axis=0)"
        if self.mode == "indices":
            return "argsort(axis=0)"
        by = f"by={list(self.by)}" if self.by else ""
        down = "descending" if self.descending else ""
        return "sort_rows(" + ", ".join(a for a in (by, down) if a) + ")"


def check_kth(kth: tuple[int, ...], length: int) -> None:
    """NumPy's ValueError for the first of ``kth`` out of bounds along an axis of
    ``length`` (negative ones count from the end, and the message shows them so)."""
    for k in kth:
        index = k + length if k < 0 else k
        if not 0 <= index < length:
            raise ValueError(f"kth(={index}) out of bounds ({length})")


# -- runs on the SSD --------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One sorted block in a spill file: ``length`` rows, and its arrays as ``(name,
    offset, dtype, shape)`` (bytes from the file's start). ``samples`` holds every
    :data:`SAMPLE_STEP`-th key, in memory (``[columns, ...]`` for the column sorts):
    what narrows the search for a rank to a few pages of each run."""

    path: str
    length: int
    parts: tuple[tuple[str, int, str, tuple[int, ...]], ...]
    samples: np.ndarray = field(compare=False)

    def read(self, name: str, start: int, stop: int, column: int | None = None) -> np.ndarray:
        """Rows ``[start, stop)`` of array ``name`` (of row ``column`` of a column-major
        one), read from the file (a ranged read of an object in object storage) into a
        new array; with ``column`` the array is 2-D."""
        _, offset, dtype_str, shape = next(p for p in self.parts if p[0] == name)
        dtype = np.dtype(dtype_str)
        if column is None:
            row = math.prod(shape[1:]) * dtype.itemsize
            out = np.empty((stop - start, *shape[1:]), dtype)
            where = offset + start * row
        else:
            out = np.empty(stop - start, dtype)
            where = offset + (column * shape[1] + start) * dtype.itemsize
        if out.nbytes and intermediates.is_url(self.path):
            data = intermediates.read_range(self.path, where, where + out.nbytes)
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8)
        elif out.nbytes:
            _pread(self.path, out, where)
        return out

    def arrays(self) -> dict[str, Any]:
        """The run's arrays, memory-mapped read-only (unmapped when they are dropped);
        in object storage, views that read the slices asked for (:class:`_Remote`)."""
        if intermediates.is_url(self.path):
            return {name: _Remote(self, name, shape) for name, _, _, shape in self.parts}
        return {
            name: np.memmap(self.path, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
            if math.prod(shape)
            else np.empty(shape, np.dtype(dtype))
            for name, offset, dtype, shape in self.parts
        }


class _Remote:
    """An array of a run in object storage, as the merge's searches use it: its length,
    and slices read when asked for (ranged reads); ``keys[c]`` of a column-major one is
    its row ``c``, another such view."""

    def __init__(
        self, run: Run, name: str, shape: tuple[int, ...], column: int | None = None
    ) -> None:
        self.run, self.name, self.column = run, name, column
        self.shape = shape if column is None else shape[1:]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            rows = self.run.read(self.name, start, max(start, stop), self.column)
            return rows[::step] if step != 1 else rows
        if self.column is None:  # row c of a column-major array
            return _Remote(self.run, self.name, self.shape, operator.index(index))
        raise TypeError("a run's keys in object storage are read by slice")


def _pread(path: str, out: np.ndarray, where: int) -> None:
    """Fill ``out`` with the bytes of ``path`` from ``where``, then drop them from the
    page cache: a run's slice is read once, and a read (unlike a fault through a
    mapping) is one request the disk serves at its streaming speed."""
    data = out.reshape(-1).view(np.uint8).data
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < out.nbytes:
            got = os.preadv(fd, [data[done:]], where + done)
            if got <= 0:
                raise OSError(f"the run file {path} ended {out.nbytes - done} bytes early")
            done += got
        os.posix_fadvise(fd, where, out.nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Runs:
    """The runs of a whole array, in row order: ``starts[i]`` is the first row of run
    ``i`` in the array, ``total`` the number of rows."""

    runs: tuple[Run, ...]
    starts: tuple[int, ...]
    total: int

    def opened(self) -> list[dict[str, Any]]:
        return [r.arrays() for r in self.runs]


class RunFiles:
    """The run files of one sorted array: a folder of their own, removed when the last
    compute using them ends.

    :meth:`open` and :meth:`close` count the computes using it (a plan opens it when its
    compute starts, closes it when it ends). The first open makes the folder, under this
    process's spill folder (so the files of a process that crashed go with that folder,
    :func:`tierflow.storage.spill.clean_stale`), or, for a compute on a cluster with a
    ``shared_dir``, under that shared folder or object-storage prefix, where a merge task
    on any node finds every run (each written under a temporary name and committed,
    read back by ranged reads); the last close removes it with every file in it. It
    pickles as its folder: runs written by worker processes go there too. :meth:`write`
    runs on workers; the lock guards the counts and the folder."""

    def __init__(self, folder: str | None = None) -> None:
        self._lock = threading.Lock()
        self._records: list[spill.SpillFile] = []
        self._users = 0
        self.folder = folder

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"])  # type: ignore[misc]

    def open(self, shared: str | None = None) -> None:
        """One more compute uses the runs; ``shared``: the cluster's shared folder or
        prefix, where the first open puts them (None: this process's spill folder)."""
        with self._lock:
            self._users += 1
            if self.folder is None:
                if shared is not None:
                    folder = intermediates.join(shared, f".tf-sort-{secrets.token_hex(8)}")
                    intermediates.makedirs(folder)
                else:
                    folder = os.path.join(spill.process_dir(), f"sort-{secrets.token_hex(8)}")
                    os.mkdir(folder, 0o700)
                self.folder = folder

    def close(self) -> None:
        """Remove the folder and every run file once no compute uses them."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users:
                return
            records, self._records = self._records, []
            folder, self.folder = self.folder, None
        for record in records:
            record.delete()
        if folder is not None and intermediates.is_url(folder):
            intermediates.remove_matching(folder + "/")
        elif folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def live(self) -> list[str]:
        """The run files there are now."""
        folder = self.folder
        if folder is not None and intermediates.is_url(folder):
            return sorted(p.rsplit("/", 1)[1] for p in intermediates.listing(folder + "/"))
        return sorted(os.listdir(folder)) if folder is not None and os.path.isdir(folder) else []

    def write(self, length: int, arrays: dict[str, np.ndarray], samples: np.ndarray) -> Run:
        """A new run file holding ``arrays`` (each C-contiguous), one after the other."""
        parts = []
        offset = 0
        for name, a in arrays.items():
            parts.append((name, offset, a.dtype.str, tuple(a.shape)))
            offset += -(-a.nbytes // _ALIGN) * _ALIGN
        assert self.folder is not None
        if intermediates.is_url(self.folder):
            whole = np.zeros(max(offset, 1), np.uint8)
            for (_, start, _, _), a in zip(parts, arrays.values(), strict=True):
                whole[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
            stem = intermediates.join(self.folder, f"run-{secrets.token_hex(8)}")
            return Run(intermediates.write_bytes(stem, whole), length, tuple(parts), samples)
        record = spill.create(max(offset, 1), self.folder)
        with self._lock:
            self._records.append(record)
        fd = os.open(record.path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            for (_, start, _, _), a in zip(parts, arrays.values(), strict=True):
                data = a.reshape(-1).view(np.uint8).data
                done = 0
                while done < a.nbytes:
                    done += os.pwritev(fd, [data[done:]], start + done)
        finally:
            os.close(fd)
        return Run(record.path, length, tuple(parts), samples)


# -- pass 1: sorted runs -----------------------------------------------------------------


def _columns(block: np.ndarray) -> np.ndarray:
    """``block``'s columns as rows of a C-contiguous ``[columns, rows]`` copy in native
    byte order, always a copy: the sort writes into it, and a block may be a read-only
    view of a file (a 1-D or one-column block is already in this layout)."""
    n = block.shape[0]
    return np.array(block.reshape(n, -1).T, dtype=byteorder.native_dtype(block.dtype), order="C")


def _row_key(block: np.ndarray, how: Sorting) -> np.ndarray:
    if not how.by:
        return sorting.row_key([block], how.descending)
    return sorting.row_key([block[:, c] for c in how.by], how.descending)


def _key_itemsize(dtype: np.dtype, how: Sorting) -> int:
    return dtype.itemsize * max(1, len(how.by))


class SortRuns:
    """The reduction of pass 1 (see the module docstring): ``chunk`` sorts a block and
    writes it to a run file, partials are lists of runs combined in row order, the
    result is :class:`Runs`."""

    n_inputs = 1
    row_independent = False
    commutative = False
    out_dtype = None
    out_shape = None

    def __init__(self, how: Sorting, dtype: np.dtype, row_shape: tuple[int, ...], files: RunFiles):
        self.how = how
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(row_shape)
        self.files = files

    def sorted_block(self, block: np.ndarray) -> dict[str, np.ndarray]:
        """What a run of ``block`` stores (see :class:`Sorting`)."""
        how = self.how
        if how.mode == "values":
            columns = _columns(block)
            for row in columns:
                row[:] = sorting.sort_stable(row)
            return {"keys": columns}
        if how.mode == "indices":
            columns = _columns(block)
            order = sorting.stable_order(columns, axis=1)
            return {"keys": np.take_along_axis(columns, order, axis=1), "index": order}
        key = _row_key(block, how)
        order = sorting.stable_order(key)
        return {"keys": np.take(key, order), "rows": np.take(block, order, axis=0)}

    def chunk(self, block: np.ndarray, row_offset: int = 0) -> list[Run] | None:
        if block.shape[0] == 0:
            return None
        arrays = self.sorted_block(block)
        samples = np.array(arrays["keys"][..., ::SAMPLE_STEP])
        return [self.files.write(block.shape[0], arrays, samples)]

    def combine(self, a: list[Run] | None, b: list[Run] | None) -> list[Run] | None:
        return combine_partials(a, b, operator.add)

    def aggregate(self, partial: list[Run] | None) -> Runs:
        runs = tuple(partial or ())
        starts = [0]
        for r in runs:
            starts.append(starts[-1] + r.length)
        self.how.check(starts[-1], self.row_shape)
        return Runs(runs, tuple(starts[:-1]), starts[-1])

    def temp_bytes(self, rows: int) -> int:
        block = block_bytes(rows, self.row_shape, self.dtype)
        if self.how.mode == "values":
            return 2 * block  # the column-major copy, and the sort's merge buffer
        if self.how.mode == "indices":
            return 2 * block + 2 * rows * math.prod(self.row_shape) * _INDEX.itemsize
        # The key, its order-preserving integers and their temporaries, the packed
        # keys and positions (operators.sorting.stable_order), the sorted rows.
        key = rows * _key_itemsize(self.dtype, self.how)
        return 6 * key + 2 * rows * _INDEX.itemsize + block

    def partial_bytes(self) -> int:
        return 4096


@dataclass(frozen=True, eq=False)
class RunsSpec(specs.ReduceSpec):
    """Builds :class:`SortRuns` for a :class:`~tierflow.engine.graph.nodes.Reduce` node; its
    value (:class:`Runs`) has no dtype or shape and is used by :class:`SortedRows` only.
    ``files`` live for one compute: not part of the key."""

    how: Sorting
    files: RunFiles = field(metadata=NOT_KEY)

    @property
    def scratch(self) -> RunFiles:
        """The run files, opened and closed by the plan (graph.Reduce)."""
        return self.files

    def build(
        self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values
    ) -> SortRuns:
        return SortRuns(self.how, dtypes[0], row_shapes[0], self.files)

    def meta(self, op: Any, first: Any) -> tuple[None, None]:
        return None, None

    def label(self) -> str:
        return f"sort runs for {self.how.label()}"


# -- pass 2: merge ----------------------------------------------------------------------


class SortedRows(Chunked):
    """The rows of ``source`` in sorted order, merged from the runs (its one input, a
    :class:`~tierflow.engine.graph.nodes.Reduce` of :class:`RunsSpec`). Cut as ``source``
    is when its row counts are known; else into as many blocks, of equal shares."""

    cacheable = False  # made from run files that live for one compute

    def __init__(self, runs: graph.Reduce, source: Chunked, how: Sorting) -> None:
        dtype = _INDEX if how.mode == "indices" else source.dtype
        if source.bounds is not None:
            blocks = Blocks(source.bounds)
        else:
            blocks = Blocks(None, source.nblocks, ("sorted", self))
        super().__init__((runs,), dtype, source.shape, blocks)
        self.how = how
        self.rows_of = source
        self._share: int | None = None

    def share(self, upper_rows: Any) -> int:
        """At most how many rows a block of unknown size has: an equal share of at most
        the rows ``source``'s blocks have (``upper_rows(node, j)`` bounds block ``j``)."""
        if self._share is None:
            count = max(1, self.nblocks)
            total = sum(upper_rows(self.rows_of, j) for j in range(self.nblocks))
            self._share = -(-total // count)
        return self._share

    def params(self) -> str:
        return self.how.params()

    def label(self) -> str:
        return f"merge runs of {self.how.label()}"

    def rows_from(self) -> tuple[Node, ...]:
        """The sorted rows are ``source``'s, reached through the runs."""
        return (self.rows_of,)

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        (runs,) = inputs
        assert isinstance(runs, graph.Reduce) and isinstance(runs.inputs[0], Chunked)
        return SortedRows(runs, runs.inputs[0], self.how)


def sorted_node(source: Chunked, how: Sorting) -> SortedRows:
    """The lazy sorted array of ``source`` (see the module docstring)."""
    return SortedRows(graph.Reduce(RunsSpec(how, RunFiles()), (source,)), source, how)


class MergeStep(Step):
    """Output rows of a :class:`SortedRows` node: ranks ``[a, b)`` merged from the runs.
    ``runs`` is the bound :class:`Runs` (None while planning)."""

    node: SortedRows

    def __init__(self, node: SortedRows, runs: Runs | None) -> None:
        self.node = node
        self.runs = runs

    def ranks(self, req: Request) -> tuple[int, int]:
        """The ranks ``[a, b)`` a request asks for."""
        if isinstance(req, RowRange):
            return req.start, req.stop
        assert isinstance(req, BlockIndex) and self.runs is not None
        total, count = self.runs.total, max(1, self.node.nblocks)
        return req.index * total // count, (req.index + 1) * total // count

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        a, b = self.ranks(req)
        assert self.runs is not None
        return merge(self.runs, self.node, a, b)

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        return iter(())

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        node = self.node
        out = 0 if into_sink else block_bytes(rows, node.row_shape, np.dtype(node.dtype))
        source = node.rows_of
        dtype = np.dtype(source.dtype)
        cells = rows * math.prod(node.row_shape)
        if node.how.mode == "rows":
            key = rows * _key_itemsize(dtype, node.how)
            slices = block_bytes(rows, node.row_shape, dtype) + key
            temps = slices + 5 * key + 2 * rows * _INDEX.itemsize
        elif node.how.mode == "values":
            slices = cells * dtype.itemsize
            # One column at a time: its slices, their order (as in SortRuns), sorted.
            temps = 7 * rows * dtype.itemsize + 2 * rows * _INDEX.itemsize
        else:
            slices = cells * (dtype.itemsize + _INDEX.itemsize)
            temps = rows * (dtype.itemsize + 3 * _INDEX.itemsize)
        return TaskMemory(inputs=slices, outputs=out, temps=temps)


def merge(runs: Runs, node: SortedRows, a: int, b: int) -> np.ndarray:
    """Ranks ``[a, b)`` of the stable merge of ``runs``, as rows of ``node``."""
    how, dtype, row_shape = node.how, np.dtype(node.dtype), node.row_shape
    rows = max(0, b - a)
    if rows == 0 or not runs.runs:
        return np.empty((rows, *row_shape), dtype)
    opened = runs.opened()
    each = list(zip(runs.runs, runs.starts, strict=True))
    if how.mode == "rows":
        keys = [o["keys"] for o in opened]
        lo, hi = _splits(runs, keys, None, a, b)
        pieces = [r.read("keys", i, j) for (r, _), i, j in zip(each, lo, hi, strict=True)]
        _, order = sorting.merge_order(pieces)
        picked = [r.read("rows", i, j) for (r, _), i, j in zip(each, lo, hi, strict=True)]
        return np.take(byteorder.join(picked), order, axis=0)
    width = math.prod(row_shape)
    out = np.empty((rows, width), dtype)
    for c in range(width):
        keys = [o["keys"][c] for o in opened]
        lo, hi = _splits(runs, keys, c, a, b)
        pieces = [r.read("keys", i, j, c) for (r, _), i, j in zip(each, lo, hi, strict=True)]
        if how.mode == "values":
            out[:, c] = sorting.sort_stable(np.concatenate(pieces))
            continue
        _, order = sorting.merge_order(pieces)
        index = np.concatenate(
            [
                r.read("index", i, j, c) + start
                for (r, start), i, j in zip(each, lo, hi, strict=True)
            ]
        )
        out[:, c] = index[order]
    return out.reshape(rows, *row_shape)


def _splits(
    runs: Runs, keys: list[np.ndarray], column: int | None, a: int, b: int
) -> tuple[list[int], list[int]]:
    """Where ranks ``a`` and ``b`` fall in each run (of ``column`` of the column sorts)."""
    samples = [r.samples if column is None else r.samples[column] for r in runs.runs]

    def read(i: int, start: int, stop: int) -> np.ndarray:
        return runs.runs[i].read("keys", start, stop, column)

    lo = sorting.split_sampled(keys, samples, SAMPLE_STEP, a, read)
    hi = sorting.split_sampled(keys, samples, SAMPLE_STEP, b, read)
    return lo, hi
