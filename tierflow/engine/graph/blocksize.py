"""The engine's block-size rule: how many rows a block gets when ``rows=`` is not given.

Every constructor (``from_npy``, ``from_raw``, ``from_array``, ``from_files``,
``persist``) and every operator whose output rows are wider than its input's
(``map_blocks``, ``@``) takes its blocks from here::

    block bytes  = budget / max(16, 4 x workers), clamped to [1 MB, 32 MB]
    rows         = block bytes / row bytes                        (at least 1)
    rows         = min(rows, max(n_rows / (4 x workers), 1 MB / row bytes))

So every block but the last holds 1 MB to 32 MB, in whole rows (less only when the
whole array is smaller, more only when a single row is bigger), and every worker gets
at least four blocks of an array that is big enough to share. Why no more than 32 MB: the work inside a block runs in
cache-sized sub-blocks, so a bigger block buys nothing but a longer wait at the start
and the end of a pass, and more memory per task in flight.

Files loaded by ``from_files`` are counted in files per block: the same byte target,
and at most ``n_files / (4 x workers)`` files per block with no 1 MB floor, because
loading a file costs far more than reading its bytes, so every core should get files.

Outputs obey the cap too (:func:`output_bounds`). A block operator whose rows are wider
than its input's (8 values in, 512 out) would otherwise turn a 32 MB input block into a
2 GB output block. Its blocks are cut so that each output block holds at most the
larger of 32 MB and the input block it is made from (a block the user asked for with
``rows=`` keeps its size when the operator does not widen it). The cut depends only on
the row sizes and the input's blocks, never on the budget, so cache keys stay stable.
Where the row count is unknown until computed (after a boolean mask), blocks cannot be
cut in advance; the scheduler's out-of-memory halving still applies there.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import numpy as np

from ...config import MB
from ...operators import selection
from ...storage import stream
from ...system import budget, devices

__all__ = [
    "BLOCKS_PER_WORKER",
    "MAX_BLOCK_BYTES",
    "MIN_BLOCK_BYTES",
    "bounds",
    "default_rows",
    "files_per_block",
    "output_bounds",
]

MAX_BLOCK_BYTES = 32 * MB  # bytes of one block, inputs and outputs
MIN_BLOCK_BYTES = 1 * MB  # bytes below which a block is not made smaller to spread work
BLOCKS_PER_WORKER = 4  # an array is spread over at least this many blocks per worker
MIN_SHARE = 16  # a block is at most budget / 16, whatever the number of workers


def _workers() -> int:
    try:
        return max(1, devices.cpu_cores())
    except Exception:
        return max(1, os.cpu_count() or 1)


def _block_bytes(workers: int) -> int:
    """The byte target of one block: the budget's share, clamped to [1 MB, 32 MB]."""
    share = max(MIN_SHARE, BLOCKS_PER_WORKER * workers)
    return min(MAX_BLOCK_BYTES, max(MIN_BLOCK_BYTES, budget.budget_bytes() // share))


def default_rows(row_nbytes: int, n_rows: int | None = None) -> int:
    """Rows per block for rows of ``row_nbytes`` bytes (see the module docstring);
    ``n_rows``, when known, spreads the array over every worker. At least 1."""
    workers = _workers()
    row = max(1, row_nbytes)  # rows of 0 bytes (a zero-width axis) count as 1 byte
    rows = _block_bytes(workers) // row
    if n_rows:
        spread = math.ceil(n_rows / (BLOCKS_PER_WORKER * workers))
        rows = min(rows, max(spread, MIN_BLOCK_BYTES // row))
    return max(1, rows)


def bounds(n_rows: int, rows: Any, row_nbytes: int) -> tuple[int, ...]:
    """Block boundaries ``(0, ..., n_rows)`` of an array: ``rows`` rows per block when
    given (checked: an integer >= 1), the rows of each block when ``rows`` is a
    sequence (dask's chunks along axis 0: they must add up to ``n_rows``; empty blocks
    are left out), else :func:`default_rows`.

    >>> bounds(10, (4, 0, 6), 8)
    (0, 4, 10)
    """
    if isinstance(rows, (tuple, list, np.ndarray)):
        return _given(n_rows, rows)
    step = stream.check_rows(rows) or default_rows(row_nbytes, n_rows)
    return (0, *(stop for _, stop in selection.block_bounds(n_rows, step)))


def _given(n_rows: int, rows: Any) -> tuple[int, ...]:
    sizes = []
    for r in rows:
        if isinstance(r, (bool, np.bool_)) or not hasattr(r, "__index__"):
            raise TypeError(f"rows: each block's rows must be an integer, got {r!r}")
        if int(r) < 0:
            raise ValueError(f"rows: a block cannot have {int(r)} rows")
        sizes.append(int(r))
    if sum(sizes) != n_rows:
        raise ValueError(
            f"rows: the blocks' rows add up to {sum(sizes)}, but the array has {n_rows} rows"
        )
    return (0, *itertools.accumulate(s for s in sizes if s))


def files_per_block(n_files: int, file_nbytes: int) -> int:
    """Files per block of ``from_files`` when ``rows=`` is not given: the block byte
    target for files of ``file_nbytes`` bytes, and at most ``n_files / (4 x workers)``."""
    workers = _workers()
    spread = math.ceil(n_files / (BLOCKS_PER_WORKER * workers))
    by_bytes = _block_bytes(workers) // max(1, file_nbytes)
    return max(1, min(spread, by_bytes))


def output_bounds(
    in_bounds: tuple[int, ...], in_row_nbytes: int, out_row_nbytes: int
) -> tuple[int, ...]:
    """``in_bounds`` with each block cut so that its output (rows of ``out_row_nbytes``
    bytes) holds at most the larger of :data:`MAX_BLOCK_BYTES` and the block's input
    (rows of ``in_row_nbytes``). The same tuple when no block needs cutting.

    >>> output_bounds((0, 1000), 32, 32)
    (0, 1000)
    >>> output_bounds((0, 1 << 20), 32, 2048)[:3]
    (0, 16384, 32768)
    """
    if out_row_nbytes <= in_row_nbytes:
        return in_bounds  # never bigger than its input: nothing to cut
    cut: list[int] = [0]
    changed = False
    for a, b in itertools.pairwise(in_bounds):
        rows = b - a
        need = rows * out_row_nbytes
        limit = max(MAX_BLOCK_BYTES, rows * in_row_nbytes)
        if need <= limit:
            cut.append(b)
            continue
        most = max(1, limit // out_row_nbytes)  # rows an output block may hold
        step = math.ceil(rows / math.ceil(rows / most))  # equal pieces, none over most
        cut.extend(range(a + step, b, step))
        cut.append(b)
        changed = True
    return tuple(cut) if changed else in_bounds
