"""Tall-skinny QR, SVD and PCA (``tw.linalg``) against NumPy, with NumPy's factors
brought to the same sign conventions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tierflow as tw
from tierflow.engine.api import linalg

from common import examples

SETTINGS = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DTYPES = ["int16", "int64", "uint8", "float32", "float64"]


def _numpy_qr(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, r = np.linalg.qr(a.astype(np.float64))
    signs = np.where(np.diagonal(r) < 0, -1.0, 1.0)
    return q * signs, r * signs[:, None]


def _numpy_svd(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    u, s, vh = np.linalg.svd(a.astype(np.float64), full_matrices=False)
    biggest = np.argmax(np.abs(vh), axis=1)
    signs = np.sign(vh[np.arange(len(vh)), biggest])
    return u * signs, s, vh * signs[:, None]


def _distinct(s: np.ndarray) -> bool:
    """Whether the singular values are far enough apart for their vectors to be unique."""
    return bool(np.all(-np.diff(s) > 1e-3 * s[0])) if len(s) > 1 else True


def _tie_signs(vh: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """``vh`` with the signs of ``expected`` on rows whose two largest magnitudes tie
    (there the convention cannot tell the signs apart)."""
    top = np.sort(np.abs(expected), axis=1)
    tied = top[:, -1] - (top[:, -2] if top.shape[1] > 1 else 0) < 1e-6
    signs = np.where(tied & (np.sum(vh * expected, axis=1) < 0), -1.0, 1.0)
    return vh * signs[:, None]


@st.composite
def full_rank(draw: st.DrawFn) -> np.ndarray:
    """A tall array whose columns are well apart (so its factors are well defined)."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    k = draw(st.integers(1, 5))
    rows = draw(st.integers(k, 60))
    noise = draw(hnp.arrays(np.float64, (rows, k), elements=st.floats(-1, 1)))
    scale = draw(st.sampled_from([1.0, 50.0]))
    offset = draw(st.sampled_from([0.0, 10.0]))
    base = np.zeros((rows, k))
    base[:k] = np.diag(3.0 + 2 * np.arange(k))  # rank k whatever the noise
    values = offset + scale * (base + noise)
    if dtype.kind in "iu":
        values = np.round(values * 3)
        if dtype.kind == "u":
            values = np.abs(values)
        values = np.clip(values, np.iinfo(dtype).min, np.iinfo(dtype).max)
    a = values.astype(dtype)
    if np.linalg.matrix_rank(a.astype(np.float64)) < k:
        a = (base * 3 + np.arange(k)).astype(dtype)
    return a


def _tolerance(a: np.ndarray) -> float:
    return 1e-4 if a.dtype == np.float32 else 1e-9


@pytest.mark.executors("threads")
@SETTINGS
@given(a=full_rank(), block=st.integers(1, 9))
def test_qr_matches_numpy(a: np.ndarray, block: int) -> None:
    q, r = tw.linalg.qr(tw.from_array(a, rows=block))
    assert isinstance(r, np.ndarray) and isinstance(q, tw.Array)
    expected_q, expected_r = _numpy_qr(a)
    dtype = np.float32 if a.dtype == np.float32 else np.float64
    assert r.dtype == dtype and q.dtype == dtype
    tol = _tolerance(a)
    scale = np.abs(expected_r).max()
    np.testing.assert_allclose(r, expected_r, atol=tol * scale, rtol=0)
    computed = q.compute()
    np.testing.assert_allclose(computed, expected_q, atol=tol * np.linalg.cond(expected_r), rtol=0)
    np.testing.assert_allclose(computed.T @ computed, np.eye(a.shape[1]), atol=tol)
    np.testing.assert_array_equal(np.diagonal(r) >= 0, True)
    only_r = tw.linalg.qr(tw.from_array(a, rows=block), mode="r")
    np.testing.assert_allclose(only_r, r, atol=tol * scale, rtol=0)  # merged in any order


