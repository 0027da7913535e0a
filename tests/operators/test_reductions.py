"""Reductions against NumPy: every kind, axis form, keepdims, dtype, ddof, NaN and empty case."""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.operators import reductions
from tierflow.operators.reductions import (
    KINDS,
    Histogram,
    Reduction,
    ReductionOptions,
    RowReduction,
    RowwiseReduction,
    accumulator_dtype,
    reduce_rows,
    reduction,
)
from tierflow.operators.types import BlockOp, ReductionOp

from .helpers import DTYPES, random_array, run_blockwise, with_nans
from common import examples

EXACT = {"min", "max", "any", "all", "count_nonzero", "argmin", "argmax"}
DTYPE_CHOICES: dict[str, list[Any]] = {
    "sum": [None, np.float64, np.float32, np.int64],
    "prod": [None, np.float64, np.int64],
    "mean": [None, np.float64, np.float32],
    "var": [None, np.float64, np.float32],
    "std": [None, np.float64],
}


def _numpy(kind: str, x: np.ndarray, kwargs: dict[str, Any]) -> Any:
    return getattr(np, kind)(x, **kwargs)


def _eps(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps) if dtype.kind in "fc" else 0.0


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    row_shape = draw(st.sampled_from([(), (3,), (0,), (2, 3), (4, 1), (2, 0), (1, 2, 2)]))
    ndim = len(row_shape) + 1
    if kind in ("argmin", "argmax"):
        axis = draw(st.one_of(st.none(), st.integers(-ndim, ndim - 1)))
    else:
        chosen = sorted(draw(st.sets(st.integers(0, ndim - 1), min_size=0, max_size=ndim)))
        signed = tuple(a - ndim if draw(st.booleans()) else a for a in chosen)
        axis = draw(st.sampled_from([None, signed] + ([signed[0]] if len(signed) == 1 else [])))
    kwargs: dict[str, Any] = {"axis": axis, "keepdims": draw(st.booleans())}
    if kind in DTYPE_CHOICES:
        kwargs["dtype"] = draw(st.sampled_from(DTYPE_CHOICES[kind]))
    if kind in ("var", "std"):
        kwargs["ddof"] = draw(st.sampled_from([0, 1, 2]))
    return {
        "kind": kind,
        "dtype": dtype,
        "row_shape": row_shape,
        "kwargs": kwargs,
        "rows": draw(st.integers(0, 30)),
        "block_rows": draw(st.integers(1, 13)),
        "nan": dtype.kind == "f" and draw(st.booleans()),
        "wide_ints": draw(st.booleans()),
        "strided": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _data(case: dict[str, Any]) -> np.ndarray:
    rng = np.random.default_rng(case["seed"])
    shape = (case["rows"], *case["row_shape"])
    strided = case["strided"] and case["row_shape"]
    made = (*shape[:-1], shape[-1] * 2) if strided else shape
    values = random_array(rng, case["dtype"], made, wide_ints=case["wide_ints"])
    if case["nan"]:
        with_nans(rng, values, 0.15)
    return values[..., ::2] if strided else values


@settings(max_examples=examples(400), deadline=None)
@given(case=_cases())
def test_every_reduction_matches_numpy(case: dict[str, Any]) -> None:
    kind, kwargs = case["kind"], case["kwargs"]
    x = _data(case)
    rng = np.random.default_rng(case["seed"])
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        want: Any = None
        want_error: Exception | None = None
        try:
            want = _numpy(kind, x, kwargs)
        except (ValueError, TypeError) as exc:
            want_error = exc
        if want_error is not None:
            with pytest.raises(type(want_error)) as raised:
                op = reduction(kind, x.dtype, x.shape[1:], **kwargs)
                run_blockwise(op, x, case["block_rows"], rng)
            assert str(raised.value) == str(want_error)
            return
        op = reduction(kind, x.dtype, x.shape[1:], **kwargs)
        got = run_blockwise(op, x, case["block_rows"], rng)
    want_array, got_array = np.asarray(want), np.asarray(got)
    assert type(got) is type(want)
    assert got_array.dtype == want_array.dtype
    assert got_array.shape == want_array.shape
    if op.row_independent:
        assert got_array.shape[1:] == op.out_row_shape
    else:
        assert got_array.shape == op.out_shape
        assert got_array.dtype == op.out_dtype
    result_dtype = want_array.dtype
    if op.row_independent or kind in EXACT or result_dtype.kind in "biu":
        # Row-independent reductions are NumPy itself on each block: bitwise equal.
        np.testing.assert_array_equal(got_array, want_array)
        return
    # Float results: compare to NumPy in float64 (our accumulators are float64), cast to
    # NumPy's result dtype; and loosely to NumPy itself, whose float32 sums are coarser.
    oracle_kwargs = dict(kwargs)
    if oracle_kwargs.get("dtype") is not None:
        oracle_kwargs["dtype"] = np.float64
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        oracle = np.asarray(_numpy(kind, x.astype(np.float64), oracle_kwargs))
        scale = float(np.nanmax(np.abs(x.astype(np.float64)), initial=1.0)) * max(1, x.size)
        if kind == "prod":
            scale = np.abs(oracle)
        if kind in ("var", "std"):
            scale = scale * scale if kind == "var" else scale
        # The largest magnitude, NaN left out: a product's scale is its own magnitude,
        # which may be NaN or, without elements, empty.
        largest = float(np.fmax.reduce(np.ravel(scale), initial=0.0))
        rtol = 4 * _eps(result_dtype)
        np.testing.assert_allclose(
            got_array, oracle.astype(result_dtype), rtol=rtol, atol=1e-12 * largest
        )
        loose = {"f": {2: 2e-2, 4: 1e-5, 8: 1e-12}}[result_dtype.kind][result_dtype.itemsize]
        # Where NumPy's own arithmetic in a narrow dtype went non-finite on its own (a
        # float32 sum of squares of wide integers overflows; the float32 rounding of one
        # value minus its float64 mean divides by ddof == count to inf), the float64
        # oracle, already matched above, is the reference.
        narrow_only = ~np.isfinite(want_array) & ~(oracle.astype(result_dtype) == want_array)
        np.testing.assert_allclose(
            np.where(narrow_only, 0, got_array),
            np.where(narrow_only, 0, want_array),
            rtol=loose,
            atol=loose * largest,
        )


def test_default_result_dtypes_are_numpys() -> None:
    def out(kind: str, in_dtype: Any, **kwargs: Any) -> np.dtype:
        return reduction(kind, in_dtype, (3,), **kwargs).out_dtype

    assert out("sum", np.int8) == np.int64
    assert out("sum", np.uint8) == np.uint64
    assert out("sum", bool) == np.int64
    assert out("sum", np.float32) == np.float32
    assert out("mean", np.int16) == np.float64
    assert out("mean", np.float16) == np.float16
    assert out("var", np.complex64) == np.float32
    assert out("prod", np.int32) == np.int64
    assert out("count_nonzero", np.float32, axis=0) == np.intp
    assert out("argmax", np.float32) == np.intp
    assert out("sum", np.int8, dtype=np.int8) == np.int8


def test_accumulators() -> None:
    assert accumulator_dtype(np.dtype(np.float16)) == np.float64
    assert accumulator_dtype(np.dtype(np.float32)) == np.float64
    assert accumulator_dtype(np.dtype(np.complex64)) == np.complex128
    assert accumulator_dtype(np.dtype(np.int8)) == np.int8


def test_integer_sums_wrap_exactly_like_numpy() -> None:
    x = np.full((7, 2), 2**62, dtype=np.int64)
    for block_rows in (1, 2, 3):
        op = reduction("sum", np.int64, (2,), axis=0)
        np.testing.assert_array_equal(run_blockwise(op, x, block_rows), x.sum(axis=0))
    small = np.full((300,), 100, dtype=np.int8)
    op = reduction("sum", np.int8, (), dtype=np.int8)
    assert run_blockwise(op, small, 7) == small.sum(dtype=np.int8)
    prod = reduction("prod", np.int64, ())
    big = np.arange(1, 40, dtype=np.int64)
    assert run_blockwise(prod, big, 5) == big.prod()


def test_float32_sums_use_float64_partials() -> None:
    # 2**24 + 1 is not a float32: a float32 accumulator stalls at 2**24, ours does not.
    x = np.ones((2**24 + 64, 1), dtype=np.float32)
    op = reduction("sum", np.float32, (1,), axis=0)
    assert run_blockwise(op, x, 2**22)[0] == np.float32(2**24 + 64)


def test_variance_merge_is_numerically_sound() -> None:
    rng = np.random.default_rng(7)
    x = 1e9 + rng.standard_normal((10_000, 3))
    op = reduction("var", np.float64, (3,), axis=0, ddof=1)
    got = run_blockwise(op, x, 777, rng)
    wide = x.astype(np.longdouble)
    two_pass = ((wide - wide.mean(axis=0)) ** 2).sum(axis=0) / (x.shape[0] - 1)
    np.testing.assert_allclose(got, two_pass.astype(np.float64), rtol=1e-11)
    naive = ((x**2).sum(axis=0) - x.sum(axis=0) ** 2 / x.shape[0]) / (x.shape[0] - 1)
    assert np.max(np.abs(naive - two_pass)) > 1e-3  # what a sum of squares would give


def test_complex_variance() -> None:
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((100, 2)) + 1j * rng.standard_normal((100, 2))).astype(np.complex64)
    op = reduction("std", np.complex64, (2,), axis=0)
    got = run_blockwise(op, x, 13, rng)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np.std(x.astype(np.complex128), axis=0), rtol=1e-6)


