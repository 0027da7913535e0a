"""The ndarray methods and attributes a NumPy user reaches for on a lazy array.

Three kinds (``Array`` methods in :mod:`tierflow.engine.api.array` reach the first two
through the registry, :data:`tierflow.engine.api.dispatch.METHODS`):

* lazy, row by row: ``copy``, ``rechunk``, ``conj``/``conjugate``, ``real``, ``imag``,
  ``dot``, ``take``/``compress``/``repeat``/``swapaxes``/``diagonal``/``trace`` along
  trailing axes, ``squeeze``, ``view`` to a dtype that divides a row, ``ravel`` and
  ``flatten`` of a 1-D array;
* computed now, as NumPy's: ``tolist`` (refused when the list would not fit the RAM
  budget), ``item``;
* refused with what to do instead (:data:`tierflow.engine.api.dispatch.REFUSED`): methods that change an array in
  place (``sort``, ``fill``, ``resize``, ``put``...), that need every row at once
  (``nonzero``, ``searchsorted``...) or the array's memory (``data``, ``strides``,
  ``flags``...). ``Array`` gets one raising method or property per name, so a name
  that NumPy has gives its guidance, and any other name a plain AttributeError.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import format_bytes
from ...storage import identity
from .. import graph
from ..graph import Chunked, Value, blocksize
from . import build, dispatch
from .blockwise import on_blocks

if TYPE_CHECKING:
    from .array import Array

__all__ = [
    "LIST_BYTES_PER_ELEMENT",
    "Rechunk",
    "rechunk",
    "tolist",
]

LIST_BYTES_PER_ELEMENT = 32  # a list slot (8) and a Python float or int (24)


# -- lazy -------------------------------------------------------------------------------


@dispatch.method("copy")
def copy(x: Array, order: str = "C") -> Array:
    """A new handle on the same lazy graph: a lazy array never changes, so nothing needs
    copying until it is computed (each compute gives a new NumPy array)."""
    if order not in ("C", "K", "A"):
        raise ValueError(f"a lazy array is copied in C order, not order={order!r}")
    return build.wrap(x._node)


@dispatch.method("rechunk")
def rechunk(x: Array, rows: Any) -> Array:
    """``x`` in new row blocks: lazy, nothing is read. ``rows``: rows per block (the
    last may be shorter), ``"auto"`` (the default block size), the rows of each block
    (a sequence adding up to the rows), or dask's chunks, one entry per axis
    (``((r1, r2, ...), (k,))``, ``(r, -1)``, ``{0: r}``: trailing axes are whole in every
    block, so they must be asked whole, as ``-1``, ``None``, ``"auto"`` or their length).

    The new blocks read their rows from ``x``'s by row ranges, as dask's ``rechunk``
    along axis 0; after a mask, once the rows are counted (a compute counts them
    first, as for every operation that needs the row count). Raises ValueError for an
    in-memory result."""
    node = x._node
    if not isinstance(node, Chunked):
        raise ValueError(
            "rechunk: this array is an in-memory result (a reduction's), it has no row "
            "blocks; use tw.from_array(x.compute(), rows=...) to cut its result"
        )
    rows = _row_chunks(rows, node)
    if node.n_rows is None:
        meta = (node.dtype, node.row_shape)
        return build.defer_method(node, "rechunk", (rows,), meta, f"rechunk({rows})")
    row_nbytes = np.dtype(node.dtype).itemsize * math.prod(node.row_shape)
    bounds = blocksize.bounds(node.n_rows, None if rows == "auto" else rows, row_nbytes)
    if bounds == node.bounds:
        return x
    if isinstance(node, graph.Source):
        # As from_npy(path, rows=...): the same rows, read in other blocks, same key.
        return build.wrap(graph.Source(node.reader, bounds, key=node.key))
    return build.wrap(Rechunk(node, bounds, rows if isinstance(rows, int) else None))


def _row_chunks(rows: Any, node: Chunked) -> Any:
    """``rows`` of :func:`rechunk` as rows per block (an int), ``"auto"``, or a tuple of
    each block's rows; dask's per-axis chunks checked whole along the trailing axes."""
    if isinstance(rows, dict):
        extra = {k: v for k, v in rows.items() if int(k) % node.ndim != 0}
        rows = [rows.get(0, rows.get(-node.ndim, "auto"))] + [
            extra.get(k, extra.get(k - node.ndim)) for k in range(1, node.ndim)
        ]
    if isinstance(rows, (tuple, list)) and rows:
        first = rows[0]
        if isinstance(first, (tuple, list, str)) or first is None or len(rows) == node.ndim:
            for axis, (want, have) in enumerate(zip(rows[1:], node.row_shape, strict=False), 1):
                whole = want in (None, -1, "auto", have) or (
                    isinstance(want, (tuple, list)) and tuple(want) == (have,)
                )
                if not whole:
                    raise ValueError(
                        f"rechunk: blocks are cut along axis 0 only, so axis {axis} (of "
                        f"length {have}) is whole in every block; ask for it whole "
                        f"(-1), not {want!r}"
                    )
            rows = first
    if rows is None or rows == -1:
        return (node.n_rows,) if node.n_rows is not None else "auto"
    if isinstance(rows, str):
        if rows != "auto":
            raise ValueError(f"rechunk: rows={rows!r}: give a number of rows, or 'auto'")
        return rows
    if isinstance(rows, (tuple, list, np.ndarray)):
        return tuple(int(operator.index(r)) for r in rows)
    step = operator.index(rows)
    if step < 1:
        raise ValueError(f"rechunk needs rows >= 1, got {step}")
    return step


class Rechunk(graph.Concat):
    """``x.rechunk(rows)``: the rows of one input in new blocks, each read from the input
    by its row range (a concatenation of one input, cut anew)."""

    def __init__(self, source: Chunked, bounds: tuple[int, ...], rows: int | None) -> None:
        super().__init__((source,))
        self.rows = rows  # rows per block, when asked so; else each block's were given
        self.bounds = bounds
        self.nblocks = len(bounds) - 1

    def params(self) -> str:
        if self.rows is not None:
            return f"rows={self.rows}"
        return f"bounds={identity.digest(repr(self.bounds))}"

    def label(self) -> str:
        if self.rows is not None:
            return f"rechunk(rows={self.rows})"
        return f"rechunk({self.nblocks} blocks)"


def per_block(name: str, fn: Callable[..., Any], x: Array, **kwargs: Any) -> Array:
    """NumPy's ``fn`` on each block of ``x`` (or on its in-memory result)."""
    if isinstance(x._node, Value):
        return build.value_apply(fn, x._node, name=name, **kwargs)
    return on_blocks(name, fn, [x], **kwargs)


