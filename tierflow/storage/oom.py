"""Out-of-memory errors: recognise them, recover from them, explain them.

:func:`is_oom` tells an out-of-memory error from any other: ``MemoryError`` (which
includes cupy's ``OutOfMemoryError``), torch's ``torch.cuda.OutOfMemoryError``, and the
``RuntimeError`` older torch versions raise with "CUDA out of memory" in the message.
It never imports torch or cupy: the classes are matched by name and module.

:func:`empty_gpu_caches` gives cached GPU memory back to the driver (torch's caching
allocator, cupy's pools), only for the libraries this process has already imported and
initialised.

:func:`explain_oom` turns a final out-of-memory error into a diagnosis with numbers.
For CUDA the four figures of PyTorch's caching allocator:

- *total* and *free*: the device's memory (``cudaMemGetInfo``);
- *allocated*: bytes of live tensors;
- *reserved*: allocated plus free blocks PyTorch keeps cached.

and three readings of them: **fragmentation** when the cache holds at least the failed
request and at least 1 % of the device but no contiguous piece of it was big enough
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` is the cure); **memory outside
PyTorch** when ``total - reserved - free`` (other processes, cupy, cuBLAS workspaces,
the CUDA context) is over 1 GB and over 5 % of the device; otherwise the work is **too
big** for what is left. For ``MemoryError`` the RAM figures of
:func:`tierflow.system.limits.read_memory`.

:func:`recover` is the one recovery sequence after an out-of-memory error: read the GPU
figures, drop the failed attempt's frames, collect garbage, empty the GPU caches, then
retry smaller or give up with the diagnosis. :func:`fit_batch` (``memory.fit_batch``),
which calls a function with a batch size and halves it, and the engine's block halving
(:mod:`tierflow.engine.program.halving`) both follow it.
"""

from __future__ import annotations

import functools
import gc
import logging
import re
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..config import GB, format_bytes
from ..errors import OutOfMemoryError

__all__ = [
    "CudaFigures",
    "cuda_figures",
    "empty_gpu_caches",
    "explain_cuda_oom",
    "explain_oom",
    "explain_ram_oom",
    "fit_batch",
    "is_cuda_oom",
    "is_oom",
    "parse_cuda_oom",
    "recover",
]

log = logging.getLogger("tierflow.storage")

T = TypeVar("T")

# RuntimeError texts of GPU out-of-memory errors that do not have their own class:
# torch < 1.13 raised RuntimeError("CUDA out of memory. ..."); a failed cudaMalloc
# outside the caching allocator (cuBLAS/cuDNN handles) reads "CUDA error: out of memory".
_CUDA_OOM_TEXTS = ("CUDA out of memory", "CUDA error: out of memory")
_OOM_MODULES = ("torch", "cupy", "cupy_backends")

# Thresholds of the diagnosis; see the module docstring.
_FRAGMENTED_SHARE = 0.01
_OUTSIDE_MIN = 1 * GB
_OUTSIDE_SHARE = 0.05


def is_cuda_oom(exc: BaseException) -> bool:
    """True for a GPU out-of-memory error of torch or cupy (never imports either)."""
    for cls in type(exc).__mro__:
        if cls.__name__ == "OutOfMemoryError" and cls.__module__.split(".")[0] in _OOM_MODULES:
            return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(marker in text for marker in _CUDA_OOM_TEXTS)
    return False


def is_oom(exc: BaseException) -> bool:
    """True if ``exc`` says memory ran out: ``MemoryError`` (RAM, cupy, tierflow's own
    :class:`~tierflow.errors.OutOfMemoryError`) or a torch/cupy GPU out-of-memory."""
    return isinstance(exc, MemoryError) or is_cuda_oom(exc)


