"""Disk-backed arrays and tensors cross process boundaries by path: nothing is copied.

A spill-backed NumPy array (``memory.array`` on the SSD) or any view of it, and a torch
tensor made from one with :func:`to_tensor`, pickle for multiprocessing as the file's
path, dtype, shape, strides and offset. The receiving process maps the same file: no
bytes go through the pipe, nothing is written to /dev/shm, and the receiver's RSS grows
only as it touches the data. Both mappings are shared file mappings of one file, so a
write through either side is seen by the other.

How: reducers registered with ``multiprocessing.reduction.ForkingPickler``, the pickler
behind ``multiprocessing.Queue``, ``Pipe``, ``Pool``, ``Process(args=...)`` under spawn
and forkserver, and ``concurrent.futures.ProcessPoolExecutor``. They are installed when
tierflow is imported (:func:`install`, idempotent). Everything else pickles as before,
but for byte order: plain arrays and memmaps tierflow did not make by value (an array in
the other byte order keeps it, where NumPy's pickle below protocol 5, multiprocessing's
default, would rebuild it native: :func:`reduce_in_byte_order`), plain torch tensors
through torch's own reducer (``torch.multiprocessing.reductions``, /dev/shm), and
ordinary ``pickle.dumps`` of a spilled array still copies its values. torch is never
imported here: its reducer is wrapped when torch was imported before tierflow, or on
first use of :func:`to_tensor`, and in a process that receives such a tensor.

Under fork, ``Process(args=...)`` pickles nothing: the child inherits the mapping itself.

Lifetime. The receiver maps the file when it unpickles. A mapping outlives the file's
name, so once mapped, the receiver's array stays valid even after the sender frees its
array (``memory.free`` deletes the file; the disk space comes back with the last
mapping). An array freed *before* the receiver mapped it cannot be received: keep the
sender's array alive until the receiver has it (``Queue.put`` pickles in a background
thread, after ``put`` has returned). The receiver refuses a missing file, or one too
short for the array, with :class:`~tierflow.errors.SpillError` naming the path and the
sizes; mapping it anyway would create a zero-filled file or read past its end (SIGBUS).
In a ``Pool`` worker such an error ends the worker (multiprocessing drops a task it
cannot unpickle), so a pool's ``map`` waits; with a ``Queue`` the error is raised by
``get()``.

An array received by path can be sent on by path (back to its owner, or to another
process), as long as the file exists; if it is gone, it is sent by value.
"""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..config import format_bytes
from ..errors import SpillError, missing_dependency
from . import pages
from .spill import spill_file_of

if TYPE_CHECKING:
    import torch

__all__ = [
    "in_byte_order",
    "install",
    "reduce_in_byte_order",
    "remember_mapping",
    "shared_range",
    "to_tensor",
]

_MARK = "_tierflow_reducer"
_ORIGIN = "_tierflow_origin"  # attribute on a torch storage made by to_tensor

# Mappings this process made of files it does not own (arrays received by path, shared
# arrays in /dev/shm), which may be sent on by path: id(mmap) -> (weakref, path).
_foreign: dict[int, tuple[weakref.ref[mmap.mmap], str]] = {}
_install_lock = threading.Lock()


@dataclass(frozen=True)
class _TensorOrigin:
    """What a storage made by :func:`to_tensor` maps, and the array it must outlive."""

    path: str
    writable: bool
    owner: Any  # the NumPy array whose spill file this is; None in a receiver


# -- which arrays cross by path --------------------------------------------------------


def remember_mapping(mapping: mmap.mmap, path: str) -> None:
    """Let arrays over ``mapping`` (a mapping of ``path`` tierflow made, that is not a
    spill file of this process) cross process boundaries by path."""
    key = id(mapping)
    _foreign[key] = (weakref.ref(mapping), path)
    weakref.finalize(mapping, _forget, key)


def _forget(key: int) -> None:
    entry = _foreign.get(key)
    if entry is not None and entry[0]() is None:
        del _foreign[key]


