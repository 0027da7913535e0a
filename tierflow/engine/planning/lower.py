"""Lowering: from the lazy graph to block programs, with fusion.

:class:`Lowering` turns the roots of one pass (its sinks and reductions, see
:mod:`tierflow.engine.planning.plan`) into the steps of a
:class:`~tierflow.engine.program.program.Program`:

* A maximal tree of elementwise nodes becomes one
  :class:`~tierflow.operators.fused.FusedKernel` over the nodes that feed it (sources,
  block maps, selections), evaluated in cache-sized sub-blocks with reused buffers.
  An elementwise node used by several roots is inlined into each (recomputing it from
  L2-resident sub-blocks is cheaper than writing a block-sized intermediate), unless it
  is itself a result (then the others read the result's block)::

      sqrt(x * 2 + 1).sum(0)   ->   ReduceRoot(FusedReduction(sqrt(add(multiply))))
                                      SourceStep(x)

* A reduction over the rows of an elementwise tree (a built-in row reduction, a
  histogram, an unweighted ``np.bincount``) becomes a
  :class:`~tierflow.operators.fused.FusedReduction`: no block-sized intermediate at all.
  A trailing-axis reduction, ``@ w`` or a trailing index after an elementwise tree is the
  kernel's epilogue.
* Every other node (sources, ``map_blocks``, slices, masks, concatenation, counted
  rows) is one step.
* A node the compute caches (:mod:`tierflow.engine.io.cache`) is never fused into its
  consumers: its step is wrapped in a :class:`~tierflow.engine.program.steps.CachedStep`.
* A pass that asks for a device (:func:`tierflow.engine.gpu.offload.pass_device`) gets the
  device form of every operator that has one (:func:`attach_device`): fused kernels
  without an epilogue whose operations torch does the NumPy way, ``map_blocks`` on a
  GPU, and the built-in sums, products, min/max, any/all, means and count_nonzero. In
  a block task on a GPU these run there, one after the other, on the block copied
  there once; the rest of the program runs on the host as before::

      x -> (x - m) * s -> map_blocks(model, device="cuda") -> sum(0)
           [copy x] TorchKernel  ->  model            ->  TorchReduction [partial back]

Lowering builds; it runs nothing and opens nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...operators import elementwise as ew
from ...operators import fused, reductions, torch_ops
from .. import graph
from ..gpu import offload
from ..graph import Chunked, Node, callsites
from ..graph.block_operators import MapBlocks
from ..program.program import Program
from ..program.roots import Accumulator, ReduceRoot, SinkRoot
from ..program.steps import (
    CachedStep,
    ConcatStep,
    CountedStep,
    FilterStep,
    KernelStep,
    SliceStep,
    SourceStep,
    Step,
    TakeStep,
)
from ..rowwide import external_sort, overlap, scans
from ..rowwide.frequencies import Bincount
from . import jit as jit_module

__all__ = ["Lowering", "attach_device", "lower_pass", "share_partials"]


def lower_pass(  # noqa: PLR0913 -- the pass, then the compute's options
    sinks: list[tuple[Chunked, Any]],
    reduces: list[graph.Reduce],
    values: dict[str, Any],
    cache: Any = None,
    device: str | None = None,
    *,
    jit: bool = False,
) -> tuple[Program, dict[str, Accumulator]]:
    """The program of a pass computing ``sinks`` (``(node, sink)``) and ``reduces``,
    with value nodes bound to ``values``, and each reduction's accumulator by key.
    ``device`` is the compute's ``device=`` (None: not given; see
    :func:`tierflow.engine.gpu.offload.pass_device`); ``jit`` gives fused reductions
    their compiled kernels' sources (:mod:`tierflow.engine.planning.jit`)."""
    lowering = Lowering(values, {n.ident for n, _ in sinks}, cache)
    accs: dict[str, Accumulator] = {}

    def acc_for(node: Node, op: Any) -> Accumulator:
        acc = Accumulator(op)
        accs[node.ident] = acc
        return acc

    roots = [SinkRoot(n, lowering.step(n), sink) for n, sink in sinks]
    program = Program(roots, share_partials([lowering.reduce_root(r, acc_for) for r in reduces]))
    program.origins = lowering.origins
    program.session = cache
    program.device = offload.pass_device(device, _gpu_map(program))
    if program.device is not None:
        program.work = attach_device(program)
    jit_module.attach(program, jit)
    return program, accs


