"""tierflow against the disk: a column sum of a file bigger than RAM read cold, against
``cat``, and a standardised copy written with ``to_npy``, against a plain write.

``cold``: a float32 ``[N, 8]`` ``.npy`` of ``--gb`` (default 30: bigger than this
machine's 24 GB of RAM, so no run finds it cached) is generated in ``--dir`` and
removed at the end. In each round, alternating, its page cache is dropped, then
``cat file > /dev/null`` reads it (the disk's sequential read speed, what any reader
must wait for), then the cache is dropped again and a fresh process computes
``tw.from_npy(path).sum(axis=0)`` (default settings: threads, the default budget, jit
on). The figure is cat's time over tierflow's in the same round (1: tierflow reads at
the disk's speed), median (min-max) of the rounds; tierflow's peak RSS is reported
beside it.

``write``: from a warm float32 ``[N, 8]`` file of ``--write-gb`` (default 4), a fresh
process writes ``((x - m) / s).to_npy(out)`` (``m`` and ``s`` computed first, apart,
as a user would: ``tw.compute(x.mean(0), x.std(0))``), then ``fsync`` of the output;
against a process that writes the same number of bytes from one 64 MB buffer with
``write``, then ``fsync`` (``plain``: the whole write-back waits for the ``fsync``), and
one that also starts each piece's write-back as it goes (``streaming``:
``sync_file_range``, as tierflow's ``to_npy`` does; the disk's sequential write speed).
Each starts its clock after an ``os.sync()``, so that no other file's dirty pages are in
its figure. Alternating, each output
removed before the next run. The figures are each writer's time over tierflow's.

``python tests/benchmarks/bench_disk.py [--gb 30] [--write-gb 4] [--rounds 2]
[--dir /tmp] [--only cold,write] [--json f]``; run it under
``flock /tmp/tierflow-bench.lock`` on a quiet machine. ``make bench`` runs the
pytest-benchmark test below on small files (results checked, figures recorded; the
cache holds them, so its ratios say nothing of the disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's tierflow

from _harness import drop_cache, ensure_warm, make_npy, report_run, run_sampled

WIDTH = 8
TIMEOUT_S = 3600.0
PIECE = 64 << 20  # the plain writer's buffer

_CHILD_SUM = r"""
import json, sys, time
import numpy as np
import tierflow as tw
start = time.perf_counter()
total = tw.from_npy(sys.argv[1]).sum(axis=0).compute(progress=False)
seconds = time.perf_counter() - start
with open("/proc/self/status") as f:
    peak = [int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM")][0]
print(json.dumps({"seconds": seconds, "peak_rss": peak, "total": np.asarray(total, float).tolist()}))
"""

_CHILD_STANDARDISE = r"""
import json, os, sys, time
import numpy as np
import tierflow as tw
x = tw.from_npy(sys.argv[1])
m, s = tw.compute(x.mean(axis=0), x.std(axis=0), progress=False)
os.sync()  # nothing else's dirty pages in the figure
start = time.perf_counter()
((x - m) / s).to_npy(sys.argv[2], progress=False)
fd = os.open(sys.argv[2], os.O_RDONLY)
os.fsync(fd)
os.close(fd)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

_CHILD_WRITE = r"""
import ctypes, json, os, sys, time
import numpy as np
size, piece, streaming = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "streaming"
buffer = np.random.default_rng(0).random(piece // 4, dtype=np.float32).tobytes()
sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
os.sync()  # nothing else's dirty pages in the figure
start = time.perf_counter()
with open(sys.argv[1], "wb", buffering=0) as f:
    done = 0
    while done < size:
        n = f.write(memoryview(buffer)[: min(piece, size - done)])
        if streaming:  # start this piece's write-back now (SYNC_FILE_RANGE_WRITE)
            sync_file_range(f.fileno(), done, n, 2)
        done += n
    os.fsync(f.fileno())
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def _child(code: str, *args: str) -> dict[str, Any]:
    run = run_sampled([sys.executable, "-c", code, *args], timeout=TIMEOUT_S)
    if run.returncode != 0:
        raise RuntimeError(f"child failed ({run.returncode}): {run.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return found


def _cat(path: str) -> float:
    start = time.perf_counter()
    with open(os.devnull, "wb") as null:
        subprocess.run(["cat", path], stdout=null, check=True, timeout=TIMEOUT_S)
    return time.perf_counter() - start


def cold(folder: str, gb: float, rounds: int) -> dict[str, Any]:
    """cat against tierflow's sum, the file's cache dropped before each."""
    rows = int(gb * 1e9) // (4 * WIDTH)
    path = str(make_npy(os.path.join(folder, "cold.npy"), rows, WIDTH))
    found: dict[str, Any] = {"bytes": os.path.getsize(path), "cat": [], "tierflow": []}
    for _ in range(rounds):
        drop_cache(path)
        found["cat"].append(_cat(path))
        drop_cache(path)
        run = _child(_CHILD_SUM, path)
        found["tierflow"].append(run["seconds"])
        found["peak_rss"] = max(found.get("peak_rss", 0), run["peak_rss"])
        found["total"] = run["total"]
    os.unlink(path)
    return found


def write(folder: str, gb: float, rounds: int) -> dict[str, Any]:
    """A plain sequential write against tierflow's standardised to_npy, same bytes."""
    rows = int(gb * 1e9) // (4 * WIDTH)
    path = str(make_npy(os.path.join(folder, "in.npy"), rows, WIDTH))
    out = os.path.join(folder, "out.npy")
    found: dict[str, Any] = {
        "bytes": os.path.getsize(path), "plain": [], "streaming": [], "tierflow": []
    }  # fmt: skip
    for _ in range(rounds):
        for how in ("plain", "streaming"):
            ensure_warm(path)
            args = (out, str(found["bytes"]), str(PIECE), how)
            found[how].append(_child(_CHILD_WRITE, *args)["seconds"])
            os.unlink(out)
        ensure_warm(path)
        found["tierflow"].append(_child(_CHILD_STANDARDISE, path, out)["seconds"])
        got = np.load(out, mmap_mode="r")
        found["checked"] = bool(got.shape == (rows, WIDTH) and np.isfinite(got[:1000]).all())
        del got
        os.unlink(out)
    return found


def bench(gb: float, write_gb: float, rounds: int, only: set[str], folder: str | None) -> Any:
    where = tempfile.mkdtemp(prefix="tierflow-bench-disk-", dir=folder)
    try:
        report: dict[str, Any] = {}
        if "cold" in only:
            report["cold"] = cold(where, gb, rounds)
        if "write" in only:
            report["write"] = write(where, write_gb, rounds)
        return report
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def describe(report: dict[str, Any]) -> list[str]:
    lines = []
    if "cold" in report:
        c = report["cold"]
        r = _ratios(c["cat"], c["tierflow"])
        gb = c["bytes"] / 1e9
        lines.append(
            f"cold sum of {gb:.1f} GB: {statistics.median(r):.2f}x cat's speed "
            f"({', '.join(f'{x:.2f}' for x in r)}; cat {gb / statistics.median(c['cat']):.2f} "
            f"GB/s, tierflow {gb / statistics.median(c['tierflow']):.2f} GB/s; target 0.95x); "
            f"tierflow's peak RSS {c['peak_rss'] / 2**20:,.0f} MB"
        )
    if "write" in report:
        w = report["write"]
        gb = w["bytes"] / 1e9
        for how in ("plain", "streaming"):
            r = _ratios(w[how], w["tierflow"])
            lines.append(
                f"standardise {gb:.1f} GB to_npy: {statistics.median(r):.2f}x a {how} write's "
                f"speed ({', '.join(f'{x:.2f}' for x in r)}; {how} "
                f"{gb / statistics.median(w[how]):.2f} GB/s, tierflow "
                f"{gb / statistics.median(w['tierflow']):.2f} GB/s; target 0.9x)"
            )
        lines.append(f"  output checked: {w['checked']}")
    return lines


def test_disk_figures_on_small_files(benchmark: Any) -> None:
    benchmark.group = "engine: against the disk (cat, a plain write)"
    report = benchmark.pedantic(
        bench, args=(0.064, 0.064, 1, {"cold", "write"}, None), rounds=1, iterations=1
    )
    print("\n".join(describe(report)))
    assert report["write"]["checked"]
    assert len(report["cold"]["total"]) == WIDTH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=30.0, help="the cold file (30: over RAM)")
    parser.add_argument("--write-gb", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="cold,write")
    parser.add_argument("--dir", default=None, help="where the temporary files go")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    only = set(args.only.split(","))
    report_run(
        lambda: bench(args.gb, args.write_gb, args.rounds, only, args.dir), describe, args.json
    )


if __name__ == "__main__":
    main()
