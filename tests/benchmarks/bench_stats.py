"""Statistics at memory speed: one-pass var and std against the column sum, same run.

A float32 ``[N, 8]`` ``.npy`` is generated in a temporary folder (default 4 GB: 125,000,000
rows; ``--gb``), its page cache warm, and removed at the end. One child process (so the
figures share one interpreter, one budget and one warm page cache) times, in each round
and in this order:

* ``x.sum(axis=0)`` (the column sum: the speed to reach),
* ``x.var(axis=0)``, ``x.std(axis=0)``,
* ``tw.compute(x.mean(axis=0), x.std(axis=0))`` (the mean from the variance's partials),

each ``.compute()``-d on the default threads executor. The figure of each statistic is
its GB/s over the column sum's GB/s in the same round, median (min-max) over the rounds
(issue 15: at least 0.5x). Checked once at the end: var and std of the whole file against
NumPy's float64 ``var`` over the memory map, blocked by hand (rtol 4 units of float32).

``python tests/benchmarks/bench_stats.py [--gb 4] [--rounds 5] [--dir /tmp] [--json f]``
prints the figures (run anything over 0.5 GB under ``flock /tmp/tierflow-bench.lock``).
``make bench`` runs the pytest-benchmark test below on a small file
(``TIERFLOW_BENCH_STATS_SIZE_MB``, default 64), which checks the results.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's tierflow

from _harness import emit, ensure_warm, make_npy, report_run, run_sampled

MB = 1 << 20
WIDTH = 8
TIMEOUT_S = 1800.0
SIZE_MB = float(os.environ.get("TIERFLOW_BENCH_STATS_SIZE_MB", "64"))
KINDS = ("sum", "var", "std", "mean+std")
PIECE = 1 << 22  # rows of the hand-blocked NumPy check


def _timed(kind: str, x: Any) -> float:
    import tierflow as tw

    start = time.perf_counter()
    if kind == "sum":
        x.sum(axis=0).compute(progress=False)
    elif kind == "var":
        x.var(axis=0).compute(progress=False)
    elif kind == "std":
        x.std(axis=0).compute(progress=False)
    else:
        tw.compute(x.mean(axis=0), x.std(axis=0), progress=False)
    return time.perf_counter() - start


def _reference(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Column mean and variance of the file in float64, by NumPy over the memory map in
    blocks (two passes)."""
    m = np.load(path, mmap_mode="r")
    total = np.zeros(m.shape[1])
    for a in range(0, len(m), PIECE):
        total += m[a : a + PIECE].sum(axis=0, dtype=np.float64)
    mean = total / len(m)
    squares = np.zeros(m.shape[1])
    for a in range(0, len(m), PIECE):
        dev = m[a : a + PIECE].astype(np.float64) - mean
        squares += np.einsum("ij,ij->j", dev, dev)
    return mean, squares / len(m)


def child(path: str, rounds: int) -> None:
    """The measurement (a child process): every statistic, ``rounds`` times."""
    import tierflow as tw

    x = tw.from_npy(path)
    nbytes = os.path.getsize(path)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    _timed("sum", x)  # warms the interpreter's caches and the thread pool
    for _ in range(rounds):
        ensure_warm(path)
        for kind in KINDS:
            times[kind].append(_timed(kind, x))
    mean, var = tw.compute(x.mean(axis=0), x.var(axis=0), progress=False)
    std = x.std(axis=0).compute(progress=False)
    want_mean, want_var = _reference(path)
    tol = 4 * float(np.finfo(np.float32).eps)
    correct = bool(
        np.allclose(var, want_var.astype(np.float32), rtol=tol, atol=0)
        and np.allclose(std, np.sqrt(want_var).astype(np.float32), rtol=tol, atol=0)
        and np.allclose(mean, want_mean.astype(np.float32), rtol=tol, atol=0)
    )
    emit({"bytes": nbytes, "times": times, "correct": correct, "workers": os.cpu_count()})


def bench(size_mb: float, rounds: int, folder: str | None = None) -> dict[str, Any]:
    where = tempfile.mkdtemp(prefix="tierflow-bench-stats-", dir=folder)
    try:
        rows = int(size_mb * MB) // (4 * WIDTH)
        src = str(make_npy(os.path.join(where, "x.npy"), rows, WIDTH))
        ensure_warm(src)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", src, str(rounds)]
        result = run_sampled(cmd, timeout=TIMEOUT_S)
        report = result.figures()
        report["rows"] = rows
        report["returncode"] = result.returncode
        if result.returncode != 0:
            report["error"] = result.stderr[-2000:]
        return report
    finally:
        shutil.rmtree(where, ignore_errors=True)


def ratios(report: dict[str, Any]) -> dict[str, list[float]]:
    """Per statistic, its speed over the column sum's in each round."""
    times = report["times"]
    return {
        k: [s / t for s, t in zip(times["sum"], times[k], strict=True)] for k in KINDS if k != "sum"
    }


def describe(report: dict[str, Any]) -> list[str]:
    if report.get("returncode") != 0:
        return [f"failed: exit {report.get('returncode')} {report.get('error', '')[-500:]}"]
    gb = report["bytes"] / 1e9
    lines = [
        f"{report['rows']:,} rows x {WIDTH} float32 ({gb:.2f} GB), page cache warm, "
        f"{len(report['times']['sum'])} rounds; results correct: {report['correct']}"
    ]
    for kind in KINDS:
        speeds = [gb / t for t in report["times"][kind]]
        lines.append(f"  {kind:>9}: {statistics.median(speeds):5.2f} GB/s (median)")
    for kind, values in ratios(report).items():
        lines.append(
            f"  {kind:>9} / sum: {statistics.median(values):.2f}x "
            f"({min(values):.2f}-{max(values):.2f})"
        )
    return lines


def test_statistics_against_the_column_sum(benchmark: Any) -> None:
    benchmark.group = "engine: var and std against the column sum"
    report = benchmark.pedantic(bench, args=(SIZE_MB, 2), rounds=1, iterations=1)
    print("\n".join(describe(report)))
    assert report["returncode"] == 0, report.get("error")
    assert report["correct"], "var, std or mean differ from NumPy's float64 results"
    benchmark.extra_info.update({k: statistics.median(v) for k, v in ratios(report).items()})


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="file size (4: 125M rows)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the temporary file goes")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    report_run(lambda: bench(args.gb * 1e9 / MB, args.rounds, args.dir), describe, args.json)


if __name__ == "__main__":
    main()
