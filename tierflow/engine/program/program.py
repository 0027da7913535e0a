"""The block runtime: what one block task runs, in any process.

A :class:`Program` computes, for one block, every result of a group of roots that share
the same blocks (the sinks and reductions of one pass, built by
:mod:`tierflow.engine.planning.lower`): block ``j`` is read once and every root takes what it
needs from it. A program is a tree of *steps* under its roots::

    Program
      SinkRoot  divide -> NpySink          rows written to the sink's block
        KernelStep  fused[divide ∘ subtract]
          SourceStep  from_npy('x.npy')    a view of the memory map
      ReduceRoot  mean(axis=0)             a partial per block, added to an Accumulator
        SourceStep  from_npy('x.npy')      (the same step: read once, memoised)

A step evaluates its node for a *request*, memoised per task (:class:`Context`): a node
used twice in a block is computed once. Requests are typed:

* :class:`RowRange` ``(start, stop)``: rows ``start:stop`` of a node whose row counts
  are known (any range can be computed: every step maps rows to rows);
* :class:`BlockIndex` ``(index)``: block ``index`` of a node whose row counts are
  unknown until computed (after a mask, files of varying rows). A pass that joins the
  results over an array to those over its masks asks by index; a root over the array
  itself computes that block's rows of it (:func:`own_request`).

In the driver's threads :meth:`Program.run` computes a block and adds the reductions'
partials to their accumulators. In a worker process :meth:`Program.run_remote` returns
them by value (with the blocks of results the driver holds), and the driver's
:meth:`Program.receive` adds them (see :mod:`tierflow.engine.program.tasks`). A
:class:`CachedStep` maps a cached node's block from the compute's cache when it is
there, and computes and writes it when it is not; a cached reduction looks up each
block's partial result before computing it.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import BlockError, OutOfMemoryError
from ...operators import byteorder, selection, torch_ops
from ...operators.types import block_bytes
from ...storage import pages
from ...storage.pool import Pool
from ...system import budget, pressure, tally
from ...system.types import Level
from .. import graph
from ..gpu import offload, transfer
from ..graph import Chunked, Node, callsites
from ..io import cache as cache_module
from ..io.cache import MISS
from ..types import BlockIndex, Request, RowRange, TaskMemory
from . import float_errors, halving

__all__ = [
    "SKIPPED",
    "Accumulator",
    "BlockIndex",
    "CachedStep",
    "Context",
    "Program",
    "ReduceRoot",
    "Request",
    "RowRange",
    "SharedBlock",
    "SinkRoot",
    "Step",
    "own_request",
]


_HIGH = frozenset({Level.HIGH, Level.CRITICAL})


class _Skipped:
    def __repr__(self) -> str:
        return "SKIPPED"

    def __reduce__(self) -> str:
        return "SKIPPED"


SKIPPED: Any = _Skipped()
"""A reduction's partial for a block it does not need (a complete prefix exists)."""


class Context:
    """One task's state: the memo of evaluated steps, the source rows it read, the
    device lane its device steps run on (None: everything on the CPU), and in a worker
    process the floating-point warnings of its operators, ``caught`` for the driver
    (None: issued at once; see :mod:`tierflow.engine.program.float_errors`)."""

    __slots__ = ("caught", "index", "lane", "memo", "program", "reads", "req", "started")

    def __init__(
        self, index: int, req: Request, program: Program, lane: transfer.Lane | None = None
    ) -> None:
        self.index = index
        self.req = req
        self.program = program
        self.lane = lane
        self.started = False
        self.memo: dict[tuple[Any, ...], Any] = {}
        self.reads: list[tuple[Any, int, int]] = []
        self.caught: list[tuple[str, callsites.CallSite | None]] | None = None

    def start(self) -> None:
        """The block's compute on the device starts (its inputs are there)."""
        if not self.started and self.lane is not None:
            self.started = True
            self.lane.started(self.index)

    def describe(self) -> str:
        """Which block this task computes, in words (made only for an error message)."""
        req, program = self.req, self.program
        rows = f" (rows {req.start}:{req.stop})" if isinstance(req, RowRange) else ""
        return f"block {self.index} of {program.count}{rows} of {program.name}"

    @property
    def where(self) -> str:
        """:meth:`describe`."""
        return self.describe()


def _where_of(ctx: Context, req: Request) -> tuple[int, int, int]:
    if isinstance(req, RowRange):
        return ctx.index, req.start, req.stop
    return ctx.index, -1, -1


def _user_error(label: str, ctx: Context, req: Request, exc: Exception) -> BlockError:
    index, start, stop = _where_of(ctx, req)
    return BlockError(
        f"{label} failed on {ctx.where}: {type(exc).__name__}: {exc}",
        index=index,
        start=max(start, 0),
        stop=max(stop, 0),
    )


def _operator_call(
    step: KernelStep | ReduceRoot, ctx: Context, req: Request, op: Any, call: Callable[[], Any]
) -> Any:
    """``call()``: a call of ``step``'s operator ``op`` on the rows of ``req`` (through
    :mod:`~tierflow.engine.program.halving`), its errors told as the user needs them.
    Halving's own (a :class:`BlockError`, an :class:`OutOfMemoryError`) pass
    as they are; a user function's error becomes a :class:`BlockError` that names the
    operator and the block; the floating-point warnings and errors of tierflow's own
    operators name the user's line (:mod:`tierflow.engine.program.float_errors`)."""
    built_at, label = step.node.built_at, step.site.label
    entered = None if step.user else float_errors.enter(ctx, op, built_at, label)
    try:
        return call()
    except (BlockError, OutOfMemoryError):
        raise
    except Exception as exc:
        if step.user:
            raise _user_error(label, ctx, req, exc) from exc
        float_errors.annotate(exc, op, ctx.program.origins, built_at)
        raise
    finally:
        if entered is not None:
            float_errors.leave(entered)


