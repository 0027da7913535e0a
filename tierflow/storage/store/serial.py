"""How a value becomes the bytes of one store file, and how those bytes are trusted.

Every entry is one file: a body, then a signed trailer::

    [ body ][ meta (JSON) ][ HMAC-SHA256 of meta: 32 bytes ][ len(meta): 4 bytes ][ b"TFSTORE\\x01" ]

Bodies by kind:

- ``npy``: a NumPy array (no Python objects inside) as a complete ``.npy`` file;
  ``np.load`` reads it as is. It comes back memory-mapped read-only from the data
  offset the signed meta gives: nothing is read until touched. The mapping holds a read
  lease (:mod:`tierflow.storage.leases`), so the file cannot shrink under it; where
  none can be had, the array is read into memory instead.
- ``torch``: a strided torch tensor, as the ``.npy`` of its CPU data (dtypes NumPy
  lacks, such as bfloat16, are stored as same-size integers and viewed back). It comes
  back as a tensor over a copy-on-write mapping (writes stay private to the process),
  on its original device when that device exists, else on the CPU. torch is imported
  only to read such an entry; no pickle is involved.
- ``pickle``: anything else, pickled (protocol 5).

The meta holds the key, the kind, the tag, the body length and a BLAKE2b digest: of
the whole body for a pickle (checked before unpickling), of the ``.npy`` header for an
array (checked before mapping, so shape, dtype and offsets are the ones written). A
file whose trailer is missing or forged, whose size differs from the signed one, whose
key is not the one asked for, or whose pickle or header does not match its digest is
:class:`EntryDamaged`, and is never unpickled or mapped. Not checked: the data bytes
of an array (hashing them would mean reading them, which memory-mapping avoids); a
changed byte there gives changed numbers, never a crash or code execution.

A trailer alone is enough to rebuild the index (:func:`read_meta`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import math
import os
import pickle
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, NamedTuple

import numpy as np

from ...errors import missing_dependency
from .. import leases
from .signing import Signer

__all__ = [
    "KINDS",
    "EntryDamaged",
    "Loaded",
    "Meta",
    "StoreWarning",
    "Written",
    "read_entry",
    "read_meta",
    "write_entry",
]

KINDS = ("npy", "torch", "pickle")

_MAGIC = b"TFSTORE\x01"
_FOOTER = struct.Struct("<32sI8s")  # mac, meta length, magic
# One read at the end of a file gets the trailer of any ordinary entry.
_TAIL_READ = 4096
_MAX_META = 1 << 20
# Below this a body and its trailer go out in one write() call.
_ONE_WRITE = 1 << 20
# Non-contiguous arrays are written in pieces of about this many bytes.
_PIECE = 16 << 20


class StoreWarning(UserWarning):
    """A store dropped an entry it could not trust or load (changed outside tierflow,
    unreadable index, a pickle whose classes are gone); the message says which and why."""


class EntryDamaged(Exception):
    """A store file failed a check; ``str()`` says which. Internal: stores turn it into a
    miss, remove the file and warn with :class:`StoreWarning`. ``ident`` is the
    :func:`file_ident` of the file that failed, when known."""

    ident: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class Meta:
    """What a file's signed trailer says about it.

    ``body`` is the number of bytes before the trailer; ``digest`` the BLAKE2b hex of
    the pickle (kind ``pickle``) or of the ``.npy`` header (``npy``/``torch``);
    ``header`` the length of that ``.npy`` header, i.e. where the data starts; ``torch``
    the tensor's dtype name, device, ``requires_grad`` and whether the stored dtype is
    a same-size integer stand-in (``view``).
    """

    key: bytes
    kind: str
    tag: str | None
    body: int
    digest: str
    header: int = 0
    torch: dict[str, Any] | None = None

    def to_json(self) -> bytes:
        """The JSON of this meta, formatted by hand: ``json.dumps`` of the whole dict
        costs a tenth of a small set. Every field is a number, hex, a kind name, or
        passes through ``json.dumps``."""
        tag_json = "null" if self.tag is None else json.dumps(self.tag)
        torch_json = "null" if self.torch is None else json.dumps(self.torch, sort_keys=True)
        return (
            f'{{"v":1,"key":"{self.key.hex()}","kind":"{self.kind}","tag":{tag_json},'
            f'"body":{int(self.body)},"digest":"{self.digest}","header":{int(self.header)},'
            f'"torch":{torch_json}}}'
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Meta:
        """Parse signed meta; :class:`EntryDamaged` when it is not what :meth:`to_json` wrote."""
        try:
            fields = json.loads(data)
            meta = cls(
                key=bytes.fromhex(fields["key"]),
                kind=fields["kind"],
                tag=fields["tag"],
                body=fields["body"],
                digest=fields["digest"],
                header=fields["header"],
                torch=fields["torch"],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise EntryDamaged(f"its trailer is signed but unreadable ({exc})") from None
        if fields.get("v") != 1 or meta.kind not in KINDS:
            raise EntryDamaged(f"its trailer has version {fields.get('v')!r}, kind {meta.kind!r}")
        return meta


class Written(NamedTuple):
    """What :func:`write_entry` wrote: the kind and file size (bytes), and how to make
    the copy the RAM tier may keep (``holder()``, ``held_nbytes`` bytes; ``holder`` is
    None for values the RAM tier does not keep)."""

    kind: str
    size: int
    holder: Callable[[], Any] | None
    held_nbytes: int


@dataclass(frozen=True)
class Loaded:
    """A value read back by :func:`read_entry`: ``held`` says whether the RAM tier should
    keep it (unpickled values: yes; memory-mapped arrays and tensors: no, a mapping is
    cheaper to redo than RAM is to hold); ``nbytes`` is what keeping it costs."""

    value: Any
    kind: str
    held: bool
    nbytes: int
    ident: tuple[int, int, int, int]


def file_ident(st: os.stat_result) -> tuple[int, int, int, int]:
    """Device, inode, mtime (ns) and size: changes whenever an entry's file is replaced."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


