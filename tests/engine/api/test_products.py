"""Products across the rows: ``x.T @ y``, ``x.T @ x``, ``np.cov`` and ``np.corrcoef``
against NumPy, and the errors for every other use of ``x.T``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tierflow as tw
from tierflow.engine.api import products

from common import examples

DTYPES = ["bool", "int8", "int32", "int64", "uint8", "float16", "float32", "float64"]
SETTINGS = settings(
    max_examples=examples(80),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _elements(dt: np.dtype) -> st.SearchStrategy[Any]:
    if dt.kind == "f":
        return st.floats(-100, 100, width=dt.itemsize * 8, allow_nan=False)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return st.integers(int(info.min), int(info.max))
    return st.booleans()


@st.composite
def tall(draw: st.DrawFn, rows: int, row_shape: tuple[int, ...], dtype: str | None = None) -> Any:
    dt = np.dtype(dtype or draw(st.sampled_from(DTYPES)))
    return draw(hnp.arrays(dt, (rows, *row_shape), elements=_elements(dt)))


def _reference_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """NumPy's ``a.T @ b``: exact for integers and bool, float64-accumulated otherwise."""
    expected = np.matmul(a.T, b)
    if expected.dtype.kind == "f":
        return np.matmul(a.T.astype(np.float64), b.astype(np.float64)).astype(expected.dtype)
    return expected


def _assert_product(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    expected = _reference_product(a, b)
    assert got.dtype == np.matmul(a.T, b).dtype
    assert got.shape == expected.shape
    if expected.dtype.kind == "f":
        tol = {2: 1e-2, 4: 1e-5, 8: 1e-12}[expected.dtype.itemsize]
        scale = np.abs(a.T.astype(np.float64)) @ np.abs(b.astype(np.float64)) + 1
        with np.errstate(invalid="ignore"):
            close = np.abs(got.astype(np.float64) - expected.astype(np.float64)) <= tol * scale
        assert np.all(close | (got == expected)), "equal where float16 overflowed to inf"

    else:
        np.testing.assert_array_equal(got, expected)


# -- x.T @ y ----------------------------------------------------------------------------


@pytest.mark.executors("threads")
@pytest.mark.filterwarnings("ignore:overflow encountered")  # float16, as in NumPy
@SETTINGS
@given(data=st.data())
def test_x_T_at_y_matches_numpy_for_any_shape_block_and_dtype(data: st.DataObject) -> None:
    rows = data.draw(st.sampled_from([0, 1, 2, 5, 13, 31]))
    k = data.draw(st.integers(1, 4))
    m = data.draw(st.sampled_from([None, 1, 3]))
    a = data.draw(tall(rows, (k,)))
    b = data.draw(tall(rows, () if m is None else (m,)))
    x = tw.from_array(a, rows=data.draw(st.integers(1, 7)))
    y = tw.from_array(b, rows=data.draw(st.integers(1, 7)))
    _assert_product((x.T @ y).compute(), a, b)


@pytest.mark.executors("threads")
@pytest.mark.filterwarnings("ignore:overflow encountered")  # float16, as in NumPy
@SETTINGS
@given(data=st.data())
def test_x_T_at_x_matches_numpy_and_is_symmetric(data: st.DataObject) -> None:
    rows = data.draw(st.sampled_from([0, 1, 2, 5, 13, 31]))
    a = data.draw(tall(rows, (data.draw(st.integers(1, 4)),)))
    x = tw.from_array(a, rows=data.draw(st.integers(1, 7)))
    got = (x.T @ x).compute()
    _assert_product(got, a, a)
    np.testing.assert_array_equal(got, got.T)


def test_x_T_at_x_reads_x_once_per_block() -> None:
    x = tw.from_array(np.arange(40.0).reshape(20, 2), rows=5)
    product = x.T @ x
    assert product._node.n_chunked == 1, "the symmetric product has x as its one input"
    assert product._node.label() == "x.T @ x"


def test_the_spellings_of_the_product_agree() -> None:
    a = np.random.default_rng(1).standard_normal((101, 3))
    b = np.random.default_rng(2).standard_normal((101, 2))
    x, y = tw.from_array(a, rows=17), tw.from_array(b, rows=23)
    expected = a.T @ b
    for got in (
        x.T @ y,
        x.transpose() @ y,
        x.transpose(1, 0) @ y,
        x.transpose((1, 0)) @ y,
        np.transpose(x) @ y,
        np.matmul(x.T, y),
        np.dot(x.T, y),
        x.T @ b,
        np.dot(x.T, b),
    ):
        np.testing.assert_allclose(got.compute(), expected, rtol=1e-12)
    assert x.T.T is x
    assert x.T.shape == (3, 101)


def test_float32_products_accumulate_in_float64() -> None:
    a = (1e4 + np.random.default_rng(3).standard_normal((200_000, 2))).astype(np.float32)
    x = tw.from_array(a, rows=30_000)
    got = (x.T @ x).compute()
    exact = a.T.astype(np.float64) @ a.astype(np.float64)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, exact.astype(np.float32), rtol=1e-7)