class Step(abc.ABC):
    """A physical step: evaluates its graph node for a request, memoised per task."""

    node: Node

    def eval(self, ctx: Context, req: Request) -> np.ndarray:
        key = (id(self), req)
        found = ctx.memo.get(key)
        if found is None:
            found = self._eval(ctx, req)
            ctx.memo[key] = found
        return found

    def eval_into(self, ctx: Context, req: Request, out: np.ndarray) -> np.ndarray:
        """Evaluate into ``out`` (a sink's block); the memo then holds ``out``."""
        result = self._eval_into(ctx, req, out)
        ctx.memo[(id(self), req)] = out
        return result

    def host(self, ctx: Context, req: Request) -> np.ndarray:
        """The rows ``req`` asks for as a NumPy block (brought back once from the device
        when this step ran there, in the node's byte order: tensors have only the
        native one)."""
        value = self.eval(ctx, req)
        if ctx.lane is None or isinstance(value, np.ndarray):
            return value
        key = (id(self), req, "host")
        found = ctx.memo.get(key)
        if found is None:
            found = ctx.lane.to_host(value)
            dtype = self.node.dtype
            if isinstance(found, np.ndarray) and dtype is not None and found.dtype != dtype:
                found = found.astype(dtype)
            ctx.memo[key] = found
        return found

    def on_device(self, ctx: Context, req: Request) -> Any:
        """The rows ``req`` asks for as a tensor on the task's device (copied there once
        when this step ran on the host). Only in a task with a lane."""
        key = (id(self), req, "device")
        found = ctx.memo.get(key)
        if found is None:
            value = self.eval(ctx, req)
            lane = ctx.lane
            assert lane is not None
            found = lane.upload(ctx.index, value) if isinstance(value, np.ndarray) else value
            ctx.memo[key] = found
        return found

    @abc.abstractmethod
    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        """The rows ``req`` asks for (what :meth:`eval` memoises)."""

    def _eval_into(self, ctx: Context, req: Request, out: np.ndarray) -> np.ndarray:
        np.copyto(out, self.host(ctx, req), casting="unsafe")
        return out

    def children(self) -> list[Step]:
        """Steps this one reads (for walking the program)."""
        return []

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        """``(reader, a, b)`` this step reads from files for ``req`` (for readahead)."""
        return iter(())

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        """This step's own projected bytes for a block of ``rows`` rows."""
        return TaskMemory()

    def label(self) -> str:
        return self.node.label()


class SourceStep(Step):
    node: graph.Source

    def __init__(self, node: graph.Source) -> None:
        self.node = node
        self.reader = node.reader

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        if isinstance(req, RowRange):
            a, b = req.start, req.stop
            reader = self.reader
            if reader.reads_into:
                block = _lend((b - a, *reader.row_shape), reader.dtype)
                ctx.reads.append((_Loan(block), a, b))
                return reader.read_into(a, b, block)
            block = reader.read(a, b)
            if reader.file_backed:
                ctx.reads.append((reader, a, b))
            return block
        return self.reader.read_block(req.index)

    def _eval_into(self, ctx: Context, req: Request, out: np.ndarray) -> np.ndarray:
        reader = self.reader
        if (
            reader.reads_into
            and isinstance(req, RowRange)
            and out.dtype == reader.dtype
            and out.shape == (req.stop - req.start, *reader.row_shape)
            and out.flags.c_contiguous
        ):
            return reader.read_into(req.start, req.stop, out)  # straight into the sink's
        return super()._eval_into(ctx, req, out)

    def on_device(self, ctx: Context, req: Request) -> Any:
        """The rows on the device, from the copy staged by the previous block's task when
        there is one; stages the next block's rows before waiting (double buffering,
        see :mod:`tierflow.engine.gpu.transfer`)."""
        reader, n = self.reader, self.reader.n_rows
        if not isinstance(req, RowRange) or n is None or reader.makes_blocks:
            return super().on_device(ctx, req)
        key = (id(self), req, "device")
        found = ctx.memo.get(key)
        if found is None:
            lane = ctx.lane
            assert lane is not None
            a, b = req.start, req.stop
            copy = lane.take(ctx.index, reader, a, b)
            if b < n:
                lane.stage(ctx.index + 1, reader, b, min(n, 2 * b - a))
            found = ctx.memo[key] = lane.ready(copy)
            if reader.file_backed:
                ctx.reads.append((reader, a, b))
        return found

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        if isinstance(req, RowRange) and (self.reader.file_backed or self.reader.reads_ahead):
            yield self.reader, req.start, req.stop

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        nbytes = rows * self.reader.row_nbytes
        if self.reader.file_backed:
            return TaskMemory(inputs=nbytes)  # file pages faulted in, released after
        if self.reader.makes_blocks:  # rows loaded (decoded) or computed, and the scratch
            return TaskMemory(outputs=nbytes, temps=self.reader.scratch_bytes(rows))
        return TaskMemory()  # views of an array already in memory