def shared_range(x: np.ndarray) -> pages.FileRange | None:
    """The file range ``x`` crosses processes as, or None when it is pickled by value.

    Not None for a non-empty view of a live spill file of this process, or of a file
    tierflow mapped for sharing (an array received by path, a ``shared_array``);
    None for arrays in RAM, memmaps tierflow did not make, copy-on-write views, empty
    arrays, and arrays whose file has been deleted.
    """
    if x.size == 0:
        return None
    mapping, _ = pages._owner(x)
    if mapping is None:
        return None
    if spill_file_of(x) is None:
        entry = _foreign.get(id(mapping))
        if entry is None or entry[0]() is not mapping:
            return None
    try:
        found = pages.file_range(x)
    except ValueError:
        return None  # the file is gone: the mapping still holds the values
    if found is None or found.copy_on_write:
        return None
    return found


# -- NumPy -----------------------------------------------------------------------------


def _array_reducer(previous: Callable[[Any], Any] | None) -> Callable[[np.ndarray], Any]:
    """A reducer that sends tierflow's disk-backed arrays by path and everything else as
    ``previous`` (another library's reducer) or NumPy's own ``__reduce_ex__`` did."""

    def reduce_array(x: np.ndarray) -> Any:
        found = shared_range(x)
        if found is None:
            if previous is not None:
                return previous(x)
            # What the pickler itself would call: multiprocessing always pickles with
            # the default protocol (ForkingPickler.dumps(obj) with protocol=None).
            if not x.dtype.isnative:
                return reduce_in_byte_order(x, pickle.DEFAULT_PROTOCOL)
            return x.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        writable = found.writable and bool(x.flags.writeable)
        return (_rebuild_array, (found, x.dtype, x.shape, x.strides, writable))

    setattr(reduce_array, _MARK, True)
    return reduce_array


def reduce_in_byte_order(x: np.ndarray, protocol: int) -> str | tuple[Any, ...]:
    """``x``'s reduction for ``protocol`` that keeps its byte order: below protocol 5
    NumPy rebuilds an array in the other byte order as a native one (the same values,
    another dtype), which would change the dtype of what a process receives."""
    if x.dtype.isnative or protocol >= 5:
        return x.__reduce_ex__(protocol)
    return (_rebuild_in_byte_order, (x.__reduce_ex__(protocol), x.dtype))


def _rebuild_in_byte_order(reduced: tuple[Any, ...], dtype: np.dtype[Any]) -> np.ndarray:
    rebuild, args, state = reduced
    array = rebuild(*args)
    array.__setstate__(state)
    return array.astype(dtype, copy=False)


class _InByteOrder:
    """An array in the other byte order that pickles as itself, byte order kept, under
    any pickler and protocol (see :func:`in_byte_order`)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce_ex__(self, protocol: Any) -> str | tuple[Any, ...]:
        return reduce_in_byte_order(self.array, int(protocol))


def in_byte_order(x: np.ndarray) -> Any:
    """``x`` for an object's pickled state: ``x`` itself when it is in native byte order
    (it pickles as usual, by path where it is a spill file); else a stand-in that
    unpickles as a copy of ``x`` in its own byte order, whatever the protocol (a plain
    ``pickle.dumps`` below protocol 5 would give it back native)."""
    return x if x.dtype.isnative else _InByteOrder(x)


def _check_file(path: str, needed: int, what: str) -> None:
    """Refuse a file that is missing or shorter than ``needed`` bytes."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise SpillError(
            errno.ENOENT,
            f"cannot map {what} sent by path: its file {path} no longer exists. The "
            "sending process freed the array (or exited) before this process mapped it; "
            "keep the sender's array alive until the receiver has it",
        ) from None
    if size < needed:
        raise SpillError(
            errno.EINVAL,
            f"cannot map {what} sent by path: its file {path} holds {size} bytes "
            f"({format_bytes(size)}) but the array needs {needed} bytes "
            f"({format_bytes(needed)}); the file was truncated or replaced after the array "
            "was sent. Send the array again from a live owner",
        )