def test_rows_from_the_same_mask_multiply() -> None:
    a = np.random.default_rng(4).standard_normal((500, 3))
    b = np.random.default_rng(5).standard_normal((500, 2))
    x, y = tw.from_array(a, rows=64), tw.from_array(b, rows=64)
    mask = x[:, 0] > 0
    keep = a[:, 0] > 0
    np.testing.assert_allclose((x[mask].T @ y[mask]).compute(), a[keep].T @ b[keep], rtol=1e-12)
    np.testing.assert_allclose((x[mask].T @ x[mask]).compute(), a[keep].T @ a[keep], rtol=1e-12)


def test_operands_of_one_mask_with_other_block_sizes_multiply() -> None:
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((40, 3)), rng.standard_normal((40, 2))
    x, y = tw.from_array(a, rows=3), tw.from_array(b, rows=5)
    m = x[:, 0] > 0
    keep = a[:, 0] > 0
    close = np.testing.assert_allclose
    close((x[m].T @ y[m]).compute(), a[keep].T @ b[keep], rtol=1e-12)
    close(np.dot(x[m].T, y[m]).compute(), a[keep].T @ b[keep], rtol=1e-12)
    close(np.cov(x[m], y[m], rowvar=False).compute(), np.cov(a[keep], b[keep], rowvar=False))
    close(np.corrcoef(x[m], y[m], rowvar=False).compute(), np.corrcoef(a[keep], b[keep], False))
    close(np.einsum("ij,ik->jk", x[m], y[m]).compute(), a[keep].T @ b[keep], rtol=1e-12)
    close(np.einsum("ij,ij->i", x[m][:, :2], y[m]).compute(), (a[keep][:, :2] * b[keep]).sum(1))


def test_operands_of_different_masks_multiply_when_their_counts_agree() -> None:
    a = np.arange(200.0).reshape(100, 2) % 9
    x = tw.from_array(a, rows=10)
    y = tw.from_array(a[::-1].copy(), rows=25)
    kx, ky = a[:, 0] > 3, a[::-1, 0] > 3  # as many rows kept, from other places
    got = (x[x[:, 0] > 3].T @ y[y[:, 0] > 3]).compute()
    np.testing.assert_allclose(got, a[kx].T @ a[::-1][ky])
    everything = x[x[:, 0] >= 0]  # keeps all 100 rows: it lines up with y once counted
    np.testing.assert_allclose((everything.T @ y).compute(), a.T @ a[::-1])


def test_in_memory_operands_after_a_mask_multiply_once_counted() -> None:
    a = np.arange(30.0).reshape(10, 3)
    x = tw.from_array(a, rows=3)
    m = x[:, 0] > 15  # keeps 4 rows
    kept = a[a[:, 0] > 15]
    np.testing.assert_array_equal((x[m].T @ np.ones((4, 1))).compute(), kept.T @ np.ones((4, 1)))
    np.testing.assert_array_equal((x[m].T @ np.arange(4.0)).compute(), kept.T @ np.arange(4.0))
    np.testing.assert_array_equal(
        np.einsum("ij,i->j", x[m], np.arange(4.0)).compute(),
        np.einsum("ij,i->j", kept, np.arange(4.0)),
    )
    np.testing.assert_allclose(
        np.cov(x[m], np.arange(4.0)[:, None] ** 2, rowvar=False).compute(),
        np.cov(kept, np.arange(4.0)[:, None] ** 2, rowvar=False),
    )