@pytest.mark.parametrize("kind", ["var", "std"])
@pytest.mark.parametrize("axis", [0, None, (0, 2)])
def test_complex_variance_with_a_real_dtype_is_numpys_real_mean_quirk(kind: str, axis: Any) -> None:
    # NumPy sums the mean in the real dtype= (the real parts, a ComplexWarning) and takes
    # the complex deviations from it: the imaginary parts count whole, not their spread.
    rng = np.random.default_rng(9)
    x = rng.standard_normal((60, 2, 3)) + 1j * (5 + rng.standard_normal((60, 2, 3)))
    x[7, 1, 2] = complex(1.0, np.inf)
    op = reduction(kind, np.complex128, (2, 3), axis=axis, dtype=np.float64, ddof=1)
    with pytest.warns(np.exceptions.ComplexWarning):
        got = run_blockwise(op, x, 7, rng)
    with pytest.warns(np.exceptions.ComplexWarning):
        want = getattr(np, kind)(x, axis=axis, dtype=np.float64, ddof=1)
    assert np.asarray(got).dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_nan_propagates_and_argmax_finds_the_first_nan() -> None:
    x = np.arange(20, dtype=np.float64).reshape(10, 2)
    x[6, 1] = np.nan
    x[3, 1] = np.nan
    x[8, 0] = np.nan
    rng = np.random.default_rng(9)
    for kind in ("sum", "min", "max", "mean", "var"):
        got = run_blockwise(reduction(kind, np.float64, (2,), axis=0), x, 3, rng)
        assert np.isnan(got).all(), kind
    for kind in ("argmax", "argmin"):
        for axis in (None, 0):
            op = reduction(kind, np.float64, (2,), axis=axis)
            for _ in range(5):
                want = getattr(np, kind)(x, axis=axis)
                np.testing.assert_array_equal(run_blockwise(op, x, 2, rng), want)


