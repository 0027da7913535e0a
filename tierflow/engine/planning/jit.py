"""Which operators of a program get a compiled kernel, and when it is asked for.

Lowering (pure) gives every :class:`~tierflow.operators.fused.FusedReduction` of a pass
(a built-in row reduction or a histogram of an elementwise expression), every built-in
row reduction of an array itself and its unweighted ``np.bincount``, every such reduction of the rows a mask keeps where
the mask is an expression of single values of those rows (then it reads the unfiltered
blocks: :class:`~tierflow.operators.compiled.tiered.MaskedKernelChunker`), and every
fused elementwise kernel without an epilogue
(:class:`~tierflow.operators.fused.FusedKernel`) its kernel's source, or the reason it
has none (:func:`attach`); nothing compiles then.
When the compute starts (:func:`start`, from :meth:`Plan.open
<tierflow.engine.planning.plan.Plan.open>` and from a pass lowered while it runs), a
reduction over at least ``jit_min_bytes`` of input asks the background thread for its
kernel; a smaller one uses a kernel this process already has, and never asks: it would
end before the compiler did. Blocks run on the NumPy path until the kernel is ready
(:mod:`tierflow.operators.compiled.tiered`).

Switches, the first that says no wins: ``jit=False`` on a compute or a sink,
``config.set(jit=False)`` or ``TIERFLOW_JIT=0``, and numba missing (said once).
``jit="eager"`` makes the compute wait for its kernels before its first block, whatever
its size (tests and benchmarks that must run the compiled path).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import config
from ...operators import elementwise as ew
from ...operators import fused, selection
from ...operators.compiled import Unsupported, elementwise_source, reduction_source, tiered
from ...operators.compiled.source import bincount_source, histogram_source, masked_source
from ...operators.compiled.tiered import CompiledSlot, KernelChunker, MaskedKernelChunker
from ...operators.reductions import Histogram, RowReduction
from ...system import budget as budget_module
from ..graph import Chunked
from ..program.program import Program
from ..program.steps import FilterStep, KernelStep, UnfilteredStep
from ..rowwide.frequencies import Bincount

__all__ = ["MIN_BUDGET", "JitSettings", "attach", "room_for_kernels", "settings", "start"]

# A process loads kernels only with a memory budget of at least this (bytes): numba and
# llvmlite add about 100 MB to a process, which a small worker (a Dask worker of 300 MB)
# does not have. Such a process runs the NumPy path, and its profile line says why.
MIN_BUDGET = 1 << 30


def room_for_kernels() -> str | None:
    """None where this process's budget leaves room for numba, else why not."""
    budget = budget_module.budget_bytes()
    if budget < MIN_BUDGET:
        return (
            f"the memory budget ({config.format_bytes(budget)}) is under "
            f"{config.format_bytes(MIN_BUDGET)}, too small to load numba"
        )
    return None


tiered.set_policy(room_for_kernels)  # worker processes follow it too: they import this


@dataclass(frozen=True)
class JitSettings:
    """Where kernels are kept, and from how many input bytes a compute compiles."""

    folder: str
    min_bytes: int
    eager: bool = False  # wait for the kernels before the first block


def settings(jit: bool | str | None) -> JitSettings | None:
    """The compute's kernel settings; None when ``jit`` (the compute's option: True,
    False or ``"eager"``; None: the ``jit`` setting) turns kernels off."""
    choice = config.get("jit") if jit is None else jit
    if choice not in (True, False, "eager"):
        raise ValueError(f"jit={choice!r}: use True, False or 'eager'")
    if choice is False:
        return None
    folder = config.get("kernel_dir")
    if folder is None:
        folder = os.path.join(os.path.expanduser(config.get("store_dir")), ".kernels")
    return JitSettings(
        os.path.expanduser(folder), int(config.get("jit_min_bytes")), choice == "eager"
    )


def attach(program: Program, enabled: bool) -> None:
    """Give each fused reduction, each built-in reduction of an input itself and each
    fused elementwise kernel its kernel's source, or the reason it has none (pure)."""
    for step in program.steps():
        if isinstance(step, KernelStep) and isinstance(step.op, fused.FusedKernel):
            _attach_elementwise(step, enabled)
    for root in program.reductions:
        chunker = root.chunker
        if enabled and _attach_masked(root):
            continue
        op: Any
        if isinstance(chunker, fused.FusedReduction):
            op = chunker.reduction
            kernel = chunker.kernel
            expr, dtypes, shapes = kernel.expr, kernel.input_dtypes, kernel.input_row_shapes
        elif enabled and chunker is root.op and isinstance(chunker, RowReduction):
            op = chunker
            expr, dtypes, shapes = ew.Input(0), [op.in_dtype], [op.in_row_shape]
        elif enabled and chunker is root.op and isinstance(chunker, Bincount):
            _attach_bincount(root)
            continue
        else:
            continue
        slot: CompiledSlot | None = None
        why: str | None = "jit is off"
        if enabled:
            slot, why = _slot(expr, dtypes, shapes, op)
        if isinstance(chunker, fused.FusedReduction):
            chunker.compiled, chunker.not_compiled = slot, why
        else:
            root.chunker = KernelChunker(op, slot, why)


def _attach_bincount(root: Any) -> None:
    """``np.bincount`` of an integer array itself (unweighted): one compiled pass that
    counts, where NumPy's finds the smallest and the largest value first."""
    op = root.op
    dtype = root.inputs[0].node.dtype
    slot, why = _slot(ew.Input(0), [dtype], [()], op)
    root.chunker = KernelChunker(op, slot, why)


