"""The steps of a block program (see :mod:`tierflow.engine.program.program`): a source's
block, a fused kernel, a row slice or pick, a mask, a counted mask, a concatenation, a
cached node's block; and the pool that lends source blocks."""

from __future__ import annotations

import abc
import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...operators import byteorder, selection, torch_ops
from ...operators.types import block_bytes
from ...storage import pages
from ...storage.pool import Pool
from ...system import budget
from .. import graph
from ..graph import Chunked, Node
from ..types import BlockIndex, Request, RowRange, TaskMemory
from . import halving
from .context import Context, operator_call, user_error

__all__ = [
    "BLOCK_POOL_MAX",
    "CachedStep",
    "ConcatStep",
    "CountedStep",
    "FilterStep",
    "KernelStep",
    "SliceStep",
    "SourceStep",
    "Step",
    "TakeStep",
    "UnfilteredStep",
    "own_request",
    "widest_rows",
    "worker_name",
]


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
        errors told as :func:`operator_call` says."""
        return operator_call(
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


def worker_name() -> str:
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
            raise user_error(self.node.label(), ctx, inner, exc) from exc

    def children(self) -> list[Step]:
        return [self.source] + ([self.mask] if self.mask is not None else [])

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        yield from self.source.sources(self._inner(req))

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        return TaskMemory(outputs=block_bytes(rows, self.node.row_shape, self.node.dtype))  # type: ignore[arg-type]


class UnfilteredStep(Step):
    """A step under a filter, asked for the rows of one of the filter's blocks: all the
    rows that block is taken from, none dropped (a compiled masked reduction reads them
    whole and applies the mask itself; see :mod:`tierflow.engine.planning.jit`)."""

    def __init__(self, filtered: FilterStep, step: Step) -> None:
        self.filtered = filtered
        self.step = step
        self.node = step.node

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        return self.step.host(ctx, self.filtered._inner(req))

    def children(self) -> list[Step]:
        return [self.step]

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        yield from self.step.sources(self.filtered._inner(req))

    def label(self) -> str:
        return f"{self.step.label()} (unfiltered)"


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