def test_argmin_ties_go_to_the_first_occurrence_in_any_combine_order() -> None:
    x = np.zeros((12, 3), dtype=np.int16)
    x[[2, 5, 9], :] = -1
    rng = np.random.default_rng(10)
    for axis in (None, 0):
        op = reduction("argmin", np.int16, (3,), axis=axis)
        for _ in range(10):
            np.testing.assert_array_equal(run_blockwise(op, x, 2, rng), np.argmin(x, axis=axis))


def test_argmax_keepdims_and_global_flat_index() -> None:
    x = np.zeros((9, 2, 2), dtype=np.float32)
    x[7, 1, 0] = 5
    op = reduction("argmax", np.float32, (2, 2), keepdims=True)
    got = run_blockwise(op, x, 4)
    np.testing.assert_array_equal(got, np.argmax(x, keepdims=True))
    assert got.shape == (1, 1, 1)


@pytest.mark.parametrize("kind", ["min", "max"])
def test_min_max_of_no_rows_raise_numpys_error(kind: str) -> None:
    name = "minimum" if kind == "min" else "maximum"
    op = reduction(kind, np.float32, (3,), axis=0)
    with pytest.raises(
        ValueError, match=f"zero-size array to reduction operation {name} which has no identity"
    ):
        run_blockwise(op, np.empty((0, 3), np.float32), 4)


def test_argmin_of_no_rows_raises_numpys_error() -> None:
    op = reduction("argmin", np.int32, ())
    with pytest.raises(ValueError, match="attempt to get argmin of an empty sequence"):
        op.aggregate(None)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_mean_of_no_rows_warns_and_gives_nan() -> None:
    op = reduction("mean", np.int32, (2,))
    with pytest.warns(RuntimeWarning, match="Mean of empty slice"):
        got = op.aggregate(op.chunk(np.empty((0, 2), np.int32)))
    assert np.isnan(got)
    assert got.dtype == np.float64


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_mean_of_rows_without_elements_warns_like_numpy() -> None:
    op = reduction("mean", np.float32, (0,))
    with pytest.warns(RuntimeWarning, match="Mean of empty slice"):
        got = run_blockwise(op, np.empty((5, 0), np.float32), 2)
    assert np.isnan(got)
    assert got.dtype == np.float32


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_variance_with_too_few_values_warns_degrees_of_freedom() -> None:
    op = reduction("var", np.float64, (), ddof=1)
    with pytest.warns(RuntimeWarning, match=r"Degrees of freedom <= 0 for slice"):
        got = op.aggregate(op.chunk(np.array([3.0])))
    assert np.isnan(got)