def test_rows_that_differ_after_a_mask_raise_numpys_error_when_computed() -> None:
    a = np.arange(30.0).reshape(10, 3)
    x, y = tw.from_array(a, rows=3), tw.from_array(a[:, :2].copy(), rows=4)
    m = x[:, 0] > 15  # keeps 4 rows
    product = x[m].T @ np.ones((5, 1))  # built lazily: the rows are not counted yet
    with pytest.raises(ValueError, match=r"matmul: Input operand 1 has a mismatch in its core"):
        product.compute()
    with pytest.raises(ValueError, match=r"\(size 9 is different from 4\)"):
        (x[m].T @ y[y[:, 0] > 0]).compute()
    with pytest.raises(ValueError, match=r"along dimension 1, the array at index 0 has size 4 "):
        np.cov(x[m], y[y[:, 0] > 0], rowvar=False).compute()
    with pytest.raises(ValueError, match=r"operands could not be broadcast together with remapped"):
        np.einsum("ij,ik->jk", x[m], y[y[:, 0] > 0]).compute()


def test_rows_that_differ_are_refused_with_numpys_error() -> None:
    x = tw.from_array(np.ones((100, 2)))
    with pytest.raises(ValueError, match=r"core dimension 0.*\(size 99 is different from 100\)"):
        x.T @ tw.from_array(np.ones((99, 3)))
    with pytest.raises(ValueError, match=r"\(size 2 is different from 100\)"):
        x.T @ np.ones((2, 3))
    with pytest.raises(ValueError, match=r"array at index 0 has size 100 and the array at"):
        np.cov(x, np.ones((99, 3)), rowvar=False)
    with pytest.raises(ValueError, match=r"1-D or 2-D"):
        x.T @ tw.from_array(np.ones((100, 2, 2)))


MISUSES: dict[str, tuple[Callable[[Any, Any], Any], str]] = {
    "x.T + 1": (lambda x, y: x.T + 1, r"x.T \+ \.\.\. is not: write \(x \+ \.\.\.\)\.T @ y"),
    "1 + x.T": (lambda x, y: 1 + x.T, r"x.T \+"),
    "x.T * y.T": (lambda x, y: x.T * y.T, r"x.T \*"),
    "x.T < 0": (lambda x, y: x.T < 0, r"x.T <"),
    "-x.T": (lambda x, y: -x.T, r"neg\(x.T\)"),
    "x.T[0]": (lambda x, y: x.T[0], r"x\[:, 0\] for x.T\[0\]"),
    "np.cumsum(x.T)": (lambda x, y: np.cumsum(x.T), r"np.cumsum\(x.T, \.\.\.\) is not"),
    "np.sum(x.T, axis=0)": (lambda x, y: np.sum(x.T, axis=0), r"keep its rows"),
    "np.exp(x.T)": (lambda x, y: np.exp(x.T), r"np.exp is not: apply it to x"),
    "np.add.reduce(x.T)": (lambda x, y: np.add.reduce(x.T), r"np.add.reduce"),
    "x.T.sum()": (lambda x, y: x.T.sum(), r"x.T.sum is not: use x.sum with the axes swapped"),
    "x.T.compute()": (lambda x, y: x.T.compute(), r"x.compute\(\).T"),
    "x.T.persist()": (lambda x, y: x.T.persist(), r"persist x"),
    "np.asarray(x.T)": (lambda x, y: np.asarray(x.T), r"converting it to a NumPy array"),
    "list(x.T)": (lambda x, y: list(x.T), r"iterating over x.T"),
    "len(x.T)": (lambda x, y: len(x.T), r"len\(x.T\)"),
    "bool(x.T)": (lambda x, y: bool(x.T), r"truth value"),
    "y @ x.T": (lambda x, y: y @ x.T, r"w @ x.T \(the right operand\)"),
    "w @ x.T": (lambda x, y: np.ones((2, 3)) @ x.T, r"w @ x.T"),
    "np.dot(y, x.T)": (lambda x, y: np.dot(y, x.T), r"x.T"),
    "np.matmul(w, x.T)": (lambda x, y: np.matmul(np.ones((2, 3)), x.T), r"w @ x.T"),
    "x.T @ y.T": (lambda x, y: x.T @ y.T, r"x.T @ y.T.*\(y @ x\).T"),
    "x.T @ x.T": (lambda x, y: x.T @ x.T, r"x.T @ y.T"),
    "np.concatenate([x.T])": (lambda x, y: np.concatenate([x.T]), r"x.T"),
}


@pytest.mark.executors("threads")
@pytest.mark.parametrize("name", list(MISUSES))
def test_every_other_use_of_x_T_says_what_to_do(name: str) -> None:
    use, match = MISUSES[name]
    x = tw.from_array(np.ones((10, 3)), rows=4)
    y = tw.from_array(np.ones((10, 3)), rows=4)
    with pytest.raises(TypeError, match=r"x.T is only lazy as the left operand of @"):
        use(x, y)
    with pytest.raises(TypeError, match=match):
        use(x, y)


