"""The demo job behind ``tierflow demo`` (``make demo``).

It sets a small RAM budget, writes a float32 ``.npy`` file several times bigger than it
into a temporary folder, computes per-column mean and standard deviation in one pass,
writes the standardised features with ``to_npy``, checks a few rows against NumPy, and
prints the throughput of each step, the peak RSS and the budget. The folder is removed
at the end, whatever happens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .config import GB, MB, format_bytes

__all__ = ["DemoReport", "run_demo"]


class _PeakRss:
    """Samples this process's RSS every ``interval`` seconds in a background thread."""

    def __init__(self, interval: float = 0.01) -> None:
        import psutil

        self._process = psutil.Process()
        self.interval = interval
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierflow-demo-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


@dataclass
class DemoReport:
    """What the demo measured: sizes in bytes, rates in bytes per second."""

    budget: int
    file_bytes: int
    rows: int
    columns: int
    stats_rate: float
    write_rate: float
    peak_rss: int
    baseline_rss: int


def _generate(path: str, rows: int, columns: int, piece_rows: int = 1 << 20) -> None:
    """A float32 ``.npy`` of ``rows`` x ``columns``: columns with different means and
    scales, written piece by piece (never more than one piece in memory)."""
    from .engine.io.npy import npy_header

    rng = np.random.default_rng(20240501)
    shift = np.linspace(-5, 5, columns, dtype=np.float32)
    scale = np.linspace(0.5, 4, columns, dtype=np.float32)
    with open(path, "wb") as f:
        f.write(npy_header(np.dtype("<f4"), (rows, columns)))
        for start in range(0, rows, piece_rows):
            n = min(piece_rows, rows - start)
            piece = rng.standard_normal((n, columns), dtype=np.float32)
            piece *= scale
            piece += shift
            f.write(piece.tobytes())
        # Written pages are the kernel's page cache, not this process's RSS; drop them
        # so the timed passes read the file the way a cold job would start.
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def run_demo(
    *,
    budget: int = 256 * MB,
    file_bytes: int = 1 * GB,
    columns: int = 8,
    folder: str | None = None,
    say: Callable[[str], None] = print,
) -> DemoReport:
    """Run the demo job (see the module docstring) and return what it measured."""
    import tierflow as tw

    from . import config

    rows = file_bytes // (4 * columns)
    workdir = tempfile.mkdtemp(prefix="tierflow-demo-", dir=folder)
    with config.set(ram_budget=budget):
        try:
            source = os.path.join(workdir, "features.npy")
            target = os.path.join(workdir, "standardised.npy")
            say(
                f"RAM budget {format_bytes(budget)}; writing a {format_bytes(rows * columns * 4)} "
                f"float32 file of {rows:,} rows x {columns} columns to {workdir}"
            )
            _generate(source, rows, columns)
            x = tw.from_npy(source)
            say(f"lazy array: {x.shape} {x.dtype} in {x.nblocks} blocks")
            with _PeakRss() as rss:
                baseline = rss.peak
                start = time.perf_counter()
                mean, std = tw.compute(x.mean(axis=0), x.std(axis=0), progress=False)
                stats_seconds = time.perf_counter() - start
                say(
                    f"mean and std of every column, one pass: {stats_seconds:.2f} s, "
                    f"{x.nbytes / stats_seconds / GB:.2f} GB/s"  # type: ignore[operator]
                )
                start = time.perf_counter()
                ((x - mean) / std).to_npy(target, progress=False)
                write_seconds = time.perf_counter() - start
                say(
                    f"standardised features written with to_npy: {write_seconds:.2f} s, "
                    f"{x.nbytes / write_seconds / GB:.2f} GB/s"  # type: ignore[operator]
                )
            check = np.load(target, mmap_mode="r")
            first = np.load(source, mmap_mode="r")[:1000]
            expected = (first - mean) / std
            if not np.allclose(check[:1000], expected, rtol=1e-5, atol=1e-5):
                raise AssertionError("the standardised rows do not match NumPy's")
            zmean = tw.from_npy(target).mean(axis=0).compute(progress=False)
            say(f"check: standardised column means {np.abs(zmean).max():.1e} from 0 at most")
            say(
                f"peak RSS {format_bytes(rss.peak)} (before the passes {format_bytes(baseline)}); "
                f"file {format_bytes(x.nbytes or 0)} = {(x.nbytes or 0) / budget:.1f} x the "
                f"{format_bytes(budget)} budget"
            )
            return DemoReport(
                budget=budget,
                file_bytes=x.nbytes or 0,
                rows=rows,
                columns=columns,
                stats_rate=(x.nbytes or 0) / stats_seconds,
                write_rate=(x.nbytes or 0) / write_seconds,
                peak_rss=rss.peak,
                baseline_rss=baseline,
            )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
