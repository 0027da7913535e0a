"""Rows picked in random order (a shuffle) of a file bigger than a container's memory.

A float32 ``[N, 8]`` ``.npy`` is generated in a temporary folder (default 1024 MB; 1 MB
= 2**20 bytes), page cache warm, and removed at the end. Each contender is a child
process that draws the same permutation of the rows and writes the shuffled rows to a
new ``.npy``; it times that part only (not the interpreter's start or the draw):

* tierflow: ``tw.from_npy(path)[perm].to_npy(out)``;
* NumPy: ``np.load(path, mmap_mode="r")`` gathered 1,048,576 rows of ``perm`` at a
  time into an ``np.lib.format.open_memmap`` output (what one writes by hand to keep
  memory flat).

Both run unconstrained and inside a memory cgroup (``--cgroup-mb``, default 1024; skipped
with the reason where none can be made). The figure is NumPy's time over tierflow's,
in one run; the output of both must equal ``x[perm]``. ``python
tests/benchmarks/bench_take.py [--size-mb 1024] [--cgroup-mb 1024] [--json f]`` prints
the figures. ``make bench`` runs the pytest-benchmark test below on a small file
(``TIERFLOW_BENCH_TAKE_SIZE_MB``, default 32), which checks the outputs only.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Measure, emit, ensure_warm, make_npy, report_run, run_sampled

MB = 1 << 20
WIDTH = 8
PIECE = 1 << 20  # rows NumPy gathers at a time
TIMEOUT_S = 1800.0
SIZE_MB = float(os.environ.get("TIERFLOW_BENCH_TAKE_SIZE_MB", "32"))
KINDS = ("tierflow", "numpy")


def _permutation(n: int) -> np.ndarray:
    return np.random.default_rng(1).permutation(n)


def child(kind: str, src: str, out: str) -> None:
    """One contender (a child process): shuffle ``src`` into ``out``."""
    import tierflow as tw  # imported before the clock starts, as NumPy is

    m = Measure()
    perm = _permutation(np.load(src, mmap_mode="r").shape[0])
    m.start()
    if kind == "tierflow":
        tw.from_npy(src)[perm].to_npy(out, progress=False)
    else:
        x = np.load(src, mmap_mode="r")
        y = np.lib.format.open_memmap(out, mode="w+", dtype=x.dtype, shape=x.shape)
        for start in range(0, len(perm), PIECE):
            y[start : start + PIECE] = x[perm[start : start + PIECE]]
        y.flush()
        del y
    m.stop()
    emit(m.figures)


def check(src: str, out: str) -> bool:
    """Whether ``out`` holds the rows of ``src`` in the permutation's order."""
    x = np.load(src, mmap_mode="r")
    y = np.load(out, mmap_mode="r")
    perm = _permutation(len(x))
    return y.shape == x.shape and all(
        np.array_equal(y[s : s + PIECE], x[perm[s : s + PIECE]]) for s in range(0, len(x), PIECE)
    )


def run(kind: str, src: str, folder: str, wrap: Any = None) -> dict[str, Any]:
    out = os.path.join(folder, f"{kind}.npy")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, src, out]
    result = run_sampled(cmd, wrap=wrap, timeout=TIMEOUT_S)
    figures = result.figures()
    figures["returncode"] = result.returncode
    if result.returncode == 0 and "seconds" in figures:
        figures["correct"] = check(src, out)
    else:
        figures["error"] = result.stderr[-2000:]
    measured = result.window(figures.get("started_at"), figures.get("stopped_at"))
    figures["anon_peak"] = max((s.anon for s in measured), default=None)
    if os.path.exists(out):
        os.unlink(out)
    return figures


def bench(size_mb: float, cgroup_mb: int | None) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="tierflow-bench-take-")
    try:
        rows = int(size_mb * MB) // (4 * WIDTH)
        src = str(make_npy(os.path.join(folder, "x.npy"), rows, WIDTH))
        report: dict[str, Any] = {"rows": rows, "bytes": os.path.getsize(src)}
        for kind in KINDS:
            ensure_warm(src)
            report[kind] = run(kind, src, folder)
        if cgroup_mb:
            try:
                from cgroups import memory_cgroup

                for kind in KINDS:
                    ensure_warm(src)
                    with memory_cgroup(cgroup_mb * MB) as cg:
                        figures = run(kind, src, folder, wrap=cg.wrap)
                        figures["oom_kills"] = cg.oom_kills()
                    report[f"{kind} in cgroup"] = figures
            except Exception as exc:  # no cgroup here: say why, keep the other figures
                report["cgroup_skipped"] = f"{type(exc).__name__}: {exc}"
        return report
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def describe(report: dict[str, Any]) -> list[str]:
    lines = [f"{report['rows']:,} rows x {WIDTH} float32 ({report['bytes'] / MB:,.0f} MB)"]
    for where in ("", " in cgroup"):
        runs = [report.get(k + where) for k in KINDS]
        for kind, r in zip(KINDS, runs, strict=True):
            if r is None:
                continue
            if r.get("returncode") != 0:
                lines.append(f"  {kind}{where}: exit {r['returncode']} {r.get('error', '')[-200:]}")
                continue
            lines.append(
                f"  {kind}{where}: {r['seconds']:.2f} s, peak RSS {r['peak_rss'] / MB:,.0f} MB, "
                f"anonymous {(r['anon_peak'] or 0) / MB:,.0f} MB, correct {r.get('correct')}"
            )
        ours, theirs = runs
        if ours and theirs and ours.get("returncode") == 0 and theirs.get("returncode") == 0:
            lines.append(
                f"  ratio{where}: NumPy / tierflow = {theirs['seconds'] / ours['seconds']:.2f}x"
            )
    if "cgroup_skipped" in report:
        lines.append(f"  cgroup runs skipped: {report['cgroup_skipped']}")
    return lines


def test_shuffle_of_a_file(benchmark: Any) -> None:
    benchmark.group = "engine: rows picked in random order"
    report = benchmark.pedantic(bench, args=(SIZE_MB, None), rounds=1, iterations=1)
    print("\n".join(describe(report)))
    for kind in KINDS:
        assert report[kind]["returncode"] == 0, report[kind].get("error")
        assert report[kind]["correct"], f"{kind} wrote the wrong rows"
    benchmark.extra_info.update({k: report[k]["seconds"] for k in KINDS})


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024.0)
    parser.add_argument("--cgroup-mb", type=int, default=1024, help="0: no cgroup runs")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    report_run(lambda: bench(args.size_mb, args.cgroup_mb or None), describe, args.json)


if __name__ == "__main__":
    main()
