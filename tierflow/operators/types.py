"""Contracts of the operators layer: what the engine calls on one row block.

Arrays are chunked along axis 0 only; a *block* is rows ``[start, stop)`` of an array with
all trailing axes whole, and a block's *row shape* is its shape without axis 0. The engine
sees two kinds of operator:

* :class:`BlockOp` — row-independent: output row ``i`` depends on input row ``i`` only,
  and a block of ``rows`` rows gives ``rows`` rows out. Chains of them fuse into one task
  per block. Elementwise kernels, reductions over trailing axes only, ``block @ w`` and
  trailing-axis indexing are block ops.
* :class:`ReductionOp` — combines across rows: ``chunk`` turns one block into a small
  partial result, ``combine`` merges two partials as blocks finish (nothing is
  materialised), ``aggregate`` turns the last partial into the result. ``None`` is the
  partial of "no rows"; ``combine(None, p)`` is ``p`` and ``aggregate(None)`` gives
  NumPy's result for an array with no rows. The engine never calls ``chunk`` on a
  block without rows (a mask that kept none of a block's rows): that block's partial
  is None. An operator whose partials must see every block, empty or not (a count per
  block, a user's reduction), says so with ``sees_empty_blocks = True``. Called
  directly, ``chunk`` of an empty block gives None.

Memory is planned from these objects alone: ``temp_bytes(rows)`` is the peak of scratch
an operator allocates while it runs on ``rows`` rows, beyond its input blocks and its
output block (which the scheduler counts from ``block_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

__all__ = ["BlockOp", "Partial", "ReductionOp", "block_bytes", "combine_partials"]

Partial = Any
"""A reduction's partial result: small (independent of the number of rows), picklable."""

P = TypeVar("P")


@runtime_checkable
class BlockOp(Protocol):
    """A row-independent operator on ``n_inputs`` row blocks with equal numbers of rows."""

    n_inputs: int
    out_dtype: np.dtype
    out_row_shape: tuple[int, ...]
    row_independent: bool  # always True: tells a BlockOp from a ReductionOp

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The output block; written into ``out`` (shape and dtype checked) when given."""
        ...

    def temp_bytes(self, rows: int) -> int:
        """Peak scratch bytes of one ``apply`` on ``rows`` rows (inputs, output excluded)."""
        ...


@runtime_checkable
class ReductionOp(Protocol):
    """A reduction over the row axis, as chunk / combine / aggregate.

    ``combine`` is associative; when ``commutative`` is False the engine only combines
    partials of adjacent row ranges, left before right. ``out_dtype`` and ``out_shape``
    describe the aggregated result (None where a user reduction did not say).
    """

    n_inputs: int
    out_dtype: np.dtype | None
    out_shape: tuple[int, ...] | None
    row_independent: bool  # always False
    commutative: bool

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The partial of one block whose first row is row ``row_offset`` of the array."""
        ...

    def combine(self, a: Partial, b: Partial) -> Partial:
        """Merge two partials; never modifies either argument."""
        ...

    def aggregate(self, partial: Partial) -> Any:
        """The final result from the partial of all rows."""
        ...

    def temp_bytes(self, rows: int) -> int:
        """Peak scratch bytes of one ``chunk`` on ``rows`` rows."""
        ...

    def partial_bytes(self) -> int:
        """Bytes one partial holds while it waits to be combined."""
        ...


def block_bytes(rows: int, row_shape: tuple[int, ...], dtype: np.dtype | type | str) -> int:
    """Bytes of a C-contiguous block of ``rows`` rows.

    >>> block_bytes(1000, (8,), "float32")
    32000
    """
    return int(rows) * math.prod(row_shape) * np.dtype(dtype).itemsize


def combine_partials(a: P, b: P, merge: Callable[[Any, Any], P]) -> P:
    """``merge(a, b)``, with None (the partial of no rows) as the identity: the
    ``combine`` of every :class:`ReductionOp`, which gives its own ``merge`` (called
    with two partials, neither None).

    >>> combine_partials(None, [1], list.__add__), combine_partials([1], [2], list.__add__)
    ([1], [1, 2])
    """
    if a is None:
        return b
    if b is None:
        return a
    return merge(a, b)
