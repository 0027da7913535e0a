"""A block task as data: what another process needs to run it, and how it runs there.

A block task of a plan computes block ``index`` of one pass: it runs the pass's
:class:`~tierflow.engine.program.program.Program` on the rows ``request`` names. In the
driver's own threads the task is a call of ``Program.run``. To run it in another
process the task travels as a :class:`BlockTask`, a small frozen record::

    BlockTask(program="3f9c…", index=7, request=RowRange(7000, 8000))

* ``program`` is the content hash of the pickled program (cloudpickle). The program
  itself travels once per worker process and is cached there by hash
  (:class:`Runtime`): its steps, kernels and user functions, its sources by path and
  identity (an in-memory array by value), and where its sinks' rows go.
* ``request`` names the rows: ``RowRange(a, b)`` for rows ``a:b``, ``BlockIndex(j)``
  for block ``j`` of rows counted only when computed (:mod:`tierflow.engine.types`).

:func:`run_task` runs one in any process that sees the same paths and returns a
:class:`BlockResult`: the reductions' partial results by value, and the blocks of sinks
whose rows are not written in place. A ``.npy`` file's known rows are written by the
worker at their offset in the file (by place); everything else comes back by value and
the driver places it (:meth:`~tierflow.engine.program.program.Program.receive`). The driver
keeps the order, admission, halving decisions and the combining of partials.

A program that reads or writes the compute's cache takes the cache's entries along by
store path: the worker opens the same store and reads and writes its blocks and
partials there; its counts (hits, misses, bytes) and failures come back with each
result, so ``tw.cache_info()`` and the cache's warnings in the driver see them.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeVar

import cloudpickle
import numpy as np

from ...errors import PortabilityError
from ...storage import sharing
from ..graph.callsites import CallSite
from ..types import Request

__all__ = [
    "LRU",
    "BlockResult",
    "BlockTask",
    "Runtime",
    "program_bytes",
    "reissue",
    "run_task",
    "ship",
    "shipped_program",
]


@dataclass(frozen=True, slots=True)
class BlockTask:
    """Block ``index`` of the program hashed ``program``, on rows ``request``, under
    the compute's floating-point ``errstate`` (divide, over, under, invalid; None:
    NumPy's defaults; see :mod:`tierflow.engine.program.float_errors`)."""

    program: str
    index: int
    request: Request
    errstate: tuple[str, ...] | None = None

    def __reduce__(self) -> tuple[Any, ...]:  # one per task: a slotted dataclass is slow
        return (BlockTask, (self.program, self.index, self.request, self.errstate))


