"""Shared test helpers: random data per dtype and running operators block by block."""

from __future__ import annotations

from typing import Any

import numpy as np

from tierflow.operators.selection import block_bounds

DTYPES = [
    np.dtype(d)
    for d in (
        bool,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.float16,
        np.float32,
        np.float64,
    )
]
FLOATS = [np.dtype(d) for d in (np.float16, np.float32, np.float64)]


def random_array(
    rng: np.random.Generator,
    dtype: np.dtype,
    shape: tuple[int, ...],
    *,
    span: tuple[float, float] = (-4.0, 4.0),
    wide_ints: bool = False,
) -> np.ndarray:
    """Random values of ``dtype``: floats in ``span``, integers in 4 times ``span`` (or
    over their whole range with ``wide_ints``)."""
    dtype = np.dtype(dtype)
    low, high = span
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if wide_ints:
            return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
        lo, hi = max(info.min, int(low) * 4), min(info.max, int(high) * 4)
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)


def with_nans(rng: np.random.Generator, values: np.ndarray, fraction: float) -> np.ndarray:
    """``values`` (floats) with about ``fraction`` of them set to NaN, in place."""
    values[rng.random(values.shape) < fraction] = np.nan
    return values


def combine_all(op: Any, partials: list[Any], rng: np.random.Generator | None) -> Any:
    """Combine partials in a random tree order (in row order when not commutative)."""
    partials = list(partials)
    if rng is None or not op.commutative:
        result = partials[0]
        for p in partials[1:]:
            result = op.combine(result, p)
        return result
    while len(partials) > 1:
        i, j = sorted(rng.choice(len(partials), size=2, replace=False))
        b = partials.pop(j)
        a = partials.pop(i)
        if rng.random() < 0.5:
            a, b = b, a
        partials.append(op.combine(a, b))
    return partials[0]


def run_blockwise(
    op: Any, x: np.ndarray, block_rows: int, rng: np.random.Generator | None = None
) -> Any:
    """Run a BlockOp or a ReductionOp over ``x`` cut into blocks of ``block_rows`` rows,
    the way the engine will."""
    bounds = block_bounds(x.shape[0], block_rows) or [(0, 0)]
    if op.row_independent:
        pieces = [op.apply(x[start:stop]) for start, stop in bounds]
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    partials = [op.chunk(x[start:stop], row_offset=start) for start, stop in bounds]
    return op.aggregate(combine_all(op, partials, rng))
