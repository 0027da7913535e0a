"""The contracts: every operator satisfies its protocol; docstring examples run."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest

from tierflow.operators.crossprod import CoMoments, CrossProduct
from tierflow.operators.elementwise import Input
from tierflow.operators.fused import FusedKernel, FusedReduction
from tierflow.operators.linalg import Matmul, RowContraction
from tierflow.operators.order_stats import ColumnStats
from tierflow.operators.reductions import Histogram, Reduction, reduction
from tierflow.operators.selection import TrailingIndex
from tierflow.operators.tsqr import TallQR
from tierflow.operators.types import BlockOp, ReductionOp, block_bytes, combine_partials

MODULES = ["types", "dag", "elementwise", "fused", "reductions", "selection", "linalg"]


def _block_ops() -> list[object]:
    return [
        FusedKernel(Input(0) * 2, [np.float32], [(3,)]),
        reduction("mean", np.float32, (3,), axis=1),
        Matmul(np.float32, (3,), np.ones((3, 2))),
        TrailingIndex(np.float32, (3,), slice(1, None)),
    ]


def _reduction_ops() -> list[object]:
    kernel = FusedKernel(Input(0) * 2, [np.float32], [(3,)])
    return [
        reduction("sum", np.float32, (3,)),
        FusedReduction(kernel, reduction("max", np.float32, (3,), axis=0)),  # type: ignore[arg-type]
        Histogram(np.float32, 4, (0, 1)),
        Reduction(len, lambda a, b: a + b),
        RowContraction(np.float32, (), np.ones(5), n_rows=5),
        ColumnStats(np.float32, (3,), flat=False),
        TallQR(np.float32, (3,)),
        CrossProduct([np.float32], [(3,)], symmetric=True),
        CoMoments([np.float32], [(3,)], ddof=1),
    ]


@pytest.mark.parametrize("op", _block_ops(), ids=repr)
def test_block_ops_follow_the_contract(op: object) -> None:
    assert isinstance(op, BlockOp)
    assert op.row_independent is True
    assert op.n_inputs == 1
    block = np.ones((6, 3), np.float32)
    result = op.apply(block)
    assert result.shape == (6, *op.out_row_shape)
    assert result.dtype == op.out_dtype
    assert op.temp_bytes(6) >= 0


@pytest.mark.parametrize("op", _reduction_ops(), ids=repr)
def test_reduction_ops_follow_the_contract(op: object) -> None:
    assert isinstance(op, ReductionOp)
    assert op.row_independent is False
    assert isinstance(op.commutative, bool)
    block = (
        np.ones((5, 3), np.float32)
        if not isinstance(op, RowContraction)
        else np.ones(5, np.float32)
    )
    partial = op.chunk(block, row_offset=0)
    assert op.combine(None, partial) is partial
    assert op.combine(partial, None) is partial
    op.aggregate(partial)
    assert op.temp_bytes(5) >= 0
    assert op.partial_bytes() > 0


def test_none_is_the_identity_of_combined_partials() -> None:
    merged: list[tuple[object, object]] = []

    def merge(a: object, b: object) -> object:
        merged.append((a, b))
        return (a, b)

    p, q = object(), object()
    assert combine_partials(None, p, merge) is p
    assert combine_partials(p, None, merge) is p
    assert combine_partials(None, None, merge) is None
    assert merged == []  # None never reaches the operator's merge
    assert combine_partials(p, q, merge) == (p, q)
    assert merged == [(p, q)]  # left before right


def test_block_bytes() -> None:
    assert block_bytes(1000, (8,), "float32") == 32_000
    assert block_bytes(3, (), np.int8) == 3
    assert block_bytes(0, (4, 4), np.float64) == 0


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"tierflow.operators.{name}")
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0
