"""The one block-size rule: default blocks of 1 MB to 32 MB spread over the workers,
and outputs of operators that widen rows cut to the same cap."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tierflow as tw
from tierflow.config import GB, MB
from tierflow.engine.graph import blocksize
from tierflow.engine.graph.blocksize import MAX_BLOCK_BYTES, default_rows, output_bounds

ROW = 8 * 4  # a row of 8 float32


Machine = Callable[[int, int], None]


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch) -> Machine:
    """``machine(budget, workers)`` sets what the rule reads."""

    def set_to(budget: int, workers: int) -> None:
        monkeypatch.setattr(blocksize.budget, "budget_bytes", lambda: budget)
        monkeypatch.setattr(blocksize, "_workers", lambda: workers)

    return set_to


def test_a_big_budget_still_makes_blocks_of_at_most_32_mb(machine: Machine) -> None:
    machine(64 * GB, 2)
    assert default_rows(ROW, 100_000_000) * ROW == 32 * MB
    assert default_rows(ROW) * ROW == 32 * MB


def test_a_small_budget_makes_blocks_of_at_least_1_mb(machine: Machine) -> None:
    machine(8 * MB, 2)  # budget / 16 = 512 KB
    assert default_rows(ROW, 100_000_000) * ROW == 1 * MB


def test_every_worker_gets_four_blocks_of_an_array_big_enough_to_share(machine: Machine) -> None:
    machine(64 * GB, 2)
    rows = default_rows(ROW, 1 << 20)  # 32 MB in all
    assert rows == (1 << 20) // 8  # 4 MB blocks: 8 of them for 2 workers
    assert default_rows(ROW, 10_000) * ROW == 1 * MB  # never below 1 MB to spread work


def test_one_row_bigger_than_the_cap_is_a_block_of_one_row(machine: Machine) -> None:
    machine(64 * GB, 2)
    assert default_rows(64 * MB, 100) == 1


def test_files_per_block_spread_over_the_workers_without_a_floor(machine: Machine) -> None:
    machine(64 * GB, 2)
    assert blocksize.files_per_block(80, 1000) == 10  # 80 files / (4 x 2 workers)
    assert blocksize.files_per_block(10**6, 4 * MB) == 8  # 32 MB of files a block


def test_rows_that_do_not_widen_keep_their_blocks() -> None:
    bounds = (0, 3_000_000, 6_000_000)
    assert output_bounds(bounds, ROW, ROW) is bounds
    assert output_bounds(bounds, ROW, 4) is bounds


def test_widened_rows_are_cut_to_the_cap() -> None:
    bounds = (0, 1 << 20, 2 << 20)  # 32 MB input blocks
    cut = output_bounds(bounds, ROW, 512 * 4)  # 2 GB of output per input block
    assert set(bounds) <= set(cut)
    assert max((b - a) * 512 * 4 for a, b in itertools.pairwise(cut)) <= MAX_BLOCK_BYTES


def test_a_big_block_asked_for_keeps_its_size_when_widened_a_little() -> None:
    bounds = (0, 2 << 20)  # 64 MB of input, asked for with rows=
    cut = output_bounds(bounds, ROW, ROW * 3 // 2)  # 96 MB of output
    assert cut == (0, 1 << 20, 2 << 20)  # two blocks of 48 MB, not three of 32 MB


@given(
    sizes=st.lists(st.integers(1, 5_000_000), min_size=1, max_size=6),
    in_row=st.integers(0, 64),
    out_row=st.integers(0, 4096),
)
def test_output_bounds_refine_the_input_and_respect_the_cap(
    sizes: list[int], in_row: int, out_row: int
) -> None:
    bounds = (0, *itertools.accumulate(sizes))
    cut = output_bounds(bounds, in_row, out_row)
    assert cut[0] == 0 and cut[-1] == bounds[-1] and set(bounds) <= set(cut)
    assert all(b > a for a, b in itertools.pairwise(cut))
    edges = list(bounds)
    for a, b in itertools.pairwise(cut):
        block = next(k for k in range(len(edges) - 1) if edges[k] <= a < edges[k + 1])
        in_bytes = (edges[block + 1] - edges[block]) * in_row
        assert (b - a) * out_row <= max(MAX_BLOCK_BYTES, in_bytes) or b - a == 1


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_map_blocks_that_widens_rows_makes_blocks_under_the_cap() -> None:
    a = np.random.default_rng(0).random((40_000, 8), dtype=np.float32)  # 1.28 MB
    seen: list[int] = []

    def widen(b: np.ndarray) -> np.ndarray:
        seen.append(len(b))
        return np.repeat(b, 64, axis=1) * 2  # 8 values in, 512 out: 80 MB in all

    for x in (tw.from_array(a), tw.from_array(a, rows=40_000)):
        seen.clear()
        y = x.map_blocks(widen, dtype=np.float32, row_shape=(512,))
        sizes = [(stop - start) * 512 * 4 for start, stop in y.blocks]
        assert max(sizes) <= MAX_BLOCK_BYTES and y.nblocks >= 3
        want = np.repeat(a, 64, axis=1) * 2
        np.testing.assert_array_equal(y.compute(), want)
        assert max(seen) * 512 * 4 <= MAX_BLOCK_BYTES  # what the function made, too
        np.testing.assert_allclose(y.sum(axis=0).compute(), want.sum(axis=0, dtype=np.float64))


def test_a_product_that_widens_rows_is_cut_too() -> None:
    a = np.random.default_rng(1).random((40_000, 8))
    w = np.random.default_rng(2).random((8, 256))
    y = tw.from_array(a, rows=40_000) @ w  # 80 MB of float64 from 2.5 MB
    assert max((stop - start) * 256 * 8 for start, stop in y.blocks) <= MAX_BLOCK_BYTES
    np.testing.assert_allclose(y.compute(), a @ w)