# -- writing ----------------------------------------------------------------------------


def write_entry(fd: int, value: Any, key: bytes, tag: str | None, signer: Signer) -> Written:
    """Write ``value`` as a complete entry for the encoded ``key`` to the empty file
    open for writing at descriptor ``fd``.

    The caller owns the descriptor (and the file's atomic rename). Raises what pickling
    raises for an unpicklable value (``TypeError``, ``pickle.PicklingError``,
    ``AttributeError``) and ``OSError`` for write errors.
    """
    tensor = _as_plain_tensor(value)
    if tensor is not None:
        return _write_tensor(fd, tensor, key, tag, signer)
    if type(value) in (np.ndarray, np.memmap) and not value.dtype.hasobject:
        return _write_npy(fd, value, key, tag, signer)
    return _write_pickle(fd, value, key, tag, signer)


def _trailer(data: bytes, signer: Signer) -> bytes:
    """The trailer for the meta JSON ``data``: the meta, its signature and the footer."""
    return data + _FOOTER.pack(signer.sign(data), len(data), _MAGIC)


def _write_all(fd: int, data: Any) -> None:
    """Write all of ``data`` (any buffer) to ``fd``; ``OSError`` if the file stops
    taking bytes."""
    view = memoryview(data).cast("B")
    total = view.nbytes
    done = os.write(fd, view)
    while done < total:
        written = os.write(fd, view[done:])
        if written <= 0:
            raise OSError(f"short write: {done} of {total} bytes written")
        done += written


