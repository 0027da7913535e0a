"""Exact quantiles: ``np.median(x, axis=0)`` on a lazy array against NumPy on a memory map,
in a 1 GB cgroup and outside it, and ``da.percentile`` (dask.array) on a column.

The data: a float32 ``[N, 8]`` ``.npy`` of uniform values (default 4 GB: 125,000,000
rows), written into a temporary folder under ``--dir`` and removed at the end. Its pages
are warm (read once first) before each contender.

1. **In a 1 GB memory cgroup** (``--cgroup-mb``): ``np.median(tw.from_npy(path),
   axis=0).compute()`` and ``np.median(np.load(path, mmap_mode="r"), axis=0)``, each in a
   child process of its own inside a real cgroup: whether it completed, its wall time,
   the cgroup's peak and OOM kills. Skipped, with the reason, where no cgroup can be made.
2. **Without a limit**: the same two, each in its own child, alternating, ``--rounds``
   times: wall times, peak RSS and the ratio NumPy / tierflow per round; the two results
   must be equal bit for bit.
3. **Against dask.array on one column**: ``da.percentile(col, [1, 50, 99])`` over the
   memory map's column 0 (chunks of 1,000,000 rows) against tierflow's exact
   ``np.percentile(x[:, 0], [1, 50, 99])``: the time ratio dask / tierflow and dask's
   largest error against the exact answer, in value and in ranks (how many values lie
   between dask's answer and the exact rank, counted exactly).

``python tests/benchmarks/bench_quantiles.py [--gb 4] [--rounds 2] [--only
cgroup,free,dask] [--cgroup-mb 1024] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _harness
sys.path.insert(0, str(HERE.parent))  # cgroups.py
sys.path.insert(0, str(HERE.parent.parent))  # this checkout's tierflow

import _harness  # noqa: E402

WIDTH = 8
PARTS = ("cgroup", "free", "dask")
MB = 1 << 20

CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
import numpy as np
from _harness import peak_rss
which, path, _, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
start = time.perf_counter()
if which == "tierflow":
    import tierflow as tw
    result = np.median(tw.from_npy(path), axis=0).compute(progress=False)
else:
    result = np.median(np.load(path, mmap_mode="r"), axis=0)
seconds = time.perf_counter() - start
np.save(out, result)
print(json.dumps({"seconds": seconds, "peak_rss": peak_rss()}), flush=True)
"""


def _child(which: str, path: Path, out: Path) -> list[str]:
    return [sys.executable, "-c", CHILD, which, str(path), str(HERE), str(out)]


