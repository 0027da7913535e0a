"""Plans: the task graph of a compute, its order, and the memory each task projects.

A compute asks for results: chunked arrays (into an array or a ``.npy`` file) and values
(reductions and what is computed from them). Planning:

1. **Nodes.** Every node reachable from the results, deduplicated by key (the same
   computation built twice runs once). File sources are checked: a file changed since
   its array was built is an error naming it.
2. **Stages.** A value used inside a chunked computation (``x - x.mean(0)``) must be
   known before that computation runs, so it runs in a later *stage*. Stage 0 holds
   every pass that needs no computed value; a reduction in stage ``s`` makes its value
   usable from stage ``s + 1``. A file is read once per stage that needs it: ``mean``
   and ``std`` of a file in one pass, then the standardised file in a second.
3. **Passes.** In a stage, results over the same blocks form one *pass*: one task per
   block computes all of them from a single read of that block (see
   :mod:`tierflow.engine.planning.lower`). Block ``j`` of a mask's result is block ``j`` of the
   array it masks, so the results over every mask of one array (and masks of those)
   form one pass too: ``tw.compute(x[m1].std(0), x[m2].sum(0))`` reads each block of
   ``x`` once (:func:`pass_key`), and the results over ``x`` itself join that pass
   (their roots compute rows ``bounds[j]:bounds[j + 1]`` of ``x`` for block ``j``:
   :func:`~tierflow.engine.program.steps.own_request`). Blocks whose projected memory
   exceeds a worker's share of the budget (``budget / (2 x workers)``) are cut into
   pieces first; an array whose blocks are cut keeps a pass of its own.
4. **Tasks**, in depth-first order (the scheduler runs the lowest ready index first)::

       stage 0:  [block 0] [block 1] ... [block n]   -> [finish mean] [finish std]
       stage 1:  [prepare: bind mean, std] -> [block 0] ... [block n] -> [commit file]

   a pass over blocks of unknown size writing a ``.npy`` file appends block ``j`` right
   after it is computed (``[block j] -> [append j]``, each append after the previous
   one), and block ``j`` starts only after the append of block ``j - 2 x workers``, so
   computed blocks never pile up behind a slow append; reductions are folded as blocks
   finish, so ``finish`` only aggregates.
5. **Memory.** Each block task carries its projection (:class:`TaskMemory`: file pages
   it reads, blocks it makes, operators' scratch), computed by the pure function
   :meth:`tierflow.engine.program.program.Program.memory`. A task whose single row exceeds
   the whole budget is refused before anything runs, quoting the numbers.
6. **Devices.** A block task whose program runs a ``map_blocks`` on a GPU
   (``device="cuda"``, ``"cuda:N"``, or ``"auto"`` where a GPU's budget fits the task)
   is a device task (``Task.device``): it also projects its bytes on the GPU (``device_bytes``: the
   blocks in and the result out, twice over for the function's own tensors, as
   ``MapBlocks`` estimates them), and the scheduler admits it against that GPU's budget.
7. **Cache.** With a cache session (:mod:`tierflow.engine.io.cache`), values it found
   (``session.resolved``) are constants: nothing below them is planned. Its chunked
   nodes and reductions are lowered with the session (cached steps, cached partials),
   and the tasks that finish its values write them to the cache.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...config import format_bytes
from ...errors import OutOfMemoryError
from ...operators.types import block_bytes
from ...storage import oom
from ...system import device_budget, devices
from .. import graph
from ..gpu import offload
from ..graph import Chunked, Node
from ..graph.block_operators import MapBlocks
from ..io.indexed import RegionSink
from ..io.memory import ArraySink
from ..io.npy import NpySink
from ..io.zarr import ZarrSink
from ..program import float_errors
from ..program.program import Program
from ..program.roots import Accumulator
from ..program.steps import KernelStep
from ..rowwide import external_sort
from ..types import BlockIndex, Request, RowRange, Task, TaskMemory
from . import jit as jit_module
from .jit import JitSettings
from .lower import lower_pass

__all__ = [
    "Plan",
    "Target",
    "build_plan",
    "describe",
    "device_bytes",
    "device_steps",
    "pass_key",
    "task_device",
]

log = logging.getLogger("tierflow.engine")

# A block task may take this share of the budget: two tasks per worker are in flight.
TASKS_PER_WORKER = 2


@dataclass
class Target:
    """One result a compute asks for: ``node`` computed into ``sink`` (None for a value)."""

    node: Node
    sink: ArraySink | NpySink | ZarrSink | RegionSink | None = None


@dataclass(frozen=True, slots=True)
class TaskOutput:
    """A result read from task ``task``'s result."""

    task: int


