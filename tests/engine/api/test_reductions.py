"""Reductions and passes: one read for several results, stages, user reductions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.io.npy import FileReader
from tierflow.engine.planning.plan import Target, build_plan


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Every row range a task reads from a file source, in order."""
    seen: list[tuple[int, int]] = []
    original = FileReader.read

    def read(self: FileReader, i0: int, i1: int) -> np.ndarray:
        seen.append((i0, i1))
        return original(self, i0, i1)

    monkeypatch.setattr(FileReader, "read", read)
    yield seen


@pytest.fixture
def path(tmp_path: Path) -> str:
    a = np.random.default_rng(1).normal(3, 2, size=(5000, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", a)
    return str(tmp_path / "x.npy")


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_mean_and_std_come_from_one_pass(path: str, reads: list[tuple[int, int]]) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=700)
    mean, std, top = tw.compute(x.mean(axis=0), x.std(axis=0), x.max())
    assert sorted(reads) == list(x.blocks)  # every block read exactly once
    np.testing.assert_allclose(mean, a.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(std, a.std(axis=0), rtol=1e-5)
    assert top == a.max()


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_reductions_over_different_masks_of_one_file_share_each_read(
    path: str, reads: list[tuple[int, int]]
) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=700)
    st, pos = x[x[:, 0] > 3], x[x[:, 1] > 3]
    deeper = pos[pos[:, 2] < 4]  # a mask of a mask: the same blocks of x
    std, total, top = tw.compute(st.std(0), pos.sum(0), deeper.max(0))
    assert sorted(reads) == list(x.blocks)  # every block read exactly once
    np.testing.assert_allclose(std, a[a[:, 0] > 3].std(0), rtol=1e-5)
    np.testing.assert_allclose(total, a[a[:, 1] > 3].sum(0), rtol=1e-5)
    b = a[a[:, 1] > 3]
    np.testing.assert_array_equal(top, b[b[:, 2] < 4].max(0))


def test_results_over_different_masks_run_in_one_pass_on_every_executor(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=700)
    low, high = x[x[:, 0] < 2], x[x[:, 0] > 4]
    plan = build_plan(
        [Target(low.mean(0)._node), Target(high.sum(0)._node), Target(high[:, 1].max()._node)],
        workers=2,
        budget=1 << 30,
    )
    assert plan.passes == 1
    mean, total, column = tw.compute(low.mean(0), high.sum(0), high[:, 1])
    np.testing.assert_allclose(mean, a[a[:, 0] < 2].mean(0), rtol=1e-5)
    np.testing.assert_allclose(total, a[a[:, 0] > 4].sum(0), rtol=1e-5)
    np.testing.assert_array_equal(column, a[a[:, 0] > 4][:, 1])


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_results_over_an_array_and_over_masks_of_it_share_each_read(
    path: str, reads: list[tuple[int, int]]
) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=700)
    pos = x[x[:, 1] > 3]
    std, total = tw.compute(x.std(0), pos.sum(0))
    assert sorted(reads) == list(x.blocks)  # every block read exactly once
    np.testing.assert_allclose(std, a.std(0), rtol=1e-5)
    np.testing.assert_allclose(total, a[a[:, 1] > 3].sum(0), rtol=1e-5)


@pytest.mark.executors("threads", "serial", "processes", "dask", "ray")
def test_an_array_and_masks_of_it_in_one_pass_give_numpys_results(
    path: str, tmp_path: Path
) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=700)
    m = x[:, 0] > 3
    low = x[x[:, 0] < 2]
    plan = build_plan(
        [Target(n._node) for n in (x.argmax(0), x.mean(0), x[m].max(0), low.min(0))],
        workers=2,
        budget=1 << 30,
    )
    assert plan.passes == 1
    # Row numbers of the array's own blocks, a sink with known rows, one of unknown rows.
    first, mean, masked_first, smallest, doubled, picked = tw.compute(
        x.argmax(0), x.mean(0), x[m].argmax(0), low.min(0), x * 2, x[m][:, 2]
    )
    np.testing.assert_array_equal(first, a.argmax(0))
    np.testing.assert_allclose(mean, a.mean(0), rtol=1e-5)
    np.testing.assert_array_equal(masked_first, a[a[:, 0] > 3].argmax(0))
    np.testing.assert_array_equal(smallest, a[a[:, 0] < 2].min(0))
    np.testing.assert_array_equal(doubled, a * 2)
    np.testing.assert_array_equal(picked, a[a[:, 0] > 3][:, 2])
    (x - 1).to_npy(tmp_path / "out.npy")  # a file sink joined to nothing: unchanged
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), a - 1)


