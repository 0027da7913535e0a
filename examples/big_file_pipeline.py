"""A lazy pipeline over a ``.npy`` file bigger than the RAM budget, with flat memory.

    python examples/big_file_pipeline.py                          # 256 MB file, 64 MB budget
    python examples/big_file_pipeline.py --size 4GB --budget 1GB  # a bigger run

It sets a small RAM budget, writes a float32 ``.npy`` several times bigger than it to a
temporary folder (removed at the end, whatever happens), and runs a pipeline over it
with ``import tierflow as tw``:

1. the mean and standard deviation of every column, both in ONE pass over the file
   (``tw.compute(x.mean(axis=0), x.std(axis=0))``);
2. standardise, ``z = (x - mean) / std``: lazy, nothing runs yet;
3. filter with a boolean mask, keeping rows without an outlier (``|z| < 3`` in every
   column): the mask is lazy too, so the row count is unknown (``?``) until computed;
4. a histogram of the first kept column and the number of kept rows, in one pass;
5. ``to_npy`` of the kept rows: streamed to disk in row blocks, written atomically.

It prints each result, the throughput of each pass, the most memory the scheduler
planned to hold at once, and the peak RSS of the process against the budget. A few
rows of the output are checked against plain NumPy on the start of the file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import tierflow as tw
from tierflow import config
from tierflow.config import format_bytes, parse_size
from tierflow.engine.types import ComputeFinished

COLUMNS = 8


class PlannedPeak:
    """A compute callback that keeps the peak memory the scheduler admitted at once."""

    def __init__(self) -> None:
        self.peak = 0

    def finish(self, event: ComputeFinished) -> None:
        self.peak = max(self.peak, event.peak_bytes)


def rss_now() -> int:
    """This process's resident set size in bytes (VmRSS)."""
    return _status_kb("VmRSS:") * 1024


def peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM), since the last reset."""
    return _status_kb("VmHWM:") * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Start a new peak-RSS measurement (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def write_file(path: str, rows: int, columns: int) -> None:
    """A float32 ``.npy`` of ``rows`` x ``columns`` with a different mean and scale per
    column, written in pieces of 128K rows so it is never whole in memory."""
    rng = np.random.default_rng(7)
    shift = np.linspace(-5, 5, columns, dtype=np.float32)
    scale = np.linspace(0.5, 4, columns, dtype=np.float32)
    step = 1 << 17
    with open(path, "wb") as f:
        header = {"descr": "<f4", "fortran_order": False, "shape": (rows, columns)}
        np.lib.format.write_array_header_1_0(f, header)
        for start in range(0, rows, step):
            piece = rng.standard_normal((min(step, rows - start), columns), dtype=np.float32)
            piece *= scale
            piece += shift
            f.write(piece.tobytes())
        # The written pages are page cache; drop them so the first pass reads the file
        # from disk, the way a job over a file written long ago starts.
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def rate(nbytes: int, seconds: float) -> str:
    """How long a pass over ``nbytes`` of input took, and its throughput in GB/s."""
    return f"{seconds:.2f} s, {nbytes / max(seconds, 1e-9) / 2**30:.2f} GB/s"


def run(size: int, budget: int, folder: str | None) -> None:
    config.set(ram_budget=budget)  # bytes; memory.budget("64MB") does the same
    rows = max(1, size // (4 * COLUMNS))
    workdir = tempfile.mkdtemp(prefix="tierflow-pipeline-", dir=folder)
    try:
        source = os.path.join(workdir, "features.npy")
        target = os.path.join(workdir, "kept.npy")
        write_file(source, rows, COLUMNS)
        nbytes = os.path.getsize(source)
        print(
            f"wrote {format_bytes(nbytes)} ({rows:,} rows x {COLUMNS} float32) to {workdir}; "
            f"RAM budget {format_bytes(budget)} (the file is {nbytes / budget:.1f}x the budget)"
        )

        x = tw.from_npy(source)  # reads the header only
        print(repr(x))
        start_rss = rss_now()
        since = "since the file was written" if reset_peak_rss() else "of the whole run"
        planned = PlannedPeak()

        # 1. Two reductions over the same file: one pass, each block read once.
        start = time.perf_counter()
        mean, std = tw.compute(x.mean(axis=0), x.std(axis=0), progress=False, callbacks=planned)
        print(f"pass 1, mean and std of every column: {rate(nbytes, time.perf_counter() - start)}")
        print(f"  mean {np.round(mean, 2)}")
        print(f"  std  {np.round(std, 2)}")

        # 2.-3. Lazy: these lines only describe the pipeline.
        z = (x - mean) / std
        keep = (np.abs(z) < 3).all(axis=1)
        kept = z[keep]
        print("the kept rows, before anything is computed:")
        print(repr(kept))

        # 4. A histogram of one column of the kept rows, and how many rows were kept.
        # On a lazy array np.histogram returns (lazy counts, edges): edges are known now.
        lazy_counts, edges = np.histogram(kept[:, 0], bins=12, range=(-3, 3))
        start = time.perf_counter()
        counts, n_kept = tw.compute(lazy_counts, keep.sum(), progress=False, callbacks=planned)
        print(f"pass 2, histogram and row count: {rate(nbytes, time.perf_counter() - start)}")
        print(
            f"  kept {n_kept:,} of {rows:,} rows ({n_kept / rows:.2%}); column 0 of the kept rows:"
        )
        tallest = max(int(counts.max()), 1)
        for lo, hi, count in zip(edges[:-1], edges[1:], counts, strict=True):
            print(f"  [{lo:+.1f}, {hi:+.1f}) {count:>10,} {'#' * round(40 * count / tallest)}")

        # 5. The kept rows to a new .npy, block by block.
        start = time.perf_counter()
        kept.to_npy(target, progress=False, callbacks=planned)
        print(f"pass 3, to_npy of the kept rows: {rate(nbytes, time.perf_counter() - start)}")
        peak = peak_rss()
        out = np.load(target, mmap_mode="r")
        print(f"  {target}: {out.shape} {out.dtype}, {format_bytes(os.path.getsize(target))}")

        # The mask keeps row order, so the first output rows are the kept rows of the
        # first input rows: a check against NumPy that needs only the start of the file.
        head = np.load(source, mmap_mode="r")[:10_000]
        zh = (head - mean) / std
        expected = zh[(np.abs(zh) < 3).all(axis=1)]
        same = np.allclose(out[: len(expected)], expected, rtol=1e-5, atol=1e-5)
        print(f"  the first {len(expected):,} output rows match NumPy: {same}")
        del out, head
        if not same or len(np.load(target, mmap_mode="r")) != n_kept:
            raise SystemExit("the output does not match NumPy")

        print(
            f"memory: budget {format_bytes(budget)}; the scheduler planned at most "
            f"{format_bytes(planned.peak)} at once"
        )
        print(
            f"  peak RSS {since}: {format_bytes(peak)}, of which {format_bytes(start_rss)} "
            f"was there before the passes (Python, NumPy, tierflow); the file is "
            f"{format_bytes(nbytes)}"
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256MB", help="size of the generated file (256MB)")
    parser.add_argument("--budget", default="64MB", help="RAM budget (64MB)")
    parser.add_argument("--dir", default=None, help="parent of the temporary folder (TMPDIR)")
    args = parser.parse_args()
    run(parse_size(args.size, "--size"), parse_size(args.budget, "--budget"), args.dir)


if __name__ == "__main__":
    main()