class KernelStep(Step):
    """A block operator (a fused kernel, a user function, ...) on input steps.

    ``device_op``, when set (lowering sets it in a pass that asks for a device), computes
    the same rows from tensors on the task's device with ``apply_tensors(*tensors)``,
    its scratch there projected by ``temp_bytes(rows)`` (a
    :class:`~tierflow.operators.torch_ops.TorchKernel`, a GPU ``map_blocks``); in a task
    with a lane the step runs there and its value is a tensor."""

    device_op: Any = None

    def __init__(
        self,
        node: Node,
        op: Any,
        inputs: list[Step],
        *,
        user: bool = False,
        label: str | None = None,
    ) -> None:
        self.node = node
        self.op = op
        self.inputs = inputs
        self.user = user
        self._label = label or node.label()
        self.site = halving.Site(node.ident, self._label)

    def label(self) -> str:
        return self._label

    def _run(self, ctx: Context, req: Request, out: np.ndarray | None) -> np.ndarray:
        blocks = [s.host(ctx, req) for s in self.inputs]
        return self._halved(ctx, req, self.op.apply, blocks, out)

    def _halved(self, ctx: Context, req: Request, fn: Any, blocks: list[Any], out: Any) -> Any:
        """``fn`` on ``blocks`` with out-of-memory halving (:func:`halving.call`), its
        errors told as :func:`_operator_call` says."""
        return _operator_call(
            self, ctx, req, self.op, lambda: halving.call(self.site, ctx.describe, fn, blocks, out)
        )

    def _run_on_device(self, ctx: Context, req: Request) -> Any:
        """The rows on the device. With out-of-memory halving as on the host: the
        result goes into a tensor allocated first, which halves write their rows into."""
        import torch

        blocks = [s.on_device(ctx, req) for s in self.inputs]
        ctx.start()
        op, device_fn = self.op, self.device_op.apply_tensors
        dtype = torch_ops.torch_dtype(op.out_dtype)
        # halving's types say NumPy; it only slices and hands back what it is given
        out: Any = torch.empty(
            (blocks[0].shape[0], *op.out_row_shape), dtype=dtype, device=blocks[0].device
        )

        def fn(*parts: Any, out: Any) -> Any:
            out.copy_(device_fn(*parts))
            return out

        return self._halved(ctx, req, fn, blocks, out)

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        if ctx.lane is not None and self.device_op is not None:
            return self._run_on_device(ctx, req)
        return self._run(ctx, req, None)

    def _eval_into(self, ctx: Context, req: Request, out: np.ndarray) -> np.ndarray:
        lane = ctx.lane
        if lane is not None and self.device_op is not None:
            return lane.to_host_into(self.eval(ctx, req), out)
        return self._run(ctx, req, out)

    def children(self) -> list[Step]:
        return list(self.inputs)

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        for s in self.inputs:
            yield from s.sources(req)

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        out = 0 if into_sink else block_bytes(rows, self.op.out_row_shape, self.op.out_dtype)
        return TaskMemory(outputs=out, temps=int(self.op.temp_bytes(rows)))


class SliceStep(Step):
    node: graph.RowSlice

    def __init__(self, node: graph.RowSlice, source: Step) -> None:
        self.node = node
        self.source = source

    def _map(self, req: Request) -> tuple[Request, slice]:
        assert isinstance(req, RowRange)
        lo, hi, take = self.node.input_rows(req.start, req.stop)
        return RowRange(lo, hi), take

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        inner, take = self._map(req)
        return self.source.host(ctx, inner)[take]

    def children(self) -> list[Step]:
        return [self.source]

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        yield from self.source.sources(self._map(req)[0])


class TakeStep(Step):
    """Picked rows of the input (:class:`graph.RowTake`). Sorted picks of an output row
    range lie in one input block, which is evaluated over the picks' span, in pieces
    where they are far apart, so a computed input is not evaluated on rows nobody
    picked. Picks out of order come from a source's view of its whole span."""

    node: graph.RowTake
    GAP = 256  # rows between picks beyond which the span is cut

    def __init__(self, node: graph.RowTake, source: Step) -> None:
        self.node = node
        self.source = source

    def _spans(self, req: Request) -> list[tuple[int, int, np.ndarray]]:
        assert isinstance(req, RowRange)
        lo, hi, take = self.node.input_rows(req.start, req.stop)
        if not self.node.ordered or hi - lo <= 2 * len(take) + self.GAP:
            return [(lo, hi, take)]  # out of order: a source's view, picked from anywhere
        cuts = np.flatnonzero(np.diff(take) > self.GAP) + 1
        return [(lo + int(t[0]), lo + int(t[-1]) + 1, t - t[0]) for t in np.split(take, cuts)]

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        spans = self._spans(req)
        parts = [self.source.host(ctx, RowRange(a, b))[take] for a, b, take in spans]
        if len(parts) == 1:
            return parts[0]
        return byteorder.join(parts)

    def children(self) -> list[Step]:
        return [self.source]

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        if not self.node.ordered:
            return  # reading the span ahead would read what nobody picked
        for a, b, _ in self._spans(req):
            yield from self.source.sources(RowRange(a, b))


_worker: str | None = None  # this process's name as a worker, made once


def _worker_name() -> str:
    """This process as a profile names a worker: the name the processes executor gave
    it (``tierflow-worker-3``), else host and pid (a Dask or Ray worker)."""
    global _worker
    if _worker is None:
        import multiprocessing
        import socket

        name = multiprocessing.current_process().name
        _worker = name if name.startswith("tierflow-") else f"{socket.gethostname()}:{os.getpid()}"
    return _worker


def _block_request(node: Chunked, j: int) -> Request:
    """The request for block ``j`` of ``node`` in its own terms."""
    if node.bounds is not None:
        return RowRange(node.bounds[j], node.bounds[j + 1])
    return BlockIndex(j)


def own_request(node: Chunked, req: Request) -> Request:
    """What a root over ``node`` computes for a task's ``req``. A pass over the blocks
    masks cut asks by index (``BlockIndex(j)``); a root in it over the masked array
    itself, whose rows are known, computes its block ``j``, rows ``bounds[j]:bounds[j +
    1]`` (see :func:`tierflow.engine.planning.plan.pass_key`)."""
    if isinstance(req, BlockIndex) and node.bounds is not None:
        return RowRange(node.bounds[req.index], node.bounds[req.index + 1])
    return req


class FilterStep(Step):
    node: graph.Filter

    def __init__(self, node: graph.Filter, source: Step, mask: Step | None) -> None:
        self.node = node
        self.source = source
        self.mask = mask
        source_node = node.inputs[0]
        assert isinstance(source_node, Chunked)
        self.source_node: Chunked = source_node

    def _inner(self, req: Request) -> Request:
        assert isinstance(req, BlockIndex)
        return _block_request(self.source_node, req.index)

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        inner = self._inner(req)
        block = self.source.host(ctx, inner)
        if self.mask is not None:
            return selection.mask_rows(block, self.mask.host(ctx, inner))
        fn = self.node.fn
        try:
            assert fn is not None
            return selection.filter_rows(block, fn)
        except Exception as exc:
            raise _user_error(self.node.label(), ctx, inner, exc) from exc

    def children(self) -> list[Step]:
        return [self.source] + ([self.mask] if self.mask is not None else [])

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        yield from self.source.sources(self._inner(req))

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        return TaskMemory(outputs=block_bytes(rows, self.node.row_shape, self.node.dtype))  # type: ignore[arg-type]


