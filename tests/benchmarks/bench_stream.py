"""Streaming: memory.chunks vs a plain np.load(mmap_mode="r") loop; memory.map vs one thread.

One float32 ``.npy`` of shape ``[N, 8]`` is generated in a temporary folder (default
3.5 GB; ``--size 200MB`` or ``TIERFLOW_BENCH_STREAM_SIZE``) and removed at the end.
Every scan runs in its own child process (``bench_stream.py --child KIND ...``), so its
peak RSS (``VmHWM``, reported by the child) is its own, and the parent samples the
child's RSS every 20 ms for the plot (``_harness.run_sampled``).

Targets (1,000,000-row blocks, i.e. 32 MB, unless said):

- ``memory.chunks`` column sums: peak RSS <= 150 MB, while the plain loop over
  ``np.load(mmap_mode="r")`` reaches about the file's size; throughput >= 0.9x the
  plain loop (same blocks, same arithmetic; the page cache is warm for both unless
  ``--cold``).
- the same scan in a 512 MB memory cgroup completes (file cache dropped first, so the
  reads are charged to the cgroup); skipped, with the reason, where cgroups cannot be
  made.
- ``memory.map(lambda b: np.sqrt(b * 2 + 1), ...)`` >= 1.6x a single-thread loop over the
  same blocks writing into a preallocated output.
- ``memory.map`` with a budget smaller than the output (``min(512 MB, file / 4)``): the
  output lands on the SSD and the peak RSS stays within budget + 200 MB. This run uses
  the default block size, which divides the budget among the workers (a fixed 32 MB
  block per worker would not fit a small budget on a many-core machine).

``python tests/benchmarks/bench_stream.py [--size 3.5GB] [--plot rss.png] [--cold]``
prints the figures and PASS/FAIL per target (exit status 1 on a FAIL with ``--strict``);
``--plot`` writes the RSS-over-time plot of the chunked scan vs the plain loop (PNG).
``make bench`` runs the pytest-benchmark suite below: memory targets and the cgroup run
are asserted; speed ratios are recorded in ``extra_info`` and asserted only with
``TIERFLOW_BENCH_STRICT=1`` (they depend on the machine's cores and load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: cgroups.py

from _harness import peak_rss, run_sampled

from tierflow import config, memory
from tierflow.storage import pages

MB = 1 << 20
ROWS = 1_000_000
WIDTH = 8
SIZE = os.environ.get("TIERFLOW_BENCH_STREAM_SIZE", "3.5GB")
STRICT = os.environ.get("TIERFLOW_BENCH_STRICT", "") not in ("", "0")

CHUNKS_PEAK = 150 * MB
CHUNKS_SPEED = 0.9
MAP_SPEED = 1.6
SPILL_SLACK = 200 * MB
CGROUP_LIMIT = 512 * MB


# -- the data -----------------------------------------------------------------------------


def make_file(folder: str, size: int | str) -> Path:
    """Write a float32 ``[N, 8]`` .npy of about ``size`` bytes (fsynced) and return its path."""
    nbytes = config.parse_size(size, "--size")
    n = max(1, nbytes // (4 * WIDTH))
    path = Path(folder) / f"stream-{n}x{WIDTH}.npy"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        header = {"descr": "<f4", "fortran_order": False, "shape": (n, WIDTH)}
        np.lib.format.write_array_header_1_0(f, header)
        for start in range(0, n, ROWS):
            block = rng.random((min(ROWS, n - start), WIDTH), dtype=np.float32)
            f.write(block.tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


# -- the child side: one scan per process -------------------------------------------------


# Each workload calls ``mark()`` when the measured part is over: the time and the peak
# RSS are taken there, before a checksum that reads the result back.
Mark = Callable[[], None]


def _scan_chunks(path: str, mark: Mark) -> dict[str, Any]:
    acc = np.zeros(WIDTH)
    for block in memory.chunks(path, ROWS):
        acc += block.sum(axis=0, dtype=np.float64)
    mark()
    return {"checksum": float(acc.sum())}


def _scan_memmap(path: str, mark: Mark) -> dict[str, Any]:
    m = np.load(path, mmap_mode="r")
    acc = np.zeros(WIDTH)
    for start in range(0, m.shape[0], ROWS):
        acc += m[start : start + ROWS].sum(axis=0, dtype=np.float64)
    mark()
    return {"checksum": float(acc.sum())}


def _fn(b: np.ndarray) -> np.ndarray:
    return np.sqrt(b * 2 + 1)


def _checksum(out: np.ndarray) -> float:
    # In blocks, released as they go: a strided read of a spilled output would map it all.
    return sum(float(b[::997].sum(dtype=np.float64)) for b in memory.chunks(out, ROWS))


def _map(path: str, mark: Mark) -> dict[str, Any]:
    out = memory.map(_fn, path, ROWS)
    mark()
    result = {"checksum": _checksum(out), "on_disk": memory.on_disk(out)}
    memory.free(out)
    return result


def _loop(path: str, mark: Mark) -> dict[str, Any]:
    m = np.load(path, mmap_mode="r")
    out = np.empty(m.shape, np.float32)
    for start in range(0, m.shape[0], ROWS):
        out[start : start + ROWS] = _fn(m[start : start + ROWS])
    mark()
    return {"checksum": _checksum(out), "on_disk": False}


def _map_spill(path: str, mark: Mark) -> dict[str, Any]:
    out = memory.map(_fn, path)  # default rows: the budget divided among the workers
    mark()
    result = {"checksum": _checksum(out), "on_disk": memory.on_disk(out)}
    memory.free(out)
    return result


KINDS = {
    "chunks": _scan_chunks,
    "memmap": _scan_memmap,
    "map": _map,
    "loop": _loop,
    "map-spill": _map_spill,
}


def child_main(kind: str, path: str, budget: str | None) -> None:
    """Run one workload and print its figures as one JSON line."""
    if budget:
        memory.budget(budget)
    figures: dict[str, Any] = {}

    def mark() -> None:
        figures["seconds"] = time.perf_counter() - start
        figures["peak_rss"] = peak_rss()

    start = time.perf_counter()
    result = KINDS[kind](path, mark)
    result.update(figures, kind=kind, bytes=os.path.getsize(path), budget=memory.budget())
    print(json.dumps(result))


# -- the parent side ----------------------------------------------------------------------


def child_command(kind: str, path: Path, budget: str | None = None) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(path)]
    return [*cmd, "--budget", budget] if budget else cmd


def run_child(
    kind: str,
    path: Path,
    *,
    budget: str | None = None,
    wrap: Any = None,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Run one workload in a child process; its JSON figures plus ``samples``:
    ``[(seconds since start, RSS bytes), ...]`` taken every 20 ms by this process."""
    run = run_sampled(child_command(kind, path, budget), wrap=wrap, timeout=timeout)
    samples = [(s.t, s.rss) for s in run.samples]
    if run.returncode != 0:
        return {
            "kind": kind,
            "returncode": run.returncode,
            "error": run.stderr[-2000:],
            "samples": samples,
        }
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    result.update(returncode=0, samples=samples)
    return result


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("returncode") == 0]
    if not ok:
        raise RuntimeError(f"every run failed: {runs[-1].get('error')}")
    best = min(ok, key=lambda r: r["seconds"])
    return {**best, "peak_rss": max(r["peak_rss"] for r in ok)}


