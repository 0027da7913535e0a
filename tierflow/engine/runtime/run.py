"""The node-level entry of a compute: from sink targets to results.

:func:`run` takes the graph nodes and sinks a public call (``tw.compute``, ``to_npy``,
``persist``, ``to_zarr``: :mod:`tierflow.engine.api.compute`) asks for. It counts the
rows that are unknown (:mod:`tierflow.engine.planning.counting`), opens the cache
session, chooses the executor, builds the plan, runs it with the scheduler and returns
the results; it works on nodes, never on Arrays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...system import budget as budget_module
from .. import graph
from ..graph import Chunked
from ..io import cache as cache_module
from ..io.memory import ArrayReader, ArraySink
from ..observe.profile import recorder_for
from ..observe.progress import progress_callbacks
from ..planning import counting, jit
from ..planning.plan import Target, build_plan, describe
from ..types import Executor, callback_list
from . import scheduler
from .executors import default_is_set, make_executor

__all__ = ["PLAN_LINES", "PROCESSES_PAY", "RunOptions", "resolve_rows", "run"]

log = logging.getLogger("tierflow.engine")


@dataclass(frozen=True)
class RunOptions:
    """The options every sink takes (see :func:`compute`)."""

    progress: bool | None = None
    executor: str | Executor | None = None
    workers: int | None = None
    callbacks: Any = None
    cache: Any = None
    device: str | None = None
    profile: Any = None
    jit: bool | str | None = None


PLAN_LINES = 200  # a profile keeps every task's line of plans with at most this many tasks

# Compressed bytes a source must read before worker processes pay for their start.
PROCESSES_PAY = 64 << 20


def _preferred(targets: list[Target]) -> str | None:
    """``"processes"`` when the compute chose no executor, its sources read at least
    :data:`PROCESSES_PAY` bytes that decode faster in worker processes than in threads
    (a compressed HDF5 dataset: h5py runs every call under one lock), and its graph can
    travel to them (no in-memory array, everything pickles); else None (threads)."""
    if default_is_set():
        return None
    nodes = graph.walk([t.node for t in targets])
    sources = [n for n in nodes if isinstance(n, graph.Source)]
    wanted = sum(int(getattr(s.reader, "processes_pay", lambda: 0)()) for s in sources)
    if wanted < PROCESSES_PAY:
        return None
    if any(isinstance(s.reader, ArrayReader) for s in sources):
        return None  # an in-memory array would travel to every worker
    try:
        import cloudpickle

        cloudpickle.dumps([t.node for t in targets])
    except Exception:  # a function that does not pickle: threads, as before
        return None
    return "processes"


def _resolve(targets: list[Target], options: RunOptions) -> tuple[list[Target], list[str]]:
    """``targets`` with the operations that wait for row counts built (see
    :mod:`tierflow.engine.planning.counting`): the counting passes run first, as computes of
    their own with the same options. Also those passes, in words."""
    nodes = [t.node for t in targets]
    if not any(isinstance(n, graph.Deferred) for n in graph.walk(nodes)):
        return targets, []

    def count(reductions: list[graph.Node]) -> list[Any]:
        return run([Target(r) for r in reductions], options)[0]

    built, passes = counting.resolve(nodes, count)
    out = []
    for target, node in zip(targets, built, strict=True):
        sink = target.sink
        if node is not target.node and type(sink) is ArraySink and isinstance(node, Chunked):
            sink = ArraySink(node)  # known rows now: written in place, not assembled
        out.append(Target(node, sink))
    return out, passes


def resolve_rows(node: graph.Node) -> graph.Node:
    """``node`` built on counted rows (its row count known), counting what it needs."""

    def count(reductions: list[graph.Node]) -> list[Any]:
        return run([Target(r) for r in reductions], RunOptions())[0]

    (built,), _ = counting.resolve([node], count, count_roots=True)
    return built


def run(targets: list[Target], options: RunOptions) -> tuple[list[Any], scheduler.Stats]:
    """Compute ``targets``: count unknown rows first, pick the executor, plan, run the
    tasks, and return each target's result (and the run's figures). On any error or
    KeyboardInterrupt the plan is aborted (outputs freed, spill files deleted)."""
    targets, counted = _resolve(targets, options)
    session = cache_module.session(options.cache, [t.node for t in targets])
    executor = options.executor
    if executor is None:
        executor = _preferred(targets)
    chosen, owned = make_executor(executor, options.workers)
    hooks = [*progress_callbacks(options.progress), *callback_list(options.callbacks)]
    recorder, sampled = recorder_for(options.profile, chosen)
    if recorder is not None:
        hooks.append(recorder)
    if sampled is not None:
        sampled.start()
    try:
        if session is not None:
            session.resolve([t.node for t in targets])
        plan = build_plan(
            targets,
            workers=chosen.workers,
            budget=budget_module.budget_bytes(),
            cache=session,
            device=options.device,
            jit=jit.settings(options.jit),
        )
        plan.counting = counted
        log.debug("plan of %s: %s", plan.what, describe(plan))
        if recorder is not None:
            recorder.planned(plan, describe(plan, tasks=len(plan.tasks) <= PLAN_LINES))
        place = getattr(chosen, "scratch_place", None)  # a cluster's shared place
        plan.open(place() if place is not None else None)
        try:
            results, stats = scheduler.run(
                plan.tasks, chosen, keep=plan.kept(), callbacks=hooks, what=plan.what
            )
        except BaseException:
            plan.abort()
            raise
        finally:
            plan.close()
    finally:
        if owned:
            chosen.shutdown()
        if session is not None:
            session.finish()
        if sampled is not None:
            sampled.stop()
    return plan.results(results), stats
