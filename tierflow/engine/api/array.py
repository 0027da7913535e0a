"""The lazy :class:`Array` (its constructors, ``tw.from_npy`` and the others, are in
:mod:`tierflow.engine.api.creation`).

An Array is a handle on a graph node (:mod:`tierflow.engine.graph.nodes`). Building one reads
no data and runs no operator: NumPy operators, ufuncs, reductions, selections and
``map_blocks`` add nodes; a sink (``compute``, ``to_npy``, ``persist``) runs them. NumPy's
functions and the methods implemented elsewhere reach their modules through the registry
(:mod:`tierflow.engine.api.dispatch`), and nodes are built with
:mod:`tierflow.engine.api.build`; this module imports none of the modules that register.

Semantics are NumPy's: result dtypes follow NEP 50, operands broadcast against trailing
axes, shapes that do not broadcast raise NumPy's error naming both shapes, and errors
NumPy raises while resolving dtypes (an unsigned integer plus ``-1``) are raised when the
pipeline is built, not halfway through it. Two things differ, both because rows come in
blocks:

* an operand that does not have the array's rows (a row vector of column means, the
  result of a reduction) is a *broadcast constant*: it is computed first and held in
  memory whole;
* after a boolean mask the number of rows is unknown (``shape[0]`` is None) until
  counted; such arrays combine row by row with arrays cut by the same mask, and an
  operation that needs the row count (a row slice, ``x[i]``, ``argmax``, other rows)
  waits for a pass that counts rows per block (:mod:`tierflow.engine.planning.counting`); one
  that needs the length of a value that depends on the data (``np.unique(x)[1:]``)
  waits for the value.
"""

from __future__ import annotations

import html
import math
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...config import format_bytes
from ...operators import reductions as red
from ...operators import selection
from ...system import devices
from .. import graph
from ..graph import Chunked, ElemOp, Node, Value, block_operators, blocksize, rewrites, specs
from ..planning import counting
from . import build, dispatch
from .creation import from_array

__all__ = ["Array"]


# -- constructors -----------------------------------------------------------------------


# -- operands ---------------------------------------------------------------------------


def _power_shortcut(dtype: np.dtype, exponent: Any) -> np.ufunc | None:
    """The ufunc ``ndarray.__pow__`` calls instead of np.power for a Python number:
    ``x ** 2`` is np.square, and for floats and complex numbers ``x ** -1`` is
    np.reciprocal and ``x ** 0.5`` np.sqrt. Their answers differ from np.power's for
    complex infinities and NaN, and np.square of booleans is int8 (np.power's int64)."""
    inexact = np.dtype(dtype).kind in "fc"
    if type(exponent) is int and (exponent == 2 or (exponent == -1 and inexact)):
        return np.square if exponent == 2 else np.reciprocal
    if type(exponent) is float and exponent == 0.5 and inexact:
        return np.sqrt
    return None


def _reduce_value(kind: str) -> Callable[..., Any]:
    if kind == "count_nonzero":
        return np.count_nonzero
    return getattr(np, kind)


# Keywords of the along() functions for which None is a value, not the default.
_VALUED = frozenset({"prepend", "append"})


def _filtered(node: graph.Filter) -> Array:
    """The rows ``node`` keeps: unknown until counted, but none of none, so the rows of
    an array without rows are counted at once (its blocks keep none), as a count would
    leave them."""
    source = node.inputs[0]
    assert isinstance(source, Chunked)
    if source.n_rows != 0:
        return build.wrap(node)
    node.row_counts = (0,) * node.nblocks
    return build.wrap(graph.Counted(node, node.row_counts))


def _diff_joined(x: Array, axis: int, kwargs: dict[str, Any]) -> Array | None:
    """``np.diff(x, n, axis, prepend=a, append=b)`` where ``a`` or ``b`` is an array (not
    a number): NumPy joins them to ``x`` along ``axis`` (``np.concatenate``, whose error
    it raises) and takes the differences of that. Such an array has ``x``'s rows, so the
    join is a lazy concatenation, its rows cut as ``x``'s are; a number stays with each
    block. None where there is no array to join (or ``n`` is not positive: NumPy then
    returns ``x``, or raises, before it joins anything)."""
    n = kwargs.get("n", 1)
    arrays = {e: kwargs[e] for e in ("prepend", "append") if e in kwargs and np.ndim(kwargs[e])}
    if not arrays or not isinstance(n, (int, np.integer)) or n <= 0:
        return None
    parts = [arrays.get("prepend"), x, arrays.get("append")]
    rest = {k: v for k, v in kwargs.items() if k not in arrays}
    joined = dispatch.handler(np.concatenate)([p for p in parts if p is not None], axis=axis)
    return joined.along("diff", axis, **rest)


def _key(key: Any, items: tuple[Any, ...]) -> Any:
    """``items`` in the form of ``key`` (a tuple, or one item)."""
    return items if isinstance(key, tuple) else items[0]


# -- the Array --------------------------------------------------------------------------


