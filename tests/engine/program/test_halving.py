"""Out-of-memory halving: retry on halves, stitch, remember, explain."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.program import halving
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


@pytest.mark.executors("serial")  # counts calls in this process
def test_the_size_that_worked_serves_the_rest_of_the_block_and_the_next_blocks() -> None:
    # A function that runs out of memory above 1,000 rows, on 20,000-row blocks: 20,000,
    # 10,000, 5,000, 2,500 and 1,250 fail once each, then every piece is 625 rows.
    a = np.random.default_rng(2).uniform(size=(100_000, 2))
    fn, sizes = limited(1000, lambda: MemoryError("cannot allocate"))
    x = tw.from_array(a, rows=20_000)
    assert x.nblocks == 5
    y = x.map_blocks(fn, dtype=np.float64, row_shape=(2,))
    np.testing.assert_array_equal(y.compute(), np.sqrt(a) + 1)
    oversized = [n for n in sizes if n > 1000]
    assert len(oversized) <= 6, oversized
    assert oversized == [20_000, 10_000, 5_000, 2_500, 1_250]
    assert set(sizes) - set(oversized) == {625}
    assert sum(sizes) - sum(oversized) == len(a)  # each row computed once


@pytest.mark.executors("serial")  # counts calls in this process
def test_a_reduction_chunk_uses_the_size_that_worked_at_once() -> None:
    a = np.random.default_rng(3).normal(size=(60_000, 2))
    seen: list[int] = []

    def chunk(b: np.ndarray, start: int) -> list[tuple[int, int]]:
        seen.append(len(b))
        if len(b) > 1000:
            raise MemoryError
        return [(start, len(b))]

    x = tw.from_array(a, rows=20_000)
    r = x.reduction(chunk, lambda p, q: p + q, with_offset=True, commutative=False)
    pieces = r.compute()
    assert [n for n in seen if n > 1000] == [20_000, 10_000, 5_000, 2_500, 1_250]
    assert {n for _, n in pieces} == {625}
    assert [s for s, _ in pieces] == list(range(0, 60_000, 625))  # offsets stay global


@pytest.mark.executors("serial")  # counts calls in this process
def test_the_caches_are_emptied_before_each_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[str] = []
    monkeypatch.setattr(oom, "empty_gpu_caches", lambda: steps.append("empty"))

    def fn(b: np.ndarray) -> np.ndarray:
        steps.append(f"call {len(b)}")
        if len(b) > 2:
            raise MemoryError
        return b * 2

    y = tw.from_array(np.ones((16, 2)), rows=8).map_blocks(fn, dtype=np.float64, row_shape=(2,))
    np.testing.assert_array_equal(y.compute(), np.full((16, 2), 2.0))
    assert steps == [
        "call 8", "empty", "call 4", "empty", "call 2", "call 2", "call 2", "call 2",
        "call 2", "call 2", "call 2", "call 2",
    ]  # fmt: skip


CASES = {
    "too big": (
        "CUDA out of memory. Tried to allocate 100.00 GiB (GPU 0; 80.00 GiB total capacity; "
        "1.00 GiB already allocated; 78.00 GiB free; 1.00 GiB reserved in total by PyTorch)",
        r"Too big for the device: one request of 100\.00 GB exceeds its 80\.00 GB",
    ),
    "fragmented": (
        "CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 80.00 GiB total capacity; "
        "70.00 GiB already allocated; 512.00 MiB free; 79.00 GiB reserved in total by PyTorch)",
        r"Looks like fragmentation: 9\.00 GB is reserved but unallocated.*expandable_segments",
    ),
    "another process": (
        "CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 80.00 GiB total capacity; "
        "70.00 GiB already allocated; 0 bytes free; 70.00 GiB reserved in total by PyTorch)",
        r"10\.00 GB of the device is used outside this allocator.*another process",
    ),
}


@pytest.mark.torch
@pytest.mark.executors("serial")  # counts calls in this process
@pytest.mark.parametrize("case", CASES)
def test_one_row_that_does_not_fit_on_the_gpu_names_the_case(case: str) -> None:
    torch = pytest.importorskip("torch")
    message, diagnosis = CASES[case]
    fn, sizes = limited(0, lambda: torch.cuda.OutOfMemoryError(message))
    y = tw.from_array(np.ones((4, 2)), rows=4).map_blocks(fn, dtype=np.float64, row_shape=(2,))
    with pytest.raises(OutOfMemoryError, match=r"\(4, 2, 1 rows\).*" + diagnosis):
        y.compute(executor="serial")
    assert sizes == [4, 2, 1]


@pytest.mark.executors("threads")  # a child process, on its own executor
def test_emptying_the_gpu_caches_imports_neither_torch_nor_cupy() -> None:
    code = (
        "import sys; from tierflow.storage import oom; oom.empty_gpu_caches(); "
        "print('torch' in sys.modules, 'cupy' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