def _cold(path: Path, cold: bool) -> None:
    if cold:
        pages.release_path(path)


def compare_scan(path: Path, repeat: int = 2, cold: bool = False) -> dict[str, Any]:
    """chunks vs the plain memmap loop, alternating, best of ``repeat`` each."""
    runs: dict[str, list[dict[str, Any]]] = {"memmap": [], "chunks": []}
    for _ in range(repeat):
        for kind in runs:
            _cold(path, cold)
            runs[kind].append(run_child(kind, path))
    plain, chunked = _best(runs["memmap"]), _best(runs["chunks"])
    assert abs(plain["checksum"] - chunked["checksum"]) <= 1e-9 * abs(plain["checksum"])
    return {
        "file_bytes": plain["bytes"],
        "memmap_s": plain["seconds"],
        "chunks_s": chunked["seconds"],
        "memmap_gb_s": plain["bytes"] / plain["seconds"] / (1 << 30),
        "chunks_gb_s": chunked["bytes"] / chunked["seconds"] / (1 << 30),
        "speed_ratio": plain["seconds"] / chunked["seconds"],
        "memmap_peak_rss": plain["peak_rss"],
        "chunks_peak_rss": chunked["peak_rss"],
        "chunks_peaks": [r.get("peak_rss") for r in runs["chunks"]],
        "memmap_samples": plain["samples"],
        "chunks_samples": chunked["samples"],
    }


def compare_map(path: Path, repeat: int = 2) -> dict[str, Any]:
    """memory.map on all cores vs a single-thread loop, best of ``repeat`` each."""
    runs: dict[str, list[dict[str, Any]]] = {"loop": [], "map": []}
    for _ in range(repeat):
        for kind in runs:
            runs[kind].append(run_child(kind, path))
    single, parallel = _best(runs["loop"]), _best(runs["map"])
    assert abs(single["checksum"] - parallel["checksum"]) <= 1e-6 * abs(single["checksum"])
    return {
        "cores": len(os.sched_getaffinity(0)),
        "loop_s": single["seconds"],
        "map_s": parallel["seconds"],
        "speed_ratio": single["seconds"] / parallel["seconds"],
        "map_on_disk": parallel["on_disk"],
        "map_peak_rss": parallel["peak_rss"],
    }


