"""How often values occur, over all rows: ``np.unique``, ``np.bincount`` and ``tw.value_counts``.

``np.unique(x, return_index=, return_inverse=, return_counts=, axis=)`` on a lazy array
gives lazy results, identical to NumPy's (dtypes included, ``equal_nan=True``):

* the values (and counts, first indices) are one reduction (:class:`UniqueTable`):
  each block's ``np.unique``, merged as a tree and spilled to the SSD by value range
  when the distinct values outgrow a sixteenth of the RAM budget
  (:mod:`tierflow.engine.rowwide.distinct`). Its result is a *table*, a structured array with
  the fields ``value``, ``count`` and ``index`` that were asked for; each output is a
  field of it, so asking for several costs one pass.
* the inverse is a lazy array with the input's rows (:class:`Inverse`): a second pass
  that looks each value up in the unique values (``np.searchsorted``), which it holds
  in memory.

``axis=None`` flattens, as NumPy does; ``axis=0`` on an array of two or more
dimensions gives unique rows. Other axes run across every row and are refused.

``np.bincount(x, weights=, minlength=)``: one pass; each block's counts are as long as
its largest value, and partials grow to the longer one as they merge. Negative values
are refused with NumPy's message, and counts bigger than the RAM budget before they are
made.

``tw.value_counts(x)``: the unique values and their counts, most frequent first, ties
in value order.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import format_bytes
from ...errors import OutOfMemoryError
from ...operators import byteorder
from ...operators.types import block_bytes, combine_partials
from ...storage import placement, spill
from ...system import budget
from .. import graph
from ..graph import Chunked, Value
from ..graph.specs import Dtypes, ReduceSpec, Shapes, Spec, Values
from ..rowwide import distinct
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = [
    "Bincount",
    "BincountSpec",
    "Inverse",
    "InverseSpec",
    "UniqueSpec",
    "UniqueTable",
    "bincount",
    "unique",
    "value_counts",
]

LIMIT_SHARE = 16  # distinct values held in RAM: 1/16 of the budget (merging takes ~5x that)
_MIN_LIMIT = 64 << 10  # however small the budget, a partial may hold this much


def _key_dtype(dtype: np.dtype, row_shape: tuple[int, ...], rows: bool) -> np.dtype:
    """The dtype of keys, in native byte order: the values', or one field per column
    for unique rows (keys of every block merge and compare alike, and a row becomes a
    key by a view of its bytes: :mod:`tierflow.operators.byteorder`)."""
    dtype = byteorder.native_dtype(dtype)
    if not rows:
        return dtype
    return np.dtype([(f"f{i}", dtype) for i in range(math.prod(row_shape))])


def _keys(block: np.ndarray, key_dtype: np.dtype, rows: bool) -> np.ndarray:
    """The keys of ``block`` (of :func:`_key_dtype`): a copy where its byte order is not
    the keys'."""
    if not rows:
        return byteorder.native(block.reshape(-1))
    columns = len(key_dtype.names or ())
    values = np.ascontiguousarray(block.reshape(block.shape[0], columns), dtype=key_dtype[0])
    return values.view(key_dtype).reshape(-1)


def _table_dtype(dtype: np.dtype, row_shape: tuple[int, ...], fields: Sequence[str]) -> np.dtype:
    parts: list[tuple[Any, ...]] = [("value", dtype, row_shape) if row_shape else ("value", dtype)]
    parts += [(name, np.intp) for name in fields if name != "value"]
    return np.dtype(parts)


