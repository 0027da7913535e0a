"""Zero rows and empty blocks: after a mask that empties some blocks or all of them, over
an array without rows and over a slice without rows (``x[n:]``), every function of the
function table gives NumPy's answer, NumPy's dtype and NumPy's warnings, or raises
NumPy's error."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.api.dispatch import FUNCTIONS

ROWS = 12
BLOCK = 4
KEEP_FROM = 9  # the mask keeps rows 9 to 11: blocks 0 and 1 are emptied


def _data(dtype: Any, shape: tuple[int, ...] = (ROWS, 3)) -> np.ndarray:
    values = np.random.default_rng(7).integers(0, 20, size=shape)
    return values.astype(dtype) if np.dtype(dtype).kind != "b" else values % 2 == 1


def _contexts(a: np.ndarray) -> dict[str, tuple[np.ndarray, tw.Array]]:
    """NumPy's array and the lazy one, for each way of having few or no rows."""
    x = tw.from_array(a, rows=BLOCK)
    some = np.arange(len(a)) >= KEEP_FROM
    none = np.zeros(len(a), bool)
    return {
        "mask empties some blocks": (a[some], x[tw.from_array(some, rows=BLOCK)]),
        "mask empties every block": (a[none], x[tw.from_array(none, rows=BLOCK)]),
        "no rows": (a[:0], tw.from_array(a[:0])),
        "slice without rows": (a[len(a) :], x[len(a) :]),
    }


def _outcome(fn: Callable[[Any], Any], a: Any) -> tuple[Any, BaseException | None, list[Any]]:
    """What ``fn(a)`` gives (computed), the error it raised, and its warnings (category,
    message; a floating-point warning names the operation tierflow ran, NumPy its
    ufunc, so only ``... encountered`` is compared)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn(a)
            if isinstance(result, tuple):
                result = tuple(r.compute() if isinstance(r, tw.Array) else r for r in result)
            elif isinstance(result, tw.Array):
                result = result.compute()
            error = None
        except Exception as exc:
            result, error = None, exc
    seen = {
        (w.category, re.sub(r" encountered in .*", " encountered", str(w.message))) for w in caught
    }
    return result, error, sorted(seen, key=str)


def _assert_same(got: Any, want: Any) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)
        return
    got, want = np.asarray(got), np.asarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    if want.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


def _assert_like_numpy(fn: Callable[[Any], Any], a: np.ndarray, x: tw.Array) -> None:
    want, numpy_error, numpy_warnings = _outcome(fn, a)
    got, error, got_warnings = _outcome(fn, x)
    if numpy_error is not None:
        assert error is not None, f"NumPy raised {numpy_error!r}, tierflow gave {got!r}"
        assert isinstance(error, type(numpy_error))
        assert str(error) == str(numpy_error)
    else:
        assert error is None, f"tierflow raised {error!r}, NumPy gave {want!r}"
        _assert_same(got, want)
    assert got_warnings == numpy_warnings


def _sorted_partition(a: Any, kth: int, axis: int) -> Any:
    """np.partition's result as a valid one is checked: sorted along the axis (what a
    lazy partition gives; NumPy's order around kth is its own)."""
    out = np.partition(a, kth, axis=axis)
    return np.sort(out, axis=axis) if isinstance(out, np.ndarray) else out


