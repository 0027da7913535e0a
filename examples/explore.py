"""Exploring a big ``.npy`` file the way one would in a notebook, without loading it.

    python examples/explore.py                                 # 4M rows x 8 (122 MB)
    python examples/explore.py --rows 100_000_000 --budget 1GB # 3 GB, a bigger run

Each step below is what one notebook cell would hold; in Jupyter the lazy arrays,
``memory.status()`` and ``memory.report()`` show as tables and the progress bar as a
widget. The file is generated in a temporary folder (removed at the end): 8 float32
columns of noise with different means and scales, and one planted spike in column 3.

- ``repr`` of a lazy array: shape, dtype, size, blocks, sources and pending operations,
  without computing anything;
- ``head()``: the first rows, reading only the first block;
- quick statistics of every column in one pass (``tw.compute`` of mean, std, min, max);
- a boolean mask, ``x[x[:, 0] > 0]``: rows unknown (``?``) until computed, and
  statistics of the masked rows;
- ``np.histogram`` of a column, drawn as text;
- ``argmax`` finding the spike, and that one row;
- a random sample of rows, ``x[np.sort(positions)]``, and ``np.cumsum`` along the columns;
- ``visualize()`` of a pipeline: a text drawing of the graph (graphviz when installed);
- ``persist()`` of the masked rows, then ``memory.status()`` and ``memory.report()``
  showing where the result lives (RAM while it fits the budget, else the SSD).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import numpy as np

import tierflow as tw
from tierflow import config, memory
from tierflow.config import format_bytes, parse_size

COLUMNS = 8
SPIKE_COLUMN = 3


def write_file(path: str, rows: int) -> int:
    """A float32 ``.npy`` of ``rows`` x COLUMNS, written in pieces; returns the row of
    the planted spike (1000.0 in SPIKE_COLUMN)."""
    rng = np.random.default_rng(11)
    spike = int(rng.integers(rows))
    shift = np.arange(COLUMNS, dtype=np.float32)  # column 0 is centred on 0: a mask
    # x[:, 0] > 0 keeps about half the rows
    scale = np.linspace(1, 8, COLUMNS, dtype=np.float32)
    step = 1 << 17
    with open(path, "wb") as f:
        header = {"descr": "<f4", "fortran_order": False, "shape": (rows, COLUMNS)}
        np.lib.format.write_array_header_1_0(f, header)
        for start in range(0, rows, step):
            piece = rng.standard_normal((min(step, rows - start), COLUMNS), dtype=np.float32)
            piece *= scale
            piece += shift
            if start <= spike < start + len(piece):
                piece[spike - start, SPIKE_COLUMN] = 1000.0
            f.write(piece.tobytes())
    return spike


def cell(title: str) -> None:
    print(f"\n# -- {title}")


def run(rows: int, budget: int, folder: str | None) -> None:
    config.set(ram_budget=budget)  # bytes; memory.budget("64MB") does the same
    np.set_printoptions(precision=3, suppress=True, linewidth=100)
    workdir = tempfile.mkdtemp(prefix="tierflow-explore-", dir=folder)
    try:
        path = os.path.join(workdir, "sensors.npy")
        spike = write_file(path, rows)
        print(f"{path}: {format_bytes(os.path.getsize(path))}, RAM budget {format_bytes(budget)}")

        cell("open it: only the header is read")
        x = tw.from_npy(path)
        print(repr(x))

        cell("x.head(): the first rows, from the first block only")
        print(x.head().compute())

        cell("quick stats: four reductions, one pass over the file")
        mean, std, lo, hi = tw.compute(x.mean(axis=0), x.std(axis=0), x.min(axis=0), x.max(axis=0))
        print("column      mean       std       min       max")
        for c in range(COLUMNS):
            print(f"{c:>6} {mean[c]:>9.3f} {std[c]:>9.3f} {lo[c]:>9.3f} {hi[c]:>9.3f}")

        cell("a boolean mask: x[x[:, 0] > 0]")
        positive = x[x[:, 0] > 0]
        print(repr(positive))
        count, positive_mean = tw.compute((x[:, 0] > 0).sum(), positive.mean(axis=0))
        print(f"{count:,} of {rows:,} rows have x[:, 0] > 0 ({count / rows:.1%})")
        print(f"their column means: {positive_mean}")

        cell("np.histogram of column 1 (the range is needed up front: we have it)")
        # On a lazy array np.histogram returns (lazy counts, edges): edges are known now.
        lazy_counts, edges = np.histogram(x[:, 1], bins=12, range=(float(lo[1]), float(hi[1])))
        (counts,) = tw.compute(lazy_counts)
        tallest = max(int(counts.max()), 1)
        for a, b, n in zip(edges[:-1], edges[1:], counts, strict=True):
            print(f"[{a:+7.2f}, {b:+7.2f}) {n:>9,} {'#' * round(40 * n / tallest)}")

        cell(f"argmax: where is the largest value of column {SPIKE_COLUMN}?")
        where = int(x[:, SPIKE_COLUMN].argmax().compute())
        print(f"row {where:,} (the spike was planted at row {spike:,}): {x[where].compute()}")
        if where != spike:
            raise SystemExit(f"argmax found row {where}, not the planted spike at {spike}")

        cell("a random sample of 5 rows: sorted positions are picked block by block")
        picks = np.sort(np.random.default_rng(5).choice(rows, size=min(5, rows), replace=False))
        sample = x[picks]
        print(f"rows {picks.tolist()}:")
        print(sample.compute())
        print(
            "their running totals along the columns (np.cumsum, axis=1), last column: "
            f"{np.cumsum(sample, axis=1)[:, -1].compute()}"
        )

        cell("visualize(): the graph of a pipeline, before it runs")
        standardised = ((x - mean) / std)[x[:, 0] > 0]
        print(standardised.max(axis=0).visualize())

        cell("persist() the masked rows, then ask where the bytes are")
        kept = positive.persist()
        print(repr(kept))
        print(memory.status())
        print(memory.report())
        del kept  # its spill file, if it has one, is deleted with its last reference
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="rows (4_000_000)")
    parser.add_argument("--budget", default="64MB", help="RAM budget (64MB)")
    parser.add_argument("--dir", default=None, help="parent of the temporary folder (TMPDIR)")
    args = parser.parse_args()
    if args.rows < 1:
        parser.error(f"--rows must be at least 1, got {args.rows}")
    run(args.rows, parse_size(args.budget, "--budget"), args.dir)


if __name__ == "__main__":
    main()
