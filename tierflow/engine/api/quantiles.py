"""Exact quantiles of lazy arrays: ``np.quantile``, ``np.percentile``, ``np.median`` and
their nan-versions, along the rows (``axis=0``) or over all values (``axis=None``).

Here are NumPy's signatures, their argument checks and the lazy results; the passes
that find the order statistics, and NumPy's interpolation on them, are
:mod:`tierflow.engine.rowwide.quantiles`.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...operators import order_stats
from ...operators.order_stats import Limits
from .. import graph
from ..graph import Chunked, Value
from ..rowwide.quantiles import Rule, finish, passes
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["quantile_passes", "rule_of"]


def quantile_passes(array: Array, rule: Rule, limits: Limits | None = None) -> list[Array]:
    """The passes of ``rule`` over ``array`` as lazy values, in order: the stats, then
    each narrowing pass (its :class:`~tierflow.operators.order_stats.Search`)."""
    node = array._node
    assert isinstance(node, Chunked)
    return [build.wrap(p) for p in passes(node, rule, limits)]


def _flat_axis(function: str, axis: Any, ndim: int) -> bool:
    """True for all values (axis None), False for the rows (axis 0); other axes refused."""
    if axis is None:
        return True
    axes = axis if isinstance(axis, tuple) else (axis,)
    normal = sorted(
        {operator.index(a) % ndim if -ndim <= a < ndim else _bad_axis(a, ndim) for a in axes}
    )
    if normal == list(range(ndim)):
        return True
    if normal == [0]:
        return False
    raise ValueError(
        f"np.{function} of a lazy array runs along the rows (axis=0) or over all values "
        f"(axis=None), not axis={axis}; for a trailing axis use "
        f"x.map_blocks(lambda b: np.{function}(b, axis={axis}))"
    )


def _bad_axis(axis: int, ndim: int) -> int:
    raise np.exceptions.AxisError(axis, ndim)


def _refuse(function: str, out: Any, weights: Any = None, interpolation: Any = None) -> None:
    if out is not None:
        raise TypeError(f"np.{function}(..., out=...) is not supported on lazy arrays")
    if weights is not None:
        raise TypeError(
            f"np.{function}(..., weights=...) is not supported on lazy arrays; compute() first"
        )
    if interpolation is not None:
        raise TypeError(f"np.{function}: interpolation= was renamed method= in NumPy 1.22")


def _lazy(function: str, a: Any, q: Any, axis: Any, method: str, keepdims: Any) -> Any:  # noqa: PLR0913
    """``np.<function>`` of a lazy array (``q`` None for the medians)."""
    array = from_array(a)
    keep = bool(keepdims) if keepdims is not np._NoValue else False
    node = array._node
    if isinstance(node, Chunked) and node.n_rows == 0:
        node = build.as_value(node)  # NumPy's own answer (or error) over no rows
    if isinstance(node, Value):
        extra: dict[str, Any] = {} if function.endswith("median") else {"method": method}
        args = () if function.endswith("median") else (q,)
        fn = getattr(np, function)
        return build.value_apply(fn, node, *args, axis=axis, keepdims=keep, name=function, **extra)
    assert isinstance(node, Chunked)
    if node.n_rows is None:
        _flat_axis(function, axis, node.ndim)  # the refusal of a trailing axis comes first
        if _rows_decide(function, node, q, axis, method):
            return _once_counted(function, array, q, axis, method, keep)
    rule = rule_of(function, array, q, axis=axis, method=method, keepdims=keep)
    last = quantile_passes(array, rule)[-1]
    return build.wrap(graph.Apply(finish, (last._node,), {"rule": rule}, name=rule.function))


def _numpy_on(function: str, node: Chunked, rows: int, q: Any, axis: Any, **kwargs: Any) -> Any:
    """``np.<function>`` of zeros of ``node``'s dtype and row shape, ``rows`` rows."""
    zeros = np.zeros((rows, *node.row_shape), node.dtype)
    args = () if function.endswith("median") else (q,)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return getattr(np, function)(zeros, *args, axis=axis, **kwargs)