# One call per entry of the function table (its NumPy function), on a 2-D array.
CALLS: dict[Any, Callable[[Any], Any]] = {
    np.sum: lambda a: np.sum(a, axis=0),
    np.prod: lambda a: np.prod(a, axis=0),
    np.mean: lambda a: np.mean(a, axis=0),
    np.std: lambda a: np.std(a, axis=0),
    np.var: lambda a: np.var(a, axis=0, ddof=1),
    np.min: lambda a: np.min(a, axis=0),
    np.max: lambda a: np.max(a),
    np.amin: lambda a: np.amin(a, axis=0),
    np.amax: lambda a: np.amax(a, axis=0, initial=3),
    np.any: lambda a: np.any(a, axis=0),
    np.all: lambda a: np.all(a),
    np.argmin: lambda a: np.argmin(a, axis=0),
    np.argmax: lambda a: np.argmax(a),
    np.count_nonzero: lambda a: np.count_nonzero(a, axis=0),
    np.histogram: lambda a: np.histogram(a, bins=4, range=(0, 20)),
    np.concatenate: lambda a: np.concatenate([a, a]),
    np.clip: lambda a: np.clip(a, 2, 9),
    np.round: lambda a: np.round(a, 1),
    np.around: lambda a: np.around(a, 1),
    np.where: lambda a: np.where(a > 5, a, 0),
    np.dot: lambda a: np.dot(a, np.ones(3)),
    np.stack: lambda a: np.stack([a, a], axis=1),
    np.reshape: lambda a: np.reshape(a, (-1, 3, 1)),
    np.nansum: lambda a: np.nansum(a, axis=0),
    np.sort: lambda a: np.sort(a, axis=0),
    np.argsort: lambda a: np.argsort(a, axis=0),
    np.cumsum: lambda a: np.cumsum(a, axis=1),
    np.cumprod: lambda a: np.cumprod(a, axis=1),
    np.nancumsum: lambda a: np.nancumsum(a, axis=1),
    np.nancumprod: lambda a: np.nancumprod(a, axis=1),
    np.diff: lambda a: np.diff(a, axis=1),
    np.shape: lambda a: np.shape(a)[1:],
    np.ndim: np.ndim,
    np.result_type: lambda a: np.result_type(a, np.float32),
    np.pad: lambda a: np.pad(a, [(2, 1), (0, 0)], constant_values=1),
    np.moveaxis: lambda a: np.sum(np.moveaxis(a, 0, 1), axis=1),
    np.flip: lambda a: np.flip(a, 0),
    np.flipud: lambda a: np.flipud(a),
    np.lib.stride_tricks.sliding_window_view: lambda a: np.lib.stride_tricks.sliding_window_view(
        a, 1, axis=0
    ),
    np.size: lambda a: np.size(a, 1),
    np.quantile: lambda a: np.quantile(a, 0.3, axis=0),
    np.percentile: lambda a: np.percentile(a, [10, 90]),
    np.nanquantile: lambda a: np.nanquantile(a, 0.3, axis=0),
    np.nanpercentile: lambda a: np.nanpercentile(a, 30, axis=0),
    np.median: lambda a: np.median(a, axis=0),
    np.nanmedian: lambda a: np.nanmedian(a, axis=0),
    np.unique: lambda a: np.unique(a[:, 0], return_index=True, return_counts=True),
    np.bincount: lambda a: np.bincount(a[:, 0].astype(np.int64), minlength=3),
    np.matmul: lambda a: np.matmul(a, np.ones((3, 2))),
    np.transpose: lambda a: np.transpose(a) @ a,
    np.cov: lambda a: np.cov(a, rowvar=False),
    np.corrcoef: lambda a: np.corrcoef(a, rowvar=False),
    np.linalg.norm: lambda a: np.linalg.norm(a, ord=np.inf, axis=0),
    np.einsum: lambda a: np.einsum("ij->j", a),
    np.vstack: lambda a: np.vstack([a, a]),
    np.hstack: lambda a: np.hstack([a, a]),
    np.column_stack: lambda a: np.column_stack([a[:, 0], a]),
    np.nanmin: lambda a: np.nanmin(a, axis=0),
    np.nanmax: lambda a: np.nanmax(a),
    np.nanargmin: lambda a: np.nanargmin(a, axis=0),
    np.nanargmax: lambda a: np.nanargmax(a, axis=0),
    np.nanprod: lambda a: np.nanprod(a, axis=0),
    np.nanmean: lambda a: np.nanmean(a, axis=0),
    np.nanvar: lambda a: np.nanvar(a, axis=0),
    np.nanstd: lambda a: np.nanstd(a),
    np.partition: lambda a: _sorted_partition(a, 0, 0),
}
if hasattr(np, "astype"):  # NumPy >= 2
    CALLS[np.astype] = lambda a: np.astype(a, np.float32)


