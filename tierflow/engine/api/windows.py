"""Padding, windows and reversal along the rows, lazily: ``np.pad``,
``np.lib.stride_tricks.sliding_window_view`` (what xarray's ``rolling`` runs) and
``np.flip`` (what xarray's ``bfill`` runs around its fill).

``np.pad`` along the rows puts the padding rows before and after the array's blocks
(a small block of the constant, or slices of the array's own first and last rows for
``edge``, ``reflect``, ``symmetric`` and ``wrap``); along a trailing axis it pads each
block. ``sliding_window_view`` along the rows is a :meth:`map_overlap
<tierflow.engine.api.array.Array.map_overlap>` with ``window - 1`` rows after each
block: a row of the result is its window, a new last axis; along a trailing axis it is
NumPy's own on each block. ``np.flip`` is a slice with step -1 on each axis it flips
(the rows: the blocks read in reverse order, each reversed).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph import Chunked, Value
from . import build, dispatch
from .blockwise import axes
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["flip", "flipud", "pad", "sliding_window_view"]

_BY_ROWS = ("edge", "reflect", "symmetric", "wrap")  # modes that copy the array's own rows


@dispatch.implements(np.pad)
def pad(array: Any, pad_width: Any, mode: Any = "constant", **kwargs: Any) -> Array:
    """``np.pad``: lazy for ``constant``, ``edge``, ``reflect``, ``symmetric`` and
    ``wrap`` (the modes that take values, not statistics of the whole axis), padding
    the rows with at most the array's rows (``reflect``: one fewer)."""
    x = from_array(array)
    node = x._node
    if isinstance(node, Value):
        return build.value_apply(np.pad, node, pad_width, name="pad", mode=mode, **kwargs)
    assert isinstance(node, Chunked)
    # NumPy's own checks and widths, on an array of this shape with one row
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.intp), (x.ndim, 2))
    np.pad(np.zeros((1, *node.row_shape), node.dtype), widths, mode=mode, **kwargs)
    if mode != "constant" and mode not in _BY_ROWS:
        raise ValueError(
            f"np.pad(mode={mode!r}) takes statistics of the whole axis; on a lazy array it "
            f"pads with one of constant, {', '.join(_BY_ROWS)}, or compute() first"
        )
    before, after = (int(w) for w in widths[0])
    if node.n_rows is None and (before or after) and mode != "constant":
        return build.defer_function(
            lambda xs: pad(xs[0], pad_width, mode=mode, **kwargs), [node], f"pad({mode})"
        )
    trailing = [tuple(int(w) for w in row) for row in widths[1:]]
    if any(a or b for a, b in trailing):
        x = x.map_blocks(
            lambda b: np.pad(b, [(0, 0), *trailing], mode=mode, **kwargs),
            dtype=node.dtype,
            row_shape=tuple(n + a + b for n, (a, b) in zip(node.row_shape, trailing, strict=True)),
        )
    if not (before or after):
        return x
    pieces = [
        _rows(x, before, mode, kwargs, first=True),
        x,
        _rows(x, after, mode, kwargs, first=False),
    ]
    joined: Any = np.concatenate([p for p in pieces if p is not None], axis=0)  # lazy
    return joined


def _tuple(value: Any) -> tuple[Any, ...]:
    """A number, or a sequence of them, as a tuple."""
    return (value,) if np.isscalar(value) else tuple(value)


def _rows(x: Array, count: int, mode: str, kwargs: dict[str, Any], first: bool) -> Any:
    """The ``count`` padding rows before (``first``) or after the array."""
    if count == 0:
        return None
    n = x.shape[0]
    if mode == "constant":
        values = kwargs.get("constant_values", 0)
        side = np.broadcast_to(np.asarray(values), (x.ndim, 2))[0][0 if first else 1]
        return from_array(np.full((count, *x.shape[1:]), side, dtype=x.dtype))
    assert n is not None
    most = n - 1 if mode == "reflect" else n
    if count > most or n == 0:
        raise ValueError(
            f"np.pad(mode={mode!r}) of {count} rows on a lazy array of {n} rows: pad with at "
            f"most {most} rows (NumPy repeats the reflection beyond that), or compute() first"
        )
    if mode == "edge":
        return x[[0] * count] if first else x[[n - 1] * count]
    if mode == "wrap":
        return x[n - count :] if first else x[:count]
    start = 1 if mode == "reflect" else 0  # reflect leaves the edge row out
    if first:
        return x[start : start + count][::-1]
    return x[n - count - start : n - start][::-1]