def _figures(stdout: str) -> dict[str, float]:
    for line in reversed(stdout.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def part_cgroup(path: Path, folder: Path, limit_mb: int) -> None:
    from cgroups import memory_cgroup, skip_reason

    reason = skip_reason()
    if reason:
        print(f"1. in a {limit_mb} MB cgroup: not run ({reason})")
        return
    for which in ("tierflow", "numpy"):
        _harness.warm(path)
        out = folder / f"cg-{which}.npy"
        with memory_cgroup(limit_mb * MB) as cg:
            proc = cg.run(_child(which, path, out), timeout=3600)
            peak = cg.peak_bytes()
            kills = cg.oom_kills()
        if proc.returncode == 0:
            got = _figures(proc.stdout)
            what = f"completed in {got['seconds']:.1f} s, peak RSS {int(got['peak_rss']) // MB} MB"
        else:
            tail = proc.stderr.strip().splitlines()[-1:]
            what = f"failed (exit {proc.returncode}{', OOM-killed' if kills else ''}) {tail}"
        peak_text = "?" if peak is None else f"{peak // MB} MB"
        print(
            f"1. {which} in a {limit_mb} MB cgroup: {what}; cgroup peak {peak_text} "
            f"(page cache included), OOM kills {kills}"
        )


def part_free(path: Path, folder: Path, rounds: int) -> None:
    ratios, ours, theirs, our_rss, their_rss = [], [], [], [], []
    for _ in range(rounds):
        runs = {}
        for which in ("tierflow", "numpy"):
            _harness.warm(path)
            out = folder / f"free-{which}.npy"
            run = _harness.run_sampled(_child(which, path, out), timeout=3600)
            if run.returncode != 0:
                raise RuntimeError(f"{which} failed: {run.stderr.strip()[-2000:]}")
            runs[which] = _figures(run.stdout)
        a, b = np.load(folder / "free-tierflow.npy"), np.load(folder / "free-numpy.npy")
        if not np.array_equal(a, b):
            raise AssertionError(f"the medians differ: {a} against {b}")
        ours.append(runs["tierflow"]["seconds"])
        theirs.append(runs["numpy"]["seconds"])
        our_rss.append(runs["tierflow"]["peak_rss"] / MB)
        their_rss.append(runs["numpy"]["peak_rss"] / MB)
        ratios.append(theirs[-1] / ours[-1])
    print(
        f"2. np.median(axis=0), no limit: tierflow {statistics.median(ours):.1f} s "
        f"(peak RSS {max(our_rss):.0f} MB), NumPy on the memory map "
        f"{statistics.median(theirs):.1f} s (peak RSS {max(their_rss):.0f} MB); "
        f"NumPy / tierflow {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}); results equal bit for bit"
    )


def part_dask(path: Path) -> None:
    import dask.array as da

    import tierflow as tw

    q = [1, 50, 99]
    _harness.warm(path)
    start = time.perf_counter()
    exact = np.asarray(np.percentile(tw.from_npy(path)[:, 0], q).compute(progress=False))
    ours = time.perf_counter() - start
    column = np.load(path, mmap_mode="r")[:, 0]
    _harness.warm(path)
    start = time.perf_counter()
    approx = da.percentile(da.from_array(column, chunks=1_000_000), q).compute()
    theirs = time.perf_counter() - start
    error = np.abs(np.asarray(approx, np.float64) - exact.astype(np.float64))
    # How many ranks away dask's answers are: the values below each, counted exactly.
    lazy = tw.from_npy(path)[:, 0]
    below = tw.compute(*[(lazy < v).sum() for v in np.asarray(approx)], progress=False)
    n = len(column)
    wanted = [p / 100 * (n - 1) for p in q]
    off = max(abs(int(b) - w) for b, w in zip(below, wanted, strict=True))
    print(
        f"3. percentiles {q} of column 0: tierflow (exact) {ours:.1f} s, da.percentile "
        f"{theirs:.1f} s; dask / tierflow {theirs / ours:.2f}x; dask's largest error "
        f"{error.max():.3g}, {off:,.0f} ranks ({off / n:.2%} of the column) from the exact "
        f"answer; exact {exact.tolist()}, dask {np.asarray(approx).tolist()}"
    )


def test_median_of_a_small_file(benchmark: Any, tmp_path: Path) -> None:
    """``make bench``: the median of every column of a 6.4 MB file, checked against NumPy."""
    import tierflow as tw

    path = _harness.make_npy(tmp_path / "x.npy", 200_000, WIDTH)
    got = benchmark(lambda: np.median(tw.from_npy(path), axis=0).compute(progress=False))
    np.testing.assert_array_equal(got, np.median(np.load(path), axis=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the file (GB)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--cgroup-mb", type=int, default=1024)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    parts = args.only.split(",")
    rows = int(args.gb * 1e9) // (4 * WIDTH)
    folder = Path(tempfile.mkdtemp(prefix="tierflow-bench-quantiles-", dir=args.dir))
    try:
        path = _harness.make_npy(folder / "x.npy", rows, WIDTH)
        print(f"data: float32 [{rows:,}, {WIDTH}], {rows * WIDTH * 4 / 1e9:.2f} GB")
        if "cgroup" in parts:
            part_cgroup(path, folder, args.cgroup_mb)
        if "free" in parts:
            part_free(path, folder, args.rounds)
        if "dask" in parts:
            part_dask(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