def test_every_function_of_the_table_has_a_call_here() -> None:
    missing = [getattr(f, "__name__", f) for f in FUNCTIONS if f not in CALLS]
    assert not missing


@pytest.mark.executors("threads")
@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.float32, np.bool_])
@pytest.mark.parametrize("function", list(CALLS), ids=lambda f: getattr(f, "__name__", str(f)))
def test_every_function_gives_numpys_answer_over_empty_blocks_and_no_rows(
    function: Any, dtype: Any
) -> None:
    for context, (a, x) in _contexts(_data(dtype)).items():
        try:
            _assert_like_numpy(CALLS[function], a, x)
        except AssertionError as exc:
            raise AssertionError(f"{context}: {exc}") from exc


# -- the examples of the issue ------------------------------------------------------------


@pytest.mark.parametrize(
    "function",
    [
        lambda a: np.median(a, axis=0),
        lambda a: np.nanmedian(a, axis=0),
        lambda a: np.percentile(a, [25, 75], axis=0),
        lambda a: np.nanpercentile(a, 40, axis=0),
        lambda a: np.quantile(a, 0.5, axis=0),
        lambda a: np.nanquantile(a, 0.9),
    ],
    ids=["median", "nanmedian", "percentile", "nanpercentile", "quantile", "nanquantile"],
)
def test_a_mask_that_empties_a_block_gives_numpys_quantiles(function: Any) -> None:
    a = np.arange(24.0).reshape(12, 2)
    x = tw.from_array(a, rows=4)
    kept = x[x[:, 0] > 10]  # blocks 0 and 1 (rows 0-7) keep no row
    np.testing.assert_array_equal(function(kept).compute(), function(a[a[:, 0] > 10]))


def test_a_mask_that_empties_every_block_gives_numpys_nan_median_and_its_warning() -> None:
    a = np.arange(24.0).reshape(12, 2)
    x = tw.from_array(a, rows=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = np.median(x[x[:, 0] > 100], axis=0).compute()
    assert "Mean of empty slice" in {str(w.message) for w in caught}
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [np.nan, np.nan])


def test_the_partial_of_an_empty_block_is_made_without_calling_chunk() -> None:
    """The engine's one rule: a built-in reduction's chunk never sees an empty block;
    a user's reduction sees every block, empty ones included, as dask's does."""
    a = np.arange(24.0).reshape(12, 2)
    x = tw.from_array(a, rows=4)
    seen: list[int] = []

    def chunk(block: np.ndarray) -> int:
        seen.append(len(block))
        return len(block)

    count = x[x[:, 0] > 10].reduction(chunk, lambda p, q: p + q, dtype=np.int64, shape=())
    assert count.compute(executor="serial") == 6
    assert sorted(seen) == [0, 2, 4]  # block 0 keeps none of its rows


def test_a_users_reduction_over_no_rows_is_its_functions_on_an_empty_block() -> None:
    x = tw.from_array(np.zeros((0, 2)))
    total = x.reduction(lambda b: b.sum(axis=0), np.add, lambda p: p * 2)
    np.testing.assert_array_equal(total.compute(), [0.0, 0.0])


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
def test_einsum_over_a_slice_without_rows_gives_numpys_zeros(dtype: Any) -> None:
    o = tw.from_array(np.ones((3, 2), dtype))
    got = np.einsum("ij->j", o[3:]).compute()
    want = np.einsum("ij->j", np.ones((3, 2), dtype)[3:])
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    np.testing.assert_array_equal(got, [0, 0])


