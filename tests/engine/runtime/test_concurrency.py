"""Computes at once: threads sharing lazy arrays and sources get NumPy's results, their
admitted bytes stay within the one budget, and a compute inside a block function works."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine import types
from tierflow.engine.runtime import executors, scheduler
from tierflow.system import budget

from common import Concurrency

MB = 1 << 20
ROUNDS = 4
N = 6000
ROWS = 250  # 24 blocks


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(11).random((N, 3))


def run_together(jobs: list[Callable[[], Any]], timeout: float = 60) -> list[Any]:
    """Run ``jobs`` on threads of their own, started together; their results, or the
    first error raised. A job still running after ``timeout`` seconds fails the test
    (its thread is a daemon: a deadlock does not hang the test run)."""
    barrier = threading.Barrier(len(jobs))
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def body(k: int) -> None:
        barrier.wait()
        try:
            results[k] = jobs[k]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a compute did not finish"
    if errors:
        raise errors[0]
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("executor", ["threads", "serial"])
def test_two_threads_computing_on_shared_arrays_get_numpys_results(
    src: Path, data: np.ndarray, tmp_path: Path, executor: str
) -> None:
    x = tw.from_npy(src, rows=ROWS)
    y = np.sqrt(x * 2 + 1)
    picked = y[y[:, 0] > 1.5]
    mapped = x.map_blocks(lambda b: b[:, ::-1] * 3, dtype=np.float64, row_shape=(3,))
    in_ram = tw.from_array(data * 3, rows=ROWS + 70)  # other blocks than x's
    marked = (x + in_ram).map_blocks(lambda b: b - 1, dtype=np.float64, row_shape=(3,)).cache()
    expected_y = np.sqrt(data * 2 + 1)
    expected_picked = expected_y[expected_y[:, 0] > 1.5]
    expected_mapped = data[:, ::-1] * 3
    expected_marked = (data + data * 3) - 1

    def job(k: int) -> None:
        for r in range(ROUNDS):
            mean, std = tw.compute(y.mean(axis=0), y.std(axis=0), executor=executor)
            np.testing.assert_allclose(mean, expected_y.mean(axis=0), rtol=1e-12)
            np.testing.assert_allclose(std, expected_y.std(axis=0), rtol=1e-12)
            assert (x.argmin(axis=0).compute(executor=executor) == data.argmin(axis=0)).all()
            np.testing.assert_allclose(
                picked.sum(axis=0).compute(executor=executor),
                expected_picked.sum(axis=0),
                rtol=1e-12,
            )
            out = tmp_path / f"y-{k}-{r}.npy"
            y.to_npy(out, executor=executor)
            np.testing.assert_array_equal(np.load(out), expected_y)
            kept = picked.persist(executor=executor)
            np.testing.assert_array_equal(kept.compute(executor=executor), expected_picked)
            np.testing.assert_allclose(
                (kept * 2).max(axis=0).compute(executor=executor),
                expected_picked.max(axis=0) * 2,
            )
            cached = mapped.compute(cache=True, executor=executor)
            np.testing.assert_array_equal(cached, expected_mapped)
            np.testing.assert_allclose(
                marked.sum(axis=0).compute(executor=executor),
                expected_marked.sum(axis=0),
                rtol=1e-12,
            )
            np.testing.assert_array_equal(marked.compute(executor=executor), expected_marked)
            masked = tmp_path / f"picked-{k}-{r}.npy"
            (picked * 2).to_npy(masked, executor=executor)
            np.testing.assert_array_equal(np.load(masked), expected_picked * 2)

    run_together([lambda: job(0), lambda: job(1)])


class Peak:
    """A callback keeping the run's peak projected bytes."""

    def __init__(self) -> None:
        self.peak = 0

    def finish(self, event: types.ComputeFinished) -> None:
        self.peak = event.peak_bytes


@pytest.mark.timeout(120)
def test_two_computes_admit_within_one_budget_together_and_both_finish() -> None:
    tw.memory.budget("8MB")
    budget.ledger.reset_peak()
    fn = Concurrency()
    rows = MB // 8
    x = tw.from_array(np.ones((rows * 6, 1)), rows=rows)
    # After a mask, blocks cannot be cut: each task projects about 4.2 MB, more than
    # half of the budget, so two of them, of either compute, never run at once.
    y = x[x[:, 0] > 0].map_blocks(fn, dtype=np.float64, row_shape=(1,)).sum(axis=0)
    peaks = [Peak(), Peak()]
    sums = run_together([lambda k=k: y.compute(workers=2, callbacks=peaks[k]) for k in (0, 1)])
    assert [float(s[0]) for s in sums] == [2.0 * 6 * rows] * 2
    assert all(p.peak > 4 * MB for p in peaks)  # the premise: tasks over half the budget
    assert fn.calls == 12 and fn.most == 1
    assert budget.ledger.peak <= 8 * MB
    assert budget.ledger.admitted == 0  # everything went back