def empty_gpu_caches() -> None:
    """Give the GPU memory cached by torch and cupy back to the driver.

    Touches only libraries already imported (and, for torch, CUDA already initialised):
    it never imports them nor creates a CUDA context. Errors of the libraries are
    logged and ignored — emptying a cache is a best effort before a retry.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except Exception as e:  # a broken CUDA state must not hide the original OOM
            log.debug("torch.cuda.empty_cache() failed: %s", e)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        except Exception as e:
            log.debug("freeing cupy's memory pools failed: %s", e)


@dataclass(frozen=True)
class CudaFigures:
    """The GPU memory figures at an out-of-memory error, in bytes (None when unknown).

    ``requested``: the allocation that failed; ``total``/``free``: the device;
    ``allocated``: live tensors; ``reserved``: allocated plus PyTorch's cached free
    blocks (for cupy: its memory pool); ``processes``: ``(pid, bytes)`` of processes
    PyTorch listed as using the device; ``source``: where the numbers came from
    (``"message"``, ``"torch"``, ``"cupy"`` or a combination such as
    ``"message+torch"``).
    """

    device: int | None = None
    requested: int | None = None
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    processes: tuple[tuple[int, int], ...] = ()
    source: str = "message"

    @property
    def unallocated(self) -> int | None:
        """Reserved but not allocated: cached blocks PyTorch could not use."""
        if self.reserved is None or self.allocated is None:
            return None
        return max(0, self.reserved - self.allocated)

    @property
    def outside(self) -> int | None:
        """Device memory neither free nor reserved by PyTorch (other processes, cupy,
        cuBLAS workspaces, the CUDA context)."""
        if self.total is None or self.free is None or self.reserved is None:
            return None
        return max(0, self.total - self.reserved - self.free)

    def merged(self, other: CudaFigures) -> CudaFigures:
        """These figures, with gaps filled from ``other``."""
        filled = {
            name: getattr(self, name) if getattr(self, name) is not None else getattr(other, name)
            for name in ("device", "requested", "total", "free", "allocated", "reserved")
        }
        return CudaFigures(
            **filled,
            processes=self.processes or other.processes,
            source=f"{self.source}+{other.source}",
        )


_SIZE = r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)"
_UNIT = {
    "bytes": 1, "B": 1,
    "KiB": 1 << 10, "KB": 1 << 10,
    "MiB": 1 << 20, "MB": 1 << 20,
    "GiB": 1 << 30, "GB": 1 << 30,
    "TiB": 1 << 40, "TB": 1 << 40,
}  # fmt: skip
_PATTERNS = {
    "requested": [rf"Tried to allocate {_SIZE}", rf"Out of memory allocating {_SIZE}"],
    "device": [r"\(GPU (\d+);", r"\bGPU (\d+) has a total capacity"],
    "total": [rf"{_SIZE} total capacity", rf"total capacity of {_SIZE}"],
    "free": [rf"{_SIZE} free\b", rf"of which {_SIZE} is free"],
    "allocated": [
        rf"{_SIZE} already allocated",
        rf"Of the allocated memory {_SIZE} is allocated by PyTorch",
        rf"allocated so far: {_SIZE}",
    ],
    "reserved": [rf"{_SIZE} reserved in total by PyTorch"],
    "unallocated": [rf"{_SIZE} is reserved by PyTorch but unallocated"],
}
_PROCESS = re.compile(rf"Process (\d+) has {_SIZE} memory in use")


def _size(number: str, unit: str) -> int:
    return int(float(number.replace(",", "")) * _UNIT[unit])


def parse_cuda_oom(message: str) -> CudaFigures | None:
    """Read the figures out of a torch or cupy out-of-memory message; None if it has none.

    Understands torch's older format ("Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB
    total capacity; 12.34 GiB already allocated; 1.23 GiB free; 13.45 GiB reserved in
    total by PyTorch)"), its newer one ("Tried to allocate 20.00 MiB. GPU 0 has a total
    capacity of 79.15 GiB of which 1.2 GiB is free. ... Of the allocated memory 75.33 GiB
    is allocated by PyTorch, and 1.61 GiB is reserved by PyTorch but unallocated.") and
    cupy's ("Out of memory allocating 1,024 bytes (allocated so far: 4,096 bytes).").

    >>> parse_cuda_oom("Tried to allocate 1.00 GiB (GPU 0; 8.00 GiB total capacity; "
    ...     "6.00 GiB already allocated; 0 bytes free; 7.50 GiB reserved in total by PyTorch)").free
    0
    """
    found: dict[str, int] = {}
    for name, patterns in _PATTERNS.items():
        for pattern in patterns:
            match = re.search(pattern, message)
            if match:
                groups = match.groups()
                found[name] = int(groups[0]) if name == "device" else _size(*groups)
                break
    processes = tuple((int(pid), _size(n, u)) for pid, n, u in _PROCESS.findall(message))
    if not found and not processes:
        return None
    unallocated = found.pop("unallocated", None)
    if unallocated is not None and "allocated" in found and "reserved" not in found:
        found["reserved"] = found["allocated"] + unallocated
    return CudaFigures(**found, processes=processes, source="message")


def _torch_figures(device: int | None) -> CudaFigures | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        index = torch.cuda.current_device() if device is None else device
        free, total = torch.cuda.mem_get_info(index)
        return CudaFigures(
            device=index,
            total=int(total),
            free=int(free),
            allocated=int(torch.cuda.memory_allocated(index)),
            reserved=int(torch.cuda.memory_reserved(index)),
            source="torch",
        )
    except Exception as e:  # reading figures must never replace the error being explained
        log.debug("reading torch's CUDA memory figures failed: %s", e)
        return None


def _cupy_figures() -> CudaFigures | None:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    try:
        pool = cupy.get_default_memory_pool()
        free, total = cupy.cuda.runtime.memGetInfo()
        return CudaFigures(
            device=int(cupy.cuda.runtime.getDevice()),
            total=int(total),
            free=int(free),
            allocated=int(pool.used_bytes()),
            reserved=int(pool.total_bytes()),
            source="cupy",
        )
    except Exception as e:
        log.debug("reading cupy's memory figures failed: %s", e)
        return None


def cuda_figures(exc: BaseException) -> CudaFigures | None:
    """The GPU memory figures for the out-of-memory error ``exc``, or None.

    The figures in the message come first: they were taken at the failed allocation,
    while live readings come after the stack unwound and tensors were freed. Gaps are
    filled from a live reading of the library that raised (torch when it is imported
    and CUDA initialised, cupy's pool for a cupy error). Call it before
    :func:`empty_gpu_caches`, which changes the reserved figure.
    """
    parsed = parse_cuda_oom(str(exc))
    module = type(exc).__module__.split(".")[0]
    live = _cupy_figures() if module.startswith("cupy") else None
    if live is None:
        live = _torch_figures(parsed.device if parsed else None)
    if parsed is None:
        return live
    return parsed.merged(live) if live is not None else parsed


def _fmt(n: int | None) -> str:
    return "unknown" if n is None else format_bytes(n, 2)


def explain_cuda_oom(exc: BaseException, figures: CudaFigures | None = None) -> str:
    """Explain a GPU out-of-memory error: the figures, what they point to, what to do.

    ``figures`` default to :func:`cuda_figures` of ``exc`` (pass the ones read before
    the caches were emptied when you have them). Returns a few sentences for the
    message of a :class:`~tierflow.errors.OutOfMemoryError`.
    """
    f = figures if figures is not None else cuda_figures(exc)
    if f is None:
        return (
            "No GPU memory figures were available (CUDA not initialised in this process "
            "and none in the message). Try a smaller min_batch, a smaller model or lower "
            "precision (float16/bfloat16), or another device (memory.best_device(gb))."
        )
    gpu = "GPU" if f.device is None else f"GPU {f.device}"
    lines = [
        f"{gpu}: {_fmt(f.total)} total, {_fmt(f.free)} free, {_fmt(f.allocated)} "
        f"allocated by live tensors, {_fmt(f.reserved)} reserved by the allocator "
        f"(figures from {f.source})."
    ]
    if f.requested is not None:
        lines.append(f"The failed request was {_fmt(f.requested)}.")
    if f.processes:
        listed = ", ".join(f"pid {pid}: {_fmt(n)}" for pid, n in f.processes)
        lines.append(f"Processes using the device: {listed}.")
    found = False
    if f.requested is not None and f.total is not None and f.requested > f.total:
        found = True
        lines.append(
            f"Too big for the device: one request of {_fmt(f.requested)} exceeds its "
            f"{_fmt(f.total)}; use a smaller min_batch, a smaller model or lower precision "
            "(float16/bfloat16), or a device with more memory (memory.best_device(gb))."
        )
    unallocated = f.unallocated
    if (
        not found
        and unallocated is not None
        and unallocated >= (f.requested or 0)
        and f.total is not None
        and unallocated >= _FRAGMENTED_SHARE * f.total
    ):
        found = True
        lines.append(
            f"Looks like fragmentation: {_fmt(unallocated)} is reserved but unallocated, "
            "yet no contiguous piece of it was big enough. Set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before CUDA is initialised) "
            "or max_split_size_mb:128, and retry."
        )
    outside = f.outside
    if (
        outside is not None
        and f.total is not None
        and outside > max(_OUTSIDE_MIN, _OUTSIDE_SHARE * f.total)
    ):
        found = True
        lines.append(
            f"{_fmt(outside)} of the device is used outside this allocator (reserved + "
            "free is well below total): another process (see nvidia-smi), cupy's memory "
            "pool, cuBLAS/cuDNN workspaces or the CUDA context. Free it, or run on "
            "another GPU (memory.best_device(gb))."
        )
    if not found:
        lines.append(
            "The work simply does not fit in what is left: use a smaller min_batch, a "
            "smaller model or lower precision (float16/bfloat16), free tensors held "
            "elsewhere, or another device (memory.best_device(gb))."
        )
    return " ".join(lines)


def explain_ram_oom(exc: BaseException) -> str:
    """Explain a RAM ``MemoryError`` with the figures of
    :func:`tierflow.system.limits.read_memory` (usable, free, and what limits them)."""
    from ..system import limits

    try:
        m = limits.read_memory()
        where = m.source if m.limited_by is None else f"{m.source} {m.limited_by}"
        figures = f"RAM: {_fmt(m.usable)} usable (limited by {where}), {_fmt(m.free)} free now."
    except Exception as e:  # never hide the original error behind a reading failure
        figures = f"RAM figures unavailable ({type(e).__name__}: {e})."
    return (
        f"{figures} Use a smaller min_batch, free large arrays held elsewhere (del them, "
        "then gc.collect()), keep big arrays on the SSD (memory.array), or raise the "
        "memory limit."
    )


def explain_oom(exc: BaseException, figures: CudaFigures | None = None) -> str:
    """Explain an out-of-memory error: :func:`explain_cuda_oom` for a GPU error,
    :func:`explain_ram_oom` otherwise."""
    return explain_cuda_oom(exc, figures) if is_cuda_oom(exc) else explain_ram_oom(exc)


def recover(
    exc: Exception, *, last: bool, give_up: Callable[[CudaFigures | None], OutOfMemoryError]
) -> bool:
    """The out-of-memory recovery sequence, called in the ``except`` clause of an attempt.

    Returns False when ``exc`` is not an out-of-memory error (:func:`is_oom`), or is
    tierflow's own :class:`~tierflow.errors.OutOfMemoryError` (the verdict of a nested
    attempt that already tried down to its smallest size): the caller re-raises it.
    Otherwise, in this order:

    1. the GPU figures are read (:func:`cuda_figures`), before emptying the caches
       changes them;
    2. the traceback's frames are cleared: they hold the failed attempt's arrays and
       tensors;
    3. garbage is collected and the GPU caches are emptied (:func:`empty_gpu_caches`),
       so a retry can reuse that memory;
    4. when the attempt was the ``last`` (its size was the smallest allowed), raises
       ``give_up(figures)`` chained to ``exc``; else returns True: retry smaller.
    """
    if not is_oom(exc) or isinstance(exc, OutOfMemoryError):
        return False
    figures = cuda_figures(exc) if is_cuda_oom(exc) else None
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    empty_gpu_caches()
    if last:
        raise give_up(figures) from exc
    return True


def _key(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Which definition ``fn`` comes from: what ``fit_batch`` remembers sizes by."""
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "__func__", target)  # a bound method: its function
    code = getattr(target, "__code__", None)
    if code is not None:
        qualname = getattr(target, "__qualname__", code.co_name)
        return ("code", code.co_filename, str(code.co_firstlineno), qualname)
    cls = type(target)
    return ("class", cls.__module__, cls.__qualname__)


