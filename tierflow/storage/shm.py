"""Shared memory without SIGBUS: check the room in /dev/shm before allocating there.

/dev/shm is a tmpfs, i.e. RAM, and often tiny in containers (64 MB by default under
Docker). Sizing a shared-memory object reserves nothing: creating one larger than the
mount succeeds, and the first write past the mount's end kills the process with SIGBUS,
a signal with no traceback. torch's ``share_memory_()`` (and every DataLoader worker
that returns a tensor) allocates there the same way.

So before allocating, :func:`check_room` reads the mount's free space (``statvfs``) and
refuses a request that does not fit with a spare margin (:func:`margin`: room other
users of the mount, such as DataLoader queues and semaphores, still need), raising
:class:`~tierflow.errors.SharedMemoryError` with the bytes needed and free and both
remedies:

- keep the data on disk instead: ``memory.array`` spills to ``TIERFLOW_SPILL_DIR`` on
  a real filesystem, and a spill-backed array (or ``memory.to_tensor`` of one) crosses
  processes by path, putting nothing in /dev/shm;
- or give the container a larger /dev/shm: ``docker run --shm-size=8g``, or in
  Kubernetes an ``emptyDir`` volume with ``medium: Memory`` mounted at /dev/shm.

:func:`shared_array` also reserves its pages (``posix_fallocate``), so a mount that
fills up between the check and the allocation (another process) is an error too, never
a SIGBUS. Pages in /dev/shm are RAM: they count against the container's memory limit
like any other memory.

:data:`SHM_DIR` is the mount checked; tests point it at a small tmpfs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
import weakref
from typing import Any

import numpy as np

from ..config import MB, format_bytes
from ..errors import SharedMemoryError
from ..system import processes
from . import sharing
from .placement import request

__all__ = ["SHM_DIR", "check_room", "margin", "share_tensor", "shared_array", "shm_free"]

SHM_DIR = "/dev/shm"
MARGIN_MIN = 1 * MB  # bytes kept spare on any mount
MARGIN_FRACTION = 1 / 64  # and this share of the mount's size, if larger

PREFIX = "tierflow-shm-"
# tierflow-shm-<pid>-<start time in clock ticks since boot>-<random>.bin
_NAME_RE = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-.+\.bin")
_swept: set[str] = set()  # folders this process has cleared of stale files


def shm_free(directory: str | None = None) -> tuple[int, int]:
    """``(free, size)`` in bytes of the mount holding ``directory`` (default /dev/shm)."""
    st = os.statvfs(directory or SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def margin(size: int) -> int:
    """Bytes kept spare on a mount of ``size`` bytes: max(1 MB, 1/64 of the mount)."""
    return max(MARGIN_MIN, int(size * MARGIN_FRACTION))


def check_room(nbytes: int, *, what: str = "a shared array", directory: str | None = None) -> None:
    """Raise :class:`~tierflow.errors.SharedMemoryError` unless ``nbytes`` fit the mount.

    ``nbytes`` is rounded up to whole pages (tmpfs allocates pages) and must fit the
    mount's free space less :func:`margin`. ``what`` names the request in the message.
    """
    folder = directory or SHM_DIR
    free, size = shm_free(folder)
    need = -(-nbytes // os.sysconf("SC_PAGE_SIZE")) * os.sysconf("SC_PAGE_SIZE")
    if need + margin(size) > free:
        raise _no_room(folder, what, nbytes, free, size)


def _no_room(folder: str, what: str, nbytes: int, free: int, size: int) -> SharedMemoryError:
    spare = margin(size)
    return SharedMemoryError(
        errno.ENOSPC,
        f"not enough shared memory for {what} of {format_bytes(nbytes, 3)} ({nbytes} bytes): "
        f"{folder} has {format_bytes(free, 3)} ({free} bytes) free of {format_bytes(size, 3)}, "
        f"and tierflow keeps {format_bytes(spare)} spare there. Writing past the end of a "
        "shared-memory mount kills the process with SIGBUS, so nothing was allocated. "
        "Either keep the data on disk: memory.array() spills to TIERFLOW_SPILL_DIR on a real "
        "filesystem, and a spill-backed array (or memory.to_tensor() of one) crosses "
        f"processes by path without using {folder}; or make {folder} larger, e.g. "
        "docker run --shm-size=8g (Kubernetes: an emptyDir volume with medium: Memory).",
    )


def shared_array(shape: Any, dtype: Any = "float64", *, directory: str | None = None) -> np.ndarray:
    """A zero-filled array in shared memory (a file in /dev/shm), after checking the room.

    The result is a ``np.memmap`` over a new file in ``directory`` (default
    :data:`SHM_DIR`) whose pages are reserved up front, so it can never SIGBUS. Forked
    children inherit it; it crosses other process boundaries (spawn, ``Queue``,
    ``Pool``) by path, as a spill-backed array does. The file is deleted when the last
    view is garbage-collected or at exit, and files of processes that died are removed
    by the next call in the same folder.

    Raises :class:`~tierflow.errors.SharedMemoryError` when the array does not fit (see
    :func:`check_room`; the message names the bytes and the remedies), and
    ``TypeError``/``ValueError`` for a bad shape or dtype.
    """
    shape_t, dt, nbytes = request(shape, dtype)
    if nbytes == 0:
        return np.zeros(shape_t, dt)
    folder = directory or SHM_DIR
    what = f"a {list(shape_t)} {dt} array"
    check_room(nbytes, what=what, directory=folder)
    _sweep(folder)
    me = os.getpid()
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{processes.token()}-", suffix=".bin", dir=folder)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                free, size = shm_free(folder)
                raise _no_room(folder, what, nbytes, free, size) from exc
            raise SharedMemoryError(
                exc.errno or errno.EIO,
                f"could not reserve {format_bytes(nbytes, 3)} for {what} in {folder}: "
                f"{exc.strerror or exc}",
            ) from exc
        x = np.memmap(path, dtype=dt, mode="r+", shape=shape_t)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    mapping = x._mmap  # type: ignore[attr-defined]
    sharing.remember_mapping(mapping, path)
    weakref.finalize(mapping, _unlink, path, me)
    return x


def share_tensor(t: Any) -> Any:
    """``t.share_memory_()`` after checking that /dev/shm has room for ``t``'s storage.

    torch moves a CPU tensor's storage into /dev/shm (both of its sharing strategies do)
    without reserving the pages, so a tensor larger than the free space there would
    SIGBUS while being copied in. Returns ``t``. Does nothing for a tensor that is
    already shared, a CUDA tensor (shared through CUDA IPC, not /dev/shm), or a
    disk-backed tensor from ``memory.to_tensor`` (it crosses processes by path).

    Raises :class:`~tierflow.errors.SharedMemoryError` when it does not fit.
    """
    if t.device.type != "cpu" or t.is_shared() or sharing._tensor_origin(t) is not None:
        return t
    nbytes = t.untyped_storage().nbytes()
    check_room(nbytes, what=f"a {list(t.shape)} {t.dtype} tensor")
    return t.share_memory_()


# -- files of processes that died --------------------------------------------------------


def _unlink(path: str, owner: int) -> None:
    """Finalizer: delete ``path``, only in the process that made it (not a fork child)."""
    if os.getpid() == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _sweep(folder: str) -> None:
    """Remove the shared arrays of processes that are gone, once per folder per process.

    A file is stale when no process has its pid, or the process with that pid started
    at another time (the pid was reused). A pid that exists but cannot be inspected, and
    names that do not follow the pattern, are left alone.
    """
    key = f"{os.getpid()}:{os.path.realpath(folder)}"
    if key in _swept:
        return
    _swept.add(key)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        match = _NAME_RE.fullmatch(name)
        if match is None:
            continue
        if not processes.may_be_running(int(match.group(1)), int(match.group(2))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
