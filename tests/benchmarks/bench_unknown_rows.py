"""After a boolean mask: what the pass that counts rows per block costs.

A float32 ``[N, 8]`` ``.npy`` is generated in a temporary folder (``--gb``, default 0.5;
1 GB = 2**30 bytes), page cache warm, and removed at the end. The mask keeps the rows
whose first value is above 0 (about half). Each contender is a child process that
times its compute only and checks its answer against NumPy's on the same rows:

* ``sum``: ``x[m].sum(axis=0)``, one pass, no count (the baseline);
* ``count``: ``len(x[m])``, the counting pass alone;
* ``[1:] sum``: ``x[m][1:].sum(axis=0)``: the count, then the sum;
* ``reversed sum``: ``x[m][::-1].sum(axis=0)``: the count, then the sum;
* ``argmax``: ``x[m].argmax(axis=0)``: the count, then the arg-reduction;
* ``persist, reversed sum``: ``x[m].persist()[::-1].sum(axis=0)``, what was needed
  before the count (the masked rows written to RAM or the SSD, then read again);
* ``dask reversed sum``: ``da.from_array(mmap)[m].compute_chunk_sizes()[::-1].sum(0)``.

The contenders run in turns, ``--rounds`` times (default 3); a contender's figure is
its median time over the rounds, divided by the baseline's, in one run. ``python
tests/benchmarks/bench_unknown_rows.py [--gb 0.5] [--rounds 3] [--json f]``; run a
file over 0.5 GB under the benchmark lock (see docs/benchmarks.md).
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

GB = 1 << 30
MB = 1 << 20
WIDTH = 8
TIMEOUT_S = 1800.0
KINDS = (
    "sum",
    "count",
    "[1:] sum",
    "reversed sum",
    "argmax",
    "persist, reversed sum",
    "dask reversed sum",
)


def _expected(kind: str, src: str) -> np.ndarray:
    """NumPy's answer, a block of rows at a time (the file may not fit in RAM)."""
    x = np.load(src, mmap_mode="r")
    if kind == "argmax":
        best = np.full(WIDTH, -np.inf)
        where = np.zeros(WIDTH, np.int64)
        seen = 0
        for s in range(0, len(x), 1 << 22):
            kept = x[s : s + (1 << 22)]
            kept = kept[kept[:, 0] > 0]
            if len(kept):
                top, arg = kept.max(axis=0), kept.argmax(axis=0)
                better = top > best
                best[better], where[better] = top[better], arg[better] + seen
            seen += len(kept)
        return where
    total = np.zeros(WIDTH)
    for s in range(0, len(x), 1 << 22):
        kept = x[s : s + (1 << 22)]
        total += kept[kept[:, 0] > 0].sum(axis=0, dtype=np.float64)
    return total


def child(kind: str, src: str) -> None:
    """One contender (a child process)."""
    import tierflow as tw

    m = Measure()
    m.start()
    if kind == "dask reversed sum":
        import dask.array as da

        d = da.from_array(np.load(src, mmap_mode="r"), chunks=(1 << 20, WIDTH))
        kept = d[d[:, 0] > 0]
        kept.compute_chunk_sizes()
        got = kept[::-1].sum(axis=0, dtype=np.float64).compute()
    else:
        x = tw.from_npy(src)
        kept = x[x[:, 0] > 0]
        if kind == "sum":
            got = kept.sum(axis=0).compute(progress=False)
        elif kind == "count":
            got = len(kept)
        elif kind == "[1:] sum":
            got = kept[1:].sum(axis=0).compute(progress=False)
        elif kind == "reversed sum":
            got = kept[::-1].sum(axis=0).compute(progress=False)
        elif kind == "argmax":
            got = kept.argmax(axis=0).compute(progress=False)
        else:
            got = kept.persist(progress=False)[::-1].sum(axis=0).compute(progress=False)
    m.stop()
    figures = dict(m.figures)
    if kind == "count":
        x = np.load(src, mmap_mode="r")
        want = sum(int((x[s : s + (1 << 22), 0] > 0).sum()) for s in range(0, len(x), 1 << 22))
        figures["correct"] = got == want
    elif kind == "[1:] sum":
        x = np.load(src, mmap_mode="r")
        first = next(x[s : s + (1 << 22)] for s in range(0, len(x), 1 << 22))
        first = first[first[:, 0] > 0][0]
        want = _expected("sum", src) - first
        figures["correct"] = bool(np.allclose(np.asarray(got, np.float64), want, rtol=1e-6))
    else:
        want = _expected("argmax" if kind == "argmax" else "sum", src)
        figures["correct"] = bool(np.allclose(np.asarray(got, np.float64), want, rtol=1e-6))
    emit(figures)


def bench(gb: float, rounds: int) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="tierflow-bench-unknown-rows-")
    try:
        rows = int(gb * GB) // (4 * WIDTH)
        src = str(make_npy(os.path.join(folder, "x.npy"), rows, WIDTH))
        report: dict[str, Any] = {"rows": rows, "bytes": os.path.getsize(src)}
        runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for _ in range(rounds):
            for kind in KINDS:
                ensure_warm(src)
                cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, src]
                result = run_sampled(cmd, timeout=TIMEOUT_S)
                figures = result.figures()
                figures["returncode"] = result.returncode
                if result.returncode != 0:
                    figures["error"] = result.stderr[-2000:]
                runs[kind].append(figures)
        for kind, done in runs.items():
            failed = [r for r in done if r["returncode"] != 0]
            if failed:
                report[kind] = failed[0]
                continue
            report[kind] = {
                "returncode": 0,
                "seconds": float(np.median([r["seconds"] for r in done])),
                "peak_rss": max(r["peak_rss"] for r in done),
                "correct": all(r.get("correct") for r in done),
            }
        return report
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def describe(report: dict[str, Any]) -> list[str]:
    lines = [f"{report['rows']:,} rows x {WIDTH} float32 ({report['bytes'] / GB:.2f} GB)"]
    base = report["sum"].get("seconds")
    for kind in KINDS:
        r = report[kind]
        if r.get("returncode") != 0:
            lines.append(f"  {kind}: exit {r['returncode']} {r.get('error', '')[-300:]}")
            continue
        ratio = f"{r['seconds'] / base:.2f}x the sum" if base else ""
        lines.append(
            f"  {kind}: {r['seconds']:.2f} s ({ratio}), peak RSS {r['peak_rss'] / MB:,.0f} MB, "
            f"correct {r.get('correct')}"
        )
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    report_run(lambda: bench(args.gb, args.rounds), describe, args.json)


if __name__ == "__main__":
    main()
