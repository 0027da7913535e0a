"""Matrix products of row blocks with in-memory operands.

* ``x @ w`` with ``x`` of shape ``(N, ..., k)`` (2-D or more) and ``w`` of shape ``(k, m)``
  or ``(k,)``: row-independent, one BLAS call per block — :class:`Matmul`, a BlockOp.
* ``x @ w`` with a 1-D ``x`` of shape ``(N,)``, and ``w @ x`` for ``x`` of shape ``(N,)`` or
  ``(N, k)``: the product contracts the row axis, so it is a reduction —
  :class:`RowContraction`, a ReductionOp whose chunk multiplies a block with the matching
  rows (or columns) of ``w`` and whose combine adds.

Result dtypes follow ``np.matmul`` (bool @ bool is bool, int8 @ int8 is int8, mixed
dtypes promote). Integer products wrap exactly as NumPy's; float partial products of a
row contraction are summed in float64 (complex128) and cast at the end, so they differ
from NumPy's single BLAS call in the last bits. Shape errors name both shapes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._blocks import check_blocks, prepare_out
from .reductions import accumulator_dtype, partial_sum
from .types import Partial, combine_partials

__all__ = ["Matmul", "RowContraction", "matmul"]


def _frozen(w: Any) -> np.ndarray:
    array = np.array(w, copy=True)
    if array.dtype == object:
        raise TypeError("matmul needs a numeric w, got values of dtype object")
    array.flags.writeable = False
    return array


def _shape_text(rows: Any, row_shape: tuple[int, ...]) -> str:
    return "(" + ", ".join([str(rows), *map(str, row_shape)]) + ("," if not row_shape else "") + ")"


class Matmul:
    """``block @ w`` for row blocks with two or more dimensions: a BlockOp.

    Raises ValueError when the blocks' last axis does not match ``w``'s first, naming
    both shapes, and TypeError where NumPy's matmul has no loop for the dtypes.

    >>> op = Matmul(np.float32, (3,), np.ones((3, 2)))
    >>> op.out_dtype, op.out_row_shape
    (dtype('float64'), (2,))
    """

    row_independent = True
    n_inputs = 1

    def __init__(self, in_dtype: Any, row_shape: tuple[int, ...], w: Any) -> None:
        self.in_dtype = np.dtype(in_dtype)
        self.in_row_shape = tuple(int(n) for n in row_shape)
        self.w = _frozen(w)
        blocks = _shape_text("rows", self.in_row_shape)
        if not self.in_row_shape:
            raise ValueError(
                f"block @ w: the blocks have shape {blocks}, so the product contracts the row "
                "axis; use RowContraction (a reduction) for 1-D arrays"
            )
        if self.w.ndim not in (1, 2):
            raise ValueError(
                f"block @ w: w must be 1-D or 2-D, got w of shape {self.w.shape} "
                f"(blocks of shape {blocks})"
            )
        if self.in_row_shape[-1] != self.w.shape[0]:
            raise ValueError(
                f"block @ w: the blocks have shape {blocks} and w has shape {self.w.shape}; "
                f"the blocks' last axis ({self.in_row_shape[-1]}) must equal w's first axis "
                f"({self.w.shape[0]})"
            )
        probe = np.matmul(np.empty((0, *self.in_row_shape), self.in_dtype), self.w)
        self.out_dtype = probe.dtype
        self.out_row_shape = tuple(probe.shape[1:])

    def __repr__(self) -> str:
        return f"Matmul(@ {self.w.dtype} w of shape {self.w.shape})"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``block @ w``, written into ``out`` when given."""
        rows = check_blocks(blocks, [self.in_dtype], [self.in_row_shape], "block @ w")
        if out is not None:
            out = prepare_out(out, (rows, *self.out_row_shape), self.out_dtype, blocks, "block @ w")
        return np.matmul(blocks[0], self.w, out=out)

    def temp_bytes(self, rows: int) -> int:
        """A copy of the block, which matmul makes when the block is strided or its
        dtype differs from ``w``'s (a C-contiguous block of the same dtype needs none)."""
        return (
            rows
            * math.prod(self.in_row_shape)
            * max(self.in_dtype.itemsize, self.out_dtype.itemsize)
        )


