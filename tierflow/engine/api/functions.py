"""Operations on lazy arrays that are not methods: ``tw.where``, ``tw.concatenate``,
``tw.stack``, matrix products, multi-output ufuncs, and the NumPy functions a lazy
array answers through ``__array_function__`` (``np.sum(x)``, ``np.histogram(x, ...)``,
``np.concatenate([x, y])``...).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import graph
from ..graph import Chunked, ElemOp, Value, specs
from . import build, dispatch, products
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = [
    "REDUCE_UFUNCS",
    "cast_joined",
    "concatenate",
    "dot",
    "matmul",
    "multi_output",
    "reduce_ufunc",
    "stack",
    "where",
]


def _contract_later(left: Any, right: Any, numpy_fn: Callable[..., Any]) -> Array:
    """``left @ right``, a product over rows that are unknown until counted (NumPy's
    errors are ``numpy_fn``'s)."""
    inputs = [n for n in (left, right) if isinstance(n, graph.Node)]

    def placeholder(n: Any, other: Any, side: str) -> Any:
        # The unknown row count stands as the other operand's matching axis.
        value = graph.placeholder(n) if isinstance(n, graph.Node) else np.asarray(n)
        if not (isinstance(n, Chunked) and n.n_rows is None):
            return value
        shape = np.shape(graph.placeholder(other) if isinstance(other, graph.Node) else other)
        rows = (shape[0] if len(shape) == 1 else shape[-2]) if side == "left" else shape[-1]
        return np.zeros((rows, *value.shape[1:]), value.dtype)

    with graph.quiet():
        x = placeholder(left, right, "left")
        w = placeholder(right, left, "right")
        result = np.asarray(np.matmul(x, w))
    return build.deferred(
        inputs,
        lambda lookup: (
            matmul(
                lookup(left) if isinstance(left, graph.Node) else left,
                lookup(right) if isinstance(right, graph.Node) else right,
                numpy_fn,
            )._node
        ),
        (result.dtype, result.shape),
        "matmul",
        ("matmul", [n if not isinstance(n, graph.Node) else "node" for n in (left, right)]),
        rows=False,
    )


def _numpy_core_check(numpy_fn: Callable[..., Any], left: Any, right: Any) -> None:
    """NumPy's error (``numpy_fn``'s type and message) for operands whose contracted
    axes differ, when their shapes are known: raised by NumPy on data-less stand-ins,
    before it computes anything."""
    shapes = [build.shape_of(n) for n in (left, right)]
    if any(None in s or not s for s in shapes):
        return  # unknown rows: compared once counted; scalars: NumPy's error below
    a, b = shapes
    if a[-1] != (b[0] if len(b) == 1 else b[-2]):
        numpy_fn(*(build.shape_only(n) if isinstance(n, graph.Node) else n for n in (left, right)))


@dispatch.method("matmul")
def matmul(a: Any, b: Any, numpy_fn: Callable[..., Any] = np.matmul) -> Array:
    """``a @ b`` (``np.matmul``; ``np.dot`` passes itself as ``numpy_fn`` for its own
    errors) of lazy operands, as a block operation or a reduction over the rows."""
    if isinstance(b, products.Transposed):
        b.__rmatmul__(a)  # refused, saying what to write instead
    left, right = build.node_of(a), build.node_of(b)
    _numpy_core_check(numpy_fn, left, right)
    unknown_left = isinstance(left, Chunked) and left.n_rows is None
    unknown_right = isinstance(right, Chunked) and right.n_rows is None
    if (unknown_left and left.ndim == 1) or (unknown_right and not isinstance(left, Chunked)):
        return _contract_later(left, right, numpy_fn)
    if isinstance(left, Chunked) and isinstance(right, Chunked):
        right = build.as_value(right)
    if isinstance(left, Chunked):
        w = right
        values: tuple[Value, ...] = ()
        w_array = None
        if isinstance(w, Value):
            values = (w,)
        else:
            w_array = np.asarray(w)
        if left.ndim >= 2:
            return build.wrap(graph.BlockMap(specs.MatmulSpec(w_array), (left,), values))
        return build.wrap(graph.Reduce(specs.ContractSpec(w_array, "right"), (left,), values))
    if isinstance(right, Chunked):
        values = (left,) if isinstance(left, Value) else ()
        w_array = None if values else np.asarray(left)
        if right.ndim > 2:
            raise ValueError(
                f"w @ x with x of shape {build.describe_shape(right.shape)} multiplies stacked "
                "matrices, not the row axis; x must be 1-D or 2-D"
            )
        return build.wrap(graph.Reduce(specs.ContractSpec(w_array, "left"), (right,), values))
    return build.value_apply(np.matmul, left, right, name="matmul")


@dispatch.method("outputs")
def multi_output(
    ufunc: np.ufunc, inputs: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Array, ...]:
    nodes = [build.node_of(i) for i in inputs]
    try:
        shape = build.result_shape(nodes)
    except build.NeedsCount:
        return _multi_output_later(ufunc, nodes, kwargs)
    aligned = build.align(nodes, shape)
    chunked = [a for a in aligned if isinstance(a, Chunked)]
    if not chunked:
        return _value_outputs(ufunc, aligned, kwargs)
    blocks = tuple(chunked)
    template = tuple(
        None if isinstance(a, Chunked) else specs.VALUE if isinstance(a, Value) else a
        for a in aligned
    )
    values = tuple(a for a in aligned if isinstance(a, Value))
    return tuple(
        build.wrap(graph.BlockMap(specs.UfuncOutSpec(ufunc, k, kwargs, template), blocks, values))
        for k in range(ufunc.nout)
    )


def _multi_output_later(
    ufunc: np.ufunc, nodes: list[Any], kwargs: dict[str, Any]
) -> tuple[Array, ...]:
    """The outputs of ``ufunc`` on operands whose rows line up only once counted (or
    values whose length is known once computed)."""
    if not any(isinstance(n, Chunked) for n in nodes):
        return _value_outputs(ufunc, nodes, kwargs)
    inputs = [n for n in nodes if isinstance(n, graph.Node)]
    probes = [
        np.zeros((1, *n.shape[1:]), n.dtype) if isinstance(n, np.ndarray) and n.ndim else n
        for n in nodes
    ]
    with graph.quiet():
        results = ufunc(*graph.substitute(probes, graph.placeholder), **kwargs)
    outputs = []
    for k, probe in enumerate(results):
        meta = (np.asarray(probe).dtype, np.shape(probe)[1:])

        def make(lookup: Callable[[graph.Node], graph.Node], k: int = k) -> graph.Node:
            swapped = [lookup(n) if isinstance(n, graph.Node) else n for n in nodes]
            return multi_output(ufunc, swapped, kwargs)[k]._node

        what = f"{ufunc.__name__}[{k}]"
        outputs.append(build.deferred(inputs, make, meta, what, (what, kwargs, len(nodes))))
    return tuple(outputs)


def _value_outputs(
    ufunc: np.ufunc, operands: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Array, ...]:
    """The outputs of ``ufunc`` on in-memory values."""
    return tuple(
        build.value_apply(
            lambda *v, k=k: ufunc(*v, **kwargs)[k], *operands, name=f"{ufunc.__name__}[{k}]"
        )
        for k in range(ufunc.nout)
    )


REDUCE_UFUNCS: dict[np.ufunc, str] = {
    np.add: "sum",
    np.multiply: "prod",
    np.minimum: "min",
    np.maximum: "max",
    np.logical_or: "any",
    np.logical_and: "all",
}


# Reductions whose kernels take no dtype: NumPy's reduce with one casts the values first.
_CAST_FIRST = frozenset({"min", "max", "any", "all"})


@dispatch.implements_reduce(*REDUCE_UFUNCS)
def reduce_ufunc(ufunc: np.ufunc, a: Any, axis: Any = 0, **kwargs: Any) -> Array:
    """``np.add.reduce(a, axis, dtype, keepdims, initial)`` and the other
    :data:`REDUCE_UFUNCS`.

    ``np.maximum.reduce(a, dtype=d)`` is the maximum of ``a`` cast to ``d`` (unsafely,
    as NumPy casts for a reduce); a dtype the ufunc has no loop for raises NumPy's
    TypeError, found by NumPy on one row of zeros."""
    kind = REDUCE_UFUNCS[ufunc]
    unknown = set(kwargs) - {"dtype", "keepdims", "initial"}
    if unknown:
        raise TypeError(f"np.{ufunc.__name__}.reduce: unsupported keywords {sorted(unknown)}")
    array = from_array(a)
    dtype = kwargs.pop("dtype", None)
    if dtype is None or kind not in _CAST_FIRST:
        return array._reduce(kind, axis=axis, dtype=dtype, **kwargs)
    sample = np.zeros((1, *(int(n or 0) for n in array.shape[1:])), array.dtype)
    with graph.quiet():
        ufunc.reduce(sample, axis=axis, dtype=dtype, **kwargs)
    return array.astype(dtype)._reduce(kind, axis=axis, **kwargs)


# -- module functions -------------------------------------------------------------------


def where(condition: Any, x: Any = None, y: Any = None) -> Array:
    """``np.where(condition, x, y)`` elementwise. The one-argument form is not lazy."""
    if x is None or y is None:
        raise TypeError(
            "tw.where(condition) without x and y (the indices of true elements) is not "
            "supported; use x[condition] to select, or compute() first"
        )
    return build.elementwise(ElemOp("where"), condition, x, y)


def concatenate(arrays: Sequence[Any], axis: int = 0) -> Array:
    """``np.concatenate(arrays, axis)``: along the rows, the blocks of each array one
    after the other (nothing is copied until computed); along a trailing axis, a block
    operation on arrays with the same rows."""
    items = [from_array(a) for a in arrays]
    if not items:
        raise ValueError("need at least one array to concatenate")
    nodes = [a._node for a in items]
    if any(isinstance(n, Value) for n in nodes):
        # An in-memory piece among chunked ones: the whole result is held in memory
        # (the chunked pieces must then be small enough to be constants).
        nodes = [n if isinstance(n, Value) else build.as_value(n) for n in nodes]
    if all(isinstance(n, Value) for n in nodes):
        return build.value_apply(np.concatenate, list(nodes), axis=axis, name="concatenate")
    ndim = nodes[0].ndim
    if any(n.ndim != ndim for n in nodes):
        _numpy_concatenate_check(nodes, axis)
        raise ValueError(
            "all the input arrays must have same number of dimensions, but the array at "
            f"index 0 has {ndim} dimension(s) and another has a different number: "
            + ", ".join(build.describe_shape(n.shape) for n in nodes)
        )
    axis = operator.index(axis)
    if axis < 0:
        axis += ndim
    if not 0 <= axis < ndim:
        raise np.exceptions.AxisError(axis, ndim)
    chunked = tuple(n for n in nodes if isinstance(n, Chunked))
    if axis == 0:
        if len(chunked) == 1:
            return items[0]
        return build.wrap(graph.Concat(chunked))
    if build.line_up_later(chunked):
        return build.defer_function(
            lambda xs: concatenate(xs, axis=axis), chunked, f"concatenate(axis={axis})"
        )
    rows = {n.n_rows for n in chunked}
    if len(rows) > 1:
        _numpy_concatenate_check(nodes, axis)
        raise ValueError(
            f"all the input array dimensions except for the concatenation axis must match "
            f"exactly: the arrays have rows {', '.join(build.describe_shape(n.shape) for n in chunked)}"
        )
    return build.wrap(graph.BlockMap(specs.StackSpec(np.concatenate, axis), chunked))


def _numpy_concatenate_check(nodes: Sequence[Any], axis: int) -> None:
    """NumPy's error for arrays that do not concatenate: ``np.concatenate`` of data-less
    stand-ins raises it before it copies anything. Where a row count is unknown, only
    for numbers of dimensions (NumPy's message names no row count then)."""
    if all(None not in n.shape for n in nodes) or len({n.ndim for n in nodes}) > 1:
        np.concatenate([build.shape_only(n) for n in nodes], axis=axis)


def stack(arrays: Sequence[Any], axis: int = 1) -> Array:
    """``np.stack(arrays, axis)`` along a new trailing axis (``axis >= 1``) of arrays with
    the same rows."""
    items = [from_array(a) for a in arrays]
    nodes = [a._node for a in items]
    if not items:
        raise ValueError("need at least one array to stack")
    if all(isinstance(n, Value) for n in nodes):
        return build.value_apply(np.stack, list(nodes), axis=axis, name="stack")
    axis = operator.index(axis)
    if axis < 0:
        axis += nodes[0].ndim + 1
    if axis == 0:
        raise ValueError(
            "stacking along axis 0 would make the arrays the rows; stack along a trailing "
            "axis, or concatenate along the rows"
        )
    chunked = tuple(n for n in nodes if isinstance(n, Chunked))
    if len(chunked) == len(nodes) and build.line_up_later(chunked):
        return build.defer_function(lambda xs: stack(xs, axis=axis), chunked, f"stack(axis={axis})")
    shapes = {n.shape for n in chunked}
    if len(chunked) != len(nodes) or len(shapes) > 1:
        raise ValueError(
            "all input arrays must have the same shape: "
            + ", ".join(build.describe_shape(n.shape) for n in nodes)
        )
    return build.wrap(graph.BlockMap(specs.StackSpec(np.stack, axis), chunked))


def _reduction_function(kind: str) -> Callable[..., Any]:
    def handler(
        a: Any,
        axis: Any = None,
        dtype: Any = None,
        out: Any = None,
        keepdims: Any = False,
        **kw: Any,
    ) -> Any:
        if out is not None:
            raise TypeError(f"np.{kind}(..., out=...) is not supported on lazy arrays")
        keep = bool(keepdims) if keepdims is not np._NoValue else False
        kw.pop("where", None) if kw.get("where", True) is True else _no_where(kind)
        initial = kw.pop("initial", np._NoValue)
        ddof = kw.pop("ddof", 0)
        kw.pop("mean", None)
        kw.pop("correction", None)
        if kw:
            raise TypeError(f"np.{kind}: unsupported keywords {sorted(kw)} on lazy arrays")
        array = from_array(a)
        if kind in ("min", "max", "any", "all", "argmin", "argmax", "count_nonzero"):
            if dtype is not None:
                raise TypeError(f"{kind} takes no dtype argument")
            return array._reduce(kind, axis, keep, initial=initial)
        return array._reduce(kind, axis, keep, dtype, ddof, initial=initial)

    return handler


def _no_where(kind: str) -> None:
    raise TypeError(
        f"np.{kind}(..., where=...) is not supported on lazy arrays; use tw.where first"
    )


def _arg_function(kind: str) -> Callable[..., Any]:
    def handler(a: Any, axis: Any = None, out: Any = None, *, keepdims: Any = False) -> Any:
        if out is not None:
            raise TypeError(f"np.{kind}(..., out=...) is not supported on lazy arrays")
        keep = bool(keepdims) if keepdims is not np._NoValue else False
        return from_array(a)._reduce(kind, axis, keep)

    return handler


@dispatch.implements(np.count_nonzero)
def _count_nonzero(a: Any, axis: Any = None, *, keepdims: bool = False) -> Any:
    return from_array(a).count_nonzero(axis=axis, keepdims=keepdims)


@dispatch.implements(np.histogram)
def _histogram(
    a: Any, bins: Any = 10, range: Any = None, density: Any = None, weights: Any = None
) -> Any:
    if weights is not None:
        raise TypeError("np.histogram(..., weights=...) is not supported on lazy arrays")
    return from_array(a).histogram(bins=bins, range=range, density=bool(density))


@dispatch.implements(np.concatenate)
def _concatenate(
    arrays: Sequence[Any],
    axis: int | None = 0,
    out: Any = None,
    dtype: Any = None,
    casting: str = "same_kind",
) -> Any:
    if out is not None or axis is None:
        raise TypeError("np.concatenate on lazy arrays takes neither out= nor axis=None")
    return cast_joined(concatenate(arrays, axis=axis), dtype, casting)


def cast_joined(result: Array, dtype: Any, casting: str) -> Array:
    """The ``dtype=`` and ``casting=`` of np.concatenate, np.vstack and np.hstack:
    ``result`` cast to ``dtype``, or NumPy's TypeError where ``casting`` forbids it."""
    if dtype is None:
        return result
    if not np.can_cast(result.dtype, dtype, casting=casting):  # type: ignore[arg-type]
        raise TypeError(
            f"Cannot cast array data from dtype('{result.dtype}') to dtype('{np.dtype(dtype)}') "
            f"according to the rule '{casting}'"
        )
    return result.astype(dtype)


@dispatch.implements(np.clip)
def _clip(  # noqa: PLR0913 -- np.clip's own signature, for __array_function__
    a: Any,
    a_min: Any = np._NoValue,
    a_max: Any = np._NoValue,
    out: Any = None,
    *,
    min: Any = np._NoValue,
    max: Any = np._NoValue,
    **kw: Any,
) -> Any:
    if out is not None or kw:
        raise TypeError("np.clip on lazy arrays takes neither out= nor ufunc keywords")
    lo = min if a_min is np._NoValue else a_min
    hi = max if a_max is np._NoValue else a_max
    lo = None if lo is np._NoValue else lo
    hi = None if hi is np._NoValue else hi
    return from_array(a).clip(lo, hi)


@dispatch.implements(np.round, np.around)
def _round(a: Any, decimals: int = 0, out: Any = None) -> Any:
    if out is not None:
        raise TypeError("np.round(..., out=...) is not supported on lazy arrays")
    return from_array(a).round(decimals)


@dispatch.implements(np.where)
def _where(condition: Any, x: Any = None, y: Any = None) -> Any:
    return where(condition, x, y)


def dot(a: Any, b: Any) -> Array:
    """``np.dot(a, b)``: ``a @ b``, and ``a * b`` where either is 0-d, as NumPy's (which
    makes a Python number an array first: ``int8 . 2`` is int64, not NEP 50's int8)."""
    if np.ndim(a) == 0 or np.ndim(b) == 0:
        a, b = (v if build.is_array(v) else np.asarray(v) for v in (a, b))
        return np.multiply(a, b)
    return matmul(a, b, np.dot)


@dispatch.implements(np.dot)
def _dot(a: Any, b: Any, out: Any = None) -> Any:
    if out is not None:
        raise TypeError("np.dot(..., out=...) is not supported on lazy arrays")
    return dot(a, b)


@dispatch.implements(np.stack)
def _stack(
    arrays: Sequence[Any],
    axis: int = 0,
    out: Any = None,
    *,
    dtype: Any = None,
    casting: str = "same_kind",
) -> Any:
    if out is not None:
        raise TypeError("np.stack(..., out=...) is not supported on lazy arrays")
    return cast_joined(stack(arrays, axis=axis), dtype, casting)


@dispatch.implements(np.reshape)
def _reshape(a: Any, *args: Any, **kwargs: Any) -> Any:
    shape = kwargs.get("shape", kwargs.get("newshape", args[0] if args else None))
    if kwargs.get("order", "C") != "C":
        raise TypeError("lazy arrays reshape in C order only")
    return from_array(a).reshape(shape)


def _astype(x: Any, dtype: Any, /, *, copy: bool = True, device: Any = None) -> Any:
    return from_array(x).astype(dtype)


@dispatch.implements(np.nansum)
def _nansum(
    a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: Any = False, **kw: Any
) -> Any:
    if out is not None or kw:
        raise TypeError("np.nansum on lazy arrays takes neither out= nor initial=/where=")
    array = from_array(a)
    keep = bool(keepdims) if keepdims is not np._NoValue else False
    if array.dtype.kind not in "fc":
        return array.sum(axis=axis, dtype=dtype, keepdims=keep)
    return where(np.isnan(array), 0, array).sum(axis=axis, dtype=dtype, keepdims=keep)


def _size(array: Array, axis: Any) -> int:
    """``np.size(array, axis)``: a number, as NumPy's, so a row count unknown after a
    mask is counted first (as ``len()`` counts; ``Array._counted_shape``)."""
    np.size(build.shape_only(array._node), axis)  # NumPy's error for the axis
    return int(np.size(array._standin(), axis))


def _along(name: str, default_axis: int | None) -> Callable[..., Any]:
    def handler(a: Any, axis: Any = default_axis, **kwargs: Any) -> Any:
        return from_array(a).along(name, axis, **kwargs)

    return handler


for _kind in ("sum", "prod", "mean", "std", "var", "min", "max", "any", "all"):
    dispatch.implements(getattr(np, _kind))(_reduction_function(_kind))
dispatch.implements(np.amin)(_reduction_function("min"))
dispatch.implements(np.amax)(_reduction_function("max"))
dispatch.implements(np.argmin)(_arg_function("argmin"))
dispatch.implements(np.argmax)(_arg_function("argmax"))
for _name, _axis in (
    ("sort", -1), ("argsort", -1), ("cumsum", None), ("cumprod", None),
    ("nancumsum", None), ("nancumprod", None), ("diff", -1),
):  # fmt: skip
    dispatch.implements(getattr(np, _name))(_along(_name, _axis))
dispatch.implements(np.shape)(lambda a: from_array(a).shape)
# Metadata: a lazy array takes part by its dtype (NumPy 2 promotes arrays by dtype alone).
dispatch.implements(np.result_type)(
    lambda *args: np.result_type(*(a.dtype if build.is_array(a) else a for a in args))
)
dispatch.implements(np.ndim)(lambda a: from_array(a).ndim)
dispatch.implements(np.size)(lambda a, axis=None: _size(from_array(a), axis))
if hasattr(np, "astype"):
    dispatch.implements(np.astype)(_astype)
