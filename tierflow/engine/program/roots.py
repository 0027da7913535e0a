"""The roots of a block program: reductions (:class:`ReduceRoot`, whose partials an
:class:`Accumulator` merges) and sinks (:class:`SinkRoot`, with held blocks that travel
back from other processes as :class:`SharedBlock` files)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...storage import intermediates
from .. import graph
from ..gpu import transfer
from ..graph import Chunked
from ..io.cache import MISS
from ..types import Request, RowRange, TaskMemory
from . import halving
from .context import SKIPPED, Context, operator_call
from .steps import Step, own_request

__all__ = [
    "SHARED_MIN",
    "Accumulator",
    "ReduceRoot",
    "SharedBlock",
    "SinkRoot",
]


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
        partial = operator_call(
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
    """A block a worker wrote to the shared folder or object storage, by path or URL:
    ``.npy`` bytes written under a temporary name and committed
    (:func:`tierflow.storage.intermediates.write_npy`), so a retried or duplicated task
    is harmless. The driver reads it once (:meth:`take`) and deletes it."""

    path: str

    @staticmethod
    def write(stem: str, block: np.ndarray) -> SharedBlock:
        """Write ``block`` as ``stem + ".npy"`` (by way of ``stem + ".tmp"``); the
        driver chose ``stem`` (in the shared folder or prefix), so it can remove the
        file of an attempt it stopped."""
        return SharedBlock(intermediates.write_npy(stem, block))

    def take(self) -> np.ndarray:
        """The block in this process's RAM; the file is gone afterwards."""
        try:
            return intermediates.read_npy(self.path)
        finally:
            intermediates.remove(self.path)

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