class UniqueTable:
    """The reduction behind ``np.unique``: the table of distinct values (or rows), with
    their counts and first indices as asked (see the module docstring).

    ``rows``: keys are rows (``axis=0``), else single values of the flattened array.
    ``n_rows``: the array's rows, when known (a spill then makes as many partitions as
    the rows could fill, :class:`~tierflow.engine.rowwide.distinct.Room`). ``limit``: bytes of
    distinct values held before spilling (default: 1/16 of the RAM budget). ``combine`` consumes a spilled partial (its files move into the result).
    """

    row_independent = False
    commutative = True
    n_inputs = 1

    def __init__(  # noqa: PLR0913 -- the flags of np.unique
        self,
        dtype: Any,
        row_shape: tuple[int, ...],
        *,
        rows: bool,
        counts: bool,
        index: bool,
        n_rows: int | None = None,
        limit: int | None = None,
    ) -> None:
        self.in_dtype = np.dtype(dtype)
        self.in_row_shape = tuple(row_shape)
        self.rows = rows
        self.row_size = math.prod(row_shape)
        self.value_shape = tuple(row_shape) if rows else ()
        self.key_dtype = _key_dtype(self.in_dtype, self.in_row_shape, rows)
        self.want = distinct.Want(
            counts=counts, first=index, tie_order=rows and self.in_dtype.kind in "fc"
        )
        fields = ["value", *(["count"] if counts else []), *(["index"] if index else [])]
        self.out_dtype = _table_dtype(self.in_dtype, self.value_shape, fields)
        self.out_shape = None  # the number of distinct values is known once computed
        if limit is None:
            limit = max(_MIN_LIMIT, budget.budget_bytes() // LIMIT_SHARE)
        self.limit = int(limit)
        expected = None
        if n_rows is not None:
            keys = n_rows if rows else n_rows * self.row_size
            expected = keys * distinct.record_dtype(self.key_dtype, self.want).itemsize
        self.room = distinct.Room(self.limit, expected)

    def __repr__(self) -> str:
        return f"UniqueTable({'rows' if self.rows else 'values'}, {self.want})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> distinct.Partial:
        """The block's distinct keys as a level-0 run."""
        block = blocks[0]
        if block.shape[0] == 0:
            return None
        keys = _keys(block, self.key_dtype, self.rows)
        offset = row_offset if self.rows else row_offset * self.row_size
        return distinct.Stack(((0, distinct.run_of(keys, offset, self.want)),))

    def combine(self, a: distinct.Partial, b: distinct.Partial) -> distinct.Partial:
        """Merge two partials; spills past the limit."""
        return distinct.combine(a, b, self.want, self.room)

    def aggregate(self, partial: distinct.Partial) -> np.ndarray:
        """The table: one record per distinct value, in NumPy's order.

        A spilled result is reduced one partition at a time into a file of records
        under the spill folder (its length is known only at the end), then read into an
        array placed by the budget (RAM, or a spill file when it does not fit); the
        file is removed on the way out, error or not."""
        if not isinstance(partial, distinct.Spilled):
            runs = list(distinct.runs_of(partial, self.want))
            return self._records(runs[0]) if runs else np.empty(0, self.out_dtype)
        fd, path = tempfile.mkstemp(prefix="unique-result-", dir=spill.process_dir())
        try:
            total = 0
            with os.fdopen(fd, "wb") as f:
                for run in partial.results():
                    self._records(run).tofile(f)
                    total += len(run)
            table = placement.array((total,), self.out_dtype)
            step = max(1, self.limit // self.out_dtype.itemsize)
            with open(path, "rb") as f:
                for at in range(0, total, step):
                    piece = np.fromfile(f, self.out_dtype, count=step)
                    table[at : at + len(piece)] = piece
            return table
        finally:
            os.unlink(path)

    def _records(self, run: distinct.Run) -> np.ndarray:
        """A run as records of the table."""
        n = len(run)
        table = np.empty(n, self.out_dtype)
        values = run.keys.view(self.key_dtype[0]) if self.rows else run.keys
        table["value"] = values.reshape(n, *self.value_shape)
        if run.counts is not None:
            table["count"] = run.counts
        if run.first is not None:
            table["index"] = run.first
        return table

    def discard(self, partial: distinct.Partial) -> None:
        """Remove the files of a partial left by a compute that failed."""
        distinct.discard(partial)

    def temp_bytes(self, rows: int) -> int:
        """np.unique sorts a copy of the block's keys, with an index per key."""
        return 3 * block_bytes(rows, self.in_row_shape, self.in_dtype) + 16 * rows * (
            1 if self.rows else self.row_size
        )

    def partial_bytes(self) -> int:
        """A block's run is counted in :meth:`temp_bytes`; the merged partial the
        accumulator holds stays under :attr:`limit` (past it, it spills)."""
        return 1024


@dataclass(frozen=True)
class UniqueSpec(ReduceSpec):
    """``np.unique``'s table (see :class:`UniqueTable`)."""

    rows: bool
    counts: bool
    index: bool

    @property
    def needs_offset(self) -> bool:
        return self.index

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return UniqueTable(
            dtypes[0], row_shapes[0], rows=self.rows, counts=self.counts, index=self.index,
            n_rows=n_rows,
        )  # fmt: skip

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...]]:
        return op.out_dtype, (None,)

    def label(self) -> str:
        asked = [n for n, on in (("counts", self.counts), ("index", self.index)) if on]
        what = "unique rows" if self.rows else "unique"
        return f"{what}({', '.join(asked)})" if asked else what


