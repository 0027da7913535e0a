"""Tiered kernels: blocks run on the NumPy path until the compiled kernel is ready.

A :class:`CompiledSlot` is what a fused operator carries (a fused reduction, a fused
elementwise kernel, a reduction of the rows a mask keeps): the kernel's source (made
while the program is lowered, which compiles nothing) and, once
:meth:`CompiledSlot.start` asked for it, the kernel that one background thread per
process loads: compiled by the compiling process where the kernel folder does not hold
it yet (:mod:`.kernels`, :mod:`.server`), then read from there. ``partial`` (``apply``,
``masked_partial``) returns None until the kernel is ready, and for blocks the kernel
sends back (a floating-point error, NaN in the data): the caller then runs the NumPy
path. So no block ever waits for a compiler, and a compute that ends before its kernel
is ready ran on the NumPy path throughout. A process that ends with kernels still to
load hands them to the compiling process at exit (:func:`.kernels.on_exit_compile`),
which finishes them for the next process without being waited for.

Kernels are kept per process by key (:attr:`~.source.KernelSource.key`): every program
with the same expression shape and dtypes shares one, compiled once. The thread runs at
a lower scheduling priority where the system allows it; importing numba and reading a
kernel need the GIL, which it gives up every few milliseconds.

A slot travels to a worker process without its kernel and asks that process's thread
for it when it arrives: the kernel folder keeps the machine code, so a machine compiles
a kernel once, not once per task or per process.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._blocks import check_blocks
from ..types import Partial
from .kernels import (
    CompiledBincount,
    CompiledElementwise,
    CompiledHistogram,
    CompiledMaskedReduction,
    CompiledReduction,
    Loaded,
    compiler_missing,
    kernel_folder,
    load,
    numba_installed,
    on_disk,
    on_exit_compile,
)
from .source import KernelSource

__all__ = [
    "CompiledSlot",
    "Kernel",
    "KernelChunker",
    "MaskedKernelChunker",
    "kernels",
    "set_policy",
]

_NICE = 10  # how much lower the compiling thread's priority is
# Seconds between asking for a kernel no folder holds and the compile: the compiling
# process, even at the lowest priority, takes 15-20 ms of CPU from the compute that
# asked (a first compute of 60 ms over 320 MB took 1.25-1.35x as long).
COMPILE_DELAY = 0.3

# Whether this process may load kernels now, or why not (the engine sets the rule: a
# process whose memory budget leaves no room for numba runs the NumPy path).
_policy: Callable[[], str | None] = lambda: None  # noqa: E731


def set_policy(policy: Callable[[], str | None]) -> None:
    """Set the rule :meth:`CompiledSlot.start` follows: ``policy()`` gives None where
    this process may load kernels, else why not."""
    global _policy
    _policy = policy


class Kernel:
    """One compiled kernel of this process: waiting, ready, or failed (with why).

    ``state`` and the fields below are written by the loading thread once, under
    ``_lock``; readers see either the old or the new state.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.state = "idle"  # idle, waiting, ready, failed
        self.function: Callable[..., Any] | None = None
        self.reason: str | None = None
        self.compiled = False  # whether loading it compiled (else it came from disk)
        self.seconds = 0.0
        self.ready = threading.Event()

    def _done(self, loaded: Loaded | None, reason: str | None) -> None:
        with _lock:
            if loaded is not None:
                self.function = loaded.function
                self.compiled = loaded.compiled
                self.seconds = loaded.seconds
                self.state = "ready"
            else:
                self.reason = reason
                self.state = "failed"
        self.ready.set()


_lock = threading.Lock()
_kernels: dict[str, Kernel] = {}
_queue: queue.Queue[tuple[KernelSource, Path, Kernel]] = queue.Queue()
_thread: threading.Thread | None = None
_current: list[tuple[KernelSource, Path, Kernel]] = []  # what the thread is loading now


def _unfinished() -> list[tuple[KernelSource, Path]]:
    """The kernels asked for and not loaded yet (at exit: see :func:`on_exit_compile`)."""
    items = list(_current)
    while True:
        try:
            items.append(_queue.get_nowait())
        except queue.Empty:
            break
    return [(source, folder) for source, folder, kernel in items if kernel.state == "waiting"]


on_exit_compile(_unfinished)


def kernels() -> list[Kernel]:
    """The kernels this process knows (for reports and tests)."""
    with _lock:
        return list(_kernels.values())


def _request(source: KernelSource, folder: Path) -> Kernel:
    """The kernel of ``source``: known, or queued for the compiling thread."""
    global _thread
    with _lock:
        kernel = _kernels.get(source.key)
        if kernel is None:
            kernel = _kernels[source.key] = Kernel(source.key)
        if kernel.state == "idle":
            kernel.state = "waiting"
            _queue.put((source, folder, kernel))
            if _thread is None or not _thread.is_alive():
                _thread = threading.Thread(target=_compile_loop, name="tierflow-jit", daemon=True)
                _thread.start()
    return kernel


def _known(source: KernelSource) -> Kernel | None:
    with _lock:
        return _kernels.get(source.key)


