"""Zarr: tierflow against dask.array on a big compressed array, in a 1 GB cgroup, and over S3.

The data: a float32 ``[N, 8]`` Zarr (format 3) with blosc lz4 in 1,000,000-row chunks
(default 125,000,000 rows: 4 GB decoded), normal values rounded to 3 decimals, written
into a temporary folder under ``--dir`` and removed at the end.

1. **Column sum** (issue 14: at least 1.5x ``dask.array.from_zarr(...).sum(axis=0)``):
   ``tw.from_zarr(path).sum(axis=0)`` against dask.array's on its default threaded
   scheduler, alternating per round; the ratio dask / tierflow of each round, median
   (min-max). The chunks' pages are warm (read once first): decoding is measured. Also
   how decoding scales with the cores: the same sum on one worker thread, per round.
2. **In a 1 GB memory cgroup**: the same sums, each in a child process of its own inside
   a real cgroup of ``--cgroup-mb`` (default 1024) MB; whether it completed, its wall
   time, the cgroup's peak and OOM kills. Skipped, with the reason, where no cgroup can
   be made (needs root).
3. **Standardising into a new Zarr** (at least 1.5x ``da.to_zarr``): ``(x - mean) / std``
   with the column statistics computed first, written with ``x.to_zarr`` against
   ``da.to_zarr`` of the same expression (1,000,000-row chunks, blosc lz4 both); one
   output checked against the other.
4. **Over S3**: a ``--s3-rows`` array (default 8,000,000 rows, 256 MB) written to a local
   S3-compatible server (moto) and to the local disk; the column sum's throughput from
   each, decoded GB/s, and the ratio.

``python tests/benchmarks/bench_zarr.py [--rows 125000000] [--rounds 3] [--only
sum,cgroup,standardise,s3] [--cgroup-mb 1024] [--s3-rows 8000000] [--dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: cgroups.py, common.py
sys.path.insert(0, str(HERE))  # _harness.py

import _harness  # noqa: E402

from common import local_s3  # noqa: E402

WIDTH = 8
CHUNK = 1_000_000
PARTS = ("sum", "cgroup", "standardise", "s3")


def _codecs() -> list[Any]:
    from zarr.codecs import BloscCodec

    return [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")]


def _data(a: int, b: int) -> np.ndarray:
    rng = np.random.default_rng(a)
    return np.round(rng.standard_normal((b - a, WIDTH)), 3).astype(np.float32)


def make(store: Any, rows: int, storage_options: dict[str, Any] | None = None) -> None:
    import zarr

    extra = {"storage_options": storage_options} if storage_options else {}
    z = zarr.create_array(
        store=store, shape=(rows, WIDTH), chunks=(CHUNK, WIDTH), dtype="float32",
        compressors=_codecs(), overwrite=True, **extra,
    )  # fmt: skip
    for a in range(0, rows, CHUNK):
        b = min(rows, a + CHUNK)
        z[a:b] = _data(a, b)


def _warm(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(1 << 24):
                    pass


def part_sum(path: Path, rounds: int) -> None:
    import dask.array as da

    import tierflow as tw

    ratios, ours, theirs, alone = [], [], [], []
    diff = 0.0
    for _ in range(rounds):
        _, one = _harness.timed(
            lambda: tw.from_zarr(path).sum(axis=0).compute(workers=1, progress=False)
        )
        alone.append(one)
        got, t = _harness.timed(lambda: tw.from_zarr(path).sum(axis=0).compute(progress=False))
        want, d = _harness.timed(lambda: da.from_zarr(str(path)).sum(axis=0).compute())
        # dask.array sums float32 in float32 (tierflow in float64): compared loosely.
        diff = max(diff, float(np.max(np.abs(np.asarray(got, np.float64) - want))))
        if diff > 1e-6 * len(want) * 1e8:
            raise AssertionError(f"the sums differ: {got} against {want}")
        ours.append(t)
        theirs.append(d)
        ratios.append(d / t)
    print(
        f"1. column sum: tierflow {statistics.median(ours):.2f} s, dask.array "
        f"{statistics.median(theirs):.2f} s; dask / tierflow {_harness.span(ratios)} (target >= 1.5x); "
        f"largest difference of the sums {diff:.3g}"
    )
    scaling = [a / t for a, t in zip(alone, ours, strict=True)]
    print(
        f"   decoding on {os.cpu_count()} cores: 1 worker {statistics.median(alone):.2f} s, "
        f"all {statistics.median(ours):.2f} s; 1 worker / all {_harness.span(scaling)}"
    )


CHILD = """
import sys, time
import numpy as np
which, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if which == "tierflow":
    import tierflow as tw
    out = tw.from_zarr(path).sum(axis=0).compute(progress=False)
