"""Compiled reductions of the rows a mask keeps, in one pass over the unfiltered blocks,
against the filter then the reduction on the NumPy path."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("numba")

from tierflow.operators.compiled.source import Unsupported, masked_source
from tierflow.operators.compiled.tiered import CompiledSlot, MaskedKernelChunker
from tierflow.operators.elementwise import Expr, Input, call
from tierflow.operators.fused import FusedKernel
from tierflow.operators.reductions import reduction
from tierflow.operators.selection import TrailingIndex

x = Input(0)


def _chunker(  # noqa: PLR0913 -- the reduction, then its mask, then its values
    kind: str, dtype: str, mask: Expr, column: int, folder: Path, data: Expr | None = None
) -> MaskedKernelChunker:
    data_kernel = None if data is None else FusedKernel(data, [dtype], [(4,)])
    in_dtype = np.dtype(dtype) if data_kernel is None else data_kernel.out_dtype
    op = reduction(kind, in_dtype, (4,), axis=0)
    index = TrailingIndex(np.dtype(dtype), (4,), column)
    mask_kernel = FusedKernel(mask, [dtype], [()])
    source = masked_source(
        data if data is not None else x, [dtype], [(4,)], mask, [(0, column)], op
    )
    slot = CompiledSlot(source, op)
    slot.start(folder)
    assert slot.wait(120), slot.state()
    return MaskedKernelChunker(op, slot, data_kernel, mask_kernel, [(0, index)], 1)


def _numpy(chunker: MaskedKernelChunker, block: np.ndarray) -> Any:
    keep = chunker.mask.apply(chunker.columns[0][1].apply(block))
    values = block if chunker.data is None else chunker.data.apply(block)
    kept = values[keep]
    return None if not len(kept) else chunker.reduction.chunk(kept)


@pytest.mark.parametrize("kind", ["sum", "mean", "min", "max", "var", "count_nonzero", "any"])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_the_kept_rows_reduce_as_the_filter_then_the_reduction(
    kind: str, dtype: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.getbasetemp() / "kernels-masked"
    rng = np.random.default_rng(5)
    block = (rng.random((3001, 4)) * 100).astype(dtype)
    chunker = _chunker(kind, dtype, call(np.greater, x, 50), 2, folder)
    done, partial = chunker.compiled.masked_partial([block], 3001, lambda n: block[:n])
    assert done
    got, want = chunker.aggregate(partial), chunker.aggregate(_numpy(chunker, block))
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_allclose(got, want, rtol=2e-6 if dtype == "float32" else 1e-12)


def test_a_mask_that_keeps_no_row_gives_the_partial_of_no_rows(tmp_path: Path) -> None:
    block = np.ones((100, 4), np.float32)
    chunker = _chunker("sum", "float32", call(np.less, x, 0), 0, tmp_path)
    assert chunker.compiled.masked_partial([block], 100, lambda n: block[:n]) == (True, None)
    assert chunker.chunk(block) is None


def test_an_expression_of_the_kept_rows_and_a_var_shift_from_all_rows(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    block = rng.random((5000, 4)).astype(np.float32) + 1000
    chunker = _chunker("var", "float32", call(np.greater, x, 1000.9), 1, tmp_path, data=x * 2 - 1)
    got = chunker.aggregate(chunker.chunk(block))
    kept = (block * np.float32(2) - 1)[block[:, 1] > 1000.9].astype(np.float64)
    np.testing.assert_allclose(got, kept.var(axis=0), rtol=4e-6)


def test_an_error_in_the_mask_or_the_values_goes_back(tmp_path: Path) -> None:
    block = np.full((50, 4), 3e38, np.float32)
    overflowing_mask = _chunker("sum", "float32", call(np.greater, x * 10, 0), 0, tmp_path)
    assert overflowing_mask.compiled.masked_partial([block], 50, lambda n: block[:n])[0] is False
    with pytest.warns(RuntimeWarning, match="overflow"):
        overflowing_mask.chunk(block)
    nan = np.ones((50, 4), np.float32)
    nan[3, 1] = np.nan
    chunker = _chunker("sum", "float32", call(np.greater, x, 0), 0, tmp_path)
    assert chunker.compiled.masked_partial([nan], 50, lambda n: nan[:n])[0] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(chunker.aggregate(chunker.chunk(nan))[1])


def test_arg_reductions_after_a_mask_are_not_compiled() -> None:
    op = reduction("argmax", np.float32, (4,), axis=0)
    with pytest.raises(Unsupported, match="argmax after a mask"):
        masked_source(x, ["float32"], [(4,)], call(np.greater, x, 0), [(0, 0)], op)


def test_kernels_of_other_dtypes_have_other_keys() -> None:
    """The key covers every argument's type (warm() names them), so a kernel never
    meets arguments it was not compiled for, which would compile it in this process."""
    keys = set()
    for dtype in ("int8", "int16", "float32"):
        op = reduction("sum", np.dtype(dtype), (4,), axis=0)
        mask = call(np.greater, x, 3)
        keys.add(masked_source(x, [dtype], [(4,)], mask, [(0, 1)], op).key)
    assert len(keys) == 3
