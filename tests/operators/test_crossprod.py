"""Co-moments of row blocks (np.cov's reduction), against NumPy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tierflow.operators.crossprod import CoMoments


def _cov(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    op = CoMoments([x.dtype, y.dtype], [x.shape[1:], y.shape[1:]], ddof=1)
    return op.aggregate(op.chunk(x, y))


@pytest.mark.parametrize("y_columns", [1, 3])
def test_one_row_of_y_is_taken_as_numpy_takes_it(y_columns: int) -> None:
    # NumPy leaves a one-row y as it is (not transposed): with several columns it does
    # not join x's variables, and NumPy raises.
    x, y = np.arange(2.0).reshape(1, 2), np.arange(y_columns, dtype=np.float64)[None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = np.cov(x, y, rowvar=False)
        except ValueError as exc:
            with pytest.raises(ValueError, match=str(exc)):
                _cov(x, y)
            return
        got = _cov(x, y)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_two_rows_of_y_join_xs_variables() -> None:
    x, y = np.array([[1.0, 2.0], [3.0, 5.0]]), np.array([[2.0, 0.0, 1.0], [1.0, 4.0, 1.0]])
    np.testing.assert_allclose(_cov(x, y), np.cov(x, y, rowvar=False), rtol=1e-14)
