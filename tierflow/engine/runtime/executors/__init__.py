"""Executors: how a compute's tasks run, chosen by name or passed as an object.

* ``"threads"`` (default): a thread per usable core (:mod:`.local`). NumPy and torch
  release the GIL inside their loops, so threads compute in parallel without copying
  blocks between processes.
* ``"processes"``: block tasks travel as data to a persistent pool of spawned worker
  processes (:mod:`.processes`), for functions written in plain Python, which hold the
  GIL.
* ``"dask"`` and ``"ray"``: block tasks on a Dask distributed or Ray cluster
  (:mod:`.cluster`, :mod:`.dask`, :mod:`.ray`), tierflow still driving.
* ``"serial"`` (alias ``"sync"``): each task at once in the calling thread, for
  debugging; ``"raise"``: refuses to compute, for laziness tests.

An executor made by name is made per compute and shut down at its end, so no worker
thread outlives the compute that started it (the process pool stays, for the next
compute); an executor object passed in is used as it is and left running.

:func:`use_executor` sets the default for a block of code (a context manager) or for
the rest of the process; laziness tests wrap the building of a pipeline in
``use_executor("raise")``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

from ...types import Executor
from .cluster import ClusterExecutor, WorkerLost
from .dask import DaskExecutor
from .local import (
    ComputeForbidden,
    RaisingExecutor,
    SerialExecutor,
    ThreadExecutor,
    default_workers,
    in_task,
)
from .processes import ProcessExecutor, RemoteError, WorkerDied
from .ray import RayExecutor

__all__ = [
    "ClusterExecutor",
    "ComputeForbidden",
    "DaskExecutor",
    "ProcessExecutor",
    "RaisingExecutor",
    "RayExecutor",
    "RemoteError",
    "SerialExecutor",
    "ThreadExecutor",
    "WorkerDied",
    "WorkerLost",
    "close_cluster_executors",
    "default_is_set",
    "default_workers",
    "in_task",
    "make_executor",
    "use_executor",
]

_NAMES: dict[str, Callable[[int | None], Executor]] = {
    "threads": lambda workers: ThreadExecutor(workers),
    "serial": lambda workers: SerialExecutor(),
    "sync": lambda workers: SerialExecutor(),
    "raise": lambda workers: RaisingExecutor(),
    "processes": lambda workers: ProcessExecutor(workers),
    "dask": lambda workers: _cluster("dask", workers),
    "ray": lambda workers: _cluster("ray", workers),
}
_clusters: dict[tuple[str, int | None, int], ClusterExecutor] = {}


def _cluster(name: str, workers: int | None) -> Executor:
    """The cluster executor for ``name``, made once per client (Dask) or per Ray
    instance (a new one after ``ray.shutdown()`` and ``ray.init``): making one registers
    a worker plugin or starts Ray."""
    from . import dask as dask_module

    client = dask_module.current_client() if name == "dask" else None
    key = (name, workers, id(client))
    found = _clusters.get(key)
    if isinstance(found, RayExecutor) and not found.connected():
        found.close()  # made on a Ray instance that was shut down since
        found = None
    if found is None or (client is not None and getattr(found, "client", None) is not client):
        found = (
            DaskExecutor(client, workers=workers)
            if name == "dask"
            else RayExecutor(workers=workers)
        )
        _clusters[key] = found
    return found


def close_cluster_executors(name: str | None = None) -> None:
    """Close the cluster executors that ``executor="dask"`` or ``executor="ray"`` made in
    this process (``name``: those of that engine only); the next compute by name makes a
    new one. Call it before ``ray.shutdown()`` or ``client.close()`` so that no thread
    of theirs still reaches the engine: after ``ray.shutdown()``, a call into Ray ends
    the process."""
    for key in [k for k in _clusters if name is None or k[0] == name]:
        _clusters.pop(key).close()


# None: not set (threads, unless a compute's sources prefer worker processes: see
# tierflow.engine.api.compute).
_default: contextvars.ContextVar[str | Executor | None] = contextvars.ContextVar(
    "tierflow_executor", default=None
)


def default_is_set() -> bool:
    """Whether :func:`use_executor` chose the default executor in this context."""
    return _default.get() is not None


def make_executor(
    executor: str | Executor | None, workers: int | None = None
) -> tuple[Executor, bool]:
    """The executor to use and whether this compute owns it (and must shut it down).

    ``executor`` is None (the default set by :func:`use_executor`, else threads), a
    name (``"threads"``, ``"processes"``, ``"serial"``, ``"raise"``) or an object
    following the protocol.
    """
    chosen = (_default.get() or "threads") if executor is None else executor
    if isinstance(chosen, str):
        make = _NAMES.get(chosen)
        if make is None:
            raise ValueError(
                f"unknown executor {chosen!r}; use one of {', '.join(sorted(_NAMES))} or an "
                "object with submit(fn, done), shutdown(cancel=...), workers and name"
            )
        return make(workers), True
    if not isinstance(chosen, Executor):
        raise TypeError(
            f"{type(chosen).__name__} is not an executor: it needs submit(fn, done), "
            "shutdown(cancel=...), workers and name"
        )
    return chosen, False


class _Setting:
    """What :func:`use_executor` returns: the setting, undone on leaving a ``with``."""

    def __init__(self, token: contextvars.Token[str | Executor | None]) -> None:
        self._token = token

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _default.reset(self._token)


def use_executor(executor: str | Executor | None) -> _Setting:
    """Make ``executor`` the default of computes in this context (a thread or task);
    None goes back to tierflow's own choice (threads, or worker processes for sources
    that decode faster there, such as a compressed HDF5 dataset).

    >>> from tierflow.engine.runtime.executors import use_executor
    >>> with use_executor("serial"):
    ...     pass
    """
    if executor is not None:
        make_executor(executor)  # validate now, not at the first compute
    return _Setting(_default.set(executor))
