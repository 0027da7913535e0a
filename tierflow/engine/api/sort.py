"""Sorting along the rows, lazily: ``np.sort(x, axis=0)``, ``np.argsort(x, axis=0)``,
``tw.sort_rows``, ``tw.topk`` and ``np.partition``.

Sorts run as an external merge sort (:mod:`tierflow.engine.rowwide.external_sort`):
the result is a lazy array like any other (sum it, slice it, write it with
``to_npy``), computed in two passes with bounded memory. ``topk`` is a reduction (one
pass, ``k`` rows per column held: :mod:`tierflow.engine.rowwide.topk`). Orders are
NumPy's ``kind="stable"``: ties keep their original order, NaN goes last (also when
descending, as pandas puts it).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...operators import sorting as kernels
from .. import graph
from ..graph import Chunked, Value
from ..rowwide.external_sort import Sorting, check_kth, sorted_node
from ..rowwide.topk import TopKSpec, top
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["along_rows", "partition", "sort_rows", "topk"]


@dispatch.method("sort_rows")
def along_rows(node: Chunked, name: str, kwargs: dict[str, Any]) -> Array:
    """``np.sort`` or ``np.argsort`` of ``node`` along axis 0 (``name``), lazily.

    Any ``kind`` gives the stable order (a valid answer for every kind); ``order`` (for
    structured arrays) is refused."""
    if kwargs.get("order") is not None:
        raise TypeError(f"np.{name}(..., order=...) sorts structured arrays; lazy arrays are not")
    unknown = set(kwargs) - {"kind", "order", "stable"}
    if unknown:
        raise TypeError(f"np.{name}: unsupported keywords {sorted(unknown)} on lazy arrays")
    # NumPy's errors for kind and stable, on an array like this one without rows
    no_rows = getattr(np, name)(np.empty((0, *node.row_shape), node.dtype), axis=0, **kwargs)
    if node.n_rows == 0:
        return from_array(no_rows)  # nothing to sort: NumPy's answer, whatever the dtype
    kernels.check_sortable(np.dtype(node.dtype), f"np.{name} along the rows")
    mode = "values" if name == "sort" else "indices"
    return build.wrap(sorted_node(node, Sorting(mode)))


def sort_rows(x: Any, by: int | Sequence[int] | None = None, descending: bool = False) -> Array:
    """The rows of ``x`` reordered by the key columns ``by``, like a table sort.

    ``by``: a column or a list of columns of a 2-D ``x``, the first deciding first
    (``np.lexsort`` takes them the other way round); every column when None. A 1-D
    ``x`` is sorted by its values (``by`` must be None). The sort is stable: rows with
    equal keys keep their order. NaN keys go last; ``descending=True`` reverses the
    order of every key and still puts NaN last (as pandas does), equal keys still in
    their original order. Keys are booleans, integers or floats.

    Lazy: an external merge sort (docs/engine.md, "Sorting along the rows"); a
    ``to_npy`` of the result writes the file with bounded memory.

    >>> import tierflow as tw
    >>> tw.sort_rows(np.array([[2, 0], [1, 5], [2, -1]]), by=0).compute().tolist()
    [[1, 5], [2, 0], [2, -1]]
    """
    array = from_array(x)
    node = array._node
    if node.ndim not in (1, 2):
        raise ValueError(
            f"sort_rows sorts the rows of a 1-D or 2-D array, not one of shape "
            f"{build.describe_shape(node.shape)}; reshape it to [rows, columns] first"
        )
    columns = _key_columns(node, by)
    kernels.check_sortable(np.dtype(node.dtype), "sort_rows")
    how = Sorting("rows", columns, bool(descending))
    if isinstance(node, Value):
        return build.value_apply(_sort_rows_now, node, columns, bool(descending), name=how.label())
    assert isinstance(node, Chunked)
    return build.wrap(sorted_node(node, how))


def _key_columns(node: graph.Node, by: int | Sequence[int] | None) -> tuple[int, ...]:
    if node.ndim == 1:
        if by is not None:
            raise ValueError("sort_rows of a 1-D array sorts by its values; leave by= out")
        return ()
    width = int(node.shape[1] or 0)
    if by is None:
        picked = list(range(width))
    elif isinstance(by, (int, np.integer)):
        picked = [operator.index(by)]
    else:
        picked = [operator.index(c) for c in by]
    if not picked:
        raise ValueError("sort_rows needs at least one key column in by=")
    out = []
    for c in picked:
        if not -width <= c < width:
            raise IndexError(f"sort_rows: key column {c} is out of range for {width} columns")
        out.append(c % width)
    return tuple(out)


def _sort_rows_now(values: np.ndarray, by: tuple[int, ...], descending: bool) -> np.ndarray:
    """``sort_rows`` of an array in memory."""
    values = np.asarray(values)
    if not by:
        key = kernels.row_key([values], descending)
    else:
        key = kernels.row_key([values[:, c] for c in by], descending)
    return values[kernels.stable_order(key)]


# -- top k ------------------------------------------------------------------------------


def topk(x: Any, k: int, axis: int = 0) -> Array:
    """The ``k`` largest values of each column of ``x``, largest first.

    Returns a lazy array of shape ``[k, *x.shape[1:]]`` and ``x``'s dtype: row ``i`` holds
    the ``i``-th largest value of each column, i.e. the first ``k`` rows of each column
    sorted descending, stably (equal values, such as ``0.0`` and ``-0.0``, in their
    order in ``x``). NaN counts as smaller than every number: it appears only in a
    column with fewer than ``k`` numbers. Values only; for the rows they come from,
    ``np.argsort`` or ``tw.sort_rows(x, by=c, descending=True)[:k]``. ``k`` above the
    number of rows raises ValueError (when the rows are known after a mask, at compute).

    One pass, as a reduction: each block keeps its ``k`` largest per column
    (``np.partition``), merged in row order as blocks finish; memory ``k`` rows per
    partial.

    >>> import tierflow as tw
    >>> tw.topk(np.array([[1, 9], [5, 2], [3, 4]]), 2).compute().tolist()
    [[5, 9], [3, 4]]
    """
    array = from_array(x)
    node = array._node
    k = operator.index(k)
    if node.ndim == 0:
        raise ValueError("topk needs an array with rows, not a scalar")
    axis = operator.index(axis)
    if axis % node.ndim != 0 or not -node.ndim <= axis < node.ndim:
        raise ValueError(
            f"topk runs along the rows (axis=0), not axis={axis}; for a trailing axis use "
            "np.sort(x, axis) and a slice"
        )
    kernels.check_sortable(np.dtype(node.dtype), "topk")
    if k < 1:
        raise ValueError(f"topk needs k >= 1, got {k}")
    n = node.shape[0]
    if n is not None and k > n:
        raise ValueError(f"topk: k={k} is more than the {n} rows of the array; ask for at most {n}")
    if isinstance(node, Value):
        row_shape = tuple(node.shape[1:])
        return build.value_apply(
            lambda v: top(np.asarray(v).reshape(len(v), -1), k).reshape(k, *row_shape),
            node,
            name=f"topk({k})",
        )
    assert isinstance(node, Chunked)
    return build.wrap(graph.Reduce(TopKSpec(k), (node,)))


# -- partition --------------------------------------------------------------------------


def partition(
    a: Any, kth: Any, axis: int | None = -1, kind: str = "introselect", order: Any = None
) -> Array:
    """``np.partition(a, kth, axis)`` lazily: the array sorted along ``axis`` (a sorted
    array is a valid partition for every ``kth``: the element at each ``kth`` is where
    a sort would put it, smaller ones before, larger ones after). Along the rows that is
    the external sort of ``np.sort(x, axis=0)``; along a trailing axis a sort of each
    row.

    NumPy's errors: ``kind``, ``kth`` that is not integers and ``axis`` when this is
    called; ``kth`` out of bounds too where the rows are known, else when computed (the
    rows counted). An array without elements is given back as it is, whatever ``kth``,
    as NumPy does."""
    if order is not None:
        raise TypeError("np.partition(..., order=...) sorts structured arrays; lazy arrays are not")
    array = from_array(a)
    node = array._node
    if isinstance(node, Value):
        return build.value_apply(np.partition, node, kth, axis=axis, kind=kind, name="partition")
    assert isinstance(node, Chunked)
    # NumPy checks kind, kth and axis on an array like this one without elements.
    empty = np.empty((0, *node.row_shape), node.dtype)
    np.partition(empty, kth, axis=axis, kind=kind)  # type: ignore[call-overload]
    if axis is None:
        raise ValueError(
            "np.partition(x, kth, axis=None) works on the flattened array; give an axis, "
            "or compute() first"
        )
    axis = operator.index(axis) % node.ndim
    kths = tuple(int(k) for k in np.asarray(kth).reshape(-1))
    row_elements: int = math.prod(node.row_shape)
    if node.n_rows is None and row_elements:
        return _partition_later(node, kths, axis, kind)
    if node.n_rows and row_elements:
        check_kth(kths, int(node.shape[axis]))  # type: ignore[arg-type]
    return array.along("sort", axis)


def _partition_later(node: Chunked, kth: tuple[int, ...], axis: int, kind: str) -> Array:
    """:func:`partition` of ``node``, whose rows are unknown until computed: NumPy's
    error for a ``kth`` out of bounds comes when there are rows. Along the rows the
    sort's runs count them; along a trailing axis, where ``kth`` is out of bounds for
    every row, a pass counts the rows first (none: the array as it is)."""
    if axis == 0:
        kernels.check_sortable(np.dtype(node.dtype), "np.partition along the rows")
        return build.wrap(sorted_node(node, Sorting("values", kth=kth)))
    try:
        check_kth(kth, node.shape[axis])  # type: ignore[arg-type]
    except ValueError:
        return build.deferred(
            [node],
            lambda lookup: partition(build.wrap(lookup(node)), kth, axis, kind)._node,
            (node.dtype, node.row_shape),
            "partition",
            ("partition", kth, axis),
        )
    return build.wrap(node).along("sort", axis)


@dispatch.implements(np.partition)
def _partition(
    a: Any, kth: Any, axis: int | None = -1, kind: str = "introselect", order: Any = None
) -> Any:
    return partition(a, kth, axis=axis, kind=kind, order=order)