@dataclass(frozen=True, slots=True)
class ConstOutput:
    """A result known without running anything (a constant, a cached value)."""

    value: Any


Output = TaskOutput | ConstOutput


@dataclass
class Plan:
    """The tasks of a compute, in priority order, and how to read the results.

    Planning opens nothing: :meth:`open` opens the sinks (allocates outputs, creates
    temporary files) when the compute starts, and :meth:`abort` undoes that."""

    tasks: list[Task] = field(default_factory=list)
    outputs: list[Output] = field(default_factory=list)  # one per target, in order
    sinks: list[Any] = field(default_factory=list)
    what: str = ""
    stages: int = 0
    passes: int = 0
    programs: list[Program] = field(default_factory=list)  # one per pass, as planned
    # Every reduction's accumulator, planned or made by a prepare task (for abort).
    accumulators: list[Accumulator] = field(default_factory=list)
    # The passes that counted rows per block before this plan was built, in words
    # (see tierflow.engine.planning.counting); empty when no count was needed.
    counting: list[str] = field(default_factory=list)
    # The index of the first task of each stage (tasks are numbered stage by stage;
    # values computed from values after the last stage count in a stage of their own).
    stage_starts: list[int] = field(default_factory=list)
    # Files that live for one compute (an external sort's runs): open() when it starts,
    # close() when it ends, however it ends (see tierflow.engine.rowwide.external_sort).
    scratch: list[Any] = field(default_factory=list)
    # Where compiled kernels live and when a compute asks for one; None: NumPy path only.
    jit: JitSettings | None = None

    def add(self, task: Task) -> int:
        self.tasks.append(task)
        return len(self.tasks) - 1

    def kept(self) -> set[int]:
        """Tasks whose results the caller reads."""
        return {o.task for o in self.outputs if isinstance(o, TaskOutput)}

    def open(self, shared: str | None = None) -> None:
        """Open every sink, then the scratch (in ``shared``, the shared folder or prefix
        of a cluster's nodes, where given), and ask for the compiled kernels that pay;
        on a failure what was opened is undone."""
        opened = []
        try:
            for sink in self.sinks:
                sink.open()
            for scratch in self.scratch:
                scratch.open(shared)
                opened.append(scratch)
            for program in self.programs:
                jit_module.start(program, self.jit)
        except BaseException:
            for scratch in opened:
                scratch.close()
            self.abort()
            raise

    def close(self) -> None:
        """Close the scratch (its files are deleted): after the compute, whatever happened."""
        for scratch in self.scratch:
            scratch.close()

    def abort(self) -> None:
        """Free outputs and remove temporary files (sinks not opened do nothing, and
        reductions drop their partials)."""
        for sink in self.sinks:
            sink.abort()
        for acc in self.accumulators:
            acc.discard()

    def results(self, by_task: dict[int, Any]) -> list[Any]:
        """The targets' results, given the kept tasks' results."""
        return [by_task[o.task] if isinstance(o, TaskOutput) else o.value for o in self.outputs]


def _chunked_part(roots: list[Node]) -> list[Node]:
    """The chunked nodes a pass evaluates for ``roots`` (not crossing into values)."""
    found: dict[str, Node] = {}
    stack = [r.inputs[i] for r in roots if isinstance(r, graph.Reduce) for i in range(r.n_chunked)]
    stack += [r for r in roots if isinstance(r, Chunked)]
    while stack:
        node = stack.pop()
        if node.ident in found:
            continue
        found[node.ident] = node
        stack.extend(i for i in node.inputs if isinstance(i, Chunked))
    return list(found.values())


def _value_inputs(roots: list[Node]) -> list[Node]:
    """Value nodes the pass binds (operands of its chunked nodes, reduction parameters)."""
    found: dict[str, Node] = {}
    for node in _chunked_part(roots) + [r for r in roots if isinstance(r, graph.Reduce)]:
        for i in node.inputs:
            if isinstance(i, graph.Value):
                found[i.ident] = i
    return list(found.values())