class Inverse:
    """The inverse of ``np.unique``: each value's (or row's) place among the unique
    ones, block by block (``np.searchsorted``), as intp."""

    row_independent = True
    n_inputs = 1
    out_dtype = np.dtype(np.intp)

    def __init__(
        self, dtype: Any, row_shape: tuple[int, ...], rows: bool, uniques: np.ndarray
    ) -> None:
        self.in_dtype = np.dtype(dtype)
        self.in_row_shape = tuple(row_shape)
        self.rows = rows
        self.out_row_shape = () if rows else self.in_row_shape
        self.key_dtype = _key_dtype(self.in_dtype, self.in_row_shape, rows)
        self.uniques = _keys(np.asarray(uniques, self.in_dtype), self.key_dtype, rows)

    def __repr__(self) -> str:
        return f"Inverse({len(self.uniques)} unique)"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        block = blocks[0]
        keys = _keys(block, self.key_dtype, self.rows)
        found = np.searchsorted(self.uniques, keys, side="left").astype(np.intp, copy=False)
        if self.rows and len(keys) and self.in_dtype.kind in "fc":
            missed = self.uniques[np.minimum(found, len(self.uniques) - 1)] != keys
            if missed.any():
                raise ValueError(
                    f"np.unique(..., return_inverse=True, axis=0): {int(missed.sum())} rows of "
                    "this block hold a NaN; such a row equals no other, so its place among the "
                    "unique rows depends on where it first occurs, which a block cannot see. "
                    "Replace NaN first (tw.where(np.isnan(x), fill, x)), or compute() the array"
                )
        result = found.reshape(block.shape[0], *self.out_row_shape)
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def temp_bytes(self, rows: int) -> int:
        """The keys' copy and the positions."""
        return block_bytes(rows, self.in_row_shape, self.in_dtype) + 8 * rows * (
            1 if self.rows else math.prod(self.in_row_shape)
        )


@dataclass(frozen=True)
class InverseSpec(Spec):
    """``np.unique(..., return_inverse=True)``'s inverse; the unique values are
    ``values[0]``."""

    rows: bool

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return Inverse(dtypes[0], row_shapes[0], self.rows, values[0])

    def label(self) -> str:
        return "unique rows inverse" if self.rows else "unique inverse"


