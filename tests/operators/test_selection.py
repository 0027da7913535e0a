"""Selection bookkeeping against NumPy indexing of the whole array."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.operators.selection import (
    TrailingIndex,
    block_bounds,
    bounds_from_sizes,
    concat_blocks,
    concat_result,
    filter_rows,
    head_counts,
    locate_row,
    mask_rows,
    plan_slice,
    plan_take,
    slice_in_block,
    split_index,
)
from tierflow.operators.types import BlockOp

from common import examples


@st.composite
def _bounds(draw: st.DrawFn) -> list[tuple[int, int]]:
    """Blocks of random sizes, empty blocks included."""
    sizes = draw(st.lists(st.integers(0, 9), min_size=0, max_size=8))
    return bounds_from_sizes(sizes)


_ends = st.one_of(st.none(), st.integers(-60, 60))
_slices = st.builds(slice, _ends, _ends, st.one_of(st.none(), st.integers(-7, 7).filter(bool)))


def _blocks_of(x: np.ndarray, bounds: list[tuple[int, int]]) -> list[np.ndarray]:
    return [x[start:stop] for start, stop in bounds]


@settings(max_examples=examples(300), deadline=None)
@given(bounds=_bounds(), key=_slices)
def test_plan_slice_matches_numpy_slicing(bounds: list[tuple[int, int]], key: slice) -> None:
    n_rows = bounds[-1][1] if bounds else 0
    x = np.arange(n_rows * 2).reshape(n_rows, 2)
    blocks = _blocks_of(x, bounds)
    pieces = plan_slice(key, bounds)
    want = x[key]
    parts = [blocks[p.block][p.local] for p in pieces]
    got = np.concatenate(parts) if parts else np.empty((0, 2), x.dtype)
    np.testing.assert_array_equal(got, want)
    # The output ranges tile [0, len(result)) in order, each as long as its piece.
    position = 0
    for piece, part in zip(pieces, parts, strict=True):
        assert piece.out_start == position
        assert piece.out_stop - piece.out_start == len(part) > 0
        position = piece.out_stop
    assert position == len(want)


def test_slice_in_block_with_a_negative_step_reaching_row_zero() -> None:
    # The local stop would be -1, which Python reads as "the last row": it must be None.
    assert slice_in_block(slice(None, None, -1), 6, 0, 3) == (slice(2, None, -1), 3, 6)
    assert slice_in_block(slice(5, 2, 1), 10, 0, 3) is None
    with pytest.raises(ValueError, match="slice step cannot be zero"):
        slice_in_block(slice(None, None, 0), 5, 0, 5)


@settings(max_examples=examples(100), deadline=None)
@given(bounds=_bounds(), index=st.integers(-70, 70))
def test_locate_row_matches_numpy(bounds: list[tuple[int, int]], index: int) -> None:
    n_rows = bounds[-1][1] if bounds else 0
    x = np.arange(n_rows)
    if -n_rows <= index < n_rows:
        block, local = locate_row(index, bounds)
        assert _blocks_of(x, bounds)[block][local] == x[index]
    else:
        with pytest.raises(
            IndexError, match=f"index {index} is out of bounds for axis 0 with size {n_rows}"
        ):
            locate_row(index, bounds)


@settings(max_examples=examples(150), deadline=None)
@given(bounds=_bounds(), data=st.data())
def test_plan_take_matches_numpy_fancy_indexing(
    bounds: list[tuple[int, int]], data: st.DataObject
) -> None:
    n_rows = bounds[-1][1] if bounds else 0
    x = np.arange(n_rows * 3).reshape(n_rows, 3)
    if n_rows:
        values = st.integers(-n_rows, n_rows - 1)
        indices = np.array(data.draw(st.lists(values, max_size=12)), dtype=np.int64)
        if data.draw(st.booleans()) and indices.size % 2 == 0:
            indices = indices.reshape(2, -1)
    else:
        indices = np.array([], dtype=np.int64)
    blocks = _blocks_of(x, bounds)
    got = np.empty((indices.size, 3), dtype=x.dtype)
    for piece in plan_take(indices, bounds):
        assert len(piece.local) == len(piece.positions)
        got[piece.positions] = blocks[piece.block][piece.local]
    np.testing.assert_array_equal(got.reshape(*indices.shape, 3), x[indices])


def test_plan_take_reads_each_block_once_and_refuses_bad_indices() -> None:
    pieces = plan_take([7, 0, 6, 1], [(0, 4), (4, 4), (4, 8)])
    assert [p.block for p in pieces] == [0, 2]
    with pytest.raises(IndexError, match="index 8 is out of bounds for axis 0 with size 8"):
        plan_take([1, 8], [(0, 8)])
    with pytest.raises(IndexError, match="index -9 is out of bounds"):
        plan_take([-9], [(0, 8)])
    with pytest.raises(IndexError, match="must be of integer"):
        plan_take([0.5], [(0, 8)])
    assert plan_take([], [(0, 8)]) == []


@pytest.mark.parametrize(
    "key",
    [
        np.s_[2:7, 1],
        np.s_[::-2, [0, 2]],
        np.s_[..., 1],
        np.s_[..., ::2],
        np.s_[3],
        np.s_[-1, ..., 0],
        np.s_[[4, 0, 2], ...],
        np.s_[:, None, 1:],
        np.s_[:, [True, False, True, False], 1],
        np.s_[1:, 1:3, [0, 0]],
        np.s_[...],
        (),
    ],
)
def test_split_index_then_trailing_index_equals_numpy(key: Any) -> None:
    x = np.arange(10 * 4 * 3).reshape(10, 4, 3)
    rows, trailing = split_index(key, x.ndim)
    op = TrailingIndex(x.dtype, x.shape[1:], trailing)
    assert isinstance(op, BlockOp)
    if isinstance(rows, (int, np.integer)):
        got = op.apply(x[rows : rows + 1])[0] if rows >= 0 else op.apply(x[rows:][:1])[0]
    else:
        got = op.apply(x[rows])
    np.testing.assert_array_equal(got, x[key])
    if not isinstance(rows, (int, np.integer)):
        assert got.shape[1:] == op.out_row_shape


def test_split_index_refusals() -> None:
    with pytest.raises(IndexError, match="single ellipsis"):
        split_index((Ellipsis, Ellipsis), 3)
    with pytest.raises(IndexError, match=r"new axis \(None\) in front of the rows"):
        split_index((None, 1), 2)
    with pytest.raises(IndexError, match="paired elementwise"):
        split_index(([0, 1], [1, 2]), 2)
    with pytest.raises(IndexError, match="boolean mask over 2 axes followed by more indices"):
        split_index((np.ones((3, 4), bool), 0), 3)
    rows, trailing = split_index(np.ones(5, bool), 2)
    assert rows.dtype == bool
    assert trailing == ()


def test_trailing_index_refuses_keys_that_move_the_row_axis() -> None:
    with pytest.raises(IndexError, match="makes NumPy move the row axis"):
        TrailingIndex(np.float32, (4, 5, 6), ([0, 1], slice(None), [0, 1]))
    with pytest.raises(IndexError, match="index 7 is out of bounds for axis 1 with size 4"):
        TrailingIndex(np.float32, (4,), 7)


def test_trailing_index_views_and_copies() -> None:
    x = np.arange(12.0).reshape(4, 3)
    basic = TrailingIndex(x.dtype, (3,), slice(1, None))
    assert basic.is_view
    assert np.shares_memory(basic.apply(x), x)
    fancy = TrailingIndex(x.dtype, (3,), [[2, 0]])
    assert not fancy.is_view
    assert fancy.out_row_shape == (1, 2)
    out = np.empty((4, 1, 2))
    assert fancy.apply(x, out=out) is out
    np.testing.assert_array_equal(out, x[:, [[2, 0]]])
    assert fancy.temp_bytes(4) == 0


@settings(max_examples=examples(60), deadline=None)
@given(bounds=_bounds(), seed=st.integers(0, 1000))
def test_mask_and_filter_rows_per_block_equal_numpy(
    bounds: list[tuple[int, int]], seed: int
) -> None:
    n_rows = bounds[-1][1] if bounds else 0
    rng = np.random.default_rng(seed)
    x = rng.random((n_rows, 3))
    mask = rng.random(n_rows) < 0.4
    pieces = [mask_rows(x[a:b], mask[a:b]) for a, b in bounds]
    got = np.concatenate(pieces) if pieces else np.empty((0, 3))
    np.testing.assert_array_equal(got, x[mask])
    filtered = [filter_rows(x[a:b], lambda block: block[:, 0] > 0.5) for a, b in bounds]
    got = np.concatenate(filtered) if filtered else np.empty((0, 3))
    np.testing.assert_array_equal(got, x[x[:, 0] > 0.5])
    element_mask = rng.random(x.shape) < 0.5
    flat = [mask_rows(x[a:b], element_mask[a:b]) for a, b in bounds]
    got = np.concatenate(flat) if flat else np.empty((0,))
    np.testing.assert_array_equal(got, x[element_mask])


def test_mask_errors_follow_numpy() -> None:
    x = np.zeros((5, 3))
    with pytest.raises(
        IndexError,
        match="along axis 0; size of axis is 5 but size of corresponding boolean axis is 4",
    ):
        mask_rows(x, np.ones(4, bool))
    with pytest.raises(
        IndexError,
        match="along axis 1; size of axis is 3 but size of corresponding boolean axis is 2",
    ):
        mask_rows(x, np.ones((5, 2), bool))
    with pytest.raises(TypeError, match="must be boolean, got dtype int64"):
        mask_rows(x, np.ones(5, np.int64))
    with pytest.raises(TypeError, match="returned int64 values of shape"):
        filter_rows(x, lambda b: np.ones(len(b), np.int64))
    with pytest.raises(ValueError, match=r"mask of shape \(3,\) for a block of 5 rows"):
        filter_rows(x, lambda b: np.ones(3, bool))


def test_head_counts_stop_reading_once_satisfied() -> None:
    assert head_counts(5, [2, 0, 4, 7]) == [2, 0, 3]
    assert head_counts(0, [3]) == []
    assert head_counts(10, [3, 2]) == [3, 2]
    seen: list[int] = []

    def sizes() -> Any:
        for size in (4, 4, 4, 4):
            seen.append(size)
            yield size

    assert head_counts(6, sizes()) == [4, 2]
    assert len(seen) == 2
    with pytest.raises(ValueError, match="head needs n >= 0, got -1"):
        head_counts(-1, [3])


def test_block_bounds() -> None:
    assert block_bounds(0, 4) == []
    assert block_bounds(8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="block_rows must be at least 1"):
        block_bounds(8, 0)
    with pytest.raises(ValueError, match="cannot have -1 rows"):
        bounds_from_sizes([2, -1])


def test_concat_blocks_and_result() -> None:
    pieces = concat_blocks([[2, 0, 3], [], [1]])
    assert [(p.input, p.block, p.out_start, p.out_stop) for p in pieces] == [
        (0, 0, 0, 2),
        (0, 1, 2, 2),
        (0, 2, 2, 5),
        (2, 0, 5, 6),
    ]
    assert concat_result([np.int8, bool], [(2,), (2,)]) == (np.dtype(np.int8), (2,))
    assert concat_result([np.int32, np.float32], [(), ()]) == (np.dtype(np.float64), ())
    with pytest.raises(
        ValueError,
        match="along dimension 1, the array at index 0 has size 8 and the array at index 1 has size 4",
    ):
        concat_result([np.float32, np.float32], [(8,), (4,)])
    with pytest.raises(ValueError, match="at least one input"):
        concat_result([], [])
