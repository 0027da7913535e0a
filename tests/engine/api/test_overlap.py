"""``map_overlap``: each block with rows of its neighbours, the halo trimmed; the
boundaries, halving, masks, several arrays, and errors."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tierflow as tw
from tierflow.engine.program import halving
from tierflow.engine.rowwide.overlap import halo
from tierflow.errors import BlockError

from common import examples


def window_sums(block: np.ndarray, before: int, after: int) -> np.ndarray:
    """Row i: the sum of rows i - before ... i + after of the block (those it has)."""
    padded = np.concatenate(
        [np.zeros((before, *block.shape[1:])), block, np.zeros((after, *block.shape[1:]))]
    )
    c = np.concatenate([np.zeros((1, *block.shape[1:])), np.cumsum(padded, axis=0)])
    width = before + after + 1
    return c[width : width + block.shape[0]] - c[: block.shape[0]]


def reference(a: np.ndarray, fn: Any, depth: Any, boundary: Any, bounds: list[int]) -> np.ndarray:
    """``fn`` on each block of ``bounds`` with its halo, written with NumPy."""
    h = halo(depth, boundary, a.ndim, a.dtype)
    n = a.shape[0]
    if h.boundary == "none":
        padded, shift = a, 0
    else:
        mode = {"reflect": "symmetric", "nearest": "edge", "periodic": "wrap"}
        widths = [(h.before, h.after)] + [(0, 0)] * (a.ndim - 1)
        if h.boundary == "constant":
            padded = np.pad(a, widths, constant_values=h.fill)
        else:
            padded = np.pad(a, widths, mode=mode[h.boundary])
        shift = h.before
    out = []
    for s, e in itertools.pairwise(bounds):
        if h.boundary == "none":
            lo, hi = max(0, s - h.before), min(n, e + h.after)
        else:
            lo, hi = s + shift - h.before, e + shift + h.after
        out.append(fn(padded[lo:hi])[s + shift - lo : e + shift - lo])
    return np.concatenate(out) if out else fn(a)


@pytest.mark.executors("threads", "processes")
@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 300),
    block=st.integers(1, 80),
    before=st.integers(0, 12),
    after=st.integers(0, 12),
    boundary=st.sampled_from(["none", "reflect", "nearest", "periodic", 0.5, -3]),
)
def test_each_block_gets_its_neighbours_rows_and_the_halo_is_trimmed(  # noqa: PLR0913
    seed: int, rows: int, block: int, before: int, after: int, boundary: Any
) -> None:
    a = np.random.default_rng(seed).normal(size=(rows, 2))

    def fn(b: np.ndarray) -> np.ndarray:
        return window_sums(b, before, after)

    got = tw.from_array(a, rows=block).map_overlap(fn, depth=(before, after), boundary=boundary)
    bounds = [*range(0, rows, block), rows]
    want = reference(a, fn, (before, after), boundary, bounds)
    np.testing.assert_allclose(got.compute(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.executors("threads")
def test_a_rolling_mean_over_the_whole_array_does_not_depend_on_the_blocks() -> None:
    a = np.random.default_rng(1).random((1000, 3))
    w = 7

    def rolling(b: np.ndarray) -> np.ndarray:
        out = np.full(b.shape, np.nan)
        if len(b) >= w:  # the first block may have fewer rows than a window
            out[w - 1 :] = np.lib.stride_tricks.sliding_window_view(b, w, axis=0).mean(axis=-1)
        return out

    want = rolling(a)
    for rows in (1, 6, 7, 100, 1000):
        got = tw.from_array(a, rows=rows).map_overlap(rolling, depth=(w - 1, 0)).compute()
        np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.executors("threads", "serial")  # counts calls in this process
def test_halving_on_out_of_memory_keeps_the_halo() -> None:
    a = np.arange(4000.0).reshape(2000, 2)
    calls: list[int] = []

    def small_only(b: np.ndarray) -> np.ndarray:
        calls.append(b.shape[0])
        if b.shape[0] > 300:
            raise MemoryError("too many rows")
        return window_sums(b, 3, 3)

    x = tw.from_array(a, rows=1000)
    lazy = x.map_overlap(small_only, depth=3, boundary="reflect", dtype=float, row_shape=(2,))
    try:
        got = lazy.compute()
    finally:
        halving.forget()
    want = reference(a, lambda b: window_sums(b, 3, 3), 3, "reflect", [0, 1000, 2000])
    np.testing.assert_array_equal(got, want)
    assert max(calls) > 300 and min(calls) >= 6  # halves, each with its 3 + 3 rows


@pytest.mark.executors("threads")
def test_several_arrays_get_the_same_halo_and_a_mask_counts_first() -> None:
    a = np.random.default_rng(2).random((500, 2))
    b = np.random.default_rng(3).random(500)
    x, y = tw.from_array(a, rows=64), tw.from_array(b, rows=100)  # cut differently

    def weighted(block: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return window_sums(block * weights[:, None], 2, 2)

    got = x.map_overlap(weighted, y, depth=2, boundary=0).compute()
    np.testing.assert_allclose(got, window_sums(a * b[:, None], 2, 2), rtol=1e-12)
    masked = x[x[:, 0] > 0.5]
    kept = a[a[:, 0] > 0.5]
    got = masked.map_overlap(lambda blk: window_sums(blk, 1, 1), depth=1, boundary=0).compute()
    np.testing.assert_allclose(got, window_sums(kept, 1, 1), rtol=1e-12)


@pytest.mark.executors("threads")
def test_no_rows_and_a_halo_deeper_than_the_array() -> None:
    empty = tw.from_array(np.zeros((0, 3), np.float32), rows=4)
    got = empty.map_overlap(lambda b: b * 2, depth=2).compute()
    assert got.shape == (0, 3) and got.dtype == np.float32
    a = np.arange(5.0)
    for boundary in ("reflect", "nearest", "periodic", 9):
        got = tw.from_array(a, rows=2).map_overlap(
            lambda b: window_sums(b, 8, 8), depth=8, boundary=boundary
        )
        want = reference(a, lambda b: window_sums(b, 8, 8), 8, boundary, [0, 2, 4, 5])
        np.testing.assert_array_equal(got.compute(), want)


@pytest.mark.executors("threads")
def test_map_overlap_says_what_it_does_not_do() -> None:
    x = tw.from_array(np.ones((10, 3)), rows=4)
    with pytest.raises(ValueError, match="neighbours along axis \\[1\\]"):
        x.map_overlap(lambda b: b, depth={0: 1, 1: 1})
    with pytest.raises(ValueError, match=r"map_overlap\(trim=False\) is not supported"):
        x.map_overlap(lambda b: b, depth=1, trim=False)
    with pytest.raises(ValueError, match="boundary='wrap'"):
        x.map_overlap(lambda b: b, depth=1, boundary="wrap")
    with pytest.raises(ValueError, match="depth -1 is negative"):
        x.map_overlap(lambda b: b, depth=-1)
    with pytest.raises(ValueError, match="does not fit the array's int64 values"):
        tw.from_array(np.ones(4, np.int64)).map_overlap(lambda b: b, depth=1, boundary=np.nan)
    with pytest.raises(ValueError, match="probe block of 4 rows; it must return one row"):
        x.map_overlap(lambda b: b[1:-1], depth=1)
    lazy = x.map_overlap(lambda b: b[1:-1], depth=1, dtype=float, row_shape=(3,))
    with pytest.raises(BlockError, match="block"):
        lazy.compute()
