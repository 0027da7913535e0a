"""Compiling a kernel's source with numba, and running it on a block.

numba is imported on first use, never by ``import tierflow`` (it takes about half a
second). Where it cannot be imported, :func:`compiler_missing` says why, once, and
every program runs on the NumPy path.

A kernel's module is written to ``<folder>/k<key>.py`` (atomically: a temporary file,
then a rename), compiled by the compiling process (:mod:`.server`: numba never compiles
in the process that runs the kernel) and imported from there; numba's own on-disk
cache (``cache=True``: ``__pycache__`` beside the file, checked against the file and
numba's version) keeps its machine code, so a second process that loads the same
kernel finds it compiled. The folder's name holds numba's and Python's versions, so a
new numba never reads old code.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..types import Partial
from .source import KernelSource

__all__ = [
    "CompileError",
    "CompiledBincount",
    "CompiledElementwise",
    "CompiledHistogram",
    "CompiledMaskedReduction",
    "CompiledReduction",
    "Loaded",
    "compiler_missing",
    "kernel_folder",
    "load",
    "numba_installed",
    "on_disk",
    "on_exit_compile",
    "write_module",
]

_NICE = 10  # how much lower the compiling process's priority is

# How the compiling process (:mod:`.server`) starts: its priority is lowered first,
# before its imports (tierflow and NumPy take 0.3 s of CPU), and numba's import and
# compiles run below the compute too. Not SCHED_IDLE: a compute that keeps both cores
# busy starves it (a 5 s compute on the NumPy path got its kernel after 5.4 s and took
# 6.1 s; at nice 10 the kernel was there after 2.5 s and the compute took 3.8 s).
SERVER_COMMAND = (
    "import os\n"
    "try:\n"
    f"    os.nice({_NICE})\n"
    "except (AttributeError, OSError):\n"
    "    pass\n"
    "from tierflow.operators.compiled.server import main\n"
    "main()\n"
)

_IDLE_EXIT_S = 2.0  # how long exit waits for an idle compiling process to end
_MIN_COUNTS = 1024  # a compiled bincount's first counts ...
_MAX_COUNTS = 1 << 22  # ... and its most (32 MB): larger values count on the NumPy path
_PILOT_ELEMENTS = 16384  # values of a block's first rows that set the var/std shift

_lock = threading.Lock()
_missing: str | None = None
_checked = False


def compiler_missing() -> str | None:
    """Why kernels cannot be compiled here (numba cannot be imported), or None.

    The first call imports numba; where that fails it warns once, naming the fix.
    """
    global _missing, _checked
    with _lock:
        if not _checked:
            _checked = True
            try:
                import numba  # noqa: F401
            except Exception as exc:  # ImportError, or a broken llvmlite
                _missing = f"numba cannot be imported ({type(exc).__name__}: {exc})"
                warnings.warn(
                    f"tierflow: {_missing}; fused programs run on the NumPy path. "
                    "Install numba (pip install numba) for compiled kernels.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return _missing


def kernel_folder(root: str | os.PathLike[str]) -> Path:
    """The folder under ``root`` for this numba and Python (not created). Reads numba's
    version from its installed metadata: importing numba is not needed for it."""
    version = importlib.metadata.version("numba")
    return Path(root) / f"numba-{version}-py{sys.version_info[0]}{sys.version_info[1]}"


@dataclass(frozen=True)
class Loaded:
    """A compiled kernel: the function, and whether loading it compiled (seconds) or
    found the machine code on disk."""

    function: Callable[..., Any]
    compiled: bool
    seconds: float


def load(source: KernelSource, folder: str | os.PathLike[str]) -> Loaded:
    """The kernel of ``source``, read from numba's cache in ``folder``.

    Writes the module when it is not there; where its machine code is not cached yet,
    the compiling process (:mod:`.server`) compiles it first, so that numba never
    compiles in this process (see there why). Raises :class:`CompileError` with
    numba's reason for source it cannot compile.

    numba is imported here only after the compile: the import holds the GIL for much
    of half a second, which the computes running meanwhile need, and a compute shorter
    than the compile is over before it starts.
    """
    path = write_module(source, folder)
    start = time.perf_counter()
    compiled = not _cached(path)
    if compiled:
        _server().compile(path)
    missing = compiler_missing()
    if missing is not None:
        raise CompileError(missing)
    module = import_kernel(path)
    module.warm()  # reads the machine code from the cache
    return Loaded(module.kernel, compiled, time.perf_counter() - start)


def on_disk(source: KernelSource, folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds the machine code of ``source``'s kernel (then
    :func:`load` compiles nothing)."""
    return _cached(Path(folder) / f"k{source.key}.py")


