"""How often values occur, over all rows: the reductions behind ``np.unique``,
``np.bincount`` and ``tw.value_counts``, and the table they give. The NumPy functions
(their arguments, the lazy results) are :mod:`tierflow.engine.api.frequencies`.

``np.unique(x, return_index=, return_inverse=, return_counts=, axis=)`` on a lazy array
gives lazy results, identical to NumPy's (dtypes included, ``equal_nan=True``):

* the values (and counts, first indices) are one reduction (:class:`UniqueTable`):
  each block's ``np.unique``, merged as a tree and spilled to the SSD by value range
  when the distinct values outgrow a sixteenth of the RAM budget
  (:mod:`tierflow.engine.rowwide.distinct`). Its result is a *table*, a structured
  array with the fields ``value``, ``count`` and ``index`` that were asked for; each
  output is a field of it (:func:`table_field`), so asking for several costs one pass.
* the inverse is a lazy array with the input's rows (:class:`Inverse`): a second pass
  that looks each value up in the unique values (``np.searchsorted``), which it holds
  in memory.

Keys are single values of the flattened array (``axis=None``), or whole rows
(``axis=0`` on an array of two or more dimensions).

``np.bincount(x, weights=, minlength=)`` (:class:`Bincount`): one pass; each block's
counts are as long as its largest value, and partials grow to the longer one as they
merge. Negative values are refused with NumPy's message, and counts bigger than the RAM
budget before they are made.

``tw.value_counts(x)``: the table of ``np.unique(x, return_counts=True)`` most frequent
first, ties in value order (:func:`by_count`).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config import format_bytes
from ...errors import OutOfMemoryError
from ...operators import byteorder
from ...operators.types import block_bytes, combine_partials
from ...storage import placement, spill
from ...system import budget
from ..graph.specs import Dtypes, ReduceSpec, Shapes, Spec, Values
from . import distinct

__all__ = [
    "Bincount",
    "BincountSpec",
    "Inverse",
    "InverseSpec",
    "UniqueSpec",
    "UniqueTable",
    "by_count",
    "table_dtype",
    "table_field",
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


def table_dtype(dtype: np.dtype, row_shape: tuple[int, ...], fields: Sequence[str]) -> np.dtype:
    """The dtype of a table: a ``value`` field of ``dtype`` and ``row_shape``, then the
    other ``fields`` asked for (``count``, ``index``) as intp."""
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
        self.out_dtype = table_dtype(self.in_dtype, self.value_shape, fields)
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


# -- the table's outputs ----------------------------------------------------------------


def table_field(table: np.ndarray, name: str) -> np.ndarray:
    """One output of the table, as its own array (placed by the budget when big)."""
    column = table[name]
    if column.nbytes < (1 << 20):
        return np.array(column)
    out = placement.array(column.shape, column.dtype)
    np.copyto(out, column)
    return out


def by_count(table: np.ndarray) -> np.ndarray:
    """The table most frequent first; ties keep the value order."""
    return table[np.argsort(-table["count"], kind="stable")]