class _FitBatch:
    """Call ``fn(batch_size)``, halving the batch on out-of-memory errors.

    ``memory.fit_batch(fn, batch, min_batch=1, *, remember=True) -> (result, batch_size)``

    ``fn(n)`` is called with ``n = batch`` first. When it raises an out-of-memory error
    (``MemoryError``, ``torch.cuda.OutOfMemoryError``, a ``RuntimeError`` with "CUDA out
    of memory", cupy's ``OutOfMemoryError``), the failed attempt's memory is reclaimed
    and the GPU caches are emptied (``torch.cuda.empty_cache()`` when torch is imported
    and CUDA initialised, cupy's default pools; see :func:`recover`) and ``fn`` is
    called again with half the size; the last try is ``min_batch`` itself. Any other
    error, and tierflow's own ``OutOfMemoryError`` from a nested ``fit_batch`` or
    compute that already gave up, is raised as is, without a retry. Returns ``fn``'s
    result and the size that worked.

    When ``min_batch`` fails too it raises :class:`~tierflow.errors.OutOfMemoryError`
    (a ``MemoryError``), chained to the last error, whose message lists the sizes
    tried and explains the cause: for the GPU the total, free, allocated and reserved
    figures and whether it looks like fragmentation, memory used outside PyTorch, or a
    job too big for the device; for RAM the usable and free memory.

    With ``remember=True`` the size that worked after an out-of-memory error is kept
    (keyed by the definition of ``fn``: file, line and qualified name of its code, or
    the class of a callable object, so a lambda re-created by the same line on every
    call shares it) and the next call starts at ``min(batch, remembered)``. It is never
    raised again by itself: ``fit_batch.forget(fn)`` forgets one function,
    ``fit_batch.forget()`` all, and ``remember=False`` neither reads nor stores.

    Raises ``ValueError`` for ``batch < min_batch`` or sizes below 1, ``TypeError`` for
    sizes that are not integers.

    >>> import torch                                            # doctest: +SKIP
    >>> out, n = memory.fit_batch(lambda n: model(x[:n].cuda()), 4096)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: dict[tuple[str, ...], int] = {}

    def __call__(
        self,
        fn: Callable[[int], T],
        batch: int,
        min_batch: int = 1,
        *,
        remember: bool = True,
    ) -> tuple[T, int]:
        batch = _positive_int(batch, "batch")
        min_batch = _positive_int(min_batch, "min_batch")
        if min_batch > batch:
            raise ValueError(f"min_batch={min_batch} is larger than batch={batch}")
        key = _key(fn)
        size = batch
        if remember:
            with self._lock:
                known = self._sizes.get(key)
            if known is not None:
                size = max(min_batch, min(batch, known))
        tried: list[int] = []
        while True:
            tried.append(size)
            try:
                result = fn(size)
            except Exception as exc:
                last = size <= min_batch
                give_up = functools.partial(self._give_up, fn, tried, min_batch, exc)
                if not recover(exc, last=last, give_up=give_up):
                    raise
                smaller = max(min_batch, size // 2)
                log.info(
                    "%s ran out of memory at batch size %d; retrying with %d",
                    getattr(fn, "__name__", fn),
                    size,
                    smaller,
                )
                size = smaller
                continue
            if remember and len(tried) > 1:
                with self._lock:
                    self._sizes[key] = size
            return result, size

    @staticmethod
    def _give_up(
        fn: Callable[..., Any],
        tried: list[int],
        min_batch: int,
        failure: BaseException,
        figures: CudaFigures | None,
    ) -> OutOfMemoryError:
        name = getattr(fn, "__name__", type(fn).__name__)
        what = "GPU memory" if is_cuda_oom(failure) else "memory"
        sizes = ", ".join(str(n) for n in tried)
        text = str(failure).split("\n")[0].strip()
        if len(text) > 200:
            text = text[:200] + "..."
        last = type(failure).__name__ + (f": {text.rstrip('.')}" if text else "")
        return OutOfMemoryError(
            f"fit_batch: {name} ran out of {what} at every batch size tried ({sizes}; "
            f"min_batch={min_batch}); last error {last}. " + explain_oom(failure, figures)
        )

    def forget(self, fn: Callable[..., Any] | None = None) -> None:
        """Forget the size remembered for ``fn`` (for every function when None)."""
        with self._lock:
            if fn is None:
                self._sizes.clear()
            else:
                self._sizes.pop(_key(fn), None)

    def remembered(self, fn: Callable[..., Any]) -> int | None:
        """The batch size remembered for ``fn``, or None."""
        with self._lock:
            return self._sizes.get(_key(fn))


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    number = int(value.__index__())
    if number < 1:
        raise ValueError(f"{name} must be at least 1, got {number}")
    return number


fit_batch = _FitBatch()