def test_an_array_whose_blocks_must_be_cut_keeps_its_own_pass(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=1000)
    wide = x.map_blocks(lambda b: np.repeat(b, 100, axis=1), dtype=x.dtype, row_shape=(600,))
    budget = 4 * wide._node.row_shape[0] * 4 * 200  # a task's share holds ~200 wide rows
    targets = [Target(wide.sum(0)._node), Target(x[x[:, 0] > 3].sum(0)._node)]
    plan = build_plan(targets, workers=2, budget=budget)
    assert plan.passes == 2  # cut in pieces, the wide blocks cannot join the masked pass
    total, masked = tw.compute(wide.sum(0), x[x[:, 0] > 3].sum(0))
    np.testing.assert_allclose(total, np.repeat(a, 100, axis=1).sum(0), rtol=1e-4)
    np.testing.assert_allclose(masked, a[a[:, 0] > 3].sum(0), rtol=1e-5)


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_standardising_takes_a_second_stage(path: str, reads: list[tuple[int, int]]) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=1000)
    z = (x - x.mean(axis=0)) / x.std(axis=0)
    result = z.compute()
    assert len(reads) == 2 * x.nblocks  # once for the moments, once for the output
    np.testing.assert_allclose(result, (a - a.mean(0)) / a.std(0), rtol=1e-4, atol=1e-5)


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_the_same_computation_built_twice_runs_once(
    path: str, reads: list[tuple[int, int]]
) -> None:
    s1, s2 = tw.compute(tw.from_npy(path, rows=1000).sum(), tw.from_npy(path, rows=1000).sum())
    assert s1 == s2 and len(reads) == 5


