"""Counting: ``np.unique`` of a column of a 4 GB file, tierflow against NumPy and dask.array.

The data: a float32 ``[N, 8]`` ``.npy`` of uniform values in [0, 1) (default
125,000,000 rows, 4 GB; ``--gb`` scales it), written with ``_harness.make_npy`` into a
temporary folder under ``--dir``, read once into the page cache, and removed at the end.

1. **A rounded column** (few distinct values): ``np.unique(np.round(x[:, 0], 2),
   return_counts=True)`` (101 values).

   - tierflow inside a memory cgroup of ``--cgroup-mb`` (default 1024) MB: whether it
     completes, its time, the child's peak RSS and the cgroup's peak;
   - tierflow, NumPy on the memory map (``np.unique(np.round(mm[:, 0], 2),
     return_counts=True)``, which makes the column in RAM) and dask.array's
     ``da.unique(da.round(d[:, 0], 2), return_counts=True)`` (``from_array`` over the
     memory map, 1,048,576-row chunks), each in its own child process outside the cgroup,
     one after the other: times, peaks, and the ratios NumPy / tierflow and
     dask / tierflow of this run. NumPy also runs inside the cgroup, for the record.

2. **Every value of a column** (``--only distinct``; many distinct values: about 16
   million floats): ``np.unique(x[:, 0], return_counts=True)``, tierflow in the cgroup
   (the distinct values outgrow a sixteenth of the budget, so they spill to partition
   files) against NumPy outside it.

Every run's result is checked against the others (number of distinct values, total
count, and the count-weighted sum of the values).

``python tests/benchmarks/bench_counting.py [--gb 4] [--only rounded,distinct]
[--cgroup-mb 1024] [--dir DIR]``; above 0.5 GB run it under the machine's benchmark lock
(``flock /tmp/tierflow-bench.lock ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: cgroups.py
sys.path.insert(0, str(HERE))  # _harness

from _harness import ensure_warm, make_npy  # noqa: E402

WIDTH = 8
PARTS = ("rounded", "distinct")

CHILD = """
import sys
sys.path.insert(0, sys.argv[4])
import numpy as np
from _harness import Measure, emit
which, path, what = sys.argv[1], sys.argv[2], sys.argv[3]
m = Measure()
if which == "tierflow":
    import tierflow as tw
    x = tw.from_npy(path)
    column = np.round(x[:, 0], 2) if what == "rounded" else x[:, 0]
    m.start()
    values, counts = tw.compute(*np.unique(column, return_counts=True), progress=False)
elif which == "numpy":
    mm = np.load(path, mmap_mode="r")
    m.start()
    column = np.round(mm[:, 0], 2) if what == "rounded" else np.array(mm[:, 0])
    values, counts = np.unique(column, return_counts=True)
else:
    import dask
    import dask.array as da
    mm = np.load(path, mmap_mode="r")
    d = da.from_array(mm, chunks=(1 << 20, mm.shape[1]))
    m.start()
    column = da.round(d[:, 0], 2) if what == "rounded" else d[:, 0]
    values, counts = dask.compute(*da.unique(column, return_counts=True))
m.stop(
    distinct=len(values), total=int(counts.sum()),
    weighted=float(np.dot(values.astype(np.float64), counts)),
)
emit(m.figures)
"""


def run_child(which: str, path: Path, what: str, cgroup_mb: int | None) -> dict[str, Any]:
    """One contender in a child process (inside a fresh memory cgroup of ``cgroup_mb``
    when given); its figures, with ``error`` when it failed and the cgroup's peak."""
    cmd = [sys.executable, "-c", CHILD, which, str(path), what, str(HERE)]
    if cgroup_mb is None:
        import subprocess

        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        return _figures(proc.returncode, proc.stdout, proc.stderr)
    from cgroups import memory_cgroup, skip_reason

    reason = skip_reason()
    if reason:
        return {"error": f"not run: {reason}"}
    with memory_cgroup(cgroup_mb << 20) as cg:
        proc = cg.run(cmd, timeout=3600)
        figures = _figures(proc.returncode, proc.stdout, proc.stderr)
        figures["cgroup_peak"] = cg.peak_bytes()
        figures["oom_kills"] = cg.oom_kills()
    return figures


