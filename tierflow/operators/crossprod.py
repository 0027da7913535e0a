"""Products across the rows: ``x.T @ y``, ``x.T @ x`` and co-moments (covariance).

* :class:`CrossProduct` — ``x.T @ y`` (two inputs) or ``x.T @ x`` (one input, computed
  once per block as a symmetric product) for ``x`` of shape ``(N, k)`` and ``y`` of shape
  ``(N,)`` or ``(N, m)``: a ReductionOp whose partials are ``[k, m]`` and add.
* :class:`CoMoments` — the count, mean and centred cross-products of the columns of one
  or two row-aligned arrays (``np.cov(x, y, rowvar=False)``): each block centred on a
  shift (its first rows' mean), blocks merged with Chan's pairwise update for
  co-moments.

Float and complex products accumulate in float64 (complex128), one cache-sized sub-block
at a time through a reused buffer; the result is cast to NumPy's dtype at the end
(``np.matmul``'s for products, so float32 in, float32 out). Integer and bool products
wrap exactly as NumPy's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._blocks import check_blocks
from .reductions import accumulator_dtype, partial_sum
from .types import Partial, combine_partials

__all__ = ["CoMoments", "CrossProduct"]

_SUB_BYTES = 1 << 21  # float64 scratch per sub-block: stays in L2 while it is multiplied


def _columns(row_shape: tuple[int, ...]) -> int:
    """Columns a block of ``row_shape`` contributes: 1 for a 1-D array, ``k`` for 2-D."""
    return row_shape[0] if row_shape else 1


def _sub_rows(columns: int) -> int:
    return max(1, _SUB_BYTES // (16 * max(1, columns)))


class CrossProduct:
    """``x.T @ y`` over the rows (``N``) of ``x`` ``(N, k)`` and ``y`` ``(N,)``/``(N, m)``.

    ``symmetric=True`` takes one input and gives ``x.T @ x``, each block's product
    computed once (NumPy's ``dot`` of a matrix with its own transpose is a BLAS syrk).
    Raises ValueError for inputs that are not 2-D (x) and 1-D or 2-D (y).

    >>> op = CrossProduct([np.float32], [(2,)], symmetric=True)
    >>> op.aggregate(op.chunk(np.array([[1, 2], [3, 4]], np.float32)))
    array([[10., 14.],
           [14., 20.]], dtype=float32)
    """

    row_independent = False
    commutative = True

    def __init__(
        self, dtypes: list[Any], row_shapes: list[tuple[int, ...]], *, symmetric: bool
    ) -> None:
        self.symmetric = symmetric
        self.n_inputs = 1 if symmetric else 2
        if len(dtypes) != self.n_inputs:
            raise ValueError(f"x.T @ y takes {self.n_inputs} block(s), got {len(dtypes)}")
        self.in_dtypes = [np.dtype(d) for d in dtypes]
        self.in_row_shapes = [tuple(int(n) for n in s) for s in row_shapes]
        x_shape = self.in_row_shapes[0]
        y_shape = self.in_row_shapes[-1]
        if len(x_shape) != 1 or len(y_shape) > 1:
            raise ValueError(
                f"x.T @ y needs x of shape (N, k) and y of shape (N,) or (N, m); got rows of "
                f"shape {x_shape} and {y_shape}"
            )
        probe = np.matmul(
            np.empty((x_shape[0], 0), self.in_dtypes[0]),
            np.empty((0, *y_shape), self.in_dtypes[-1]),
        )
        self.out_dtype = probe.dtype
        self.out_shape = tuple(probe.shape)
        self.acc = accumulator_dtype(self.out_dtype)

    def __repr__(self) -> str:
        return "CrossProduct(x.T @ x)" if self.symmetric else "CrossProduct(x.T @ y)"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """This block's ``x.T @ y`` in the accumulator dtype (None without rows)."""
        rows = check_blocks(blocks, self.in_dtypes, self.in_row_shapes, "x.T @ y")
        if rows == 0:
            return None
        if self.acc.kind not in "fc":
            x = blocks[0]
            return np.asarray(np.matmul(x.T, x if self.symmetric else blocks[1]), self.acc)
        columns = sum(_columns(s) for s in self.in_row_shapes)
        step = _sub_rows(columns)
        total = np.zeros(self.out_shape, self.acc)
        x_buf = np.empty((min(step, rows), *self.in_row_shapes[0]), self.acc)
        y_buf = None if self.symmetric else np.empty((len(x_buf), *self.in_row_shapes[1]), self.acc)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            x = x_buf[: stop - start]
            np.copyto(x, blocks[0][start:stop], casting="unsafe")
            if y_buf is None:
                total += np.dot(x.T, x)
            else:
                y = y_buf[: stop - start]
                np.copyto(y, blocks[1][start:stop], casting="unsafe")
                total += np.dot(x.T, y)
        return total

    def combine(self, a: Partial, b: Partial) -> Partial:
        """Add two partial products."""
        return combine_partials(a, b, partial_sum)

    def aggregate(self, partial: Partial) -> np.ndarray:
        """The product, in NumPy's dtype (zeros for no rows, as NumPy gives)."""
        if partial is None:
            partial = np.zeros(self.out_shape, self.acc)
        return np.asarray(partial).astype(self.out_dtype)

    def temp_bytes(self, rows: int) -> int:
        """The sub-block buffers and one product."""
        columns = sum(_columns(s) for s in self.in_row_shapes)
        return min(rows, _sub_rows(columns)) * columns * 16 + 2 * self.partial_bytes()

    def partial_bytes(self) -> int:
        """Bytes of one partial product."""
        return max(1, math.prod(self.out_shape)) * self.acc.itemsize


class CoMoments:
    """The covariance of the columns of one or two arrays with ``N`` rows, as NumPy's
    ``np.cov(x, y, rowvar=False, ddof=ddof)`` gives it (``x`` and ``y`` 1-D or 2-D; their
    columns side by side are the variables).

    A partial is ``(count, shift, offset, comoments)``: the mean is ``shift + offset``
    (a first estimate and its correction, kept apart so two block means near 1e9 still
    subtract exactly), ``comoments`` the centred cross-products. Blocks merge with
    Chan's update ``C = Ca + Cb + d d^H · na nb / n`` with ``d`` the difference of the
    means. ``out_dtype`` is NumPy's: float64 unless the input is complex (complex128) or
    long double; a 0-d result when there is one variable.
    """

    row_independent = False
    commutative = True

    def __init__(
        self,
        dtypes: list[Any],
        row_shapes: list[tuple[int, ...]],
        *,
        ddof: int,
        dtype: Any = None,
    ) -> None:
        self.n_inputs = len(dtypes)
        self.in_dtypes = [np.dtype(d) for d in dtypes]
        self.in_row_shapes = [tuple(int(n) for n in s) for s in row_shapes]
        if any(len(s) > 1 for s in self.in_row_shapes):
            raise ValueError(
                f"np.cov takes 1-D or 2-D arrays; got rows of shape {self.in_row_shapes}"
            )
        self.ddof = int(ddof)
        natural = np.result_type(*self.in_dtypes, np.float64)
        self.out_dtype = np.dtype(dtype) if dtype is not None else natural
        self.acc = accumulator_dtype(natural)
        self.columns = sum(_columns(s) for s in self.in_row_shapes)
        # NumPy squeezes the matrix: one variable gives a 0-d result.
        self.out_shape: tuple[int, ...] = () if self.columns == 1 else (self.columns, self.columns)

    def __repr__(self) -> str:
        return f"CoMoments({self.columns} variables, ddof={self.ddof})"

    def _centre(
        self, blocks: tuple[np.ndarray, ...], start: int, stop: int, shift: Any, out: np.ndarray
    ) -> None:
        """Rows ``[start, stop)`` of the blocks side by side, minus ``shift``, into ``out``
        (one pass: the cast to the accumulator dtype and the subtraction together)."""
        at = 0
        for block in blocks:
            piece = block[start:stop]
            width = _columns(block.shape[1:])
            np.subtract(
                piece.reshape(len(piece), width),
                shift[at : at + width],
                out=out[:, at : at + width],
                casting="unsafe",
            )
            at += width

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """This block's (count, shift, offset, comoments) (None without rows).

        The shift is the mean of the block's first sub-block; every sub-block is
        centred on it while it is cast, and its sums (``ones @ dev``) and cross-products
        (``dev.T @ dev``, BLAS) are added up; the co-moments about the block's mean are
        then ``C - n d d^H`` with ``d`` the mean deviation, which is small against the
        data's spread (the shift is a mean of the same data), so nothing cancels."""
        rows = check_blocks(blocks, self.in_dtypes, self.in_row_shapes, "np.cov")
        if rows == 0:
            return None
        step = _sub_rows(self.columns)
        buf = np.empty((min(step, rows), self.columns), self.acc)
        zero = np.zeros(self.columns, self.acc)
        self._centre(blocks, 0, len(buf), zero, buf)
        shift = buf.sum(axis=0) / len(buf)
        ones = np.ones(len(buf), self.acc)
        sums = np.zeros(self.columns, self.acc)
        products = np.zeros((self.columns, self.columns), self.acc)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            dev = buf[: stop - start]
            self._centre(blocks, start, stop, shift, dev)
            sums += ones[: len(dev)] @ dev
            products += dev.T @ (dev.conj() if dev.dtype.kind == "c" else dev)
        offset = sums / rows
        comoments = products - rows * np.outer(offset, offset.conj())
        return (rows, shift, offset, comoments)

    def combine(self, a: Partial, b: Partial) -> Partial:
        """Chan's merge of two partials (neither is modified)."""
        return combine_partials(a, b, _chan)

    def means(self, partial: Partial) -> np.ndarray:
        """The column means of a partial."""
        _, shift, offset, _ = partial
        return np.asarray(shift + offset)

    def aggregate(self, partial: Partial) -> np.ndarray:
        """The covariance matrix (a 0-d array for one variable), NaN or inf where NumPy
        gives them (no rows, or ``ddof`` >= the rows), with NumPy's warnings: over no
        rows NumPy's own ``np.cov`` of no rows; else NumPy's last steps (the co-moments
        times ``1 / (n - ddof)``)."""
        if partial is None:
            empty = np.empty((0, self.columns), np.result_type(*self.in_dtypes))
            result = np.cov(empty, rowvar=False, ddof=self.ddof, dtype=self.out_dtype)
            return np.asarray(result).reshape(self.out_shape)
        count, _, _, comoments = partial
        self._check_one_row(count)
        divisor = count - self.ddof
        if divisor <= 0:
            import warnings

            warnings.warn("Degrees of freedom <= 0 for slice", RuntimeWarning, stacklevel=2)
            divisor = 0
        result = comoments * np.true_divide(1, divisor)
        return np.asarray(result).reshape(self.out_shape).astype(self.out_dtype)

    def _check_one_row(self, count: int) -> None:
        """NumPy's error for ``np.cov(x, y, rowvar=False)`` where ``y`` has one row of
        several columns: NumPy takes a one-row ``y`` as it is (one row, one variable per
        column: it transposes only ``y`` of other shapes), which does not join x's
        variables."""
        if count != 1 or self.n_inputs != 2:
            return
        y_shape = self.in_row_shapes[1]
        if len(y_shape) == 1 and y_shape[0] != 1:
            raise ValueError(
                "all the input array dimensions except for the concatenation axis must "
                "match exactly, but along dimension 1, the array at index 0 has size 1 and "
                f"the array at index 1 has size {y_shape[0]}"
            )

    def temp_bytes(self, rows: int) -> int:
        """The sub-block buffer and a few products."""
        return min(rows, _sub_rows(self.columns)) * self.columns * 16 + 4 * self.partial_bytes()

    def partial_bytes(self) -> int:
        """Bytes of one partial: the co-moments and two means."""
        return (self.columns + 2) * self.columns * self.acc.itemsize


def _chan(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    """Chan's merge of the co-moments of two row ranges ``(rows, shift, offset,
    comoments)``: the means moved by the difference, the products by its outer product."""
    na, shift_a, offset_a, c_a = a
    nb, shift_b, offset_b, c_b = b
    n = na + nb
    delta = (shift_b - shift_a) + (offset_b - offset_a)
    return (
        n,
        shift_a,
        offset_a + delta * (nb / n),
        c_a + c_b + np.outer(delta, delta.conj()) * (na * nb / n),
    )