def share_partials(roots: list[ReduceRoot]) -> list[ReduceRoot]:
    """The reduction roots, each that can derive its partial from another's over the same
    input told so (``tw.compute(x.mean(0), x.std(0))``: the mean from the variance's
    count and mean, one pass over each block instead of two; see
    :meth:`~tierflow.operators.reductions.RowReduction.derive_from`), givers first.

    Only built-in reductions of the input itself (not fused over an expression) and not
    cached share; a derived root whose giver did not run (skipped, or on a device)
    computes its own partial."""
    plain = [
        r
        for r in roots
        if r.chunker is r.op and r.cache is None and isinstance(r.op, reductions.RowReduction)
    ]
    for taker in plain:
        for giver in plain:
            if giver is taker or giver.derived_from is not None or giver.inputs != taker.inputs:
                continue
            derive = taker.op.derive_from(giver.op)
            if derive is not None:
                giver.shares = True
                taker.derived_from = (giver, derive)
                break
    return sorted(roots, key=lambda r: r.derived_from is not None)


def _gpu_map(program: Program) -> str | None:
    """The GPU of a ``map_blocks(device="cuda:N")`` in the program, if any."""
    for step in program.steps():
        op = getattr(step, "op", None)
        if isinstance(op, MapBlocks) and op.device and op.device.startswith("cuda"):
            return op.device
    return None


def attach_device(program: Program) -> offload.Work:
    """Give the program's operators their device forms (see the module docstring);
    what a row of the program costs (for ``device="auto"``)."""
    work = offload.Work(0.0, 0, 0)
    uploads: set[int] = set()
    for step in program.steps():
        if not isinstance(step, KernelStep):
            continue
        op = step.op
        if isinstance(op, MapBlocks) and op.device is not None:
            step.device_op = op
            work = work + offload.Work(float("inf"), 0, 1)  # asked for a GPU by name
        elif isinstance(op, fused.FusedKernel) and torch_ops.kernel_supported(
            op.expr, op.input_dtypes, op.epilogue
        ):
            step.device_op = torch_ops.TorchKernel(op.expr, op.input_dtypes, op.input_row_shapes)
            work = work + _kernel_work(op.expr, op.input_dtypes, op.input_row_shapes)
        else:
            continue
        uploads.update(id(s) for s in step.inputs if not isinstance(s, KernelStep))
    for root in program.reductions:
        chunker, op = root.chunker, root.op
        if not torch_ops.reduction_supported(op):
            continue
        if isinstance(chunker, fused.FusedReduction):
            kernel_op = chunker.kernel
            if not torch_ops.kernel_supported(kernel_op.expr, kernel_op.input_dtypes):
                continue
            root.device_kernel = torch_ops.TorchKernel(
                kernel_op.expr, kernel_op.input_dtypes, kernel_op.input_row_shapes
            )
            work = work + _kernel_work(
                kernel_op.expr, kernel_op.input_dtypes, kernel_op.input_row_shapes
            )
        elif chunker is not op:
            continue
        root.device_reduce = torch_ops.TorchReduction(op)
        elements = offload.elements(op.in_row_shape)
        work = work + offload.Work(float(elements), 0, 2)
        uploads.update(id(s) for s in root.inputs if not isinstance(s, KernelStep))
    for step in program.steps():
        if id(step) in uploads and isinstance(step.node, Chunked):
            node = step.node
            row = offload.elements(node.row_shape) * np.dtype(node.dtype).itemsize
            work = work + offload.Work(0.0, row, 1)
    return work