def _rebuild_array(
    where: pages.FileRange,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    writable: bool,
) -> np.ndarray:
    """Map the file range ``where`` and view it as the sent array."""
    path, offset, nbytes = where.path, where.offset, where.nbytes
    _check_file(path, offset + nbytes, f"a {list(shape)} {dtype} array")
    mode: Literal["r+", "r"] = "r+" if writable else "r"
    if where.data_offset == 0 and _c_strides(shape, dtype.itemsize, strides):
        x: np.ndarray = np.memmap(path, dtype=dtype, mode=mode, offset=offset, shape=shape)
    else:
        raw = np.memmap(path, dtype=np.uint8, mode=mode, offset=offset, shape=(nbytes,))
        x = np.ndarray(shape, dtype, buffer=raw, offset=where.data_offset, strides=strides)
    mapping, _ = pages._owner(x)
    assert mapping is not None
    remember_mapping(mapping, path)
    return x


def _c_strides(shape: tuple[int, ...], itemsize: int, strides: tuple[int, ...]) -> bool:
    expected = itemsize
    for n, stride in zip(reversed(shape), reversed(strides), strict=True):
        if n > 1 and stride != expected:
            return False
        expected *= n
    return True


# -- torch -----------------------------------------------------------------------------


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise missing_dependency("torch", "torch", "a disk-backed torch tensor") from exc
    return torch


