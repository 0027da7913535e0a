"""Row-wise NumPy functions on lazy arrays (tierflow/engine/api/: linalg, einsum, stacking,
nanfunctions), against NumPy: np.linalg.norm, np.einsum, np.vstack / np.hstack / np.column_stack, the nan-reductions."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierflow as tw

from common import examples

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_]
NAN_WARNINGS = ("All-NaN slice encountered", "Mean of empty slice", "Degrees of freedom")


def _data(seed: int, dtype: Any, rows: int, row_shape: tuple[int, ...], nans: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    shape = (rows, *row_shape)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -5, 6, size=shape).astype(dtype)
    x = rng.uniform(-3, 3, size=shape)
    if not row_shape:
        return x.astype(dtype)
    x[:, 0] = 1.5  # a constant column
    if nans:
        x[rng.random(shape) < 0.3] = np.nan
        x[:, -1] = np.nan  # an all-NaN column
        if rows > 1:
            x[1, 0] = np.nan
    return x.astype(dtype)


def _run(fn: Callable[[], Any]) -> tuple[Any, set[str]]:
    """The result (or the error) and the nan-warnings raised while it was computed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: Any = fn()
        except (ValueError, TypeError) as exc:
            result = exc
    found = {w for w in NAN_WARNINGS for c in caught if str(c.message).startswith(w)}
    return result, found


def _tolerance(dtype: np.dtype) -> float:
    return {2: 2e-3, 4: 2e-6, 8: 1e-12}.get(dtype.itemsize, 1e-12) if dtype.kind in "fc" else 0


def _check(got: Any, want: Any, oracle: Any = None) -> None:
    assert type(got) is type(want)
    got_a, want_a = np.asarray(got), np.asarray(want)
    assert got_a.dtype == want_a.dtype
    assert got_a.shape == want_a.shape
    with np.errstate(over="ignore"):  # float16 results past its range are inf
        reference = want_a if oracle is None else np.asarray(oracle).astype(want_a.dtype)
    rtol = _tolerance(want_a.dtype)
    if rtol == 0:
        np.testing.assert_array_equal(got_a, reference)
    else:
        finite = np.abs(reference.astype(np.float64))
        scale = float(np.max(finite, where=np.isfinite(finite), initial=1.0))
        np.testing.assert_allclose(got_a, reference, rtol=rtol, atol=rtol * scale, equal_nan=True)


NAN_FUNCTIONS = [
    np.nanmin, np.nanmax, np.nanmean, np.nanvar, np.nanstd, np.nanprod, np.nansum,
    np.nanargmin, np.nanargmax,
]  # fmt: skip


@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 300),
    row_shape=st.sampled_from([(1,), (3,), (2, 3)]),
    block=st.integers(1, 70),
    nans=st.booleans(),
    fn=st.sampled_from(NAN_FUNCTIONS),
    axis=st.sampled_from([0, 1, -1, None, (0, 1)]),
    keepdims=st.booleans(),
)
@settings(max_examples=examples(200), deadline=None)
def test_nan_reductions_match_numpy(  # noqa: PLR0913 -- hypothesis draws
    seed: int, dtype: Any, rows: int, row_shape: tuple[int, ...], block: int, nans: bool,
    fn: Any, axis: Any, keepdims: bool,
) -> None:  # fmt: skip
    x = _data(seed, dtype, rows, row_shape, nans)
    kwargs: dict[str, Any] = {"axis": axis, "keepdims": keepdims}
    if fn in (np.nanargmin, np.nanargmax) and isinstance(axis, tuple):
        return  # NumPy's argmin takes one axis
    if fn in (np.nanvar, np.nanstd) and seed % 3 == 0:
        kwargs["ddof"] = 1
    want, want_warnings = _run(lambda: fn(x, **kwargs))
    lazy = tw.from_array(x, rows=block)
    got, got_warnings = _run(lambda: tw.compute(fn(lazy, **kwargs))[0])
    if isinstance(want, Exception):
        assert isinstance(got, type(want)), got
        assert str(got).endswith(str(want)) or str(want) in str(got)
        return
    assert not isinstance(got, Exception), got
    assert got_warnings == want_warnings
    oracle = None
    if np.dtype(dtype).kind == "f" and fn not in (np.nanargmin, np.nanargmax):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            oracle = fn(x.astype(np.float64), **kwargs)
    _check(got, want, oracle)