class RowContraction:
    """A matrix product over the row axis of ``x`` (``N`` rows): a ReductionOp.

    ``side="right"``: ``x @ w`` for a 1-D ``x`` and ``w`` of shape ``(N,)`` or ``(N, m)``.
    ``side="left"``: ``w @ x`` for ``w`` of shape ``(N,)`` or ``(m, N)`` and ``x`` of shape
    ``(N,)`` or ``(N, k)``. Raises ValueError naming both shapes when they do not fit.

    >>> op = RowContraction(np.int64, (), np.arange(4), n_rows=4)
    >>> op.aggregate(op.combine(op.chunk(np.arange(2)), op.chunk(np.arange(2, 4), row_offset=2)))
    np.int64(14)
    """

    row_independent = False
    commutative = True
    n_inputs = 1

    def __init__(
        self,
        in_dtype: Any,
        row_shape: tuple[int, ...],
        w: Any,
        *,
        n_rows: int,
        side: str = "right",
    ) -> None:
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' (w @ x) or 'right' (x @ w), got {side!r}")
        self.in_dtype = np.dtype(in_dtype)
        self.in_row_shape = tuple(int(n) for n in row_shape)
        self.w = _frozen(w)
        self.n_rows = int(n_rows)
        self.side = side
        x_text = _shape_text(self.n_rows, self.in_row_shape)
        x_probe = np.empty((0, *self.in_row_shape), self.in_dtype)
        if side == "right":
            if self.in_row_shape:
                raise ValueError(f"x @ w with x of shape {x_text} is row-independent; use Matmul")
            contracted = self.w.shape[0] if self.w.ndim in (1, 2) else None
            text = f"x @ w: x has shape {x_text} and w has shape {self.w.shape}"
        else:
            if len(self.in_row_shape) > 1:
                raise ValueError(
                    f"w @ x with x of shape {x_text} multiplies stacked matrices, not the row "
                    "axis; x must be 1-D or 2-D"
                )
            contracted = self.w.shape[-1] if self.w.ndim in (1, 2) else None
            text = f"w @ x: w has shape {self.w.shape} and x has shape {x_text}"
        if contracted != self.n_rows:
            need = "w's first axis" if side == "right" else "w's last axis"
            raise ValueError(f"{text}; {need} must have the {self.n_rows} rows of x")
        pair = (x_probe, self._w_rows(0, 0)) if side == "right" else (self._w_rows(0, 0), x_probe)
        probe = np.matmul(*pair)
        self.out_dtype = probe.dtype
        self.out_shape = tuple(probe.shape)
        self.acc = accumulator_dtype(self.out_dtype)

    def __repr__(self) -> str:
        text = "x @ w" if self.side == "right" else "w @ x"
        return f"RowContraction({text}, w of shape {self.w.shape})"

    def _w_rows(self, start: int, stop: int) -> np.ndarray:
        return self.w[start:stop] if self.side == "right" else self.w[..., start:stop]

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The product of one block with the matching part of ``w`` (None without rows)."""
        rows = check_blocks(blocks, [self.in_dtype], [self.in_row_shape], "row contraction")
        if rows == 0:
            return None
        if row_offset < 0 or row_offset + rows > self.n_rows:
            raise ValueError(
                f"rows {row_offset}..{row_offset + rows} are outside x's {self.n_rows} rows"
            )
        part = self._w_rows(row_offset, row_offset + rows)
        pair = (blocks[0], part) if self.side == "right" else (part, blocks[0])
        return np.asarray(np.matmul(*pair)).astype(self.acc)

    def combine(self, a: Partial, b: Partial) -> Partial:
        """Add two partial products."""
        return combine_partials(a, b, partial_sum)

    def aggregate(self, partial: Partial) -> Any:
        """The product, in NumPy's dtype (a NumPy scalar for a 0-d result)."""
        if partial is None:
            partial = np.zeros(self.out_shape, self.acc)
        result = np.asarray(partial).astype(self.out_dtype)
        return result[()] if result.ndim == 0 else result

    def temp_bytes(self, rows: int) -> int:
        """The matmul's result and its accumulator copy."""
        return 3 * self.partial_bytes()

    def partial_bytes(self) -> int:
        """Bytes of one partial product."""
        return max(1, math.prod(self.out_shape)) * self.acc.itemsize


def matmul(
    in_dtype: Any, row_shape: tuple[int, ...], w: Any, *, n_rows: int
) -> Matmul | RowContraction:
    """``x @ w`` for ``x`` with ``n_rows`` rows of ``row_shape``: a Matmul for 2-D and wider
    ``x``, a RowContraction for 1-D ``x``."""
    if row_shape:
        return Matmul(in_dtype, row_shape, w)
    return RowContraction(in_dtype, row_shape, w, n_rows=n_rows, side="right")
