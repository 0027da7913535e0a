"""Moving blocks between the host and a GPU: pinned staging, two streams, readahead.

Every host <-> device copy of the engine's block programs goes through one
:class:`Lane` per device (:func:`lane`), which counts them (:func:`stats`; a
``map_blocks`` on a GPU outside a GPU pass copies its blocks itself, and counts them with
:func:`count`):

* Host to device. A block is copied into a pinned (page-locked) staging buffer from a
  small pool (:data:`STAGING_BUFFERS` per device), then to the device on the lane's *copy
  stream*, and an event is recorded after the copy. The task that uses the block makes
  its *compute stream* wait for that event: the GPU, not the host, orders the two. A
  staging buffer is reused only after the copy out of it has completed.
* Readahead (double buffering). A task on block ``i`` asks for its own input and then
  for block ``i + 1``'s (:meth:`Lane.stage`) before it waits: the copy of block
  ``i + 1`` runs on the copy stream while block ``i`` computes on the compute stream::

      copy stream     | copy 0 | copy 1 |        | copy 2 |        |
      compute stream  |        |   compute 0     |   compute 1     | ...

  Copies are issued in order by one copier thread per device (filling a pinned buffer
  is host work; the task's thread launches its kernels meanwhile). At most
  :data:`STAGING_BUFFERS` staged blocks wait to be used; a staged block nobody asks for
  (a guess of the next rows that missed) is dropped.
* Device to host. Only results come back: a sink's rows (copied straight into the
  sink's block) or a reduction's partials (:meth:`Lane.to_host`).

A simulated GPU (:class:`~tierflow.system.devices.FakeGpus`) runs the same code with
torch CPU tensors standing for device memory, accounted under its ``"cuda:N"``; there
the copy is synchronous and there are no streams, and :func:`record_order` records the
order in which copies are issued and computes start, for tests.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import missing_dependency
from ...operators import byteorder
from ...system import devices

__all__ = [
    "STAGING_BUFFERS",
    "CopyStats",
    "Lane",
    "count",
    "lane",
    "record_order",
    "reset_stats",
    "stats",
    "torch_device",
]

STAGING_BUFFERS = 2  # pinned staging buffers, and staged blocks waiting, per device
FILL_THREADS = 4  # threads filling one big staging buffer (one memcpy thread tops ~10 GB/s)
FILL_PIECE_BYTES = 16 << 20  # a block above this is filled in pieces of at least this size


@dataclass
class CopyStats:
    """Copies of one device since the last :func:`reset_stats`: host to device
    (``h2d``) and device to host (``d2h``), counts and bytes, and, while
    :func:`record_order` is on, ``order``: ``("copy", i)`` when the copy of block
    ``i`` is issued, ``("compute", i)`` when block ``i``'s compute starts."""

    h2d: int = 0
    h2d_bytes: int = 0
    d2h: int = 0
    d2h_bytes: int = 0
    order: list[tuple[str, int]] = field(default_factory=list)


_stats_lock = threading.Lock()
_stats: dict[str, CopyStats] = {}
_recording = False


def stats(device: str) -> CopyStats:
    """The copy counts of ``device`` (``"cuda:N"``), a snapshot."""
    with _stats_lock:
        found = _stats.get(device, CopyStats())
        return CopyStats(found.h2d, found.h2d_bytes, found.d2h, found.d2h_bytes, list(found.order))


def reset_stats() -> None:
    """Zero every device's copy counts and recorded order."""
    with _stats_lock:
        _stats.clear()


def record_order(on: bool = True) -> None:
    """Record the order of copies and computes (:attr:`CopyStats.order`) from now on."""
    global _recording
    _recording = on


def count(device: str, **add: int) -> None:
    """Add to ``device``'s copy counts (:class:`CopyStats` fields by name): every copy
    between the host and a GPU is counted, here or by the caller that makes it."""
    with _stats_lock:
        s = _stats.setdefault(device, CopyStats())
        for name, n in add.items():
            setattr(s, name, getattr(s, name) + n)


def _record(device: str, what: str, index: int) -> None:
    if _recording:
        with _stats_lock:
            _stats.setdefault(device, CopyStats()).order.append((what, index))


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise missing_dependency("torch", "torch", "running operators on a GPU") from None
    return torch


def torch_device(device: str) -> Any:
    """The torch device that holds the tensors of ``device`` (``"cuda:N"``): the GPU
    itself, or the CPU where a simulated GPU (backend ``"fake"``) stands for it."""
    torch = _torch()
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    for d in devices.gpus():
        if d.index == index and d.backend == "fake":
            return torch.device("cpu")
    return torch.device(f"cuda:{index}")