def pass_key(partition: tuple[Any, ...]) -> tuple[Any, ...]:
    """What the passes of roots over ``partition`` (a node's
    :meth:`~tierflow.engine.graph.nodes.Chunked.partition`) are grouped by: the partition,
    except that the blocks of a filter (a mask's result) are keyed by the blocks it
    filters. Block ``j`` of a filter is computed from block ``j`` of its source, so the
    results over different masks of one array, in one task per block, read each block
    of it once."""
    kind, origin = partition[0], partition[1]
    if kind != "blocks" or not (isinstance(origin, tuple) and origin[:1] == ("filter",)):
        return partition
    below = origin[2]  # the filtered node's partition
    while below[0] == "blocks" and isinstance(below[1], tuple) and below[1][:1] == ("filter",):
        below = below[1][2]
    return ("filtered", below)


class _Pass:
    """One pass: roots over the same blocks, and the tasks that compute them.
    ``partition`` is its first root's (roots of a pass keyed by :func:`pass_key` have
    the same count of blocks)."""

    def __init__(self, stage: int, partition: Any) -> None:
        self.stage = stage
        self.partition = partition
        self.reduces: list[graph.Reduce] = []
        self.sinks: list[tuple[Chunked, Any]] = []  # (node, sink)

    def roots(self) -> list[Node]:
        return [*self.reduces, *(n for n, _ in self.sinks)]

    def label(self) -> str:
        names = [n.label() for n in self.roots()]
        text = ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
        return text


