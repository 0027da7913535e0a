"""``x.map_overlap(fn, depth=, boundary=)``: a function of each row block with rows of
its neighbours, lazily (:mod:`tierflow.engine.rowwide.overlap`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph import Chunked, Value, specs
from ..rowwide.overlap import Halo, Overlapped, halo
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["map_overlap"]


@dispatch.method("map_overlap")
def map_overlap(  # noqa: PLR0913 -- dask's signature
    x: Any,
    fn: Callable[..., Any],
    *others: Any,
    depth: Any,
    boundary: Any = None,
    trim: bool = True,
    dtype: Any = None,
    row_shape: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> Array:
    """See :meth:`tierflow.engine.api.array.Array.map_overlap`."""
    if not callable(fn):
        raise TypeError(f"map_overlap needs a function, got {type(fn).__name__}")
    if not trim:
        raise ValueError(
            "map_overlap(trim=False) is not supported: the function returns the rows it is "
            "given (halo included) and tierflow trims the halo; leave trim=True"
        )
    arrays = [from_array(x), *(from_array(o) for o in others)]
    given = [a._node for a in arrays]
    name = getattr(fn, "__qualname__", type(fn).__name__)
    nodes = [n for n in given if isinstance(n, Chunked)]
    if len(nodes) < len(given):
        value = given[0]
        if len(given) > 1 or not isinstance(value, Value):
            raise TypeError("map_overlap: every array must be a chunked array with the same rows")
        whole = halo(depth, boundary, value.ndim, np.dtype(value.dtype))
        return build.value_apply(
            lambda v: _in_memory(fn, np.asarray(v), whole, kwargs), value, name=name
        )
    first = nodes[0]
    shape = halo(depth, boundary, first.ndim, np.dtype(first.dtype))
    for extra in nodes[1:]:
        if None not in (extra.n_rows, first.n_rows) and extra.n_rows != first.n_rows:
            raise ValueError(
                f"map_overlap: the arrays have different rows: "
                f"{build.describe_shape(first.shape)} and {build.describe_shape(extra.shape)}"
            )
    if dtype is None or row_shape is None:
        probe_dtype, probe_shape = _probe(fn, nodes, shape.before + shape.after + 2, kwargs)
        dtype = probe_dtype if dtype is None else dtype
        row_shape = probe_shape if row_shape is None else row_shape
    spec = specs.MapSpec(fn, np.dtype(dtype), tuple(row_shape), None, kwargs)
    if any(n.bounds is None for n in nodes):  # after a mask: once the rows are counted

        def make(xs: list[Array]) -> Array:
            known = [a._node for a in xs if isinstance(a._node, Chunked)]
            if len({n.n_rows for n in known}) > 1:
                shapes = " and ".join(build.describe_shape(n.shape) for n in known)
                raise ValueError(f"map_overlap: the arrays have different rows: {shapes}")
            return build.wrap(Overlapped(spec, tuple(known), shape))

        return build.defer_function(make, nodes, f"map_overlap({name})")
    # Each input is read by row ranges: other arrays need not be cut as the first is.
    return build.wrap(Overlapped(spec, tuple(nodes), shape))


def _in_memory(fn: Callable[..., Any], value: np.ndarray, h: Halo, kwargs: dict[str, Any]) -> Any:
    """``fn`` on an array in memory: one block, padded at both ends as the boundary says."""
    n = value.shape[0]

    def first(count: int) -> np.ndarray:
        return value[: min(count, n)]

    def last(count: int) -> np.ndarray:
        return value[n - min(count, n) :]

    ends = (last, first) if h.boundary == "periodic" else (first, last)
    padded = h.pad(*ends, value, (h.before, h.after))
    top = h.before if h.boundary != "none" else 0
    return np.asarray(fn(padded, **kwargs))[top : top + n]


def _probe(
    fn: Callable[..., Any], nodes: list[Any], rows: int, kwargs: dict[str, Any]
) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and row shape of ``fn`` on zero blocks of ``rows`` rows (a block of
    two rows with its halo)."""
    blocks = [np.zeros((rows, *n.row_shape), n.dtype) for n in nodes]
    name = getattr(fn, "__qualname__", type(fn).__name__)
    try:
        with np.errstate(all="ignore"):
            result = np.asarray(fn(*blocks, **kwargs))
    except Exception as exc:
        raise type(exc)(
            f"map_overlap({name}) failed on its probe block of {rows} zero rows (called to "
            f"learn the result's dtype and row shape; give dtype= and row_shape= to skip "
            f"it): {exc}"
        ) from exc
    if result.ndim == 0 or result.shape[0] != rows:
        got = "a scalar" if result.ndim == 0 else f"shape {result.shape}"
        raise ValueError(
            f"map_overlap({name}) returned {got} for a probe block of {rows} rows; it must "
            "return one row per row it is given (the halo included)"
        )
    return result.dtype, tuple(result.shape[1:])