def _trailing_axis(x: Array, axis: Any, what: str, instead: str) -> int:
    k = operator.index(axis)
    if not -x.ndim <= k < x.ndim:
        raise np.exceptions.AxisError(k, x.ndim)
    k %= x.ndim
    if k == 0 and isinstance(x._node, Chunked):
        raise ValueError(f"x.{what} along the rows (axis 0) {instead}")
    return k


@dispatch.method("real")
def real(x: Array) -> Array:
    """The real part (``x`` itself for real data)."""
    return x if x.dtype.kind != "c" else per_block("real", np.real, x)


@dispatch.method("imag")
def imag(x: Array) -> Array:
    """The imaginary part (zeros for real data, as NumPy)."""
    return per_block("imag", np.imag, x)


@dispatch.method("take")
def take(x: Array, indices: Any, axis: Any = None) -> Array:
    """``x.take(indices, axis)``: rows picked (axis 0, or a 1-D array), or a trailing
    axis picked on each block."""
    if axis is None:
        if x.ndim != 1:
            raise ValueError(
                "x.take(indices) without an axis picks from the flattened array, which mixes "
                "rows; give axis=0 (rows) or a trailing axis, or compute() first"
            )
        axis = 0
    k = operator.index(axis)
    if not -x.ndim <= k < x.ndim:
        raise np.exceptions.AxisError(k, x.ndim)
    if k % x.ndim == 0:
        return x[np.asarray(indices)]
    return per_block("take", np.take, x, indices=np.asarray(indices), axis=k % x.ndim)


@dispatch.method("compress")
def compress(x: Array, condition: Any, axis: Any = None) -> Array:
    """``x.compress(condition, axis)``: rows kept where ``condition`` is true (axis 0, or
    a 1-D array), or a trailing axis on each block."""
    cond = condition if build.is_array(condition) else np.asarray(condition, bool)
    if axis is None:
        if x.ndim != 1:
            raise ValueError(
                "x.compress(condition) without an axis works on the flattened array, which "
                "mixes rows; give axis=0 (rows) or a trailing axis, or compute() first"
            )
        axis = 0
    if operator.index(axis) % x.ndim == 0:
        if isinstance(cond, np.ndarray) and x.shape[0] is not None and len(cond) < x.shape[0]:
            cond = np.concatenate([cond, np.zeros(x.shape[0] - len(cond), bool)])
        return x[cond]
    return per_block("compress", _compress_block, x, condition=np.asarray(cond), axis=axis)


