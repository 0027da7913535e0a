"""Tall-skinny QR over row blocks (TSQR): the ``R`` factor of an ``(N, k)`` array.

Each block's ``R`` comes from LAPACK's Householder QR (``np.linalg.qr(mode="r")``) in
float64; two partials merge as the ``R`` of the two stacked on each other, so a partial
is at most ``k x k`` whatever the number of rows. Every ``R`` is sign-normalised (its
diagonal non-negative): it is then unique for a full-rank array, which makes the merge
order irrelevant (``commutative``).

``with_ones=True`` factors ``[1 | x]`` instead of ``x``: its ``R`` holds the row count
(``R[0, 0]**2``), the column means (``R[0, 1:] / R[0, 0]``) and, in ``R[1:, 1:]``, the
``R`` of the centred ``x`` -- centring by orthogonal transformations, one pass, accurate
for data far from zero (what PCA needs).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._blocks import check_blocks
from .types import Partial, combine_partials

__all__ = ["TallQR", "positive_diagonal"]

_SUB_BYTES = 1 << 15  # float64 rows per LAPACK call: 32 KB (L1) for narrow arrays


def positive_diagonal(r: np.ndarray) -> np.ndarray:
    """``r`` with each row whose diagonal entry is negative negated (in place)."""
    n = min(r.shape)
    signs = np.where(np.diagonal(r)[:n] < 0, -1.0, 1.0)
    r[:n] *= signs[:, None]
    return r


class TallQR:
    """The ``R`` factor of the QR decomposition of the rows, as a ReductionOp.

    ``out_shape`` is ``(k, k)`` (``k`` the columns, plus one ``with_ones``); an array with
    fewer rows than columns gives the ``(rows, k)`` ``R`` NumPy's reduced QR gives. Raises
    ValueError for blocks that are not 2-D, TypeError for complex data.

    >>> op = TallQR(np.float64, (2,))
    >>> op.aggregate(op.chunk(np.array([[3.0, 1.0], [4.0, 2.0]])))
    array([[5. , 2.2],
           [0. , 0.4]])
    """

    row_independent = False
    commutative = True
    n_inputs = 1

    def __init__(
        self, in_dtype: Any, row_shape: tuple[int, ...], *, with_ones: bool = False
    ) -> None:
        self.in_dtype = np.dtype(in_dtype)
        self.in_row_shape = tuple(int(n) for n in row_shape)
        if len(self.in_row_shape) != 1:
            raise ValueError(
                f"a tall-skinny QR needs a 2-D array (N, k); got rows of shape {self.in_row_shape}"
            )
        if self.in_dtype.kind not in "biuf":
            raise TypeError(
                f"a tall-skinny QR of {self.in_dtype} data is not supported; convert to a real "
                "dtype, or compute() first"
            )
        self.with_ones = with_ones
        self.columns = self.in_row_shape[0] + (1 if with_ones else 0)
        self.out_dtype = np.dtype(np.float64)
        self.out_shape = (self.columns, self.columns)

    def __repr__(self) -> str:
        return f"TallQR({self.columns} columns{', with ones' if self.with_ones else ''})"

    def _r(self, stacked: np.ndarray) -> np.ndarray:
        return positive_diagonal(np.asarray(np.linalg.qr(stacked, mode="r")))

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """This block's ``R`` (None without rows), a sub-block at a time: the ``R`` so far
        stacked on the next rows and factored again, so LAPACK works in the cache."""
        rows = check_blocks(blocks, [self.in_dtype], [self.in_row_shape], "tall-skinny QR")
        if rows == 0:
            return None
        step = max(2 * self.columns, _SUB_BYTES // (8 * self.columns))
        top = self.columns
        buf = np.empty((top + min(step, rows), self.columns), np.float64)
        if self.with_ones:
            buf[:, 0] = 1.0
        first = self.columns - self.in_row_shape[0]
        r: np.ndarray | None = None
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            body = buf[top : top + stop - start]
            np.copyto(body[:, first:], blocks[0][start:stop], casting="unsafe")
            if r is None:
                r = np.asarray(np.linalg.qr(body, mode="r"))
            else:
                head = top - len(r)
                buf[head:top] = r
                r = np.asarray(np.linalg.qr(buf[head : top + stop - start], mode="r"))
        assert r is not None
        return positive_diagonal(r)

    def combine(self, a: Partial, b: Partial) -> Partial:
        """The ``R`` of two partials stacked."""
        return combine_partials(a, b, self._stacked)

    def _stacked(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._r(np.concatenate([a, b]))

    def aggregate(self, partial: Partial) -> np.ndarray:
        """``R``; an array with no rows gives a ``(0, k)`` R, as NumPy's reduced QR."""
        if partial is None:
            return np.zeros((0, self.columns))
        return np.asarray(partial)

    def temp_bytes(self, rows: int) -> int:
        """The sub-block buffer, LAPACK's copy of it, and a few ``R``."""
        step = max(2 * self.columns, _SUB_BYTES // (8 * self.columns))
        return 2 * (min(rows, step) + self.columns) * self.columns * 8 + 3 * self.partial_bytes()

    def partial_bytes(self) -> int:
        """Bytes of one ``R``."""
        return self.columns * self.columns * 8
