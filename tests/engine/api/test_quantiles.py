"""Exact quantiles of lazy arrays against NumPy: np.quantile, np.percentile, np.median and
their nan-versions, along the rows and over all values, out of core."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierflow as tw
from tierflow.engine.api import quantiles
from tierflow.engine.planning.plan import Target, build_plan, describe
from tierflow.engine.rowwide import quantiles as rowwide_quantiles
from tierflow.operators import order_stats
from tierflow.operators.order_stats import Limits

METHODS = [
    "linear", "lower", "higher", "nearest", "midpoint", "inverted_cdf",
    "averaged_inverted_cdf", "closest_observation", "interpolated_inverted_cdf",
    "hazen", "weibull", "median_unbiased", "normal_unbiased",
]  # fmt: skip
DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64,
]  # fmt: skip
FUNCTIONS = ["quantile", "percentile", "median", "nanquantile", "nanpercentile", "nanmedian"]


@pytest.fixture
def tiny_limits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Limits]:
    """At most 16 collected values and small histograms: most searches refine."""
    limits = Limits(bins=1024, collect=16)
    monkeypatch.setattr(rowwide_quantiles, "limits_for", lambda budget: limits)
    yield limits


def _numpy(function: str, a: np.ndarray, q: Any, **kw: Any) -> tuple[Any, Any, list[str]]:
    """NumPy's result (or the error it raised) and the warnings it gave."""
    fn = getattr(np, function)
    args = () if function.endswith("median") else (q,)
    if function.endswith("median"):
        kw.pop("method", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn(a, *args, **kw), None, [str(w.message) for w in caught]
        except Exception as exc:
            return None, exc, [str(w.message) for w in caught]


def _lazy(function: str, x: tw.Array, q: Any, **kw: Any) -> tuple[Any, Any, list[str]]:
    fn = getattr(np, function)
    args = () if function.endswith("median") else (q,)
    if function.endswith("median"):
        kw.pop("method", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn(x, *args, **kw)
            (value,) = tw.compute(result, executor="serial", progress=False)
            return value, None, [str(w.message) for w in caught]
        except Exception as exc:
            return None, exc, [str(w.message) for w in caught]


def _assert_same(
    got: tuple[Any, Any, list[str]], want: tuple[Any, Any, list[str]], empty: bool = False
) -> None:
    """The same value, dtype, shape and warnings, or the same error. (For an empty
    array NumPy may fail on an index before it fails on the dtype, as a lazy array
    does when the graph is built: any error will do there.)"""
    value, error, warned = got
    expected, expected_error, expected_warned = want
    if expected_error is not None:
        assert error is not None, f"NumPy raised {expected_error!r}, tierflow gave {value!r}"
        assert empty or type(error) is type(expected_error), (error, expected_error)
        return
    assert error is None, f"tierflow raised {error!r}; NumPy gave {expected!r}"
    assert np.shape(value) == np.shape(expected)
    assert np.asarray(value).dtype == np.asarray(expected).dtype
    np.testing.assert_array_equal(value, expected, strict=False)
    # Floating-point warnings ("invalid value encountered in subtract") follow the
    # thread's errstate; the ones NumPy itself warns with must match.
    assert _own(warned) == _own(expected_warned)


def _own(messages: list[str]) -> set[str]:
    return {m for m in messages if "encountered in" not in m}


@st.composite
def arrays(draw: Any) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    rows = draw(st.integers(0, 90))
    row_shape = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    shape = (rows, *row_shape)
    kind = draw(st.sampled_from(["spread", "ties", "constant", "extremes"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if dtype.kind == "b":
        a = rng.integers(0, 2, shape).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        if kind == "ties":
            a = rng.integers(0, 3, shape).astype(dtype)
        elif kind == "constant":
            a = np.full(shape, info.max // 3, dtype)
        elif kind == "extremes":
            a = rng.choice(np.array([info.min, info.max, 0, 1], dtype), shape)
        else:
            a = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    else:
        if kind == "ties":
            a = rng.integers(-2, 3, shape).astype(dtype)
        elif kind == "constant":
            a = np.full(shape, 1.5, dtype)
        elif kind == "extremes":
            big = np.finfo(dtype).max
            pool = np.array([-big, big, -0.0, 0.0, np.inf, -np.inf, 1e-3], dtype)
            a = rng.choice(pool, shape)
        else:
            a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
        if draw(st.booleans()) and a.size:
            nan = rng.random(shape) < draw(st.sampled_from([0.05, 0.5, 1.0]))
            a[nan] = np.nan
    if draw(st.booleans()):  # the search's keys are the values' bits: the other order too
        a = a.astype(a.dtype.newbyteorder())
    return a


QS = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 0.25, 0.999]),
    st.floats(0, 1),
    st.lists(st.floats(0, 1), min_size=1, max_size=4).map(np.array),
    st.floats(0, 1).map(np.float64),
    st.floats(0, 1).map(np.float32),
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    a=arrays(),
    function=st.sampled_from(FUNCTIONS),
    q=QS,
    method=st.sampled_from(METHODS),
    axis=st.sampled_from([0, None]),
    keepdims=st.booleans(),
    rows=st.integers(1, 40),
)
def test_quantiles_match_numpy(  # noqa: PLR0913 -- one per drawn parameter
    tiny_limits: Limits,
    a: np.ndarray,
    function: str,
    q: Any,
    method: str,
    axis: int | None,
    keepdims: bool,
    rows: int,
) -> None:
    if function.endswith("percentile"):
        q = q * 100
    if a.size == 0 and a.dtype == bool and function.startswith("nan"):
        # NumPy's nan-versions answer an empty bool array with nanmean's NaN before
        # they reach the interpolation that refuses bools; a lazy array checks the
        # interpolation on one row while the graph is built, and refuses.
        return
    x = tw.from_array(a, rows=rows)
    kw = {"axis": axis, "keepdims": keepdims, "method": method}
    _assert_same(_lazy(function, x, q, **kw), _numpy(function, a, q, **kw), a.size == 0)


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.float32, np.float16, np.uint8])
@pytest.mark.parametrize("function", ["median", "nanquantile"])
def test_tiny_limits_refine_and_still_match(tiny_limits: Limits, dtype: Any, function: str) -> None:
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((2000, 3)) * 1000).astype(dtype)
    x = tw.from_array(a, rows=137)
    q = [0.1, 0.5, 0.93]
    _assert_same(_lazy(function, x, q, axis=0), _numpy(function, a, q, axis=0))