_fill_pool: ThreadPoolExecutor | None = None
_fill_lock = threading.Lock()


def _fill(host: np.ndarray, block: np.ndarray) -> None:
    """``host[...] = block`` (``host`` in native byte order, ``block`` in either); a big
    block in row pieces on :data:`FILL_THREADS` threads (NumPy's copy releases the GIL),
    so filling a pinned buffer keeps up with the bus."""
    global _fill_pool
    rows = block.shape[0] if block.ndim else 0
    pieces = min(FILL_THREADS, rows, block.nbytes // FILL_PIECE_BYTES)
    if pieces < 2:
        np.copyto(host, block, casting="equiv")
        return
    with _fill_lock:
        if _fill_pool is None:
            _fill_pool = ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="tierflow-fill")
        pool = _fill_pool
    cuts = np.linspace(0, rows, pieces + 1).astype(int)
    done = [
        pool.submit(np.copyto, host[a:b], block[a:b], casting="equiv")
        for a, b in itertools.pairwise(cuts.tolist())
    ]
    for future in done:
        future.result()


class _Staging:
    """The pinned staging buffers of one device: at most ``count``, each reused once
    the copy out of it has completed (its event). Copier thread only."""

    def __init__(self, torch: Any, pinned: bool, count: int) -> None:
        self._torch = torch
        self._pinned = pinned
        self._free: list[Any] = []
        self._busy: collections.deque[tuple[Any, Any]] = collections.deque()
        self._count = count

    def take(self, nbytes: int) -> Any:
        """A uint8 host tensor of at least ``nbytes`` bytes (waits for one in use)."""
        while True:
            self._reap(wait=False)
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
            if len(self._free) + len(self._busy) < self._count:
                break
            if self._free:
                self._free.pop(0)  # too small: replaced by a bigger one
                break
            self._reap(wait=True)
        size = 1 << max(12, (nbytes - 1).bit_length())
        return self._torch.empty(size, dtype=self._torch.uint8, pin_memory=self._pinned)

    def give(self, buf: Any, event: Any) -> None:
        """``buf`` is free again once ``event`` (None: at once) has completed."""
        if event is None:
            self._free.append(buf)
        else:
            self._busy.append((buf, event))

    def _reap(self, wait: bool) -> None:
        while self._busy:
            buf, event = self._busy[0]
            if wait:
                event.synchronize()
                wait = False
            elif not event.query():
                return
            self._busy.popleft()
            self._free.append(buf)


@dataclass
class _Staged:
    """A block copied (or being copied) to the device: which rows of which reader."""

    reader: Any
    a: int
    b: int
    future: Future[tuple[Any, Any]]


