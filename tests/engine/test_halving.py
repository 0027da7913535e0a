"""Out-of-memory halving: retry on halves, stitch, remember, explain."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine import halving
from tierflow.errors import OutOfMemoryError
from tierflow.storage import oom


@pytest.fixture(autouse=True)
def _forget() -> Iterator[None]:
    halving.forget()
    yield
    halving.forget()


def limited(limit: int, error: Callable[[], BaseException]) -> tuple[Callable[..., Any], list[int]]:
    """A block function that runs out of memory above ``limit`` rows."""
    sizes: list[int] = []

    def fn(b: np.ndarray) -> np.ndarray:
        sizes.append(len(b))
        if len(b) > limit:
            raise error()
        return np.sqrt(b) + 1

    return fn, sizes


def test_memory_error_above_n_rows_gives_numpys_result() -> None:
    a = np.random.default_rng(0).uniform(size=(1000, 3))
    fn, sizes = limited(70, lambda: MemoryError("cannot allocate"))
    x = tw.from_array(a, rows=250)
    y = x.map_blocks(fn, dtype=np.float64, row_shape=(3,))
    np.testing.assert_array_equal(y.compute(executor="serial"), np.sqrt(a) + 1)
    # 250 -> 125 -> 63 for the first block; the next blocks start from 63 at once
    assert sizes[:3] == [250, 125, 63] and max(sizes[7:]) <= 63
    assert halving.remembered(y.key) == 63
    # the remembered size also holds for the next compute of the same operator
    sizes.clear()
    y.sum(axis=0).compute(executor="serial")
    assert max(sizes) <= 63


@pytest.mark.torch
@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_torch_cuda_out_of_memory_is_halved_too() -> None:
    torch = pytest.importorskip("torch")
    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; "
        "12.00 GiB already allocated; 1.00 GiB free; 13.00 GiB reserved in total by PyTorch)"
    )
    fn, sizes = limited(100, lambda: torch.cuda.OutOfMemoryError(message))
    a = np.arange(1200.0).reshape(400, 3)
    y = tw.from_array(a, rows=400).map_blocks(fn, dtype=np.float64, row_shape=(3,))
    np.testing.assert_array_equal(y.compute(), np.sqrt(a) + 1)
    assert sizes[:3] == [400, 200, 100]


@pytest.mark.torch
def test_each_attempt_is_recovered_as_fit_batch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    steps: list[str] = []
    figures = oom.CudaFigures(
        device=0, requested=2 << 30, total=24 << 30, free=256 << 20,
        allocated=12 << 30, reserved=23 << 30,
    )  # fmt: skip
    monkeypatch.setattr(oom, "cuda_figures", lambda exc: steps.append("figures") or figures)
    monkeypatch.setattr(oom, "empty_gpu_caches", lambda: steps.append("empty"))
    fn, sizes = limited(0, lambda: torch.cuda.OutOfMemoryError("CUDA out of memory."))
    y = tw.from_array(np.ones((4, 2)), rows=4).map_blocks(fn, dtype=np.float64, row_shape=(2,))
    with pytest.raises(OutOfMemoryError, match=r"GPU 0: 24\.00 GB total.*fragmentation"):
        y.compute(executor="serial")
    assert sizes == [4, 2, 1]
    # The figures are read before the caches are emptied, on the last attempt too.
    assert steps == ["figures", "empty"] * 3


def test_a_reduction_chunk_is_halved_and_its_halves_combined() -> None:
    a = np.random.default_rng(1).normal(size=(3000, 2))
    seen: list[int] = []

    def chunk(b: np.ndarray, start: int) -> list[tuple[int, int]]:
        seen.append(len(b))
        if len(b) > 400:
            raise MemoryError
        return [(start, len(b))]

    x = tw.from_array(a, rows=1000)
    pieces = x.reduction(chunk, lambda p, q: p + q, with_offset=True, commutative=False).compute()
    assert sum(n for _, n in pieces) == 3000
    assert [s for s, _ in pieces] == sorted(s for s, _ in pieces)  # offsets stay global
    assert max(n for _, n in pieces) <= 400


def test_one_row_that_does_not_fit_is_explained() -> None:
    fn, _ = limited(0, lambda: MemoryError("out of RAM"))
    y = tw.from_array(np.ones((16, 2)), rows=8).map_blocks(fn, dtype=np.float64, row_shape=(2,))
    with pytest.raises(
        OutOfMemoryError,
        match=r"map_blocks\(limited.<locals>.fn\) ran out of memory on block 0 of 2 \(rows 0:8\).*\(8, 4, 2, 1 rows\): MemoryError: out of RAM\. RAM: .* usable",
    ) as info:
        y.compute(executor="serial")
    assert isinstance(info.value, MemoryError)


def test_an_aggregate_cannot_be_split_and_says_so() -> None:
    def aggregate(p: Any) -> Any:
        raise MemoryError("no room for the result")

    x = tw.from_array(np.ones((10, 2)), rows=5)
    r = x.reduction(lambda b: len(b), lambda p, q: p + q, aggregate, name="count")
    with pytest.raises(
        OutOfMemoryError,
        match=r"reduction\(count\) ran out of memory while aggregating.*cannot be split",
    ):
        r.compute()


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_other_errors_are_not_retried() -> None:
    calls: list[int] = []

    def fn(b: np.ndarray) -> np.ndarray:
        calls.append(len(b))
        raise ValueError("not memory")

    y = tw.from_array(np.ones((8, 2)), rows=8).map_blocks(fn, dtype=np.float64, row_shape=(2,))
    with pytest.raises(tw.errors.BlockError, match="not memory"):
        y.compute()
    assert calls == [8]