def _search(x: tw.Array, function: str, limits: Limits, q: Any = None, axis: Any = 0) -> Any:
    rule = quantiles.rule_of(function, x, q, axis=axis, method="linear", keepdims=False)
    passes = quantiles.quantile_passes(x, rule, limits)
    (search,) = tw.compute(passes[-1], executor="serial")
    return rule, passes, search


def test_collected_values_stay_under_the_limit() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((20_000, 2))
    x = tw.from_array(a, rows=999)
    limits = Limits(bins=64, collect=100)
    rule, _, search = _search(x, "median", limits)
    assert search.peak_collected <= 100
    assert search.peak_bins <= 64
    assert search.passes >= 3  # 64 bins cut 20,000 values to 100 only after a few passes
    assert not search.open
    np.testing.assert_array_equal(rowwide_quantiles.finish(search, rule), np.median(a, axis=0))


def test_heavy_ties_settle_in_the_passes_the_dtype_allows() -> None:
    a = np.zeros((5000, 1), np.float64)
    a[::7] = 1.0
    x = tw.from_array(a, rows=512)
    limits = Limits(bins=16, collect=10)
    rule, passes, search = _search(x, "quantile", limits, q=[0.5, 0.99])
    assert len(passes) - 1 == order_stats.passes_needed(np.float64, 1, 4, limits)
    assert not search.open and search.peak_collected <= 10
    np.testing.assert_array_equal(
        rowwide_quantiles.finish(search, rule), np.quantile(a, [0.5, 0.99], axis=0)
    )