def test_sum_of_no_rows_is_zero_of_numpys_dtype() -> None:
    op = reduction("sum", np.uint8, (2,), axis=0, keepdims=True)
    got = op.aggregate(None)
    np.testing.assert_array_equal(got, np.zeros((1, 2)))
    assert got.dtype == np.uint64


def test_trailing_only_reductions_are_rowwise_block_ops() -> None:
    x = np.random.default_rng(11).random((50, 4, 3), dtype=np.float32)
    op = reduction("sum", np.float32, (4, 3), axis=(-1, 1), keepdims=True)
    assert isinstance(op, RowwiseReduction)
    assert isinstance(op, BlockOp)
    assert op.row_independent
    assert op.out_row_shape == (1, 1)
    got = run_blockwise(op, x, 7)
    np.testing.assert_array_equal(got, x.sum(axis=(1, 2), keepdims=True))
    out = np.empty((50, 1, 1), np.float32)
    assert op.apply(x, out=out) is out
    np.testing.assert_array_equal(out, x.sum(axis=(1, 2), keepdims=True))
    assert op.temp_bytes(50) >= 0


def test_row_reductions_are_reduction_ops() -> None:
    for kind in KINDS:
        op = reduction(kind, np.float64, (3,), axis=0)
        assert isinstance(op, RowReduction)
        assert isinstance(op, ReductionOp)
        assert not op.row_independent
        assert op.partial_bytes() > 0
        assert op.temp_bytes(1000) > 0
        assert op.chunk(np.empty((0, 3))) is None
        assert op.combine(None, None) is None


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        reduction("median", np.float32, (3,))
    with pytest.raises(TypeError, match="min takes no dtype argument"):
        reduction("min", np.float32, (3,), dtype=np.float64)
    with pytest.raises(TypeError, match="sum takes no ddof argument"):
        reduction("sum", np.float32, (3,), ddof=1)
    with pytest.raises(TypeError, match="'tuple' object cannot be interpreted as an integer"):
        reduction("argmin", np.float32, (3,), axis=(0, 1))
    with pytest.raises(
        np.exceptions.AxisError, match="axis 2 is out of bounds for array of dimension 2"
    ):
        reduction("sum", np.float32, (3,), axis=2)
    with pytest.raises(TypeError, match="var with the integer dtype int64 would truncate"):
        reduction("var", np.float32, (3,), dtype=np.int64)
    with pytest.raises(ValueError, match="duplicate value in 'axis'"):
        reduction("sum", np.float32, (3,), axis=(0, -2))
    op = reduction("sum", np.float32, (3,), axis=0)
    with pytest.raises(ValueError, match="built for block 0 of dtype float32"):
        op.chunk(np.zeros((2, 3)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8, bool])
@pytest.mark.parametrize("rows", [0, 1, 5, 127, 128, 129, 1000, 4099])
@pytest.mark.parametrize("row_shape", [(), (1,), (3,), (8,), (2, 5), (2000,)])
def test_reduce_rows_equals_numpy(dtype: Any, rows: int, row_shape: tuple[int, ...]) -> None:
    x = random_array(np.random.default_rng(rows), np.dtype(dtype), (rows, *row_shape))
    if rows:
        np.testing.assert_array_equal(reduce_rows(np.maximum, x), np.maximum.reduce(x, axis=0))
    got = reduce_rows(np.add, x, np.float64)
    assert got.dtype == np.float64
    assert got.shape == row_shape
    np.testing.assert_allclose(got, x.sum(axis=0, dtype=np.float64), rtol=1e-12)
    exact = reduce_rows(np.add, x, np.int64) if np.dtype(dtype).kind in "biu" else None
    if exact is not None:
        np.testing.assert_array_equal(exact, x.sum(axis=0, dtype=np.int64))


def test_reduce_rows_on_a_strided_block_takes_the_plain_path() -> None:
    x = np.random.default_rng(12).random((1000, 16))[:, ::2]
    np.testing.assert_allclose(reduce_rows(np.add, x), x.sum(axis=0), rtol=1e-13)