def _requests(p: _Pass, program: Program, task_limit: int) -> list[tuple[Request, int]]:
    """``(request, rows)`` of every block task of the pass, big blocks cut in pieces."""
    kind = p.partition[0]
    if kind == "rows":
        bounds = p.partition[1]
        out: list[tuple[Request, int]] = []
        append = out.append
        # Rows per piece for each block length (blocks mostly share one length); 0 for
        # a block kept whole, which is the per-block path a compute of many small
        # blocks takes, so it does no more than one lookup.
        steps: dict[int, int] = {}
        # A sink that writes whole stored objects (a Zarr chunk) has pieces cut on them.
        align = math.lcm(1, *(int(getattr(sink, "align", 1)) for _, sink in p.sinks))
        for a, b in itertools.pairwise(bounds):
            rows = b - a
            step = steps.get(rows)
            if step is None:
                need = program.memory(rows).total if rows else 0
                pieces = min(rows, math.ceil(need / task_limit)) if need > task_limit else 1
                step = 0 if pieces <= 1 else math.ceil(rows / pieces)
                if step:
                    step = -(-step // align) * align
                    step = 0 if step >= rows else step
                steps[rows] = step
            if not step:
                append((RowRange(a, b), rows))
                continue
            for start in range(a, b, step):
                stop = min(start + step, b)
                append((RowRange(start, stop), stop - start))
        return out
    nodes: dict[str, Chunked] = {}
    for root in p.roots():  # roots over different masks: the most rows any block has
        node = root.inputs[0] if isinstance(root, graph.Reduce) else root
        assert isinstance(node, Chunked)
        nodes.setdefault(node.ident, node)
    return [
        (BlockIndex(j), max(upper_rows(n, j) for n in nodes.values()))
        for j in range(p.partition[2])
    ]


def _check_fits(p: _Pass, program: Program, budget: int) -> None:
    if p.partition[0] != "rows" or not p.partition[1][-1]:
        return
    one = program.memory(1)
    if one.total > budget:
        fix = "make rows smaller"
        if one.temps > one.inputs + one.outputs:
            fix = (
                "store the data in smaller chunks: most of it is scratch that even one "
                "row needs, such as a compressed chunk decoded whole"
            )
        raise OutOfMemoryError(
            f"{p.label()} needs {format_bytes(one.total, 3)} for a single row (inputs "
            f"{format_bytes(one.inputs, 3)}, outputs {format_bytes(one.outputs, 3)}, "
            f"scratch {format_bytes(one.temps, 3)}), more than the whole RAM budget of "
            f"{format_bytes(budget, 3)}; raise the budget (memory.budget() or "
            f"TIERFLOW_RAM_BUDGET, setting ram_budget) or {fix}"
        )


class Planner:
    """Builds the :class:`Plan` of a compute of ``targets``, one method per stage (see
    the module docstring): :meth:`nodes`, :meth:`stages`, :meth:`passes`,
    :meth:`tasks`, :meth:`outputs`. Pure: it reads file headers' identities and
    builds programs, but allocates and opens nothing."""

    def __init__(  # noqa: PLR0913 -- keyword-only options, one per aspect of a compute
        self,
        targets: list[Target],
        *,
        workers: int,
        budget: int,
        cache: Any = None,
        device: str | None = None,
        jit: bool = False,
    ) -> None:
        self.targets = targets
        self.jit = jit  # whether fused reductions get a compiled kernel's source
        self.workers = max(1, workers)
        self.budget = budget
        self.cache = cache
        self.device = device  # the compute's device= (None: not given)
        self.resolved: dict[str, Any] = cache.resolved if cache is not None else {}
        self.plan = Plan()
        self.nodes_by_key: dict[str, Node] = {}
        self.stage: dict[str, int] = {}  # chunked node and reduction -> stage it runs in
        self.avail: dict[str, int] = {}  # value -> first stage it is known in
        self.pass_of: dict[tuple[int, Any], _Pass] = {}
        self.value_task: dict[str, int] = {}  # value node -> task computing it
        self.sink_task: dict[str, int] = {}  # chunked target -> task finishing its sink

    def build(self) -> Plan:
        """Every stage in turn; the plan."""
        self.nodes()
        self.stages()
        self.passes()
        self.tasks()
        self.outputs()
        return self.plan

    def nodes(self) -> None:
        """Every node reachable from the targets, by key; file sources are checked."""
        resolved = self.resolved
        roots = [t.node for t in self.targets]
        for node in graph.walk(roots, stop=lambda n: n.ident in resolved):
            self.nodes_by_key.setdefault(node.ident, node)
        for node in self.nodes_by_key.values():
            if isinstance(node, graph.Source):
                node.reader.check()
            scratch = getattr(node, "scratch", None)
            if scratch is not None:
                self.plan.scratch.append(scratch)

    def stages(self) -> None:
        """The stage of each chunked node and reduction, and when each value is known."""
        avail, stage = self.avail, self.stage
        for key, node in self.nodes_by_key.items():
            if key in self.resolved:
                avail[key] = 0
                continue
            deps = [
                stage[i.ident] if isinstance(i, Chunked) else avail[i.ident] for i in node.inputs
            ]
            level = max(deps, default=0)
            if isinstance(node, graph.Reduce):
                stage[key] = level
                avail[key] = level + 1
            elif isinstance(node, Chunked):
                stage[key] = level
            else:
                avail[key] = level

    def _pass_for(self, s: int, partition: Any) -> _Pass:
        key = (s, pass_key(partition))
        found = self.pass_of.get(key)
        if found is None:
            found = self.pass_of[key] = _Pass(s, partition)
        return found

    def passes(self) -> None:
        """Group reductions and sinks by stage and blocks: one pass per group."""
        for node in self.nodes_by_key.values():
            if isinstance(node, graph.Reduce) and node.ident not in self.resolved:
                source = node.inputs[0]
                assert isinstance(source, Chunked)
                self._pass_for(self.stage[node.ident], source.partition()).reduces.append(node)
        seen: set[str] = set()
        for t in self.targets:
            node = self.nodes_by_key[t.node.ident]
            if t.sink is None or node.ident in seen:
                continue
            assert isinstance(node, Chunked)
            seen.add(node.ident)
            self._pass_for(self.stage[node.ident], node.partition()).sinks.append((node, t.sink))
            self.plan.sinks.append(t.sink)

    def tasks(self) -> None:
        """The tasks, stage by stage: values computed from values as soon as their inputs
        are known, then each pass of the stage."""
        nodes = self.nodes_by_key.values()
        const: dict[str, Any] = {
            k: n.value for k, n in self.nodes_by_key.items() if isinstance(n, graph.Const)
        }
        const.update(self.resolved)
        applies = [n for n in nodes if isinstance(n, graph.Apply) and n.ident not in self.resolved]
        made: set[str] = set()
        n_stages = max([p.stage for p in self.pass_of.values()] + [0]) + 1

        def add_applies(up_to: int) -> None:
            for node in applies:
                if node.ident in made or self.avail[node.ident] > up_to:
                    continue
                if any(
                    i.ident not in const and i.ident not in self.value_task for i in node.inputs
                ):
                    continue
                made.add(node.ident)
                self.value_task[node.ident] = self.plan.add(
                    _apply_task(node, const, self.value_task, self.cache)
                )

        for s in range(n_stages):
            self.plan.stage_starts.append(len(self.plan.tasks))
            add_applies(s)
            stage_passes = self._stage_passes(s, const)
            for built in stage_passes:
                built.add()
            self.plan.passes += len(stage_passes)
        if len(made) < len(applies):
            self.plan.stage_starts.append(len(self.plan.tasks))
        while len(made) < len(applies):  # values computed from values, in dependency order
            before = len(made)
            add_applies(n_stages + 1)
            if len(made) == before:
                raise RuntimeError("a value depends on itself")
        self.plan.stages = n_stages

    def _stage_passes(self, s: int, const: dict[str, Any]) -> list[_PassTasks]:
        """The passes of stage ``s``, built, in the order they were found. A pass over an
        array's own blocks joins the pass over the blocks its masks cut, so that both
        read each block once (``tw.compute(x.sum(0), x[m].sum(0))``), when the joined
        pass's whole blocks fit a task's share of the budget: a pass over masked blocks
        cannot cut them in pieces, and an array's own pass cuts a block that does not
        fit (see :func:`_requests`)."""
        keyed = [(key, p) for (stage, key), p in self.pass_of.items() if stage == s]
        by_key = dict(keyed)
        joins: dict[Any, _PassTasks] = {}  # masked pass's key -> the pass joined to it
        for key, p in keyed:
            own = by_key.get(key[1]) if key[0] == "filtered" else None
            if own is None:
                continue
            both = _Pass(s, p.partition)
            both.reduces, both.sinks = [*own.reduces, *p.reduces], [*own.sinks, *p.sinks]
            joined = _PassTasks(self, both, const)
            if joined.whole_blocks_fit():
                joins[key] = joined
        absorbed = {key[1] for key in joins}
        return [
            joins[key] if key in joins else _PassTasks(self, p, const)
            for key, p in keyed
            if key not in absorbed
        ]

    def outputs(self) -> None:
        """How each target's result is read, and the plan's name."""
        plan, nodes = self.plan, self.nodes_by_key
        for t in self.targets:
            node = nodes[t.node.ident]
            if node.ident in self.resolved:
                plan.outputs.append(ConstOutput(self.resolved[node.ident]))
            elif isinstance(node, graph.Const):
                plan.outputs.append(ConstOutput(node.value))
            elif isinstance(node, Chunked):
                plan.outputs.append(TaskOutput(self.sink_task[node.ident]))
            else:
                plan.outputs.append(TaskOutput(self.value_task[node.ident]))
        n = len(self.targets)
        plan.what = ", ".join(nodes[t.node.ident].label() for t in self.targets[:4]) + (
            f" and {n - 4} more" if n > 4 else ""
        )


def build_plan(  # noqa: PLR0913 -- keyword-only options, one per aspect of a compute
    targets: list[Target],
    *,
    workers: int,
    budget: int,
    cache: Any = None,
    device: str | None = None,
    jit: JitSettings | None = None,
) -> Plan:
    """The plan of a compute of ``targets`` (see the module docstring and
    :class:`Planner`).

    ``cache`` is the compute's cache session, or None; ``device`` the compute's
    ``device=`` (see :func:`tierflow.engine.gpu.offload.pass_device`). Opens nothing: the caller opens
    the sinks with :meth:`Plan.open` when the compute starts. Raises
    :class:`~tierflow.errors.SourceError` for a changed source file and
    :class:`~tierflow.errors.OutOfMemoryError` for a task that cannot fit the budget
    even on one row.
    """
    plan = Planner(
        targets, workers=workers, budget=budget, cache=cache, device=device, jit=jit is not None
    ).build()
    plan.jit = jit
    return plan


def _dep_values(
    node: Node, const: dict[str, Any], value_task: dict[str, int]
) -> tuple[list[str], tuple[int, ...]]:
    keys = [i.ident for i in node.inputs if i.ident not in const]
    return keys, tuple(value_task[k] for k in keys)


def _apply_task(
    node: graph.Apply, const: dict[str, Any], value_task: dict[str, int], cache: Any
) -> Task:
    keys, deps = _dep_values(node, const, value_task)
    entry = cache.entry(node) if cache is not None else None

    def run(*results: Any) -> Any:
        bound = dict(const)
        bound.update(zip(keys, results, strict=False))
        try:
            with float_errors.naming(node.built_at, node.label()):
                value = node.evaluate(lambda n: bound[n.ident])
            if entry is not None:
                entry.put_value(value)
            return value
        except Exception as exc:
            if oom.is_oom(exc):
                raise OutOfMemoryError(
                    f"{node.label()} ran out of memory; it works on whole in-memory values, "
                    "so it cannot be split into row halves. " + oom.explain_oom(exc)
                ) from exc
            raise

    return Task(f"{node.label()}", run, deps)


class _PassTasks:
    """Adds the tasks of one pass to the planner's plan: ``prepare`` (when the pass binds
    computed values), the block tasks (with the appends of blocks of unknown size),
    then the tasks that finish its reductions and sinks."""

    def __init__(self, planner: Planner, p: _Pass, const: dict[str, Any]) -> None:
        self.planner = planner
        self.plan = planner.plan
        self.p = p
        self.const = const
        self.bound = [v for v in _value_inputs(p.roots()) if v.ident not in const]
        values: dict[str, Any] = dict(const)
        values.update({v.ident: graph.placeholder(v) for v in self.bound})
        with graph.quiet():
            self.program, self.accs = lower_pass(
                p.sinks, p.reduces, values, planner.cache, planner.device, jit=planner.jit
            )
        _check_fits(p, self.program, planner.budget)
        self.task_limit = max(1, planner.budget // (TASKS_PER_WORKER * planner.workers))
        self.requests = _requests(p, self.program, self.task_limit)
        self.program.name, self.program.count = p.label(), len(self.requests)
        self.prepare: int | None = None
        self.blocks: list[int] = []
        self._memories: dict[int, TaskMemory] = {0: TaskMemory()}
        self._device_needs: dict[int, int] = {}

    def whole_blocks_fit(self) -> bool:
        """Whether every block task projects at most a task's share of the budget."""
        return all(self.program.memory(rows).total <= self.task_limit for _, rows in self.requests)

    def add(self) -> None:
        self.plan.programs.append(self.program)
        self.plan.accumulators.extend(self.accs.values())
        if self.bound:
            self._add_prepare()
        npy_held = [
            (pos, sink)
            for pos, (_, sink) in enumerate(self.p.sinks)
            if not sink.known and getattr(sink, "appends", False)
        ]
        last_append = self._add_blocks_and_appends(npy_held) if npy_held else self._add_blocks()
        self._add_finishes(last_append)

    def _add_prepare(self) -> None:
        keys = [v.ident for v in self.bound]
        p, const, cache, device = self.p, self.const, self.planner.cache, self.planner.device
        label, count = self.program.name, self.program.count
        made = self.plan.accumulators
        plan = self.plan

        def prepare_fn(*results: Any) -> tuple[Program, dict[str, Accumulator]]:
            real = dict(const)
            real.update(zip(keys, results, strict=False))
            program, accs = lower_pass(
                p.sinks, p.reduces, real, cache, device, jit=plan.jit is not None
            )
            jit_module.start(program, plan.jit)
            program.name, program.count = label, count
            made.extend(accs.values())
            return program, accs

        deps = tuple(self.planner.value_task[k] for k in keys)
        self.prepare = self.plan.add(Task(f"prepare {label}", prepare_fn, deps))

    def _block_task(self, j: int, req: Request, rows: int) -> Task:
        program = self.program
        memory = self._memories.get(rows)
        if memory is None:
            memory = self._memories[rows] = program.memory(rows)
        prefetch = functools.partial(program.prefetch, req) if self._files else None
        prepared = self.prepare is not None
        device, device_need = self._device, 0
        if (
            device is not None
            and self._pass_device == "auto"
            and not self._device_steps
            and not offload.gpu_pays(program.work, rows)
        ):
            device = None  # "auto": this block's copy would cost more than its work
        if device is not None:
            device_need = self._device_needs.get(rows, -1)
            if device_need < 0:
                device_need = self._device_needs[rows] = self._device_bytes(rows)
            if device_need > self._auto_limit:
                device, device_need = None, 0  # "auto" that fits no GPU: the CPU
        return Task(
            f"block {j} of {program.name}",
            _run_prepared if prepared else program.run,
            (self.prepare,) if self.prepare is not None else (),
            memory=memory,
            prefetch=prefetch,
            rows=rows,
            args=(j, req),
            block=True,
            program=None if prepared else program,
            device=device,
            device_bytes=device_need,
        )

    @functools.cached_property
    def _device_steps(self) -> list[KernelStep]:
        return device_steps(self.program)

    @functools.cached_property
    def _pass_device(self) -> str | None:
        """The device the pass's fused operators run on (``compute(device=)``, the
        setting, or a GPU ``map_blocks`` they follow: :mod:`tierflow.engine.gpu.offload`),
        None on the CPU."""
        device = self.program.device
        return None if device in (None, "cpu") else str(device)

    @functools.cached_property
    def _device(self) -> str | None:
        found = task_device(self._device_steps)
        device = self._pass_device
        if device is None:
            return found
        offload.require(device)
        if device.startswith("cuda:"):
            return device
        if found is None:  # "cuda" or "auto": any GPU, when there is one
            return "cuda" if devices.gpus() else None
        return found

    def _device_bytes(self, rows: int) -> int:
        if self._pass_device is not None:
            return int(self.program.device_bytes(rows))
        return device_bytes(self._device_steps, rows)

    @functools.cached_property
    def _auto_limit(self) -> int | float:
        """The most GPU bytes a task may project and stay a device task: no limit when
        the pass or a step names a GPU ("cuda", "cuda:N"), else ("auto" only) the
        largest GPU budget; above it "auto" runs on the CPU."""
        named = self._pass_device not in (None, "auto")
        if named or any(step.op.device != "auto" for step in self._device_steps):
            return math.inf
        return max(device_budget.budgets().values(), default=0)

    @functools.cached_property
    def _files(self) -> bool:
        return self.program.reads_files()

    def _add_blocks(self) -> dict[int, int | None]:
        """Block tasks only, numbered in a row."""
        tasks = self.plan.tasks
        first = len(tasks)
        tasks.extend(self._block_task(j, req, rows) for j, (req, rows) in enumerate(self.requests))
        self.blocks = list(range(first, len(tasks)))
        return {}

    def _add_blocks_and_appends(self, npy_held: list[tuple[int, NpySink]]) -> dict[int, int | None]:
        """Block tasks, each followed by the appends of its rows to ``.npy`` files of
        unknown size; the last append task of each such sink (by position)."""
        ahead = TASKS_PER_WORKER * self.planner.workers  # blocks computed ahead of appends
        plan = self.plan
        last_append: dict[int, int | None] = {pos: None for pos, _ in npy_held}
        appends: list[tuple[int, ...]] = []  # the append tasks of each block
        for j, (req, rows) in enumerate(self.requests):
            task = self._block_task(j, req, rows)
            if j >= ahead:
                # Appends run one after another and may fall behind blocks computed on
                # every worker; a block held for its append costs RAM (and past half
                # the budget a spill). Block j waits for the appends of j - ahead.
                task.after = appends[j - ahead]
            self.blocks.append(plan.add(task))
            for pos, sink in npy_held:
                prev = last_append[pos]
                last_append[pos] = plan.add(_append_task(sink, pos, j, self.blocks[-1], prev))
            appends.append(tuple(a for a in last_append.values() if a is not None))
        return last_append

    def _add_finishes(self, last_append: dict[int, int | None]) -> None:
        plan, cache, blocks = self.plan, self.planner.cache, tuple(self.blocks)
        for r in self.p.reduces:
            entry = cache.entry(r) if cache is not None else None
            self.planner.value_task[r.ident] = plan.add(
                _finish_task(r, self.accs, blocks, self.prepare, entry)
            )
        for pos, (node, sink) in enumerate(self.p.sinks):
            self.planner.sink_task[node.ident] = plan.add(
                _sink_task(node, sink, pos, blocks, last_append.get(pos))
            )


def device_steps(program: Program) -> list[KernelStep]:
    """The steps of ``program`` that run a user function on a GPU: ``map_blocks`` with
    ``device="cuda"`` or ``"cuda:N"``, or ``"auto"`` while there is a GPU."""
    found = []
    gpu_here: bool | None = None
    for step in program.steps():
        op = getattr(step, "op", None)
        if not isinstance(step, KernelStep) or not isinstance(op, MapBlocks):
            continue
        device = op.device or "cpu"
        if device == "auto":
            if gpu_here is None:
                gpu_here = bool(devices.gpus())
            if gpu_here:
                found.append(step)
        elif device.startswith("cuda"):
            found.append(step)
    return found


def task_device(steps: list[KernelStep]) -> str | None:
    """The device a task running ``steps`` asks for: the first GPU a step names
    (``"cuda:N"``), else ``"cuda"`` (any GPU), None without such steps."""
    if not steps:
        return None
    for step in steps:
        device = step.op.device
        if device is not None and device.startswith("cuda:"):
            return str(device)
    return "cuda"


def device_bytes(steps: list[KernelStep], rows: int) -> int:
    """Projected GPU bytes of a task on ``rows`` rows running ``steps``: each step's
    blocks in and result out, twice over for the function's own tensors (a pure
    function of the steps, as ``MapBlocks`` estimates it)."""
    total = 0
    for step in steps:
        op = step.op
        ins = 0
        for s in step.inputs:
            node = s.node
            if isinstance(node, Chunked):
                ins += block_bytes(rows, node.row_shape, np.dtype(node.dtype))
        total += 2 * ins + 2 * block_bytes(rows, op.out_row_shape, op.out_dtype)
    return total


def _sink_task(
    node: Chunked, sink: Any, pos: int, blocks: tuple[int, ...], last_append: int | None
) -> Task:
    """The task that finishes ``sink`` (the ``pos``-th of its pass) once its blocks are
    written: commit known rows, commit a file after its appends, or assemble held blocks."""
    if sink.known:
        return Task(f"commit {node.label()}", lambda: sink.commit(), after=blocks)
    if getattr(sink, "appends", False):
        return Task(
            f"commit {node.label()}",
            lambda *r: sink.commit(r[0] if r else 0),
            () if last_append is None else (last_append,),
        )
    return Task(
        f"assemble {node.label()}",
        lambda *results: sink.assemble([r[pos] for r in results if r is not None]),
        blocks,
    )


def _run_prepared(j: int, req: Request, prepared: tuple[Program, Any]) -> Any:
    return prepared[0].run(j, req)


def _append_task(sink: NpySink, pos: int, j: int, block: int, prev: int | None) -> Task:
    def run(held: Any, row: int = 0) -> int:
        if held is None:
            return row
        return sink.append(row, held[pos])

    return Task(f"append block {j}", run, (block,) if prev is None else (block, prev))


def _finish_task(
    node: graph.Reduce,
    planned: dict[str, Accumulator],
    blocks: tuple[int, ...],
    prepare: int | None,
    entry: Any = None,
) -> Task:
    def run(*results: Any) -> Any:
        accs = results[0][1] if prepare is not None else planned
        acc = accs[node.ident]
        try:
            with float_errors.naming(node.built_at, node.label()):
                value = acc.op.aggregate(acc.result())
            if entry is not None:
                entry.put_value(value)
            return value
        except Exception as exc:
            if oom.is_oom(exc):
                raise OutOfMemoryError(
                    f"{node.label()} ran out of memory while aggregating its partial results; "
                    "an aggregate works on the whole partial, so it cannot be split. "
                    + oom.explain_oom(exc)
                ) from exc
            raise

    deps = (prepare,) if prepare is not None else ()
    return Task(f"finish {node.label()}", run, deps, after=blocks)


def describe(plan: Plan, *, tasks: bool = False) -> str:
    """A short text of the plan (stages, passes, tasks), for logs and errors.

    ``tasks=True`` adds every pass's program and every task, one per line: index, name,
    the tasks whose results it takes (``deps``) and those it waits for (``after``), its
    rows and projected bytes (inputs/outputs/scratch), and for a device task its device
    and projected bytes there. The plan's golden tests compare this text."""
    counts: dict[str, int] = defaultdict(int)
    for t in plan.tasks:
        counts[t.name.split(" ", 1)[0]] += 1
    parts = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    head = f"{len(plan.tasks)} tasks in {plan.stages} stage(s), {plan.passes} pass(es): {parts}"
    if plan.counting:
        head = "\n".join([*plan.counting, f"then {head}"])
    if not tasks:
        return head
    lines = [head]
    for k, program in enumerate(plan.programs):
        lines.append(f"program {k}: {program.name} ({program.count} blocks)")
        lines.extend(f"  {line}" for line in program.describe().splitlines())
    for i, t in enumerate(plan.tasks):
        m = t.memory
        lines.append(
            f"{i}: {t.name} deps={list(t.deps)} after={list(t.after)} rows={t.rows} "
            f"mem={m.inputs}/{m.outputs}/{m.temps}"
            + (f" device={t.device}/{t.device_bytes}" if t.device else "")
        )
    return "\n".join(lines)


def upper_rows(node: Chunked, j: int) -> int:
    """At most how many rows block ``j`` of ``node`` has (its exact count when known)."""
    if node.bounds is not None:
        return node.bounds[j + 1] - node.bounds[j]
    if isinstance(node, graph.Source):
        return int(node.reader.block_rows())
    if isinstance(node, graph.Concat):
        k, jj = node.block_table[j]
        return upper_rows(node.inputs[k], jj)  # type: ignore[arg-type]
    if isinstance(node, external_sort.SortedRows):  # equal shares of the rows
        return node.share(upper_rows)
    # The rows come from the chunked inputs (an in-memory operand may come first:
    # ``row + x[m]``); those of one node line up, so any of them bounds the block.
    source = next(n for n in node.inputs if isinstance(n, Chunked))
    scale = 1
    if isinstance(node, graph.Filter) and node.mask_ndim > 1:
        scale = math.prod(source.row_shape[: node.mask_ndim - 1])
    return upper_rows(source, j) * scale
