"""Matrix products of row blocks: NumPy's dtypes, shape errors, row contractions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tierflow.operators.linalg import Matmul, RowContraction, matmul
from tierflow.operators.types import BlockOp, ReductionOp

from .helpers import random_array, run_blockwise

PAIRS = [
    (bool, bool),
    (np.int8, np.int8),
    (np.uint8, np.int16),
    (np.int32, np.float32),
    (np.float32, np.float32),
    (np.float32, np.float64),
    (np.float16, np.float16),
    (np.int64, bool),
]


@pytest.mark.parametrize(("x_dtype", "w_dtype"), PAIRS)
@pytest.mark.parametrize("w_shape", [(5, 3), (5,)])
def test_block_matmul_matches_numpy(x_dtype: Any, w_dtype: Any, w_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x = random_array(rng, np.dtype(x_dtype), (37, 5))
    w = random_array(rng, np.dtype(w_dtype), w_shape)
    op = Matmul(x_dtype, (5,), w)
    assert isinstance(op, BlockOp)
    got = run_blockwise(op, x, 8)
    want = x @ w
    assert op.out_dtype == want.dtype
    assert op.out_row_shape == want.shape[1:]
    assert got.dtype == want.dtype
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
    else:
        tol = 1e-2 if want.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_stacked_blocks_and_out() -> None:
    x = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4)
    w = np.ones((4, 2))
    op = Matmul(np.float64, (3, 4), w)
    out = np.empty((2, 3, 2))
    assert op.apply(x, out=out) is out
    np.testing.assert_array_equal(out, x @ w)
    assert op.temp_bytes(10) == 10 * 12 * 8


def test_shape_errors_name_both_shapes() -> None:
    with pytest.raises(
        ValueError,
        match=r"the blocks have shape \(rows, 8\) and w has shape \(3, 4\); the blocks' last axis \(8\) must equal w's first axis \(3\)",
    ):
        Matmul(np.float32, (8,), np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"w must be 1-D or 2-D, got w of shape \(2, 2, 2\)"):
        Matmul(np.float32, (2,), np.ones((2, 2, 2)))
    with pytest.raises(ValueError, match=r"shape \(rows,\), so the product contracts the row axis"):
        Matmul(np.float32, (), np.ones(3))
    with pytest.raises(TypeError, match="numeric w"):
        Matmul(np.float32, (1,), np.array([object()]))
    op = Matmul(np.float32, (3,), np.ones(3))
    with pytest.raises(ValueError, match="built for block 0 of dtype float32"):
        op.apply(np.ones((2, 3)))


def test_w_is_copied() -> None:
    w = np.ones((2, 2))
    op = Matmul(np.float64, (2,), w)
    w[:] = 5
    np.testing.assert_array_equal(op.apply(np.eye(2)), np.ones((2, 2)))


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"), [(np.int64, np.int64), (np.float32, np.float32), (np.int8, np.float64)]
)
@pytest.mark.parametrize("w_shape", [(40,), (40, 3)])
def test_one_dimensional_x_times_w_is_a_reduction(
    x_dtype: Any, w_dtype: Any, w_shape: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(1)
    x = random_array(rng, np.dtype(x_dtype), (40,), wide_ints=True)
    w = random_array(rng, np.dtype(w_dtype), w_shape, wide_ints=True)
    op = matmul(x_dtype, (), w, n_rows=40)
    assert isinstance(op, RowContraction)
    assert isinstance(op, ReductionOp)
    got = run_blockwise(op, x, 7, rng)
    want = x @ w
    assert type(got) is type(want)
    assert np.asarray(got).dtype == want.dtype
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)  # wraps exactly like NumPy
    else:
        exact = x.astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_allclose(got, exact.astype(want.dtype), rtol=1e-6)


@pytest.mark.parametrize(
    ("w_shape", "x_shape"), [((4, 30), (30, 2)), ((30,), (30, 2)), ((4, 30), (30,)), ((30,), (30,))]
)
def test_w_times_x_contracts_rows(w_shape: tuple[int, ...], x_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(2)
    w = rng.random(w_shape)
    x = rng.random(x_shape).astype(np.float32)
    op = RowContraction(np.float32, x_shape[1:], w, n_rows=30, side="left")
    got = run_blockwise(op, x, 4, rng)
    want = w @ x
    assert np.asarray(got).dtype == want.dtype
    assert op.out_shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_row_contraction_errors() -> None:
    with pytest.raises(
        ValueError,
        match=r"x @ w: x has shape \(10,\) and w has shape \(9, 2\); w's first axis must have the 10 rows of x",
    ):
        RowContraction(np.float32, (), np.ones((9, 2)), n_rows=10)
    with pytest.raises(
        ValueError, match=r"w @ x: w has shape \(2, 9\) and x has shape \(10, 3\); w's last axis"
    ):
        RowContraction(np.float32, (3,), np.ones((2, 9)), n_rows=10, side="left")
    with pytest.raises(ValueError, match="is row-independent; use Matmul"):
        RowContraction(np.float32, (3,), np.ones((3, 2)), n_rows=10)
    with pytest.raises(ValueError, match="multiplies stacked matrices"):
        RowContraction(np.float32, (3, 2), np.ones(10), n_rows=10, side="left")
    with pytest.raises(ValueError, match="side must be"):
        RowContraction(np.float32, (), np.ones(10), n_rows=10, side="up")
    op = RowContraction(np.float64, (), np.ones(10), n_rows=10)
    with pytest.raises(ValueError, match=r"rows 8\.\.12 are outside x's 10 rows"):
        op.chunk(np.ones(4), row_offset=8)
    assert op.aggregate(op.chunk(np.empty(0))) == 0.0