def test_transposes_that_are_not_x_T() -> None:
    a = np.arange(24.0).reshape(4, 3, 2)
    x = tw.from_array(a, rows=3)
    v = tw.from_array(np.arange(5.0))
    assert v.T is v, "a 1-D array is its own transpose, as in NumPy"
    np.testing.assert_array_equal(x.transpose(0, 2, 1).compute(), a.transpose(0, 2, 1))
    np.testing.assert_array_equal(np.transpose(x, (0, 2, 1)).compute(), a.transpose(0, 2, 1))
    assert x.transpose(0, 1, 2) is x
    total = x.sum(axis=0)  # an in-memory value transposes lazily
    np.testing.assert_array_equal(total.T.compute(), a.sum(axis=0).T)
    moved = x.T  # the rows last: lazy in reductions over them, and transposed back
    assert moved.shape == (2, 3, 4) and not hasattr(moved, "chunks")
    assert moved.T is x and np.transpose(moved) is x
    assert np.moveaxis(x.transpose(1, 2, 0), -1, 0) is x
    np.testing.assert_array_equal(np.sum(moved, axis=-1).compute(), a.T.sum(axis=-1))
    q = np.nanquantile(x.transpose(1, 2, 0), [0.1, 0.9], axis=(-1,))
    np.testing.assert_array_equal(
        q.compute(), np.nanquantile(a.transpose(1, 2, 0), [0.1, 0.9], axis=-1)
    )
    kept = np.mean(np.moveaxis(x, 0, 1), axis=1, keepdims=True)
    np.testing.assert_allclose(kept.compute(), np.moveaxis(a, 0, 1).mean(axis=1, keepdims=True))
    np.testing.assert_array_equal(np.moveaxis(x, 1, 2).compute(), np.moveaxis(a, 1, 2))
    with pytest.raises(TypeError, match=r"np.sum over axes \(0,\) of the transpose"):
        np.sum(moved, axis=0)
    with pytest.raises(TypeError, match=r"x.T\[0\]"):
        moved[0]
    with pytest.raises(ValueError, match="don't match"):
        x.transpose(0, 1)


# -- np.cov and np.corrcoef -------------------------------------------------------------


def quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return fn()


@pytest.mark.executors("threads")
@SETTINGS
@given(data=st.data())
def test_cov_matches_numpy_on_any_shape_block_and_dtype(data: st.DataObject) -> None:
    rows = data.draw(st.sampled_from([0, 1, 2, 3, 7, 31]))
    k = data.draw(st.sampled_from([None, 1, 2, 4]))
    a = data.draw(tall(rows, () if k is None else (k,)))
    if data.draw(st.booleans(), label="constant column") and a.ndim == 2 and rows:
        a[:, 0] = a[0, 0]
    second = data.draw(st.booleans(), label="second array")
    b = data.draw(tall(rows, (2,), "float32")) if second else None
    ddof = data.draw(st.sampled_from([None, 0, 1, 2]))
    bias = data.draw(st.booleans())
    x = tw.from_array(a, rows=data.draw(st.integers(1, 7)))
    y = tw.from_array(b, rows=data.draw(st.integers(1, 7))) if b is not None else None
    kwargs: dict[str, Any] = {"rowvar": False, "bias": bias, "ddof": ddof}
    try:
        expected = quiet(lambda: np.cov(a, b, **kwargs))
    except ValueError:  # NumPy reads one row of a and b as variables of different lengths
        with pytest.raises(ValueError):
            quiet(lambda: np.cov(x, y, **kwargs).compute())
        return
    got = quiet(lambda: np.cov(x, y, **kwargs).compute())
    assert got.dtype == expected.dtype and got.shape == expected.shape
    # NumPy's own rounding: its float64 mean of data near v is off by ~eps * v, which
    # gives a constant column a variance of ~(eps * v)**2 where the exact one is 0.
    rounding = (8 * np.finfo(np.float64).eps * _largest(a, b)) ** 2
    scale = np.abs(np.nan_to_num(expected)).max(initial=1)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9 * scale + rounding)
    expected_r = quiet(lambda: np.corrcoef(a, b, rowvar=False))
    got_r = quiet(lambda: np.corrcoef(x, y, rowvar=False).compute())
    assert got_r.shape == expected_r.shape
    # Correlations with a column whose variance is all rounding are noise in NumPy.
    spread = np.atleast_1d(np.diagonal(np.atleast_2d(expected)))
    defined = spread > 1e3 * rounding
    pairs = np.outer(defined, defined).reshape(got_r.shape)
    np.testing.assert_allclose(got_r[pairs], expected_r[pairs], rtol=1e-9, atol=1e-9)


