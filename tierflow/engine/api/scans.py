"""Scans along the rows, lazily: ``np.cumsum``, ``np.cumprod``, ``np.nancumsum`` and
``np.nancumprod`` with ``axis=0`` (or ``axis=None`` of a 1-D array), and the fills
``tw.ffill`` and ``tw.bfill``. Each is two passes over the input, one block held at a
time (:mod:`tierflow.engine.rowwide.scans`); along a trailing axis the cum-functions
are one block at a time (:meth:`~tierflow.engine.api.array.Array.along`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph import Chunked, Value
from ..rowwide.scans import How, Scanning, UserScan, scan_dtype, scanned_node
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["bfill", "cumreduction", "ffill", "scan_rows"]


@dispatch.method("scan_rows")
def scan_rows(node: Chunked, name: str, kwargs: dict[str, Any]) -> Array:
    """``np.<name>(x, axis=0)`` for ``name`` in cumsum, cumprod, nancumsum,
    nancumprod (``kwargs``: ``dtype=`` only)."""
    unknown = set(kwargs) - {"dtype"}
    if unknown:
        raise TypeError(f"np.{name}: unsupported keywords {sorted(unknown)} on lazy arrays")
    how = Scanning(name, scan_dtype(name, node.dtype, kwargs.get("dtype")).str)
    return _scanned(node, how)


def _scanned(node: Chunked, how: How) -> Array:
    if node.bounds is None:  # after a mask: each block's first row, once counted
        return build.defer_function(lambda xs: _scanned(xs[0]._node, how), [node], how.label())
    return build.wrap(scanned_node(node, how))


def _fill(kind: str, x: Any, limit: int | None, axis: int) -> Array:
    array = from_array(x)
    node = array._node
    if limit is not None:
        limit = operator.index(limit)
        if limit < 0:
            raise ValueError(f"{kind}: limit must be 0 or more, got {limit}")
    if _axis(axis, array.ndim) != 0:
        raise ValueError(
            f"{kind} fills along the rows (axis=0), not axis={axis}: a lazy array is cut "
            "into row blocks, so along a trailing axis use map_blocks with your fill"
        )
    how = Scanning(kind, scan_dtype(kind, node.dtype).str, limit)
    if isinstance(node, Value):
        return build.value_apply(lambda v: how.scan(np.asarray(v), None, 0), node, name=kind)
    assert isinstance(node, Chunked)
    return _scanned(node, how)


def _axis(axis: Any, ndim: int) -> int:
    """``axis`` of an array of ``ndim`` axes, as NumPy checks it (AxisError)."""
    k = operator.index(axis)
    if not -max(1, ndim) <= k < max(1, ndim):
        raise np.exceptions.AxisError(k, ndim)
    return k % max(1, ndim)


def ffill(x: Any, limit: int | None = None, axis: int = 0) -> Array:
    """Each NaN replaced by the last non-NaN value above it in its column (along the
    rows, axis 0), as pandas' ``ffill`` and bottleneck's ``push`` do; with ``limit``,
    only NaN at most ``limit`` rows below that value. Lazy: two passes, one block at a
    time. An array that cannot hold NaN (integers, bools) comes back as it is.

    >>> import tierflow as tw
    >>> tw.ffill(np.array([np.nan, 1.0, np.nan, np.nan, 4.0])).compute().tolist()
    [nan, 1.0, 1.0, 1.0, 4.0]
    >>> tw.ffill(np.array([1.0, np.nan, np.nan, 4.0]), limit=1).compute().tolist()
    [1.0, 1.0, nan, 4.0]
    """
    return _fill("ffill", x, limit, axis)


def bfill(x: Any, limit: int | None = None, axis: int = 0) -> Array:
    """Each NaN replaced by the first non-NaN value below it in its column (see
    :func:`ffill`).

    >>> import tierflow as tw
    >>> tw.bfill(np.array([np.nan, 1.0, np.nan, 4.0, np.nan])).compute().tolist()
    [1.0, 1.0, 4.0, 4.0, nan]
    """
    return _fill("bfill", x, limit, axis)


def cumreduction(  # noqa: PLR0913 -- dask.array.reductions.cumreduction's signature
    func: Callable[..., Any],
    binop: Callable[..., Any],
    ident: Any,
    x: Any,
    axis: int | None = None,
    dtype: Any = None,
    method: str = "sequential",
    preop: Callable[..., Any] | None = None,
) -> Array:
    """A scan of your own along the rows, as ``dask.array.reductions.cumreduction``:
    ``func(block, axis=0, dtype=dtype)`` scans each block (``np.cumsum``), ``binop``
    (``np.add``) adds to it what the rows before the block carry, which is
    ``preop(block, axis=0, keepdims=True)`` of each earlier block when given, else the
    last row of its scan, folded with ``binop``; ``ident`` is the identity of
    ``binop`` (``binop(ident, v)`` is ``v``). Two passes, one block at a time; ``method``
    is dask's (``"sequential"`` or ``"blelloch"``: both give the same answer here).

    >>> import tierflow as tw
    >>> x = tw.from_array(np.arange(6.0), rows=2)
    >>> tw.cumreduction(np.cumsum, np.add, 0, x, axis=0).compute().tolist()
    [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]
    """
    array = from_array(x)
    node = array._node
    if axis is None and array.ndim == 1:
        axis = 0
    if axis is None or _axis(axis, array.ndim) != 0:
        raise ValueError(
            f"cumreduction runs along the rows (axis=0), not axis={axis}: along a trailing "
            "axis, map_blocks runs your scan on each block"
        )
    if method not in ("sequential", "blelloch"):
        raise ValueError(f"cumreduction: method={method!r}: use 'sequential' or 'blelloch'")
    if isinstance(node, Value):
        return build.value_apply(
            lambda v: func(np.asarray(v), axis=0, dtype=dtype), node, name="cumreduction"
        )
    assert isinstance(node, Chunked)
    if dtype is None:
        probe = np.asarray(func(np.zeros((2, *node.row_shape), node.dtype), axis=0, dtype=None))
        dtype = probe.dtype
    how = UserScan(func, binop, ident, preop, np.dtype(dtype).newbyteorder("=").str)
    return _scanned(node, how)
