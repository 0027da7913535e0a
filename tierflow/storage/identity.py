"""What identifies a value or a function: the same computation, the same key, every run.

One rule for both users of it: the engine keys its graph nodes with :func:`token` (its
persistent cache), and ``@memory.cached`` names a function by :func:`function_token`
(see :mod:`.store.fingerprint`). A key is a 32-digit hex digest (BLAKE2b, 16 bytes) of
a canonical text of the value. What enters it:

* scalars by type and value (``1`` and ``1.0`` and ``np.float32(1)`` differ: they
  promote differently under NEP 50);
* NumPy arrays by dtype, shape and a digest of their bytes, read in 16 MB row pieces so
  a strided array is never copied whole; a memory-mapped array by its file's identity
  (path, size, mtime, inode) and byte range instead, so keying a file never reads it;
* Python functions by what they do, not where they were written: their bytecode,
  constants (nested functions and lambdas recursively), names and argument layout, the
  values of their defaults and closure cells, and the values of the globals their code
  names (other functions recursively; modules by name). File names and line numbers
  stay out, so an identical function defined again (a notebook cell run twice, a
  script run again) has the same key, and an edited one gets a new key. Functions of
  installed libraries (the standard library, site-packages) enter by name and code
  only. ``functools.partial`` and bound methods enter with their arguments and object;
  ufuncs and types by name (classes of the user's own code with their methods' code);
* any other object by its type and a digest of its ``cloudpickle`` (its state: the
  weights of a model, the fields of a dataclass), never by ``repr``, which may leave
  state out. An object that cannot be pickled gets a token unique to this process
  (logged at debug level): it is never wrongly shared, only not reusable across runs —
  except in a function's globals, where such an object (a lock, a logger's handler, an
  open file) is not data the result depends on, and enters by its type alone.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import math
import os
import sys
import sysconfig
import threading
import types
import uuid
from typing import Any

import numpy as np

from . import pages

__all__ = ["PIECE_BYTES", "array_digest", "digest", "function_token", "token"]

log = logging.getLogger(__name__)

PIECE_BYTES = 16 << 20  # bytes hashed per piece of a big array (bounds a strided copy)
_PROCESS = uuid.uuid4().hex  # salt of keys that cannot be stable across runs
_LIBRARY_PATHS = tuple(
    sorted(
        {
            os.path.join(os.path.realpath(p), "")
            for name in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(name))
        }
    )
)
# Functions being keyed on this thread: a function that names itself (recursion) or
# two that name each other enter the second time by name only.
_active = threading.local()


def digest(text: str | bytes) -> str:
    """32 hex digits of BLAKE2b over ``text``."""
    data = text.encode() if isinstance(text, str) else text
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _file_identity(x: np.ndarray) -> str | None:
    """``path, size, mtime, inode, byte range`` of a memory-mapped array, else None."""
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


# -- code and functions ---------------------------------------------------------------


def _code_token(code: types.CodeType) -> str:
    """What ``code`` does: bytecode, constants, names, argument layout and flags; not
    its file name or line numbers (see the module docstring)."""
    consts = ",".join(
        _code_token(c) if isinstance(c, types.CodeType) else token(c) for c in code.co_consts
    )
    return (
        f"code({code.co_name},{code.co_code.hex()},[{consts}],{code.co_names},"
        f"{code.co_varnames},{code.co_freevars},{code.co_cellvars},{code.co_argcount},"
        f"{code.co_posonlyargcount},{code.co_kwonlyargcount},{code.co_flags})"
    )


def _global_names(code: types.CodeType) -> set[str]:
    """Names ``code`` and the code nested in it may look up as globals."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str | None) -> bool:
    """Whether code from ``filename`` belongs to the standard library or an installed
    package (keyed by name and code, not followed into its globals)."""
    if not filename:
        return True
    if filename.startswith("<frozen"):
        return True
    return os.path.realpath(filename).startswith(_LIBRARY_PATHS)


def _python_function_token(fn: types.FunctionType) -> str:
    code = fn.__code__
    parts = [f"{fn.__module__}.{fn.__qualname__}", _code_token(code)]
    if _is_library(code.co_filename):
        return ";".join(parts)
    parts.append(token(fn.__defaults__))
    parts.append(token(fn.__kwdefaults__))
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet assigned
            parts.append("cell()")
            continue
        parts.append(f"cell({token(value)})")
    namespace = fn.__globals__
    for name in sorted(_global_names(code)):
        if name in namespace:
            parts.append(f"{name}={_global_token(namespace[name])}")
    return ";".join(parts)


