"""Interoperating with dask.array: ``tw.from_dask(darr)`` and ``Array.to_dask()``.

A Dask user can move one step of a pipeline at a time::

    y = tw.from_dask(d).map_blocks(f).to_dask()     # f now runs in tierflow

**from_dask.** A :class:`DaskReader` serves a dask array's rows. Its row blocks are the
dask array's chunks along axis 0 (one tierflow block per row chunk); the chunks along
the other axes of a row chunk are computed together and joined. A chunk is computed from
the dask graph's own keys for that row chunk, culled to what they need, with dask's
synchronous scheduler in the tierflow worker that asked for the block::

    row chunk i  ->  keys[i] (every trailing chunk)  ->  cull(graph, keys[i])
                 ->  dask.local.get_sync  ->  joined along the trailing axes

Why the keys and not ``darr[a:b].compute()``: slicing builds a new graph layer and every
compute optimises and culls the whole graph, which costs time in proportion to the
number of chunks, for every block. The reader turns the graph into a dict of tasks once
per process and then culls from the keys of one row chunk, which costs in proportion to
what that chunk needs: with 10,000 row chunks, 0.5 ms a block against 18 ms for
``darr[a:b].compute()`` and 55 ms for ``darr.blocks[i].compute()``. dask's own graph
optimisations (blockwise fusion) are left out: they cost more than they save when one
row chunk runs at a time. Why synchronous: tierflow's scheduler already decides how
many blocks are computed at once and admits each against the memory budget; a nested
thread pool would work around that. Tasks that several row chunks share (a rechunk, an overlap) are
computed once for each row chunk that needs them. A block read in pieces (cut to fit
the budget, or halved after running out of memory) computes its chunk once for all its
pieces: the reader keeps the chunk until every row has been asked for (a few chunks at
most; a slice that ends inside a chunk leaves that one kept until others push it out).

Chunk sizes along axis 0 that dask does not know (NaN, after a boolean mask) make a
source whose row counts are known once computed, as after a tierflow mask: block ``j``
is row chunk ``j``. The other axes must have known chunk sizes.

A from_dask source pickles with its dask graph by value (through ``cloudpickle``, so
functions in the graph travel too). Its key is the dask array's name, which dask
derives from the graph deterministically (``dask.base.tokenize``): the same graph
keys the same, and a changed graph changes the key and misses in the cache.

**to_dask.** A dask array whose chunks along axis 0 are the tierflow array's blocks
(NaN sizes when its row counts are unknown), one dask task per block. The task lowers
the array's graph to a block program (:mod:`tierflow.engine.planning.lower`) and runs it for that
block, serially, on the dask worker's thread: no tierflow plan, scheduler or thread
pool is built per task. Values the blocks use (``x - x.mean(axis=0)``: the mean) are
dask tasks of their own, computed once (with ``executor="serial"``) and passed to every
block task. The tierflow graph is one item of the dask graph: it pickles by value, its
file sources by path, so a ``distributed`` cluster whose workers see the same paths
runs it. Out-of-memory halving works inside a task; admission against the memory
budget is dask's business there, and tierflow's cache is not used.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import BlockError, missing_dependency
from ...operators import byteorder
from .. import graph
from ..graph import Chunked, Node, Value, blocksize, portable
from ..io.readers import Reader, unfit
from ..planning import counting
from ..planning.lower import lower_pass
from ..types import BlockIndex, Request, RowRange
from . import build

if TYPE_CHECKING:
    from .array import Array

__all__ = ["DaskReader", "from_dask", "to_dask"]


def _dask_array(purpose: str) -> Any:
    """``dask.array``, or the error that says ``purpose`` needs the extra."""
    try:
        import dask.array
    except ImportError:
        raise missing_dependency("dask", "dask", purpose) from None
    return dask.array


def _describe(shape: tuple[float, ...]) -> str:
    return "(" + ", ".join("nan" if math.isnan(n) else str(int(n)) for n in shape) + ")"


def _joined(parts: Any) -> np.ndarray:
    """The chunks of one row chunk (nested as the trailing axes nest them) as one block."""
    if not isinstance(parts, (list, tuple)):
        return np.asarray(parts)
    if len(parts) == 1:
        return _joined(parts[0])
    inner = [_joined(p) for p in parts]
    depth = 1
    probe = parts[0]
    while isinstance(probe, (list, tuple)):
        depth += 1
        probe = probe[0]
    return np.concatenate(inner, axis=inner[0].ndim - depth, dtype=inner[0].dtype)


# -- from_dask ----------------------------------------------------------------------------

# Row chunks read in pieces that a reader keeps at once (see DaskReader._piece): enough
# for the cut blocks a few workers have in flight, few enough that chunks a slice reads
# only in part (its first and last) do not pile up while the array lives.
PIECES_KEPT = 4


class _Pieces:
    """A row chunk read in pieces: its block once computed, and its rows not asked for."""

    __slots__ = ("block", "left", "lock")

    def __init__(self, rows: int) -> None:
        self.block: np.ndarray | None = None
        self.left = rows
        self.lock = threading.Lock()


class DaskReader(Reader):
    """The rows of a dask array, computed chunk by chunk (see the module docstring)."""

    makes_blocks = True
    computes = True

    def __init__(self, array: Any) -> None:
        chunks = array.chunks
        if array.ndim == 0:
            raise ValueError(
                "tw.from_dask needs an array with rows; this dask array is 0-d: compute() it"
            )
        if array.dtype.hasobject:
            raise TypeError(
                f"cannot make a lazy array of dtype {array.dtype}: it holds Python objects; "
                "convert to a numeric dtype first (darr.astype(...))"
            )
        unknown = [
            axis for axis in range(1, array.ndim) if any(math.isnan(c) for c in chunks[axis])
        ]
        if unknown:
            raise ValueError(
                f"tw.from_dask: the dask array of shape {_describe(array.shape)} has unknown "
                f"chunk sizes along axis {unknown[0]}; only the rows (axis 0) may be unknown. "
                "Call darr.compute_chunk_sizes() first"
            )
        self.array = array
        self.name = str(array.name)
        self.dtype = np.dtype(array.dtype)
        self.row_shape = tuple(int(n) for n in array.shape[1:])
        rows = chunks[0]
        self.nblocks = len(rows)
        self.bounds: tuple[int, ...] | None = None
        if not any(math.isnan(c) for c in rows):
            self.bounds = (0, *itertools.accumulate(int(c) for c in rows))
        self.n_rows = None if self.bounds is None else self.bounds[-1]
        self.label = f"from_dask({self.name[:24]!r})"
        self._keys: list[Any] = list(array.__dask_keys__())
        self._graph: dict[Any, Any] | None = None
        self._lock = threading.Lock()
        self._pieces: OrderedDict[int, _Pieces] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        # The graph by value, functions in it too; the dict of tasks is made again.
        return {"array": portable.by_value(self.array)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["array"])  # type: ignore[misc]

    def _materialised(self) -> dict[Any, Any]:
        """The dask graph as one dict of tasks, made once per process."""
        found = self._graph
        if found is None:
            with self._lock:
                found = self._graph
                if found is None:
                    found = self._graph = dict(self.array.__dask_graph__())
        return found

    def chunk(self, i: int) -> np.ndarray:
        """Row chunk ``i``, every trailing chunk computed and joined."""
        import dask.local
        from dask.optimization import cull

        keys = self._keys[i]
        needed, _ = cull(self._materialised(), keys)
        block = _joined(dask.local.get_sync(needed, keys))
        start, stop = (0, 0) if self.bounds is None else self.bounds[i : i + 2]
        want = None if self.bounds is None else stop - start
        if block.shape[1:] != self.row_shape or (want is not None and block.shape[0] != want):
            rows = "?" if want is None else str(want)
            raise BlockError(
                f"from_dask: row chunk {i} of {self.name} computed to shape {block.shape}, "
                f"but the dask array says ({rows}, {', '.join(map(str, self.row_shape))}); "
                "the graph's chunk sizes are wrong (a map_blocks without the right chunks=?)",
                index=i,
                start=start,
                stop=stop,
            )
        if block.dtype != self.dtype:
            if not np.can_cast(block.dtype, self.dtype, casting="same_kind"):
                raise BlockError(
                    f"from_dask: row chunk {i} of {self.name} computed to {block.dtype}, which "
                    f"does not cast to the dask array's {self.dtype}; give map_blocks the "
                    "right dtype=",
                    index=i,
                    start=start,
                    stop=stop,
                )
            found = unfit(block, self.dtype)
            if found is not None:
                raise BlockError(
                    f"from_dask: row chunk {i} of {self.name} computed to {block.dtype} and "
                    f"holds {found.text()}, {found.why} (the dask array says {self.dtype}); "
                    f"give map_blocks the right dtype= ({block.dtype})",
                    index=i,
                    start=start,
                    stop=stop,
                )
            block = block.astype(self.dtype)
        return block

    def read(self, a: int, b: int) -> np.ndarray:
        bounds = self.bounds
        assert bounds is not None
        if b <= a:
            return np.empty((0, *self.row_shape), self.dtype)
        first = bisect.bisect_right(bounds, a) - 1
        last = bisect.bisect_left(bounds, b)  # one past the last chunk needed
        parts = []
        for i in range(first, last):
            lo, hi = max(a, bounds[i]) - bounds[i], min(b, bounds[i + 1]) - bounds[i]
            whole = lo == 0 and hi == bounds[i + 1] - bounds[i]
            parts.append(self.chunk(i) if whole else self._piece(i, lo, hi))
        return parts[0] if len(parts) == 1 else byteorder.join(parts)

    def _piece(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of row chunk ``i``, read in pieces (a block cut to fit the
        budget, or halved after running out of memory): the chunk is computed once for
        all its pieces and dropped once every row has been asked for. At most
        :data:`PIECES_KEPT` chunks are kept; one pushed out is computed again."""
        with self._lock:
            entry = self._pieces.pop(i, None)
            if entry is None:
                entry = _Pieces(self.bounds[i + 1] - self.bounds[i])  # type: ignore[index]
            entry.left -= hi - lo
            if entry.left > 0:  # rows still to come: kept, as the most recent
                self._pieces[i] = entry
                while len(self._pieces) > PIECES_KEPT:
                    self._pieces.popitem(last=False)
        with entry.lock:  # one thread computes, the others wait for its block
            if entry.block is None:
                entry.block = self.chunk(i)
        return entry.block[lo:hi]

    def read_block(self, j: int) -> np.ndarray:
        return self.chunk(j)

    def block_rows(self) -> int:
        # A NaN chunk says nothing of its size: project a default-sized block.
        return blocksize.default_rows(self.row_nbytes)

    def token(self) -> str:
        return f"dask({self.name!r})"


