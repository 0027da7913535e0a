"""A Zarr pipeline: compressed chunks in, a new Zarr array out, inside a small RAM budget.

    python examples/zarr_pipeline.py                          # 256 MB array, 64 MB budget
    python examples/zarr_pipeline.py --size 4GB --budget 1GB  # a bigger run

Needs the ``zarr`` extra (``pip install -e '.[zarr]'`` in the tierflow checkout). It
writes a float32 Zarr array (format 3, blosc lz4, 65,536-row chunks) several times
bigger than the RAM budget into a temporary folder (removed at the end, whatever
happens), then, with ``import tierflow as tw``:

1. ``tw.from_zarr`` reads the array's metadata only; blocks are whole chunks;
2. the mean and standard deviation of every column in ONE pass, decompressing each
   chunk once, in the worker threads;
3. standardises and keeps the rows without an outlier (a boolean mask: the row count
   is unknown until computed), and writes them with ``x.to_zarr`` to a new array, each
   block task writing whole chunks; the array is marked incomplete until its last
   block is in;
4. reads the new array back with ``tw.from_zarr`` and checks its first rows against
   plain NumPy and zarr.

It prints the throughput of each pass (decoded bytes per second) and the peak RSS
against the budget.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import BloscCodec

import tierflow as tw
from tierflow import config
from tierflow.config import format_bytes, parse_size

COLUMNS = 8
CHUNK = 1 << 16  # rows per stored chunk (2 MB): a chunk is decoded whole


def write_array(path: Path, rows: int) -> None:
    """A float32 ``[rows, 8]`` Zarr array, a different mean and scale per column,
    written a chunk at a time so it is never whole in memory."""
    z = zarr.create_array(
        store=str(path),
        shape=(rows, COLUMNS),
        chunks=(CHUNK, COLUMNS),
        dtype="float32",
        compressors=[BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
    )
    rng = np.random.default_rng(7)
    shift = np.linspace(-5, 5, COLUMNS, dtype=np.float32)
    scale = np.linspace(0.5, 4, COLUMNS, dtype=np.float32)
    for start in range(0, rows, CHUNK):
        piece = rng.standard_normal((min(CHUNK, rows - start), COLUMNS), dtype=np.float32)
        z[start : start + len(piece)] = np.round(piece * scale + shift, 3)


def stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def rate(nbytes: int, seconds: float) -> str:
    return f"{seconds:.2f} s, {nbytes / max(seconds, 1e-9) / 2**30:.2f} GB/s decoded"


def run(size: int, budget: int, folder: str | None) -> None:
    config.set(ram_budget=budget)
    rows = max(1, size // (4 * COLUMNS))
    workdir = Path(tempfile.mkdtemp(prefix="tierflow-zarr-", dir=folder))
    try:
        source, target = workdir / "features.zarr", workdir / "kept.zarr"
        write_array(source, rows)
        nbytes = rows * COLUMNS * 4
        print(
            f"wrote {format_bytes(nbytes)} decoded ({rows:,} rows x {COLUMNS} float32) as "
            f"{format_bytes(stored_bytes(source))} of blosc-lz4 chunks; RAM budget "
            f"{format_bytes(budget)} ({nbytes / budget:.1f}x the budget)"
        )

        # 1. The metadata only: shape, dtype, chunks, and each chunk's size and time.
        x = tw.from_zarr(source)
        print(repr(x))

        # 2. Two reductions, one pass: each chunk is read and decompressed once.
        start = time.perf_counter()
        mean, std = tw.compute(x.mean(axis=0), x.std(axis=0), progress=False)
        print(f"pass 1, mean and std of every column: {rate(nbytes, time.perf_counter() - start)}")
        print(f"  mean {np.round(mean, 2)}")
        print(f"  std  {np.round(std, 2)}")

        # 3. Lazy until to_zarr: standardise, drop rows with an outlier, write.
        z = (x - mean) / std
        kept = z[(np.abs(z) < 3).all(axis=1)]
        start = time.perf_counter()
        kept.to_zarr(target, progress=False)
        print(f"pass 2, to_zarr of the kept rows: {rate(nbytes, time.perf_counter() - start)}")

        # 4. The new array, read back; its first rows against NumPy on zarr's own read.
        out = tw.from_zarr(target)
        attrs = dict(zarr.open_array(str(target), mode="r").attrs)
        print(
            f"  {target.name}: {out.shape} {out.dtype} in {format_bytes(stored_bytes(target))}; "
            f"marked complete: {attrs.get('tierflow', {}).get('complete')}"
        )
        head = zarr.open_array(str(source), mode="r")[:10_000]
        zh = (head - mean) / std
        expected = zh[(np.abs(zh) < 3).all(axis=1)].astype(np.float32)
        got = out[: len(expected)].compute(progress=False)
        same = np.allclose(got, expected, rtol=1e-5, atol=1e-5)
        print(f"  the first {len(expected):,} rows read back match NumPy: {same}")
        if not same:
            raise SystemExit("the output does not match NumPy")
        print(f"memory: budget {format_bytes(budget)}; peak RSS {format_bytes(peak_rss())}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MB", help="decoded size of the array (256MB)")
    parser.add_argument("--budget", default="64MB", help="RAM budget (64MB)")
    parser.add_argument("--dir", default=None, help="parent of the temporary folder (TMPDIR)")
    args = parser.parse_args()
    run(parse_size(args.size, "--size"), parse_size(args.budget, "--budget"), args.dir)


if __name__ == "__main__":
    main()
