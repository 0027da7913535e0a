"""Fingerprints for ``@cached``: a function's identity, and its arguments by value.

A function's identity is ``module.qualname@<16 hex digits>``, a digest of the function's
:func:`~tierflow.storage.identity.function_token`: the rule the engine's cache keys
follow too. It covers the bytecode, constants (nested functions, lambdas and
comprehensions recursively), names and argument layout, the values of defaults and
closure cells, and the values of the globals the code names, following helper
functions of the user's own code recursively. So editing the body, or a helper it
calls, or a global it reads, misses; moving it down the file does not. Functions of
installed libraries enter by name and code only; a new Python version changes
bytecode, so its cache starts empty. The identity is taken at each call (about 10 us
for a function with a few helpers), so a helper redefined in a notebook is seen at the
next call. A global the function changes (a list it appends to, a counter) changes its
identity too, so such a function misses every time: keep that state out of its globals.

Arguments are bound with the function's signature (``f(1, b=2)`` and ``f(1, 2)`` are
one call) and hashed by value with BLAKE2b: ``None``, ``bool``, ``int``, ``float``
(by ``repr``), ``complex``, ``str``, ``bytes``/``bytearray``, tuples, lists, dicts
(order-independent), sets, NumPy arrays (dtype, shape and the bytes), NumPy scalars
and dtypes. Every value is tagged with its type, so ``1``, ``1.0``, ``True`` and
``"1"`` differ. Anything else is a ``TypeError`` naming the argument and its type:
hashing an object by ``id`` or ``repr`` would make hits wrong or impossible.

>>> def f(a, b=2): return a + b
>>> call_digest(inspect.signature(f).bind(1), "f") == call_digest(
...     inspect.signature(f).bind(1, b=2), "f")
True
"""

from __future__ import annotations

import hashlib
import inspect
import struct
import types
from typing import Any

import numpy as np

from .. import identity

__all__ = ["SUPPORTED", "call_digest", "function_identity", "value_digest"]

SUPPORTED = (
    "None, bool, int, float, complex, str, bytes, tuples, lists, dicts, sets, "
    "NumPy arrays, scalars and dtypes"
)

_LEN = struct.Struct(">Q")
_MAX_DEPTH = 64
# Non-contiguous arrays are hashed in row pieces of about this many bytes.
_PIECE = 16 << 20


def function_identity(fn: Any) -> str:
    """``module.qualname@<16 hex digits>`` for a Python function (see the module docstring).

    A callable that is not a plain function but wraps one (``functools.wraps``) is
    looked through. Raises ``TypeError`` for callables without Python code (builtins,
    C extensions, objects with ``__call__``).
    """
    target = fn if isinstance(fn, types.FunctionType) else inspect.unwrap(fn)
    if not isinstance(getattr(target, "__code__", None), types.CodeType):
        raise TypeError(
            f"@cached needs a Python function to fingerprint; {fn!r} has no Python code "
            "(wrap the call in a def)"
        )
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", "?")
    return f"{module}.{qualname}@{identity.digest(identity.function_token(target))[:16]}"


def _put(h: Any, data: bytes) -> None:
    h.update(_LEN.pack(len(data)))
    h.update(data)


def call_digest(bound: inspect.BoundArguments, label: str) -> bytes:
    """A 32-byte digest of one call's arguments, by value.

    ``bound`` is ``signature.bind(*args, **kwargs)``; defaults are applied here.
    ``label`` (the function's name) goes into error messages. Raises ``TypeError``
    naming the argument (and where inside it) whose type cannot be hashed by value.
    """
    bound.apply_defaults()
    h = hashlib.blake2b(digest_size=32)
    for name, value in bound.arguments.items():
        _put(h, name.encode())
        _feed(h, value, f"argument {name!r}", label, 0)
    return h.digest()


def value_digest(value: Any, what: str = "value") -> bytes:
    """A 32-byte digest of ``value`` by value (the rules of :func:`call_digest`)."""
    h = hashlib.blake2b(digest_size=32)
    _feed(h, value, what, "value_digest", 0)
    return h.digest()