def test_all_nan_columns_get_numpys_results_and_warnings() -> None:
    x = np.full((40, 3), np.nan, np.float32)
    x[:, 0] = np.arange(40)
    lazy = tw.from_array(x, rows=16)
    for fn, message in [
        (np.nanmin, "All-NaN slice encountered"),
        (np.nanmax, "All-NaN slice encountered"),
        (np.nanmean, "Mean of empty slice"),
        (np.nanvar, "Degrees of freedom <= 0 for slice."),
        (np.nanstd, "Degrees of freedom <= 0 for slice."),
    ]:
        result = fn(lazy, axis=0)
        assert isinstance(result, tw.Array)  # lazy until computed
        with pytest.warns(RuntimeWarning, match=message):
            got = result.compute()
        assert got.dtype == np.float32
        assert np.isnan(got[1:]).all() and np.isfinite(got[0])
    with pytest.raises(ValueError, match="All-NaN slice encountered"):
        np.nanargmin(lazy, axis=0).compute()
    assert np.nansum(lazy, axis=0).compute()[1] == 0
    assert np.nanprod(lazy, axis=0).compute()[2] == 1


def test_nanvar_takes_two_passes_and_keeps_float64_accuracy() -> None:
    rng = np.random.default_rng(5)
    x = (1e6 + rng.standard_normal((5000, 2))).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    got = np.nanstd(tw.from_array(x, rows=777), axis=0, ddof=1).compute()
    want = np.nanstd(x.astype(np.float64), axis=0, ddof=1).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=4e-7)


@pytest.mark.parametrize("function", [np.nanvar, np.nanstd])
def test_nanvar_of_complex_values_with_a_real_dtype_is_numpys(function: Any) -> None:
    # NumPy's mean in a real dtype= keeps the real parts (ComplexWarning); the deviations
    # from it are complex, so the imaginary parts count whole.
    rng = np.random.default_rng(6)
    a = rng.standard_normal((40, 3)) + 1j * (4 + rng.standard_normal((40, 3)))
    a[[3, 17], [0, 2]] = np.nan
    with pytest.warns(np.exceptions.ComplexWarning):
        got = function(tw.from_array(a, rows=7), axis=0, dtype=np.float64).compute()
    with pytest.warns(np.exceptions.ComplexWarning):
        want = function(a, axis=0, dtype=np.float64)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_nanmean_of_complex_values_with_a_real_dtype_sums_the_real_parts() -> None:
    # NumPy sums in the real dtype=: an infinite imaginary part does not turn the real
    # mean into NaN, as a complex mean divided by the count would.
    a = np.array([[np.inf - 2j], [1 - np.inf * 1j], [np.nan + 0j], [3 + 1j]], np.complex64)
    with pytest.warns(np.exceptions.ComplexWarning):
        got = np.nanmean(tw.from_array(a, rows=2), axis=0, dtype=np.float64).compute()
    with pytest.warns(np.exceptions.ComplexWarning):
        want = np.nanmean(a, axis=0, dtype=np.float64)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_nan_reductions_refuse_out_and_where() -> None:
    lazy = tw.from_array(np.ones((10, 2)))
    with pytest.raises(TypeError, match=r"np\.nanmean\(\.\.\., out=\.\.\.\) is not supported"):
        np.nanmean(lazy, axis=0, out=np.empty(2))
    with pytest.raises(TypeError, match=r"np\.nanmin: initial= is not supported"):
        np.nanmin(lazy, axis=0, initial=3)
    with pytest.raises(TypeError, match="dtype must be inexact"):
        np.nanmean(lazy, axis=0, dtype=np.int32)


# -- np.linalg.norm ------------------------------------------------------------------------

NORM_CASES = [
    ({"axis": 1}, 2),
    ({"axis": -1, "ord": 1}, 2),
    ({"axis": 1, "ord": np.inf, "keepdims": True}, 2),
    ({"axis": 1, "ord": 3}, 2),
    ({"axis": (1, 2), "ord": "fro"}, 3),
    ({"axis": (1, 2), "ord": 2}, 3),
    ({}, 2),
    ({}, 3),
    ({"keepdims": True}, 2),
    ({"axis": 0}, 2),
    ({"axis": 0, "ord": 1}, 2),
    ({"axis": 0, "ord": np.inf}, 2),
    ({"axis": 0, "ord": -np.inf}, 2),
    ({"axis": 0, "ord": 0}, 2),
    ({"axis": 0, "ord": 0.5, "keepdims": True}, 2),
    ({"axis": 0, "ord": -2}, 2),
    ({"ord": 1}, 2),
    ({"ord": -1}, 2),
    ({"ord": np.inf}, 2),
    ({"ord": -np.inf, "keepdims": True}, 2),
    ({"ord": "fro"}, 2),
    ({"axis": (1, 0), "ord": 1}, 2),
    ({"axis": (0, 2), "ord": np.inf}, 3),
    ({"axis": (2, 0), "ord": None, "keepdims": True}, 3),
    ({"ord": 3}, 1),
    ({"ord": 0}, 1),
]