def _write_pickle(fd: int, value: Any, key: bytes, tag: str | None, signer: Signer) -> Written:
    payload = pickle.dumps(value, protocol=5)
    digest = hashlib.blake2b(payload, digest_size=32).hexdigest()
    trailer = _trailer(Meta(key, "pickle", tag, len(payload), digest).to_json(), signer)
    if len(payload) < _ONE_WRITE:
        _write_all(fd, payload + trailer)
    else:
        _write_all(fd, payload)
        _write_all(fd, trailer)
    if _immutable(value):
        holder: Callable[[], Any] = lambda: value  # noqa: E731
    else:
        # Keep a copy, not the caller's object: a later change to that object must not
        # change what get() returns in this process while the file says otherwise.
        holder = lambda: pickle.loads(payload)  # noqa: E731
    return Written("pickle", len(payload) + len(trailer), holder, len(payload))


_IMMUTABLE_TYPES = (type(None), bool, int, float, complex, str, bytes, range, np.generic)


def _immutable(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _IMMUTABLE_TYPES):
        return True
    if type(value) in (tuple, frozenset) and depth < 3 and len(value) <= 256:
        return all(_immutable(item, depth + 1) for item in value)
    return False


def _npy_header(arr: np.ndarray) -> tuple[bytes, str]:
    """The ``.npy`` header of ``arr`` and its digest (hex)."""
    # The order np.save writes: C for C-contiguous arrays (1-d ones are both), Fortran
    # for Fortran-contiguous ones, C (after a copy) for the rest.
    fortran = not arr.flags.c_contiguous and arr.flags.f_contiguous
    return _npy_header_for(arr.dtype, arr.shape, fortran)


@functools.lru_cache(maxsize=512)
def _npy_header_for(
    dtype: np.dtype[Any], shape: tuple[int, ...], fortran: bool
) -> tuple[bytes, str]:
    """Cached: formatting a header costs tens of microseconds, and the arrays of a
    store often share a dtype and shape. Equal dtypes have the same ``descr``."""
    fields = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": fortran,
        "shape": shape,
    }
    buf = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(buf, fields)
    except ValueError:  # header over 64 KiB (a huge structured dtype): format 2.0
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, fields)
    header = buf.getvalue()
    return header, hashlib.blake2b(header, digest_size=32).hexdigest()