def _global_token(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return f"module({value.__name__})"
    return token(value, loose=True)


def function_token(fn: Any) -> str:
    """A stable token of a callable (see the module docstring)."""
    active: set[int] | None = getattr(_active, "ids", None)
    if active is None:
        active = _active.ids = set()
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    if id(fn) in active:
        return f"fn-again({name})"
    active.add(id(fn))
    try:
        if isinstance(fn, functools.partial):
            inner = f"{function_token(fn.func)},{token(fn.args)},{token(fn.keywords)}"
            return f"partial({inner})"
        if isinstance(fn, types.MethodType):
            return f"method({function_token(fn.__func__)},{token(fn.__self__)})"
        if isinstance(fn, types.FunctionType):
            return f"fn({_python_function_token(fn)})"
        if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(fn, "__self__", None)
            if owner is None or isinstance(owner, types.ModuleType):
                return f"builtin({name})"
            return f"builtin({name},{token(owner)})"
        return _object_token(fn, loose=False)
    finally:
        active.discard(id(fn))


# -- objects --------------------------------------------------------------------------


def _type_token(cls: type) -> str:
    """A class by name; a class of the user's own code also by its methods' code."""
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or _is_library(getattr(module, "__file__", None)):
            continue
        for attr, member in sorted(vars(klass).items()):
            if isinstance(member, property):
                found = [member.fget, member.fset]
            else:  # a function, a staticmethod or classmethod (__func__)
                found = [getattr(member, "__func__", member)]
            for func in found:
                code = getattr(func, "__code__", None)
                if isinstance(code, types.CodeType):
                    parts.append(f"{klass.__qualname__}.{attr}:{digest(_code_token(code))}")
    return "type(" + ";".join(parts) + ")"


def _torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _tensor_token(t: Any) -> str:
    """A torch tensor by dtype, shape and a digest of its values. (Its pickle names
    the storage by its address, which differs from process to process.)"""
    import torch

    try:
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    except Exception as exc:  # sparse, quantized, meta tensors ...
        log.debug("cannot read tensor %s for its key (%s); keying it by identity", t.dtype, exc)
        return f"tensor({id(t)},{_PROCESS})"
    return f"tensor({t.dtype},{tuple(t.shape)},{digest(data.tobytes())})"


def _tensor_stub(text: str) -> str:
    """What a tensor pickles as inside an object being keyed (see :func:`_pickle_digest`)."""
    return text


@functools.lru_cache(maxsize=1)
def _key_pickler() -> type:
    import cloudpickle

    class KeyPickler(cloudpickle.Pickler):
        """cloudpickle, with torch tensors as their :func:`_tensor_token`."""

        def reducer_override(self, obj: Any) -> Any:
            if _torch_tensor(obj):
                return _tensor_stub, (_tensor_token(obj),)
            return super().reducer_override(obj)

    return KeyPickler


def _pickle_digest(value: Any) -> str:
    buffer = io.BytesIO()
    _key_pickler()(buffer, protocol=5).dump(value)
    return digest(buffer.getvalue())


def _object_token(value: Any, *, loose: bool) -> str:
    """An object by its type and pickled state; unpicklable: by identity in this
    process, or (``loose``, for globals) by type alone."""
    try:
        data = _pickle_digest(value)
    except Exception as exc:  # a lock, an open file, a generator, ...
        if loose:
            return f"unpicklable({_type_token(type(value))})"
        log.debug("cannot pickle %r for its key (%s); keying it by identity", value, exc)
        return f"object({type(value).__qualname__},{id(value)},{_PROCESS})"
    return f"object({_type_token(type(value))},{data})"


def token(value: Any, *, loose: bool = False) -> str:
    """The canonical text of ``value`` that keys are hashed from.

    Nodes give their own key (``value.key``); containers recurse; functions, types and
    other objects as the module docstring says. ``loose`` keys an object that cannot
    be pickled by its type instead of its identity (for a function's globals).
    """
    if value is None or value is Ellipsis:
        return repr(value)
    key = getattr(value, "key", None)
    if isinstance(key, str) and (hasattr(value, "inputs") or hasattr(value, "_node")):
        return f"node({key})"  # a graph node, or a lazy array over one
    found = _scalar_token(value)
    if found is None and _torch_tensor(value):
        found = _tensor_token(value)
    if found is None:
        found = _container_token(value, loose)
    if found is not None:
        return found
    if isinstance(value, type):
        return _type_token(value)
    if isinstance(value, types.ModuleType):
        return f"module({value.__name__})"
    if callable(value) and not _is_plain_object(value):
        return function_token(value)
    return _object_token(value, loose=loose)


def _scalar_token(value: Any) -> str | None:
    """The token of a number, string, NumPy scalar, array, dtype or ufunc; else None."""
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
    return None


def _container_token(value: Any, loose: bool) -> str | None:
    """The token of a slice, range, tuple, list, set or dict (exactly those types,
    not subclasses, whose state may be more than their items); else None."""
    if isinstance(value, slice):
        return f"slice({token(value.start)},{token(value.stop)},{token(value.step)})"
    if isinstance(value, range):
        return f"range({value.start},{value.stop},{value.step})"
    if type(value) in (tuple, list):
        inner = ",".join(token(v, loose=loose) for v in value)
        return f"{type(value).__name__}({inner})"
    if type(value) in (set, frozenset):  # sorted: set order follows the hash seed
        inner = ",".join(sorted(token(v, loose=loose) for v in value))
        return f"{type(value).__name__}({inner})"
    if type(value) is dict:
        items = sorted((token(k), token(v, loose=loose)) for k, v in value.items())
        return "dict(" + ",".join(f"{k}:{v}" for k, v in items) + ")"
    return None


def _is_plain_object(value: Any) -> bool:
    """A callable instance of a class with state worth keying (a torch module, an
    estimator): keyed as an object, whose pickle covers its state, not as a function."""
    return not isinstance(
        value,
        (
            types.FunctionType,
            types.MethodType,
            types.BuiltinFunctionType,
            types.BuiltinMethodType,
            functools.partial,
        ),
    )