@pytest.mark.executors("threads")
@SETTINGS
@given(a=full_rank(), block=st.integers(1, 9))
def test_svd_matches_numpy(a: np.ndarray, block: int) -> None:
    expected_u, expected_s, expected_vh = _numpy_svd(a)
    assume(_distinct(expected_s))
    u, s, vh = tw.linalg.svd(tw.from_array(a, rows=block), full_matrices=False)
    tol = _tolerance(a)
    np.testing.assert_allclose(s, expected_s, atol=tol * expected_s[0], rtol=0)
    np.testing.assert_allclose(
        _tie_signs(vh, expected_vh), expected_vh, atol=tol * 10 * np.linalg.cond(a.astype(float))
    )
    computed = u.compute()
    np.testing.assert_allclose((computed * s) @ vh, a, atol=tol * 10 * expected_s[0], rtol=0)
    flips = np.where(np.sum(_tie_signs(vh, expected_vh) * vh, axis=1) < 0, -1.0, 1.0)
    np.testing.assert_allclose(
        computed * flips, expected_u, atol=tol * 10 * np.linalg.cond(a.astype(float)), rtol=0
    )
    np.testing.assert_allclose(computed.T @ computed, np.eye(a.shape[1]), atol=tol)
    only_s = tw.linalg.svd(tw.from_array(a, rows=block), compute_uv=False)
    np.testing.assert_allclose(only_s, expected_s, atol=tol * expected_s[0], rtol=0)


def _numpy_pca(a: np.ndarray, n: int) -> dict[str, Any]:
    centred = a.astype(np.float64) - a.astype(np.float64).mean(axis=0)
    _, s, vh = _numpy_svd(centred)
    variance = s**2 / (len(a) - 1)
    return {
        "components": vh[:n],
        "explained_variance": variance[:n],
        "explained_variance_ratio": (variance / variance.sum())[:n],
        "singular_values": s[:n],
        "projection": centred @ vh[:n].T,
    }


@pytest.mark.executors("threads")
@SETTINGS
@given(a=full_rank(), block=st.integers(2, 9), data=st.data())
def test_pca_matches_a_numpy_pca(a: np.ndarray, block: int, data: st.DataObject) -> None:
    if len(a) < 3:
        return
    limit = min(len(a), a.shape[1])
    n = data.draw(st.integers(1, limit))
    expected = _numpy_pca(a, limit)
    assume(_distinct(expected["singular_values"]))
    expected = _numpy_pca(a, n)
    result = tw.linalg.pca(tw.from_array(a, rows=block), n)
    tol = _tolerance(a)
    assert result.n_samples == len(a)
    for name in ("explained_variance", "singular_values"):
        np.testing.assert_allclose(getattr(result, name), expected[name], rtol=tol * 10, atol=tol)
    np.testing.assert_allclose(
        result.explained_variance_ratio, expected["explained_variance_ratio"], atol=tol * 10
    )
    np.testing.assert_allclose(np.abs(result.components), np.abs(expected["components"]), atol=1e-3)
    np.testing.assert_allclose(
        result.projection.compute(),
        (a.astype(np.float64) - a.astype(np.float64).mean(axis=0))
        @ result.components.T.astype(np.float64),
        atol=tol * 10 * np.abs(a).max(),
    )


def test_pca_of_data_far_from_zero_with_a_constant_column() -> None:
    rng = np.random.default_rng(0)
    a = (1e6 + rng.standard_normal((200_000, 4)) * [1.0, 0.5, 0.25, 0.0]).astype(np.float32)
    a[:, 1] += a[:, 0] - 1e6  # correlated columns
    result = tw.linalg.pca(tw.from_array(a, rows=9_999), 3)
    expected = _numpy_pca(a, 3)
    np.testing.assert_allclose(result.explained_variance, expected["explained_variance"], rtol=1e-5)
    np.testing.assert_allclose(result.components, expected["components"], atol=1e-5)
    np.testing.assert_allclose(result.mean, a.astype(np.float64).mean(axis=0), rtol=1e-7)
    assert result.explained_variance_ratio.sum() == pytest.approx(1.0, abs=1e-6)
    assert result.projection.dtype == np.float32
    np.testing.assert_allclose(result.projection.compute(), expected["projection"], atol=1e-3)
    np.testing.assert_allclose(
        result.transform(tw.from_array(a[:10])).compute(), expected["projection"][:10], atol=1e-3
    )


def test_an_ill_conditioned_array_still_gets_an_orthonormal_q() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5_000, 4))
    a[:, 3] = a[:, 0] + 1e-9 * a[:, 3]  # condition number near 1e9
    assert np.linalg.cond(a) > linalg.SAFE_CONDITION
    x = tw.from_array(a, rows=700)
    q, r = tw.linalg.qr(x)
    computed = q.compute()
    np.testing.assert_allclose(computed.T @ computed, np.eye(4), atol=1e-12)
    np.testing.assert_allclose(computed @ r, a, atol=1e-12)
    naive = a @ np.linalg.inv(_numpy_qr(a)[1])
    assert np.abs(naive.T @ naive - np.eye(4)).max() > 1e-9, "x R^-1 alone would not do"
    u, s, vh = tw.linalg.svd(x, full_matrices=False)
    computed_u = u.compute()
    np.testing.assert_allclose(computed_u.T @ computed_u, np.eye(4), atol=1e-12)
    np.testing.assert_allclose((computed_u * s) @ vh, a, atol=1e-12)


