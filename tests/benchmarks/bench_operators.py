"""Block kernels of the operators layer against plain NumPy per block, one thread.

Throughput, on a float32 ``[N, 8]`` array in RAM (512 MB by default) walked in blocks of
1M rows (32 MB), as the engine walks a file:

* column sums: ``reduce_rows`` (wide view, float64 lanes) against
  ``block.sum(axis=0, dtype=np.float64)``;
* ``var(axis=0)``: the row reduction (one pass: float32 deviations summed four rows of
  lanes at a time, float64 across; Chan's merge between blocks) against
  ``block.var(axis=0, dtype=np.float64)``;
* ``np.sqrt(x * 2 + 1).sum(axis=0)``: ``FusedReduction`` (sub-blocks in cache, float64
  partials) against NumPy's two block-sized temporaries and float32 ``sum(axis=0)``;
* the map alone, ``np.sqrt(x * 2 + 1)`` into an output block: ``FusedKernel`` against
  NumPy;
* row-vector constants, ``(x - m) / s`` with ``m`` and ``s`` of shape ``(8,)``, into an
  output block: ``FusedKernel`` (wide view) against NumPy, whose inner loops are 8
  elements long.

Fixed cost, in microseconds per call on one block of 1000 rows (32 KB, in cache), the
cost the engine pays per task on top of its scheduling: ``FusedReduction`` of
``((x + 1) * 2 - 3).sum(axis=0)`` against NumPy's ``((b + 1) * 2 - 3).sum(axis=0)``,
the var reduction's ``chunk`` against ``b.var(axis=0, dtype=np.float64)``, and
``FusedKernel`` of ``(x - m) / s`` into an output block against NumPy.

Every figure is the best of ``TIERFLOW_BENCH_OPS_REPEAT`` rounds (default 3), the
NumPy reference and the kernel interleaved in each round, so that a busy machine slows
both alike. ``python tests/benchmarks/bench_operators.py`` prints GB/s, microseconds and
ratios (about a minute); ``make bench`` runs it under pytest-benchmark.
``TIERFLOW_BENCH_OPS_MB`` sets the array size in MB (default 512),
``TIERFLOW_BENCH_OPS_BLOCK`` the block rows (default 1M).
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
REPEAT = int(os.environ.get("TIERFLOW_BENCH_OPS_REPEAT", "3"))
COLUMNS = 8
SMALL_ROWS = 1000  # rows of the block whose fixed cost is measured
SMALL_CALLS = 2000  # calls per timing of the small block

x_ = Input(0)


def make_array(size_mb: int = SIZE_MB) -> np.ndarray:
    """A float32 ``[N, 8]`` array of ``size_mb`` MB with values in [0, 1)."""
    rows = size_mb * MB // (4 * COLUMNS)
    x = np.empty((rows, COLUMNS), np.float32)
    rng = np.random.default_rng(0)
    for start in range(0, rows, BLOCK_ROWS):
        block = x[start : start + BLOCK_ROWS]
        block[...] = rng.random(block.shape, dtype=np.float32)
    return x


def row_constants() -> tuple[np.ndarray, np.ndarray]:
    """Column means and scales of shape ``(8,)``, as a standardisation would use."""
    return np.linspace(0.4, 0.6, COLUMNS, dtype=np.float32), np.linspace(
        0.2, 0.4, COLUMNS, dtype=np.float32
    )


def _blocks(x: np.ndarray) -> list[np.ndarray]:
    return [x[start : start + BLOCK_ROWS] for start in range(0, x.shape[0], BLOCK_ROWS)]


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


def var_numpy(x: np.ndarray) -> list[np.ndarray]:
    """NumPy's float64 variance of each block (no merge: the reference costs less)."""
    return [block.var(axis=0, dtype=np.float64) for block in _blocks(x)]