else:
    import dask.array as da
    out = da.from_zarr(path).sum(axis=0).compute()
# VmHWM, not ru_maxrss: a child's ru_maxrss keeps the forking parent's peak across exec.
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(time.perf_counter() - start, hwm, flush=True)
"""


def part_cgroup(path: Path, limit_mb: int) -> None:
    from cgroups import skip_reason

    reason = skip_reason()
    if reason:
        print(f"2. in a {limit_mb} MB cgroup: not run ({reason})")
        return
    for which in ("tierflow", "dask"):
        cmd = [sys.executable, "-c", CHILD, which, str(path)]
        print(f"2. {which} in a {limit_mb} MB cgroup: {_harness.in_cgroup(cmd, limit_mb, 1800)}")


def part_standardise(path: Path, folder: Path) -> None:
    import dask.array as da
    import zarr

    import tierflow as tw

    x = tw.from_zarr(path)
    (mean, std), stats = _harness.timed(
        lambda: tw.compute(x.mean(axis=0), x.std(axis=0), progress=False)
    )
    z = (x - mean) / std
    _, ours = _harness.timed(
        lambda: z.to_zarr(folder / "tw.zarr", chunks=CHUNK, compressors=_codecs(), progress=False)
    )
    d = da.from_zarr(str(path))
    dz = (d - d.mean(axis=0)) / d.std(axis=0)
    _, theirs = _harness.timed(
        lambda: da.to_zarr(
            dz.rechunk((CHUNK, WIDTH)), str(folder / "da.zarr"), compressors=_codecs()
        )
    )
    a = zarr.open_array(str(folder / "tw.zarr"), mode="r")
    b = zarr.open_array(str(folder / "da.zarr"), mode="r")
    for start in range(0, a.shape[0], 10 * CHUNK):
        # dask.array computes float32 means and deviations in float32: loosely.
        np.testing.assert_allclose(a[start : start + CHUNK], b[start : start + CHUNK], atol=5e-3)
    total = ours + stats
    print(
        f"3. standardise into a new Zarr: tierflow {total:.2f} s (statistics {stats:.2f} s), "
        f"dask.array {theirs:.2f} s; dask / tierflow {theirs / total:.2f}x (target >= 1.5x)"
    )


def part_s3(rows: int, folder: Path) -> None:
    import tierflow as tw

    with local_s3("bench") as options:
        make("s3://bench/a.zarr", rows, options)
        make(str(folder / "s3-local.zarr"), rows, None)
        _warm(folder / "s3-local.zarr")
        gb = rows * WIDTH * 4 / 1e9
        local, lt = _harness.timed(
            lambda: tw.from_zarr(folder / "s3-local.zarr").sum(axis=0).compute(progress=False)
        )
        remote, rt = _harness.timed(
            lambda: (
                tw.from_zarr("s3://bench/a.zarr", storage_options=options)
                .sum(axis=0)
                .compute(progress=False)
            )
        )
        np.testing.assert_array_equal(local, remote)
        print(
            f"4. over S3 (moto on localhost), {gb:.2f} GB decoded: local disk {gb / lt:.2f} GB/s, "
            f"S3 {gb / rt:.2f} GB/s; S3 / local {lt / rt:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=125_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(PARTS))
    parser.add_argument("--cgroup-mb", type=int, default=1024)
    parser.add_argument("--s3-rows", type=int, default=8_000_000)
    parser.add_argument("--dir", default=None)
    options = parser.parse_args()
    parts = set(options.only.split(","))
    folder = Path(tempfile.mkdtemp(prefix="tierflow-bench-zarr-", dir=options.dir))
    print(f"{os.cpu_count()} cores; {options.rows:,} x {WIDTH} float32 "
          f"({options.rows * WIDTH * 4 / 1e9:.2f} GB decoded), blosc lz4, {CHUNK:,}-row chunks")  # fmt: skip
    try:
        path = folder / "x.zarr"
        if parts & {"sum", "cgroup", "standardise"}:
            _, seconds = _harness.timed(lambda: make(str(path), options.rows))
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            print(f"   written in {seconds:.1f} s, {size / 1e9:.2f} GB on disk")
            _warm(path)
        if "sum" in parts:
            part_sum(path, options.rounds)
        if "cgroup" in parts:
            part_cgroup(path, options.cgroup_mb)
        if "standardise" in parts:
            part_standardise(path, folder)
        if "s3" in parts:
            part_s3(options.s3_rows, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps({"load_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