def from_dask(array: Any) -> Array:
    """A lazy array over a ``dask.array.Array``: one row block per chunk along axis 0.

    Nothing is computed now. A block is the row chunk's dask tasks, run with dask's
    synchronous scheduler in the tierflow worker that reads it (see
    :mod:`tierflow.engine.api.dask`). Chunk sizes along axis 0 that dask does not know
    (NaN, after a boolean mask) give an array whose row count is known once computed;
    unknown sizes along other axes raise ValueError (call
    ``darr.compute_chunk_sizes()``). The key is the dask array's name, deterministic for
    the same graph. Raises :class:`~tierflow.errors.DependencyError` (an ImportError)
    without dask, TypeError for anything that is not a dask array.
    """
    da = _dask_array("tw.from_dask")
    if not isinstance(array, da.Array):
        raise TypeError(f"tw.from_dask needs a dask.array.Array, got {type(array).__name__}")
    reader = DaskReader(array)
    return build.wrap(graph.Source(reader, reader.bounds))


# -- to_dask ------------------------------------------------------------------------------


class _HeldSink:
    """A sink that keeps no rows: each block comes back to the task that asked for it."""

    known = False

    def task_bytes(self, rows: int) -> int:
        return 0

    def place(self) -> None:
        return None


def _bound_values(node: Chunked) -> list[Value]:
    """The value nodes the chunked part of ``node``'s graph uses (broadcast constants,
    parameters of block operators): what a block needs computed first."""
    found: dict[str, Value] = {}
    for n in graph.walk([node], stop=lambda n: isinstance(n, Value)):
        if isinstance(n, Value):
            found.setdefault(n.ident, n)
    return list(found.values())