class Bincount:
    """``np.bincount`` as a reduction: counts (or sums of weights) per value, partials
    as long as the largest value seen, padded as they merge."""

    row_independent = False
    commutative = True

    def __init__(self, weighted: bool, minlength: int) -> None:
        self.weighted = weighted
        self.n_inputs = 2 if weighted else 1
        self.minlength = minlength
        self.out_dtype = np.dtype(np.float64 if weighted else np.intp)
        self.out_shape = None  # max(x) + 1 or minlength, known once computed

    def __repr__(self) -> str:
        return f"Bincount(weighted={self.weighted}, minlength={self.minlength})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Any:
        values = blocks[0]
        if values.shape[0] == 0:
            return None
        low = values.min()
        if low < 0:
            raise ValueError(
                f"'list' argument must have no negative elements: found {low} in a block of "
                f"{values.shape[0]} values; np.bincount counts the values 0, 1, 2...: shift "
                "or mask the negative ones first"
            )
        high = int(values.max())
        need = (high + 1) * 8
        if need > budget.budget_bytes():
            raise OutOfMemoryError(
                f"np.bincount: a block holds the value {high}, so its counts take "
                f"{format_bytes(need, 3)} (one count per value from 0 to {high}), more "
                f"than the RAM budget of {format_bytes(budget.budget_bytes(), 3)}; count "
                "only the values present with np.unique(x, return_counts=True), or raise "
                "the budget"
            )
        weights = blocks[1] if self.weighted else None
        return np.bincount(values.astype(np.intp, copy=False), weights)

    def combine(self, a: Any, b: Any) -> Any:
        """Add two partials, the shorter padded with zeros."""
        return combine_partials(a, b, _padded_sum)

    def aggregate(self, partial: Any) -> np.ndarray:
        """The counts, at least ``minlength`` long."""
        if partial is None:  # NumPy's empty input gives intp zeros, weights or not
            return np.zeros(self.minlength, np.intp)
        if len(partial) < self.minlength:
            out = np.zeros(self.minlength, self.out_dtype)
            out[: len(partial)] = partial
            return out
        return np.asarray(partial, self.out_dtype)

    def temp_bytes(self, rows: int) -> int:
        """The block's values as intp."""
        return 8 * rows + self.partial_bytes()

    def partial_bytes(self) -> int:
        """The counts up to ``minlength`` (unknown beyond it until computed)."""
        return 8 * self.minlength + 1024


def _padded_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b``, the shorter padded with zeros."""
    if len(a) < len(b):
        a, b = b, a
    out = a.copy()
    out[: len(b)] += b
    return out


@dataclass(frozen=True)
class BincountSpec(ReduceSpec):
    """``np.bincount(x, weights, minlength)``."""

    weighted: bool
    minlength: int

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return Bincount(self.weighted, self.minlength)

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...]]:
        return op.out_dtype, (None,)

    def label(self) -> str:
        extra = ["weights"] if self.weighted else []
        if self.minlength:
            extra.append(f"minlength={self.minlength}")
        return f"bincount({', '.join(extra)})"


# -- the functions ------------------------------------------------------------------------


def _field(table: np.ndarray, name: str) -> np.ndarray:
    """One output of the table, as its own array (placed by the budget when big)."""
    column = table[name]
    if column.nbytes < (1 << 20):
        return np.array(column)
    out = placement.array(column.shape, column.dtype)
    np.copyto(out, column)
    return out


def _field_of(table: graph.Node, name: str, label: str) -> Array:
    """A lazy field of a table whose length is known once computed (shape ``(None,
    ...)``, as a ``head`` of a masked array has)."""
    fields: dict[str, Any] = dict(np.dtype(table.dtype).fields or {})
    shape = (None, *fields[name][0].shape)
    return build.wrap(graph.Apply(_field, (table,), {"name": name}, name=label, shape=shape))


def _by_count(table: np.ndarray) -> np.ndarray:
    """The table most frequent first; ties keep the value order."""
    return table[np.argsort(-table["count"], kind="stable")]


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
        ranked = build.wrap(graph.Apply(_by_count, (table,), name="value_counts"))
    table_node = ranked._node
    return (
        _field_of(table_node, "value", "value_counts values"),
        _field_of(table_node, "count", "value_counts counts"),
    )


def _value_table(value: np.ndarray, axis: int | None) -> np.ndarray:
    uniq, counts = np.unique(value, return_counts=True, axis=axis)
    table = np.empty(len(counts), _table_dtype(uniq.dtype, uniq.shape[1:], ["value", "count"]))
    table["value"], table["count"] = uniq, counts
    return _by_count(table)


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