def _compress_block(block: np.ndarray, condition: np.ndarray, axis: int) -> np.ndarray:
    return np.compress(condition, block, axis=axis)


@dispatch.method("repeat")
def repeat(x: Array, repeats: Any, axis: Any = None) -> Array:
    """``x.repeat(repeats, axis)`` along a trailing axis (each row's values repeated)."""
    if axis is None:
        raise ValueError(
            "x.repeat(repeats) without an axis repeats the flattened values, which mixes "
            "rows; give a trailing axis, or compute() first"
        )
    k = _trailing_axis(x, axis, "repeat", "changes the row count; compute() first")
    return per_block("repeat", np.repeat, x, repeats=repeats, axis=k)


@dispatch.method("swapaxes")
def swapaxes(x: Array, axis1: Any, axis2: Any) -> Array:
    """``x.swapaxes(a, b)`` of two trailing axes (each row's own axes)."""
    np.swapaxes(build.shape_only(x._node), axis1, axis2)  # NumPy's errors for the axes
    instead = "moves the rows elsewhere; swap trailing axes only, or compute() first"
    a = _trailing_axis(x, axis1, "swapaxes", instead)
    b = _trailing_axis(x, axis2, "swapaxes", instead)
    return per_block("swapaxes", np.swapaxes, x, axis1=a, axis2=b)


@dispatch.method("diagonal")
def diagonal(x: Array, offset: int = 0, axis1: int = 0, axis2: int = 1) -> Array:
    """``x.diagonal(offset, axis1, axis2)`` of two trailing axes, row by row."""
    np.diagonal(build.shape_only(x._node), offset, axis1, axis2)  # NumPy's errors for the axes
    instead = "needs every row at once; give two trailing axes, or compute() first"
    a = _trailing_axis(x, axis1, "diagonal", instead)
    b = _trailing_axis(x, axis2, "diagonal", instead)
    return per_block("diagonal", np.diagonal, x, offset=offset, axis1=a, axis2=b)


@dispatch.method("trace")
def trace(  # noqa: PLR0913 -- ndarray.trace's signature
    x: Array, offset: int = 0, axis1: int = 0, axis2: int = 1, dtype: Any = None,
    out: Any = None,
) -> Array:  # fmt: skip
    """``x.trace(offset, axis1, axis2)`` of two trailing axes, row by row."""
    if out is not None:
        raise TypeError("x.trace(..., out=...) is not supported on lazy arrays")
    # NumPy's errors for the axes (its trace is a sum of this diagonal)
    np.diagonal(build.shape_only(x._node), offset, axis1, axis2)
    instead = "needs every row at once; give two trailing axes, or compute() first"
    a = _trailing_axis(x, axis1, "trace", instead)
    b = _trailing_axis(x, axis2, "trace", instead)
    return per_block("trace", np.trace, x, offset=offset, axis1=a, axis2=b, dtype=dtype)


@dispatch.method("squeeze")
def squeeze(x: Array, axis: Any = None) -> Array:
    """``x.squeeze(axis)``: trailing axes of length one dropped; the row axis too when
    there is one row (then the result is an in-memory value, as a row is). Whether the
    row axis goes depends on the row count: after a mask, ``squeeze()`` and
    ``squeeze(axis=0)`` count the rows first, now, as ``len()`` does."""
    node = x._node
    if isinstance(node, Value):
        return build.value_apply(np.squeeze, node, axis=axis, name="squeeze")
    shape = x.shape
    axes = None if axis is None else tuple(a % x.ndim for a in np.atleast_1d(axis).tolist())
    if shape[0] is None and (axes is None or 0 in axes):
        shape = x._counted_shape()
    if axes is None:
        axes = tuple(i for i, n in enumerate(shape) if n == 1)
    else:
        for a in axes:
            if shape[a] != 1:
                raise ValueError(
                    "cannot select an axis to squeeze out which has size not equal to one"
                )
    if 0 in axes:
        return build.value_apply(np.squeeze, x._node, axis=axes, name="squeeze")
    kept = [n for i, n in enumerate(shape) if i not in axes and i > 0]
    return x.reshape(-1, *kept) if axes else x