def test_a_rank_deficient_array_gives_r_and_s_but_no_q() -> None:
    a = np.random.default_rng(2).standard_normal((100, 3))
    a[:, 2] = a[:, 0]
    x = tw.from_array(a, rows=30)
    r = tw.linalg.qr(x, mode="r")
    np.testing.assert_allclose(r.T @ r, a.T @ a, atol=1e-10)
    np.testing.assert_allclose(
        tw.linalg.svd(x, compute_uv=False), np.linalg.svd(a, compute_uv=False), atol=1e-10
    )
    with pytest.raises(np.linalg.LinAlgError, match=r"rank-deficient.*condition number"):
        tw.linalg.qr(x)
    with pytest.raises(np.linalg.LinAlgError, match=r"rank-deficient"):
        tw.linalg.svd(x, full_matrices=False)


def test_masked_rows_factor() -> None:
    a = np.random.default_rng(3).standard_normal((400, 3))
    x = tw.from_array(a, rows=50)
    keep = a[:, 0] > 0
    q, r = tw.linalg.qr(x[x[:, 0] > 0])
    np.testing.assert_allclose(r, _numpy_qr(a[keep])[1], atol=1e-12)
    np.testing.assert_allclose(q.compute(), _numpy_qr(a[keep])[0], atol=1e-12)
    result = tw.linalg.pca(x[x[:, 0] > 0], 2)
    assert result.n_samples == keep.sum()


def test_fewer_rows_than_columns_are_factored_in_memory() -> None:
    a = np.random.default_rng(4).standard_normal((3, 5))
    q, r = tw.linalg.qr(tw.from_array(a))
    np.testing.assert_allclose(q.compute() @ r, a, atol=1e-12)
    u, s, vh = tw.linalg.svd(tw.from_array(a), full_matrices=False)
    np.testing.assert_allclose((u.compute() * s) @ vh, a, atol=1e-12)
    tall = np.concatenate([a, np.full((20, 5), -100.0)])
    x = tw.from_array(tall, rows=4)
    masked = x[x[:, 0] > -50]  # the 3 rows of a, known only once computed
    q, r = tw.linalg.qr(masked)
    assert r.shape == (3, 5)
    np.testing.assert_allclose(q.compute() @ r, a, atol=1e-12)
    u, s, vh = tw.linalg.svd(masked, full_matrices=False)
    np.testing.assert_allclose((u.compute() * s) @ vh, a, atol=1e-12)


def test_factorisations_under_a_tiny_budget() -> None:
    tw.memory.budget("2MB")
    a = np.random.default_rng(5).standard_normal((300_000, 3)).astype(np.float32)
    x = tw.from_array(a)
    assert x.nblocks >= 4, "the budget cut the array into blocks"
    q, r = tw.linalg.qr(x)
    np.testing.assert_allclose(r, _numpy_qr(a)[1], rtol=1e-5)
    assert np.abs(q.sum(axis=0).compute() - _numpy_qr(a)[0].sum(axis=0)).max() < 1e-3


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x: tw.linalg.qr(x, mode="complete"), ValueError, r"mode='reduced'.*N x N"),
        (lambda x: tw.linalg.svd(x), ValueError, r"pass full_matrices=False"),
        (lambda x: tw.linalg.svd(x, hermitian=True), ValueError, "hermitian"),
        (lambda x: tw.linalg.qr(x[:, 0]), ValueError, r"2-D array \(N, k\)"),
        (lambda x: tw.linalg.qr(x.astype(np.complex64)), TypeError, "complex64"),
        (lambda x: tw.linalg.pca(x, 4), ValueError, r"between 1 and min\(N, k\) = 3"),
        (lambda x: tw.linalg.pca(x[:1]), ValueError, "at least two rows"),
    ],
)
def test_factorisation_errors(call: Any, error: type[Exception], match: str) -> None:
    x = tw.from_array(np.random.default_rng(6).standard_normal((20, 3)), rows=7)
    with pytest.raises(error, match=match):
        call(x)