def _figures(returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for line in reversed(stdout.strip().splitlines()):
        try:
            figures = json.loads(line)
            break
        except ValueError:
            continue
    if returncode != 0 or "seconds" not in figures:
        tail = stderr.strip().splitlines()[-1:] or [f"exit {returncode}"]
        figures["error"] = f"exit {returncode}: {tail[0][:200]}"
    return figures


def _text(name: str, f: dict[str, Any]) -> str:
    if "error" in f:
        extra = f", OOM kills {f['oom_kills']}" if f.get("oom_kills") else ""
        return f"   {name}: failed ({f['error']}){extra}"
    cgroup = f", cgroup peak {f['cgroup_peak'] >> 20} MB" if f.get("cgroup_peak") else ""
    return (
        f"   {name}: {f['seconds']:.2f} s, peak RSS {f['peak_rss'] >> 20} MB{cgroup}; "
        f"{f['distinct']:,} distinct values"
    )


def _agree(runs: dict[str, dict[str, Any]]) -> None:
    done = {
        k: (f["distinct"], f["total"], f["weighted"]) for k, f in runs.items() if "error" not in f
    }
    first = next(iter(done.values()), None)
    for name, got in done.items():
        assert got[:2] == first[:2], (name, got, first)  # type: ignore[index]
        assert abs(got[2] - first[2]) <= 1e-9 * abs(first[2]) + 1e-6, (name, got, first)  # type: ignore[index]


def part(
    path: Path, what: str, base_name: str, contenders: list[tuple[str, str, int | None]]
) -> dict[str, Any]:
    title = "np.round(x[:, 0], 2)" if what == "rounded" else "x[:, 0]"
    print(f"{'1' if what == 'rounded' else '2'}. np.unique({title}, return_counts=True)")
    runs: dict[str, dict[str, Any]] = {}
    for name, which, limit in contenders:
        runs[name] = run_child(which, path, what, limit)
        print(_text(name, runs[name]), flush=True)
    _agree(runs)
    base = runs[base_name]
    for name, f in runs.items():
        if name != base_name and "error" not in f and "error" not in base:
            print(f"   {name} / {base_name}: {f['seconds'] / base['seconds']:.2f}x the time")
    return runs


def bench(
    gb: float, parts: set[str], cgroup_mb: int | None, where: str | None = None
) -> dict[str, Any]:
    """Write the file, run the parts (``cgroup_mb`` None: no cgroup runs), remove the
    file; the figures of every run, by part and contender."""
    rows = int(gb * 1e9) // (4 * WIDTH)  # 10^9 bytes: --gb 4 is [125M, 8]
    folder = Path(tempfile.mkdtemp(prefix="tierflow-bench-counting-", dir=where))
    print(f"{os.cpu_count()} cores; {rows:,} x {WIDTH} float32 ({rows * WIDTH * 4 / 1e9:.2f} GB)")
    report: dict[str, Any] = {"rows": rows}
    try:
        path = folder / "x.npy"
        start = time.perf_counter()
        make_npy(path, rows, WIDTH)
        print(f"   written in {time.perf_counter() - start:.1f} s; cached {ensure_warm(path):.0%}")
        in_cgroup = f"tierflow in a {cgroup_mb} MB cgroup"
        caged = [] if cgroup_mb is None else [(in_cgroup, "tierflow", cgroup_mb)]
        if "rounded" in parts:
            numpy_caged = (
                []
                if cgroup_mb is None
                else [(f"numpy in a {cgroup_mb} MB cgroup", "numpy", cgroup_mb)]
            )
            report["rounded"] = part(
                path, "rounded", "tierflow",
                [*caged, ("tierflow", "tierflow", None), ("numpy", "numpy", None),
                 ("dask.array", "dask", None), *numpy_caged],
            )  # fmt: skip
        if "distinct" in parts:
            report["distinct"] = part(
                path, "distinct", in_cgroup if caged else "tierflow",
                [*(caged or [("tierflow", "tierflow", None)]), ("numpy", "numpy", None)],
            )  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return report


def test_unique_of_a_column(benchmark: Any) -> None:
    benchmark.group = "engine: np.unique of a column"
    report = benchmark.pedantic(bench, args=(0.02, set(PARTS), None), rounds=1, iterations=1)
    for name in PARTS:
        for contender, figures in report[name].items():
            assert "error" not in figures, (name, contender, figures["error"])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="file size in 10^9 bytes")
    parser.add_argument("--only", default="rounded")
    parser.add_argument("--cgroup-mb", type=int, default=1024, help="0: no cgroup runs")
    parser.add_argument("--dir", default=None)
    options = parser.parse_args()
    bench(options.gb, set(options.only.split(",")), options.cgroup_mb or None, options.dir)
    print(json.dumps({"load_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