def write_module(source: KernelSource, folder: str | os.PathLike[str]) -> Path:
    """The path of the module of ``source`` in ``folder``, written there (atomically)
    where it is not yet."""
    path = Path(folder) / f"k{source.key}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".k{source.key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(source.text)
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
    return path


def import_kernel(path: str | os.PathLike[str]) -> ModuleType:
    """The kernel module at ``path``, imported under one name in every process (numba's
    cache finds a kernel's globals through ``sys.modules`` by that name)."""
    name = "tierflow_kernel_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class CompileError(RuntimeError):
    """numba could not compile a kernel (the NumPy path runs instead)."""


def _cached(path: Path) -> bool:
    """Whether numba's cache holds machine code for the module at ``path``."""
    return any((path.parent / "__pycache__").glob(f"{path.stem}.kernel-*.nbi"))


class _Server:
    """The compiling process of this process (:mod:`.server`), started on first use;
    one compile at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one compile at a time
        self._input_lock = threading.Lock()  # one writer of its input at a time
        self._proc: subprocess.Popen[str] | None = None
        self._closed = False

    def _started(self) -> subprocess.Popen[str]:
        with self._input_lock:
            if self._closed:
                raise CompileError("this process is ending")
            proc = self._proc
            if proc is None or proc.poll() is not None:
                # Its errors come back as answers; numba's own messages stay out of
                # the user's terminal.
                proc = self._proc = subprocess.Popen(
                    [sys.executable, "-c", SERVER_COMMAND],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    bufsize=1,
                )
            return proc

    def _send(self, proc: subprocess.Popen[str], paths: Sequence[Path]) -> None:
        assert proc.stdin is not None
        with self._input_lock:
            proc.stdin.write("".join(f"{path}\n" for path in paths))
            proc.stdin.flush()

    def compile(self, path: Path) -> None:
        """Have the module at ``path`` compiled; CompileError with numba's reason."""
        with self._lock:
            proc = self._started()
            assert proc.stdout is not None
            try:
                self._send(proc, [path])
                answer = proc.stdout.readline().strip()
            except (OSError, ValueError) as exc:  # a broken pipe, or closed at exit
                answer = f"error: the compiling process ended ({exc})"
            if not answer:
                answer = f"error: the compiling process ended (exit {proc.poll()})"
        if answer != "ok":
            raise CompileError(answer.removeprefix("error: "))

    def close(self, paths: Sequence[Path] = ()) -> None:
        """At exit: hand ``paths`` to the compiling process (started for them where it
        is not running), then close its input. It is neither waited for nor killed: it
        finishes the compile under way and those, so that their machine code reaches
        the cache and the next process reads it from disk instead of compiling again
        (a compute shorter than a compile would otherwise leave every run compiling);
        then its input is at an end, and it ends. Its answers go nowhere. An idle one
        (nothing handed over, no compile under way) ends at once: it is waited for, so
        that nothing of it is left to warn about at exit."""
        with contextlib.suppress(OSError, ValueError, CompileError):
            if paths:
                self._send(self._started(), paths)
        with self._input_lock:
            self._closed = True
            proc = self._proc
        if proc is None or proc.stdin is None:
            return
        # Only the input: closing the output would wait for the answer a compiling
        # thread is reading (a reader holds the pipe's lock).
        with contextlib.suppress(OSError):
            proc.stdin.close()
        if paths or not self._lock.acquire(blocking=False):
            return
        try:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                proc.wait(_IDLE_EXIT_S)
                if proc.stdout is not None:
                    proc.stdout.close()
        finally:
            self._lock.release()


_servers: list[_Server] = []


def _server() -> _Server:
    with _lock:
        if not _servers:
            _servers.append(_Server())
        return _servers[0]


# Kernels this process asked for and had not compiled yet when it ended: each function
# here lists them as (source, kernel folder root); see _at_exit.
_unfinished: list[Callable[[], list[tuple[KernelSource, Path]]]] = []


def on_exit_compile(unfinished: Callable[[], list[tuple[KernelSource, Path]]]) -> None:
    """At this process's exit, have the kernels ``unfinished()`` lists compiled by the
    compiling process, which outlives it (:meth:`_Server.close`)."""
    _unfinished.append(unfinished)


def numba_installed() -> bool:
    """Whether numba can be imported, as far as this process knows without importing it."""
    if _checked:
        return _missing is None
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):  # sys.modules["numba"] set to None
        return False


def _at_exit() -> None:
    paths: list[Path] = []
    if numba_installed():
        for unfinished in _unfinished:
            for source, root in unfinished():
                with contextlib.suppress(Exception):  # an unwritable folder: nothing to do
                    path = write_module(source, kernel_folder(root))
                    if not _cached(path):
                        paths.append(path)
    if paths or _servers:
        _server().close(paths)


atexit.register(_at_exit)


