"""Pool vs fresh allocation for big temporaries.

Twenty temporaries of 256 MB, each taken, touched (``a[...] = 1``) and given back,
against ``np.empty`` + the same touch. A fresh 256 MB buffer is mapped anew by the
allocator and faults in every page on first touch; a pooled one is already mapped.
Target: ``zero=False`` at least 1.3x faster than fresh (``zero=True`` also pays a fill).

``make bench`` runs it under pytest-benchmark; ``python tests/benchmarks/bench_pool.py``
prints the ratios for docs/benchmarks.md. ``TIERFLOW_BENCH_MB`` sets the size of one
temporary (default 256), ``TIERFLOW_BENCH_COUNT`` how many (default 20).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from tierflow import memory

MB = 1 << 20
SIZE_MB = int(os.environ.get("TIERFLOW_BENCH_MB", "256"))
COUNT = int(os.environ.get("TIERFLOW_BENCH_COUNT", "20"))


def fresh(size_mb: int = SIZE_MB, count: int = COUNT) -> None:
    """``count`` new temporaries of ``size_mb``, each touched once."""
    for _ in range(count):
        a = np.empty(size_mb * MB // 4, np.float32)
        a[...] = 1
        del a


def pooled(p: Any, zero: bool, size_mb: int = SIZE_MB, count: int = COUNT) -> None:
    """The same temporaries taken from, and given back to, pool ``p``."""
    for _ in range(count):
        a = p.take(size_mb * MB // 4, "float32", zero=zero)
        a[...] = 1
        p.give(a)


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def compare(size_mb: int = SIZE_MB, count: int = COUNT, repeat: int = 3) -> dict[str, float]:
    """Best-of-``repeat`` seconds of each variant, and fresh/pooled ratios."""
    p = memory.pool(max_gb=2 * size_mb / 1024)
    pooled(p, False, size_mb, 1)  # the pool's first buffer is as fresh as any
    t_fresh = _best(lambda: fresh(size_mb, count), repeat)
    t_raw = _best(lambda: pooled(p, False, size_mb, count), repeat)
    t_zero = _best(lambda: pooled(p, True, size_mb, count), repeat)
    return {
        "fresh_s": t_fresh,
        "pool_zero_false_s": t_raw,
        "pool_zero_true_s": t_zero,
        "ratio_zero_false": t_fresh / t_raw,
        "ratio_zero_true": t_fresh / t_zero,
    }


def test_fresh(benchmark: Any) -> None:
    benchmark.group = f"pool: {COUNT} x {SIZE_MB} MB temporaries"
    benchmark.pedantic(fresh, rounds=3, iterations=1)


def test_pool_zero_false(benchmark: Any) -> None:
    benchmark.group = f"pool: {COUNT} x {SIZE_MB} MB temporaries"
    p = memory.pool(max_gb=2 * SIZE_MB / 1024)
    benchmark.pedantic(pooled, args=(p, False), rounds=3, iterations=1, warmup_rounds=1)


def test_pool_zero_true(benchmark: Any) -> None:
    benchmark.group = f"pool: {COUNT} x {SIZE_MB} MB temporaries"
    p = memory.pool(max_gb=2 * SIZE_MB / 1024)
    benchmark.pedantic(pooled, args=(p, True), rounds=3, iterations=1, warmup_rounds=1)


def test_pool_vs_fresh_ratio(benchmark: Any) -> None:
    """Both variants in one run, so the ratio compares like with like."""
    benchmark.group = "pool: ratio"
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(_summary(result))


def _summary(r: dict[str, float]) -> str:
    return (
        f"{COUNT} x {SIZE_MB} MB temporaries: fresh {r['fresh_s'] * 1000:.0f} ms, "
        f"pool zero=False {r['pool_zero_false_s'] * 1000:.0f} ms "
        f"({r['ratio_zero_false']:.2f}x, target >= 1.3x), "
        f"pool zero=True {r['pool_zero_true_s'] * 1000:.0f} ms ({r['ratio_zero_true']:.2f}x)"
    )


if __name__ == "__main__":
    print(_summary(compare()))
