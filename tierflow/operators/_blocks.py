"""Checks shared by the operators: block inputs and caller-provided output blocks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_blocks(
    blocks: Sequence[np.ndarray],
    dtypes: Sequence[np.dtype],
    row_shapes: Sequence[tuple[int, ...]],
    what: str,
) -> int:
    """The common row count of ``blocks``; ValueError when they do not match the operator.

    ``what`` names the operator in the message.
    """
    if len(blocks) != len(dtypes):
        raise ValueError(f"{what} takes {len(dtypes)} block(s), {len(blocks)} were given")
    rows = None
    for i, (block, dtype, row_shape) in enumerate(zip(blocks, dtypes, row_shapes, strict=True)):
        if not isinstance(block, np.ndarray):
            raise TypeError(f"{what}: block {i} is a {type(block).__name__}, not a NumPy array")
        if block.dtype != dtype or block.shape[1:] != row_shape or block.ndim != len(row_shape) + 1:
            raise ValueError(
                f"{what} was built for block {i} of dtype {dtype} and shape "
                f"(rows, {', '.join(map(str, row_shape))}), got dtype {block.dtype} and "
                f"shape {block.shape}"
            )
        if rows is None:
            rows = block.shape[0]
        elif block.shape[0] != rows:
            raise ValueError(
                f"{what}: blocks must have equal row counts, block 0 has {rows} rows and "
                f"block {i} has {block.shape[0]}"
            )
    return rows or 0


def prepare_out(
    out: np.ndarray | None,
    rows: int,
    row_shape: tuple[int, ...],
    dtype: np.dtype,
    blocks: Sequence[np.ndarray],
    what: str,
) -> np.ndarray:
    """``out`` checked against the expected block, or a new uninitialised block.

    Raises ValueError for the wrong shape or dtype, or an ``out`` that overlaps an input
    (sub-blocked evaluation would read rows it has already overwritten).
    """
    shape = (rows, *row_shape)
    if out is None:
        return np.empty(shape, dtype=dtype)
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(
            f"{what}: out has shape {out.shape} and dtype {out.dtype}, expected shape "
            f"{shape} and dtype {dtype}"
        )
    for i, block in enumerate(blocks):
        if np.may_share_memory(out, block):
            raise ValueError(f"{what}: out overlaps input block {i}; give a separate output block")
    return out