def _feed(h: Any, value: Any, where: str, label: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise TypeError(
            f"@cached {label}(): {where} is nested more than {_MAX_DEPTH} levels deep "
            "(does it contain itself?)"
        )
    if _feed_plain(h, value, where, label):
        return
    if isinstance(value, (tuple, list)):
        h.update((b"(" if isinstance(value, tuple) else b"[") + _LEN.pack(len(value)))
        for i, item in enumerate(value):
            _feed(h, item, f"{where}[{i}]", label, depth + 1)
    elif isinstance(value, dict):
        pairs = [
            _digest(k, f"{where} (a key)", label, depth + 1)
            + _digest(v, f"{where}[{k!r}]", label, depth + 1)
            for k, v in value.items()
        ]
        h.update(b"{" + _LEN.pack(len(pairs)))
        for pair in sorted(pairs):
            h.update(pair)
    elif isinstance(value, (set, frozenset)):
        items = [_digest(item, f"{where} (an element)", label, depth + 1) for item in value]
        h.update(b"S" + _LEN.pack(len(items)))
        for digest in sorted(items):
            h.update(digest)
    else:
        _unsupported(value, where, label)


def _digest(value: Any, where: str, label: str, depth: int) -> bytes:
    """The digest of ``value`` alone: a dict's keys and values and a set's elements are
    hashed one by one and sorted, so their order does not matter."""
    h = hashlib.blake2b(digest_size=32)
    _feed(h, value, where, label, depth)
    return h.digest()


def _feed_plain(h: Any, value: Any, where: str, label: str) -> bool:
    """Feed ``value`` if it is None, a number, a string, bytes or a NumPy array, scalar
    or dtype; False for anything else (containers and the unsupported)."""
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"T" if value else b"F")
    elif isinstance(value, np.ndarray):
        _feed_array(h, value, where, label)
    elif isinstance(value, np.generic):
        if value.dtype.hasobject:
            _unsupported(value, where, label)
        h.update(b"g")
        _put(h, _dtype_text(value.dtype))
        _put(h, value.tobytes())
    elif isinstance(value, np.dtype):
        h.update(b"D")
        _put(h, _dtype_text(value))
    elif isinstance(value, int):
        h.update(b"i")
        _put(h, str(int(value)).encode())
    elif isinstance(value, float):
        h.update(b"f")
        _put(h, repr(float(value)).encode())
    elif isinstance(value, complex):
        h.update(b"c")
        _put(h, repr(complex(value)).encode())
    elif isinstance(value, str):
        h.update(b"s")
        _put(h, value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (bytes, bytearray)):
        h.update(b"b")
        _put(h, bytes(value))
    else:
        return False
    return True


def _dtype_text(dtype: np.dtype[Any]) -> bytes:
    # dtype.str of a structured dtype is only '|V12'; descr names its fields.
    return repr(dtype.descr if dtype.fields else dtype.str).encode()


def _feed_array(h: Any, arr: np.ndarray, where: str, label: str) -> None:
    if arr.dtype.hasobject:
        raise TypeError(
            f"@cached {label}(): {where} is a NumPy array of dtype {arr.dtype} holding Python "
            "objects, which cannot be hashed by value; convert it to a numeric or string array"
        )
    h.update(b"A")
    _put(h, _dtype_text(arr.dtype))
    h.update(_LEN.pack(arr.ndim) + b"".join(_LEN.pack(n) for n in arr.shape))
    if arr.flags.c_contiguous:
        h.update(arr.reshape(-1).view(np.uint8))
        return
    rows = max(1, _PIECE // max(1, arr[:1].nbytes))
    for start in range(0, arr.shape[0], rows):
        h.update(np.ascontiguousarray(arr[start : start + rows]).reshape(-1).view(np.uint8))


def _unsupported(value: Any, where: str, label: str) -> None:
    kind = type(value)
    raise TypeError(
        f"@cached {label}(): {where} is a {kind.__module__}.{kind.__qualname__}, which cannot "
        f"be hashed by value; supported: {SUPPORTED}. Pass the values it is made from instead"
    )