class Pipeline:
    """What the dask tasks of one ``to_dask`` share: a node and the values its blocks
    bind. Travels to dask workers by value (a lazy graph pickles, see
    :mod:`tierflow.engine.graph.portable`); each process lowers it once per set of values."""

    def __init__(self, node: Chunked | Value) -> None:
        self.node = node
        # A value alone (a reduction made a dask array) is its own only value.
        self.values = [node] if isinstance(node, Value) else _bound_values(node)
        self._lock = threading.Lock()
        self._program: tuple[tuple[Any, ...], Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"node": self.node, "values": self.values}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._program = None

    def value(self, k: int) -> Any:
        """Value ``k`` of :attr:`values`, computed here (serially)."""
        node = self.values[k]
        if isinstance(node, graph.Const):
            return np.asarray(node.value)
        return np.asarray(build.wrap(node).compute(executor="serial", progress=False))

    def _program_for(self, bound: tuple[Any, ...]) -> Any:
        with self._lock:
            found = self._program
            if found is not None and all(a is b for a, b in zip(found[0], bound, strict=True)):
                return found[1]
            if found is None:  # the first block in this process: are the files unchanged?
                for n in graph.walk([self.node], stop=lambda n: isinstance(n, Value)):
                    if isinstance(n, graph.Source):
                        n.reader.check()
            values = {v.ident: b for v, b in zip(self.values, bound, strict=True)}
            node = self.node
            assert isinstance(node, Chunked)
            program, _ = lower_pass([(node, _HeldSink())], [], values)
            program.name = f"to_dask of {node.label()}"
            program.count = node.nblocks
            self._program = (bound, program)
            return program

    def block(self, index: int, request: Request, bound: tuple[Any, ...]) -> np.ndarray:
        """Block ``index`` (rows ``request``), with the values bound to ``bound``."""
        (block,) = self._program_for(bound).run(index, request)
        return np.asarray(block)