@pytest.mark.parametrize(
    ("bins", "value_range"),
    [(5, (0.0, 1.0)), (3, (-1, 2)), (np.array([0.0, 0.1, 0.5, 1.0]), None), (4, (0.25, 0.25))],
)
@pytest.mark.parametrize("density", [False, True])
def test_histogram_matches_numpy(bins: Any, value_range: Any, density: bool) -> None:
    rng = np.random.default_rng(13)
    x = rng.random((101, 3)).astype(np.float32)
    x[0, 0] = 1.0  # the right edge is inside the last bin
    x[1, 1] = 0.0
    x[2, 2] = -0.5  # left out: outside the range
    x[3, 0] = np.nan  # left out
    op = Histogram(np.float32, bins, value_range, density=density)
    assert isinstance(op, ReductionOp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hist, edges = run_blockwise(op, x, 17, rng)
    want_hist, want_edges = np.histogram(x, bins=bins, range=value_range, density=density)
    np.testing.assert_array_equal(edges, want_edges)
    assert hist.dtype == want_hist.dtype
    if density:
        np.testing.assert_allclose(hist, want_hist, rtol=1e-12)
    else:
        np.testing.assert_array_equal(hist, want_hist)


def test_histogram_of_no_rows_is_zero_counts() -> None:
    op = Histogram(np.int16, 4, (0, 8))
    hist, edges = op.aggregate(op.chunk(np.empty((0,), np.int16)))
    np.testing.assert_array_equal(hist, np.zeros(4))
    np.testing.assert_array_equal(edges, np.histogram(np.empty(0, np.int16), 4, (0, 8))[1])


def test_histogram_needs_a_range_or_edges() -> None:
    with pytest.raises(ValueError, match=r"bins=10 needs range=\(lo, hi\)"):
        Histogram(np.float32, 10)
    with pytest.raises(ValueError, match="estimates bins from all the data"):
        Histogram(np.float32, "auto", (0, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max must be larger than min"):
        Histogram(np.float32, 4, (1, 0))


def test_user_reduction_with_offsets_and_order() -> None:
    def chunk(block: np.ndarray, offset: int) -> list[tuple[int, float]]:
        return [(offset + i, float(v)) for i, v in enumerate(block) if v > 0.9]

    options = ReductionOptions(with_offset=True, commutative=False)
    op = Reduction(chunk, lambda a, b: a + b, sorted, options)
    assert isinstance(op, ReductionOp)
    x = np.random.default_rng(14).random(200)
    got = run_blockwise(op, x, 30)
    assert got == [(i, float(v)) for i, v in enumerate(x) if v > 0.9]
    assert op.combine(None, [1]) == [1]
    assert op.temp_bytes(100) == 0
    with pytest.raises(ValueError, match="takes 1 block"):
        op.chunk(x, x)


def test_user_reduction_over_two_inputs() -> None:
    dot = Reduction(
        lambda a, b: float(a @ b),
        lambda p, q: p + q,
        options=ReductionOptions(
            n_inputs=2, out_dtype=np.float64, out_shape=(), temp_bytes=lambda rows: 0
        ),
    )
    a, b = np.arange(10.0), np.ones(10)
    partials = [dot.chunk(a[i : i + 3], b[i : i + 3]) for i in range(0, 10, 3)]
    total = partials[0]
    for p in partials[1:]:
        total = dot.combine(total, p)
    assert dot.aggregate(total) == 45.0


def test_rowwise_reductions_accept_only_matching_blocks() -> None:
    op = reduction("max", np.int8, (4,), axis=1)
    with pytest.raises(ValueError, match="built for block 0 of dtype int8"):
        op.apply(np.zeros((3, 4), np.int16))


@given(rows=st.integers(1, 60), block_rows=st.integers(1, 9), seed=st.integers(0, 1000))
@settings(max_examples=examples(40), deadline=None)
def test_count_nonzero_counts_nan_and_negative_zero_like_numpy(
    rows: int, block_rows: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x = rng.choice(np.array([0.0, -0.0, np.nan, 1.5]), size=(rows, 3))
    for axis in (None, 0, (0, 1)):
        op = reduction("count_nonzero", np.float64, (3,), axis=axis)
        np.testing.assert_array_equal(
            run_blockwise(op, x, block_rows, rng), np.count_nonzero(x, axis=axis)
        )


# Lanes: the wide-view fast path of reduce_rows, the fused accumulators and var/std.


@pytest.mark.parametrize("row_shape", [(2,), (3,), (8,), (2, 3)])
@pytest.mark.parametrize("rows", [600, 1000, 4099, 2**13 + 5])
def test_reduce_rows_in_lanes_matches_numpy(row_shape: tuple[int, ...], rows: int) -> None:
    width = math.prod(row_shape)
    assert reductions._lane_fold(width, rows) > 1 or rows * width < 4096
    rng = np.random.default_rng(rows)
    floats = with_nans(rng, random_array(rng, np.dtype(np.float32), (rows, *row_shape)), 0.001)
    ints = random_array(rng, np.dtype(np.int16), (rows, *row_shape), wide_ints=True)
    flags = random_array(rng, np.dtype(bool), (rows, *row_shape))
    for ufunc in (np.minimum, np.maximum):
        for x in (floats, ints):
            np.testing.assert_array_equal(reduce_rows(ufunc, x), ufunc.reduce(x, axis=0))
    got = reduce_rows(np.add, floats, np.float64)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, floats.sum(axis=0, dtype=np.float64), rtol=1e-12)
    for dtype in (None, np.int8, np.int64):  # int16 sums wrap in int8 exactly like NumPy's
        want = np.add.reduce(ints, axis=0, dtype=dtype)
        got = reduce_rows(np.add, ints, dtype)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    for ufunc in (np.logical_or, np.logical_and):
        for x in (flags, floats):
            want = ufunc.reduce(x, axis=0, dtype=bool)
            np.testing.assert_array_equal(reduce_rows(ufunc, x, bool), want)


@given(
    seed=st.integers(0, 2**32 - 1),
    row_shape=st.sampled_from([(2,), (3,), (8,), (2, 3)]),
    cuts=st.lists(st.integers(1, 700), min_size=1, max_size=8),
)
@settings(max_examples=examples(60), deadline=None)
def test_lanes_take_pieces_of_any_size_in_any_order(
    seed: int, row_shape: tuple[int, ...], cuts: list[int]
) -> None:
    rng = np.random.default_rng(seed)
    rows = sum(cuts)
    width = math.prod(row_shape)
    x = with_nans(rng, random_array(rng, np.dtype(np.float32), (rows, *row_shape)), 0.01)
    bounds = np.cumsum([0, *cuts])
    pieces = [x[a:b] for a, b in itertools.pairwise(bounds)]
    order = rng.permutation(len(pieces))  # short pieces may come before whole wide rows
    fold = 32
    for ufunc, dtype in ((np.add, np.dtype(np.float64)), (np.maximum, np.dtype(np.float32))):
        lanes = reductions._UfuncLanes(ufunc, dtype, width, fold)
        for i in order:
            lanes.add(pieces[i])
        want = ufunc.reduce(x.reshape(rows, width), axis=0, dtype=dtype)
        np.testing.assert_allclose(lanes.fold(), want, rtol=1e-12)
        assert lanes.rows == rows
    ddof = 1 if rows > 1 else 0
    op = reduction("var", np.float32, row_shape, axis=0, ddof=ddof)
    moments = reductions._MomentLanes(width, fold, row_shape)
    for i in order:
        moments.add(pieces[i])
    got = op.aggregate(moments.partial())
    oracle = np.var(x.astype(np.float64), axis=0, ddof=ddof)
    np.testing.assert_allclose(got, oracle.astype(np.float32), rtol=4e-7, atol=1e-12)


def _two_pass(x: np.ndarray, ddof: int = 0) -> np.ndarray:
    wide = x.astype(np.longdouble)
    return ((wide - wide.mean(axis=0)) ** 2).sum(axis=0) / (x.shape[0] - ddof)


def test_var_in_one_pass_is_used_for_contiguous_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> Any:
        raise AssertionError("the sub-block two-pass ran")

    monkeypatch.setattr(reductions, "_subblocks", refuse)
    x = np.random.default_rng(30).random((5000, 8), dtype=np.float32)
    op = reduction("var", np.float32, (8,), axis=0)
    np.testing.assert_allclose(op.aggregate(op.chunk(x)), _two_pass(x), rtol=4e-7)
    with pytest.raises(AssertionError, match="two-pass ran"):
        op.chunk(np.asfortranarray(x))


@pytest.mark.parametrize("shifted", [1, 64, 1000, 5376, 10_000])
def test_var_survives_a_pilot_far_from_the_mean(shifted: int) -> None:
    # The first rows of a block give the pilot. Here the first rows sit far from the
    # rest: when they are exactly the pilot's rows (5376 for 3 columns in 20,000-row
    # blocks), the pilot is as far from the block's mean as it can be (rows / pilot
    # rows times the variance), the worst case for the shifted sums.
    rng = np.random.default_rng(31)
    x = rng.standard_normal((20_000, 3))
    x[:shifted] += 1e6
    op = reduction("var", np.float64, (3,), axis=0, ddof=1)
    for block_rows in (20_000, 4096, 777):
        got = run_blockwise(op, x, block_rows, rng)
        np.testing.assert_allclose(got, _two_pass(x, 1).astype(np.float64), rtol=1e-12)


def test_var_of_float32_far_from_zero_keeps_float32_accuracy() -> None:
    rng = np.random.default_rng(32)
    x = (1e4 + 1e-2 * rng.standard_normal((50_000, 8))).astype(np.float32)
    op = reduction("std", np.float32, (8,), axis=0)
    got = run_blockwise(op, x, 12_345, rng)
    want = np.sqrt(_two_pass(x)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=4 * float(np.finfo(np.float32).eps))


def test_var_of_constant_nan_and_inf_columns() -> None:
    x = np.ones((3000, 4), np.float64) * np.array([5.0, 1e9 + 0.5, 0.0, 2.0])
    x[1500, 2] = np.nan
    x[2999, 3] = np.inf
    for kind in ("var", "std"):
        op = reduction(kind, np.float64, (4,), axis=0)
        with np.errstate(invalid="ignore"):
            want = getattr(np, kind)(x, axis=0)
            got = run_blockwise(op, x, 1024)
        np.testing.assert_array_equal(got, want)  # exactly 0 (never sqrt of -tiny), NaN
        assert got[0] == 0.0 and got[1] == 0.0


@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.uint8, np.int64, bool])
@pytest.mark.parametrize("rows", [1, 5, 63, 64, 65, 4999])
def test_var_in_lanes_for_other_dtypes_and_small_blocks(dtype: Any, rows: int) -> None:
    rng = np.random.default_rng(rows)
    x = random_array(rng, np.dtype(dtype), (rows, 2, 3))
    op = reduction("var", dtype, (2, 3), axis=0)
    got = op.aggregate(op.chunk(x))
    want = np.var(x, axis=0)
    assert got.dtype == want.dtype
    oracle = _two_pass(x.astype(np.float64))
    tol = 4 * float(np.finfo(want.dtype).eps)
    np.testing.assert_allclose(got, oracle.astype(want.dtype), rtol=tol, atol=1e-12)


# The float32 road of var/std (whole float32 blocks, float32 results).


def _refuse_float64_road(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> Any:
        raise AssertionError("the float64 road ran")

    monkeypatch.setattr(reductions, "_MomentLanes", refuse)
    monkeypatch.setattr(reductions, "_subblocks", refuse)


@pytest.mark.parametrize("extra", [0, 7, 4099, 70_001])
@pytest.mark.parametrize("row_shape", [(8,), (3,), (2, 5), (1500,)])
def test_var_of_float32_blocks_takes_float32_deviations(
    monkeypatch: pytest.MonkeyPatch, extra: int, row_shape: tuple[int, ...]
) -> None:
    _refuse_float64_road(monkeypatch)
    elements = math.prod(row_shape)
    rows = -(-reductions._NARROW_ELEMENTS // elements) + extra // elements
    rng = np.random.default_rng(rows)
    x = (1e6 + rng.standard_normal((rows, *row_shape))).astype(np.float32)
    for kind in ("var", "std"):
        op = reduction(kind, np.float32, row_shape, axis=0, ddof=0)
        got = op.aggregate(op.chunk(x))
        assert got.dtype == np.float32
        want = _two_pass(x)
        want = np.sqrt(want) if kind == "std" else want
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=4e-7, atol=0)


@pytest.mark.parametrize("rows", [8192, 8193, 70_001])
def test_float32_var_of_centered_data_sums_the_data_where_it_lies(
    monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    _refuse_float64_road(monkeypatch)
    x = np.random.default_rng(rows).random((rows, 8), dtype=np.float32)  # zero shifts
    x[:, 3] -= 0.5
    sums = reductions._narrow_sums(x.reshape(-1), np.zeros(8, np.float32), 8, 128)
    wide = x.astype(np.float64)
    # Sums of four float32 terms, then float64: off by a few float32 units of the
    # magnitudes summed, never more.
    magnitude = np.abs(wide).sum(axis=0)
    np.testing.assert_allclose(sums[0], wide.sum(axis=0), rtol=0, atol=4e-7 * magnitude.max())
    np.testing.assert_allclose(sums[1], (wide * wide).sum(axis=0), rtol=4e-7)
    for kind in ("var", "std"):
        op = reduction(kind, np.float32, (8,), axis=0, ddof=1)
        want = _two_pass(x, 1)
        want = np.sqrt(want) if kind == "std" else want
        np.testing.assert_allclose(op.aggregate(op.chunk(x)), want.astype(np.float32), rtol=4e-7)


def test_float32_var_with_a_float64_result_or_a_small_block_keeps_the_float64_road(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _refuse_float64_road(monkeypatch)
    x = np.random.default_rng(40).random((9000, 8), dtype=np.float32)
    reduction("var", np.float32, (8,), axis=0).chunk(x)
    with pytest.raises(AssertionError, match="float64 road ran"):
        reduction("var", np.float32, (8,), axis=0, dtype=np.float64).chunk(x)
    with pytest.raises(AssertionError, match="float64 road ran"):  # fixed costs first
        reduction("var", np.float32, (8,), axis=0).chunk(x[:8000])


@pytest.mark.parametrize("shifted", [1, 100, 8192, 30_000])
def test_float32_var_sums_again_from_the_mean_when_the_pilot_is_far(shifted: int) -> None:
    # The pilot is the mean of the first 8192 rows of 8; rows far from the rest there
    # put it far from the block's mean.
    rng = np.random.default_rng(41)
    x = (10 + rng.standard_normal((60_000, 8))).astype(np.float32)
    x[:shifted] += np.float32(3e4)
    op = reduction("var", np.float32, (8,), axis=0)
    got = op.aggregate(op.chunk(x))
    np.testing.assert_allclose(got, _two_pass(x).astype(np.float32), rtol=4e-7, atol=0)


def test_float32_var_past_float32_range_and_with_nan_takes_the_float64_road() -> None:
    rng = np.random.default_rng(42)
    x = (rng.standard_normal((5000, 4)) * 1e19).astype(np.float32)  # squares past 3.4e38
    x[:, 1] = 1.0
    op = reduction("var", np.float32, (4,), axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = op.aggregate(op.chunk(x))
    want = _two_pass(x).astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=4e-7)
    assert got[1] == 0.0
    x[17, 2] = np.nan
    x[18, 3] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        got = op.aggregate(op.chunk(x))
        want = np.var(x, axis=0)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[:2], _two_pass(x[:, :2]).astype(np.float32), rtol=4e-7)


def test_float16_var_takes_the_float32_road(monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_float64_road(monkeypatch)
    x = (100 + np.random.default_rng(43).standard_normal((30_000, 3))).astype(np.float16)
    op = reduction("std", np.float16, (3,), axis=0)
    got = op.aggregate(op.chunk(x))
    assert got.dtype == np.float16
    want = np.sqrt(_two_pass(x.astype(np.float64))).astype(np.float16)
    np.testing.assert_allclose(got, want, rtol=4 * float(np.finfo(np.float16).eps))


def test_a_mean_from_float32_moments_keeps_float32_accuracy() -> None:
    rng = np.random.default_rng(44)
    x = rng.standard_normal((300_000, 4))
    x[:, 1] += 1e4  # shifted by its mean: exact deviations (Sterbenz)
    x[:, 2] = x[:, 2] * 1e-3 + 1.0
    x[:, 3] += 2.5  # near its spread: shifted by zero, every deviation exact
    x = x.astype(np.float32)
    var = reduction("var", np.float32, (4,), axis=0)
    mean = reduction("mean", np.float32, (4,), axis=0)
    derive = mean.derive_from(var)
    assert derive is not None
    partial = None
    for a in range(0, len(x), 70_000):
        one = derive(var.chunk(x[a : a + 70_000]))
        partial = one if partial is None else mean.combine(partial, one)
    got = mean.aggregate(partial)
    want = x.astype(np.float64).mean(axis=0)
    sigma = x.astype(np.float64).std(axis=0)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=4e-7, atol=1e-9)
    assert np.all(np.abs(got.astype(np.float64) - want) <= 5e-11 * sigma + 4e-7 * np.abs(want))
    # A float64 mean wants float64 sums: it does not come from float32 moments.
    assert reduction("mean", np.float32, (4,), axis=0, dtype=np.float64).derive_from(var) is None


def test_argmin_of_complex_values_with_nan_parts_does_not_warn_as_numpys_does_not() -> None:
    x = np.array([1 + 1j, complex(np.nan, 2), 3j, complex(0, np.nan), -1 + 0j, 2 + 0j])
    for kind in ("argmin", "argmax"):
        op = reduction(kind, x.dtype, (), axis=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = run_blockwise(op, x, 2)
        np.testing.assert_array_equal(got, getattr(np, kind)(x, axis=0))


def test_complex_min_and_max_give_the_first_value_holding_a_nan() -> None:
    x = np.array([3 + 1j, complex(np.nan, -5), 2j, complex(7, np.nan), complex(np.nan, 1)] * 40)
    x = x.reshape(50, 4)
    rng = np.random.default_rng(3)
    for kind in ("min", "max"):
        for axis in (None, 0):
            op = reduction(kind, x.dtype, (4,), axis=axis)
            for _ in range(5):
                got = run_blockwise(op, x, 3, rng)
                want = getattr(np, kind)(x, axis=axis)
                np.testing.assert_array_equal(np.asarray(got).imag, np.asarray(want).imag)
                np.testing.assert_array_equal(np.isnan(np.asarray(got).real), np.isnan(want.real))
