"""Files' pages kept mapped between computes, against faulted in again at every compute.

Each ``tw.from_npy(path)`` is a new source, as in a notebook's cells or a benchmark's
rounds. A process now maps a file once and keeps the mapping, with its pages, for the
files it used last (``tierflow.storage.filemaps``, up to half the budget). With
``filemaps.keep_files(0)`` nothing is kept, so every compute maps the file anew and
takes a minor page fault for every 4 KB of it, as before: the baseline.

On local threads, a float32 ``[rows, 8]`` file (1 GB by default) in 32 MB blocks, the
page cache warm: the column sum, ``sqrt(x*2+1).sum(0)`` and mean+std, alternating kept
and not kept, one compute of each mode first to settle it (fill or empty the mapping).
Prints the medians and the ratio none / kept per case.

    .venv/bin/python tests/benchmarks/bench_kept_mappings.py --size-gb 1 --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import ensure_warm, make_npy

WIDTH = 8
BLOCK_ROWS = 1 << 20  # 32 MB of float32 rows of 8
CASES = ("sum", "chain", "meanstd")


def _exprs(path: str, case: str) -> list[Any]:
    import tierflow as tw

    x = tw.from_npy(path, rows=BLOCK_ROWS)
    if case == "sum":
        return [x.sum(axis=0)]
    if case == "chain":
        return [np.sqrt(x * 2 + 1).sum(axis=0)]
    return [x.mean(axis=0), x.std(axis=0)]


def _timed(path: str, case: str) -> tuple[float, list[np.ndarray]]:
    import tierflow as tw

    gc.collect()  # outside the time, as timeit does
    start = time.perf_counter()
    out = tw.compute(*_exprs(path, case), executor="threads", progress=False)
    return time.perf_counter() - start, [np.asarray(o) for o in out]


def measure(path: str, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per case and mode (``kept``, ``none``) over ``rounds`` alternations; the
    results of the two modes are checked to be the same."""
    from tierflow.storage import filemaps

    figures: dict[str, dict[str, list[float]]] = {}
    for case in CASES:
        seconds: dict[str, list[float]] = {"kept": [], "none": []}
        for _ in range(rounds):
            for mode in ("kept", "none"):
                filemaps.keep_files(None if mode == "kept" else 0)
                if mode == "none":
                    filemaps.forget_all()
                ensure_warm(path)
                _timed(path, case)  # settles the mode
                took, out = _timed(path, case)
                seconds[mode].append(took)
                if mode == "kept":
                    reference = out
                else:
                    for a, b in zip(out, reference, strict=True):
                        np.testing.assert_array_equal(a, b)
        filemaps.keep_files(None)
        figures[case] = seconds
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="the file, in 10^9 bytes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", help="folder for the generated file (default: temp)")
    args = parser.parse_args(argv)
    rows = int(args.size_gb * 1e9) // (4 * WIDTH)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = str(make_npy(Path(folder) / "x.npy", rows, WIDTH))
        from tierflow.storage import filemaps

        print(
            f"{args.size_gb:g} GB float32 [{rows:,}, {WIDTH}] in {BLOCK_ROWS:,}-row blocks, "
            f"threads; kept up to {filemaps.keep_limit() / 1e9:.1f} GB; "
            f"{args.rounds} alternations, medians (min-max)"
        )
        for case, seconds in measure(path, args.rounds).items():
            kept, none = (statistics.median(seconds[m]) for m in ("kept", "none"))
            ratios = [n / k for n, k in zip(seconds["none"], seconds["kept"], strict=True)]
            print(
                f"  {case:8} kept {kept * 1e3:.0f} ms ({args.size_gb / kept:.1f} GB/s), "
                f"none kept {none * 1e3:.0f} ms: kept is {none / kept:.2f}x as fast "
                f"({min(ratios):.2f}-{max(ratios):.2f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
