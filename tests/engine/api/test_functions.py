"""NumPy functions and module-level operations on lazy arrays, and the ones refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierflow as tw
from tierflow.errors import DestinationExistsError

from common import examples


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
        TypeError, match=r"np\.gradient is not supported on lazy arrays; use map_blocks"
    ):
        np.gradient(x)
    with pytest.raises(TypeError, match=r"np\.add\.accumulate is not supported"):
        np.add.accumulate(x)
    with pytest.raises(TypeError, match=r"np\.sqrt\(\.\.\., out=\.\.\.\) is not supported"):
        np.sqrt(x, out=np.empty((500, 4)))
    with pytest.raises(TypeError, match=r"tw\.where\(condition\) without x and y"):
        tw.where(x > 0)
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


def test_rows_picked_by_integer_arrays(tmp_path: Path, a: np.ndarray, x: tw.Array) -> None:
    np.save(tmp_path / "a.npy", a)
    f = tw.from_npy(tmp_path / "a.npy", rows=100)
    ordered = np.array([0, 3, 3, 99, 100, 350, 499])
    for lazy_array in (x, f, f * 2 - 1):
        base = lazy_array.compute()
        picked = lazy_array[ordered]
        # Sorted picks stay lazy: one block per input block picked from.
        stops = [b for _, b in lazy_array.blocks]
        touched = {int(np.searchsorted(stops, p, side="right")) for p in ordered}
        assert picked._node.kind == "chunked" and picked.nblocks == len(touched)
        np.testing.assert_array_equal(picked.compute(), base[ordered])
        np.testing.assert_allclose(
            picked.sum(axis=0).compute(), base[ordered].sum(axis=0), rtol=1e-12
        )
        shuffled = np.random.default_rng(0).permutation(500)[:50]
        out_of_order = lazy_array[shuffled]
        # Picks move below row-by-row operations to the source: lazy in any order.
        assert out_of_order._node.kind == "chunked"
        np.testing.assert_array_equal(out_of_order.compute(), base[shuffled])
        np.testing.assert_array_equal(lazy_array[[-1, 2], 1:].compute(), base[[-1, 2], 1:])
    # Far-apart picks from a computed input evaluate only the rows around each pick.
    seen: list[int] = []

    def double(b: np.ndarray) -> np.ndarray:
        seen.append(len(b))
        return b * 2

    big = np.arange(40_000.0).reshape(20_000, 2)
    doubled = tw.from_array(big, rows=10_000).map_blocks(double)
    seen.clear()
    picks = [0, 1, 2, 5_000, 9_999, 10_000, 19_999]
    # (seen in this process: threads)
    np.testing.assert_array_equal(doubled[picks].compute(executor="threads"), big[picks] * 2)
    assert sum(seen) == 7 and len(seen) == 5  # rows 0:3, 5000, 9999, 10000, 19999
    # Out of order through map_blocks (not known to work row by row): gathered in row
    # order, then reordered in memory.
    back = doubled[picks[::-1]]
    assert back._node.kind == "value"
    np.testing.assert_array_equal(back.compute(), big[picks[::-1]] * 2)
    # Through row slices, trailing selections and products, to the file.
    w = np.arange(6.0).reshape(3, 2)
    wide = np.arange(3000.0).reshape(1000, 3)
    np.save(tmp_path / "w.npy", wide)
    g = tw.from_npy(tmp_path / "w.npy", rows=64)
    chain = ((g[::-1][10:900:3] * 2) @ w)[:, 1].reshape(-1, 1)
    want = ((wide[::-1][10:900:3] * 2) @ w)[:, 1].reshape(-1, 1)
    order = np.random.default_rng(2).permutation(len(want))
    assert chain[order]._node.kind == "chunked"
    np.testing.assert_array_equal(chain[order].compute(), want[order])
    loaded = tw.from_files([str(tmp_path / "w.npy")] * 3, np.load, rows_per_file=1000)
    assert loaded[[2500, 10]]._node.kind == "value"  # files load whole: no view to pick from
    np.testing.assert_array_equal(loaded[[2500, 10]].compute(), wide[[500, 10]])
    assert x[[]].shape == (0, 4) and x[np.array([], np.int64)].compute().shape == (0, 4)
    # The graph keeps its own positions, 4 bytes each: changing the caller's array
    # after building changes nothing.
    mine = np.array([7, 3, 400])
    later = x[mine]
    assert later._node.positions.dtype == np.int32  # type: ignore[attr-defined]
    mine[:] = 0
    np.testing.assert_array_equal(later.compute(), a[[7, 3, 400]])
    with pytest.raises(IndexError, match="index 500 is out of bounds for axis 0 with size 500"):
        x[[1, 500]]
    with pytest.raises(IndexError, match="index -501 is out of bounds"):
        x[[-501]]
    with pytest.raises(IndexError, match=f"index {2**64 - 1} is out of bounds"):
        x[np.array([3, 2**64 - 1], np.uint64)]
    np.testing.assert_array_equal(x[np.array([3, 1], np.uint8)].compute(), a[[3, 1]])
    with pytest.raises(IndexError, match="must be of integer"):
        x[[1.0, 2.0]]
    with pytest.raises(IndexError, match=r"must be 1-D, not of shape \(1, 2\)"):
        x[np.array([[1, 2]])]
    with pytest.raises(IndexError, match="paired elementwise"):
        x[[1, 2], [0, 1]]
    kept = a[a[:, 0] > 0]
    np.testing.assert_array_equal(x[x[:, 0] > 0][[1, 0]].compute(), kept[[1, 0]])


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
    with pytest.raises(DestinationExistsError, match="is a folder"):
        x.to_npy(tmp_path)
    assert list(tmp_path.iterdir()) == []


ALONG = [
    (np.sort, {}),
    (np.sort, {"kind": "stable"}),
    (np.argsort, {"kind": "stable"}),
    (np.cumsum, {}),
    (np.cumprod, {}),
    (np.nancumsum, {}),
    (np.nancumprod, {}),
    (np.diff, {}),
    (np.diff, {"n": 2}),
]


@settings(max_examples=examples(150), deadline=None)
@given(
    dtype=st.sampled_from(["bool", "int8", "uint8", "int64", "float16", "float32", "float64"]),
    rows=st.sampled_from([0, 1, 7, 40]),
    row_shape=st.sampled_from([(3,), (2, 4), (1,)]),
    case=st.sampled_from(ALONG),
    data=st.data(),
)
def test_functions_along_a_trailing_axis_equal_numpy(
    dtype: str, rows: int, row_shape: tuple[int, ...], case: Any, data: st.DataObject
) -> None:
    function, kwargs = case
    a = np.random.default_rng(rows).normal(0, 3, size=(rows, *row_shape))
    a[a > 4] = np.nan if np.dtype(dtype).kind == "f" else 0
    a = a.astype(dtype)
    axis = data.draw(st.sampled_from([k for k in range(1, a.ndim)] + [-1]))
    block = data.draw(st.integers(1, 9))
    x = tw.from_array(a, rows=block) * 1 if dtype != "bool" else tw.from_array(a, rows=block)
    lazy = function(x, axis=axis, **kwargs)
    want = function(a, axis=axis, **kwargs)
    assert (lazy.shape, lazy.dtype) == (want.shape, want.dtype)
    np.testing.assert_array_equal(lazy.compute(), want)


def test_functions_along_the_rows_or_flattened_say_what_to_do(x: tw.Array) -> None:
    with pytest.raises(ValueError, match=r"np\.cumsum\(x, axis=None\) works on the flattened"):
        np.cumsum(x)
    with pytest.raises(ValueError, match=r"np\.diff along axis 0"):
        np.diff(x, axis=-2)
    with pytest.raises(np.exceptions.AxisError):
        x.cumsum(axis=2)
    with pytest.raises(ValueError, match="sort kind must be one of"):
        np.sort(x, axis=1, kind="bogus")  # NumPy's own check, when the pipeline is built
    with pytest.raises(TypeError, match=r"np\.cumsum\(\.\.\., out=\.\.\.\) is not supported"):
        np.cumsum(x, axis=1, out=np.empty((500, 4)))


def test_functions_along_an_axis_as_methods_fused_and_after_a_mask(
    a: np.ndarray, x: tw.Array
) -> None:
    assert x.cumsum(axis=1).key == np.cumsum(x, axis=1).key  # defaults key alike
    np.testing.assert_array_equal(x.cumsum(axis=1).compute(), a.cumsum(axis=1))
    np.testing.assert_array_equal(x.argsort().compute(), a.argsort())
    np.testing.assert_allclose(
        np.cumprod(x * 2 + 1, axis=1).sum(axis=0).compute(),
        np.cumprod(a * 2 + 1, axis=1).sum(axis=0),
        rtol=1e-12,
    )
    masked = np.sort(x[x[:, 0] > 0], axis=1)
    np.testing.assert_array_equal(masked.compute(), np.sort(a[a[:, 0] > 0], axis=1))
    total = x.sum(axis=0)  # an in-memory value: NumPy's function applies to it
    np.testing.assert_allclose(np.cumsum(total).compute(), np.cumsum(a.sum(axis=0)))


def test_ufunc_reductions_take_numpys_dtype() -> None:
    a = np.array([[3, 1], [2, 250], [7, 0]], np.uint8)
    x = tw.from_array(a, rows=2)
    for reduce in (
        lambda v: np.maximum.reduce(v, dtype=np.float64),
        lambda v: np.minimum.reduce(v, axis=None, dtype=np.int8),
        lambda v: np.logical_and.reduce(v, axis=1, dtype=bool, keepdims=True),
        lambda v: np.add.reduce(v, dtype=np.float32),
    ):
        got, want = np.asarray(reduce(x).compute()), reduce(a)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="No loop matching"):
        np.logical_or.reduce(x, dtype=np.float64)


def test_concatenate_casts_to_dtype_by_numpys_casting_rule() -> None:
    a = np.array([[1.5 + 1j], [2.0 - 1j]], np.complex64)
    x = tw.from_array(a, rows=1)
    with pytest.raises(TypeError, match="according to the rule 'same_kind'"):
        np.concatenate([x, x], dtype=np.float64)
    with pytest.warns(np.exceptions.ComplexWarning):
        got = np.concatenate([x, x], dtype=np.float64, casting="unsafe").compute()
    with pytest.warns(np.exceptions.ComplexWarning):
        want = np.concatenate([a, a], dtype=np.float64, casting="unsafe")
    np.testing.assert_array_equal(got, want)
    assert np.concatenate([x, x], dtype=np.complex128).compute().dtype == np.complex128


@pytest.mark.parametrize(
    "call",
    [
        lambda x: np.vecdot(x, x),
        lambda x: np.vecmat(x, np.ones((4, 2))),
        lambda x: np.matvec(x[..., None], np.ones(1)),
    ],
)
def test_generalized_ufuncs_other_than_matmul_are_refused_by_name(x: tw.Array, call: Any) -> None:
    with pytest.raises(TypeError, match=r"generalized ufunc with signature .* use map_blocks"):
        call(x)


def test_clip_without_bounds_is_numpys_clip() -> None:
    a = np.array([[3, -1], [0, 250]], np.int16)
    x = tw.from_array(a, rows=1)
    try:
        want = np.clip(a, None, None)
    except ValueError:
        with pytest.raises(ValueError, match="One of max or min must be given"):
            np.clip(x, None, None)
    else:
        for lazy in (np.clip(x, None, None), x.clip()):
            got = lazy.compute()
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


def test_np_size_counts_the_rows_after_a_mask_as_len_does(a: np.ndarray, x: tw.Array) -> None:
    masked, kept = x[x[:, 0] > 0], a[a[:, 0] > 0]
    assert np.size(masked, 1) == 4  # no count needed
    assert np.size(masked, 0) == np.size(masked, -2) == len(kept)
    assert masked.shape == kept.shape  # counted once, known from now on
    assert np.size(x[x[:, 1] > 0]) == np.size(a[a[:, 1] > 0])
    with pytest.raises(np.exceptions.AxisError):
        np.size(masked, 2)


def test_stack_casts_to_dtype_by_numpys_casting_rule() -> None:
    a = np.array([[1.5 + 1j], [2.0 - 1j]], np.complex64)
    x = tw.from_array(a, rows=1)
    with pytest.raises(TypeError, match="according to the rule 'same_kind'"):
        np.stack([x, x], axis=1, dtype=np.float64)
    with pytest.warns(np.exceptions.ComplexWarning):
        got = np.stack([x, x], axis=1, dtype=np.float64, casting="unsafe").compute()
    with pytest.warns(np.exceptions.ComplexWarning):
        want = np.stack([a, a], axis=1, dtype=np.float64, casting="unsafe")
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    ints = tw.from_array(np.arange(6).reshape(3, 2), rows=2)
    assert np.stack([ints, ints], axis=-1, dtype=np.float32).compute().dtype == np.float32


@pytest.mark.parametrize("masked", [False, True])
def test_diff_joins_arrays_to_prepend_and_append_as_numpy_does(masked: bool) -> None:
    a = np.arange(40.0).reshape(10, 4) ** 2
    x = tw.from_array(a, rows=3)
    if masked:
        x, a = x[x[:, 0] > 30], a[a[:, 0] > 30]
    n = len(a)
    for kwargs in (
        {"append": np.zeros((n, 1))},
        {"prepend": np.ones((n, 2), np.float32), "append": 7},
        {"prepend": -1, "append": np.arange(n)[:, None], "n": 2},
        {"append": np.zeros((n, 2)), "n": 0},
    ):
        got, want = np.diff(x, axis=1, **kwargs).compute(), np.diff(a, axis=1, **kwargs)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        np.diff(x, axis=1, append=x).compute(), np.diff(a, axis=1, append=a)
    )
    with pytest.raises(ValueError, match="along dimension 0"):
        np.diff(x, axis=1, append=np.zeros((n + 1, 1))).compute()


def test_result_type_takes_a_lazy_array_by_its_dtype() -> None:
    x = tw.from_array(np.ones(3, np.float32))
    assert np.result_type(x, 2.0) == np.float32  # a Python float is weak (NEP 50)
    assert np.result_type(x, np.float64) == np.float64
    assert np.result_type(x, tw.from_array(np.ones(3, np.int64))) == np.float64
    assert np.result_type(x.sum(axis=0), np.int8) == np.float32
