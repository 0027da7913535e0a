"""HDF5 and Parquet sources: which executor reads HDF5 faster, and Parquet against pyarrow.

1. **HDF5, threads against processes** (issue 14: h5py runs every call under one lock,
   so measure and make the default the faster one): a float32 ``[N, 8]`` dataset in
   100,000-row chunks (normal values rounded to 3 decimals), stored three ways (no filter, ``lzf``, ``gzip`` level 4), and
   ``tw.from_hdf5(path, "x").sum(axis=0)`` on ``serial``, ``threads`` and
   ``processes``. Per round every executor on every storage in turn; ratios are
   ``serial / executor`` of one round, the median (min-max) over the rounds. The file's
   pages are warm (read once before the rounds), so decompression and h5py's lock are
   what is measured, not the disk. Also serial with the pool of source blocks off
   (``steps.BLOCK_POOL_MAX = 0``: a fresh block for every read), as ``fresh / pooled``.
2. **Parquet against pyarrow's own column sums**: 8 float32 columns in 1,000,000-row row
   groups, ``tw.from_parquet(path).sum(axis=0)`` (default executor) against
   ``pyarrow.parquet.read_table(path)`` followed by ``pyarrow.compute.sum`` of each
   column, per round; the ratio pyarrow / tierflow.

Every tierflow sum is checked against NumPy's float64 sum of the same data (1e-6
relative). The files live in a temporary folder under ``--dir`` and are removed at the
end. ``--quiet CORES`` waits before each round until the rest of the machine uses under
``CORES`` cores (:func:`bench_processes.wait_quiet`).

``python tests/benchmarks/bench_formats.py [--rows 12500000] [--rounds 3] [--quiet CORES]
[--only hdf5,parquet] [--dir DIR]`` (12.5M rows is 400 MB a file; the issue's Parquet
figure is ``--only parquet --rows 125000000``, 4 GB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import span, timed
from bench_processes import wait_quiet

WIDTH = 8
CHUNK = 100_000
GROUP = 1_000_000
STORAGES = {
    "none": {},
    "lzf": {"compression": "lzf"},
    "gzip": {"compression": "gzip", "compression_opts": 4},
}
EXECUTORS = ("serial", "threads", "processes")
FRESH = "serial, no pool"


def _data(rows: int, a: int, b: int) -> np.ndarray:
    """Rows ``a:b``: normal values rounded to 3 decimals (compressible, as measured data
    often is: gzip keeps about half), the same for the same rows."""
    rng = np.random.default_rng(a)
    return np.round(rng.standard_normal((b - a, WIDTH)), 3).astype(np.float32)


def make_hdf5(path: Path, rows: int, options: dict[str, Any]) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        ds = f.create_dataset("x", (rows, WIDTH), "float32", chunks=(CHUNK, WIDTH), **options)
        for a in range(0, rows, GROUP):
            b = min(rows, a + GROUP)
            ds[a:b] = _data(rows, a, b)


def make_parquet(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(f"c{j}", pa.float32()) for j in range(WIDTH)])
    with pq.ParquetWriter(path, schema) as writer:
        for a in range(0, rows, GROUP):
            block = _data(rows, a, min(rows, a + GROUP))
            table = pa.table({f"c{j}": block[:, j] for j in range(WIDTH)}, schema=schema)
            writer.write_table(table, row_group_size=GROUP)


def expected_sum(rows: int) -> np.ndarray:
    total = np.zeros(WIDTH)
    for a in range(0, rows, GROUP):
        total += _data(rows, a, min(rows, a + GROUP)).astype(np.float64).sum(0)
    return total


def _check(got: Any, want: np.ndarray, what: str) -> None:
    got = np.asarray(got, dtype=np.float64)
    if not np.allclose(got, want, rtol=1e-6):
        raise AssertionError(f"{what}: {got} against {want}")


def run(rows: int, rounds: int, quiet: float | None, folder: Path, parts: set[str]) -> None:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    import tierflow as tw

    print(f"{os.cpu_count()} cores; {rows:,} x {WIDTH} float32 ({rows * WIDTH * 4 / 1e9:.2f} GB)")
    want = expected_sum(rows)
    paths = {}
    for name, options in STORAGES.items() if "hdf5" in parts else ():
        paths[name] = folder / f"{name}.h5"
        make_hdf5(paths[name], rows, options)
        print(f"  hdf5 {name}: {paths[name].stat().st_size / 1e9:.2f} GB on disk")
    parquet = folder / "t.parquet"
    if "parquet" in parts:
        make_parquet(parquet, rows)
        print(f"  parquet: {parquet.stat().st_size / 1e9:.2f} GB on disk")
    for path in [*paths.values(), *([parquet] if "parquet" in parts else [])]:  # warm pages
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    from tierflow.engine.program import steps

    times: dict[str, dict[str, list[float]]] = {
        n: {e: [] for e in (*EXECUTORS, FRESH)} for n in paths
    }
    versus: list[tuple[float, float]] = []
    for r in range(rounds):
        if quiet is not None:
            waited, cores = wait_quiet(quiet, 120)
            print(f"  round {r + 1}: waited {waited:.0f} s (other work {cores:.2f} cores)")
        for name, path in paths.items():
            for executor in EXECUTORS:
                x = tw.from_hdf5(path, "x")
                got, seconds = timed(
                    lambda x=x, e=executor: x.sum(axis=0).compute(executor=e, progress=False)
                )
                _check(got, want, f"hdf5 {name} on {executor}")
                times[name][executor].append(seconds)
            pooled, steps.BLOCK_POOL_MAX = steps.BLOCK_POOL_MAX, 0
            try:
                x = tw.from_hdf5(path, "x")
                got, seconds = timed(
                    lambda x=x: x.sum(axis=0).compute(executor="serial", progress=False)
                )
            finally:
                steps.BLOCK_POOL_MAX = pooled
            _check(got, want, f"hdf5 {name} without the pool")
            times[name][FRESH].append(seconds)
        if "parquet" not in parts:
            continue
        t = tw.from_parquet(parquet)
        got, ours = timed(lambda t=t: t.sum(axis=0).compute(progress=False))
        _check(got, want, "parquet")

        def theirs() -> list[float]:
            table = pq.read_table(parquet)
            return [pc.sum(table.column(c)).as_py() for c in table.column_names]

        got, seconds = timed(theirs)
        _check(got, want, "pyarrow")
        versus.append((ours, seconds))
    if paths:
        print(f"\n1. hdf5 sum(axis=0), serial / executor per round, median (min-max) of {rounds}")
    for name in paths:
        line = [f"    {name:<5} serial {statistics.median(times[name]['serial']):.3f} s"]
        for executor in EXECUTORS[1:]:
            ratios = [
                s / t for s, t in zip(times[name]["serial"], times[name][executor], strict=True)
            ]
            line.append(f"{executor} {span(ratios)}")
        fresh = [f / s for f, s in zip(times[name][FRESH], times[name]["serial"], strict=True)]
        line.append(f"serial without the pool / with it {span(fresh)}")
        print(", ".join(line))
    if not versus:
        return
    ratios = [theirs / ours for ours, theirs in versus]
    print(
        f"2. parquet sum(axis=0): tierflow {statistics.median(o for o, _ in versus):.3f} s, "
        f"pyarrow {statistics.median(t for _, t in versus):.3f} s; pyarrow / tierflow {span(ratios)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=12_500_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet", type=float, default=None)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--only", default="hdf5,parquet", help="hdf5, parquet or both")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tierflow-bench-formats-", dir=options.dir))
    try:
        run(options.rows, options.rounds, options.quiet, folder, set(options.only.split(",")))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
