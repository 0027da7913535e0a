"""Block kernels of the operators layer against plain NumPy per block, one thread.

On a float32 ``[N, 8]`` array in RAM (512 MB by default), walked in blocks of 1M rows
(32 MB), as the engine walks a file:

* column sums: ``reduce_rows`` (wide view, float64 accumulation) against
  ``block.sum(axis=0, dtype=np.float64)``;
* ``np.sqrt(x * 2 + 1).sum(axis=0)``: ``FusedReduction`` (sub-blocks in cache, float64
  partials) against NumPy's two block-sized temporaries and float32 ``sum(axis=0)``;
* the map alone, ``np.sqrt(x * 2 + 1)`` into an output block: ``FusedKernel`` against
  NumPy.

``python tests/benchmarks/bench_operators.py`` prints GB/s and ratios (under ~30 s);
``make bench`` runs it under pytest-benchmark. ``TIERFLOW_BENCH_OPS_MB`` sets the array
size in MB (default 512), ``TIERFLOW_BENCH_OPS_BLOCK`` the block rows (default 1M).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tierflow.operators.elementwise import Input, call
from tierflow.operators.fused import FusedKernel, FusedReduction
from tierflow.operators.reductions import reduce_rows, reduction

MB = 1 << 20
SIZE_MB = int(os.environ.get("TIERFLOW_BENCH_OPS_MB", "512"))
BLOCK_ROWS = int(os.environ.get("TIERFLOW_BENCH_OPS_BLOCK", str(1 << 20)))
COLUMNS = 8


def make_array(size_mb: int = SIZE_MB) -> np.ndarray:
    """A float32 ``[N, 8]`` array of ``size_mb`` MB with values in [0, 1)."""
    rows = size_mb * MB // (4 * COLUMNS)
    x = np.empty((rows, COLUMNS), np.float32)
    rng = np.random.default_rng(0)
    for start in range(0, rows, BLOCK_ROWS):
        block = x[start : start + BLOCK_ROWS]
        block[...] = rng.random(block.shape, dtype=np.float32)
    return x


def _blocks(x: np.ndarray) -> list[np.ndarray]:
    return [x[start : start + BLOCK_ROWS] for start in range(0, x.shape[0], BLOCK_ROWS)]


def _gbps(fn: Callable[[], Any], nbytes: int, repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def column_sum_numpy(x: np.ndarray) -> np.ndarray:
    total = np.zeros(COLUMNS)
    for block in _blocks(x):
        total += block.sum(axis=0, dtype=np.float64)
    return total


def column_sum_fast(x: np.ndarray) -> np.ndarray:
    total = np.zeros(COLUMNS)
    for block in _blocks(x):
        total += reduce_rows(np.add, block, np.float64)
    return total


def fused_sum_numpy(x: np.ndarray) -> np.ndarray:
    total = np.zeros(COLUMNS, np.float32)
    for block in _blocks(x):
        total += np.sqrt(block * 2 + 1).sum(axis=0)
    return total


def _fused_reduction() -> FusedReduction:
    kernel = FusedKernel(call(np.sqrt, Input(0) * 2 + 1), [np.float32], [(COLUMNS,)])
    return FusedReduction(kernel, reduction("sum", np.float32, (COLUMNS,), axis=0))  # type: ignore[arg-type]


def fused_sum_kernel(x: np.ndarray, op: FusedReduction | None = None) -> Any:
    op = op or _fused_reduction()
    partial = None
    for start in range(0, x.shape[0], BLOCK_ROWS):
        partial = op.combine(partial, op.chunk(x[start : start + BLOCK_ROWS], row_offset=start))
    return op.aggregate(partial)


def map_numpy(x: np.ndarray, out: np.ndarray) -> None:
    for start in range(0, x.shape[0], BLOCK_ROWS):
        out[start : start + BLOCK_ROWS] = np.sqrt(x[start : start + BLOCK_ROWS] * 2 + 1)


def map_kernel(x: np.ndarray, out: np.ndarray, kernel: FusedKernel) -> None:
    for start in range(0, x.shape[0], BLOCK_ROWS):
        stop = start + BLOCK_ROWS
        kernel.apply(x[start:stop], out=out[start:stop])


def compare(size_mb: int = SIZE_MB) -> dict[str, float]:
    """GB/s of each variant and the kernel/NumPy ratios."""
    x = make_array(size_mb)
    out = np.empty_like(x)
    out[...] = 0  # fault the output's pages in before timing
    kernel = FusedKernel(call(np.sqrt, Input(0) * 2 + 1), [np.float32], [(COLUMNS,)])
    fused = _fused_reduction()
    np.testing.assert_allclose(column_sum_fast(x), column_sum_numpy(x), rtol=1e-10)
    np.testing.assert_allclose(fused_sum_kernel(x, fused), fused_sum_numpy(x), rtol=1e-4)
    result = {
        "colsum_numpy": _gbps(lambda: column_sum_numpy(x), x.nbytes),
        "colsum_fast": _gbps(lambda: column_sum_fast(x), x.nbytes),
        "fused_sum_numpy": _gbps(lambda: fused_sum_numpy(x), x.nbytes),
        "fused_sum_kernel": _gbps(lambda: fused_sum_kernel(x, fused), x.nbytes),
        "map_numpy": _gbps(lambda: map_numpy(x, out), x.nbytes),
        "map_kernel": _gbps(lambda: map_kernel(x, out, kernel), x.nbytes),
    }
    result["colsum_ratio"] = result["colsum_fast"] / result["colsum_numpy"]
    result["fused_sum_ratio"] = result["fused_sum_kernel"] / result["fused_sum_numpy"]
    result["map_ratio"] = result["map_kernel"] / result["map_numpy"]
    return result


def _summary(r: dict[str, float], size_mb: int = SIZE_MB) -> str:
    return "\n".join(
        [
            f"float32 [N, {COLUMNS}], {size_mb} MB in RAM, blocks of {BLOCK_ROWS} rows, one thread",
            f"column sum, float64:   NumPy {r['colsum_numpy']:.2f} GB/s, "
            f"reduce_rows {r['colsum_fast']:.2f} GB/s ({r['colsum_ratio']:.1f}x)",
            f"sqrt(x*2+1).sum(0):    NumPy {r['fused_sum_numpy']:.2f} GB/s, "
            f"FusedReduction {r['fused_sum_kernel']:.2f} GB/s ({r['fused_sum_ratio']:.1f}x)",
            f"sqrt(x*2+1) into out:  NumPy {r['map_numpy']:.2f} GB/s, "
            f"FusedKernel {r['map_kernel']:.2f} GB/s ({r['map_ratio']:.1f}x)",
        ]
    )


def test_operators_vs_numpy(benchmark: Any) -> None:
    """All variants in one run, so the ratios compare like with like."""
    benchmark.group = "operators: kernels vs NumPy per block"
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(_summary(result))


if __name__ == "__main__":
    print(_summary(compare()))