def _compile_loop() -> None:
    # A lower priority for this thread only (on Linux a thread is a task of its own).
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
    while True:
        source, folder, kernel = item = _queue.get()
        _current[:] = [item]
        # numba is not imported here before the compile (see load): only looked for.
        missing = None if numba_installed() else compiler_missing()
        if missing is not None:
            kernel._done(None, missing)
            continue
        try:
            if not on_disk(source, kernel_folder(folder)):
                # A compute that ends within the delay could not have used the kernel,
                # and does not share the cores with the compile (exit hands the kernel
                # over: on_exit_compile).
                time.sleep(COMPILE_DELAY)
            loaded = load(source, kernel_folder(folder))
        except Exception as exc:  # numba's errors: the NumPy path runs instead
            missing = compiler_missing()
            kernel._done(
                None, missing or f"numba could not compile it ({type(exc).__name__}: {exc})"
            )
        else:
            kernel._done(loaded, None)
        _current.clear()


class CompiledSlot:
    """A fused operator's compiled form: its source, and its kernel once started.

    Counts the blocks each path ran (``counts``: kernel, waiting, sent back), under a
    lock: blocks run on several threads.
    """

    def __init__(self, source: KernelSource, op: Any = None) -> None:
        self.source = source
        self.op = op  # the reduction, or None for an elementwise kernel
        self._folder: Path | None = None
        self._kernel: Kernel | None = None
        self._runner: Any = None
        self._refused: str | None = None  # why this process did not load the kernel
        self._count_lock = threading.Lock()
        self.counts = {"kernel": 0, "waiting": 0, "sent back": 0}

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "op": self.op, "folder": self._folder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"], state["op"])  # type: ignore[misc]
        if state["folder"] is not None:
            self.start(state["folder"])

    @property
    def key(self) -> str:
        return self.source.key

    def loaded(self) -> bool:
        """Whether this process has the kernel already (then using it costs nothing)."""
        kernel = _known(self.source)
        return kernel is not None and kernel.state == "ready"

    def start(self, folder: str | os.PathLike[str]) -> None:
        """Ask for the kernel (compiled, or read from ``folder``) on the background
        thread; blocks use it as soon as it is ready. Where the process's rule says no
        (:func:`set_policy`), nothing is asked and ``describe`` says why."""
        self._folder = Path(folder)
        self._refused = _policy()
        if self._refused is None:
            self._kernel = _request(self.source, self._folder)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the kernel is ready or failed (tests and benchmarks); whether it is
        ready."""
        if self._kernel is None:
            return False
        self._kernel.ready.wait(timeout)
        return self._kernel.state == "ready"

    def state(self) -> str:
        """``off`` (not started), ``waiting``, ``ready`` or ``failed: <why>``."""
        kernel = self._kernel
        if kernel is None:
            return "off"
        if kernel.state == "failed":
            return f"failed: {kernel.reason}"
        return kernel.state

    def describe(self) -> str:
        """The kernel's state in words: ``not asked for`` (the compute was small),
        ``compiled in 0.42 s``, ``read from disk in 0.1 s``, ``not ready ...``,
        ``failed: ...``."""
        kernel = self._kernel
        if self._refused is not None:
            return f"not loaded: {self._refused}"
        if kernel is None:
            return "not asked for (a small compute)"
        if kernel.state == "failed":
            return f"failed: {kernel.reason}"
        if kernel.state != "ready":
            return "not ready before the compute ended (compiling, or reading from disk)"
        if kernel.compiled:
            return f"compiled in {kernel.seconds:.2f} s"
        return f"read from disk in {kernel.seconds:.2f} s"

    def _count(self, what: str) -> None:
        with self._count_lock:
            self.counts[what] += 1

    def _ready(self) -> Any:
        """The runner of the kernel, once it is ready (else None, counted as waiting)."""
        runner = self._runner
        if runner is not None:
            return runner
        kernel = self._kernel
        if kernel is None:
            return None
        function = kernel.function
        if function is None:
            self._count("waiting")
            return None
        if self.source.out_dtype is not None:
            runner = CompiledElementwise(self.source, function)
        elif self.source.edges_dtype is not None:
            runner = CompiledHistogram(self.source, function, self.op)
        elif self.source.counts:
            runner = CompiledBincount(self.source, function)
        elif self.source.masked:
            runner = CompiledMaskedReduction(self.source, function, self.op)
        else:
            runner = CompiledReduction(self.source, function, self.op)
        self._runner = runner
        return runner

    def partial(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        evaluate: Callable[[int], np.ndarray],
        row_offset: int = 0,
    ) -> Partial | None:
        """The block's partial from the kernel, or None: run the NumPy path."""
        runner = self._ready()
        if runner is None:
            return None
        partial = runner.partial(blocks, rows, evaluate, row_offset)
        self._count("sent back" if partial is None else "kernel")
        return partial

    def masked_partial(
        self, blocks: Sequence[np.ndarray], rows: int, evaluate: Callable[[int], np.ndarray]
    ) -> tuple[bool, Partial]:
        """``(True, partial)`` of the rows the mask keeps, from the kernel, or
        ``(False, None)``: run the NumPy path."""
        runner = self._ready()
        if runner is None:
            return False, None
        done, partial = runner.partial(blocks, rows, evaluate)
        self._count("kernel" if done else "sent back")
        return done, partial

    def apply(self, blocks: Sequence[np.ndarray], rows: int, out: np.ndarray) -> bool:
        """Whether the kernel wrote the block's values into ``out`` (else run the NumPy
        path, which overwrites it)."""
        runner = self._ready()
        if runner is None:
            return False
        done = bool(runner.apply(blocks, rows, out))
        self._count("kernel" if done else "sent back")
        return done


