"""How often values occur, over all rows: ``np.unique``, ``np.bincount`` and
``tw.value_counts`` on lazy arrays.

Here are NumPy's signatures, their argument checks and the lazy results: each output of
``np.unique`` is a field of one table, the inverse a second pass. ``axis=None``
flattens, as NumPy does; ``axis=0`` on an array of two or more dimensions gives unique
rows. Other axes run across every row and are refused. The reductions, how they merge
and spill, are :mod:`tierflow.engine.rowwide.frequencies`.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import graph
from ..graph import Chunked, Value
from ..rowwide.frequencies import (
    BincountSpec,
    InverseSpec,
    UniqueSpec,
    by_count,
    table_dtype,
    table_field,
)
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["bincount", "unique", "value_counts"]


def _field_of(table: graph.Node, name: str, label: str) -> Array:
    """A lazy field of a table whose length is known once computed (shape ``(None,
    ...)``, as a ``head`` of a masked array has)."""
    fields: dict[str, Any] = dict(np.dtype(table.dtype).fields or {})
    shape = (None, *fields[name][0].shape)
    return build.wrap(graph.Apply(table_field, (table,), {"name": name}, name=label, shape=shape))


def _unique_axis(node: Chunked | Value, axis: Any) -> bool:
    """Whether ``axis`` asks for unique rows; refuses axes other than the row axis."""
    if axis is None:
        return False
    k = operator.index(axis)
    if not -node.ndim <= k < node.ndim:
        raise np.exceptions.AxisError(k, node.ndim)
    if k % node.ndim != 0:
        raise ValueError(
            f"np.unique(x, axis={axis}) on an array of shape {build.describe_shape(node.shape)} "
            "compares slices that span every row, and a lazy array is cut into row blocks; "
            "use axis=0 (unique rows) or axis=None, or compute() first"
        )
    return node.ndim > 1


@dispatch.implements(np.unique)
def unique(  # noqa: PLR0913 -- np.unique's own signature
    ar: Any,
    return_index: bool = False,
    return_inverse: bool = False,
    return_counts: bool = False,
    axis: int | None = None,
    *,
    equal_nan: bool = True,
    sorted: bool = True,
) -> Any:
    """``np.unique`` on a lazy array: lazy results, identical to NumPy's (see the module
    docstring). One pass over the data for the values, counts and first indices; a
    second pass for the inverse. ``equal_nan=False`` is not supported."""
    if not equal_nan:
        raise TypeError(
            "np.unique(..., equal_nan=False) is not supported on lazy arrays (every NaN is "
            "one value, as with the default equal_nan=True)"
        )
    flags = {
        "return_index": return_index,
        "return_inverse": return_inverse,
        "return_counts": return_counts,
    }
    x = from_array(ar)
    node = x._node
    if isinstance(node, Value):
        outputs = 1 + sum(bool(v) for v in flags.values())
        if outputs == 1:
            return build.value_apply(
                np.unique, node, name="unique", data_length=True, axis=axis, **flags
            )
        return tuple(
            build.value_apply(
                _nth_unique, node, name="unique", data_length=True, n=n, axis=axis, **flags
            )
            for n in range(outputs)
        )
    assert isinstance(node, Chunked)
    rows = _unique_axis(node, axis)
    if np.dtype(node.dtype).kind not in "biuf":
        raise TypeError(
            f"np.unique on lazy arrays takes booleans, integers and floats, not {node.dtype}; "
            "compute() first"
        )
    if rows and math.prod(node.row_shape) == 0:
        raise ValueError(
            f"np.unique(axis=0) of rows without elements, shape {build.describe_shape(node.shape)}, "
            "is not supported on lazy arrays; compute() first"
        )
    spec = UniqueSpec(rows, bool(return_counts), bool(return_index))
    table: graph.Node = graph.Reduce(spec, (node,))
    if spec.needs_offset and node.n_rows is None:
        # First indices need each block's first row: known once the rows are counted.
        table = build.deferred(
            [node],
            functools.partial(_counted_table, spec, node),
            (table.dtype, table.shape),
            table.label(),
            ("unique", spec.rows, spec.counts),
            rows=False,
        )._node
    values = _field_of(table, "value", "unique values")
    out: list[Array] = [values]
    if return_index:
        out.append(_field_of(table, "index", "unique index"))
    if return_inverse:
        uniques = values._node
        assert isinstance(uniques, Value)
        out.append(build.wrap(graph.BlockMap(InverseSpec(rows), (node,), (uniques,))))
    if return_counts:
        out.append(_field_of(table, "count", "unique counts"))
    return out[0] if len(out) == 1 else tuple(out)


def _counted_table(
    spec: UniqueSpec, node: Chunked, lookup: Callable[[graph.Node], graph.Node]
) -> graph.Node:
    counted = lookup(node)
    assert isinstance(counted, Chunked)
    return graph.Reduce(spec, (counted,))


def _nth_unique(value: np.ndarray, n: int, **kwargs: Any) -> Any:
    return np.unique(value, **kwargs)[n]


def value_counts(x: Any, axis: int | None = None) -> tuple[Array, Array]:
    """The distinct values of ``x`` and how often each occurs, most frequent first
    (ties in value order), as pandas' ``Series.value_counts`` sorts them.

    Returns two lazy arrays, ``(values, counts)``: ``values`` as ``np.unique(x,
    axis=axis)`` gives them (with ``axis=0``, rows), ``counts`` as intp. NaN is counted
    as one value (pandas leaves it out by default: drop it with ``x[~np.isnan(x)]``).
    Both come from one pass over ``x`` (``tw.compute(values, counts)``).

    >>> values, counts = value_counts(np.array([3, 1, 3, 2, 1, 3]))
    >>> values.compute(), counts.compute()
    (array([3, 1, 2]), array([3, 2, 1]))
    """
    array = from_array(x)
    node = array._node
    if isinstance(node, Value):
        ranked = build.wrap(graph.Apply(_value_table, (node,), {"axis": axis}, name="value_counts"))
    else:
        values = unique(array, return_counts=True, axis=axis)[0]
        table = values._node.inputs[0]
        ranked = build.wrap(graph.Apply(by_count, (table,), name="value_counts"))
    table_node = ranked._node
    return (
        _field_of(table_node, "value", "value_counts values"),
        _field_of(table_node, "count", "value_counts counts"),
    )


def _value_table(value: np.ndarray, axis: int | None) -> np.ndarray:
    uniq, counts = np.unique(value, return_counts=True, axis=axis)
    table = np.empty(len(counts), table_dtype(uniq.dtype, uniq.shape[1:], ["value", "count"]))
    table["value"], table["count"] = uniq, counts
    return by_count(table)


@dispatch.implements(np.bincount)
def bincount(x: Any, weights: Any = None, minlength: int = 0) -> Array:
    """``np.bincount`` on a lazy array: one pass, lazy counts identical to NumPy's
    (intp, or float64 with ``weights``, an array with the rows of ``x``)."""
    array = from_array(x)
    node = array._node
    minlength = operator.index(minlength)
    if minlength < 0:
        raise ValueError("'minlength' must not be negative")
    if isinstance(node, Value):
        return build.value_apply(
            np.bincount, node, weights, name="bincount", data_length=True, minlength=minlength
        )
    assert isinstance(node, Chunked)
    if node.ndim != 1:
        raise ValueError(
            f"object too deep for desired array: np.bincount counts a 1-D array, got shape "
            f"{build.describe_shape(node.shape)}; count one column (np.bincount(x[:, j])), or "
            "every element with np.unique(x, return_counts=True)"
        )
    if np.dtype(node.dtype).kind not in "biu":
        raise TypeError(
            f"Cannot cast array data from {node.dtype!r} to dtype('int64') according to the "
            "rule 'safe'"
        )
    inputs: tuple[Chunked, ...] = (node,)
    if weights is not None:
        w = from_array(weights)._node
        if not isinstance(w, Chunked) or w.ndim != 1:
            raise ValueError(
                f"The weights and list don't have the same length: weights of shape "
                f"{build.describe_shape(w.shape)} for x of shape {build.describe_shape(node.shape)}"
            )
        if build.line_up_later([node, w]):  # different masks, block sizes, or known rows
            return build.defer_function(
                lambda xw: bincount(xw[0], weights=xw[1], minlength=minlength),
                [node, w],
                f"bincount(minlength={minlength})",
            )
        if w.n_rows != node.n_rows:
            raise ValueError(
                f"The weights and list don't have the same length: {build.describe_shape(w.shape)} "
                f"and {build.describe_shape(node.shape)}"
            )
        inputs = (node, w)
    return build.wrap(graph.Reduce(BincountSpec(weights is not None, minlength), inputs))
