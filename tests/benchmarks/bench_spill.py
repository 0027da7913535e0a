"""Spill write throughput: a memory.array forced to the SSD vs a plain sequential write.

The spill side is what a user pays: ``memory.array`` (mkstemp, ``posix_fallocate``,
mapping), a sequential fill in 64 MB row blocks, ``flush()`` (msync) to the disk, then
``memory.free``. The plain side writes the same bytes with ``write()`` in 64 MB blocks to
a file on the same filesystem, then ``fsync``. Target: spill at least 0.7x the plain
write's throughput.

``make bench`` runs it under pytest-benchmark; ``python tests/benchmarks/bench_spill.py``
prints the figures for docs/benchmarks.md. ``TIERFLOW_BENCH_SPILL_MB`` sets the size
(default 2048). Files go to the spill folder (``TIERFLOW_SPILL_DIR``).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import numpy as np

from tierflow import config, memory
from tierflow.storage import spill

MB = 1 << 20
SIZE_MB = int(os.environ.get("TIERFLOW_BENCH_SPILL_MB", "2048"))
BLOCK = 64 * MB


def spill_write(size_mb: int = SIZE_MB) -> None:
    """Fill a spill-backed array of ``size_mb`` sequentially and write it to the disk."""
    with config.set(ram_budget="1MB"):  # forces the SSD
        x = memory.array((size_mb * MB // 4,), "float32")
    assert memory.on_disk(x)
    step = BLOCK // 4
    for start in range(0, x.shape[0], step):
        x[start : start + step] = 1.0
    x.flush()
    memory.free(x)


def plain_write(size_mb: int = SIZE_MB) -> None:
    """Write the same bytes with write() to a file in the same folder, then fsync."""
    block = np.ones(BLOCK // 4, np.float32)
    fd, path = tempfile.mkstemp(dir=spill.process_dir(), suffix=".plain")
    try:
        left = size_mb * MB
        with os.fdopen(fd, "wb", buffering=0) as f:
            while left > 0:
                n = min(left, BLOCK)
                f.write(memoryview(block).cast("B")[:n])
                left -= n
            os.fsync(f.fileno())
    finally:
        os.unlink(path)


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def compare(size_mb: int = SIZE_MB, repeat: int = 3) -> dict[str, float]:
    """Best-of-``repeat`` seconds and GB/s of each, and spill/plain throughput ratio."""
    t_plain = _best(lambda: plain_write(size_mb), repeat)
    t_spill = _best(lambda: spill_write(size_mb), repeat)
    gb = size_mb / 1024
    return {
        "size_mb": float(size_mb),
        "plain_s": t_plain,
        "spill_s": t_spill,
        "plain_gb_s": gb / t_plain,
        "spill_gb_s": gb / t_spill,
        "ratio": t_plain / t_spill,
    }


def test_plain_write(benchmark: Any) -> None:
    benchmark.group = f"spill: sequential write of {SIZE_MB} MB"
    benchmark.pedantic(plain_write, rounds=3, iterations=1)


def test_spill_write(benchmark: Any) -> None:
    benchmark.group = f"spill: sequential write of {SIZE_MB} MB"
    benchmark.pedantic(spill_write, rounds=3, iterations=1)


def test_spill_vs_plain_ratio(benchmark: Any) -> None:
    """Both in one run, so the ratio compares like with like."""
    benchmark.group = "spill: ratio"
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(_summary(result))


def _summary(r: dict[str, float]) -> str:
    return (
        f"sequential write of {r['size_mb']:.0f} MB: plain write+fsync "
        f"{r['plain_gb_s']:.2f} GB/s, memory.array on the SSD + flush "
        f"{r['spill_gb_s']:.2f} GB/s ({r['ratio']:.2f}x, target >= 0.7x)"
    )


if __name__ == "__main__":
    print(_summary(compare()))
