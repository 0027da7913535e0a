"""Checks shared by the operators (block inputs, caller-provided output blocks) and the
width of the wide views their fast paths use."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def wide_fold(row_elements: int, wide_elements: int) -> int:
    """Rows per row of a wide view: the largest power of two ``f`` with
    ``f * row_elements <= wide_elements``; 1 when a row alone is that wide (or empty).

    A C-contiguous block of rows with ``row_elements`` elements each, seen flat, is a
    ``(-1, f * row_elements)`` array whose element ``k`` belongs to column
    ``k % row_elements``: NumPy runs its inner loops over the wide rows instead of over
    one narrow row at a time.

    >>> wide_fold(8, 1024), wide_fold(3, 1024), wide_fold(2000, 1024)
    (128, 256, 1)
    """
    if row_elements <= 0 or 2 * row_elements > wide_elements:
        return 1
    fold = wide_elements // row_elements
    return 1 << (fold.bit_length() - 1)


def check_blocks(
    blocks: Sequence[np.ndarray],
    dtypes: Sequence[np.dtype],
    row_shapes: Sequence[tuple[int, ...]],
    what: str,
) -> int:
    """The common row count of ``blocks``; ValueError when they do not match the operator.

    ``what`` names the operator in the message. Raises TypeError for a block that is not
    a NumPy array.
    """
    if len(blocks) == len(dtypes):
        # The common case, checked without building anything: every block an ndarray of
        # the right dtype and row shape, all with the same number of rows.
        rows = -1
        for block, dtype, row_shape in zip(blocks, dtypes, row_shapes, strict=False):
            if (
                not isinstance(block, np.ndarray)
                or block.dtype != dtype
                or block.shape[1:] != row_shape
                or block.ndim != len(row_shape) + 1
                or (rows >= 0 and block.shape[0] != rows)
            ):
                break
            rows = block.shape[0]
        else:
            return max(rows, 0)
    _explain(blocks, dtypes, row_shapes, what)
    raise AssertionError("unreachable: _explain raises")  # pragma: no cover


def _explain(
    blocks: Sequence[np.ndarray],
    dtypes: Sequence[np.dtype],
    row_shapes: Sequence[tuple[int, ...]],
    what: str,
) -> None:
    """Raise the error that says why ``blocks`` do not match (see :func:`check_blocks`)."""
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


def prepare_out(
    out: np.ndarray | None,
    shape: tuple[int, ...],
    dtype: np.dtype,
    blocks: Sequence[np.ndarray],
    what: str,
) -> np.ndarray:
    """``out`` checked against the expected block of ``shape`` and ``dtype``, or a new
    uninitialised block.

    Raises ValueError for the wrong shape or dtype, or an ``out`` that overlaps an input
    (sub-blocked evaluation would read rows it has already overwritten).
    """
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