def to_tensor(x: np.ndarray) -> torch.Tensor:
    """A torch tensor over the same memory as ``x``, without a copy.

    For a spill-backed array (``memory.array`` on the SSD) or a view of one, the tensor
    maps the spill file itself (``torch.UntypedStorage.from_file(path, shared=True)``,
    so ``storage.filename`` is the path) with ``x``'s dtype, shape, strides and offset;
    writes through either are seen by both, and it crosses process boundaries by path
    like the array does. The storage keeps ``x`` alive, so the file is not deleted
    while the tensor lives (``memory.free(x)`` still deletes it; the tensor then keeps
    its own mapping and the data). A read-only ``x`` gives a private mapping: writes to
    the tensor stay in this process.

    For any other array (RAM, a memmap tierflow did not make) this is
    ``torch.from_numpy(x)``: the same memory, crossing processes the torch way.

    Raises ``TypeError`` for a dtype torch does not have, ``ValueError`` for negative
    strides or an offset or stride that is not a whole number of elements (views torch
    cannot express: copy with ``np.ascontiguousarray(x)`` first), and
    :class:`~tierflow.errors.DependencyError` without torch.
    """
    torch = _torch()
    _install_torch(torch)
    found = shared_range(x)
    if found is None:
        return torch.from_numpy(x)
    try:
        dtype = torch.from_numpy(np.empty(0, dtype=x.dtype)).dtype
    except TypeError as exc:
        raise TypeError(f"to_tensor(): torch has no dtype for {x.dtype}") from exc
    itemsize = x.dtype.itemsize
    first = found.offset + found.data_offset  # file offset of x's first element
    if any(s < 0 for s in x.strides):
        raise ValueError(
            f"to_tensor(): x has negative strides {x.strides}, which torch tensors cannot "
            "have; pass np.ascontiguousarray(x) (a copy) instead"
        )
    if first % itemsize or any(s % itemsize for s in x.strides):
        raise ValueError(
            f"to_tensor(): x starts at byte {first} of its file with strides {x.strides}, "
            f"not whole {itemsize}-byte elements, which a torch tensor cannot view; "
            "pass np.ascontiguousarray(x) (a copy) instead"
        )
    end = found.offset + found.nbytes
    _check_file(found.path, end, f"a {list(x.shape)} {x.dtype} array")
    storage = torch.UntypedStorage.from_file(found.path, shared=found.writable, nbytes=end)
    # torch keeps a storage's Python object alive as long as any tensor uses the
    # storage, so this reference holds x (and its spill file) exactly that long.
    setattr(storage, _ORIGIN, _TensorOrigin(found.path, found.writable, x))
    tensor = torch.empty((0,), dtype=dtype)
    tensor.set_(storage, first // itemsize, x.shape, tuple(s // itemsize for s in x.strides))
    return tensor


def _tensor_origin(t: Any) -> _TensorOrigin | None:
    """The origin of a CPU tensor whose storage :func:`to_tensor` (or a receiver) made."""
    try:
        if t.device.type != "cpu" or t.is_sparse or t.numel() == 0:
            return None
        origin = getattr(t.untyped_storage(), _ORIGIN, None)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None  # tensors without a plain storage (meta, nested, functional)
    if not isinstance(origin, _TensorOrigin) or not os.path.exists(origin.path):
        return None
    return origin


def _tensor_reducer(previous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def reduce_tensor(t: Any) -> Any:
        origin = _tensor_origin(t)
        if origin is None or (t.requires_grad and not t.is_leaf):
            return previous(t)  # torch's own path, and its error for non-leaf tensors
        extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        nbytes = (t.storage_offset() + extent + 1) * t.element_size()
        layout = _TensorLayout(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=tuple(t.shape),
            stride=tuple(t.stride()),
            offset=t.storage_offset(),
            requires_grad=bool(t.requires_grad),
        )
        return (_rebuild_tensor, (origin.path, origin.writable, nbytes, layout))

    setattr(reduce_tensor, _MARK, True)
    return reduce_tensor


@dataclass(frozen=True, kw_only=True)
class _TensorLayout:
    """How a sent tensor lies in its storage (elements, not bytes), and its autograd flag."""

    dtype: str  # torch's name without "torch."
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool


def _rebuild_tensor(path: str, writable: bool, nbytes: int, layout: _TensorLayout) -> Any:
    """Map ``nbytes`` of ``path`` as a storage and view it as the sent tensor."""
    torch = _torch()
    _install_torch(torch)
    _check_file(path, nbytes, f"a {list(layout.shape)} torch.{layout.dtype} tensor")
    storage = torch.UntypedStorage.from_file(path, shared=writable, nbytes=nbytes)
    setattr(storage, _ORIGIN, _TensorOrigin(path, writable, None))
    tensor = torch.empty((0,), dtype=getattr(torch, layout.dtype))
    tensor.set_(storage, layout.offset, layout.shape, layout.stride)
    if layout.requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _install_torch(torch: Any) -> None:
    """Wrap the reducer registered for ``torch.Tensor`` (torch's own) once."""
    current = ForkingPickler._extra_reducers.get(torch.Tensor)  # type: ignore[attr-defined]
    if getattr(current, _MARK, False):
        return
    with _install_lock:
        current = ForkingPickler._extra_reducers.get(torch.Tensor)  # type: ignore[attr-defined]
        if getattr(current, _MARK, False):
            return
        if current is None:
            from torch.multiprocessing import reductions

            current = reductions.reduce_tensor
        ForkingPickler.register(torch.Tensor, _tensor_reducer(current))


# -- installing ------------------------------------------------------------------------


def install() -> None:
    """Register tierflow's reducers with ``ForkingPickler``; calling it again does nothing.

    Runs when tierflow is imported. Wraps whatever was registered for ``np.ndarray``,
    ``np.memmap`` and (if torch is imported) ``torch.Tensor`` so that those keep their
    behaviour for everything tierflow does not send by path.
    """
    with _install_lock:
        for cls in (np.ndarray, np.memmap):
            current = ForkingPickler._extra_reducers.get(cls)  # type: ignore[attr-defined]
            if not getattr(current, _MARK, False):
                ForkingPickler.register(cls, _array_reducer(current))
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "Tensor"):
        _install_torch(torch)


install()