class KernelChunker:
    """A built-in row reduction (or ``np.bincount``) of its input itself (no
    expression), with its compiled kernel beside it: ``chunk`` takes the kernel's
    partial when it gives one, else the reduction's own. ``compiled`` is the
    :class:`CompiledSlot` (None where there is none, then ``not_compiled`` says why);
    the rest is the reduction's."""

    row_independent = False
    n_inputs = 1

    def __init__(self, reduction: Any, compiled: CompiledSlot | None, why: str | None) -> None:
        self.reduction = reduction
        self.compiled = compiled
        self.not_compiled = why
        self.out_dtype = reduction.out_dtype
        self.out_shape = reduction.out_shape
        self.commutative = reduction.commutative

    def __repr__(self) -> str:
        return f"KernelChunker({self.reduction!r})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The block's partial: the kernel's, or the reduction's own chunk."""
        compiled = self.compiled
        if compiled is not None:
            op = self.reduction
            if hasattr(op, "in_row_shape"):  # a row reduction: its checks first
                rows = check_blocks(blocks, [op.in_dtype], [op.in_row_shape], op.kind)
            else:  # np.bincount: the kernel runs on its own dtype only
                rows = blocks[0].shape[0]
            if rows:
                block = blocks[0]
                found = compiled.partial(blocks, rows, lambda n: block[:n], int(row_offset))
                if found is not None:
                    return found
        return self.reduction.chunk(*blocks, row_offset=row_offset)

    def combine(self, a: Partial, b: Partial) -> Partial:
        return self.reduction.combine(a, b)

    def aggregate(self, partial: Partial) -> Any:
        return self.reduction.aggregate(partial)

    def temp_bytes(self, rows: int) -> int:
        return int(self.reduction.temp_bytes(rows))

    def partial_bytes(self) -> int:
        return int(self.reduction.partial_bytes())


class MaskedKernelChunker:
    """A built-in row reduction of the rows a mask keeps, computed from the unfiltered
    blocks: by the compiled kernel (one pass, nothing copied) when it is ready, else as
    the engine's filter would (the mask's columns, the mask's kernel, the kept rows)
    and the reduction's own chunk.

    ``columns`` are ``(input, op)``: the block input and the row selection
    (:class:`~tierflow.operators.selection.TrailingIndex`) that give each input of the
    ``mask`` kernel; ``data`` is the fused kernel of the reduced values, or None for
    the first block input itself.
    """

    row_independent = False

    def __init__(  # noqa: PLR0913 -- the reduction, its kernel, then the filter's parts
        self,
        reduction: Any,
        compiled: CompiledSlot,
        data: Any,
        mask: Any,
        columns: Sequence[tuple[int, Any]],
        n_inputs: int,
    ) -> None:
        self.reduction = reduction
        self.compiled = compiled
        self.not_compiled: str | None = None
        self.data = data
        self.mask = mask
        self.columns = list(columns)
        self.n_inputs = n_inputs
        self.out_dtype = reduction.out_dtype
        self.out_shape = reduction.out_shape
        self.commutative = reduction.commutative

    def __repr__(self) -> str:
        return f"MaskedKernelChunker({self.reduction!r}, mask {self.mask!r})"

    def _values(self, blocks: Sequence[np.ndarray], rows: int) -> np.ndarray:
        return (
            blocks[0][:rows] if self.data is None else self.data.apply(*(b[:rows] for b in blocks))
        )

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The partial of the kept rows of the block (None where none is kept)."""
        rows = blocks[0].shape[0]
        if rows == 0:
            return None
        done, partial = self.compiled.masked_partial(
            blocks, rows, lambda n: self._values(blocks, n)
        )
        if done:
            return partial
        keep = self.mask.apply(*(op.apply(blocks[i]) for i, op in self.columns))
        values = self._values(blocks, rows)[keep]
        if values.shape[0] == 0:
            return None
        return self.reduction.chunk(values, row_offset=row_offset)

    def combine(self, a: Partial, b: Partial) -> Partial:
        return self.reduction.combine(a, b)

    def aggregate(self, partial: Partial) -> Any:
        return self.reduction.aggregate(partial)

    def temp_bytes(self, rows: int) -> int:
        # The NumPy path's mask, columns and kept rows, as the filter's step holds them.
        elements = rows * max(1, math.prod(self.reduction.in_row_shape))
        kept = elements * np.dtype(self.reduction.in_dtype).itemsize
        return int(self.reduction.temp_bytes(rows)) + kept + rows * (1 + 8 * len(self.columns))

    def partial_bytes(self) -> int:
        return int(self.reduction.partial_bytes())