class Array:
    """A lazy array, chunked in row blocks along axis 0 (see the module docstring).

    Attributes: ``shape`` (None for an unknown row count), ``dtype``, ``ndim``,
    ``size``, ``nbytes``, ``blocks`` (``(start, stop)`` rows of each block), ``nblocks``
    and ``key`` (a stable digest of what it computes).
    """

    # Above NumPy arrays, so ``ndarray + Array`` dispatches here.
    __array_priority__ = 20

    def __init__(self, node: Node) -> None:
        self._node = node

    # -- metadata ---------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int | None, ...]:
        """The shape; the row count is None after a boolean mask until its rows are
        counted (by ``len()``, or a compute that needed the count), as is a length that
        depends on the data (``np.unique``, ``np.bincount``) until computed."""
        node = self._node
        shape = node.shape
        if None in shape:
            return counting.known_shape(node) or shape
        return shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype (NumPy's result dtype of the operations)."""
        return self._node.dtype  # type: ignore[return-value]

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self._node.ndim

    @property
    def T(self) -> Any:
        """The transpose: lazy only as the left operand of ``@`` with an array of the
        same rows (``x.T @ y``, ``x.T @ x``); see :mod:`tierflow.engine.api.products`."""
        return dispatch.call_method("transpose", self)

    def transpose(self, *axes: Any) -> Any:
        """``x.transpose(axes)``: as :attr:`T` without axes (or with ``(1, 0)``); a block
        map when the row axis stays first."""
        single = len(axes) == 1 and not isinstance(axes[0], (int, np.integer))
        order = axes[0] if single else axes
        return dispatch.call_method("transpose", self, order if order else None)

    @property
    def size(self) -> int | None:
        """Number of elements (None while the row count is unknown)."""
        if any(n is None for n in self.shape):
            return None
        return math.prod(self.shape)  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int | None:
        """Bytes of the computed array (None while the row count is unknown)."""
        size = self.size
        return None if size is None or self.dtype is None else size * self.dtype.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return int(self.dtype.itemsize)

    @property
    def blocks(self) -> tuple[tuple[int, int], ...] | None:
        """``(start, stop)`` rows of every block; None while row counts are unknown
        (and for in-memory results such as reductions, which have no blocks)."""
        node = self._node
        if isinstance(node, Chunked) and node.bounds is not None:
            return tuple(node.block_pairs())
        return None

    @property
    def chunks(self) -> tuple[tuple[float, ...], ...]:
        """dask's ``chunks``: the rows of every block along axis 0, and each trailing
        axis whole (``((r1, r2, ...), (k,), ...)``). Before the rows are counted (after a
        mask), NaN for each block, as dask has it; an in-memory result is one chunk."""
        node = self._node
        if isinstance(node, Chunked):
            if node.bounds is not None:
                rows: tuple[float, ...] = tuple(b - a for a, b in node.block_pairs())
            else:
                rows = (math.nan,) * node.nblocks
            return (rows, *((int(n),) for n in node.row_shape))
        return tuple((int(n),) for n in node.shape)  # type: ignore[arg-type]

    @property
    def nblocks(self) -> int:
        """Number of row blocks (1 for in-memory results)."""
        node = self._node
        return node.nblocks if isinstance(node, Chunked) else 1

    @property
    def key(self) -> str:
        """A 32-digit hex digest of what this array computes: equal keys, equal results.

        It covers the operations, their parameters (functions by their pickled code and
        closure) and the sources (path, size, modification time, inode, dtype, shape)."""
        return self._node.key

    def __len__(self) -> int:
        if not self.ndim:
            raise TypeError("len() of a 0-d array")
        return self._counted_shape()[0]

    def _counted_shape(self) -> tuple[int, ...]:
        """The shape, its row count counted first where it is unknown.

        This is the one rule for what needs the row count now: a call that answers
        with a number (``len(x)``, ``np.size(x)``, ``x.item(i)``, ``bool(x)``) counts,
        as NumPy's answer is a number; the attributes (``shape``, ``size``,
        ``nbytes``) and ``np.shape`` never run anything and show None until counted.
        Counting is one pass that counts rows per block (the mask's true values), or
        that computes a value whose length depends on the data; the counts (the
        length) are kept, so later operations, computes and ``shape`` do not count
        again."""
        shape = self.shape
        if None in shape:
            from ..runtime.run import resolve_rows

            shape = resolve_rows(self._node).shape
        if None in shape:
            raise TypeError(f"the length of {self._node.label()} is unknown until computed")
        return shape  # type: ignore[return-value]

    def _standin(self) -> np.ndarray:
        """An array of the counted shape and dtype that holds no data (every stride 0),
        for NumPy's own checks of a call that answers with a number: NumPy raises its
        error (an index out of range, an array not of one element) on it."""
        return np.broadcast_to(np.zeros((), self.dtype), self._counted_shape())

    def __iter__(self) -> Any:
        raise TypeError(
            "a lazy array cannot be iterated row by row; compute() it, or use map_blocks "
            "to run a function on each block"
        )

    __hash__ = object.__hash__

    # -- sinks ------------------------------------------------------------------------

    def compute(self, **options: Any) -> Any:
        """The result as a NumPy array (or NumPy scalar), computed now.

        A chunked result is allocated with ``memory.array``: in RAM while it fits the
        budget, else in a spill file on the SSD (an ``np.memmap``). Options are those of
        :func:`tierflow.compute` (``progress``, ``executor``, ``workers``, ``callbacks``,
        ``cache``: ``True`` or a store name keeps the result's blocks in that store and
        reads back those already there, so a re-run or a resumed run computes only
        what is missing).
        """
        from .compute import compute

        return compute(self, **options)[0]

    def persist(self, **options: Any) -> Array:
        """Compute now and return an Array over the result (RAM or SSD), with the same
        key and blocks, so later pipelines start from it instead of recomputing it.
        Options as :meth:`compute` (``cache=`` also keeps the blocks in a store, for
        later runs), plus ``device="cuda"`` (or ``"cuda:N"``, ``"auto"``): keep the
        blocks on that GPU while they fit its budget, the largest spilled to RAM (then
        the SSD) when they do not, read back when used there."""
        from .compute import persist

        return persist(self, **options)

    def to_npy(self, path: str | os.PathLike[str], **options: Any) -> None:
        """Write the result to a ``.npy`` file, streaming, however big it is.

        Written under a temporary name in the same folder and renamed to ``path`` at the
        end: an error or an interrupt leaves neither a half-written ``path`` nor the
        temporary file. Space for the whole file is reserved before anything is
        computed (a full disk fails at once, with the numbers). Options as
        :meth:`compute`, plus ``fsync=True`` to make the file durable before the rename.

        A ``path`` that exists is refused with
        :class:`~tierflow.errors.DestinationExistsError` before anything is computed,
        unless ``overwrite=True``; even then only a ``.npy`` file is replaced (never a
        folder or another kind of file), and only by the rename at the end, so the old
        file is there until the new one is complete and may be this array's own
        source.
        With ``cache=`` every block is also kept in the cache as it is written: a run
        that was killed, run again, computes only the blocks it had not finished and
        writes the same bytes; the killed run's temporary file is removed.
        """
        from .compute import to_npy

        to_npy(self, path, **options)

    def to_zarr(self, path_or_url: str | os.PathLike[str], **options: Any) -> None:
        """Write the result to a Zarr array (format 3; needs zarr) at a folder or an
        fsspec URL, streaming, however big it is.

        ``chunks``: rows per chunk (an int) or a chunk shape; default the array's block
        size, so that each block task writes whole chunks. ``shards``: rows (or a shape)
        per shard, a whole number of chunks; default none. ``compressors``: as zarr's
        ``create_array`` takes them (default zarr's). ``storage_options``: the
        filesystem's options for a URL. Chunks (or shards) must divide the blocks: the
        error says which row does not.

        A destination that holds anything is refused with
        :class:`~tierflow.errors.DestinationExistsError` before anything is computed,
        unless ``overwrite=True``. Even then only a Zarr array alone in its folder (or
        prefix) is replaced, its metadata and chunks and nothing else, and only once the
        new array is complete: it is written beside the old one and swapped in at the
        end, so the old array may be this array's own source.

        The array carries the attribute ``tierflow: {"complete": false, ...}`` until
        its last block is in; a run that fails or is killed leaves it so, with no torn
        chunk (each chunk is written whole, under a temporary name on a local disk), and
        ``tw.from_zarr`` refuses it. The same ``to_zarr`` run again finishes it (no
        ``overwrite=True`` needed for its own unfinished array); with ``cache=`` it
        computes only the blocks it had not finished. Arrays of unknown row counts
        (after a mask) are written too, growing as blocks arrive. Other options as
        :meth:`compute`.
        """
        from .compute import to_zarr

        to_zarr(self, path_or_url, **options)

    def to_dask(self) -> Any:
        """A ``dask.array.Array`` of this array whose chunks compute through tierflow.

        Its chunks along axis 0 are this array's blocks (NaN sizes while the row count
        is unknown), one dask task each; an in-memory result (a reduction) is one chunk.
        It runs on any dask scheduler, a ``distributed`` cluster included (the graph
        travels by value, files by path). Computes nothing now. Needs the ``dask``
        extra; see :mod:`tierflow.engine.api.dask`.
        """
        from .dask import to_dask

        return to_dask(self)

    def cache(self, store: Any = True) -> Array:
        """Mark this array's node for caching: every compute that needs it keeps its
        blocks (or its value, for a reduction) in a two-tier store and reads them from
        there in later runs, without caching the rest of the pipeline. Typically on an
        expensive ``map_blocks``::

            emb = x.map_blocks(embed).cache()     # kept; what follows is not
            emb.mean(axis=0).compute()            # computes emb, keeps its blocks
            emb.max(axis=0).compute()             # reads emb from the cache

        ``store``: True (the compute's cache store if it has one, else the ``cache``
        setting's, else the store named ``"cache"``), a store name or path, a store from
        ``memory.store``, or False to remove the mark. ``compute(cache=False)`` ignores
        marks. Marks the node in place (every array over the same node shares it) and
        returns ``self``; computes nothing.
        """
        if store is not True and store is not False:
            from ..io.cache import resolve_spec

            resolve_spec(store)  # a wrong type fails here, not at the compute
        self._node.cache_mark = None if store is False else store
        return self

    def visualize(self, filename: str | os.PathLike[str] | None = None) -> Any:
        """The graph of this array: a graphviz ``Digraph`` when graphviz is installed,
        else a text drawing; written to ``filename`` when given."""
        from ..observe.visualize import visualize

        return visualize(self._node, filename)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        result = np.asarray(self.compute())
        return result if dtype is None else result.astype(dtype, copy=False)

    def _one(self, convert: Callable[[np.ndarray], Any]) -> Any:
        """``convert`` (``bool``, ``int``, ``float``, ``complex``) of the computed array
        of one element: NumPy's conversion decides (NumPy 2 converts only 0-d arrays to
        numbers, and any array of one element to a truth value). An array of more or
        fewer elements (its rows counted first) gets NumPy's error, computing nothing."""
        standin = self._standin()
        if standin.size != 1:
            convert(standin)  # NumPy's error: more than one element, or none
            raise TypeError(  # where a NumPy would convert it after all
                f"only arrays with one element convert to a Python scalar; this one has "
                f"shape {build.describe_shape(standin.shape)}"
            )
        return convert(np.asarray(self.compute()))

    def __bool__(self) -> bool:
        return bool(self._one(bool))

    def __float__(self) -> float:
        return float(self._one(float))

    def __int__(self) -> int:
        return int(self._one(int))

    def __complex__(self) -> complex:
        return complex(self._one(complex))

    # -- elementwise ------------------------------------------------------------------

    def __add__(self, other: Any) -> Array:
        return build.apply_ufunc(np.add, self, other)

    def __radd__(self, other: Any) -> Array:
        return build.apply_ufunc(np.add, other, self)

    def __sub__(self, other: Any) -> Array:
        return build.apply_ufunc(np.subtract, self, other)

    def __rsub__(self, other: Any) -> Array:
        return build.apply_ufunc(np.subtract, other, self)

    def __mul__(self, other: Any) -> Array:
        return build.apply_ufunc(np.multiply, self, other)

    def __rmul__(self, other: Any) -> Array:
        return build.apply_ufunc(np.multiply, other, self)

    def __truediv__(self, other: Any) -> Array:
        return build.apply_ufunc(np.true_divide, self, other)

    def __rtruediv__(self, other: Any) -> Array:
        return build.apply_ufunc(np.true_divide, other, self)

    def __floordiv__(self, other: Any) -> Array:
        return build.apply_ufunc(np.floor_divide, self, other)

    def __rfloordiv__(self, other: Any) -> Array:
        return build.apply_ufunc(np.floor_divide, other, self)

    def __mod__(self, other: Any) -> Array:
        return build.apply_ufunc(np.remainder, self, other)

    def __rmod__(self, other: Any) -> Array:
        return build.apply_ufunc(np.remainder, other, self)

    def __pow__(self, other: Any) -> Array:
        shortcut = _power_shortcut(self.dtype, other)
        if shortcut is not None:
            return build.apply_ufunc(shortcut, self)
        return build.apply_ufunc(np.power, self, other)

    def __rpow__(self, other: Any) -> Array:
        return build.apply_ufunc(np.power, other, self)

    def __and__(self, other: Any) -> Array:
        return build.apply_ufunc(np.bitwise_and, self, other)

    def __rand__(self, other: Any) -> Array:
        return build.apply_ufunc(np.bitwise_and, other, self)

    def __or__(self, other: Any) -> Array:
        return build.apply_ufunc(np.bitwise_or, self, other)

    def __ror__(self, other: Any) -> Array:
        return build.apply_ufunc(np.bitwise_or, other, self)

    def __xor__(self, other: Any) -> Array:
        return build.apply_ufunc(np.bitwise_xor, self, other)

    def __rxor__(self, other: Any) -> Array:
        return build.apply_ufunc(np.bitwise_xor, other, self)

    def __lshift__(self, other: Any) -> Array:
        return build.apply_ufunc(np.left_shift, self, other)

    def __rlshift__(self, other: Any) -> Array:
        return build.apply_ufunc(np.left_shift, other, self)

    def __rshift__(self, other: Any) -> Array:
        return build.apply_ufunc(np.right_shift, self, other)

    def __rrshift__(self, other: Any) -> Array:
        return build.apply_ufunc(np.right_shift, other, self)

    def __lt__(self, other: Any) -> Array:
        return build.apply_ufunc(np.less, self, other)

    def __le__(self, other: Any) -> Array:
        return build.apply_ufunc(np.less_equal, self, other)

    def __gt__(self, other: Any) -> Array:
        return build.apply_ufunc(np.greater, self, other)

    def __ge__(self, other: Any) -> Array:
        return build.apply_ufunc(np.greater_equal, self, other)

    def __eq__(self, other: Any) -> Array:  # type: ignore[override]
        return build.apply_ufunc(np.equal, self, other)

    def __ne__(self, other: Any) -> Array:  # type: ignore[override]
        return build.apply_ufunc(np.not_equal, self, other)

    def __neg__(self) -> Array:
        return build.apply_ufunc(np.negative, self)

    def __pos__(self) -> Array:
        return build.apply_ufunc(np.positive, self)

    def __abs__(self) -> Array:
        return build.apply_ufunc(np.absolute, self)

    def __invert__(self) -> Array:
        return build.apply_ufunc(np.invert, self)

    def __round__(self, ndigits: int | None = None) -> Array:
        return self.round(ndigits or 0)

    def __matmul__(self, other: Any) -> Array:
        return dispatch.call_method("matmul", self, other)

    def __rmatmul__(self, other: Any) -> Array:
        return dispatch.call_method("matmul", other, self)

    def astype(
        self,
        dtype: Any,
        order: str = "K",
        casting: str = "unsafe",
        subok: bool = True,
        copy: bool = True,
    ) -> Array:
        """Cast to ``dtype``, as ``ndarray.astype``: ``casting`` checked as NumPy does
        (TypeError for a cast it does not allow); ``order`` and ``copy`` change nothing
        (a lazy array is computed in C order, and never changes, so it is never
        shared with another)."""
        dt = np.dtype(dtype)
        if order not in ("K", "A", "C", "F"):
            raise ValueError(f"order must be one of 'C', 'F', 'A', or 'K' (got {order!r})")
        if not np.can_cast(self.dtype, dt, casting=casting):  # type: ignore[arg-type]
            raise TypeError(
                f"Cannot cast array data from {self.dtype!r} to {dt!r} according to the "
                f"rule {casting!r}"
            )
        if dt == self.dtype:
            return self
        return build.elementwise(ElemOp("astype", dtype=dt), self)

    def round(self, decimals: int = 0) -> Array:
        """``np.round(x, decimals)``."""
        return build.elementwise(ElemOp("round", decimals=operator.index(decimals)), self)

    def clip(self, min: Any = None, max: Any = None) -> Array:
        """``np.clip(x, min, max)``; either bound may be None (both: ``x``, as NumPy 2.1
        on gives; older NumPy raises its ValueError)."""
        if min is None and max is None:
            np.clip(np.zeros(1, self.dtype), None, None)  # NumPy's answer on this NumPy
            return self
        bounds = [b for b in (min, max) if b is not None]
        op = ElemOp("clip", has_lo=min is not None, has_hi=max is not None)
        return build.elementwise(op, self, *bounds)

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None:
            raise TypeError(
                f"np.{ufunc.__name__}(..., out=...) is not supported on lazy arrays: results "
                "are placed by tierflow; assign the returned array instead"
            )
        kwargs.pop("out", None)
        if method == "__call__":
            if ufunc is np.matmul:
                return dispatch.call_method("matmul", *inputs)
            if ufunc.signature is not None:
                raise TypeError(
                    f"np.{ufunc.__name__} is a generalized ufunc with signature "
                    f"{ufunc.signature}; lazy arrays take elementwise ufuncs and np.matmul: "
                    "use map_blocks for a row-wise call, or compute() first"
                )
            if ufunc.nout == 1:
                return build.apply_ufunc(ufunc, *inputs, **kwargs)
            return dispatch.call_method("outputs", ufunc, inputs, kwargs)
        reduce = dispatch.reduction(ufunc) if method == "reduce" else None
        if reduce is not None and len(inputs) == 1:
            return reduce(ufunc, inputs[0], **kwargs)
        raise TypeError(
            f"np.{ufunc.__name__}.{method} is not supported on lazy arrays; use map_blocks, "
            "or compute() first"
        )

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return dispatch.handler(func)(*args, **kwargs)

    # -- reductions -------------------------------------------------------------------

    def _reduce(  # noqa: PLR0913 -- NumPy's reduction keywords
        self,
        kind: str,
        axis: Any = None,
        keepdims: bool = False,
        dtype: Any = None,
        ddof: float = 0,
        initial: Any = np._NoValue,
    ) -> Array:
        node = self._node
        build.check_meta(node)
        if isinstance(node, Value):
            kwargs: dict[str, Any] = {"axis": axis, "keepdims": keepdims}
            if dtype is not None:
                kwargs["dtype"] = dtype
            if ddof:
                kwargs["ddof"] = ddof
            if initial is not np._NoValue:
                kwargs["initial"] = initial
            return build.value_apply(_reduce_value(kind), node, name=kind, **kwargs)
        assert isinstance(node, Chunked)
        options = specs.ReduceOptions(kind, axis, keepdims, dtype, ddof, initial)
        op = options.build(node.dtype, node.row_shape)
        if isinstance(op, red.RowwiseReduction):
            return build.wrap(graph.BlockMap(specs.RowwiseSpec(options), (node,)))
        spec = specs.KindSpec(options)
        reduce = graph.Reduce(spec, (node,))
        if spec.needs_offset and node.n_rows is None:
            # Each block's first row is known once the rows are counted.
            args = (kind, axis, keepdims, dtype, ddof)
            meta = (reduce.dtype, reduce.shape)
            return build.defer_method(node, "_reduce", args, meta, spec.label(), rows=False)
        return build.wrap(reduce)

    def sum(
        self,
        axis: Any = None,
        dtype: Any = None,
        keepdims: bool = False,
        *,
        initial: Any = np._NoValue,
    ) -> Array:
        """Sum over ``axis`` (None: all), from ``initial``. Float data accumulates in
        float64."""
        return self._reduce("sum", axis, keepdims, dtype, initial=initial)

    def prod(
        self,
        axis: Any = None,
        dtype: Any = None,
        keepdims: bool = False,
        *,
        initial: Any = np._NoValue,
    ) -> Array:
        """Product over ``axis``, from ``initial``."""
        return self._reduce("prod", axis, keepdims, dtype, initial=initial)

    def mean(self, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> Array:
        """Mean over ``axis``."""
        return self._reduce("mean", axis, keepdims, dtype)

    def var(
        self, axis: Any = None, dtype: Any = None, ddof: float = 0, keepdims: bool = False
    ) -> Array:
        """Variance over ``axis`` (one pass, Chan's merge of per-block moments)."""
        return self._reduce("var", axis, keepdims, dtype, ddof)

    def std(
        self, axis: Any = None, dtype: Any = None, ddof: float = 0, keepdims: bool = False
    ) -> Array:
        """Standard deviation over ``axis``."""
        return self._reduce("std", axis, keepdims, dtype, ddof)

    def min(self, axis: Any = None, keepdims: bool = False, *, initial: Any = np._NoValue) -> Array:
        """Minimum over ``axis``; ``initial`` is the largest value it can be (and the
        result over no rows)."""
        return self._reduce("min", axis, keepdims, initial=initial)

    def max(self, axis: Any = None, keepdims: bool = False, *, initial: Any = np._NoValue) -> Array:
        """Maximum over ``axis``; ``initial`` is the smallest value it can be (and the
        result over no rows)."""
        return self._reduce("max", axis, keepdims, initial=initial)

    def any(self, axis: Any = None, keepdims: bool = False) -> Array:
        """Whether any element is true, over ``axis``."""
        return self._reduce("any", axis, keepdims)

    def all(self, axis: Any = None, keepdims: bool = False) -> Array:
        """Whether every element is true, over ``axis``."""
        return self._reduce("all", axis, keepdims)

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> Array:
        """Index of the minimum (first one; NaN first), over ``axis`` or flattened."""
        return self._reduce("argmin", axis, keepdims)

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Array:
        """Index of the maximum (first one; NaN first), over ``axis`` or flattened."""
        return self._reduce("argmax", axis, keepdims)

    def count_nonzero(self, axis: Any = None, keepdims: bool = False) -> Array:
        """Number of non-zero elements over ``axis``."""
        return self._reduce("count_nonzero", axis, keepdims)

    def histogram(
        self,
        bins: Any = 10,
        range: tuple[float, float] | None = None,
        density: bool = False,
    ) -> tuple[Array, np.ndarray]:
        """``np.histogram`` of all values: ``(lazy counts, bin edges)``.

        With a number of ``bins``, ``range=(lo, hi)`` is required (the data's range is
        unknown until every block is read); or give the bin edges.
        """
        node = self._node
        if isinstance(node, Value):
            edges = np.histogram_bin_edges(np.empty(0, node.dtype), bins=bins, range=range)
            counts = build.value_apply(
                lambda v: np.histogram(v, bins=bins, range=range, density=density)[0],
                node,
                name="histogram",
            )
            return counts, edges
        spec = specs.HistogramSpec(bins, range, density)
        result = graph.Reduce(spec, (node,))  # type: ignore[arg-type]
        edges = red.Histogram(node.dtype, bins, range, density=density).edges.copy()
        return build.wrap(result), edges

    def reduction(  # noqa: PLR0913 -- public: a custom reduction's parts, as dask.array.reduction names them
        self,
        chunk: Callable[..., Any],
        combine: Callable[[Any, Any], Any],
        aggregate: Callable[[Any], Any] | None = None,
        *,
        dtype: Any = None,
        shape: tuple[int, ...] | None = None,
        with_offset: bool = False,
        commutative: bool = True,
        partial_bytes: int = 1024,
        name: str | None = None,
    ) -> Array:
        """A user reduction over the rows: ``chunk(block)`` gives a partial,
        ``combine(a, b)`` merges two (associative; must not modify them),
        ``aggregate(p)`` finishes (the partial itself when omitted).

        ``chunk`` sees every block, also one a mask left without rows; over an array
        without any row, the result is ``aggregate(chunk(empty block))``.
        ``with_offset=True`` passes each block's first row as ``chunk(block, offset)``;
        ``commutative=False`` merges only neighbouring blocks, left before right.
        ``dtype`` and ``shape`` describe the result so it can be used in further
        operations; ``partial_bytes`` is the size of one partial, for the memory plan.
        """
        node = self._node
        if not isinstance(node, Chunked):
            raise TypeError("x.reduction() reduces the rows of a chunked array")
        options = red.ReductionOptions(
            with_offset=with_offset, commutative=commutative, out_dtype=dtype,
            out_shape=None if shape is None else tuple(shape), partial_bytes=partial_bytes,
            name=name,
        )  # fmt: skip
        reduce = graph.Reduce(specs.UserSpec(chunk, combine, aggregate, options), (node,))
        if with_offset and node.n_rows is None:
            # Each block's first row is known once the rows are counted.
            kwargs = {
                "dtype": dtype, "shape": shape, "with_offset": True,
                "commutative": commutative, "partial_bytes": partial_bytes, "name": name,
            }  # fmt: skip
            meta = (reduce.dtype, reduce.shape)
            out = build.defer_method(
                node, "reduction", (chunk, combine, aggregate), meta, reduce.label(), False, kwargs
            )
            out._node.meta_known = reduce.meta_known  # type: ignore[attr-defined]
            return out
        return build.wrap(reduce)

    # -- blockwise --------------------------------------------------------------------

    def map_overlap(  # noqa: PLR0913 -- dask's signature
        self,
        fn: Callable[..., Any],
        *others: Any,
        depth: Any,
        boundary: Any = None,
        trim: bool = True,
        dtype: Any = None,
        row_shape: tuple[int, ...] | None = None,
        **kwargs: Any,
    ) -> Array:
        """``fn(block, *other_blocks, **kwargs)`` on every row block with ``depth`` rows
        of its neighbours above and below it (the halo), the halo trimmed from the
        result: rolling windows, filters, differences along the rows. Lazy; dask's
        ``map_overlap`` along axis 0.

        ``depth``: rows on each side, a pair ``(before, after)``, or ``{0: rows}``
        (trailing axes are whole in every block already). ``boundary``: what ``fn``
        sees past the first and the last row: ``"none"`` (the default: fewer rows there),
        ``"reflect"`` (mirrored, the edge row included), ``"nearest"`` (the edge row
        repeated), ``"periodic"`` (the other end's rows) or a number. ``fn`` must return
        one row per row it is given (halo and padding included); ``dtype`` and
        ``row_shape`` default to those of ``fn`` on a probe block of zeros (called now;
        give both to skip it). ``others``: arrays with the same rows, given the same
        halo. Each block's rows are read once, the halo rows by two tasks; an
        out-of-memory error halves the block, each half with its own halo. On the CPU
        (NumPy blocks); ``trim=False`` is refused.

        >>> import tierflow as tw
        >>> x = tw.from_array(np.arange(10.0), rows=4)
        >>> x.map_overlap(lambda b: np.convolve(b, np.ones(3), "same"), depth=1).compute()
        array([ 1.,  3.,  6.,  9., 12., 15., 18., 21., 24., 17.])
        """
        return dispatch.call_method(
            "map_overlap",
            self,
            fn,
            *others,
            depth=depth,
            boundary=boundary,
            trim=trim,
            dtype=dtype,
            row_shape=row_shape,
            **kwargs,
        )

    def map_blocks(
        self,
        fn: Callable[..., Any],
        *others: Any,
        dtype: Any = None,
        row_shape: tuple[int, ...] | None = None,
        device: str = "cpu",
        **kwargs: Any,
    ) -> Array:
        """``fn(block, *other_blocks, **kwargs)`` on every row block.

        ``fn`` must treat rows independently and return one row per input row: blocks
        may be split (in halves, after an out-of-memory error) or merged differently
        from run to run. ``others`` are arrays with the same rows, passed as blocks too.
        ``device="cpu"`` gives ``fn`` NumPy blocks; ``"cuda"``/``"cuda:N"`` gives torch
        tensors on that GPU (without torch: :class:`~tierflow.errors.DependencyError`
        naming the extra). ``"auto"`` gives torch tensors on the GPU with the most free
        memory, or on the CPU without one; where torch is not installed it runs on the
        CPU and gives NumPy blocks, as ``"cpu"`` does (a function written for ``"auto"``
        should accept both, e.g. by using only operators they share). ``dtype`` and
        ``row_shape`` of the result default to those of ``fn`` on a probe block of two
        zero rows (called now; give both to skip it). A result with the wrong number of
        rows, row shape or a dtype that does not cast raises
        :class:`~tierflow.errors.BlockError` naming the block.
        """
        if not callable(fn):
            raise TypeError(f"map_blocks needs a function, got {type(fn).__name__}")
        node = self._node
        arrays = [self, *(from_array(o) for o in others)]
        nodes = [a._node for a in arrays]
        counted = False  # rows that line up only once counted
        for extra in nodes[1:]:
            if not isinstance(extra, Chunked) or not isinstance(node, Chunked):
                raise TypeError(
                    "map_blocks: extra arrays must be chunked arrays with the same rows"
                )
            if None not in (extra.n_rows, node.n_rows) and extra.n_rows != node.n_rows:
                raise ValueError(
                    f"map_blocks: the arrays have different rows: {build.describe_shape(node.shape)} "
                    f"and {build.describe_shape(extra.shape)}"
                )
            if extra.n_rows != node.n_rows or (node.n_rows is None and extra.origin != node.origin):
                counted = True
        resolved = _device(device)
        if isinstance(node, Value):
            if others:
                raise TypeError("map_blocks on an in-memory result takes no extra arrays")
            return build.value_apply(fn, node, name=getattr(fn, "__name__", "map_blocks"), **kwargs)
        if dtype is None or row_shape is None:
            probe_dtype, probe_shape = _probe(fn, nodes, resolved, kwargs)
            dtype = probe_dtype if dtype is None else dtype
            row_shape = probe_shape if row_shape is None else row_shape
        if counted:
            options = {"dtype": dtype, "row_shape": row_shape, "device": device, **kwargs}
            meta = (np.dtype(dtype), tuple(row_shape))
            what = f"map_blocks({getattr(fn, '__qualname__', 'fn')})"
            return build.defer_method(
                node, "map_blocks", (fn, *nodes[1:]), meta, what, True, options
            )
        spec = specs.MapSpec(fn, np.dtype(dtype), tuple(row_shape), resolved, kwargs)
        return build.wrap(graph.BlockMap(spec, tuple(nodes)))  # type: ignore[arg-type]

    def filter(self, fn: Callable[[np.ndarray], Any]) -> Array:
        """The rows for which ``fn(block)`` (one boolean per row) is True.

        The row count is unknown until computed."""
        node = self._node
        if not isinstance(node, Chunked):
            raise TypeError("filter selects rows of a chunked array")
        return _filtered(graph.Filter(node, None, fn))

    def head(self, n: int = 5) -> Array:
        """The first ``n`` rows (lazy). Only the blocks that hold them are computed."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"head needs n >= 0, got {n}")
        node = self._node
        if isinstance(node, Chunked) and node.n_rows is None:
            return build.wrap(graph.Reduce(specs.HeadSpec(n), (node,)))
        return self[:n]

    def along(self, name: str, axis: int | None, **kwargs: Any) -> Array:
        """``np.<name>(x, axis=axis, **kwargs)`` for ``name`` in ``sort``, ``argsort``,
        ``cumsum``, ``cumprod``, ``nancumsum``, ``nancumprod``, ``diff``, along a trailing
        axis: lazy, one block at a time (also as ``np.sort(x, axis=1)`` and so on).

        ``sort`` and ``argsort`` along the rows (axis 0, or None for a 1-D array) are an
        external merge sort (:mod:`tierflow.engine.rowwide.external_sort`); the
        cum-functions along the rows (axis 0, or None for a 1-D array) two passes of
        block totals, then each block from the ones before it
        (:mod:`tierflow.engine.rowwide.scans`). ``diff`` along axis 0 raises ValueError.
        ``out=`` is not supported."""
        function = block_operators.ALONG_AXIS.get(name)
        if function is None:
            raise ValueError(
                f"along() runs one of {', '.join(block_operators.ALONG_AXIS)}, not {name!r}"
            )
        if kwargs.get("out") is not None:
            raise TypeError(f"np.{name}(..., out=...) is not supported on lazy arrays")
        # Defaults spelled out (x.cumsum(axis=1) passes dtype=None) key like left out.
        kwargs = {k: v for k, v in kwargs.items() if k != "out" and (v is not None or k in _VALUED)}
        node = self._node
        if isinstance(node, Value):
            return build.value_apply(function, node, name=name, axis=axis, **kwargs)
        assert isinstance(node, Chunked)
        if axis is None and name != "diff" and self.ndim == 1:
            axis = 0  # the flattened array is the array
        if axis is None:
            raise ValueError(
                f"np.{name}(x, axis=None) works on the flattened array, which runs along the "
                "rows; give a trailing axis (axis=1 or -1), or compute() first"
            )
        k = operator.index(axis)
        if not -self.ndim <= k < self.ndim:
            raise np.exceptions.AxisError(k, self.ndim)
        k %= self.ndim
        if k == 0 and name in ("sort", "argsort"):
            return dispatch.call_method("sort_rows", node, name, kwargs)
        if k == 0 and name != "diff":
            return dispatch.call_method("scan_rows", node, name, kwargs)
        if k == 0:
            raise ValueError(
                f"np.{name} along axis 0 needs every row at once, and a lazy array is cut "
                "into row blocks; give a trailing axis, or compute() first"
            )
        if name == "diff":
            joined = _diff_joined(self, k, kwargs)
            if joined is not None:
                return joined
        return build.wrap(graph.BlockMap(specs.AlongAxisSpec(name, k, kwargs), (node,)))

    def cumsum(self, axis: int | None = None, dtype: Any = None, out: Any = None) -> Array:
        """``np.cumsum`` along a trailing axis (see :meth:`along`)."""
        return self.along("cumsum", axis, dtype=dtype, out=out)

    def cumprod(self, axis: int | None = None, dtype: Any = None, out: Any = None) -> Array:
        """``np.cumprod`` along a trailing axis (see :meth:`along`)."""
        return self.along("cumprod", axis, dtype=dtype, out=out)

    def argsort(self, axis: int = -1, kind: str | None = None, order: Any = None) -> Array:
        """``np.argsort`` along a trailing axis (see :meth:`along`)."""
        return self.along("argsort", axis, kind=kind, order=order)

    def reshape(self, *shape: Any) -> Array:
        """A new shape that keeps the rows: ``x.reshape(n, 2, 4)`` or ``x.reshape(-1, 8)``
        for an array of ``n`` rows of 8."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        dims = [operator.index(d) for d in shape]
        node = self._node
        if isinstance(node, Value):
            return build.value_apply(np.reshape, node, dims, name="reshape")
        assert isinstance(node, Chunked)
        if node.n_rows is not None:
            reshaped = build.shape_only(node).reshape(dims)  # NumPy's errors: sizes, -1s
            if reshaped.size == 0:
                # No values: NumPy's empty array of the new shape, whatever its rows.
                return from_array(np.empty(reshaped.shape, node.dtype))
        elif sum(d < 0 for d in dims) > 1:
            raise ValueError("can only specify one unknown dimension")
        if not dims:
            raise ValueError("reshape must keep the row axis")
        row_size = math.prod(node.row_shape)
        trailing = dims[1:]
        if -1 in trailing:
            known = math.prod(d for d in trailing if d != -1)
            if trailing.count(-1) > 1 or known == 0 or row_size % known:
                raise ValueError(
                    f"cannot reshape rows of shape {node.row_shape} into {tuple(trailing)}"
                )
            trailing = [row_size // known if d == -1 else d for d in trailing]
        if node.n_rows is None and dims[0] >= 0 and math.prod(trailing) == row_size:
            meta = (node.dtype, tuple(trailing))
            return build.defer_method(node, "reshape", tuple(dims), meta, "reshape")
        if dims[0] not in (-1, node.n_rows) or math.prod(trailing) != row_size:
            raise ValueError(
                f"cannot reshape an array of shape {build.describe_shape(node.shape)} into "
                f"{tuple(dims)}: a lazy array keeps its rows, so the first axis must be "
                f"{node.n_rows} (or -1) and the rest must hold {row_size} elements"
            )
        if tuple(trailing) == node.row_shape:
            return self
        return build.wrap(graph.BlockMap(specs.ReshapeSpec(tuple(trailing)), (node,)))

    # -- selection --------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Array:
        node = self._node
        if isinstance(node, Value):
            # A lazy index (u[u > 2]) is an operand, computed with the value.
            parts = tuple(
                build.node_of(k) if isinstance(k, Array) else k for k in build.index_items(key)
            )
            return build.value_apply(operator.getitem, node, _key(key, parts), name="getitem")
        assert isinstance(node, Chunked)
        items = key if isinstance(key, tuple) else (key,)
        if items and isinstance(items[0], Array):
            return self._mask(items[0], items[1:])
        if any(isinstance(k, Array) for k in items):
            raise IndexError(
                "a lazy array can only index the rows (the first axis), as a boolean mask"
            )
        rows, trailing = selection.split_index(key, self.ndim)
        if isinstance(rows, (np.ndarray, list)) and np.asarray(rows).dtype == bool:
            mask = np.asarray(rows)
            return self._mask(from_array(mask), trailing)
        if isinstance(rows, (np.ndarray, list, tuple)):  # split_index refused pairing
            out = self._take(rows)
            columns = (slice(None), *trailing)
            return out[columns] if trailing else out
        if isinstance(rows, slice):
            out = self._rows(rows)
        else:
            index = operator.index(rows)
            if node.n_rows is None:
                meta = (node.dtype, node.row_shape)
                value = build.defer_method(
                    node, "__getitem__", (index,), meta, f"row {index}", False
                )
                return value[trailing] if trailing else value
            selection.locate_row(index, node.block_pairs())
            if index < 0:
                index += node.n_rows
            row = graph.Reduce(
                specs.CollectSpec(), (graph.RowSlice(node, slice(index, index + 1)),)
            )
            value = build.value_apply(operator.getitem, row, 0, name=f"row {index}")
            return value[trailing] if trailing else value
        return out._trailing(trailing) if trailing else out

    def _take(self, rows: Any) -> Array:
        """``x[rows]`` for an integer array of row positions (see :class:`graph.RowTake`).

        Sorted positions (repeats allowed) stay lazy, block by block. Other orders stay
        lazy where the picks can be moved down to the sources (see
        :func:`tierflow.engine.graph.rewrites.take_below`); otherwise the rows are gathered in row order the same way
        and then put in the order asked for in memory: the result is an in-memory
        value, like a reduction's."""
        node = self._node
        assert isinstance(node, Chunked)
        index = np.asarray(rows)
        if index.size == 0 and index.dtype.kind == "f":
            index = index.astype(np.intp)  # x[[]], as in NumPy
        if index.dtype.kind not in "iu":
            raise IndexError("arrays used as indices must be of integer (or boolean) type")
        if index.ndim != 1:
            raise IndexError(
                f"an integer array on the rows must be 1-D, not of shape {index.shape}; "
                "index with its flattened form and reshape the result"
            )
        n = node.n_rows
        if n is None:
            # Sorted positions from the start stay rows; others come back in memory.
            rows_kept = index.size == 0 or (
                int(index.min()) >= 0 and bool(np.all(index[1:] >= index[:-1]))
            )
            meta = (node.dtype, node.row_shape if rows_kept else (len(index), *node.row_shape))
            what = f"rows[{len(index):,} picked]"
            return build.defer_method(node, "_take", (index.copy(),), meta, what, rows_kept)
        if index.size and (int(index.min()) < -n or int(index.max()) >= n):
            first = index[(index < -n) | (index >= n)][0]
            raise IndexError(f"index {int(first)} is out of bounds for axis 0 with size {n}")
        # One copy (a permutation of a big file's rows is big itself), in 4 bytes a
        # position where the rows allow: the graph keeps its own positions, safe from
        # changes to the caller's array.
        small = n <= np.iinfo(np.int32).max
        positions = index.astype(np.int32 if small else np.int64, copy=True)
        negative = positions < 0
        if negative.any():
            positions[negative] += n
        del negative
        if len(positions) < 2 or bool(np.all(positions[1:] >= positions[:-1])):
            return build.wrap(graph.RowTake(node, positions))
        # Blocks of the default size for the output's rows: the source's mapping is
        # released once a block, whatever the picks touched.
        row_bytes = max(1, np.dtype(node.dtype).itemsize * math.prod(node.row_shape))
        below = rewrites.take_below(
            node, positions, blocksize.default_rows(row_bytes, len(positions)), {}
        )
        if below is not None:
            return build.wrap(below)
        order = np.argsort(positions, kind="stable")
        picked = graph.RowTake(node, positions[order])
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return build.value_apply(
            np.take, picked, back, axis=0, name=f"rows in order {picked.label()}"
        )

    def _trailing(self, trailing: tuple[Any, ...]) -> Array:
        node = self._node
        assert isinstance(node, Chunked)
        return build.wrap(graph.BlockMap(specs.IndexSpec(trailing), (node,)))

    def _rows(self, key: slice) -> Array:
        node = self._node
        assert isinstance(node, Chunked)
        if key == slice(None):
            return self
        if key.step is not None and operator.index(key.step) == 0:
            raise ValueError("slice step cannot be zero")
        if node.n_rows is None:
            parts = (key.start, key.stop) if key.step is None else (key.start, key.stop, key.step)
            what = "rows[" + ":".join("" if p is None else str(p) for p in parts) + "]"
            return build.defer_method(node, "_rows", (key,), (node.dtype, node.row_shape), what)
        if key.indices(node.n_rows) == (0, node.n_rows, 1):
            return self
        return build.wrap(graph.RowSlice(node, key))

    def _mask(self, mask: Array, trailing: tuple[Any, ...]) -> Array:
        node = self._node
        mnode = mask._node
        assert isinstance(node, Chunked)
        if mask.dtype != bool:
            raise IndexError("arrays used as indices must be of integer (or boolean) type")
        if not isinstance(mnode, Chunked):
            raise IndexError(
                f"the mask is an in-memory result of shape {build.describe_shape(mnode.shape)} "
                "(a reduction's), not an array with these rows; compute() it first"
            )
        if mnode.ndim > node.ndim or tuple(node.shape[1 : mnode.ndim]) != mnode.row_shape:
            raise IndexError(
                f"boolean index of shape {build.describe_shape(mnode.shape)} does not match the "
                f"array of shape {build.describe_shape(node.shape)}: it must have the array's "
                "leading shape"
            )
        if trailing and mnode.ndim > 1:
            raise IndexError("a boolean mask over several axes cannot be followed by more indices")
        if node.n_rows is not None and mnode.n_rows is not None and mnode.n_rows != node.n_rows:
            raise IndexError(
                f"boolean index did not match indexed array along axis 0; size of axis is "
                f"{node.n_rows} but size of corresponding boolean axis is {mnode.n_rows}"
            )
        if (mnode.n_rows is None) != (node.n_rows is None) or (
            node.n_rows is None and mnode.origin != node.origin
        ):
            # The rows line up (or NumPy's IndexError is raised) once counted.
            meta = (node.dtype, tuple(node.shape[max(1, mnode.ndim) :]))
            out = build.defer_method(node, "_mask", (mnode, ()), meta, "mask")
            return out._trailing(trailing) if trailing else out
        out = _filtered(graph.Filter(node, mnode))
        return out._trailing(trailing) if trailing else out

    # -- the ndarray methods a NumPy user reaches for (see ndarray_methods) ------------

    def copy(self, order: str = "C") -> Array:
        """A new handle on the same lazy graph (a lazy array never changes)."""
        return dispatch.call_method("copy", self, order)

    def tolist(self) -> Any:
        """Computed now, as nested Python lists; refused above the RAM budget."""
        return dispatch.call_method("tolist", self)

    def item(self, *args: Any) -> Any:
        """One element as a Python scalar, computed now."""
        return dispatch.call_method("item", self, *args)

    def rechunk(self, rows: Any = "auto") -> Array:
        """The same rows in new blocks (lazy): ``rows`` rows each, ``"auto"``, or dask's
        chunks, one entry per axis with the trailing axes whole: ``(r, -1)``,
        ``((r1, r2, ...), (k,))`` for each block's rows, ``{0: r}``. A flat sequence of
        another length than the axes gives each block's rows (``(3, 3, 4)`` of a 1-D
        array, as dask)."""
        return dispatch.call_method("rechunk", self, rows)

    @property
    def real(self) -> Array:
        """The real part (lazy)."""
        return dispatch.call_method("real", self)

    @property
    def imag(self) -> Array:
        """The imaginary part (lazy; zeros for real data)."""
        return dispatch.call_method("imag", self)

    @property
    def device(self) -> str:
        """``"cpu"``: lazy arrays compute into host memory."""
        return "cpu"

    def to_device(self, device: Any, stream: Any = None) -> Array:
        """``self`` for ``"cpu"``; GPUs go through ``persist(device=...)``."""
        return dispatch.call_method("to_device", self, device, stream)

    def conj(self) -> Array:
        """The complex conjugate (lazy); ``self`` for real data, as ``ndarray.conj``
        (``np.conjugate`` would turn booleans into int8)."""
        return build.apply_ufunc(np.conjugate, self) if self.dtype.kind == "c" else self

    conjugate = conj

    def dot(self, other: Any) -> Array:
        """``self @ other``."""
        return dispatch.call_method("dot", self, other)

    def take(self, indices: Any, axis: Any = None) -> Array:
        """Rows picked (axis 0) or a trailing axis picked on each block (lazy)."""
        return dispatch.call_method("take", self, indices, axis)

    def compress(self, condition: Any, axis: Any = None) -> Array:
        """Rows kept where ``condition`` is true (axis 0), or along a trailing axis."""
        return dispatch.call_method("compress", self, condition, axis)

    def repeat(self, repeats: Any, axis: Any = None) -> Array:
        """``np.repeat`` along a trailing axis (lazy)."""
        return dispatch.call_method("repeat", self, repeats, axis)

    def swapaxes(self, axis1: Any, axis2: Any) -> Array:
        """Two trailing axes swapped (lazy)."""
        return dispatch.call_method("swapaxes", self, axis1, axis2)

    def diagonal(self, offset: int = 0, axis1: int = 0, axis2: int = 1) -> Array:
        """Diagonals over two trailing axes, row by row (lazy)."""
        return dispatch.call_method("diagonal", self, offset, axis1, axis2)

    def trace(
        self, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype: Any = None, out: Any = None
    ) -> Array:
        """Traces over two trailing axes, row by row (lazy)."""
        return dispatch.call_method("trace", self, offset, axis1, axis2, dtype, out)

    def squeeze(self, axis: Any = None) -> Array:
        """Axes of length one dropped (lazy)."""
        return dispatch.call_method("squeeze", self, axis)

    def ravel(self, order: str = "C") -> Array:
        """``self`` when 1-D; refused otherwise (it would change the rows)."""
        return dispatch.call_method("ravel", self, order)

    def view(self, dtype: Any) -> Array:
        """Each block viewed as ``dtype`` (lazy)."""
        return dispatch.call_method("view", self, dtype)

    # -- display ----------------------------------------------------------------------

    def _pending(self) -> list[str]:
        return [n.label() for n in graph.walk([self._node]) if n.inputs]

    def _sources(self) -> list[str]:
        return [n.label() for n in graph.walk([self._node]) if isinstance(n, graph.Source)]

    def _summary(self) -> list[tuple[str, str]]:
        node = self._node
        rows: list[tuple[str, str]] = []
        rows.append(("shape", build.describe_shape(self.shape)))
        rows.append(("dtype", str(self.dtype) if self.dtype is not None else "unknown"))
        nbytes = self.nbytes
        rows.append(
            ("size", format_bytes(nbytes, 2) if nbytes is not None else "unknown until computed")
        )
        if isinstance(node, Chunked):
            if node.bounds is not None:
                pairs = node.block_pairs()
                sizes = sorted({b - a for a, b in pairs}, reverse=True)
                text = f"{len(pairs)} of {sizes[0]} rows" if pairs else "none"
                last = pairs[-1][1] - pairs[-1][0] if pairs else 0
                if len(sizes) == 2 and {b - a for a, b in pairs[:-1]} == {sizes[0]}:
                    text += f" (last {last})"
                elif len(sizes) > 1:
                    text = f"{len(pairs)} of {sizes[-1]} to {sizes[0]} rows"
                rows.append(("blocks", text))
            else:
                rows.append(("blocks", f"{node.nblocks}, rows known once computed"))
        else:
            rows.append(("blocks", "in memory once computed"))
        sources = self._sources()
        rows.append(
            (
                "sources",
                ", ".join(sources[:4])
                + (f" and {len(sources) - 4} more" if len(sources) > 4 else "")
                or "none",
            )
        )
        pending = self._pending()
        shown = " -> ".join(pending[-8:])
        if len(pending) > 8:
            shown = f"({len(pending) - 8} more) -> " + shown
        rows.append(("pending", f"{len(pending)}: {shown}" if pending else "none"))
        return rows

    def __repr__(self) -> str:
        lines = [f"tierflow.Array key={self.key[:12]}"]
        lines += [f"  {name:<8} {text}" for name, text in self._summary()]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(name)}</th><td style='text-align:left'>{html.escape(text)}</td></tr>"
            for name, text in self._summary()
        )
        return (
            f"<table><caption>tierflow.Array <code>{self.key[:12]}</code></caption>"
            f"<tbody>{body}</tbody></table>"
        )


def _device(device: str) -> str | None:
    """What ``map_blocks(device=...)`` hands its function: None for NumPy blocks
    (``"cpu"``, and ``"auto"`` without torch), ``"auto"`` for torch tensors on the device
    chosen at the first block, ``"cuda:N"`` for tensors on that GPU. Only a GPU asked
    by name needs torch: :class:`~tierflow.errors.DependencyError` without it,
    ValueError for a GPU that is not here."""
    text = str(device)
    if text == "cpu":
        return None
    if text == "auto":
        return "auto" if block_operators.has_torch() else None
    if text == "cuda" or text.startswith("cuda:"):
        if not block_operators.has_torch():
            from ...errors import missing_dependency

            raise missing_dependency("torch", "torch", f"map_blocks(device={device!r})")
        found = devices.gpus()
        index = 0 if text == "cuda" else int(text.split(":", 1)[1])
        if not any(d.index == index for d in found):
            have = ", ".join(d.id for d in found) or "none"
            raise ValueError(
                f"map_blocks(device={device!r}): no such GPU (GPUs here: {have}); use "
                "device='auto' to run on the CPU when there is no GPU"
            )
        # "cuda" stays open: the scheduler seats each task on the roomiest GPU.
        return "cuda" if text == "cuda" else f"cuda:{index}"
    raise ValueError(f"device={device!r}: use 'cpu', 'auto', 'cuda' or 'cuda:N'")


def _probe(
    fn: Callable[..., Any], nodes: Sequence[Node], device: str | None, kwargs: dict[str, Any]
) -> tuple[np.dtype, tuple[int, ...]]:
    from ..graph.block_operators import numpy_dtype, to_device, to_host

    blocks: list[Any] = [np.zeros((2, *(int(d or 0) for d in n.shape[1:])), n.dtype) for n in nodes]
    if device is not None:
        where = "cpu" if device == "auto" else device
        blocks = [to_device(b, where) for b in blocks]
    name = getattr(fn, "__qualname__", type(fn).__name__)
    try:
        result = fn(*blocks, **kwargs)
    except Exception as exc:
        raise type(exc)(
            f"map_blocks({name}) failed on its probe block of two zero rows (called to "
            f"learn the result's dtype and row shape; give dtype= and row_shape= to skip "
            f"it): {exc}"
        ) from exc
    dtype = numpy_dtype(result)
    shape = tuple(np.shape(to_host(result)))
    if not shape or shape[0] != 2:
        got = "a scalar" if not shape else f"shape {shape}"
        raise ValueError(
            f"map_blocks({name}) returned {got} for a probe block of shape "
            f"{tuple(np.shape(to_host(blocks[0])))}; it must return one row per input row"
        )
    return dtype, shape[1:]


build.register_array(Array)

for _name in dispatch.REFUSED:
    if _name not in Array.__dict__:  # a method Array defines itself wins
        setattr(Array, _name, dispatch.refused_attribute(_name))