class Lane:
    """Copies and compute of one device (see the module docstring). Thread-safe."""

    def __init__(self, device: str) -> None:
        torch = _torch()
        self.device = device
        self.torch_device = torch_device(device)
        self.fake = self.torch_device.type == "cpu"
        self._torch = torch
        if self.fake:
            self.copy_stream: Any = None
            self.compute_stream: Any = None
        else:
            self.copy_stream = torch.cuda.Stream(device=self.torch_device)
            self.compute_stream = torch.cuda.Stream(device=self.torch_device)
        self._staging = _Staging(torch, not self.fake, STAGING_BUFFERS)
        self._lock = threading.Lock()
        self._staged: collections.OrderedDict[tuple[int, int, int], _Staged] = (
            collections.OrderedDict()
        )
        # Blocks a task copied itself before the previous block's task staged them (two
        # tasks running at once): staging them after that would copy them for nobody.
        self._taken: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=16)
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._copier = threading.Thread(
            target=self._copy_loop, name=f"tierflow-copy-{device}", daemon=True
        )
        self._copier.start()

    def __repr__(self) -> str:
        where = " (simulated)" if self.fake else ""
        return f"Lane({self.device}{where})"

    # -- host to device ----------------------------------------------------------------

    def _copy_loop(self) -> None:
        while True:
            self._jobs.get()()

    def _issue(
        self, index: int, read: Callable[[], np.ndarray], done: Callable[[], None] | None = None
    ) -> Future[tuple[Any, Any]]:
        """Queue the copy of ``read()`` to the device on the copier thread; the future
        gives ``(tensor, event)``."""
        future: Future[tuple[Any, Any]] = Future()
        _record(self.device, "copy", index)

        def job() -> None:
            try:
                future.set_result(self._copy_in(read()))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                if done is not None:
                    done()

        self._jobs.put(job)
        return future

    def _copy_in(self, block: np.ndarray) -> tuple[Any, Any]:
        """``block`` on the device by way of a staging buffer, and the copy's event (None
        when the copy is complete). Copier thread only."""
        torch = self._torch
        block = np.asarray(block)
        nbytes = block.nbytes
        buf = self._staging.take(max(nbytes, 1))
        # Tensors have only the native byte order: _fill swaps a block in the other.
        host = buf[:nbytes].numpy().view(byteorder.native_dtype(block.dtype)).reshape(block.shape)
        _fill(host, block)
        src = torch.from_numpy(host)
        if self.fake:
            tensor = src.clone()
            self._staging.give(buf, None)
            event = None
        else:
            with torch.cuda.stream(self.copy_stream):
                tensor = torch.empty(src.shape, dtype=src.dtype, device=self.torch_device)
                tensor.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            self._staging.give(buf, event)
        count(self.device, h2d=1, h2d_bytes=nbytes)
        return tensor, event

    def stage(self, index: int, reader: Any, a: int, b: int) -> None:
        """Start copying rows ``a:b`` of ``reader`` (block ``index``) to the device, unless
        they are staged already; the oldest staged block beyond the pool is dropped."""
        key = (id(reader), a, b)
        with self._lock:
            if key in self._staged:
                return
            if key in self._taken:
                self._taken.remove(key)
                return
            while len(self._staged) >= STAGING_BUFFERS:
                self._staged.popitem(last=False)

            def read() -> np.ndarray:
                return reader.read(a, b)

            def release() -> None:
                with contextlib.suppress(Exception):  # a hint: the pages are re-read if needed
                    reader.release(a, b)

            done = release if getattr(reader, "file_backed", False) else None
            self._staged[key] = _Staged(reader, a, b, self._issue(index, read, done))

    def take(self, index: int, reader: Any, a: int, b: int) -> Any:
        """Rows ``a:b`` of ``reader`` on the device: the staged copy (issued now when it
        was not), ready for the compute stream."""
        key = (id(reader), a, b)
        with self._lock:
            found = self._staged.pop(key, None)
            if found is None:
                self._taken.append(key)
        if found is None or found.reader is not reader:
            future = self._issue(index, lambda: reader.read(a, b))
        else:
            future = found.future
        return future

    def ready(self, future: Future[tuple[Any, Any]]) -> Any:
        """The tensor of a copy, once the compute stream may use it."""
        tensor, event = future.result()
        if event is not None:
            self.compute_stream.wait_event(event)
            tensor.record_stream(self.compute_stream)
        return tensor

    def upload(self, index: int, block: np.ndarray) -> Any:
        """A block that is not a reader's rows (computed on the host) on the device."""
        return self.ready(self._issue(index, lambda: block))

    def started(self, index: int) -> None:
        """Block ``index``'s compute starts (recorded, for tests)."""
        _record(self.device, "compute", index)

    # -- device to host ----------------------------------------------------------------

    def to_host(self, value: Any) -> Any:
        """A tensor (or a tuple with tensors, a reduction's partial) on the host as NumPy."""
        torch = self._torch
        if isinstance(value, tuple):
            return tuple(self.to_host(v) for v in value)
        if not isinstance(value, torch.Tensor):
            return value
        array = value.detach().cpu().numpy()
        if self.fake:
            array = array.copy()  # the "device" tensor's memory is not the host's
        count(self.device, d2h=1, d2h_bytes=array.nbytes)
        return array

    def to_host_into(self, value: Any, out: np.ndarray) -> np.ndarray:
        """A tensor copied into ``out`` (a sink's block), cast as NumPy casts unsafe; by
        way of a native C-contiguous copy where ``out`` is not one (torch has neither
        strides across a sink's rows nor another byte order)."""
        torch = self._torch
        direct = out.flags.c_contiguous and out.dtype.isnative
        dest = out if direct else np.empty(out.shape, byteorder.native_dtype(out.dtype))
        host = torch.from_numpy(dest) if dest.size else None
        if host is not None:
            host.copy_(value.detach().reshape(dest.shape))
        count(self.device, d2h=1, d2h_bytes=dest.nbytes)
        if dest is not out:
            np.copyto(out, dest, casting="unsafe")
        return out

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Run the body's kernels on the compute stream (nothing on a simulated GPU)."""
        if self.compute_stream is None:
            yield
            return
        with self._torch.cuda.stream(self.compute_stream):
            yield
            self.compute_stream.synchronize()


_lanes: dict[str, Lane] = {}
_lanes_lock = threading.Lock()


def lane(device: str) -> Lane:
    """The lane of ``device`` (``"cuda:N"``), made on first use, and again when the
    device changed between real and simulated (a test installed a provider)."""
    with _lanes_lock:
        found = _lanes.get(device)
        if found is None or found.fake != (torch_device(device).type == "cpu"):
            found = _lanes[device] = Lane(device)
        return found