def inner_total(executor: str | None) -> Callable[[np.ndarray], np.ndarray]:
    """A block function that computes a sum of its own block with tierflow."""

    def fn(b: np.ndarray) -> np.ndarray:
        inner = tw.from_array(np.ascontiguousarray(b), rows=max(1, len(b) // 4))
        total = (inner * 1).sum(axis=0).compute(executor=executor)
        return b + total

    return fn


def expected_inner(data: np.ndarray, rows: int) -> np.ndarray:
    blocks = [data[a : a + rows] for a in range(0, len(data), rows)]
    return np.concatenate([b + b.sum(axis=0) for b in blocks])


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("outer", ["threads", "serial"])
@pytest.mark.parametrize("inner", [None, "threads", "serial"])
def test_a_compute_inside_a_block_function_works(outer: str, inner: str | None) -> None:
    data = np.random.default_rng(3).random((4000, 2))
    x = tw.from_array(data, rows=500)
    y = x.map_blocks(inner_total(inner), dtype=np.float64, row_shape=(2,))
    np.testing.assert_allclose(y.compute(executor=outer, workers=2), expected_inner(data, 500))


@pytest.mark.timeout(60, method="thread")
def test_a_compute_inside_a_task_on_the_same_executor_object_does_not_wait_on_itself() -> None:
    ex = executors.ThreadExecutor(workers=1)
    data = np.random.default_rng(4).random((2000, 2))
    x = tw.from_array(data, rows=500)

    def fn(b: np.ndarray) -> np.ndarray:
        # The one worker runs this task: a compute queued on it would wait forever.
        inner = tw.from_array(np.ascontiguousarray(b), rows=100)
        return b + (inner * 1).sum(axis=0).compute(executor=ex)

    try:
        y = x.map_blocks(fn, dtype=np.float64, row_shape=(2,)).compute(executor=ex)
    finally:
        ex.shutdown()
    np.testing.assert_allclose(y, expected_inner(data, 500))


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("outer", ["threads", "serial"])
def test_a_compute_inside_a_task_that_holds_the_budget_still_runs(outer: str) -> None:
    tw.memory.budget("3MB")
    rows = MB // 8
    data = np.arange(rows * 4, dtype=np.float64).reshape(-1, 1)
    x = tw.from_array(data, rows=rows)

    # Each outer task projects more than the budget; the inner compute's blocks (1 MB
    # after a mask, not cut) do not fit beside it either.
    def fn(b: np.ndarray) -> np.ndarray:
        inner = tw.from_array(np.ascontiguousarray(b), rows=len(b) // 2)
        total = inner[inner[:, 0] >= 0].sum(axis=0).compute()
        return b + total

    y = x[x[:, 0] >= 0].map_blocks(fn, dtype=np.float64, row_shape=(1,))
    np.testing.assert_allclose(y.compute(executor=outer, workers=2), expected_inner(data, rows))
    assert budget.ledger.admitted == 0


@pytest.mark.timeout(60, method="thread")
@pytest.mark.executors("threads", "serial")  # the waits are for this process's budget
def test_a_compute_a_task_waits_for_on_another_thread_runs_after_a_while(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scheduler, "STARVED_SECONDS", 0.2)
    tw.memory.budget("3MB")
    rows = MB // 8
    data = np.arange(rows * 2, dtype=np.float64).reshape(-1, 1)
    x = tw.from_array(data, rows=rows)

    def fn(b: np.ndarray) -> np.ndarray:
        # Not nested (another thread), so it waits for the outer task, which waits
        # for it: after STARVED_SECONDS it runs beyond the budget instead.
        inner = tw.from_array(np.ascontiguousarray(b), rows=len(b) // 2)
        found: list[np.ndarray] = []
        thread = threading.Thread(
            target=lambda: found.append(inner[inner[:, 0] >= 0].sum(axis=0).compute())
        )
        thread.start()
        thread.join()
        return b + found[0]

    y = x[x[:, 0] >= 0].map_blocks(fn, dtype=np.float64, row_shape=(1,))
    with caplog.at_level("WARNING", logger="tierflow.engine"):
        np.testing.assert_allclose(y.compute(workers=2), expected_inner(data, rows))
    assert "waited 0 s for other computes' tasks" in caplog.text


class Spilled:
    """A callback keeping the bytes the run spilled."""

    def __init__(self) -> None:
        self.spilled = -1

    def finish(self, event: types.ComputeFinished) -> None:
        self.spilled = event.spilled_bytes


def test_results_held_by_every_compute_together_are_spilled_past_half_the_budget() -> None:
    tw.memory.budget("64MB")
    rows = MB // 8
    x = tw.from_array(np.ones((rows * 8, 1)), rows=rows)
    picked = x[x[:, 0] > 0]  # its blocks are held until they are assembled
    alone, beside = Spilled(), Spilled()
    assert len(picked.compute(callbacks=alone, workers=2)) == rows * 8
    budget.ledger.hold(30 * MB)  # what another compute holds now
    try:
        assert len(picked.compute(callbacks=beside, workers=2)) == rows * 8
    finally:
        budget.ledger.drop(30 * MB)
    assert alone.spilled == 0 and beside.spilled > 0