def _write_array_body(fd: int, arr: np.ndarray, header: bytes, trailer: bytes) -> None:
    """``header``, the data in the order the header says, then ``trailer``."""
    if arr.flags.c_contiguous or arr.flags.f_contiguous:
        flat = (arr if arr.flags.c_contiguous else arr.T).reshape(-1).view(np.uint8)
        if flat.nbytes < _ONE_WRITE:
            _write_all(fd, header + flat.tobytes() + trailer)
            return
        _write_all(fd, header)
        _write_all(fd, flat)
    else:
        _write_all(fd, header)
        rows = max(1, _PIECE // max(1, arr[:1].nbytes))
        for start in range(0, arr.shape[0], rows):
            piece = np.ascontiguousarray(arr[start : start + rows])
            _write_all(fd, piece.reshape(-1).view(np.uint8))
    _write_all(fd, trailer)


def _npy_meta(
    arr: np.ndarray, key: bytes, tag: str | None, kind: str, torch: dict[str, Any] | None
) -> tuple[bytes, bytes, int]:
    """The ``.npy`` header of ``arr``, the meta JSON of its entry, and the body length."""
    header, digest = _npy_header(arr)
    body = len(header) + arr.nbytes
    return header, Meta(key, kind, tag, body, digest, len(header), torch).to_json(), body


def _write_npy(fd: int, arr: np.ndarray, key: bytes, tag: str | None, signer: Signer) -> Written:
    header, meta, body = _npy_meta(arr, key, tag, "npy", None)
    trailer = _trailer(meta, signer)
    _write_array_body(fd, arr, header, trailer)

    def holder() -> np.ndarray:
        copy = np.array(arr, copy=True, subok=False)
        copy.flags.writeable = False
        return copy

    return Written("npy", body + len(trailer), holder, arr.nbytes)


def _as_plain_tensor(value: Any) -> Any:
    """``value`` if it is a strided torch tensor this module stores as ``.npy``, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        return None  # subclasses carry behaviour only their pickle restores
    if value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
        return None
    if getattr(value, "is_nested", False):
        return None
    return value


_SAME_SIZE_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _write_tensor(fd: int, tensor: Any, key: bytes, tag: str | None, signer: Signer) -> Written:
    import torch

    cpu = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous()
    try:
        arr = cpu.numpy()
        view = False
    except TypeError:  # bfloat16, float8 and other dtypes NumPy lacks
        stand_in = getattr(torch, _SAME_SIZE_INT[cpu.element_size()])
        arr = cpu.view(stand_in).numpy()
        view = True
    info = {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device": str(tensor.device),
        "grad": bool(tensor.requires_grad),
        "view": view,
    }
    header, meta, body = _npy_meta(arr, key, tag, "torch", info)
    trailer = _trailer(meta, signer)
    _write_array_body(fd, arr, header, trailer)
    # Tensors are not kept in the RAM tier: a GPU tensor would pin device memory, and
    # reading one back is a cheap copy-on-write mapping.
    return Written("torch", body + len(trailer), None, 0)


# -- reading ----------------------------------------------------------------------------


def _read_exact(fd: int, size: int, offset: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise EntryDamaged(f"it ended after {offset + got} bytes while being read")
        got += n
    return buf


def _read_trailer(fd: int, size: int, signer: Signer) -> Meta:
    if size < _FOOTER.size:
        raise EntryDamaged(f"it is {size} bytes, too short for a trailer")
    tail_len = min(size, _TAIL_READ)
    tail = os.pread(fd, tail_len, size - tail_len)
    if len(tail) != tail_len:
        raise EntryDamaged("it shrank while being read")
    mac, meta_len, magic = _FOOTER.unpack_from(tail, tail_len - _FOOTER.size)
    if magic != _MAGIC:
        raise EntryDamaged("it has no tierflow trailer")
    if meta_len > _MAX_META or meta_len + _FOOTER.size > size:
        raise EntryDamaged(f"its trailer claims {meta_len} bytes of meta in a {size}-byte file")
    need = meta_len + _FOOTER.size
    if need <= tail_len:
        data = bytes(tail[tail_len - need : tail_len - _FOOTER.size])
    else:
        data = bytes(_read_exact(fd, meta_len, size - need))
    if not signer.verify(data, mac):
        raise EntryDamaged("its signature does not match (changed, or signed with another key)")
    meta = Meta.from_json(data)
    if meta.body + need != size:
        raise EntryDamaged(f"it is {size} bytes, but was written as {meta.body + need}")
    return meta


def read_meta(path: str | os.PathLike[str], signer: Signer) -> tuple[Meta, int]:
    """The verified trailer of the file at ``path`` and the file's size in bytes.

    Reads only the end of the file. Raises ``FileNotFoundError`` if it is gone and
    :class:`EntryDamaged` if the trailer is missing, forged, or the size is wrong.
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        return _read_trailer(f.fileno(), size, signer), size


def read_entry(path: str | os.PathLike[str], key: bytes, signer: Signer) -> Loaded:
    """Read back the value stored for the encoded ``key`` at ``path``.

    Raises ``FileNotFoundError`` when there is no such file, and :class:`EntryDamaged`
    when any check fails or a verified pickle cannot be loaded (a class that no longer
    exists, for instance) — nothing unverified is ever unpickled or mapped. Reading a
    tensor needs torch (:class:`~tierflow.errors.DependencyError` otherwise).
    """
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        try:
            return _read_value(f, st, key, signer)
        except EntryDamaged as exc:
            exc.ident = file_ident(st)  # which file failed: the caller removes only that one
            raise


def _read_value(f: BinaryIO, st: os.stat_result, key: bytes, signer: Signer) -> Loaded:
    fd = f.fileno()
    meta = _read_trailer(fd, st.st_size, signer)
    if meta.key != key:
        raise EntryDamaged("it holds the value of another key")
    ident = file_ident(st)
    if meta.kind == "pickle":
        body = _read_exact(fd, meta.body, 0)
        if hashlib.blake2b(body, digest_size=32).hexdigest() != meta.digest:
            raise EntryDamaged("its pickle does not match the signed digest")
        try:
            value = pickle.loads(body)
        except Exception as exc:
            raise EntryDamaged(f"it is signed but cannot be unpickled here ({exc!r})") from exc
        return Loaded(value, "pickle", True, meta.body, ident)
    arr = _map_npy(f, meta, st.st_size)
    if meta.kind == "npy":
        return Loaded(arr, "npy", False, arr.nbytes, ident)
    return Loaded(_as_tensor(arr, meta), "torch", False, arr.nbytes, ident)


def _map_npy(f: BinaryIO, meta: Meta, size: int) -> np.ndarray:
    """Map the array of a verified ``npy``/``torch`` entry: read-only for arrays,
    copy-on-write for tensors (torch wants writable memory).

    Mapped under a read lease, so the file cannot shrink under the array's pages (see
    :mod:`tierflow.storage.leases`); where no lease can be had, read into memory. A
    file that is no longer ``size`` bytes is :class:`EntryDamaged`."""
    header = bytes(_read_exact(f.fileno(), meta.header, 0))
    if hashlib.blake2b(header, digest_size=32).hexdigest() != meta.digest:
        raise EntryDamaged("its .npy header does not match the signed digest")
    try:
        shape, fortran, dtype = _parse_npy_header(header)
    except ValueError as exc:
        raise EntryDamaged(f"its .npy header is unreadable ({exc})") from None
    nbytes = math.prod(shape) * dtype.itemsize
    if meta.header + nbytes != meta.body:
        raise EntryDamaged("its .npy header does not fit its size")
    mode: Literal["c", "r"] = "c" if meta.kind == "torch" else "r"
    order: Literal["C", "F"] = "F" if fortran else "C"
    if nbytes == 0:  # mmap cannot map zero bytes
        arr = np.empty(shape, dtype=dtype, order=order)
        arr.flags.writeable = mode == "c"
        return arr
    lease = leases.acquire(f.fileno())
    if lease is None:
        arr = np.empty(shape, dtype=dtype, order=order)
        if leases.read_into(f.fileno(), arr, meta.header) < nbytes:
            raise EntryDamaged(f"it shrank to {os.fstat(f.fileno()).st_size} bytes from {size}")
        arr.flags.writeable = mode == "c"
        return arr
    now = os.fstat(lease).st_size
    if now != size:
        os.close(lease)
        raise EntryDamaged(f"it changed size from {size} to {now} bytes while it was read")
    name = str(getattr(f, "name", ""))
    return leases.map_leased(
        lease, name, dtype, shape, meta.header, sequential=False, mode=mode, order=order
    )


@functools.lru_cache(maxsize=512)
def _parse_npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """(shape, fortran order, dtype) of a complete ``.npy`` header; ``ValueError`` if it
    is not one. Cached: NumPy parses headers with ``ast.literal_eval`` (tens of
    microseconds), and many entries share a shape and dtype. Only headers that matched
    their signed digest get here."""
    stream = io.BytesIO(header)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    if stream.tell() != len(header):
        raise ValueError(f"{len(header) - stream.tell()} bytes after the header")
    return tuple(shape), bool(fortran), dtype


def _as_tensor(arr: np.ndarray, meta: Meta) -> Any:
    try:
        import torch
    except ImportError:
        raise missing_dependency("torch", "torch", "a tensor read from a store") from None
    info = meta.torch or {}
    dtype = getattr(torch, str(info.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise EntryDamaged(f"it holds a tensor of dtype {info.get('dtype')!r}, unknown to torch")
    tensor = torch.from_numpy(arr)
    if info.get("view"):
        tensor = tensor.view(dtype)
    device = str(info.get("device", "cpu"))
    if device != "cpu":
        # When that device is not here, the CPU copy is the value.
        with contextlib.suppress(RuntimeError, AssertionError, ValueError):
            tensor = tensor.to(device)
    if info.get("grad"):
        tensor.requires_grad_(True)
    return tensor