def _flat(block: np.ndarray) -> np.ndarray | None:
    """A block's elements in order, as the kernel reads them: a view of a C-contiguous
    block, a column as it is (strided, one element per row), else None."""
    if block.flags.c_contiguous:
        return np.asarray(block).reshape(-1)
    if block.ndim == 1:
        return np.asarray(block)
    return None


def _flats(source: KernelSource, blocks: Sequence[np.ndarray]) -> list[np.ndarray] | None:
    """The blocks the kernel reads, as :func:`_flat` gives them; None where one is
    neither contiguous nor a column, or is not of the dtype the kernel was compiled for
    (a block in the other byte order: numba would read it wrong, or compile again)."""
    flats = [_flat(blocks[i]) for i in source.inputs]
    if any(f is None or f.dtype != d for f, d in zip(flats, source.input_dtypes, strict=True)):
        return None
    return flats  # type: ignore[return-value]


_LINE = 64  # bytes of a cache line


def _lanes(
    source: KernelSource, shift: np.ndarray | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The tiled var/std ``shift`` (a list of one array, or none) and the arrays a
    kernel folds into (``source.lane_inits``, each at its initial value), side by side
    in one buffer of whole cache lines of its own. Small arrays of their own ran the
    kernel at 0.7-0.8x on two threads: NumPy hands both threads' small allocations out
    of one cache, so the lanes one thread adds into every few nanoseconds can share a
    cache line with the other thread's, and arrays a page apart alias in the load-store
    unit."""
    specs = [(np.dtype(np.float64), 0.0)] if shift is not None else []
    specs += [(np.dtype(dtype), init) for dtype, init, _ in source.lane_inits]
    sizes = [-(-dtype.itemsize * source.lanes // _LINE) * _LINE for dtype, _ in specs]
    buffer = np.empty(sum(sizes) + 3 * _LINE, np.uint8)
    start = _LINE - buffer.ctypes.data % _LINE
    arrays = []
    for (dtype, init), size in zip(specs, sizes, strict=True):
        array = buffer[start : start + dtype.itemsize * source.lanes].view(dtype)
        array.fill(init)
        arrays.append(array)
        start += size
    if shift is None:
        return [], arrays
    arrays[0][:] = np.tile(shift, source.lanes // source.row_elements)
    return arrays[:1], arrays[1:]


def _shift(evaluate: Callable[[int], np.ndarray], head: int) -> np.ndarray:
    """The var/std shift: the mean of the expression's values on a block's first
    ``head`` rows, per element of a row."""
    with np.errstate(all="ignore"):
        values = np.asarray(evaluate(head), dtype=np.float64)
    return values.reshape(head, -1).mean(axis=0)


class CompiledReduction:
    """A fused reduction's partial of a block from its compiled kernel.

    ``partial(blocks, rows, evaluate, row_offset)`` returns the reduction's partial,
    exactly what ``chunk`` would return up to the order of the float64 additions, or
    None where the block must run on the NumPy path: a floating-point error happened
    (NumPy then warns or raises as it does), or an input is not contiguous.
    ``evaluate(rows)`` gives the expression's values on the block's first ``rows`` rows
    (the var/std shift); ``row_offset`` is the block's first row in the array.
    """

    def __init__(self, source: KernelSource, function: Callable[..., Any], op: Any) -> None:
        self.source = source
        self.function = function
        self.op = op
        self._pilot_rows = max(1, _PILOT_ELEMENTS // source.row_elements)

    def partial(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        evaluate: Callable[[int], np.ndarray],
        row_offset: int = 0,
    ) -> Partial | None:
        source = self.source
        if np.geterr()["under"] != "ignore":
            return None  # the kernel cannot see an underflow; NumPy's path can
        flats = _flats(source, blocks)
        if flats is None:
            return None
        shift = _shift(evaluate, min(rows, self._pilot_rows)) if source.pilot else None
        pilot, lanes = _lanes(source, shift)
        self.function(rows * source.row_elements, *pilot, *flats, *source.consts, *lanes)
        for lane, (_, _, checked) in zip(lanes, source.lane_inits, strict=True):
            if checked and not np.isfinite(lane).all():
                # A floating-point error, NaN or infinity in the data, or a float64 sum
                # that overflowed: the NumPy path gives NumPy's warnings and values.
                return None
        return self.op.partial_of_lanes(lanes, rows, shift, row_offset)


class CompiledElementwise:
    """A fused elementwise kernel's output block from its compiled kernel.

    ``apply(blocks, rows, out)`` writes the expression's values into ``out`` (the
    caller's output block, C-contiguous) and returns True, or returns False where the
    block must run on the NumPy path (which then overwrites ``out``): a floating-point
    error may have happened, the data hold NaN or infinity, or a block is not
    contiguous. Values are NumPy's bit for bit (:func:`~.source.elementwise_source`
    compiles only correctly rounded operations).
    """

    def __init__(self, source: KernelSource, function: Callable[..., Any]) -> None:
        self.source = source
        self.function = function

    def apply(self, blocks: Sequence[np.ndarray], rows: int, out: np.ndarray) -> bool:
        source = self.source
        if np.geterr()["under"] != "ignore" or not out.flags.c_contiguous:
            return False
        flats = _flats(source, blocks)
        if flats is None:
            return False
        _, lanes = _lanes(source)
        self.function(rows * source.row_elements, *flats, *source.consts, *lanes, out.reshape(-1))
        return all(np.isfinite(lane).all() for lane in lanes)


class CompiledMaskedReduction:
    """A reduction's partial of the rows a mask keeps, from the unfiltered blocks in one
    pass (:func:`~.source.masked_source`).

    ``partial(blocks, rows, evaluate)`` returns ``(True, partial)`` (None for a block
    whose rows the mask all dropped) or ``(False, None)`` where the block must run on
    the NumPy path, for the reasons of :class:`CompiledReduction`. The var/std shift is
    the mean of the block's first rows, kept or not (any shift gives the same
    variance; a near one keeps it accurate).
    """

    def __init__(self, source: KernelSource, function: Callable[..., Any], op: Any) -> None:
        self.source = source
        self.function = function
        self.op = op
        self._pilot_rows = max(1, _PILOT_ELEMENTS // source.row_elements)

    def partial(
        self, blocks: Sequence[np.ndarray], rows: int, evaluate: Callable[[int], np.ndarray]
    ) -> tuple[bool, Partial]:
        source = self.source
        if np.geterr()["under"] != "ignore":
            return False, None
        flats = _flats(source, blocks)
        if flats is None:
            return False, None
        shift = _shift(evaluate, min(rows, self._pilot_rows)) if source.pilot else None
        pilot, lanes = _lanes(source, shift)
        kept = np.zeros(1, np.int64)
        self.function(rows, *pilot, *flats, *source.consts, *lanes, kept)
        for lane, (_, _, checked) in zip(lanes, source.lane_inits, strict=True):
            if checked and not np.isfinite(lane).all():
                return False, None
        if not kept[0]:
            return True, None
        return True, self.op.partial_of_lanes(lanes, int(kept[0]), shift)


class CompiledBincount:
    """``np.bincount``'s counts of a block from its compiled kernel
    (:func:`~.source.bincount_source`): one pass, into counts of a capacity that grows
    to the largest value seen (up to :data:`_MAX_COUNTS`). Returns None where the block
    must run on the NumPy path: a negative value (NumPy's error), a value past the
    counts (then later blocks get room for it), a block of another dtype, a
    floating-point error in the expression's float steps."""

    def __init__(self, source: KernelSource, function: Callable[..., Any]) -> None:
        self.source = source
        self.function = function
        self.capacity = _MIN_COUNTS

    def partial(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        evaluate: Callable[[int], np.ndarray],
        row_offset: int = 0,
    ) -> Partial | None:
        source = self.source
        if source.lane_inits and np.geterr()["under"] != "ignore":
            return None
        flats = _flats(source, blocks)
        if flats is None or rows == 0:
            return None
        _, lanes = _lanes(source)
        capacity = self.capacity  # read once: another thread may grow it meanwhile
        counts = np.zeros(capacity, np.intp)
        seen = np.zeros(2, np.int64)
        self.function(rows, *flats, *source.consts, *lanes, counts, seen)
        if any(not np.isfinite(lane).all() for lane in lanes):
            return None
        high, low = int(seen[0]), int(seen[1])
        if low < 0:
            return None
        if high >= capacity:
            if high < _MAX_COUNTS:
                self.capacity = max(self.capacity, 1 << high.bit_length())
            return None
        return counts[: high + 1]


class CompiledHistogram:
    """A histogram's counts of a block from its compiled kernel
    (:func:`~.source.histogram_source`), or None where the block must run on the NumPy
    path (a floating-point error may have happened, a block is not contiguous)."""

    def __init__(self, source: KernelSource, function: Callable[..., Any], op: Any) -> None:
        self.source = source
        self.function = function
        self.edges = np.ascontiguousarray(op.histogram.edges)
        self.bins = len(self.edges) - 1

    def partial(
        self,
        blocks: Sequence[np.ndarray],
        rows: int,
        evaluate: Callable[[int], np.ndarray],
        row_offset: int = 0,
    ) -> Partial | None:
        source = self.source
        if np.geterr()["under"] != "ignore":
            return None
        flats = _flats(source, blocks)
        if flats is None:
            return None
        _, lanes = _lanes(source)
        counts = np.zeros(self.bins, np.intp)
        n = rows * source.row_elements
        self.function(n, *flats, *source.consts, *lanes, self.edges, counts)
        if any(not np.isfinite(lane).all() for lane in lanes):
            return None
        return counts
