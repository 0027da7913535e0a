"""Sorting the rows of the issue's file by one column into a new ``.npy``, with bounded
memory, against NumPy.

The file is float32 ``[125_000_000, 8]`` (4 GB; ``--gb`` scales the rows). Each
contender runs in a child process, sampled every 20 ms (:mod:`_harness`):

1. **tierflow in a 1 GB memory cgroup**: ``tw.sort_rows(tw.from_npy(src), by=0)
   .to_npy(dst)``, an external merge sort (runs spilled to the SSD). It must complete;
   the cgroup's peak and the child's peak RSS are reported.
2. **NumPy, no limit**: ``np.sort`` of column 0 of the memory map (the values of one
   column only: a copy of the column and its sorted copy in RAM), and the row sort a
   NumPy user writes, ``a[np.argsort(a[:, 0], kind="stable")]`` saved with ``np.save``
   (the order, and the whole sorted array, in RAM).

Ratios are of one run. The output of 1 is checked: column 0 equals ``np.sort`` of the
input's, every column's sum is the input's (rows were moved, not changed).

    flock /tmp/tierflow-bench.lock /work/main/.venv/bin/python tests/benchmarks/bench_sort.py --gb 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _harness import ChildRun, make_npy, run_sampled  # noqa: E402

ROWS_4GB = 125_000_000
WIDTH = 8
LIMIT_MB = 1024

CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from _harness import Measure, emit
which, src, dst = sys.argv[2:5]
m = Measure()
if which == "tierflow":
    import tierflow as tw
    x = tw.from_npy(src)
    m.start()
    tw.sort_rows(x, by=0).to_npy(dst, progress=False)
elif which == "numpy-column":
    a = np.load(src, mmap_mode="r")
    m.start()
    column = np.sort(a[:, 0])
elif which == "numpy-rows":
    a = np.load(src, mmap_mode="r")
    m.start()
    order = np.argsort(a[:, 0], kind="stable")
    np.save(dst, np.take(a, order, axis=0))
m.stop()
emit(m.figures)
"""


def run_child(which: str, src: Path, dst: Path, env: dict[str, str], wrap: Any = None) -> ChildRun:
    cmd = [sys.executable, "-c", CHILD, str(HERE), which, str(src), str(dst)]
    return run_sampled(cmd, timeout=1500, wrap=wrap, env=env)


def describe_run(run: ChildRun) -> tuple[float | None, str]:
    """Seconds of the measured part (None when it failed) and a line about it."""
    figures = run.figures()
    if run.returncode != 0 or "seconds" not in figures:
        tail = run.stderr.strip().splitlines()[-1:] if run.stderr.strip() else []
        return None, f"failed (exit {run.returncode}): {tail}"
    window = run.window(figures.get("started_at"), figures.get("stopped_at"))
    anon = max((s.anon for s in window), default=0)
    seconds = float(figures["seconds"])
    return seconds, (
        f"{seconds:.1f} s, peak RSS {figures['peak_rss'] >> 20} MB (anonymous {anon >> 20} MB)"
    )


def check_output(src: Path, dst: Path) -> str:
    """Column 0 of ``dst`` is ``np.sort`` of ``src``'s; every column sums as ``src``'s."""
    a = np.load(src, mmap_mode="r")
    b = np.load(dst, mmap_mode="r")
    assert b.shape == a.shape and b.dtype == a.dtype
    expected = np.sort(a[:, 0])
    step = 1 << 22
    sums_a = np.zeros(WIDTH)
    sums_b = np.zeros(WIDTH)
    for start in range(0, len(a), step):
        block = np.asarray(b[start : start + step])
        assert np.array_equal(block[:, 0], expected[start : start + step])
        sums_b += block.sum(axis=0, dtype=np.float64)
        sums_a += np.asarray(a[start : start + step]).sum(axis=0, dtype=np.float64)
    np.testing.assert_allclose(sums_b, sums_a, rtol=1e-9)
    return "checked: column 0 sorted as np.sort, column sums unchanged"


def part_cgroup(src: Path, dst: Path, env: dict[str, str]) -> float | None:
    from cgroups import memory_cgroup, skip_reason

    reason = skip_reason()
    if reason:
        print(f"1. tierflow in a {LIMIT_MB} MB cgroup: not run ({reason})")
        return None
    with memory_cgroup(LIMIT_MB << 20) as cg:
        run = run_child("tierflow", src, dst, env, wrap=cg.wrap)
        peak = cg.peak_bytes()
        kills = cg.oom_kills()
    seconds, text = describe_run(run)
    peak_text = "?" if peak is None else f"{peak >> 20} MB"
    print(
        f"1. tierflow sort_rows(by=0).to_npy in a {LIMIT_MB} MB cgroup: {text}; "
        f"cgroup peak {peak_text} (page cache included), OOM kills {kills}"
    )
    if seconds is not None:
        print(f"   {check_output(src, dst)}")
    return seconds


def bench(gb: float, numpy_rows: bool = True) -> dict[str, Any]:
    """Every part on a file of ``gb`` GB; prints its lines and returns the seconds of
    each contender (None where it failed or did not run) and the spill files left."""
    rows = int(ROWS_4GB * gb / 4)
    folder = Path(tempfile.mkdtemp(prefix="bench-sort-", dir="/tmp"))
    report: dict[str, Any] = {}
    try:
        src = make_npy(folder / "x.npy", rows, WIDTH)
        env = dict(os.environ, TIERFLOW_SPILL_DIR=str(folder / "spill"))
        print(f"file: float32 [{rows:,}, {WIDTH}], {src.stat().st_size / 1e9:.2f} GB")
        ours = report["tierflow"] = part_cgroup(src, folder / "tw.npy", env)
        left = [f for _, _, files in os.walk(folder / "spill") for f in files]
        report["left"] = len(left)
        print(f"   spill files left after the sort: {len(left)}")
        (folder / "tw.npy").unlink(missing_ok=True)
        column_s, column = describe_run(run_child("numpy-column", src, folder / "-", env))
        report["numpy-column"] = column_s
        print(f"2. np.sort(np.load(mmap)[:, 0]), no limit: {column}")
        rows_s = None
        if numpy_rows:
            rows_s, text = describe_run(run_child("numpy-rows", src, folder / "np.npy", env))
            print(f"3. a[np.argsort(a[:, 0], kind='stable')] saved, no limit: {text}")
        report["numpy-rows"] = rows_s
        if ours is not None and column_s is not None:
            print(f"   tierflow / np.sort of the column: {ours / column_s:.1f}x the time")
        if ours is not None and rows_s is not None:
            print(f"   tierflow / NumPy's row sort: {ours / rows_s:.2f}x the time")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return report


def test_sort_rows_of_a_file(benchmark: Any) -> None:
    from cgroups import skip_reason

    benchmark.group = "engine: sorting along the rows"
    report = benchmark.pedantic(bench, args=(0.05,), rounds=1, iterations=1)
    if skip_reason() is None:
        assert report["tierflow"] is not None, "tierflow's sort failed in the cgroup"
    assert report["left"] == 0 and report["numpy-rows"] is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="file size (4: 125M rows of 8)")
    parser.add_argument("--no-numpy-rows", action="store_true", help="skip NumPy's row sort")
    args = parser.parse_args()
    bench(args.gb, not args.no_numpy_rows)


if __name__ == "__main__":
    main()