@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.float16, np.float32, np.float64, np.int16, np.bool_, np.complex64]),
    rows=st.integers(1, 200),
    block=st.integers(1, 64),
    case=st.sampled_from(NORM_CASES),
)
@settings(max_examples=examples(150), deadline=None)
def test_norm_matches_numpy(
    seed: int, dtype: Any, rows: int, block: int, case: tuple[dict[str, Any], int]
) -> None:
    kwargs, ndim = case
    rng = np.random.default_rng(seed)
    shape = (rows, 3, 2)[:ndim]
    x = _data(seed, dtype if np.dtype(dtype).kind != "c" else np.float32, rows, shape[1:], False)
    if np.dtype(dtype).kind == "c":
        x = (x + 1j * rng.standard_normal(shape)).astype(dtype)
    want, _ = _run(lambda: np.linalg.norm(x, **kwargs))
    lazy = tw.from_array(x, rows=block)
    got, _ = _run(lambda: np.linalg.norm(lazy, **kwargs))
    if isinstance(got, tw.Array):
        got = got.compute()
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want)
        return
    wide = x.astype(np.complex128 if np.dtype(dtype).kind == "c" else np.float64)
    _check(got, want, np.linalg.norm(wide, **kwargs))


def test_norm_over_rows_refuses_singular_values() -> None:
    lazy = tw.from_array(np.ones((10, 3)))
    for ord in (2, -2, "nuc"):
        with pytest.raises(ValueError, match=r"needs the singular values.*compute\(\) first"):
            np.linalg.norm(lazy, ord=ord)
    with pytest.raises(ValueError, match=r"Improper number of dimensions to norm\."):
        np.linalg.norm(tw.from_array(np.ones((4, 2, 2))), ord=1)


# -- np.einsum -----------------------------------------------------------------------------

EINSUM_CASES = [
    ("ij,jk->ik", [(7,), None], [(7, 3)]),
    ("ij,ij->i", [(4,), (4,)], []),
    ("ij->i", [(4,)], []),
    ("ijk,k->ij", [(2, 3), None], [(3,)]),
    ("ij,j->i", [(5,), None], [(5,)]),
    ("ij,ij->", [(4,), (4,)], []),
    ("ij->j", [(4,)], []),
    ("ij,ik->jk", [(3,), (2,)], []),
    ("i,i", [(), ()], []),
    ("ij,jk", [(3,), None], [(3, 2)]),
    ("ij,j", [(3,), None], [(3,)]),
    ("ij->", [(4,)], []),
    ("ijk->ik", [(2, 3)], []),
]


@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.float16, np.bool_]),
    rows=st.integers(1, 200),
    block=st.integers(1, 64),
    case=st.sampled_from(EINSUM_CASES),
)
@settings(max_examples=examples(120), deadline=None)
def test_einsum_matches_numpy(
    seed: int, dtype: Any, rows: int, block: int, case: tuple[str, list[Any], list[Any]]
) -> None:
    subscripts, lazy_shapes, const_shapes = case
    rng = np.random.default_rng(seed)
    arrays = [
        _data(seed + k, dtype, rows, s, False) if s is not None else None
        for k, s in enumerate(lazy_shapes)
    ]
    consts = iter(_data(seed + 9, dtype, s[0], s[1:], False) for s in const_shapes)
    operands = [a if a is not None else next(consts) for a in arrays]
    lazy = [
        tw.from_array(a, rows=block + k) if s is not None else a
        for k, (a, s) in enumerate(zip(operands, lazy_shapes, strict=True))
    ]
    want = np.einsum(subscripts, *operands)
    got = np.einsum(subscripts, *lazy)
    assert isinstance(got, tw.Array)
    got = got.compute()
    oracle = None
    if np.dtype(dtype).kind == "f":
        oracle = np.einsum(subscripts, *(o.astype(np.float64) for o in operands))
    del rng
    _check(got, want, oracle)