class CountedStep(Step):
    """Rows of a counted node (:class:`graph.Counted`): each block that holds some of
    the rows asked for is computed whole (by its index, as before counting) and cut."""

    node: graph.Counted

    def __init__(self, node: graph.Counted, source: Step) -> None:
        self.node = node
        self.source = source

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        assert isinstance(req, RowRange)
        parts = [
            self.source.host(ctx, BlockIndex(j))[lo:hi]
            for j, lo, hi in self.node.pieces(req.start, req.stop)
        ]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.empty((0, *self.node.row_shape), self.node.dtype)
        return byteorder.join(parts)

    def children(self) -> list[Step]:
        return [self.source]

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        assert isinstance(req, RowRange)
        for j, _, _ in self.node.pieces(req.start, req.stop):
            yield from self.source.sources(BlockIndex(j))

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        """The block out, and what the steps below take beyond their share of ``rows``:
        they compute whole blocks before the mask, of up to :func:`widest_rows` rows."""
        out = TaskMemory(outputs=block_bytes(rows, self.node.row_shape, self.node.dtype))  # type: ignore[arg-type]
        widest = widest_rows(self.node.inputs[0])  # type: ignore[arg-type]
        if widest <= rows:
            return out
        below = _subtree(self.source)
        more = sum((s.memory(widest, False) for s in below), TaskMemory())
        less = sum((s.memory(rows, False) for s in below), TaskMemory())
        return out + TaskMemory(temps=max(0, more.total - less.total))


def _subtree(step: Step) -> list[Step]:
    """``step`` and every step below it, each once."""
    found: dict[int, Step] = {}
    stack = [step]
    while stack:
        s = stack.pop()
        if id(s) not in found:
            found[id(s)] = s
            stack.extend(s.children())
    return list(found.values())


def widest_rows(node: Chunked) -> int:
    """At most how many rows (elements, past a mask over several axes) a block of
    ``node`` is computed from: its widest block where the sizes are known."""
    if node.bounds is not None:
        return max((b - a for a, b in node.block_pairs()), default=0)
    if isinstance(node, graph.Source):
        return int(node.reader.block_rows())
    inputs = [i for i in node.inputs if isinstance(i, Chunked)]
    if isinstance(node, graph.Concat):
        return max((widest_rows(i) for i in inputs), default=0)
    scale = 1
    if isinstance(node, graph.Filter) and node.mask_ndim > 1:
        scale = math.prod(inputs[0].row_shape[: node.mask_ndim - 1])
    return widest_rows(inputs[0]) * scale


class ConcatStep(Step):
    node: graph.Concat

    def __init__(self, node: graph.Concat, inputs: list[Step]) -> None:
        self.node = node
        self.inputs = inputs

    def _parts(self, req: Request) -> list[tuple[Step, Request]]:
        if isinstance(req, RowRange):
            return [
                (self.inputs[k], RowRange(lo, hi))
                for k, lo, hi in self.node.pieces(req.start, req.stop)
            ]
        k, j = self.node.block_table[req.index]
        child = self.node.inputs[k]
        assert isinstance(child, Chunked)
        return [(self.inputs[k], _block_request(child, j))]

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        parts = [step.host(ctx, inner) for step, inner in self._parts(req)]
        dtype = self.node.dtype
        if len(parts) == 1:
            return parts[0] if parts[0].dtype == dtype else parts[0].astype(dtype)
        if not parts:
            return np.empty((0, *self.node.row_shape), dtype)
        return np.concatenate(parts).astype(dtype, copy=False)

    def children(self) -> list[Step]:
        return list(self.inputs)

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        for step, inner in self._parts(req):
            yield from step.sources(inner)

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        return TaskMemory(outputs=block_bytes(rows, self.node.row_shape, self.node.dtype))  # type: ignore[arg-type]


BLOCK_POOL_MAX = 256 << 20  # bytes of spare source blocks kept per process, at most
_block_pool: Pool | None = None
_block_pool_lock = threading.Lock()