def _block_task(pipeline: Pipeline, index: int, start: int | None, stop: int, *bound: Any) -> Any:
    request: Request = BlockIndex(index) if start is None else RowRange(start, stop)
    return pipeline.block(index, request, bound)


def _value_task(pipeline: Pipeline, k: int) -> Any:
    return pipeline.value(k)


def _empty_task(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, dtype)


def _chunk_key(name: str, j: int, ndim: int) -> tuple[Any, ...]:
    """The dask key of row chunk ``j``: ``(name, j, 0, ...)``, ``(name,)`` when 0-d."""
    key = (name, j, *(0,) * (ndim - 1)) if ndim else (name,)
    return key


def _counted(node: Node) -> Node:
    """``node`` with its operations that wait for row counts built on counts already
    known (see :mod:`tierflow.engine.planning.counting`)."""

    def refuse(reductions: list[Node]) -> list[Any]:
        raise ValueError(
            f"to_dask: {node.label()} needs the rows of an array after a boolean mask counted "
            "first, and to_dask computes nothing; call len() on the array first (one pass "
            "that counts rows per block), or persist() it"
        )

    (built,), _ = counting.resolve([node], refuse)
    return built


def to_dask(array: Array) -> Any:
    """A ``dask.array.Array`` of ``array`` whose chunks compute through tierflow.

    Row chunks are ``array``'s blocks (NaN sizes when its row count is unknown); each is
    one dask task (see :mod:`tierflow.engine.api.dask`). An in-memory result (a
    reduction) is one chunk. Nothing is computed now: an operation that waits for row
    counts (``x[m][::-1]``) needs them counted first (``len(x)``), else ValueError.
    Raises :class:`~tierflow.errors.DependencyError` without dask.
    """
    da = _dask_array("x.to_dask()")
    from dask.highlevelgraph import HighLevelGraph

    node = _counted(array._node)
    name = f"tierflow-{node.key}"
    if isinstance(node, Value) and not node.meta_known:
        raise TypeError(
            f"the result of {node.label()} has no declared dtype and shape, so it cannot "
            "be a dask array; give dtype= and shape= to x.reduction(...), or compute() it"
        )
    assert isinstance(node, (Chunked, Value))
    pipeline = Pipeline(node)
    pipeline_key = f"tierflow-pipeline-{node.key}"
    dsk: dict[Any, Any] = {pipeline_key: pipeline}
    if isinstance(node, Value):  # one chunk: the value itself
        dsk[_chunk_key(name, 0, node.ndim)] = (_value_task, pipeline_key, 0)
        chunks: tuple[tuple[float, ...], ...] = tuple((int(n),) for n in node.shape)  # type: ignore[arg-type]
    else:
        assert isinstance(node, Chunked)
        bound = []
        for k, v in enumerate(pipeline.values):
            key = (f"tierflow-value-{v.key}", k)
            dsk[key] = (_value_task, pipeline_key, k)
            bound.append(key)
        if node.bounds is None:
            rows: tuple[float, ...] = (math.nan,) * node.nblocks
            for j in range(node.nblocks):
                dsk[_chunk_key(name, j, node.ndim)] = (
                    _block_task,
                    pipeline_key,
                    j,
                    None,
                    0,
                    *bound,
                )
        elif node.nblocks == 0:  # no rows: dask still wants one chunk
            rows = (0,)
            empty = (0, *node.row_shape)
            dsk[_chunk_key(name, 0, node.ndim)] = (_empty_task, node.dtype, empty)
        else:
            pairs = node.block_pairs()
            rows = tuple(b - a for a, b in pairs)
            for j, (a, b) in enumerate(pairs):
                dsk[_chunk_key(name, j, node.ndim)] = (_block_task, pipeline_key, j, a, b, *bound)
        chunks = (rows, *((n,) for n in node.row_shape))
    hlg = HighLevelGraph.from_collections(name, dsk, dependencies=())
    meta = np.empty((0,) * len(node.shape), node.dtype)
    return da.Array(hlg, name, chunks, meta=meta)