def _attach_elementwise(step: KernelStep, enabled: bool) -> None:
    kernel = step.op
    if not enabled:
        kernel.not_compiled = "jit is off"
        return
    if kernel.epilogue is not None:
        kernel.not_compiled = f"an epilogue ({kernel.epilogue!r}) is not compiled"
        return
    try:
        source = elementwise_source(kernel.expr, kernel.input_dtypes, kernel.input_row_shapes)
    except Unsupported as exc:
        kernel.not_compiled = str(exc)
        return
    kernel.compiled = CompiledSlot(source)


def _attach_masked(root: Any) -> bool:
    """Whether ``root`` is a built-in row reduction of the rows a mask keeps, with a
    mask that is a fused kernel of single values of the same rows
    (``x[x[:, 0] > 0.5].sum(0)``), and now reduces the unfiltered blocks in one
    compiled pass (:class:`~tierflow.operators.compiled.tiered.MaskedKernelChunker`)."""
    op = root.op
    if root.chunker is not op or not isinstance(op, RowReduction) or len(root.inputs) != 1:
        return False
    if root.device_reduce is not None:
        return False  # its device form reduces the filter's rows on the GPU
    step = root.inputs[0]
    if not isinstance(step, FilterStep) or not isinstance(step.mask, KernelStep):
        return False
    mask = step.mask.op
    if not isinstance(mask, fused.FusedKernel) or mask.epilogue is not None:
        return False
    data: Any = step.source
    data_kernel = None
    inputs: list[Any] = [data]
    if isinstance(data, KernelStep) and isinstance(data.op, fused.FusedKernel):
        if data.op.epilogue is not None:
            return False
        data_kernel, inputs = data.op, list(data.inputs)
    columns: list[tuple[int, Any]] = []
    places: list[tuple[int, int]] = []
    column: Any
    for column in step.mask.inputs:
        index = getattr(column, "op", None)
        if not isinstance(index, selection.TrailingIndex) or column.inputs[0] not in inputs:
            return False
        flat = _flat_column(index)
        if flat is None:
            return False
        position = inputs.index(column.inputs[0])
        columns.append((position, index))
        places.append((position, flat))
    expr = ew.Input(0) if data_kernel is None else data_kernel.expr
    dtypes = [op.in_dtype] if data_kernel is None else data_kernel.input_dtypes
    shapes = [op.in_row_shape] if data_kernel is None else data_kernel.input_row_shapes
    try:
        source = masked_source(expr, dtypes, shapes, mask.expr, places, op)
    except Unsupported:
        return False
    slot = CompiledSlot(source, op)
    root.chunker = MaskedKernelChunker(op, slot, data_kernel, mask, columns, len(inputs))
    root.inputs = [UnfilteredStep(step, s) for s in inputs]
    return True


def _flat_column(index: Any) -> int | None:
    """The element within a row that a row selection ``x[:, j]`` (or ``x[:, i, j]``)
    picks, or None for another selection."""
    key = index.key
    if not key or key[0] != slice(None) or len(key) != len(index.in_row_shape) + 1:
        return None
    picks = key[1:]
    if not all(isinstance(k, (int, np.integer)) for k in picks):
        return None
    shape = index.in_row_shape
    flat = 0
    for k, n in zip(picks, shape, strict=True):
        if not -n <= k < n:
            return None
        flat = flat * n + (k % n)
    return flat


def _slot(
    expr: ew.Expr, dtypes: list[Any], shapes: list[tuple[int, ...]], op: Any
) -> tuple[CompiledSlot | None, str | None]:
    """The compiled slot of ``op`` over ``expr``, or why there is none."""
    histogram = getattr(op, "histogram", None)
    counting = isinstance(op, Bincount)
    if not isinstance(op, RowReduction) and not isinstance(histogram, Histogram) and not counting:
        return None, f"{type(op).__name__} is not compiled"
    if counting and op.weighted:
        return None, "a bincount with weights is not compiled"
    try:
        if histogram is not None:
            source = histogram_source(expr, dtypes, shapes, histogram)
        elif counting:
            source = bincount_source(expr, dtypes, shapes)
        else:
            source = reduction_source(expr, dtypes, shapes, op)
    except Unsupported as exc:
        return None, str(exc)
    return CompiledSlot(source, op), None


def start(program: Program, jit: JitSettings | None) -> None:
    """Ask for the kernels of ``program`` that pay (see the module docstring)."""
    if jit is None:
        return
    asked: list[tuple[CompiledSlot, Any]] = [
        (step.op.compiled, step.node)
        for step in program.steps()
        if isinstance(step, KernelStep) and getattr(step.op, "compiled", None) is not None
    ]
    asked += [
        (root.chunker.compiled, root.reduced)
        for root in program.reductions
        if getattr(root.chunker, "compiled", None) is not None
    ]
    for slot, node in asked:
        if jit.eager:
            slot.start(jit.folder)
            slot.wait()
        elif slot.loaded() or _input_bytes(slot, node) >= jit.min_bytes:
            slot.start(jit.folder)


def _input_bytes(slot: CompiledSlot, node: Any) -> float:
    """Bytes a kernel reads: the rows of ``node`` (the array it computes or reduces)
    times its inputs' row bytes (rows not known yet: those of what they come from, a
    mask's source; none known: many)."""
    rows = _upper_rows(node)
    if rows is None:
        return math.inf
    source = slot.source
    row_bytes = sum(d.itemsize for d in source.input_dtypes) * source.row_elements
    return float(rows) * row_bytes


def _upper_rows(node: Any, depth: int = 8) -> int | None:
    """``node``'s rows, or for rows not known yet (after a mask) the most rows of the
    arrays it is made from; None where none is known."""
    if node.n_rows is not None or depth == 0:
        return node.n_rows
    found = [_upper_rows(n, depth - 1) for n in node.inputs if isinstance(n, Chunked)]
    known = [n for n in found if n is not None]
    return max(known) if known else None