def _lend(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A block for a reader to read into, from this process's pool of spare blocks (its
    pages already faulted in: a fresh 64 MB block costs 16,384 page faults). The pool
    keeps at most :data:`BLOCK_POOL_MAX` or an eighth of the RAM budget, whichever is
    less, and drops its spares at pressure ``high``."""
    global _block_pool
    with _block_pool_lock:
        if _block_pool is None:
            _block_pool = Pool(0)
        found = _block_pool
    found.max_bytes = min(BLOCK_POOL_MAX, budget.budget_bytes() // 8)
    return found.take(shape, dtype, zero=False)


class _Loan:
    """A pooled block lent to a reader (:func:`_lend`), given back when its task ends
    unless something still refers to it or to a view of it (a result handed on, a block
    held by a sink); then it is freed as usual when the last reference goes."""

    __slots__ = ("block",)

    def __init__(self, block: np.ndarray) -> None:
        self.block: np.ndarray | None = block

    def release(self, a: int, b: int, *, drop_cache: bool = False) -> None:
        block, self.block = self.block, None
        if block is None or _block_pool is None:
            return
        # Two references each: ``block`` here and getrefcount's argument; for the buffer
        # under it, ``block.base`` and the argument. Any other is a user of the rows.
        if sys.getrefcount(block) == 2 and sys.getrefcount(block.base) == 2:
            _block_pool.give(block)


class _MappedBlock:
    """A block mapped from the cache, released like a source block when its task ends."""

    __slots__ = ("block",)

    def __init__(self, block: np.ndarray) -> None:
        self.block = block

    def release(self, a: int, b: int, *, drop_cache: bool = False) -> None:
        if self.block.nbytes and isinstance(self.block, np.memmap):
            # A hint: the block stays valid either way.
            with contextlib.suppress(ValueError, OSError):
                pages.release(self.block, drop_cache=drop_cache)


class CachedStep(Step):
    """A cached node's step: its block from the cache when the cache has it (a read-only
    memory map, released when the task ends), else computed by ``inner`` and written
    to the cache. ``entry`` is the node's :class:`~tierflow.engine.io.cache.Entry`."""

    def __init__(self, inner: Step, entry: Any) -> None:
        self.node = inner.node
        self.inner = inner
        self.entry = entry

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        found = self.entry.get_block(req)
        if found is not None:
            ctx.reads.append((_MappedBlock(found), 0, 0))
            return found
        block = self.inner.host(ctx, req)
        self.entry.put_block(req, block)
        return block

    def _eval_into(self, ctx: Context, req: Request, out: np.ndarray) -> np.ndarray:
        found = self.entry.get_block(req)
        if found is not None:
            np.copyto(out, found)
            ctx.reads.append((_MappedBlock(found), 0, 0))
            return out
        self.inner.eval_into(ctx, req, out)
        self.entry.put_block(req, out)
        return out

    def children(self) -> list[Step]:
        return [self.inner]

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        if not self.entry.has_block(req):  # a block in the cache reads no file
            yield from self.inner.sources(req)

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        return self.inner.memory(rows, into_sink)

    def label(self) -> str:
        return self.inner.label()


# -- reductions -------------------------------------------------------------------------


class Accumulator:
    """Partials of one reduction, combined as blocks finish (``add`` runs on workers).

    Commutative reductions fold into one running partial; the combine runs outside the
    lock, so two workers never wait for each other's combine. Others keep segments of
    neighbouring blocks and merge a segment with its neighbours, left before right.
    A reduction with ``complete(partial)`` (``head``) marks blocks after a complete
    first segment as not needed (:meth:`skip`).
    """

    def __init__(self, op: Any) -> None:
        self.op = op
        self.commutative = bool(getattr(op, "commutative", True))
        self._lock = threading.Lock()
        self._value: Any = None
        self._has_value = False
        self._by_start: dict[int, tuple[int, Any]] = {}
        self._by_end: dict[int, int] = {}
        self.complete_through: int | None = None

    def add(self, index: int, partial: Any) -> None:
        """Merge the partial of block ``index``; takes the lock only to swap partials."""
        if self.commutative:
            if partial is None:
                return
            while True:
                with self._lock:
                    if not self._has_value:
                        self._value, self._has_value = partial, True
                        return
                    other, self._value, self._has_value = self._value, None, False
                partial = self.op.combine(other, partial)
        start, end = index, index + 1
        while True:
            with self._lock:
                left_start = self._by_end.pop(start, None)
                left = self._by_start.pop(left_start) if left_start is not None else None
                right = self._by_start.pop(end, None)
                if right is not None:
                    del self._by_end[right[0]]
                if left is None and right is None:
                    self._by_start[start] = (end, partial)
                    self._by_end[end] = start
                    complete = getattr(self.op, "complete", None)
                    if start == 0 and complete is not None and complete(partial):
                        self.complete_through = end
                    return
            if left is not None:
                assert left_start is not None
                partial = self.op.combine(left[1], partial)
                start = left_start
            if right is not None:
                partial = self.op.combine(partial, right[1])
                end = right[0]

    def skip(self, index: int) -> bool:
        """Whether block ``index`` is no longer needed (a complete prefix exists)."""
        through = self.complete_through
        return through is not None and index >= through

    def discard(self) -> None:
        """Drop the partials held, letting a reduction whose partials own files
        (``op.discard(partial)``) remove them: the compute failed or was stopped."""
        with self._lock:
            held = [self._value] if self._has_value else []
            held += [p for _, p in self._by_start.values()]
            self._value, self._has_value = None, False
            self._by_start.clear()
            self._by_end.clear()
        discard = getattr(self.op, "discard", None)
        if discard is not None:
            for partial in held:
                discard(partial)

    def result(self) -> Any:
        """The partial of all blocks added (None if none had rows)."""
        with self._lock:
            if self.commutative:
                return self._value
            if not self._by_start:
                return None
            first = self._by_start.get(0)
            if self.complete_through is not None and first is not None:
                return first[1]
            if len(self._by_start) != 1 or first is None:
                raise RuntimeError(
                    f"partials of {len(self._by_start)} separate row ranges are left; a "
                    "non-commutative reduction lost a block"
                )
            return first[1]