def run_reduction(op: Any, x: np.ndarray) -> Any:
    """Chunk every block, combine in order, aggregate: what the engine does."""
    partial = None
    for start in range(0, x.shape[0], BLOCK_ROWS):
        partial = op.combine(partial, op.chunk(x[start : start + BLOCK_ROWS], row_offset=start))
    return op.aggregate(partial)


def fused_sum_numpy(x: np.ndarray) -> np.ndarray:
    total = np.zeros(COLUMNS, np.float32)
    for block in _blocks(x):
        total += np.sqrt(block * 2 + 1).sum(axis=0)
    return total


def _fused_reduction() -> FusedReduction:
    kernel = FusedKernel(call(np.sqrt, x_ * 2 + 1), [np.float32], [(COLUMNS,)])
    return FusedReduction(kernel, reduction("sum", np.float32, (COLUMNS,), axis=0))  # type: ignore[arg-type]


def fused_sum_kernel(x: np.ndarray, op: FusedReduction | None = None) -> Any:
    return run_reduction(op or _fused_reduction(), x)


def map_numpy(x: np.ndarray, out: np.ndarray) -> None:
    for start in range(0, x.shape[0], BLOCK_ROWS):
        out[start : start + BLOCK_ROWS] = np.sqrt(x[start : start + BLOCK_ROWS] * 2 + 1)


def standardise_numpy(x: np.ndarray, out: np.ndarray) -> None:
    m, s = row_constants()
    for start in range(0, x.shape[0], BLOCK_ROWS):
        stop = start + BLOCK_ROWS
        np.divide(np.subtract(x[start:stop], m), s, out=out[start:stop])


def map_kernel(x: np.ndarray, out: np.ndarray, kernel: FusedKernel) -> None:
    for start in range(0, x.shape[0], BLOCK_ROWS):
        stop = start + BLOCK_ROWS
        kernel.apply(x[start:stop], out=out[start:stop])


