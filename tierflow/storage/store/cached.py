"""``@cached``: a function's results kept in a two-tier store, across runs.

The key of a call is ``(identity, digest)``: the function's identity
(``module.qualname@<digest>`` of its code, defaults, closure, and the globals and helper
functions it uses, taken at each call: an edited body or helper misses) and a digest of
its arguments by value, bound with its signature (see :mod:`.fingerprint`). Every entry
is tagged with the identity, which is how :meth:`CachedFunction.cache_clear` removes
this function's entries and no others (those of its current identity).

A hit returns what the store returns: arrays memory-mapped read-only, other values as
stored (shared between hits in one process: do not modify them). A miss calls the
function and returns its own result. Exceptions are not cached. A result that cannot be
stored (unpicklable, larger than the store) is returned anyway, with a
:class:`~tierflow.storage.store.serial.StoreWarning`.

Functions that name the same store with the same limits share one open
:class:`~tierflow.storage.store.tiers.Store` in a process; it is opened on the first
call, not at import.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar, overload

from ...config import GB, MB
from .fingerprint import call_digest, function_identity
from .serial import StoreWarning
from .tiers import Store, resolve_path

__all__ = ["DEFAULT_STORE", "CacheInfo", "CachedFunction", "cached"]

DEFAULT_STORE = "cached"

R = TypeVar("R")

_MISS: Any = object()
_shared_lock = threading.Lock()
_shared: dict[tuple[str, int, int], Store] = {}


class CacheInfo(NamedTuple):
    """Hits and misses of this process (since the last ``cache_clear``), and the
    number of entries of this function in the store (from any process or run)."""

    hits: int
    misses: int
    entries: int


def _shared_store(spec: str | os.PathLike[str], ram_mb: float, disk_gb: float) -> Store:
    path = resolve_path(spec)
    key = (str(path), int(ram_mb * MB), int(disk_gb * GB))
    with _shared_lock:
        st = _shared.get(key)
        if st is None or st.closed:
            st = Store(path, ram_mb=ram_mb, disk_gb=disk_gb)
            _shared[key] = st
        return st


class CachedFunction(Generic[R]):
    """A function whose results are kept in a store. Call it like the function.

    ``identity`` is the function's fingerprint now; ``store`` the store (opened on first
    use); :meth:`cache_info` and :meth:`cache_clear` work like ``functools.lru_cache``'s.
    """

    # Copied from the function by functools.update_wrapper; declared for type checkers.
    __name__: str
    __wrapped__: Callable[..., R]

    def __init__(
        self,
        fn: Callable[..., R],
        store: str | os.PathLike[str] | Store,
        ram_mb: float,
        disk_gb: float,
    ) -> None:
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(f"@cached cannot cache the coroutine function {fn.__qualname__}")
        if inspect.isgeneratorfunction(fn):
            raise TypeError(
                f"@cached cannot cache the generator function {fn.__qualname__}; "
                "return a list instead"
            )
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._signature = inspect.signature(fn)
        function_identity(fn)  # refuses a callable without Python code now
        self._label = getattr(fn, "__qualname__", repr(fn))
        self._spec = store
        self._limits = (ram_mb, disk_gb)
        self._store = store if isinstance(store, Store) else None
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    @property
    def identity(self) -> str:
        """The function's fingerprint (:func:`.fingerprint.function_identity`), as of now:
        it changes when the function, a helper it calls or a global it reads changes."""
        return function_identity(self._fn)

    @property
    def store(self) -> Store:
        """The store this function's results live in (opened now if needed)."""
        st = self._store
        if st is None or st.closed:
            if isinstance(self._spec, Store):
                st = self._spec  # closed by its owner: using it raises a clear StoreError
            else:
                st = _shared_store(self._spec, *self._limits)
            self._store = st
        return st

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return self._fn(*args, **kwargs)  # the call is wrong: let the function say how
        identity = function_identity(self._fn)
        key = (identity, call_digest(bound, self._label))
        st = self.store
        value = st.get(key, _MISS)
        if value is not _MISS:
            with self._lock:
                self._hits += 1
            return value
        with self._lock:
            self._misses += 1
        result = self._fn(*args, **kwargs)
        try:
            st.set(key, result, tag=identity)
        except Exception as exc:
            warnings.warn(
                StoreWarning(f"@cached {self._label}(): the result was not stored: {exc}"),
                stacklevel=2,
            )
        return result

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        # As a method, the instance is an argument like any other: it must be hashable
        # by value, which it usually is not (the TypeError says so).
        return self if instance is None else functools.partial(self, instance)

    def __reduce__(self) -> str:
        # Pickled by reference (module + qualified name), like the function it replaces.
        return str(getattr(self._fn, "__qualname__", self._label))

    def cache_info(self) -> CacheInfo:
        """Hits and misses in this process, and this function's entries in the store."""
        entries = self.store.count(self.identity)
        with self._lock:
            return CacheInfo(self._hits, self._misses, entries)

    def cache_clear(self) -> None:
        """Remove this function's entries from the store and reset the counts."""
        self.store.clear(self.identity)
        with self._lock:
            self._hits = 0
            self._misses = 0

    def __repr__(self) -> str:
        return f"<cached {self._label} in store {self._spec if not isinstance(self._spec, Store) else self._spec.name!s}>"


@overload
def cached(fn: Callable[..., R], /) -> CachedFunction[R]: ...


@overload
def cached(
    *,
    store: str | os.PathLike[str] | Store = ...,
    ram_mb: float = ...,
    disk_gb: float = ...,
) -> Callable[[Callable[..., R]], CachedFunction[R]]: ...


def cached(
    fn: Callable[..., R] | None = None,
    /,
    *,
    store: str | os.PathLike[str] | Store = DEFAULT_STORE,
    ram_mb: float = 256,
    disk_gb: float = 10,
) -> CachedFunction[R] | Callable[[Callable[..., R]], CachedFunction[R]]:
    """Keep a function's results in a store, so they survive restarts.

    ``@cached`` uses the store named ``"cached"``; ``@cached(store="name" or path or a
    Store, ram_mb=..., disk_gb=...)`` picks another. The wrapped function has
    ``cache_info()`` (hits, misses, entries) and ``cache_clear()``.

    A call whose arguments cannot be hashed by value raises ``TypeError`` naming the
    argument and its type, before the function runs. See :mod:`.cached` for the rules.

    >>> @cached(store="features")  # doctest: +SKIP
    ... def features(path: str, scale: float = 1.0) -> np.ndarray: ...
    """
    if fn is not None:
        if not callable(fn):
            raise TypeError(
                f"@cached takes a function, got {fn!r}; to pick a store write @cached(store=...)"
            )
        return CachedFunction(fn, store, ram_mb, disk_gb)

    def decorate(f: Callable[..., R]) -> CachedFunction[R]:
        return CachedFunction(f, store, ram_mb, disk_gb)

    return decorate