@dataclass(eq=False)
class ReduceRoot:
    """A reduction root of a program: chunk each block, add to the accumulator.

    ``op`` is the reduction (its partials, combine and aggregate), ``chunker`` what
    computes a block's partial from ``inputs`` (``op`` itself when None, or a
    :class:`~tierflow.operators.fused.FusedReduction` over an elementwise tree); ``user``
    marks a user's reduction (its errors name the block); ``cache`` is the node's cache
    :class:`~tierflow.engine.io.cache.Entry` (partials per block) or None.

    ``device_reduce`` (a :class:`~tierflow.operators.torch_ops.TorchReduction`), when
    set, computes the partial on the task's device, after ``device_kernel`` (a
    :class:`~tierflow.operators.torch_ops.TorchKernel`, the fused elementwise tree) when
    there is one: in a task with a lane only the partial comes back to the host."""

    node: graph.Reduce
    op: Any
    inputs: list[Step]
    acc: Accumulator
    user: bool = False
    chunker: Any = None
    cache: Any = None
    device_kernel: Any = None
    device_reduce: Any = None
    # A root whose partial another derives (shares) keeps it in the task's memo; the
    # other (derived_from: that root and how to derive) takes it when it is there.
    shares: bool = False
    derived_from: tuple[Any, Any] | None = None
    label: str = field(init=False)
    site: halving.Site = field(init=False)
    reduced: Chunked = field(init=False)  # the array it reduces: its requests name its rows

    def __post_init__(self) -> None:
        if self.chunker is None:
            self.chunker = self.op
        reduced = self.node.inputs[0]
        assert isinstance(reduced, Chunked)
        self.reduced = reduced
        self.label = self.node.label()
        self.site = halving.Site(self.node.ident, self.label)

    def __getstate__(self) -> dict[str, Any]:
        # Travels without its accumulator: partials go back to the driver, which adds
        # them (Program.receive). Its cache entry travels by store path.
        state = self.__dict__.copy()
        state["acc"] = None
        return state

    def run(self, ctx: Context, req: Request) -> Any:
        """This block's partial result, or :data:`SKIPPED` when it is not needed."""
        req = own_request(self.reduced, req)
        acc = self.acc
        if acc is not None and acc.complete_through is not None and acc.skip(ctx.index):
            return SKIPPED
        if getattr(self.op, "idle", False):
            return None  # nothing to do in this pass (a finished search): nothing is read
        if self.derived_from is not None:
            giver, derive = self.derived_from
            found = ctx.memo.get(("partial", giver.node.ident))
            if found is not None:
                return derive(found)
        cache = self.cache
        if cache is not None:
            cached = cache.get_partial(req)
            if cached is not MISS:
                return cached
        if ctx.lane is not None and self.device_reduce is not None:
            partial = self._run_on_device(ctx, req)
            if cache is not None:
                cache.put_partial(req, partial)
            return partial
        blocks = [s.host(ctx, req) for s in self.inputs]
        if self._no_rows(blocks):
            return None
        offset = req.start if isinstance(req, RowRange) else 0
        partial = _operator_call(
            self,
            ctx,
            req,
            self.chunker,
            lambda: halving.call_chunk(self.site, ctx.describe, self.chunker, blocks, offset),
        )
        if cache is not None:
            cache.put_partial(req, partial)
        if self.shares and partial is not None:
            ctx.memo[("partial", self.node.ident)] = partial
        return partial

    def _no_rows(self, blocks: list[Any]) -> bool:
        """Whether ``blocks`` have no rows and their partial is None, the partial of no
        rows, without a call to ``chunk``: the one place an empty block (a mask that
        kept none of its rows) is reduced. An operator that sets ``sees_empty_blocks``
        (a count per block, a user's reduction) gets its ``chunk`` called all the same."""
        return blocks[0].shape[0] == 0 and not getattr(self.op, "sees_empty_blocks", False)

    def _run_on_device(self, ctx: Context, req: Request) -> Any:
        """This block's partial computed on the task's device, on the host (halved on
        out-of-memory as on the host)."""
        lane = ctx.lane
        assert lane is not None
        blocks = [s.on_device(ctx, req) for s in self.inputs]
        ctx.start()
        if self._no_rows(blocks):
            return None
        chunker = _DeviceChunker(self.op, self.device_kernel, self.device_reduce, lane)
        offset = req.start if isinstance(req, RowRange) else 0
        return halving.call_chunk(self.site, ctx.describe, chunker, blocks, offset)

    def cached(self, req: Request) -> bool:
        """Whether this block's partial is in the cache (then it reads no input)."""
        return self.cache is not None and bool(
            self.cache.has_partial(own_request(self.reduced, req))
        )

    def memory(self, rows: int) -> TaskMemory:
        return TaskMemory(temps=int(self.chunker.temp_bytes(rows)) + int(self.op.partial_bytes()))

    def steps(self) -> list[Step]:
        return self.inputs


@dataclass(frozen=True)
class _DeviceChunker:
    """A reduction's ``chunk`` on device tensors (the fused kernel, then the torch
    partial, brought to the host) and its ``combine``, for halving."""

    op: Any
    kernel: Any
    reduce: Any
    lane: transfer.Lane

    def chunk(self, *blocks: Any, row_offset: int = 0) -> Any:
        value = self.kernel.apply_tensors(*blocks) if self.kernel is not None else blocks[0]
        return self.lane.to_host(self.reduce.chunk(value))

    def combine(self, a: Any, b: Any) -> Any:
        return self.op.combine(a, b)


SHARED_MIN = 64 << 10  # a held block at least this big goes by a shared file


