"""How a lazy graph crosses a process boundary: user code by value, nothing per-process.

A lazy array pickles with any pickler (``pickle``, ``cloudpickle``, the
``multiprocessing`` one): its nodes by value, its sources by path and the identity read
when the array was built (:mod:`tierflow.engine.io.readers`), in-memory arrays by value
(spill-backed ones by path under ``multiprocessing``, see
:mod:`tierflow.storage.sharing`). Two rules make that work:

- User code (a ``map_blocks`` function, a ``filter`` predicate, a reduction's
  functions, a ``from_files`` loader) travels by value through ``cloudpickle``
  (:func:`by_value`), whatever pickler carries the graph: a lambda, a closure or a
  function defined in a notebook arrives in a process that cannot import it.
- What belongs to one process stays behind: locks, open memory maps, and identities
  made of ``id()``. The receiver makes its own, lazily, on first use.
"""

from __future__ import annotations

from typing import Any

import cloudpickle

__all__ = ["by_value"]


class _ByValue:
    """Pickles as ``cloudpickle.loads(<bytes>)``: unpickling gives back the object itself."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return cloudpickle.loads, (cloudpickle.dumps(self.obj),)


def by_value(obj: Any) -> Any:
    """``obj`` made to pickle through ``cloudpickle`` (for a ``__getstate__``).

    The outer pickler stores the bytes; unpickling gives ``obj`` back, not a wrapper.

    >>> import pickle
    >>> pickle.loads(pickle.dumps(by_value(lambda v: v + 1)))(1)
    2
    """
    return _ByValue(obj)
