"""The operators layer: what runs on one row block.

Contracts in :mod:`~tierflow.operators.types` (``BlockOp``, ``ReductionOp``); elementwise
expressions in :mod:`~tierflow.operators.elementwise`, their cache-blocked evaluation in
:mod:`~tierflow.operators.fused`; reductions, selection and matrix products in the
modules of those names; the depth-first walk that expressions and the engine's graph
share in :mod:`~tierflow.operators.dag`. ``docs/operators.md`` describes how the engine
uses them.
"""

from .elementwise import (
    Apply,
    AsType,
    Clip,
    Const,
    Expr,
    Input,
    Round,
    Where,
    astype,
    call,
    clip,
    evaluate,
    infer,
    result_dtype,
    round_,
    token,
    where,
)
from .fused import FusedKernel, FusedReduction
from .linalg import Matmul, RowContraction, matmul
from .reductions import Histogram, Reduction, RowReduction, RowwiseReduction, reduction
from .types import BlockOp, ReductionOp, block_bytes

__all__ = [
    "Apply",
    "AsType",
    "BlockOp",
    "Clip",
    "Const",
    "Expr",
    "FusedKernel",
    "FusedReduction",
    "Histogram",
    "Input",
    "Matmul",
    "Reduction",
    "ReductionOp",
    "Round",
    "RowContraction",
    "RowReduction",
    "RowwiseReduction",
    "Where",
    "astype",
    "block_bytes",
    "call",
    "clip",
    "evaluate",
    "infer",
    "matmul",
    "reduction",
    "result_dtype",
    "round_",
    "token",
    "where",
]
