"""Stream a file bigger than the RAM budget: column means with flat memory.

    python examples/stream_big_file.py

The budget is set to 64 MB and a 256 MB float32 ``.npy`` is written to a temporary
folder (removed at the end). ``memory.chunks`` reads it in row blocks (views of a
memory map, no copies): the next block is read ahead while one is used, and each block
is dropped from the process when the loop moves on, so the peak RSS stays near one
block instead of growing to the file's size as a plain ``np.load(mmap_mode="r")`` loop
does. ``drop_cache=True`` also drops the file's page cache behind the scan, for
one-pass scans of files bigger than RAM. Then ``memory.map`` runs a function over the
same blocks on all cores; its 256 MB result is over the budget, so it lands on the SSD.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np

from tierflow import memory

MB = 1 << 20


def peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Start a new peak-RSS measurement (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def write_file(path: str, rows: int, width: int) -> None:
    """Write a float32 .npy in 128K-row pieces, without ever holding it whole."""
    rng = np.random.default_rng(0)
    step = 1 << 17
    with open(path, "wb") as f:
        header = {"descr": "<f4", "fortran_order": False, "shape": (rows, width)}
        np.lib.format.write_array_header_1_0(f, header)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            block = rng.random((n, width), dtype=np.float32)
            block += np.arange(width, dtype=np.float32)
            f.write(block)
        f.flush()
        os.fsync(f.fileno())  # on disk, as a file written long ago would be


def main() -> None:
    memory.budget("64MB")
    folder = tempfile.mkdtemp(prefix="tierflow-example-")
    try:
        path = os.path.join(folder, "big.npy")
        rows, width = 8_388_608, 8  # 256 MB of float32
        write_file(path, rows, width)
        print(f"wrote {os.path.getsize(path) / MB:.0f} MB to {path}; budget 64 MB")
        since = "since the file was written" if reset_peak_rss() else "of the whole run"

        start = time.perf_counter()
        it = memory.chunks(path, drop_cache=True)  # default rows: budget / 16 = 4 MB blocks
        total = np.zeros(width)
        for block in it:
            total += block.sum(axis=0, dtype=np.float64)
        seconds = time.perf_counter() - start
        print(f"{len(it)} blocks of {it.rows} rows in {seconds:.2f} s")
        print(f"column means: {np.round(total / rows, 3)}")  # about 0.5, 1.5, ..., 7.5
        print(f"peak RSS {since}: {peak_rss() / MB:.0f} MB")

        out = memory.map(lambda b: np.sqrt(np.abs(b)), path)
        print(f"memory.map result: {out.shape} {out.dtype}, on the SSD: {memory.on_disk(out)}")
        memory.free(out)
        print(f"peak RSS {since}, memory.map included: {peak_rss() / MB:.0f} MB")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
