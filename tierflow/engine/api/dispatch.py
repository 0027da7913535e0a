"""What each NumPy name does on a lazy array: the registry.

The Array class (:mod:`tierflow.engine.api.array`) and the modules that implement NumPy's
functions over it meet here, so the class imports none of them:

* :data:`FUNCTIONS`: NumPy functions (``np.median``, ``np.concatenate``...) that
  ``Array.__array_function__`` hands to a handler. A module registers its handlers with
  ``@implements(np.median, np.nanmedian)``; the table is also the conformance suite's
  input (``tests/engine/api/test_conformance.py``), so an entry is tested against NumPy.
* :data:`REDUCTIONS`: ufuncs whose ``.reduce`` is lazy (``np.add.reduce``).
* :data:`METHODS`: Array methods implemented elsewhere (``x.T``, ``x @ y``,
  ``x.copy()``...), registered with ``@method("transpose")``.
* :data:`REFUSED`: ndarray names a lazy array refuses, with what to do instead.

:mod:`tierflow.engine.api` imports every registering module, so the tables are full
once ``tierflow`` is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = [
    "FUNCTIONS",
    "METHODS",
    "REDUCTIONS",
    "REFUSED",
    "call_method",
    "function_name",
    "handler",
    "implements",
    "implements_reduce",
    "method",
    "reduction",
    "refused_attribute",
]

F = TypeVar("F", bound=Callable[..., Any])

FUNCTIONS: dict[Callable[..., Any], Callable[..., Any]] = {}
"""NumPy function -> its handler over lazy arrays (NumPy's signature)."""

REDUCTIONS: dict[np.ufunc, Callable[..., Any]] = {}
"""ufunc -> the handler of ``ufunc.reduce(a, axis, ...)`` over a lazy array."""

METHODS: dict[str, Callable[..., Any]] = {}
"""Array method name -> its implementation, called with the Array first."""


def _register(table: dict[Any, Callable[..., Any]], key: Any, fn: Callable[..., Any]) -> None:
    old = table.get(key)
    if old is not None and old is not fn:
        raise ValueError(
            f"{function_name(key) if callable(key) else key!r} already has a handler "
            f"({old.__module__}.{old.__qualname__}); one name, one handler"
        )
    table[key] = fn


def implements(*numpy_functions: Callable[..., Any]) -> Callable[[F], F]:
    """Register the decorated function as the handler of ``numpy_functions`` on lazy
    arrays. ValueError where one already has another handler."""

    def register(fn: F) -> F:
        for numpy_function in numpy_functions:
            _register(FUNCTIONS, numpy_function, fn)
        return fn

    return register


def implements_reduce(*ufuncs: np.ufunc) -> Callable[[F], F]:
    """Register the decorated function as the handler of ``ufunc.reduce`` for each of
    ``ufuncs``; it is called as ``fn(ufunc, a, axis, **kwargs)``."""

    def register(fn: F) -> F:
        for ufunc in ufuncs:
            _register(REDUCTIONS, ufunc, fn)
        return fn

    return register


def method(name: str) -> Callable[[F], F]:
    """Register the decorated function as Array's method ``name``."""

    def register(fn: F) -> F:
        _register(METHODS, name, fn)
        return fn

    return register


def handler(func: Any) -> Callable[..., Any]:
    """The handler of NumPy function ``func``; TypeError, saying what to do, for one
    that lazy arrays do not answer."""
    found = FUNCTIONS.get(func)
    if found is None:
        raise TypeError(
            f"{function_name(func)} is not supported on lazy arrays; use map_blocks for a "
            "row-wise function, x.reduction(...) for a reduction over rows, or compute() "
            "first"
        )
    return found


def reduction(ufunc: np.ufunc) -> Callable[..., Any] | None:
    """The handler of ``ufunc.reduce``, or None where it is not lazy."""
    return REDUCTIONS.get(ufunc)


def call_method(name: str, *args: Any, **kwargs: Any) -> Any:
    """Array method ``name`` (registered with :func:`method`) called on ``args``."""
    return METHODS[name](*args, **kwargs)


def function_name(func: Any) -> str:
    """How a user writes ``func``: ``np.linalg.norm``, ``np.fft.fft``, ``np.sum``
    (private modules left out: ``numpy._core.fromnumeric`` reads as ``np``).

    >>> function_name(np.linalg.norm), function_name(np.sum)
    ('np.linalg.norm', 'np.sum')
    """
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = str(getattr(func, "__module__", None) or "")
    parts = [p for p in module.split(".") if p and not p.startswith("_")]
    if parts and parts[0] == "numpy":
        parts[0] = "np"
    return ".".join([*parts, str(name)])


# -- refused, with what to do -----------------------------------------------------------

_IN_PLACE = "lazy arrays never change in place"
_MEMORY = "a lazy array has no memory of its own until it is computed"

REFUSED: dict[str, tuple[bool, str]] = {
    # name: (a property?, what to do)
    "sort": (False, f"it sorts in place; {_IN_PLACE}: use np.sort(x, axis=...), which returns a new array"),
    "argpartition": (False, "use np.argpartition(x, kth, axis=...) on a trailing axis, or compute() first"),
    "partition": (False, f"it works in place; {_IN_PLACE}: use np.partition(x, kth, axis=...)"),
    "fill": (False, f"it writes in place; {_IN_PLACE}: use tw.where(mask, value, x), or np.full_like after compute()"),
    "put": (False, f"it writes in place; {_IN_PLACE}: use tw.where(mask, values, x)"),
    "resize": (False, f"it works in place; {_IN_PLACE}: use x.reshape(...) (same rows) or x[:n] (fewer rows)"),
    "setfield": (False, f"it writes in place; {_IN_PLACE}: compute() first"),
    "setflags": (False, f"{_MEMORY}: compute() first"),
    "byteswap": (False, "use x.astype(x.dtype.newbyteorder()) for the values in the other byte order, or compute() first"),
    "getfield": (False, "structured fields are not supported on lazy arrays; compute() first"),
    "choose": (False, "use tw.where(condition, a, b) for two choices, or compute() first"),
    "nonzero": (False, "it gives the position of every non-zero element, an array as long as the data; select with a mask (x[x != 0]), count with np.count_nonzero(x, axis=0), or compute() first"),
    "searchsorted": (False, "it needs all sorted values at once; compute() first"),
    "flatten": (False, "it would turn each row into several, and a lazy array keeps its rows; use x.reshape(n, -1) to flatten within rows, or compute() first"),
    "dump": (False, "use x.to_npy(path), which streams to a .npy file, or compute() first"),
    "dumps": (False, "use x.to_npy(path), which streams to a .npy file, or compute() first"),
    "tofile": (False, "use x.to_npy(path), which streams to a .npy file, or compute() first"),
    "tobytes": (False, f"{_MEMORY}: compute() first (or x.to_npy(path) to write it)"),
    "base": (True, f"{_MEMORY}: compute() first"),
    "ctypes": (True, f"{_MEMORY}: compute() first"),
    "data": (True, f"{_MEMORY}: compute() first"),
    "flags": (True, f"{_MEMORY}: compute() first"),
    "strides": (True, f"{_MEMORY}: its blocks are C-contiguous when computed; compute() first"),
    "flat": (True, "a lazy array cannot be iterated element by element; compute() first, or use map_blocks"),
}  # fmt: skip
"""ndarray names a lazy array refuses: whether each is a property, and what to do."""


def refused_attribute(name: str) -> Any:
    """A method (or property) of Array that raises TypeError with the guidance of
    :data:`REFUSED` for ``name``."""
    is_property, guidance = REFUSED[name]
    what = f"x.{name}" if is_property else f"x.{name}()"

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{what} is not supported on lazy arrays: {guidance}")

    refuse.__name__ = name
    refuse.__doc__ = f"Not supported on lazy arrays: {guidance}."
    return property(refuse) if is_property else refuse
