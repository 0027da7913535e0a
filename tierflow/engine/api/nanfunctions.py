"""NumPy's nan-reductions on lazy arrays: ``np.nanmean``, ``np.nanvar``,
``np.nanstd``, ``np.nanmin``, ``np.nanmax``, ``np.nanprod``, ``np.nanargmin``,
``np.nanargmax`` (``np.nansum``, ``np.nancumsum`` and ``np.nancumprod`` are in
:mod:`.functions`).

Within rows (``axis=1``), NumPy's own function on each block; over the rows, built from
the engine's reductions (float64 accumulation, Chan's merge for the variance) and
finished in memory with NumPy's warnings and NumPy's result for all-NaN columns.
``nanvar`` and ``nanstd`` take two passes (the mean, then the squares of the deviations
from it, as NumPy does); the others one. The results match NumPy's to the rounding of
float64 accumulation, with NumPy's dtypes, shapes and errors.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph import Chunked, Value
from . import blockwise, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["nanargmax", "nanargmin", "nanmax", "nanmean", "nanmin", "nanprod", "nanstd", "nanvar"]


# -- nan-reductions ---------------------------------------------------------------------


def _keep(keepdims: Any) -> bool:
    return False if keepdims is np._NoValue else bool(keepdims)


def _row_shape(array: Array) -> tuple[int, ...]:
    return tuple(int(n) for n in array.shape[1:])  # type: ignore[arg-type]


def _nan_setup(name: str, a: Any, axis: Any) -> tuple[Array, bool, bool]:
    """(the array, whether it can hold NaN, whether ``axis`` includes the rows)."""
    array = from_array(a)
    floats = array.dtype.kind in "fc"
    blockwise.numpy_dtype(
        getattr(np, name), array.dtype, _row_shape(array), axis=axis
    )  # its errors
    if axis is not None and not isinstance(axis, tuple):
        axis = operator.index(axis)
    over_rows = isinstance(array._node, Chunked) and 0 in blockwise.axes(axis, array.ndim)
    return array, floats, over_rows


def _within_rows(name: str, fn: Callable[..., Any], array: Array, **kwargs: Any) -> Any:
    """NumPy's ``fn`` itself: on each block, or on an in-memory result."""
    if isinstance(array._node, Value):
        return blockwise.in_memory(fn, name, array, **kwargs)
    return blockwise.on_blocks(name, fn, [array], **kwargs)


