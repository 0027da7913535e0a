"""Deterministic content keys: the same computation gets the same key in every run.

A key is a 32-digit hex digest (BLAKE2b, 16 bytes) of a canonical text of the value.
What enters it:

* scalars by type and value (``1`` and ``1.0`` and ``np.float32(1)`` differ: they
  promote differently under NEP 50);
* NumPy arrays by dtype, shape and a digest of their bytes, read in 16 MB row pieces so
  a strided array is never copied whole; a memory-mapped array by its file's identity
  (path, size, mtime, inode) and byte range instead, so keying a file never reads it;
* functions by ``cloudpickle`` (code, constants, closure values) plus their code object
  (so a function imported by reference still changes key when its code changes);
  ufuncs and types by name. A function that cannot be pickled gets a key that is
  unique to this process (logged at debug level): it is never wrongly shared, only
  not reusable across runs.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import types
import uuid
from typing import Any

import numpy as np

__all__ = ["PIECE_BYTES", "array_digest", "digest", "function_token", "token"]

log = logging.getLogger("tierflow.engine")

PIECE_BYTES = 16 << 20  # bytes hashed per piece of a big array (bounds a strided copy)
_PROCESS = uuid.uuid4().hex  # salt of keys that cannot be stable across runs


def digest(text: str | bytes) -> str:
    """32 hex digits of BLAKE2b over ``text``."""
    data = text.encode() if isinstance(text, str) else text
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _file_identity(x: np.ndarray) -> str | None:
    """``path, size, mtime, inode, byte range`` of a memory-mapped array, else None."""
    from ..storage import pages

    try:
        where = pages.file_range(x)
    except (ValueError, TypeError, OSError):
        return None
    if where is None:
        return None
    st = os.stat(where.path)
    return (
        f"file({where.path!r},{st.st_size},{st.st_mtime_ns},{st.st_ino},"
        f"{where.offset},{where.nbytes},{x.strides})"
    )


def array_digest(x: np.ndarray) -> str:
    """A digest of ``x``'s dtype, shape and values (or file identity, for a memmap)."""
    head = f"{x.dtype.str}|{x.dtype.descr if x.dtype.fields else ''}|{x.shape}"
    if x.nbytes >= (1 << 20):
        identity = _file_identity(x)
        if identity is not None:
            return digest(head + identity)
    h = hashlib.blake2b(head.encode(), digest_size=16)
    if x.ndim == 0 or x.size == 0:
        h.update(np.ascontiguousarray(x).tobytes())
        return h.hexdigest()
    row = max(1, x.nbytes // max(1, x.shape[0]))
    step = max(1, PIECE_BYTES // row)
    for start in range(0, x.shape[0], step):
        piece = np.ascontiguousarray(x[start : start + step])
        h.update(piece.data.cast("B"))
    return h.hexdigest()


def _code_token(code: types.CodeType) -> str:
    consts = ",".join(
        _code_token(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts
    )
    return f"code({code.co_name},{code.co_code.hex()},{consts},{code.co_names})"


def function_token(fn: Any) -> str:
    """A stable token of a callable: cloudpickle of it plus its code (see module docs)."""
    import cloudpickle

    parts = [f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"]
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        parts.append(_code_token(code))
    try:
        parts.append(digest(cloudpickle.dumps(fn, protocol=5)))
    except Exception as exc:  # an unpicklable closure (a lock, an open file, ...)
        log.debug("cannot pickle %r for its key (%s); keying it by identity", fn, exc)
        parts.append(f"id({id(fn)},{_PROCESS})")
    return "fn(" + ";".join(parts) + ")"


def token(value: Any) -> str:
    """The canonical text of ``value`` that keys are hashed from.

    Nodes give their own key (``value.key``); containers recurse; anything else is
    keyed by type and ``repr`` (and by identity if it has the default object repr).
    """
    if value is None or value is Ellipsis:
        return repr(value)
    key = getattr(value, "key", None)
    if isinstance(key, str) and hasattr(value, "inputs"):
        return f"node({key})"
    if isinstance(value, (bool, int, str, bytes)):
        return f"{type(value).__name__}({value!r})"
    if isinstance(value, float):
        return f"float({value.hex() if math.isfinite(value) else repr(value)})"
    if isinstance(value, complex):
        return f"complex({token(value.real)},{token(value.imag)})"
    if isinstance(value, np.generic):
        return f"np({value.dtype.str},{np.asarray(value).tobytes().hex()})"
    if isinstance(value, np.ndarray):
        return f"array({array_digest(value)})"
    if isinstance(value, np.dtype):
        return f"dtype({value.str},{value.descr if value.fields else ''})"
    if isinstance(value, np.ufunc):
        return f"ufunc({value.__name__})"
    if isinstance(value, slice):
        return f"slice({token(value.start)},{token(value.stop)},{token(value.step)})"
    if isinstance(value, (tuple, list)):
        inner = ",".join(token(v) for v in value)
        return f"{type(value).__name__}({inner})"
    if isinstance(value, dict):
        inner = ",".join(f"{token(k)}:{token(v)}" for k, v in sorted(value.items(), key=repr))
        return f"dict({inner})"
    if isinstance(value, type):
        return f"type({value.__module__}.{value.__qualname__})"
    if callable(value):
        return function_token(value)
    text = repr(value)
    if text.startswith("<") and " at 0x" in text:
        return f"object({type(value).__qualname__},{id(value)},{_PROCESS})"
    return f"{type(value).__qualname__}({text})"
