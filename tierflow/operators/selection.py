"""Selection on row-blocked arrays: which rows of which block go where in the result.

Blocks are given by their bounds, ``[(start, stop), ...]`` in row order (see
:func:`block_bounds`). The planning functions are pure: they say, for each block, what to
take from it (a local slice or local indices) and where that lands in the result, with
NumPy's semantics for every slice (any step, negative ones included, out-of-range starts
and stops) and NumPy's messages for bad indices:

* :func:`plan_slice` — ``x[start:stop:step]`` on rows; :func:`locate_row` — ``x[i]``;
  :func:`plan_take` — ``x[[i, j, ...]]``.
* :func:`split_index` splits a NumPy index into its row part and its trailing part;
  :class:`TrailingIndex` applies the trailing part (ints, slices, lists, boolean arrays,
  ``...``, ``None`` on trailing axes) to each block: a row-independent BlockOp.
* :func:`mask_rows` and :func:`filter_rows` select rows with a boolean mask block aligned
  with the data block; the number of output rows is known only once computed.
* :func:`head_counts` — rows to take from each block for ``head(n)``;
  :func:`concat_blocks` / :func:`concat_result` — the block table and the dtype and row
  shape of a concatenation along rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._blocks import check_blocks, prepare_out

__all__ = [
    "ConcatPiece",
    "RowPiece",
    "TakePiece",
    "TrailingIndex",
    "block_bounds",
    "bounds_from_sizes",
    "concat_blocks",
    "concat_result",
    "filter_rows",
    "head_counts",
    "locate_row",
    "mask_rows",
    "plan_slice",
    "plan_take",
    "slice_in_block",
    "split_index",
]

Bounds = Sequence[tuple[int, int]]


def block_bounds(n_rows: int, block_rows: int) -> list[tuple[int, int]]:
    """Bounds of blocks of ``block_rows`` rows (the last one shorter) covering ``n_rows``.

    >>> block_bounds(10, 4)
    [(0, 4), (4, 8), (8, 10)]
    """
    if block_rows < 1:
        raise ValueError(f"block_rows must be at least 1, got {block_rows}")
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    return [(start, min(start + block_rows, n_rows)) for start in range(0, n_rows, block_rows)]


def bounds_from_sizes(sizes: Iterable[int]) -> list[tuple[int, int]]:
    """Bounds of consecutive blocks of the given row counts.

    >>> bounds_from_sizes([3, 0, 2])
    [(0, 3), (3, 3), (3, 5)]
    """
    bounds, start = [], 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"a block cannot have {size} rows")
        bounds.append((start, start + size))
        start += size
    return bounds


def _total(bounds: Bounds) -> int:
    return bounds[-1][1] if bounds else 0


@dataclass(frozen=True)
class RowPiece:
    """Rows ``local`` of block ``block`` are rows ``[out_start, out_stop)`` of the result."""

    block: int
    local: slice
    out_start: int
    out_stop: int


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def slice_in_block(key: slice, n_rows: int, start: int, stop: int) -> tuple[slice, int, int] | None:
    """The part of ``x[key]`` (``x`` has ``n_rows`` rows) that comes from rows ``[start, stop)``.

    Returns ``(local, out_start, out_stop)``: ``block[local]`` (block = rows ``start:stop``)
    is ``x[key][out_start:out_stop]``, in that order; None when the block contributes
    nothing. Raises ValueError for a zero step, as Python does.

    >>> slice_in_block(slice(None, None, -2), 10, 4, 8)
    (slice(3, 0, -2), 1, 3)
    """
    first, last, step = key.indices(n_rows)
    count = len(range(first, last, step))
    if step > 0:
        lo = max(0, _ceil_div(start - first, step))
        hi = min(count, _ceil_div(stop - first, step))
    else:
        size = -step
        lo = max(0, (first - stop) // size + 1)
        hi = min(count, (first - start) // size + 1)
    if hi <= lo:
        return None
    head = first + lo * step - start
    tail = first + (hi - 1) * step - start
    end: int | None = tail + (1 if step > 0 else -1)
    if end is not None and end < 0:
        end = None
    return slice(head, end, step), lo, hi


def plan_slice(key: slice, bounds: Bounds) -> list[RowPiece]:
    """The pieces of ``x[key]`` in result order (for a negative step, last block first).

    >>> [(p.block, p.local, p.out_start) for p in plan_slice(slice(1, None, 3), [(0, 4), (4, 8)])]
    [(0, slice(1, 2, 3), 0), (1, slice(0, 4, 3), 1)]
    """
    n_rows = _total(bounds)
    pieces = []
    for index, (start, stop) in enumerate(bounds):
        found = slice_in_block(key, n_rows, start, stop)
        if found is not None:
            pieces.append(RowPiece(index, *found))
    pieces.sort(key=lambda p: p.out_start)
    return pieces


def _out_of_bounds(index: int, n_rows: int) -> IndexError:
    return IndexError(f"index {index} is out of bounds for axis 0 with size {n_rows}")


def locate_row(index: int, bounds: Bounds) -> tuple[int, int]:
    """``(block, local row)`` of row ``index`` (negative counts from the end).

    Raises IndexError with NumPy's message when the row does not exist.

    >>> locate_row(-1, [(0, 4), (4, 6)])
    (1, 1)
    """
    n_rows = _total(bounds)
    index = int(index)
    if not -n_rows <= index < n_rows:
        raise _out_of_bounds(index, n_rows)
    if index < 0:
        index += n_rows
    starts = [start for start, stop in bounds if stop > start]
    blocks = [i for i, (start, stop) in enumerate(bounds) if stop > start]
    position = bisect.bisect_right(starts, index) - 1
    block = blocks[position]
    return block, index - bounds[block][0]


@dataclass(frozen=True)
class TakePiece:
    """``block[local]`` goes to positions ``positions`` of the flattened index array."""

    block: int
    local: np.ndarray
    positions: np.ndarray


def plan_take(indices: Any, bounds: Bounds) -> list[TakePiece]:
    """The pieces of ``x[indices]`` for an integer index array on rows, by block.

    The result has shape ``indices.shape + row_shape``; ``positions`` index the flattened
    ``indices``. Raises IndexError with NumPy's messages for a non-integer array or an
    index out of bounds.

    >>> [(p.block, p.local.tolist(), p.positions.tolist()) for p in plan_take([5, 1, 4], [(0, 4), (4, 8)])]
    [(0, [1], [1]), (1, [1, 0], [0, 2])]
    """
    index = np.asarray(indices)
    if index.size == 0 and index.dtype.kind not in "iub":
        index = index.astype(np.intp)
    if index.dtype.kind not in "iu":
        raise IndexError("arrays used as indices must be of integer (or boolean) type")
    flat = index.reshape(-1).astype(np.int64)
    n_rows = _total(bounds)
    bad = (flat < -n_rows) | (flat >= n_rows)
    if bad.any():
        raise _out_of_bounds(int(flat[np.argmax(bad)]), n_rows)
    flat = np.where(flat < 0, flat + n_rows, flat)
    starts = np.array([start for start, _ in bounds], dtype=np.int64)
    nonempty = np.array([stop > start for start, stop in bounds], dtype=bool)
    # A row belongs to the last non-empty block starting at or before it.
    candidates = np.flatnonzero(nonempty)
    owner = (
        candidates[np.searchsorted(starts[candidates], flat, side="right") - 1]
        if flat.size
        else flat
    )
    pieces = []
    for block in np.unique(owner):
        positions = np.flatnonzero(owner == block)
        pieces.append(TakePiece(int(block), flat[positions] - starts[block], positions))
    return pieces


def _consumed_axes(item: Any) -> int:
    if item is None or item is Ellipsis:
        return 0
    if isinstance(item, np.ndarray) and item.dtype == bool:
        return max(item.ndim, 1)
    if isinstance(item, (list, tuple)):
        array = np.asarray(item)
        return max(array.ndim, 1) if array.dtype == bool else 1
    return 1


def _is_array_index(item: Any) -> bool:
    return isinstance(item, (np.ndarray, list, tuple))


def split_index(key: Any, ndim: int) -> tuple[Any, tuple[Any, ...]]:
    """Split a NumPy index of an ``ndim``-dimensional array into ``(row part, trailing key)``.

    The row part is a slice, an integer, an integer array or a boolean mask; the trailing
    key applies to each block's row shape (see :class:`TrailingIndex`). Raises IndexError
    for two ellipses, a new axis in front of the rows, and arrays on both the rows and a
    trailing axis (NumPy pairs those elementwise, which no row-block plan can express:
    index the rows first, then the columns).

    >>> split_index((slice(2, 9), [0, 3]), 2)
    (slice(2, 9, None), ([0, 3],))
    >>> split_index((Ellipsis, 1), 3)
    (slice(None, None, None), (Ellipsis, 1))
    """
    items = key if isinstance(key, tuple) else (key,)
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if not items:
        return slice(None), ()
    first, rest = items[0], tuple(items[1:])
    if first is Ellipsis:
        if sum(_consumed_axes(item) for item in rest) >= ndim:
            return split_index(rest, ndim)
        return slice(None), items
    if first is None:
        raise IndexError(
            "a new axis (None) in front of the rows would change which axis is chunked; "
            "add it after the row axis, e.g. x[:, None]"
        )
    if (
        _is_array_index(first)
        and np.asarray(first).dtype != bool
        and any(_is_array_index(item) for item in rest)
    ):
        raise IndexError(
            "index arrays on both the rows and a trailing axis are paired elementwise by "
            "NumPy, which row blocks cannot do; select the rows first, then the columns"
        )
    if _is_array_index(first) and np.asarray(first).dtype == bool and np.ndim(first) > 1 and rest:
        raise IndexError(
            f"a boolean mask over {np.ndim(first)} axes followed by more indices is not "
            "supported; apply the mask alone, then index the result"
        )
    return first, rest


class TrailingIndex:
    """``block[:, *key]``: indexing on trailing axes only, a row-independent BlockOp.

    The key may hold ints, slices, integer or boolean arrays (lists), ``...`` and ``None``;
    its result is NumPy's. ``is_view`` says whether ``apply`` returns a view of the block
    (basic indexing) rather than a copy. Raises IndexError with NumPy's message for an
    index out of bounds, and IndexError when NumPy would move the row axis (index arrays
    separated by a slice put their axes first).
    """

    row_independent = True
    n_inputs = 1

    def __init__(self, in_dtype: Any, row_shape: tuple[int, ...], key: Any) -> None:
        self.in_dtype = np.dtype(in_dtype)
        self.in_row_shape = tuple(int(n) for n in row_shape)
        items = key if isinstance(key, tuple) else (key,)
        self.key = (slice(None), *(np.asarray(k) if isinstance(k, list) else k for k in items))
        empty = np.empty((0, *self.in_row_shape), self.in_dtype)[self.key]
        one = np.empty((1, *self.in_row_shape), self.in_dtype)[self.key]
        if empty.shape[:1] != (0,) or one.shape[:1] != (1,) or empty.shape[1:] != one.shape[1:]:
            raise IndexError(
                f"the trailing index {items!r} makes NumPy move the row axis (index arrays "
                "separated by a slice go first); index those axes in two steps"
            )
        self.out_dtype = self.in_dtype
        self.out_row_shape = tuple(empty.shape[1:])
        self.is_view = not any(isinstance(k, np.ndarray) for k in self.key)

    def __repr__(self) -> str:
        return f"TrailingIndex({self.key[1:]!r})"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``block[:, *key]``; copied into ``out`` when given."""
        rows = check_blocks(blocks, [self.in_dtype], [self.in_row_shape], "trailing index")
        result = blocks[0][self.key]
        if out is None:
            return result
        out = prepare_out(
            out, (rows, *self.out_row_shape), self.out_dtype, blocks, "trailing index"
        )
        np.copyto(out, result)
        return out

    def temp_bytes(self, rows: int) -> int:
        """None: the result is the output block itself."""
        return 0