def test_einsum_refusals_say_how_to_write_it() -> None:
    x = tw.from_array(np.ones((10, 3)))
    y = tw.from_array(np.ones((12, 3)))
    with pytest.raises(ValueError, match="write 'ij->ij' and move the axis"):
        np.einsum("ij->ji", x)
    with pytest.raises(ValueError, match="must share one letter"):
        np.einsum("ij,kj->ik", x, x)
    with pytest.raises(ValueError, match="spell out every axis"):
        np.einsum("...j->...", x)
    with pytest.raises(ValueError, match=r"operands could not be broadcast together with remapped"):
        np.einsum("ij,ij->i", x, y)  # NumPy's error for rows that differ
    with pytest.raises(ValueError, match="repeats the row axis"):
        np.einsum("ii->i", tw.from_array(np.ones((3, 3))))
    with pytest.raises(TypeError, match="subscripts as a string"):
        np.einsum(x, [0, 1], [1])


def test_einsum_kept_rows_stays_lazy_and_row_blocked(tmp_path: Any) -> None:
    a = np.random.default_rng(3).random((1000, 4), dtype=np.float32)
    np.save(tmp_path / "a.npy", a)
    x = tw.from_npy(tmp_path / "a.npy", rows=100)
    out = np.einsum("ij,ij->i", x, x)
    assert out.shape == (1000,) and out.nblocks == 10
    np.testing.assert_array_equal(out.compute(), np.einsum("ij,ij->i", a, a))


# -- vstack, hstack, column_stack ----------------------------------------------------------


def test_stacks_follow_numpy() -> None:
    rng = np.random.default_rng(6)
    a, b = rng.random((50, 3)), rng.random((50, 2)).astype(np.float32)
    c = rng.random(50)
    x, y, z = tw.from_array(a, rows=7), tw.from_array(b, rows=11), tw.from_array(c, rows=13)
    cases = [
        (np.vstack([x, x[:5]]), np.vstack([a, a[:5]])),
        (np.vstack((x, a[:3])), np.vstack((a, a[:3]))),
        (np.vstack([x, x], dtype=np.float32), np.vstack([a, a], dtype=np.float32)),
        (np.hstack([x, y]), np.hstack([a, b])),
        (np.hstack([z, z[:4]]), np.hstack([c, c[:4]])),
        (np.column_stack([z, x, b]), np.column_stack([c, a, b])),
        (np.column_stack([z, z * 2]), np.column_stack([c, c * 2])),
    ]
    for lazy, want in cases:
        assert isinstance(lazy, tw.Array)
        got = lazy.compute()
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"1-D lazy array .* would make its rows one row"):
        np.vstack([z, z])
    with pytest.raises(ValueError, match="dimensions except for the concatenation axis"):
        np.hstack([x, x[:10]])
    with pytest.raises(TypeError, match="Cannot cast array data"):
        np.vstack([x, x], dtype=np.int8, casting="safe")


def test_nanvar_and_nanstd_of_complex_data_center_on_the_complex_mean() -> None:
    a = np.array([[1 + 1j, 2], [3j, complex(np.nan, 1)], [2, 1], [-1j, 4 - 2j]], np.complex64)
    x = tw.from_array(a, rows=3)
    for fn in (np.nanvar, np.nanstd):
        for axis in (None, 0):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no ComplexWarning: nothing is cast to real
                got = np.asarray(fn(x, axis=axis).compute())
            want = fn(a, axis=axis)
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs", [{}, {"axis": 0}, {"ord": "fro"}, {"axis": 0, "ord": 2}, {"axis": 1}]
)
def test_the_norm_of_complex_values_with_infinite_parts_is_numpys(kwargs: dict[str, Any]) -> None:
    # |inf + nan j| is inf, but NumPy's norm squares by parts and gets NaN, and its
    # conj(x) * x warns for an infinite part.
    a = np.array([[1 + 1j, complex(np.inf, np.nan)], [complex(np.inf, 1), 2], [3j, 1]])
    x = tw.from_array(a, rows=2)
    with warnings.catch_warnings(record=True) as numpys:
        warnings.simplefilter("always")
        want = np.linalg.norm(a, **kwargs)
    with warnings.catch_warnings(record=True) as ours:
        warnings.simplefilter("always")
        got = np.linalg.norm(x, **kwargs).compute()
    np.testing.assert_array_equal(got, want)
    assert {w.category for w in ours} == {w.category for w in numpys}