def test_reductions_over_trailing_axes_are_block_operations(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=999)
    r = x.sum(axis=1)
    assert r.shape == (5000,) and r.blocks == x.blocks
    np.testing.assert_allclose(r.compute(), a.sum(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(x.argmax(axis=1).compute(), a.argmax(axis=1))
    np.testing.assert_allclose(
        np.sqrt(x * 2 + 10).var(axis=-1, keepdims=True).compute(),
        np.sqrt(a * 2 + 10).var(axis=-1, keepdims=True),
        rtol=1e-4,
    )


def test_argmin_argmax_use_global_row_numbers(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=333)
    assert x.argmin().compute() == a.argmin()
    np.testing.assert_array_equal(x.argmax(axis=0).compute(), a.argmax(axis=0))
    keep = a[:, 0] > 0
    assert x[x[:, 0] > 0].argmin().compute() == a[keep].argmin()
    np.testing.assert_array_equal(x[x[:, 0] > 0].argmax(axis=0).compute(), a[keep].argmax(0))


def test_histogram_with_a_range_and_with_edges(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=800)
    counts, edges = np.histogram(x, bins=7, range=(-2, 8))
    want, want_edges = np.histogram(a, bins=7, range=(-2, 8))
    np.testing.assert_array_equal(edges, want_edges)
    np.testing.assert_array_equal(counts.compute(), want)
    dense, _ = x.histogram(bins=[0, 1, 2, 5], density=True)
    np.testing.assert_allclose(dense.compute(), np.histogram(a, bins=[0, 1, 2, 5], density=True)[0])
    with pytest.raises(ValueError, match="needs range"):
        x.histogram(bins=5)


def test_user_reduction_commutative_and_ordered(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=512)
    count = x.reduction(lambda b: len(b), lambda p, q: p + q, dtype=int, shape=())
    assert count.compute() == 5000
    assert (count * 2).compute() == 10000
    # The Python int the aggregate returns is bound as the declared int (a strong
    # scalar): float32 / int64 is float64, as the plan said when it was built.
    share = x / count
    assert share.dtype == np.float64
    np.testing.assert_allclose(share.compute(), a / 5000)
    firsts = x[:, 0].reduction(
        lambda b: [float(b[0])] if len(b) else [],
        lambda p, q: p + q,
        commutative=False,
        name="firsts",
    )
    assert firsts.compute() == [float(a[i, 0]) for i in range(0, 5000, 512)]
    offsets = x.reduction(lambda b, start: [start], lambda p, q: p + q, with_offset=True)
    assert sorted(offsets.compute()) == list(range(0, 5000, 512))
    with pytest.raises(TypeError, match="no declared dtype and shape"):
        firsts + 1


def test_user_reduction_errors_name_the_block(path: str) -> None:
    x = tw.from_npy(path, rows=1000)

    def chunk(b: np.ndarray) -> Any:
        if b[0, 0] > -100:
            raise RuntimeError("bad block")
        return 0

    with pytest.raises(
        tw.errors.BlockError,
        match=r"reduction\(chunk\) failed on block \d of 5 \(rows \d+:\d+\).*bad block",
    ):
        x.reduction(chunk, lambda p, q: p + q).compute(executor="serial")


def test_values_combine_with_numpy_semantics(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path)
    m = x.mean(axis=0)
    r = (m * 2 + np.arange(6)) / x.std()
    want = (a.mean(axis=0) * 2 + np.arange(6)) / a.std()
    np.testing.assert_allclose(r.compute(), want, rtol=1e-5)
    assert r.shape == (6,) and r.dtype == want.dtype
    np.testing.assert_allclose(m[2:4].compute(), a.mean(axis=0)[2:4], rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(x.var(axis=0)).compute(), a.std(axis=0), rtol=1e-5)


def test_row_vector_and_matrix_products(path: str) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=1234)
    w = np.random.default_rng(2).normal(size=(6, 3))
    np.testing.assert_allclose((x @ w).compute(), a @ w, rtol=1e-5)
    np.testing.assert_allclose(np.dot(x, w).sum(axis=0).compute(), (a @ w).sum(axis=0), rtol=1e-5)
    v = np.arange(5000.0)
    np.testing.assert_allclose((v @ x).compute(), v @ a, rtol=1e-6)
    np.testing.assert_allclose((x[:, 0] @ v).compute(), a[:, 0] @ v, rtol=1e-6)
    with pytest.raises(
        ValueError, match=r"matmul: Input operand 1 has a mismatch.*size 5 is different from 6"
    ):
        x @ np.ones((5, 3))


def test_head_of_a_masked_array_stops_after_enough_blocks(
    path: str, reads: list[tuple[int, int]]
) -> None:
    a = np.load(path)
    x = tw.from_npy(path, rows=100)
    first = x[x[:, 0] > 3].head(10)
    np.testing.assert_array_equal(first.compute(executor="serial"), a[a[:, 0] > 3][:10])
    assert len(reads) < x.nblocks // 2  # later blocks were not needed


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_a_mean_beside_a_variance_takes_the_variances_partials(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierflow.operators import reductions

    a = np.load(path)
    x = tw.from_npy(path, rows=700)
    calls: list[str] = []
    original = reductions._Mean._chunk

    def counted(self: Any, block: np.ndarray, row_offset: int) -> Any:
        calls.append(self.kind)
        return original(self, block, row_offset)

    monkeypatch.setattr(reductions._Mean, "_chunk", counted)
    mean, std, var = tw.compute(x.mean(axis=0), x.std(axis=0), x.var(axis=0, ddof=1))
    assert calls == []  # every block's mean came from the std's partial
    wide = a.astype(np.float64)
    assert mean.dtype == np.float32 and std.dtype == np.float32
    np.testing.assert_allclose(mean, wide.mean(axis=0).astype(np.float32), rtol=4e-7)
    np.testing.assert_allclose(std, wide.std(axis=0).astype(np.float32), rtol=4e-7)
    np.testing.assert_allclose(var, wide.var(axis=0, ddof=1).astype(np.float32), rtol=4e-7)
    # Not over the same rows, or not the same axes: each chunks its own (on the NumPy
    # path: a compiled kernel, where this process has one, would not call _chunk).
    tw.compute(x.mean(axis=0), x[1:].std(axis=0), jit=False)
    tw.compute(x.mean(axis=None), x.std(axis=0), jit=False)
    assert len(calls) == 2 * x.nblocks