@dataclass(frozen=True, slots=True)
class SharedBlock:
    """A block a worker wrote to a file in the shared folder, by path: ``.npy`` bytes
    written under a temporary name and renamed, so a retried or duplicated task is
    harmless. The driver reads it once (:meth:`take`) and deletes it."""

    path: str

    @staticmethod
    def write(stem: str, block: np.ndarray) -> SharedBlock:
        """Write ``block`` as ``stem + ".npy"`` (by way of ``stem + ".tmp"``); the
        driver chose ``stem`` (a path in the shared folder), so it can remove the file
        of an attempt it stopped."""
        temp, final = stem + ".tmp", stem + ".npy"
        try:
            with open(temp, "wb") as f:
                np.lib.format.write_array(f, np.ascontiguousarray(block), allow_pickle=False)
            os.replace(temp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        return SharedBlock(final)

    def take(self) -> np.ndarray:
        """The block in this process's RAM; the file is gone afterwards."""
        try:
            return np.asarray(np.load(self.path, allow_pickle=False))
        finally:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (SharedBlock, (self.path,))


class SinkRoot:
    """A chunked result: known rows go into the sink's block, unknown rows are returned
    (held by the scheduler until written)."""

    def __init__(self, node: Chunked, step: Step, sink: Any) -> None:
        self.node = node
        self.step = step
        self.sink = sink

    def __getstate__(self) -> dict[str, Any]:
        # The sink stays with the driver; its place (a file's rows) travels, if it has
        # one, and the worker writes known rows there.
        state = self.__dict__.copy()
        state["sink"] = None
        state["place"] = self.sink.place() if self.sink is not None else None
        return state

    def run(self, ctx: Context, req: Request) -> Any:
        req = own_request(self.node, req)
        if isinstance(req, RowRange) and self.sink.known:
            a, b = req.start, req.stop
            dest = self.sink.dest(a, b)
            self.step.eval_into(ctx, req, dest)
            self.sink.written(a, b, dest)
            return None
        return self._held(ctx, req)

    def _held(self, ctx: Context, req: Request) -> np.ndarray:
        block = self.step.host(ctx, req)
        return (
            np.array(block, order="C")
            if not block.flags.c_contiguous or not block.flags.owndata
            else block
        )

    def run_remote(self, ctx: Context, req: Request, shared: str | None = None) -> Any:
        """In a worker: write known rows to the sink's place, else return the block (by
        value, or when ``shared`` is a path stem in the shared folder, as a
        :class:`SharedBlock` file there when it is bigger than :data:`SHARED_MIN`)."""
        req = own_request(self.node, req)
        place = getattr(self, "place", None)
        if place is not None and isinstance(req, RowRange):
            place.write(req.start, self.step.eval(ctx, req))
            return None
        block = self._held(ctx, req)
        if shared is not None and block.nbytes >= SHARED_MIN:
            return SharedBlock.write(shared, block)
        return block

    def receive(self, req: Request, block: Any) -> Any:
        """In the driver: place a block a worker returned; the held block, if any."""
        if isinstance(block, SharedBlock):
            block = block.take()
        req = own_request(self.node, req)
        if block is None or not (isinstance(req, RowRange) and self.sink.known):
            return block
        a, b = req.start, req.stop
        dest = self.sink.dest(a, b)
        np.copyto(dest, block, casting="unsafe")
        self.sink.written(a, b, dest)
        return None

    def memory(self, rows: int) -> TaskMemory:
        return TaskMemory(outputs=int(self.sink.task_bytes(rows)))


class Program:
    """What a block task of one group runs (see the module docstring)."""

    def __init__(
        self, sinks: list[SinkRoot], reductions: list[ReduceRoot], name: str = "", count: int = 0
    ) -> None:
        self.sinks = sinks
        self.reductions = reductions
        self.name = name  # what the pass computes, for error messages
        self.count = count  # blocks in the pass
        self.session: Any = None  # the compute's cache session (lower_pass sets it)
        self.device: str | None = None  # the device the pass asks for (lower_pass sets it)
        self.work = offload.Work(0.0, 0, 0)  # what a row costs, for device="auto"
        # Where the user built each fused expression node (lower_pass sets it), and the
        # floating-point warnings issued for this pass (see float_errors).
        self.origins = callsites.Origins()
        self.warnings = float_errors.WarningLog()
        self._memory: dict[int, TaskMemory] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_memory"] = {}
        state.pop("_wire", None)
        state["session"] = None  # the driver's; a worker reports (cache.take_reports)
        return state

    def run(self, index: int, req: Request) -> Any:
        """Compute block ``index`` (request ``req``) for every root, in this process;
        the held blocks of unknown-size sinks come back as a tuple (None when there
        are none)."""
        lane = self._lane(req)
        ctx = Context(index, req, self, lane)
        held: list[Any] | None = None
        try:
            with lane.computing() if lane is not None else contextlib.nullcontext():
                if self.sinks:
                    held = [s.run(ctx, req) for s in self.sinks]
                for r in self.reductions:
                    partial = r.run(ctx, req)
                    if partial is not SKIPPED:
                        r.acc.add(index, partial)
        finally:
            self._release(ctx)
        if held is None or all(h is None for h in held):
            return None
        return tuple(held)

    def _lane(self, req: Request) -> transfer.Lane | None:
        """The lane of the device this block runs on, or None for the CPU (see
        :func:`tierflow.engine.gpu.offload.block_device`)."""
        if self.device is None:
            return None
        rows = req.stop - req.start if isinstance(req, RowRange) else 1 << 20
        device = offload.block_device(self.device, self.work, rows)
        return None if device is None else transfer.lane(device)

    @staticmethod
    def _release(ctx: Context) -> None:
        ctx.memo.clear()  # first: a pooled block goes back only once nothing holds it
        if ctx.reads:
            drop = pressure.level_now() in _HIGH
            for reader, a, b in ctx.reads:
                reader.release(a, b, drop_cache=drop)

    def run_remote(
        self,
        index: int,
        req: Request,
        shared: str | None = None,
        errstate: tuple[str, ...] | None = None,
    ) -> Any:
        """Compute block ``index`` in a worker process (see :mod:`tierflow.engine.program.tasks`):
        partials come back by value, known rows of a file go to its place, other blocks
        come back by value or, when ``shared`` is a path stem in the shared folder, by
        a file there (sink ``k``'s at ``{shared}-{k}.npy``). ``errstate``: the
        compute's floating-point modes (:func:`tierflow.engine.program.float_errors.modes`);
        the warnings they give come back with the result."""
        from .tasks import BlockResult

        ctx = Context(index, req, self)
        ctx.caught = []
        with tally.counting() as counts:  # sent back for a profile in the driver
            try:
                with float_errors.applied(errstate):
                    blocks = tuple(
                        s.run_remote(ctx, req, None if shared is None else f"{shared}-{k}")
                        for k, s in enumerate(self.sinks)
                    )
                    partials = tuple(r.run(ctx, req) for r in self.reductions)
            finally:
                self._release(ctx)
        reports = tuple(cache_module.take_reports()) if self.uses_cache else ()
        trace = (_worker_name(), tuple(counts.items()))
        return BlockResult(partials, blocks, reports, tuple(ctx.caught), trace)

    def receive(self, index: int, req: Request, result: Any) -> Any:
        """In the driver, what a worker computed for block ``index``: its partials
        added, its blocks placed; returns what :meth:`run` would have."""
        if result.cache:
            cache_module.add_reports(list(result.cache), self.session)
        for message, site in result.warnings:
            self.warnings.warn(message, site)
        for r, partial in zip(self.reductions, result.partials, strict=True):
            if partial is not SKIPPED:
                r.acc.add(index, partial)
        held = [s.receive(req, b) for s, b in zip(self.sinks, result.blocks, strict=True)]
        if not held or all(h is None for h in held):
            return None
        return tuple(held)

    def sites(self) -> list[str]:
        """The node keys of the operators whose calls halving sizes (each once)."""
        keys = [r.site.key for r in self.reductions]
        keys += [s.site.key for s in self.steps() if isinstance(s, KernelStep)]
        return list(dict.fromkeys(keys))

    def cap_rows(self, rows: int) -> None:
        """Call every operator of this program on at most ``rows`` rows from now on in
        this process (:func:`tierflow.engine.program.halving.cap`)."""
        for key in self.sites():
            halving.cap(key, rows)

    @property
    def uses_cache(self) -> bool:
        """Whether a step or a reduction reads or writes the compute's cache."""
        found = self.__dict__.get("_uses_cache")
        if found is None:
            found = any(r.cache is not None for r in self.reductions) or any(
                isinstance(s, CachedStep) for s in self.steps()
            )
            self._uses_cache = found
        return bool(found)

    def files(self) -> list[str]:
        """The source files this program reads, each once."""
        found: dict[str, None] = {}
        for s in self.steps():
            if isinstance(s, SourceStep):
                found.update(dict.fromkeys(s.reader.files()))
        return list(found)

    def reads_files(self) -> bool:
        """Whether any step reads a file or object storage (else there is nothing to
        read ahead)."""
        return any(
            isinstance(s, SourceStep) and (s.reader.file_backed or s.reader.reads_ahead)
            for s in self.steps()
        )

    def prefetch(self, req: Request, remote: bool = False) -> None:
        """Ask the kernel for the file rows ``req`` will read, and a reader of object
        storage to fetch its rows (none for what the cache holds; ``remote``: files
        only, the task runs in another process)."""
        seen = set()
        roots = [(s.step, own_request(s.node, req)) for s in self.sinks] + [
            (i, own_request(r.reduced, req))
            for r in self.reductions
            if not r.cached(req) and not getattr(r.op, "idle", False)
            for i in r.inputs
        ]
        for root, asked in roots:
            for reader, a, b in root.sources(asked):
                if (id(reader), a, b) not in seen and (reader.file_backed or not remote):
                    seen.add((id(reader), a, b))
                    reader.readahead(a, b)

    def steps_of_roots(self) -> list[Step]:
        return [s.step for s in self.sinks] + [i for r in self.reductions for i in r.inputs]

    def steps(self) -> list[Step]:
        """Every step, each once."""
        found: dict[int, Step] = {}
        stack = self.steps_of_roots()
        while stack:
            step = stack.pop()
            if id(step) in found:
                continue
            found[id(step)] = step
            stack.extend(step.children())
        return list(found.values())

    def describe(self) -> str:
        """The program's roots and their steps, one per line, indented by depth (for
        logs and the plan's golden tests)."""
        lines: list[str] = []

        def walk(step: Step, depth: int) -> None:
            lines.append(f"{'  ' * depth}{type(step).__name__} {step.label()}")
            for child in step.children():
                walk(child, depth + 1)

        for s in self.sinks:
            lines.append(f"sink {s.node.label()} -> {type(s.sink).__name__}")
            walk(s.step, 1)
        for r in self.reductions:
            if r.derived_from is not None:
                lines.append(f"reduce {r.label} from the partials of {r.derived_from[0].label}")
                continue
            lines.append(f"reduce {r.label} by {type(r.chunker).__name__}")
            for step in r.inputs:
                walk(step, 1)
        return "\n".join(lines)

    def device_bytes(self, rows: int) -> int:
        """Projected bytes one task on a block of ``rows`` rows holds on its GPU (0 for a
        program without device steps), a pure function of the program:

        * every block copied in (a host step that a device step reads), twice for a
          source's rows (the next block's staged copy waits beside it);
        * every device kernel's output block, once more for its halving output, and its
          intermediates (a fused kernel's block-sized tensors; a ``map_blocks`` counts
          one output block, as on the host);
        * a device reduction's kernel intermediates and its partial."""
        device_steps = [
            s for s in self.steps() if isinstance(s, KernelStep) and s.device_op is not None
        ]
        roots = [r for r in self.reductions if r.device_reduce is not None]
        if not device_steps and not roots:
            return 0
        total = 0
        copied: dict[int, Step] = {}
        for step in device_steps:
            op = step.op
            out = block_bytes(rows, op.out_row_shape, op.out_dtype)
            total += 2 * out + int(step.device_op.temp_bytes(rows))
            copied.update((id(s), s) for s in step.children() if s not in device_steps)
        for root in roots:
            if root.device_kernel is not None:
                total += root.device_kernel.temp_bytes(rows)
            total += root.device_reduce.partial_bytes()
            copied.update((id(s), s) for s in root.inputs if s not in device_steps)
        for host in copied.values():
            node = host.node
            assert isinstance(node, Chunked)
            nbytes = block_bytes(rows, node.row_shape, node.dtype)  # type: ignore[arg-type]
            total += 2 * nbytes if isinstance(host, SourceStep) else nbytes
        return total

    def memory(self, rows: int) -> TaskMemory:
        """Projected bytes of one task on a block of ``rows`` rows (a pure function of
        the program: inputs read, blocks made, operators' scratch)."""
        found = self._memory.get(rows)
        if found is not None:
            return found
        into = {id(s.step) for s in self.sinks if s.sink.known}
        total = TaskMemory()
        for step in self.steps():
            total = total + step.memory(rows, id(step) in into)
        for s in self.sinks:
            total = total + s.memory(rows)
        for r in self.reductions:
            total = total + r.memory(rows)
        self._memory[rows] = total
        return total