@dataclass(frozen=True, slots=True)
class BlockResult:
    """What a block task sends back: ``partials[k]`` of the program's ``k``-th
    reduction (``SKIPPED`` where it was not needed), ``blocks[k]`` of its ``k``-th sink
    (None where the rows were written in place), ``cache``: what the worker counted
    in the compute's cache and what failed there
    (:func:`tierflow.engine.io.cache.take_reports`), ``warnings``: the floating-point
    warnings of its operators, ``(message, call site)``, for the driver to issue, and
    ``trace``: the worker that ran it and what happened inside it (``(worker, ((name,
    count), ...))``, see :mod:`tierflow.system.tally`), for a profile in the driver."""

    partials: tuple[Any, ...]
    blocks: tuple[Any, ...]
    cache: tuple[Any, ...] = ()
    warnings: tuple[Any, ...] = ()
    trace: tuple[Any, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        # Dask and multiprocessing pickle results below protocol 5, where NumPy would
        # rebuild an array in the other byte order as a native one.
        partials, blocks = _in_byte_order(self.partials), _in_byte_order(self.blocks)
        return (BlockResult, (partials, blocks, self.cache, self.warnings, self.trace))


def _in_byte_order(value: Any) -> Any:
    """``value`` (a partial or a block, or tuples and lists of them) with every array in
    the other byte order replaced by a stand-in that unpickles as it, byte order kept
    (:func:`tierflow.storage.sharing.in_byte_order`)."""
    if isinstance(value, np.ndarray):
        return sharing.in_byte_order(value)
    if type(value) in (tuple, list) and any(
        isinstance(v, (np.ndarray, tuple, list)) for v in value
    ):
        return type(value)(_in_byte_order(v) for v in value)
    return value


_lock = threading.Lock()
# Programs shipped from this process, by hash; a program lives as long as its plan.
_shipped: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def ship(program: Any) -> str:
    """The content hash of ``program``, pickled once (and kept on it) for shipping."""
    wire = getattr(program, "_wire", None)
    if wire is None:
        with _lock:
            wire = getattr(program, "_wire", None)
            if wire is None:
                try:
                    data = cloudpickle.dumps(program)
                except Exception as exc:
                    raise PortabilityError(
                        f"{program.name} cannot be sent to worker processes: pickling it "
                        f"failed ({type(exc).__name__}: {exc}). Functions it runs must "
                        "pickle (no locks, open files or sockets in their closures); run "
                        "it with executor='threads' instead"
                    ) from exc
                wire = (hashlib.sha256(data).hexdigest()[:32], data)
                program._wire = wire
                _shipped[wire[0]] = program
    return str(wire[0])


def shipped_program(key: str) -> Any:
    """The program ``key`` (:func:`ship` made its hash in this process)."""
    program = _shipped.get(key)
    if program is None:
        raise KeyError(f"program {key} was not shipped from this process, or its plan is gone")
    return program


def program_bytes(key: str) -> bytes:
    """The pickled program ``key`` (:func:`ship` made it in this process)."""
    return bytes(shipped_program(key)._wire[1])


K = TypeVar("K")
V = TypeVar("V")


class LRU(OrderedDict[K, V]):
    """A dict that keeps its ``size`` most recently used items: setting an item, or
    reading it with :meth:`use`, makes it the most recent; past ``size`` the least
    recent leaves. Programs are kept so on both sides: a worker's (:class:`Runtime`),
    and the driver's record of what each worker or cluster holds. Not thread safe: its
    users hold their own locks."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)

    def use(self, key: K) -> V:
        """The item of ``key``, now the most recent (KeyError when there is none)."""
        self.move_to_end(key)
        return self[key]


class Runtime:
    """A worker process's programs by hash (the most recent ``keep``)."""

    def __init__(self, keep: int = 32) -> None:
        self._programs: LRU[str, Any] = LRU(keep)
        self._failed: dict[str, BaseException] = {}

    def add(self, key: str, data: bytes) -> None:
        """Unpickle and keep program ``key``; a program that does not unpickle here
        raises, now and for each of its tasks."""
        try:
            program = cloudpickle.loads(data)
        except Exception as exc:
            self._failed[key] = exc
            raise
        self._programs[key] = program

    def has(self, key: str) -> bool:
        return key in self._programs

    def program(self, key: str) -> Any:
        try:
            return self._programs.use(key)
        except KeyError:
            failed = self._failed.get(key)
            if failed is not None:
                raise failed from None
            raise KeyError(f"program {key} has not been shipped to this process") from None


def reissue(desc: BlockTask, caught: Any) -> None:
    """In the driver, the warnings a worker process caught while it ran ``desc``, each
    ``(category, message, filename, lineno)``, issued at the same file and line, once
    per line per program (:class:`~tierflow.engine.program.float_errors.WarningLog`). A filter
    that makes one an error raises it."""
    try:
        log = shipped_program(desc.program).warnings
    except KeyError:  # its plan is gone: nobody waits for these any more
        return
    for category, message, filename, lineno in caught:
        log.warn(message, CallSite(filename, lineno, ""), category)


def run_task(desc: BlockTask, runtime: Runtime) -> BlockResult:
    """Run ``desc`` with the program ``runtime`` holds for it."""
    return runtime.program(desc.program).run_remote(
        desc.index, desc.request, errstate=desc.errstate
    )