def test_plan_shows_the_passes_as_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        rowwide_quantiles, "limits_for", lambda budget: Limits(bins=1 << 18, collect=1 << 12)
    )
    x = tw.from_array(np.arange(1000, dtype=np.float32).reshape(500, 2), rows=100)
    plan = build_plan([Target(np.median(x, axis=0)._node)], workers=2, budget=64 << 20)
    text = describe(plan, tasks=True)
    head = "21 tasks in 3 stage(s), 3 pass(es): 15 block, 3 finish, 1 median, 2 prepare"
    assert text.startswith(head)
    assert "program 0: order stats (per column) (5 blocks)" in text
    assert "program 1: narrow 1 (5 blocks)" in text
    assert "program 2: narrow 2 (5 blocks)" in text
    assert text.rstrip().endswith("20: median deps=[19] after=[] rows=0 mem=0/0/0")


def test_a_finished_search_reads_no_block_in_later_passes() -> None:
    reads = []
    a = np.random.default_rng(3).standard_normal((3000, 2))

    def spy(block: np.ndarray) -> np.ndarray:
        reads.append(len(block))
        return block

    x = tw.from_array(a, rows=500).map_blocks(spy)
    # Collecting a column's 3000 values fits: narrow 1 settles every rank, and
    # narrows 2..4 (64-bit values need them in the worst case) are idle.
    result = np.median(x, axis=0)
    reads.clear()  # map_blocks probed its function while the graph was built
    (value,) = tw.compute(result, executor="serial")
    np.testing.assert_array_equal(value, np.median(a, axis=0))
    assert sum(reads) == 2 * 3000  # the stats pass and narrow 1


def test_rows_of_unknown_count_after_a_mask() -> None:
    a = np.random.default_rng(4).standard_normal((5000, 3)).astype(np.float32)
    x = tw.from_array(a, rows=700)
    kept = x[x[:, 0] > 0.3]
    expected = np.percentile(a[a[:, 0] > 0.3], [5, 50, 95], axis=0)
    (value,) = tw.compute(np.percentile(kept, [5, 50, 95], axis=0))
    np.testing.assert_array_equal(value, expected)


@pytest.mark.parametrize("function", [np.nanpercentile, np.percentile, np.nanmedian])
@pytest.mark.parametrize("threshold", [100, 2])
def test_what_numpy_refuses_only_over_rows_waits_for_the_row_count(
    function: Any, threshold: int
) -> None:
    # NumPy cannot subtract booleans: an error over rows, NaN (nan-versions) or another
    # error over none. After a mask, the rows are counted first.
    a = np.arange(10)[:, None] % 3 == 0
    x = tw.from_array(a, rows=4)
    args = () if function is np.nanmedian else (30,)
    kwargs = {} if function is np.nanmedian else {"method": "midpoint"}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        kept = a[np.arange(10) > threshold]
        masked = x[tw.from_array(np.arange(10), rows=4) > threshold]
        try:
            want = function(kept, *args, axis=0, **kwargs)
        except (TypeError, IndexError) as exc:
            with pytest.raises(type(exc)):
                function(masked, *args, axis=0, **kwargs).compute()
            return
        got = function(masked, *args, axis=0, **kwargs)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.compute(), want)


def test_quantile_feeds_a_lazy_expression() -> None:
    a = np.random.default_rng(5).standard_normal((4000, 2))
    x = tw.from_array(a, rows=1000)
    centred = x - np.median(x, axis=0)
    np.testing.assert_array_equal(centred.compute(), a - np.median(a, axis=0))


def test_q_out_of_range_raises_like_numpy() -> None:
    x = tw.from_array(np.ones((10, 2)), rows=4)
    with pytest.raises(ValueError, match=r"Quantiles must be in the range \[0, 1\]"):
        np.quantile(x, 1.5, axis=0)
    with pytest.raises(ValueError, match=r"Percentiles must be in the range \[0, 100\]"):
        np.percentile(x, [-1, 50])
    with pytest.raises(ValueError, match="is not a valid method"):
        np.quantile(x, 0.5, method="closest")