@dispatch.implements(np.flip)
def flip(m: Any, axis: Any = None) -> Array:
    """``np.flip``: ``m[::-1]`` along each axis in ``axis`` (None: every axis)."""
    x = from_array(m)
    flipped = axes(axis, x.ndim)  # NumPy's AxisError, a 0-d array's too
    if not flipped:
        return x
    return x[tuple(slice(None, None, -1) if a in flipped else slice(None) for a in range(x.ndim))]


@dispatch.implements(np.flipud)
def flipud(m: Any) -> Array:
    """``np.flipud``: the rows in reverse order."""
    x = from_array(m)
    if x.ndim < 1:
        raise ValueError("Input must be >= 1-d.")
    return flip(x, 0)


@dispatch.implements(np.lib.stride_tricks.sliding_window_view)
def sliding_window_view(
    x: Any, window_shape: Any, axis: Any = None, *, subok: bool = False, writeable: bool = False
) -> Array:
    """``sliding_window_view``: along the rows, the result's row ``i`` holds rows ``i``
    to ``i + window - 1`` as a new last axis (``n - window + 1`` rows); windows along
    trailing axes are NumPy's on each block. Read-only as NumPy's (``writeable=True``
    is refused: a lazy array is never written)."""
    array = from_array(x)
    node = array._node
    if writeable:
        raise ValueError("sliding_window_view(writeable=True): a lazy array is never written")
    shapes = _tuple(window_shape)
    axes = tuple(range(array.ndim)) if axis is None else _tuple(axis)
    # NumPy's checks (and the result's shape) on an array of this shape with enough rows
    known = array.shape[0]
    rows_here = known if known is not None else max(int(w) for w in shapes)
    trailing = tuple(int(n) for n in array.shape[1:] if n is not None)
    probe = np.lib.stride_tricks.sliding_window_view(
        np.zeros((rows_here, *trailing), array.dtype), shapes, axis=axis
    )
    if isinstance(node, Value):
        return build.value_apply(
            lambda v: np.lib.stride_tricks.sliding_window_view(np.asarray(v), shapes, axis=axis),
            node,
            name="sliding_window_view",
        )
    along_rows = [
        s for s, a in zip(shapes, axes, strict=True) if operator.index(a) % array.ndim == 0
    ]
    if not along_rows:
        return array.map_blocks(
            lambda b: np.lib.stride_tricks.sliding_window_view(b, shapes, axis=axis),
            dtype=array.dtype,
            row_shape=probe.shape[1:],
        )
    if len(along_rows) > 1 or len(shapes) > 1:
        raise ValueError(
            "sliding_window_view over the rows and another axis at once on a lazy array: "
            "make the windows along the rows alone, or compute() first"
        )
    window = int(along_rows[0])
    n = array.shape[0]
    if n is None:
        return build.defer_function(
            lambda xs: sliding_window_view(xs[0], window_shape, axis=axis),
            [node],
            "sliding_window_view",
        )

    def windows(block: np.ndarray) -> np.ndarray:
        # the block's rows and window - 1 after it: one window per row of the block
        return np.lib.stride_tricks.sliding_window_view(block, window, axis=0)

    padded = array.map_overlap(
        lambda b: np.concatenate([windows(b), np.zeros((window - 1, *probe.shape[1:]), b.dtype)]),
        depth=(0, window - 1),
        boundary=0,
        dtype=array.dtype,
        row_shape=probe.shape[1:],
    )
    return padded[: n - window + 1]