@dispatch.method("ravel")
def ravel(x: Array, order: str = "C") -> Array:
    """The flattened array: ``x`` itself when 1-D; refused otherwise (it would turn each
    row into several)."""
    if x.ndim == 1 or isinstance(x._node, Value):
        return x if x.ndim == 1 else build.value_apply(np.ravel, x._node, name="ravel")
    raise ValueError(
        f"x.ravel() of shape {build.describe_shape(x.shape)} would turn each row into "
        f"{math.prod(x.shape[1:])} rows, and a lazy array keeps its rows; use "  # type: ignore[arg-type]
        "x.reshape(n, -1) to flatten within rows, or compute() first"
    )


@dispatch.method("view")
def view(x: Array, dtype: Any) -> Array:
    """``x.view(dtype)`` on each block, where the rows' bytes are a whole number of the
    new dtype's elements."""
    dt = np.dtype(dtype)
    if dt == x.dtype:
        return copy(x)
    if x.ndim < 2 and dt.itemsize != x.dtype.itemsize:
        raise ValueError(
            f"x.view({dt}) of a 1-D lazy array of {x.dtype} would change the row count; "
            "reshape to (-1, 1) first, or compute() first"
        )
    return per_block("view", _view_block, x, dtype=dt)


def _view_block(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(block).view(dtype)


@dispatch.method("dot")
def dot(x: Array, other: Any) -> Array:
    """``np.dot(x, other)``: ``x @ other``, or ``x * other`` for a 0-d ``other``."""
    from .functions import dot

    return dot(x, other)


# -- computed now -----------------------------------------------------------------------


@dispatch.method("tolist")
def tolist(x: Array) -> Any:
    """``x.compute().tolist()``: nested Python lists (a Python scalar for 0-d).

    Refused, before anything is computed, when the list would take more than the RAM
    budget: about 32 bytes an element (a list slot and a Python number), four times a
    float64 array's size. An array whose row count is unknown is computed first and
    checked then."""
    size = x.size
    if size is not None:
        _check_list_size(size, x.shape)
    result = np.asarray(x.compute())
    if size is None:
        _check_list_size(result.size, result.shape)
    return result.tolist()


def _check_list_size(size: int, shape: tuple[int | None, ...]) -> None:
    from ...system import budget

    need = size * LIST_BYTES_PER_ELEMENT
    limit = budget.budget_bytes()
    if need > limit:
        raise MemoryError(
            f"x.tolist() of shape {build.describe_shape(shape)} would build {size} Python "
            f"numbers, about {format_bytes(need)}, more than the RAM budget "
            f"({format_bytes(limit)}); compute() gives a NumPy array (to_npy() a file), "
            "or take fewer rows first (x[:1000].tolist())"
        )


@dispatch.method("item")
def item(x: Array, *args: Any) -> Any:
    """``x.item()`` (one element) or ``x.item(i)`` / ``x.item(i, j)``: a Python scalar,
    computed now (only the blocks holding it are read). The rows are counted first
    where unknown (after a mask), and NumPy checks the arguments on a stand-in of the
    counted shape: its errors (``IndexError`` out of range, ``ValueError`` for
    ``item()`` of other than one element) come before anything is computed."""
    standin = x._standin()
    standin.item(*args)  # NumPy's error, if any
    if not args:
        return np.asarray(x.compute()).item()
    if len(args) == 1 and np.ndim(args[0]) == 0:
        index = np.unravel_index(operator.index(args[0]) % standin.size, standin.shape)
    else:
        index = tuple(args[0]) if len(args) == 1 else args
    return np.asarray(x[tuple(int(i) for i in index)].compute()).item()


@dispatch.method("to_device")
def to_device(x: Array, device: Any, stream: Any = None) -> Array:
    """``x.to_device("cpu")``: ``x`` (lazy arrays compute into host memory); GPUs go
    through ``persist(device=...)`` or ``map_blocks(device=...)``."""
    if str(device) == "cpu":
        return x
    raise ValueError(
        f"x.to_device({device!r}): a lazy array computes into host memory; use "
        f"x.persist(device={str(device)!r}) to keep its blocks on a GPU, or "
        "map_blocks(fn, device=...) to run there"
    )