def test_trailing_axes_and_options_are_refused_with_a_remedy() -> None:
    x = tw.from_array(np.ones((10, 2)), rows=4)
    with pytest.raises(ValueError, match=r"map_blocks\(lambda b: np.median\(b, axis=1\)\)"):
        np.median(x, axis=1)
    with pytest.raises(TypeError, match="out="):
        np.median(x, axis=0, out=np.empty(2))
    with pytest.raises(TypeError, match=r"complex128 is not supported|real numbers"):
        np.median(tw.from_array(np.ones((4, 2), complex)), axis=0)


def test_all_nan_column_warns_like_numpy() -> None:
    a = np.ones((50, 2))
    a[:, 1] = np.nan
    x = tw.from_array(a, rows=8)
    _assert_same(_lazy("nanmedian", x, None, axis=0), _numpy("nanmedian", a, None, axis=0))
    _assert_same(_lazy("nanquantile", x, 0.3, axis=0), _numpy("nanquantile", a, 0.3, axis=0))


def test_empty_array_gives_numpy_answer() -> None:
    a = np.empty((0, 3), np.float32)
    x = tw.from_array(a)
    _assert_same(_lazy("median", x, None, axis=0), _numpy("median", a, None, axis=0))
    _assert_same(_lazy("nanmedian", x, None, axis=0), _numpy("nanmedian", a, None, axis=0))
    _assert_same(_lazy("quantile", x, 0.5, axis=None), _numpy("quantile", a, 0.5, axis=None))


def test_keys_keep_the_order_of_values() -> None:
    values = np.array([-np.inf, -3.5, -1e-300, -0.0, 0.0, 5e-324, 2.0, np.inf])
    keys = order_stats.to_keys(values)
    assert np.all(keys[1:] >= keys[:-1])
    assert keys[3] + 1 == keys[4]  # -0.0 right below 0.0
    back = order_stats.from_keys(keys, np.float64)
    np.testing.assert_array_equal(back, values)
    ints = np.array([-128, -1, 0, 127], np.int8)
    keys = order_stats.to_keys(ints)
    assert np.all(keys[1:] > keys[:-1])
    np.testing.assert_array_equal(order_stats.from_keys(order_stats.to_keys(ints), np.int8), ints)


def test_a_tiny_budget_bounds_what_the_passes_hold(tmp_path: Any) -> None:
    tw.memory.budget("2MB")
    limits = rowwide_quantiles.limits_for(2 << 20)
    assert limits.collect * 8 + limits.bins * 8 <= (2 << 20) // 16 + 16 * 1024
    a = np.random.default_rng(6).standard_normal((300_000, 3))  # 7.2 MB: 3.6 budgets
    a[::97, 1] = np.nan
    np.save(tmp_path / "a.npy", a)
    x = tw.from_npy(tmp_path / "a.npy")
    rule = quantiles.rule_of(
        "nanpercentile", x, [10, 50, 90], axis=0, method="linear", keepdims=False
    )
    passes = quantiles.quantile_passes(x, rule)
    (search,) = tw.compute(passes[-1], progress=False)
    assert search.peak_collected <= limits.collect
    assert search.peak_bins > 0  # 300,000 values per column do not fit: histograms first
    np.testing.assert_array_equal(
        rowwide_quantiles.finish(search, rule), np.nanpercentile(a, [10, 50, 90], axis=0)
    )
    (value,) = tw.compute(np.nanpercentile(x, [10, 50, 90], axis=0), progress=False)
    np.testing.assert_array_equal(value, np.nanpercentile(a, [10, 50, 90], axis=0))


def test_rows_that_change_between_passes_are_an_error() -> None:
    calls = []

    def drifting(block: np.ndarray) -> np.ndarray:
        calls.append(1)
        return block + len(calls) * 1e-3  # a different answer on every read

    x = tw.from_array(np.random.default_rng(8).standard_normal((400, 1)), rows=100)
    with pytest.raises(RuntimeError, match="rows changed between the passes"):
        tw.compute(np.median(x.map_blocks(drifting), axis=0), executor="serial")