def _kernel_work(
    expr: ew.Expr, dtypes: list[np.dtype], row_shapes: list[tuple[int, ...]]
) -> offload.Work:
    """CPU operations per row of an elementwise expression, and its GPU kernels."""
    inferred = ew.infer(expr, dtypes, row_shapes)
    elements = offload.elements(inferred.row_shape)
    ops = 0.0
    launches = 0
    for node in ew.walk(expr):
        if isinstance(node, (ew.Input, ew.Const)):
            continue
        name = node.ufunc.__name__ if isinstance(node, ew.Apply) else ""
        ops += offload.op_weight(name)
        launches += 1
    return offload.Work(ops * elements, 0, launches)


class Lowering:
    """Builds the steps of programs from graph nodes, with value nodes bound.

    ``values`` maps a value node's key to its value (placeholders while planning);
    ``results`` holds the keys of chunked nodes that are results of the same pass (read
    from their sink block instead of being fused again). ``cache`` is the compute's
    :class:`~tierflow.engine.io.cache.Session` (None without one): its chunked nodes get a
    :class:`CachedStep` and are not fused, its reductions cache their partials.
    ``origins`` records the call site of each expression node made from a graph node
    (:mod:`tierflow.engine.graph.callsites`).
    """

    def __init__(
        self, values: dict[str, Any], results: set[str] | None = None, cache: Any = None
    ) -> None:
        self.values = values
        self.results = results or set()
        self.cache = cache
        self.origins = callsites.Origins()
        self._steps: dict[str, Step] = {}

    def _entry(self, node: Node) -> Any:
        return None if self.cache is None else self.cache.entry(node)

    def value(self, node: Node) -> Any:
        """The bound value of a value node, as a NumPy value of the node's dtype.

        A Python number from a user's ``aggregate`` would be a *weak* scalar under NEP 50
        and could change the result dtype the plan was built with; the declared dtype
        keeps the kernels and the plan in agreement."""
        value = self.values[node.ident]
        dtype = node.dtype
        if dtype is not None and (
            not isinstance(value, (np.ndarray, np.generic)) or value.dtype != dtype
        ):
            value = np.asarray(value).astype(dtype)
            if value.ndim == 0:
                value = value[()]
        return value

    def step(self, node: Node) -> Step:
        found = self._steps.get(node.ident)
        if found is None:
            found = self._lower(node)
            entry = self._entry(node)
            if entry is not None:
                found = CachedStep(found, entry)
            self._steps[node.ident] = found
        return found

    def _lower(self, node: Node) -> Step:
        if isinstance(node, graph.Source):
            return SourceStep(node)
        if isinstance(node, graph.Elementwise):
            expr, leaves = self._expression(node)
            kernel = fused.FusedKernel(
                expr, [n.dtype for n in leaves], [n.row_shape for n in leaves]
            )
            return KernelStep(
                node, kernel, [self.step(n) for n in leaves], label=_kernel_label(node)
            )
        if isinstance(node, graph.BlockMap):
            chunked = [n for n in node.inputs[: node.n_chunked] if isinstance(n, Chunked)]
            values = [self.value(v) for v in node.inputs[node.n_chunked :]]
            op = node.spec.build([c.dtype for c in chunked], [c.row_shape for c in chunked], values)
            source = chunked[0]
            if node.spec.epilogue and self._fusable(source):
                expr, leaves = self._expression(source)  # type: ignore[arg-type]
                kernel = fused.FusedKernel(
                    expr, [n.dtype for n in leaves], [n.row_shape for n in leaves], epilogue=op
                )
                label = f"{_kernel_label(source)} -> {node.label()}"
                return KernelStep(node, kernel, [self.step(n) for n in leaves], label=label)
            return KernelStep(node, op, [self.step(c) for c in chunked], user=node.spec.user)
        if isinstance(node, graph.RowSlice):
            return SliceStep(node, self.step(node.inputs[0]))
        if isinstance(node, graph.RowTake):
            return TakeStep(node, self.step(node.inputs[0]))
        if isinstance(node, graph.Filter):
            mask = self.step(node.inputs[1]) if len(node.inputs) > 1 else None
            return FilterStep(node, self.step(node.inputs[0]), mask)
        if isinstance(node, graph.Concat):
            return ConcatStep(node, [self.step(i) for i in node.inputs])
        if isinstance(node, graph.Counted):
            return CountedStep(node, self.step(node.inputs[0]))

        if isinstance(node, external_sort.SortedRows):
            return external_sort.MergeStep(node, self.values[node.inputs[0].ident])
        if isinstance(node, overlap.Overlapped):
            chunked = [c for c in node.inputs if isinstance(c, Chunked)]
            op = node.spec.build([c.dtype for c in chunked], [c.row_shape for c in chunked], [])
            return overlap.OverlapStep(node, [self.step(c) for c in chunked], op)
        if isinstance(node, scans.ScannedRows):
            carries = self.values[node.inputs[1].ident]
            return scans.ScanStep(node, self.step(node.inputs[0]), carries)
        raise TypeError(f"cannot lower {node!r}")

    def _fusable(self, node: Node) -> bool:
        return (
            isinstance(node, graph.Elementwise)
            and node.ident not in self.results
            and self._entry(node) is None
        )

    def _expression(self, root: graph.Elementwise) -> tuple[ew.Expr, list[Chunked]]:
        """The elementwise tree under ``root`` as one expression over its leaves."""
        leaves: dict[str, int] = {}
        leaf_nodes: list[Chunked] = []
        exprs: dict[str, ew.Expr] = {}

        def build(node: Chunked) -> ew.Expr:
            found = exprs.get(node.ident)
            if found is not None:
                return found
            if isinstance(node, graph.Elementwise) and (node is root or self._fusable(node)):
                args: list[Any] = []
                for o in node.operands:
                    if isinstance(o, Chunked):
                        args.append(build(o))
                    elif isinstance(o, Node):
                        args.append(ew.Const(self.value(o)))
                    else:
                        args.append(o)
                expr = node.op.expr(args)
                self.origins.add(expr, node.built_at)
            else:
                if node.ident not in leaves:
                    leaves[node.ident] = len(leaf_nodes)
                    leaf_nodes.append(node)
                expr = ew.Input(leaves[node.ident])
            exprs[node.ident] = expr
            return expr

        return build(root), leaf_nodes

    def reduce_root(self, node: graph.Reduce, acc_for: Any) -> ReduceRoot:
        """The root of a reduction, fused with an elementwise tree under it when it is a
        built-in reduction of one input."""
        chunked = [n for n in node.inputs[: node.n_chunked] if isinstance(n, Chunked)]
        values = [self.value(v) for v in node.inputs[node.n_chunked :]]
        op = node.spec.build(
            [c.dtype for c in chunked],
            [c.row_shape for c in chunked],
            chunked[0].n_rows,
            values,
        )
        acc = acc_for(node, op)
        source = chunked[0]
        builtin = (
            isinstance(op, reductions.RowReduction)
            or type(op).__name__ == "HistogramCounts"
            or (isinstance(op, Bincount) and not op.weighted)
        )
        inputs: list[Chunked] = chunked
        chunker = None  # the reduction itself
        if len(chunked) == 1 and builtin and self._fusable(source):
            expr, inputs = self._expression(source)  # type: ignore[arg-type]
            kernel = fused.FusedKernel(
                expr, [n.dtype for n in inputs], [n.row_shape for n in inputs]
            )
            chunker = fused.FusedReduction(kernel, op)
        return ReduceRoot(
            node,
            op,
            [self.step(n) for n in inputs],
            acc,
            user=node.spec.user,
            chunker=chunker,
            cache=self._entry(node),
        )


def _kernel_label(node: Node) -> str:
    """``sqrt(add(multiply))``-style label of an elementwise tree, shortened."""
    names = []
    for n in graph.walk([node]):
        if isinstance(n, graph.Elementwise):
            names.append(n.label())
    text = " ∘ ".join(reversed(names))
    return f"fused[{text}]" if len(names) > 1 else text