def _largest(*arrays: np.ndarray | None) -> float:
    return max(
        (float(np.abs(v.astype(np.float64)).max(initial=0)) for v in arrays if v is not None),
        default=0.0,
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cov_of_data_far_from_zero_is_as_accurate_as_numpy_in_float64(dtype: str) -> None:
    rng = np.random.default_rng(6)
    a = (1e6 + rng.standard_normal((300_000, 3)) * [1, 0.1, 10]).astype(dtype)
    x = tw.from_array(a, rows=7_001)
    exact = np.cov(a.astype(np.float64), rowvar=False)
    got = np.cov(x, rowvar=False).compute()
    np.testing.assert_allclose(got, exact, rtol=1e-10, atol=1e-10 * np.abs(exact).max())
    np.testing.assert_allclose(
        np.corrcoef(x, rowvar=False).compute(),
        np.corrcoef(a.astype(np.float64), rowvar=False),
        rtol=1e-10,
        atol=1e-12,
    )


def test_cov_under_a_tiny_budget() -> None:
    tw.memory.budget("2MB")
    a = np.random.default_rng(7).standard_normal((400_000, 4)).astype(np.float32)
    x = tw.from_array(a)
    assert x.nblocks > 4, "the budget cut the array into many blocks"
    np.testing.assert_allclose(
        np.cov(x, rowvar=False).compute(), np.cov(a, rowvar=False), rtol=1e-10
    )
    np.testing.assert_allclose((x.T @ x).compute(), a.T @ a.astype(np.float64), rtol=1e-6)


def test_cov_of_masked_rows() -> None:
    a = np.random.default_rng(8).standard_normal((300, 3))
    x = tw.from_array(a, rows=40)
    keep = a[:, 1] > 0
    np.testing.assert_allclose(
        np.cov(x[x[:, 1] > 0], rowvar=False).compute(), np.cov(a[keep], rowvar=False), rtol=1e-12
    )


def test_cov_rowvar_true_on_a_tall_array_is_refused() -> None:
    x = tw.from_array(np.ones((products.SMALL_ROWVAR + 1, 3)))
    with pytest.raises(ValueError, match=r"pass rowvar=False"):
        np.cov(x)
    with pytest.raises(ValueError, match=r"pass rowvar=False"):
        np.corrcoef(x)
    with pytest.raises(ValueError, match=r"pass rowvar=False"):
        np.cov(x[x[:, 0] > 0])


def test_cov_rowvar_true_of_few_rows_and_of_1d_arrays() -> None:
    a = np.random.default_rng(9).standard_normal((5, 40))
    x = tw.from_array(a, rows=2)
    np.testing.assert_allclose(np.cov(x).compute(), np.cov(a), rtol=1e-12)
    v = np.random.default_rng(10).standard_normal(50)
    w = np.random.default_rng(11).standard_normal(50)
    np.testing.assert_allclose(np.cov(tw.from_array(v, rows=7)).compute(), np.cov(v))
    np.testing.assert_allclose(
        np.cov(tw.from_array(v, rows=7), tw.from_array(w, rows=9)).compute(), np.cov(v, w)
    )


@pytest.mark.parametrize("function", [np.cov, np.corrcoef])
def test_cov_of_no_variables_is_numpys_empty_matrix_without_warnings(function: Any) -> None:
    # NumPy returns before it looks at the observations (or at y).
    for a, rowvar in ((np.zeros((0, 3), np.uint16), True), (np.zeros((4, 0)), False)):
        x = tw.from_array(a, rows=2)
        want = function(a, rowvar=rowvar)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for got in (function(x, rowvar=rowvar), function(x, np.ones((7, 2)), rowvar=rowvar)):
                value = got.compute()
                assert value.dtype == want.dtype and value.shape == want.shape == (0, 0)


def test_cov_options_numpy_has_and_lazy_cov_does_not() -> None:
    x = tw.from_array(np.ones((10, 2)))
    with pytest.raises(TypeError, match="fweights"):
        np.cov(x, rowvar=False, fweights=np.ones(10, int))
    with pytest.raises(ValueError, match="ddof must be integer"):
        np.cov(x, rowvar=False, ddof=1.5)
    got = np.cov(x, rowvar=False, dtype=np.float32).compute()
    assert got.dtype == np.float32