def _mask_error(block_shape: tuple[int, ...], mask_shape: tuple[int, ...]) -> IndexError:
    for axis, (have, want) in enumerate(zip(block_shape, mask_shape, strict=False)):
        if have != want:
            return IndexError(
                f"boolean index did not match indexed array along axis {axis}; size of axis "
                f"is {have} but size of corresponding boolean axis is {want}"
            )
    return IndexError(
        f"too many indices for array: array is {len(block_shape)}-dimensional, but "
        f"{len(mask_shape)} were indexed"
    )


def mask_rows(block: np.ndarray, mask: Any) -> np.ndarray:
    """``block[mask]`` for a boolean mask aligned with the block's first axes.

    A 1-D mask selects rows; a mask over the first ``d`` axes selects elements and gives
    ``(count, *block.shape[d:])``, as NumPy does for the whole array. Raises TypeError for
    a non-boolean mask and IndexError with NumPy's message for a mask of the wrong shape.
    """
    mask = np.asarray(mask)
    if mask.dtype != bool:
        raise TypeError(f"a row mask must be boolean, got dtype {mask.dtype}")
    if mask.ndim == 0 or mask.shape != block.shape[: mask.ndim]:
        raise _mask_error(block.shape, mask.shape)
    return block[mask]


def filter_rows(block: np.ndarray, fn: Callable[[np.ndarray], Any]) -> np.ndarray:
    """The rows of ``block`` for which ``fn(block)`` is True.

    ``fn`` gets the whole block and returns one boolean per row. Raises TypeError when it
    returns non-boolean values and ValueError when it returns the wrong number of them.
    """
    mask = np.asarray(fn(block))
    if mask.dtype != bool:
        raise TypeError(
            f"the filter function returned {mask.dtype} values of shape {mask.shape}; it must "
            "return one boolean per row"
        )
    if mask.shape != (block.shape[0],):
        raise ValueError(
            f"the filter function returned a mask of shape {mask.shape} for a block of "
            f"{block.shape[0]} rows; it must return shape ({block.shape[0]},)"
        )
    return block[mask]