def _best(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Best wall time of each function, in seconds; one call of each per round, in turn."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _calls(fn: Callable[[], Any], calls: int = SMALL_CALLS) -> Callable[[], None]:
    def many() -> None:
        for _ in range(calls):
            fn()

    return many


def compare(size_mb: int = SIZE_MB, rounds: int = REPEAT) -> dict[str, float]:
    """GB/s of each variant on the big array, microseconds per call on the small block,
    and the kernel/NumPy ratios (above 1: the kernel is faster)."""
    x = make_array(size_mb)
    out = np.empty_like(x)
    out[...] = 0  # fault the output's pages in before timing
    m, s = row_constants()
    kernel = FusedKernel(call(np.sqrt, x_ * 2 + 1), [np.float32], [(COLUMNS,)])
    standardise = FusedKernel((x_ - m) / s, [np.float32], [(COLUMNS,)])
    fused = _fused_reduction()
    var: Any = reduction("var", np.float32, (COLUMNS,), axis=0)
    np.testing.assert_allclose(column_sum_fast(x), column_sum_numpy(x), rtol=1e-10)
    np.testing.assert_allclose(fused_sum_kernel(x, fused), fused_sum_numpy(x), rtol=1e-4)
    np.testing.assert_allclose(
        run_reduction(var, x), x.var(axis=0, dtype=np.float64).astype(np.float32), rtol=1e-6
    )
    big = _best(
        {
            "colsum_numpy": lambda: column_sum_numpy(x),
            "colsum_fast": lambda: column_sum_fast(x),
            "var_numpy": lambda: var_numpy(x),
            "var_fast": lambda: run_reduction(var, x),
            "fused_sum_numpy": lambda: fused_sum_numpy(x),
            "fused_sum_kernel": lambda: fused_sum_kernel(x, fused),
            "map_numpy": lambda: map_numpy(x, out),
            "map_kernel": lambda: map_kernel(x, out, kernel),
            "rowconst_numpy": lambda: standardise_numpy(x, out),
            "rowconst_kernel": lambda: map_kernel(x, out, standardise),
        },
        rounds,
    )
    result = {name: x.nbytes / seconds / 1e9 for name, seconds in big.items()}

    small = x[:SMALL_ROWS].copy()
    small_out = np.empty_like(small)
    shifted = FusedKernel((x_ + 1) * 2 - 3, [np.float32], [(COLUMNS,)])
    small_sum = FusedReduction(shifted, reduction("sum", np.float32, (COLUMNS,), axis=0))  # type: ignore[arg-type]
    timed = _best(
        {
            "small_sum_numpy": _calls(lambda: ((small + 1) * 2 - 3).sum(axis=0)),
            "small_sum_kernel": _calls(lambda: small_sum.chunk(small)),
            "small_var_numpy": _calls(lambda: small.var(axis=0, dtype=np.float64)),
            "small_var_chunk": _calls(lambda: var.chunk(small)),
            "small_rowconst_numpy": _calls(
                lambda: np.divide(np.subtract(small, m), s, out=small_out)
            ),
            "small_rowconst_kernel": _calls(lambda: standardise.apply(small, out=small_out)),
        },
        rounds,
    )
    result.update({name: seconds / SMALL_CALLS * 1e6 for name, seconds in timed.items()})

    for what in ("colsum", "var", "map", "rowconst"):
        fast = "fast" if what in ("colsum", "var") else "kernel"
        result[f"{what}_ratio"] = result[f"{what}_{fast}"] / result[f"{what}_numpy"]
    result["fused_sum_ratio"] = result["fused_sum_kernel"] / result["fused_sum_numpy"]
    for what, ours in (("sum", "kernel"), ("var", "chunk"), ("rowconst", "kernel")):
        result[f"small_{what}_ratio"] = (
            result[f"small_{what}_numpy"] / result[f"small_{what}_{ours}"]
        )
    return result


def _summary(r: dict[str, float], size_mb: int = SIZE_MB) -> str:
    return "\n".join(
        [
            f"float32 [N, {COLUMNS}], {size_mb} MB in RAM, blocks of {BLOCK_ROWS} rows, one "
            f"thread, best of {REPEAT}",
            f"column sum, float64:     NumPy {r['colsum_numpy']:.2f} GB/s, "
            f"reduce_rows {r['colsum_fast']:.2f} GB/s ({r['colsum_ratio']:.1f}x)",
            f"var(axis=0):             NumPy {r['var_numpy']:.2f} GB/s, "
            f"reduction {r['var_fast']:.2f} GB/s ({r['var_ratio']:.1f}x)",
            f"sqrt(x*2+1).sum(0):      NumPy {r['fused_sum_numpy']:.2f} GB/s, "
            f"FusedReduction {r['fused_sum_kernel']:.2f} GB/s ({r['fused_sum_ratio']:.1f}x)",
            f"sqrt(x*2+1) into out:    NumPy {r['map_numpy']:.2f} GB/s, "
            f"FusedKernel {r['map_kernel']:.2f} GB/s ({r['map_ratio']:.1f}x)",
            f"(x-m)/s into out:        NumPy {r['rowconst_numpy']:.2f} GB/s, "
            f"FusedKernel {r['rowconst_kernel']:.2f} GB/s ({r['rowconst_ratio']:.1f}x)",
            f"per {SMALL_ROWS}-row block, microseconds per call:",
            f"((x+1)*2-3).sum(0):      NumPy {r['small_sum_numpy']:.1f} us, "
            f"FusedReduction {r['small_sum_kernel']:.1f} us ({r['small_sum_ratio']:.1f}x)",
            f"var(axis=0):             NumPy {r['small_var_numpy']:.1f} us, "
            f"chunk {r['small_var_chunk']:.1f} us ({r['small_var_ratio']:.1f}x)",
            f"(x-m)/s into out:        NumPy {r['small_rowconst_numpy']:.1f} us, "
            f"FusedKernel {r['small_rowconst_kernel']:.1f} us ({r['small_rowconst_ratio']:.1f}x)",
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