def test_norm_inf_over_zero_rows_gives_zeros() -> None:
    x = tw.from_array(np.ones((3, 2)))
    np.testing.assert_array_equal(np.linalg.norm(x[3:], ord=np.inf, axis=0).compute(), [0, 0])
    assert np.linalg.norm(x[3:, 0], ord=np.inf).compute() == 0.0
    assert np.linalg.norm(x[3:], ord=np.inf).compute() == 0.0


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (lambda v: np.min(v, axis=0), "zero-size array to reduction operation minimum which"),
        (np.max, "zero-size array to reduction operation maximum which has no identity"),
        (lambda v: np.nanmin(v, axis=0), "zero-size array to reduction operation fmin which"),
        (np.nanmax, "zero-size array to reduction operation fmax which has no identity"),
        (lambda v: np.argmin(v, axis=0), "attempt to get argmin of an empty sequence"),
        (np.argmax, "attempt to get argmax of an empty sequence"),
    ],
)
def test_reductions_without_identity_over_zero_rows_raise_numpys_error(
    function: Any, message: str
) -> None:
    a = np.arange(12.0).reshape(4, 3)
    x = tw.from_array(a, rows=2)
    for empty, lazy in ((a[a[:, 0] > 99], x[x[:, 0] > 99]), (a[4:], x[4:])):
        with pytest.raises(ValueError, match=message):
            function(empty)
        with pytest.raises(ValueError, match=message):
            function(lazy).compute()


def test_partition_of_zero_rows_gives_an_empty_array_whatever_kth() -> None:
    v = tw.from_array(np.arange(5.0), rows=2)
    assert np.partition(v[v > 10], 0).compute().shape == (0,)
    assert np.partition(v[5:], 3).compute().shape == (0,)
    assert np.partition(v[v > 10], 5).compute().shape == (0,)


def test_covariance_of_no_rows_gives_numpys_nan_and_warnings() -> None:
    a = np.ones((4, 2))
    x = tw.from_array(a, rows=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = np.cov(x[x[:, 0] > 5], rowvar=False).compute()
    messages = {str(w.message).split(" encountered")[0] for w in caught}
    assert {
        "Degrees of freedom <= 0 for slice",
        "Mean of empty slice",
        "divide by zero",
    } <= messages
    np.testing.assert_array_equal(got, np.full((2, 2), np.nan))


def test_nanmin_leaves_nan_out_and_warns_for_an_all_nan_column() -> None:
    a = np.array([[np.nan, 1.0], [np.nan, -3.0], [np.nan, 5.0]])
    x = tw.from_array(a, rows=2)
    with pytest.warns(RuntimeWarning, match="All-NaN slice encountered"):
        got = np.nanmin(x, axis=0).compute()
    np.testing.assert_array_equal(got, [np.nan, -3.0])


def test_initial_starts_sum_prod_min_and_max_as_numpys_does() -> None:
    a = np.array([[1.0, 9.0], [4.0, -2.0], [3.0, 0.5]])
    x = tw.from_array(a, rows=2)
    for name, initial in (("sum", 10), ("prod", 2), ("min", 0), ("max", 5)):
        fn = getattr(np, name)
        np.testing.assert_array_equal(
            fn(x, axis=0, initial=initial).compute(), fn(a, axis=0, initial=initial)
        )
        assert fn(x[3:], initial=initial).compute() == fn(a[3:], initial=initial)
    np.testing.assert_array_equal(
        np.maximum.reduce(x[3:], axis=0, initial=0).compute(), np.zeros(2)
    )


def test_nanvar_of_complex_values_sums_their_imaginary_parts() -> None:
    a = (np.arange(6) + 1j * np.arange(6)[::-1]).astype(np.complex64)
    a[2] = np.nan
    x = tw.from_array(a, rows=4)
    np.testing.assert_allclose(np.nanvar(x).compute(), np.nanvar(a), rtol=1e-6)
    np.testing.assert_allclose(np.nanstd(x[x.real >= 0]).compute(), np.nanstd(a), rtol=1e-6)
