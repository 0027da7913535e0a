"""A function written in plain Python over every row of a file: threads, serial, processes.

    python examples/plain_python_rows.py                  # 400,000 rows x 8 float32
    python examples/plain_python_rows.py --rows 2_000_000 # a longer run

``score`` below looks at one row at a time in Python, as a parser or a rule engine does.
Such code holds the GIL, so threads run it one at a time; ``executor="processes"`` runs
its blocks on a pool of worker processes, one per core. The file is generated in a
temporary folder (removed at the end); each executor computes the same scores, and
the script prints how long each took and whether the results match.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

import tierflow as tw


def score(block: np.ndarray) -> np.ndarray:
    """A score per row, computed row by row in plain Python."""
    out = np.empty((len(block), 1), np.float64)
    for i, row in enumerate(block.tolist()):
        total = 0.0
        for value in row:
            total += value * value if value > 0 else -value
        out[i, 0] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=lambda s: int(s.replace("_", "")), default=400_000)
    parser.add_argument("--block-rows", type=int, default=5_000)
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="tierflow-rows-")
    try:
        path = os.path.join(folder, "rows.npy")
        data = np.random.default_rng(0).standard_normal((args.rows, 8), dtype=np.float32)
        np.save(path, data)
        x = tw.from_npy(path, rows=args.block_rows)
        scores = x.map_blocks(score, dtype=np.float64, row_shape=(1,))
        print(f"{args.rows:,} rows x 8 float32 in blocks of {args.block_rows:,} rows")

        results = {}
        for executor in ("serial", "threads", "processes", "processes"):
            start = time.perf_counter()
            total = scores.sum(axis=0).compute(executor=executor, progress=False)
            seconds = time.perf_counter() - start
            first = executor == "processes" and executor not in results
            note = " (the first compute starts the worker pool)" if first else ""
            results.setdefault(executor, total)
            print(f"{executor:>9}: {seconds:6.2f} s{note}")
        same = all(np.allclose(v, results["serial"]) for v in results.values())
        print(f"the three executors agree: {same}")

        scores.to_npy(os.path.join(folder, "scores.npy"), executor="processes", progress=False)
        written = np.load(os.path.join(folder, "scores.npy"), mmap_mode="r")
        print(f"scores.npy: {written.shape} {written.dtype}, first rows match: "
              f"{np.allclose(written[:1000], score(data[:1000]))}")  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