def _rows_decide(function: str, node: Chunked, q: Any, axis: Any, method: str) -> bool:
    """Whether NumPy raises over rows an error it does not raise over none: an error of
    the values, not of the arguments (booleans NumPy cannot subtract: the nan-versions
    give NaN over no rows, the others another error). Such a call waits for the row
    count, where it is unknown."""
    kwargs = {} if function.endswith("median") else {"method": method}
    try:
        _numpy_on(function, node, 1, q, axis, **kwargs)
    except Exception as with_rows:
        try:
            _numpy_on(function, node, 0, q, axis, **kwargs)
        except Exception as without:
            return type(without) is not type(with_rows)
        return True
    return False


def _once_counted(  # noqa: PLR0913 -- NumPy's arguments
    function: str, array: Array, q: Any, axis: Any, method: str, keepdims: bool
) -> Array:
    """``np.<function>`` of ``array``, whose rows are unknown and whose NumPy answer
    depends on whether it has any: built again once they are counted (NumPy's answer
    over no rows, or its error over rows)."""
    node = array._node
    assert isinstance(node, Chunked)
    kwargs: dict[str, Any] = {"axis": axis, "keepdims": keepdims}
    if not function.endswith("median"):
        kwargs["method"] = method
    try:
        answer = np.asarray(_numpy_on(function, node, 0, q, **kwargs))
        meta: tuple[Any, tuple[int, ...]] = (answer.dtype, answer.shape)
    except Exception:  # an error with rows or without: no result to describe
        meta = (np.dtype(np.float64), ())

    def make(lookup: Callable[[graph.Node], graph.Node]) -> graph.Node:
        counted = build.wrap(lookup(node))
        return _lazy(function, counted, q, axis, method, keepdims)._node

    token = (function, q, axis, method, keepdims)
    return build.deferred([node], make, meta, function, token, rows=False)


def rule_of(  # noqa: PLR0913 -- NumPy's arguments
    function: str, array: Array, q: Any, *, axis: Any, method: str, keepdims: bool
) -> Rule:
    """The :class:`Rule` of ``np.<function>(array, q, axis, method, keepdims)`` (``q``
    None for the medians). NumPy checks the arguments first, on one row of zeros, and
    raises what it raises (``q`` out of range, an unknown method, complex numbers)."""
    node = array._node
    assert isinstance(node, Chunked)
    median = function.endswith("median")
    flat = _flat_axis(function, axis, node.ndim)
    sample = np.zeros((1, *node.row_shape), node.dtype)
    numpy_fn = getattr(np, function)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if median:
            probe = np.asarray(numpy_fn(sample, axis=axis, keepdims=keepdims))
        else:
            probe = np.asarray(numpy_fn(sample, q, axis=axis, method=method, keepdims=keepdims))
    if not order_stats.supported(node.dtype):
        raise TypeError(
            f"np.{function} of a lazy array of {node.dtype} is not supported (bool, integers "
            "and floats up to 64 bits are); compute() first"
        )
    weak_q = type(q) in (int, float)
    q_value = None
    if not median:
        percent = function.endswith("percentile")
        q_value = np.asanyarray(np.true_divide(q, 100) if percent else q)
        function = function.replace("percentile", "quantile")
    return Rule(
        function, q_value, weak_q, method, flat, keepdims, np.dtype(node.dtype),
        tuple(node.row_shape), probe.dtype, tuple(probe.shape),
    )  # fmt: skip


def _quantile_function(function: str) -> Callable[..., Any]:
    def handler(  # noqa: PLR0913 -- NumPy's own signature, for __array_function__
        a: Any,
        q: Any,
        axis: Any = None,
        out: Any = None,
        overwrite_input: bool = False,
        method: str = "linear",
        keepdims: Any = False,
        *,
        weights: Any = None,
        interpolation: Any = None,
    ) -> Any:
        _refuse(function, out, weights, interpolation)
        return _lazy(function, a, q, axis, method, keepdims)

    return handler


def _median_function(function: str) -> Callable[..., Any]:
    def handler(
        a: Any,
        axis: Any = None,
        out: Any = None,
        overwrite_input: bool = False,
        keepdims: Any = False,
    ) -> Any:
        _refuse(function, out)
        return _lazy(function, a, None, axis, "linear", keepdims)

    return handler


dispatch.implements(np.quantile)(_quantile_function("quantile"))
dispatch.implements(np.percentile)(_quantile_function("percentile"))
dispatch.implements(np.nanquantile)(_quantile_function("nanquantile"))
dispatch.implements(np.nanpercentile)(_quantile_function("nanpercentile"))
dispatch.implements(np.median)(_median_function("median"))
dispatch.implements(np.nanmedian)(_median_function("nanmedian"))