def head_counts(n: int, block_rows: Iterable[int]) -> list[int]:
    """Rows to take from each block, in order, for the first ``n`` rows.

    Stops reading ``block_rows`` once ``n`` rows are found, so it also works on an
    iterator that computes block sizes as blocks finish (after a filter).

    >>> head_counts(5, [2, 0, 4, 7])
    [2, 0, 3]
    """
    if n < 0:
        raise ValueError(f"head needs n >= 0, got {n}")
    counts: list[int] = []
    if n == 0:
        return counts
    remaining = n
    for rows in block_rows:
        take = min(rows, remaining)
        counts.append(take)
        remaining -= take
        if remaining == 0:
            break
    return counts


@dataclass(frozen=True)
class ConcatPiece:
    """Block ``block`` of input ``input`` is rows ``[out_start, out_stop)`` of the result."""

    input: int
    block: int
    out_start: int
    out_stop: int


def concat_blocks(block_rows_per_input: Sequence[Sequence[int]]) -> list[ConcatPiece]:
    """The block table of ``np.concatenate(inputs, axis=0)``: every input block in order.

    >>> [(p.input, p.block, p.out_start, p.out_stop) for p in concat_blocks([[2, 2], [3]])]
    [(0, 0, 0, 2), (0, 1, 2, 4), (1, 0, 4, 7)]
    """
    pieces, start = [], 0
    for which, sizes in enumerate(block_rows_per_input):
        for block, rows in enumerate(sizes):
            pieces.append(ConcatPiece(which, block, start, start + rows))
            start += rows
    return pieces


def concat_result(
    dtypes: Sequence[Any], row_shapes: Sequence[tuple[int, ...]]
) -> tuple[np.dtype, tuple[int, ...]]:
    """NumPy's dtype and row shape of concatenating arrays along rows.

    Raises ValueError with NumPy's message when the trailing shapes or dimensions differ.

    >>> concat_result([np.int8, np.float32], [(3,), (3,)])
    (dtype('float32'), (3,))
    """
    if len(dtypes) != len(row_shapes) or not dtypes:
        raise ValueError("concatenation needs at least one input, with one row shape per dtype")
    probe = np.concatenate([np.empty((0, *s), d) for d, s in zip(dtypes, row_shapes, strict=True)])
    return probe.dtype, tuple(probe.shape[1:])
