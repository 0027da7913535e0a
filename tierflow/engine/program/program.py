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

import contextlib
from typing import Any

from ...operators.types import block_bytes
from ...system import pressure, tally
from ..gpu import offload, transfer
from ..graph import Chunked, callsites
from ..io import cache as cache_module
from ..types import Request, RowRange, TaskMemory
from . import float_errors, halving
from .context import HIGH_PRESSURE, SKIPPED, Context
from .roots import ReduceRoot, SinkRoot
from .steps import CachedStep, KernelStep, SourceStep, Step, own_request, worker_name

__all__ = [
    "Program",
]


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
            drop = pressure.level_now() in HIGH_PRESSURE
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
        trace = (worker_name(), tuple(counts.items()))
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
            line = f"{'  ' * depth}{type(step).__name__} {step.label()}"
            op: Any = getattr(step, "op", None)
            if getattr(op, "compiled", None) is not None:
                line += f" [compiled kernel {op.compiled.key}]"
            elif getattr(op, "not_compiled", None):
                line += f" [NumPy path: {op.not_compiled}]"
            lines.append(line)
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
            compiled = getattr(r.chunker, "compiled", None)
            if compiled is not None:
                lines.append(f"  compiled kernel {compiled.key}")
            elif getattr(r.chunker, "not_compiled", None):
                lines.append(f"  NumPy path: {r.chunker.not_compiled}")
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