def spill_budget(path: Path) -> int:
    """The budget of the spill run: smaller than the output by a wide margin."""
    return min(512 * MB, max(16 * MB, os.path.getsize(path) // 4))


def map_spill(path: Path) -> dict[str, Any]:
    """memory.map with a budget smaller than its output."""
    budget = spill_budget(path)
    r = run_child("map-spill", path, budget=str(budget))
    if r["returncode"] != 0:
        raise RuntimeError(f"the spill run failed: {r['error']}")
    return {
        "budget": budget,
        "output_bytes": r["bytes"],
        "on_disk": r["on_disk"],
        "seconds": r["seconds"],
        "peak_rss": r["peak_rss"],
        "limit": budget + SPILL_SLACK,
    }


def cgroup_scan(path: Path, kind: str = "chunks") -> dict[str, Any]:
    """The chunked scan inside a 512 MB memory cgroup, the file's cache dropped first.

    Raises ``RuntimeError`` with the reason where no cgroup can be made.
    """
    import cgroups

    reason = cgroups.skip_reason()
    if reason:
        raise RuntimeError(reason)
    pages.release_path(path)
    with cgroups.memory_cgroup(CGROUP_LIMIT) as cg:
        r = run_child(kind, path, wrap=cg.wrap)
        return {
            "kind": kind,
            "returncode": r["returncode"],
            "oom_kills": cg.oom_kills(),
            "cgroup_peak": cg.peak_bytes(),
            "seconds": r.get("seconds"),
            "peak_rss": r.get("peak_rss"),
            "error": r.get("error", ""),
        }


def plot_rss(scan: dict[str, Any], png: str | os.PathLike[str]) -> None:
    """Write the RSS-over-time plot of the chunked scan vs the plain memmap loop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (
        ("memmap_samples", "np.load(mmap_mode='r') loop"),
        ("chunks_samples", "memory.chunks"),
    ):
        samples = scan[key]
        ax.plot([t for t, _ in samples], [rss / MB for _, rss in samples], label=label)
    ax.set_xlabel("seconds since the child started")
    ax.set_ylabel("RSS (MB)")
    size = scan["file_bytes"] / (1 << 30)
    ax.set_title(f"Column sums over a {size:.2f} GB float32 .npy in 1,000,000-row blocks")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# -- pytest-benchmark ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_file() -> Iterator[Path]:
    folder = tempfile.mkdtemp(prefix="tierflow-bench-stream-")
    try:
        yield make_file(folder, SIZE)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_chunks_scan(benchmark: Any, bench_file: Path) -> None:
    benchmark.group = f"stream: column sums over {SIZE}"
    r = benchmark.pedantic(run_child, args=("chunks", bench_file), rounds=2, iterations=1)
    assert r["returncode"] == 0, r.get("error")
    assert r["peak_rss"] <= CHUNKS_PEAK


def test_memmap_scan(benchmark: Any, bench_file: Path) -> None:
    benchmark.group = f"stream: column sums over {SIZE}"
    r = benchmark.pedantic(run_child, args=("memmap", bench_file), rounds=2, iterations=1)
    assert r["returncode"] == 0, r.get("error")


def test_chunks_vs_memmap(benchmark: Any, bench_file: Path) -> None:
    """Both in one run, alternating, so the ratio compares like with like."""
    benchmark.group = "stream: ratios"
    r = benchmark.pedantic(compare_scan, args=(bench_file,), rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in r.items() if not k.endswith("_samples")})
    print(_scan_summary(r))
    assert r["chunks_peak_rss"] <= CHUNKS_PEAK
    if STRICT:
        assert r["speed_ratio"] >= CHUNKS_SPEED


def test_chunks_in_a_512mb_cgroup(bench_file: Path) -> None:
    import cgroups

    if reason := cgroups.skip_reason():
        pytest.skip(reason)
    r = cgroup_scan(bench_file)
    print(_cgroup_summary(r))
    assert r["returncode"] == 0 and r["oom_kills"] == 0, r["error"]


def test_map_vs_single_thread(benchmark: Any, bench_file: Path) -> None:
    benchmark.group = "stream: ratios"
    r = benchmark.pedantic(compare_map, args=(bench_file,), rounds=1, iterations=1)
    benchmark.extra_info.update(r)
    print(_map_summary(r))
    if STRICT:
        assert r["speed_ratio"] >= MAP_SPEED


def test_map_output_spills_within_budget(benchmark: Any, bench_file: Path) -> None:
    benchmark.group = "stream: map with a small budget"
    r = benchmark.pedantic(map_spill, args=(bench_file,), rounds=1, iterations=1)
    benchmark.extra_info.update(r)
    print(_spill_summary(r))
    assert r["on_disk"]
    assert r["peak_rss"] <= r["limit"]


# -- script mode --------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / MB:.0f} MB"


def _mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _scan_summary(r: dict[str, Any]) -> str:
    return (
        f"column sums, 1M-row blocks, {r['file_bytes'] / (1 << 30):.2f} GB: "
        f"np.load(mmap) loop {r['memmap_gb_s']:.2f} GB/s peak RSS {_mb(r['memmap_peak_rss'])}; "
        f"memory.chunks {r['chunks_gb_s']:.2f} GB/s peak RSS {_mb(r['chunks_peak_rss'])}\n"
        f"  [{_mark(r['chunks_peak_rss'] <= CHUNKS_PEAK)}] chunks peak RSS "
        f"{_mb(r['chunks_peak_rss'])} <= {_mb(CHUNKS_PEAK)}\n"
        f"  [{_mark(r['speed_ratio'] >= CHUNKS_SPEED)}] chunks throughput "
        f"{r['speed_ratio']:.2f}x the plain loop (target >= {CHUNKS_SPEED}x)"
    )


def _cgroup_summary(r: dict[str, Any]) -> str:
    ok = r["returncode"] == 0 and r["oom_kills"] == 0
    peak = "unknown" if r["cgroup_peak"] is None else _mb(r["cgroup_peak"])
    detail = (
        f"{r['seconds']:.2f} s, cgroup peak {peak}, RSS peak {_mb(r['peak_rss'])}"
        if ok
        else f"exit {r['returncode']}, OOM kills {r['oom_kills']}: {r['error'][-300:]}"
    )
    return f"  [{_mark(ok)}] {r['kind']} scan in a {_mb(CGROUP_LIMIT)} cgroup completes ({detail})"


def _map_summary(r: dict[str, Any]) -> str:
    return (
        f"sqrt(b*2+1), 1M-row blocks: single-thread loop {r['loop_s']:.2f} s, memory.map on "
        f"{r['cores']} cores {r['map_s']:.2f} s (peak RSS {_mb(r['map_peak_rss'])})\n"
        f"  [{_mark(r['speed_ratio'] >= MAP_SPEED)}] memory.map {r['speed_ratio']:.2f}x the "
        f"single-thread loop (target >= {MAP_SPEED}x)"
    )


def _spill_summary(r: dict[str, Any]) -> str:
    ok = r["on_disk"] and r["peak_rss"] <= r["limit"]
    return (
        f"memory.map with a {_mb(r['budget'])} budget, {_mb(r['output_bytes'])} output: "
        f"{r['seconds']:.2f} s, output on {'the SSD' if r['on_disk'] else 'RAM'}\n"
        f"  [{_mark(ok)}] output spilled and peak RSS {_mb(r['peak_rss'])} <= budget + "
        f"{_mb(SPILL_SLACK)} = {_mb(r['limit'])}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default=SIZE, help="file size, e.g. 3.5GB or 200MB")
    parser.add_argument("--plot", help="write the RSS-over-time plot (PNG) here")
    parser.add_argument("--repeat", type=int, default=2, help="runs per timed workload")
    parser.add_argument("--cold", action="store_true", help="drop the file's cache per scan")
    parser.add_argument("--dir", help="folder for the generated file (default: a temp folder)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--budget", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child[0], args.child[1], args.budget)
        return 0
    folder = tempfile.mkdtemp(prefix="tierflow-bench-stream-", dir=args.dir)
    failed = False
    try:
        t0 = time.perf_counter()
        path = make_file(folder, args.size)
        gb = os.path.getsize(path) / (1 << 30)
        print(f"generated {path} ({gb:.2f} GB) in {time.perf_counter() - t0:.1f} s")
        scan = compare_scan(path, args.repeat, args.cold)
        print(_scan_summary(scan))
        failed |= scan["chunks_peak_rss"] > CHUNKS_PEAK or scan["speed_ratio"] < CHUNKS_SPEED
        if args.plot:
            plot_rss(scan, args.plot)
            print(f"  RSS over time: {args.plot}")
        try:
            cg = cgroup_scan(path)
            print(_cgroup_summary(cg))
            failed |= cg["returncode"] != 0 or cg["oom_kills"] != 0
        except RuntimeError as e:
            print(f"  [SKIP] scan in a {_mb(CGROUP_LIMIT)} cgroup: {e}")
        m = compare_map(path, args.repeat)
        print(_map_summary(m))
        failed |= m["speed_ratio"] < MAP_SPEED
        s = map_spill(path)
        print(_spill_summary(s))
        failed |= not s["on_disk"] or s["peak_rss"] > s["limit"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
