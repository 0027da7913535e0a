"""NumPy functions and module-level operations on lazy arrays, and the ones refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tierflow as tw


@pytest.fixture
def a() -> np.ndarray:
    return np.random.default_rng(4).normal(size=(500, 4))


@pytest.fixture
def x(a: np.ndarray) -> tw.Array:
    return tw.from_array(a, rows=128)


def test_numpy_functions_dispatch_to_lazy_arrays(a: np.ndarray, x: tw.Array) -> None:
    cases = [
        (np.mean(x, axis=0), np.mean(a, axis=0)),
        (np.std(x, axis=0, ddof=1), np.std(a, axis=0, ddof=1)),
        (np.max(x, axis=1, keepdims=True), np.max(a, axis=1, keepdims=True)),
        (np.count_nonzero(x > 0, axis=0), np.count_nonzero(a > 0, axis=0)),
        (np.concatenate([x, x[:7]]), np.concatenate([a, a[:7]])),
        (np.concatenate([x, x * 2], axis=1), np.concatenate([a, a * 2], axis=1)),
        (np.stack([x, x + 1], axis=-1), np.stack([a, a + 1], axis=-1)),
        (np.where(x > 0, x, np.nan), np.where(a > 0, a, np.nan)),
        (np.round(x, 1), np.round(a, 1)),
        (np.clip(x, -1, None), np.clip(a, -1, None)),
        (
            np.nansum(np.where(x > 1, np.nan, x), axis=0),
            np.nansum(np.where(a > 1, np.nan, a), axis=0),
        ),
        (np.reshape(x, (500, 2, 2)), np.reshape(a, (500, 2, 2))),
        (np.add.reduce(x), np.add.reduce(a)),
        (np.maximum.reduce(x, axis=1), np.maximum.reduce(a, axis=1)),
        (np.dot(x, np.eye(4)[:, :2]), np.dot(a, np.eye(4)[:, :2])),
    ]
    for lazy, want in cases:
        assert isinstance(lazy, tw.Array)
        np.testing.assert_allclose(lazy.compute(), want, rtol=1e-12, equal_nan=True)
    assert np.shape(x) == (500, 4) and np.ndim(x) == 2 and np.size(x) == 2000
    q, r = np.divmod(x, 0.5)
    np.testing.assert_array_equal(q.compute(), np.divmod(a, 0.5)[0])
    np.testing.assert_array_equal(r.compute(), np.divmod(a, 0.5)[1])


def test_unsupported_numpy_calls_say_what_to_do(x: tw.Array) -> None:
    with pytest.raises(
        TypeError, match=r"np\.cumsum is not supported on lazy arrays; use map_blocks"
    ):
        np.cumsum(x)
    with pytest.raises(TypeError, match=r"np\.add\.accumulate is not supported"):
        np.add.accumulate(x)
    with pytest.raises(TypeError, match=r"np\.sqrt\(\.\.\., out=\.\.\.\) is not supported"):
        np.sqrt(x, out=np.empty((500, 4)))
    with pytest.raises(TypeError, match=r"tw\.where\(condition\) without x and y"):
        tw.where(x > 0)
    with pytest.raises(IndexError, match="integer arrays on the rows are not supported"):
        x[[1, 5, 2]]
    with pytest.raises(IndexError, match="in-memory result of shape"):
        x[x.mean(axis=1).sum() > 0]
    with pytest.raises(ValueError, match="a lazy array keeps its rows"):
        x.reshape(250, 8)
    with pytest.raises(ValueError, match="stacking along axis 0 would make the arrays the rows"):
        tw.stack([x, x], axis=0)


def test_row_indexing_and_values_of_a_row(a: np.ndarray, x: tw.Array) -> None:
    np.testing.assert_array_equal(x[7].compute(), a[7])
    assert x[-1, 2].compute() == a[-1, 2]
    with pytest.raises(IndexError, match="index 500 is out of bounds for axis 0 with size 500"):
        x[500]
    np.testing.assert_array_equal(x[..., 1].compute(), a[..., 1])
    np.testing.assert_array_equal(x[:, None, 1:3].compute(), a[:, None, 1:3])


def test_in_memory_operands_broadcast_and_align(a: np.ndarray, x: tw.Array) -> None:
    np.testing.assert_allclose((x - a.mean(axis=0)).compute(), a - a.mean(axis=0))
    np.testing.assert_allclose(
        (x * np.arange(500.0)[:, None]).compute(), a * np.arange(500.0)[:, None]
    )
    other = tw.from_array(a[:, :1] * 3, rows=77)  # different blocks, same rows
    np.testing.assert_allclose((x + other).compute(), a + a[:, :1] * 3)
    small = tw.from_array(np.arange(4.0), rows=2)  # a lazy (4,) row vector: a constant
    np.testing.assert_allclose((x * small).compute(), a * np.arange(4.0))


def test_to_npy_into_a_folder_is_refused_at_once(tmp_path: Path, x: tw.Array) -> None:
    with pytest.raises(IsADirectoryError, match="it is a folder"):
        x.to_npy(tmp_path)
    assert list(tmp_path.iterdir()) == []