@dispatch.implements(np.nanmin)
def nanmin(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, out: Any = None, keepdims: Any = np._NoValue,
    initial: Any = np._NoValue, where: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanmin``: NaN left out; an all-NaN slice gives NaN and NumPy's warning."""
    return _nan_extreme("nanmin", a, axis, out, keepdims, initial, where)


@dispatch.implements(np.nanmax)
def nanmax(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, out: Any = None, keepdims: Any = np._NoValue,
    initial: Any = np._NoValue, where: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanmax``: NaN left out; an all-NaN slice gives NaN and NumPy's warning."""
    return _nan_extreme("nanmax", a, axis, out, keepdims, initial, where)


def _nan_extreme(  # noqa: PLR0913 -- NumPy's signature
    name: str, a: Any, axis: Any, out: Any, keepdims: Any, initial: Any, where: Any
) -> Any:
    blockwise.no_extras(name, out, initial=initial, where=where)
    keep = _keep(keepdims)
    array, _, over_rows = _nan_setup(name, a, axis)
    fn = np.nanmin if name == "nanmin" else np.nanmax
    if not over_rows:
        return _within_rows(name, fn, array, axis=axis, keepdims=keep)
    # np.fmin / np.fmax over the rows, as NumPy runs them (its errors over no rows too)
    return array._reduce(name, axis, keep)


def _fill(array: Array, missing: Array, value: Any) -> Array:
    from .functions import where

    return where(missing, np.asarray(value, array.dtype), array)


@dispatch.implements(np.nanargmin)
def nanargmin(a: Any, axis: Any = None, out: Any = None, *, keepdims: Any = np._NoValue) -> Any:
    """``np.nanargmin``: NaN left out; an all-NaN slice raises NumPy's ValueError when
    computed."""
    return _nan_arg("nanargmin", a, axis, out, keepdims)


@dispatch.implements(np.nanargmax)
def nanargmax(a: Any, axis: Any = None, out: Any = None, *, keepdims: Any = np._NoValue) -> Any:
    """``np.nanargmax``: NaN left out; an all-NaN slice raises NumPy's ValueError when
    computed."""
    return _nan_arg("nanargmax", a, axis, out, keepdims)


def _nan_arg(name: str, a: Any, axis: Any, out: Any, keepdims: Any) -> Any:
    blockwise.no_extras(name, out)
    keep = _keep(keepdims)
    array, floats, over_rows = _nan_setup(name, a, axis)
    kind = name[3:]
    if not over_rows:
        return _within_rows(name, getattr(np, name), array, axis=axis, keepdims=keep)
    if not floats:
        return array._reduce(kind, axis, keep)
    missing = blockwise.lazy(np.isnan, array)
    filled = _fill(array, missing, np.inf if kind == "argmin" else -np.inf)
    found = filled._reduce(kind, axis, keep)
    empty = missing.all(axis=axis, keepdims=keep)
    return blockwise.in_memory(_finish_arg, name, found, empty)


def _finish_arg(found: Any, empty: Any) -> Any:
    if np.any(empty):
        raise ValueError("All-NaN slice encountered")
    return blockwise.scalar_or_array(np.asarray(found))


@dispatch.implements(np.nanprod)
def nanprod(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: Any = np._NoValue,
    initial: Any = np._NoValue, where: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanprod``: NaN counted as 1."""
    blockwise.no_extras("nanprod", out, initial=initial, where=where)
    array, floats, _ = _nan_setup("nanprod", a, axis)
    if floats:
        array = _fill(array, blockwise.lazy(np.isnan, array), 1)
    return array.prod(axis=axis, dtype=dtype, keepdims=_keep(keepdims))


@dispatch.implements(np.nanmean)
def nanmean(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: Any = np._NoValue,
    *, where: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanmean``: the mean of the values that are not NaN; an all-NaN slice gives
    NaN and NumPy's warning "Mean of empty slice"."""
    blockwise.no_extras("nanmean", out, where=where)
    keep = _keep(keepdims)
    array, floats, over_rows = _nan_setup("nanmean", a, axis)
    if not floats:
        return array.mean(axis=axis, dtype=dtype, keepdims=keep)
    _check_inexact(dtype)
    if not over_rows:
        return _within_rows("nanmean", np.nanmean, array, axis=axis, dtype=dtype, keepdims=keep)
    result = blockwise.numpy_dtype(np.nanmean, array.dtype, _row_shape(array), dtype=dtype)
    total, count = _nan_sums(array, axis, keep, result)
    return blockwise.in_memory(_finish_mean, "nanmean", total, count, dtype=result)


def _check_inexact(dtype: Any) -> None:
    if dtype is not None and not issubclass(np.dtype(dtype).type, np.inexact):
        raise TypeError("If a is inexact, then dtype must be inexact")


def _nan_sums(array: Array, axis: Any, keep: bool, result: np.dtype) -> tuple[Array, Array]:
    """The sums of the values that are not NaN, in float64 for a real ``result`` (of
    complex data: the real parts, as NumPy's sum in a real dtype, with its
    ComplexWarning) and complex128 for a complex one; and their counts."""
    missing = blockwise.lazy(np.isnan, array)
    acc = blockwise.float_acc(result)
    total = _fill(array, missing, 0).sum(axis=axis, dtype=acc, keepdims=keep)
    count = (~missing).sum(axis=axis, dtype=np.intp, keepdims=keep)
    return total, count


def _finish_mean(total: Any, count: Any, dtype: np.dtype) -> Any:
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.true_divide(total, count)
    if np.any(np.asarray(count) == 0):
        warnings.warn("Mean of empty slice", RuntimeWarning, stacklevel=2)
    return blockwise.scalar_or_array(np.asarray(mean).astype(dtype))


@dispatch.implements(np.nanvar)
def nanvar(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, dtype: Any = None, out: Any = None, ddof: Any = 0,
    keepdims: Any = np._NoValue, *, where: Any = np._NoValue, mean: Any = np._NoValue,
    correction: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanvar``: the variance of the values that are not NaN, in two passes (their
    mean, then the squares of the deviations from it); a slice with ``ddof`` or fewer
    values gives NaN and NumPy's warning "Degrees of freedom <= 0 for slice."."""
    return _nan_moment("nanvar", a, axis, dtype, out, ddof, keepdims, where, mean, correction)


@dispatch.implements(np.nanstd)
def nanstd(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, dtype: Any = None, out: Any = None, ddof: Any = 0,
    keepdims: Any = np._NoValue, *, where: Any = np._NoValue, mean: Any = np._NoValue,
    correction: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanstd``: the square root of :func:`nanvar`."""
    return _nan_moment("nanstd", a, axis, dtype, out, ddof, keepdims, where, mean, correction)


def _nan_moment(  # noqa: PLR0913 -- NumPy's signature
    name: str, a: Any, axis: Any, dtype: Any, out: Any, ddof: Any, keepdims: Any,
    where: Any, mean: Any, correction: Any,
) -> Any:  # fmt: skip
    blockwise.no_extras(name, out, where=where, mean=mean)
    if correction is not np._NoValue:
        if ddof != 0:
            raise ValueError("ddof and correction can't be provided simultaneously.")
        ddof = correction
    keep = _keep(keepdims)
    array, floats, over_rows = _nan_setup(name, a, axis)
    if not floats:
        plain = array.var if name == "nanvar" else array.std
        return plain(axis=axis, dtype=dtype, ddof=ddof, keepdims=keep)
    _check_inexact(dtype)
    fn = np.nanvar if name == "nanvar" else np.nanstd
    if not over_rows:
        return _within_rows(name, fn, array, axis=axis, dtype=dtype, ddof=ddof, keepdims=keep)
    result = blockwise.numpy_dtype(fn, array.dtype, _row_shape(array), dtype=dtype)
    # The mean of complex data is complex, though its variance is real; NumPy's mean in
    # a real dtype= keeps the real parts (its ComplexWarning), and the deviations from
    # it stay complex.
    real_mean = array.dtype.kind == "c" and dtype is not None and np.dtype(dtype).kind != "c"
    mean_dtype = result if real_mean else np.result_type(array.dtype, result)
    total, count = _nan_sums(array, axis, True, mean_dtype)
    center = blockwise.in_memory(_center, "nanmean", total, count)
    missing = blockwise.lazy(np.isnan, array)
    deviations = _fill(array - center, missing, 0)
    squares = blockwise.squares(deviations).sum(axis=axis, keepdims=keep)
    count = count if keep else (~missing).sum(axis=axis, dtype=np.intp)
    return blockwise.in_memory(
        _finish_moment, name, squares, count, ddof=ddof, root=name == "nanstd", dtype=result
    )


def _center(total: Any, count: Any) -> Any:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.true_divide(total, count)


def _finish_moment(squares: Any, count: Any, ddof: Any, root: bool, dtype: np.dtype) -> Any:
    dof = np.asarray(count) - ddof
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.true_divide(squares, dof)
    bad = dof <= 0
    if np.any(bad):
        warnings.warn("Degrees of freedom <= 0 for slice.", RuntimeWarning, stacklevel=2)
        var = np.where(bad, np.nan, var)
    if root:
        var = np.sqrt(var)
    return blockwise.scalar_or_array(np.asarray(var).astype(dtype))
