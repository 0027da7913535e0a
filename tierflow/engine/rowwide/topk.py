"""The ``k`` largest values of each column, over all rows: the reduction behind
``tw.topk`` (:mod:`tierflow.engine.api.sort` checks its arguments and builds the lazy
result).

One pass: each block keeps the first ``k`` rows of each column in the stable
descending order (largest first, NaN after every number, equal values in their order),
found with ``np.partition`` (:func:`top`); partials merge in row order as blocks finish,
so memory is ``k`` rows per partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...operators import byteorder
from ...operators import sorting as kernels
from ...operators.types import combine_partials
from ..graph import specs
from ..graph.specs import Dtypes, Shapes, Values

__all__ = ["TopK", "TopKSpec", "top"]


def top(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` rows of each column of ``values`` (``[rows, columns]``) in the
    stable descending order: largest first, NaN after every number, equal values in
    their order in ``values``.

    ``np.partition`` finds each column's ``k``-th key; the keys below it and the first
    of those equal to it (by position, which is what keeps ``-0.0`` and ``0.0`` in
    their order) are the ``k`` kept, then sorted."""
    key = kernels.descending_key(values)
    if values.shape[0] > k:
        kth = np.partition(key, k - 1, axis=0)[k - 1]
        below, equal = key < kth, key == kth
        if key.dtype.kind == "f":
            nan = np.isnan(kth)
            below |= nan & ~np.isnan(key)
            equal |= nan & np.isnan(key)
        wanted = k - below.sum(axis=0)
        kept = below | (equal & (np.cumsum(equal, axis=0) <= wanted))
        width = values.shape[1]
        values = values.T[kept.T].reshape(width, k).T
        key = key.T[kept.T].reshape(width, k).T
    return np.take_along_axis(values, kernels.stable_order(key, axis=0), axis=0)


class TopK:
    """The reduction behind ``tw.topk``: each partial holds the first ``k`` of each
    column so far in the stable descending order (fewer while fewer rows were seen);
    partials combine in row order, which keeps equal values in their order."""

    n_inputs = 1
    row_independent = False
    commutative = False

    def __init__(self, k: int, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.k = k
        self.in_dtype = np.dtype(dtype)
        self.row_shape = tuple(row_shape)
        self.out_dtype = self.in_dtype
        self.out_shape = (k, *self.row_shape)

    def chunk(self, block: np.ndarray, row_offset: int = 0) -> np.ndarray | None:
        if block.shape[0] == 0:
            return None
        return top(block.reshape(block.shape[0], -1), self.k)

    def combine(self, a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
        return combine_partials(a, b, self._top_of_both)

    def _top_of_both(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return top(byteorder.join([a, b]), self.k)

    def aggregate(self, partial: np.ndarray | None) -> np.ndarray:
        rows = 0 if partial is None else partial.shape[0]
        if rows < self.k:
            raise ValueError(
                f"topk: k={self.k} is more than the {rows} rows of the array; ask for at "
                f"most {rows}"
            )
        assert partial is not None
        return partial.reshape(self.out_shape)

    def temp_bytes(self, rows: int) -> int:
        cells = rows * int(np.prod(self.row_shape, dtype=np.int64))
        return cells * (2 * self.in_dtype.itemsize + 8)

    def partial_bytes(self) -> int:
        return self.k * int(np.prod(self.row_shape, dtype=np.int64)) * self.in_dtype.itemsize


@dataclass(frozen=True)
class TopKSpec(specs.ReduceSpec):
    """Builds :class:`TopK` for a :class:`~tierflow.engine.graph.nodes.Reduce` node."""

    k: int

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> TopK:
        return TopK(self.k, dtypes[0], row_shapes[0])

    def label(self) -> str:
        return f"topk({self.k})"
