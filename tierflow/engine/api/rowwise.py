"""NumPy functions a lazy array runs row by row or as reductions over the rows:
``np.linalg.norm``, ``np.einsum``, ``np.vstack`` / ``np.hstack`` / ``np.column_stack``
and NumPy's nan-reductions (``np.nanmean``, ``np.nanvar``, ``np.nanstd``,
``np.nanmin``, ``np.nanmax``, ``np.nanprod``, ``np.nanargmin``, ``np.nanargmax``;
``np.nansum``, ``np.nancumsum`` and ``np.nancumprod`` are in
:mod:`tierflow.engine.api.functions`).

Two ways, chosen by whether the function reduces over the row axis:

* Within rows (``norm(x, axis=1)``, ``einsum("ij,jk->ik", x, w)``, ``nanmean(x,
  axis=1)``): NumPy's own function on each block, in the block's task
  (:class:`BlockFunction`). The result has the rows of the input and is NumPy's,
  bitwise, warnings included (raised in the worker that ran the block).
* Over the rows (``norm(x, axis=0)``, ``einsum("ij->j", x)``, ``nanmean(x, axis=0)``):
  built from the engine's reductions (float64 accumulation, Chan's merge for the
  variance), finished in memory with NumPy's warnings and NumPy's result for all-NaN
  columns; the result dtype is NumPy's. ``nanvar`` and ``nanstd`` take two passes (the
  mean, then the squares of the deviations from it, as NumPy does); the others one.

The results match NumPy's to the rounding of float64 accumulation (more accurate than
NumPy's own float32 sums), with NumPy's dtypes, shapes and errors.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...operators import reductions as red
from ...operators.types import block_bytes
from .. import graph
from ..graph import Chunked, Value, specs
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

try:
    from numpy.lib.array_utils import normalize_axis_tuple
except ImportError:  # NumPy < 2
    from numpy.core.numeric import normalize_axis_tuple  # type: ignore[no-redef]

__all__ = ["BlockFunction", "BlockFunctionSpec", "on_blocks"]


# -- NumPy's function on each block ----------------------------------------------------


class BlockFunction:
    """``fn(*operands, **kwargs)`` on each block: a row-independent BlockOp.

    ``template`` lists ``fn``'s positional operands: None for the next block,
    :data:`~tierflow.engine.graph.specs.VALUE` for the next value, anything else a constant.
    ``fn`` must give one row per row of its blocks; its dtype and row shape are read from
    ``fn`` on blocks of one zero row, so NumPy's errors (a bad ``ord``, subscripts that
    do not match) are raised when the pipeline is built.
    """

    row_independent = True

    def __init__(  # noqa: PLR0913 -- what the spec holds, and what the node gives
        self,
        fn: Callable[..., Any],
        kwargs: dict[str, Any],
        template: tuple[Any, ...],
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> None:
        self.fn = fn
        self.kwargs = kwargs
        self.template = template
        self.values = tuple(values)
        self.n_inputs = len(dtypes)
        self.in_bytes = sum(
            np.dtype(d).itemsize * math.prod(s) for d, s in zip(dtypes, row_shapes, strict=True)
        )
        zeros = [np.zeros((1, *s), d) for d, s in zip(dtypes, row_shapes, strict=True)]
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            probe = np.asarray(self._call(zeros))
        if probe.ndim == 0 or probe.shape[0] != 1:
            raise ValueError(
                f"{getattr(fn, '__name__', fn)} does not keep the rows: one row in gave shape "
                f"{probe.shape}"
            )
        self.out_dtype = probe.dtype
        self.out_row_shape = tuple(probe.shape[1:])

    def __repr__(self) -> str:
        return f"BlockFunction({getattr(self.fn, '__name__', self.fn)}, {self.kwargs})"

    def _call(self, blocks: Sequence[np.ndarray]) -> Any:
        next_block = iter(blocks)
        next_value = iter(self.values)
        operands = [
            next(next_block) if t is None else next(next_value) if t is specs.VALUE else t
            for t in self.template
        ]
        return self.fn(*operands, **self.kwargs)

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """NumPy's function on the blocks; copied into ``out`` when given."""
        result = np.asarray(self._call(blocks))
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def temp_bytes(self, rows: int) -> int:
        """The result and as much as the inputs again (NumPy's casts and einsum's
        intermediates)."""
        return block_bytes(rows, self.out_row_shape, self.out_dtype) + rows * self.in_bytes


class BlockFunctionSpec(specs.Spec):
    """A NumPy function on each block (see :class:`BlockFunction`), named ``name``."""

    def __init__(
        self, name: str, fn: Callable[..., Any], kwargs: dict[str, Any], template: tuple[Any, ...]
    ) -> None:
        self.name = name
        self.fn = fn
        self.kwargs = kwargs
        self.template = template

    def _fields(self) -> tuple[Any, ...]:
        return (self.name, self.fn, self.kwargs, self.template)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        return BlockFunction(self.fn, self.kwargs, self.template, dtypes, row_shapes, values)

    def label(self) -> str:
        shown = "".join(f", {k}={v!r}" for k, v in self.kwargs.items() if v is not None)
        return f"{self.name}({shown.lstrip(', ')})"


def on_blocks(name: str, fn: Callable[..., Any], operands: Sequence[Any], **kwargs: Any) -> Array:
    """``fn(*operands, **kwargs)`` on each block of the chunked operands (same rows);
    in-memory operands are constants, lazy in-memory results values."""
    nodes = [build.node_of(o) for o in operands]
    chunked = [n for n in nodes if isinstance(n, Chunked)]
    values = tuple(n for n in nodes if isinstance(n, Value))
    template = tuple(
        None if isinstance(n, Chunked) else specs.VALUE if isinstance(n, Value) else n
        for n in nodes
    )
    spec = BlockFunctionSpec(name, fn, kwargs, template)
    return build.wrap(graph.BlockMap(spec, tuple(chunked), values))


def _in_memory(fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Array:
    """``fn`` of in-memory (or lazy in-memory) operands, as a lazy value."""
    nodes = [build.node_of(a) if build.is_array(a) else a for a in args]
    return build.value_apply(fn, *nodes, name=name, **kwargs)


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    return tuple(normalize_axis_tuple(axis, ndim, allow_duplicate=False))


def _keep(keepdims: Any) -> bool:
    return False if keepdims is np._NoValue else bool(keepdims)


def _no_extras(name: str, out: Any = None, **extra: Any) -> None:
    if out is not None:
        raise TypeError(
            f"np.{name}(..., out=...) is not supported on lazy arrays: results are placed by "
            "tierflow; assign the returned array instead"
        )
    given = sorted(k for k, v in extra.items() if v is not np._NoValue and v is not None)
    if given:
        raise TypeError(
            f"np.{name}: {', '.join(given)}= is not supported on lazy arrays; use tw.where to "
            "leave elements out, or compute() first"
        )


def _scalar_or_array(value: np.ndarray) -> Any:
    return value[()] if value.ndim == 0 else value


def _numpy_dtype(
    fn: Callable[..., Any], in_dtype: np.dtype, row_shape: tuple[int, ...], **kw: Any
) -> np.dtype:
    """The dtype NumPy's ``fn`` gives for one row of zeros of ``in_dtype``."""
    sample = np.zeros((1, *(max(n, 1) for n in row_shape)), in_dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.asarray(fn(sample, **kw)).dtype


def _lazy(ufunc: np.ufunc, *operands: Any) -> Array:
    """``ufunc`` of lazy operands, as the lazy array it gives."""
    result = ufunc(*operands)
    assert build.is_array(result)
    return result


def _row_shape(array: Array) -> tuple[int, ...]:
    return tuple(int(n) for n in array.shape[1:])  # type: ignore[arg-type]


def _float_acc(dtype: np.dtype) -> np.dtype:
    """float64 (complex128) for float sums whose result is ``dtype``."""
    return red.accumulator_dtype(np.dtype(dtype))


# -- np.linalg.norm ---------------------------------------------------------------------


@dispatch.implements(np.linalg.norm)
def norm(x: Any, ord: Any = None, axis: Any = None, keepdims: bool = False) -> Any:
    """``np.linalg.norm(x, ord, axis, keepdims)``: within rows on each block; over the
    rows as sums (``ord`` None, 2, 1, a power, ``'fro'``), maxima or minima (``inf``,
    ``-inf``, matrix ``1``/``-1``/``inf``/``-inf``) and counts (``0``) of the rows.
    Matrix 2-norms and the nuclear norm over the rows need singular values: refused."""
    array = from_array(x)
    node = array._node
    if isinstance(node, Value):
        return _in_memory(np.linalg.norm, "norm", array, ord=ord, axis=axis, keepdims=keepdims)
    assert isinstance(node, Chunked)
    ndim = array.ndim
    # NumPy's own errors (the axes, ord for vectors and matrices), on one row of zeros
    dtype = _numpy_dtype(
        np.linalg.norm, array.dtype, node.row_shape, ord=ord, axis=axis, keepdims=keepdims
    )
    if axis is not None and not isinstance(axis, tuple):
        axis = (operator.index(axis),)
    axes = _axes(axis, ndim)
    if 0 not in axes:
        return on_blocks("norm", np.linalg.norm, [array], ord=ord, axis=axis, keepdims=keepdims)
    values = array if array.dtype.kind in "fc" else array.astype(np.float64)
    # NumPy's norm of every value (its square root of re.re + im.im over the raveled x).
    every = ord is None or (ord in ("f", "fro") and ndim == 2) or (ord == 2 and ndim == 1)
    if axis is None and every:
        squares = _squares(values, by_parts=True).sum(
            axis=None, dtype=np.float64, keepdims=keepdims
        )
        return _in_memory(_cast_result, "norm", dtype, _lazy(np.sqrt, squares))
    if len(axes) == 1 or (axis is None and ndim == 1):
        result = _vector_norm(values, ord, axes[0], keepdims)
    elif len(axes) == 2:
        result = _matrix_norm(values, ord, tuple(axis or (0, 1)), keepdims, ndim)
    else:
        raise ValueError("Improper number of dimensions to norm.")
    return _in_memory(_cast_result, "norm", dtype, result)


def _squares(values: Array, by_parts: bool = False) -> Array:
    """``|values|**2`` in float64, as NumPy's norm finds it for complex data:
    ``(conj(x) * x).real``, or ``re**2 + im**2`` with ``by_parts`` (its norm of all
    values). Either way an infinite part beside a NaN part gives NaN, where ``abs(x)``
    would give inf; the first also warns as NumPy's does (``inf - inf`` inside)."""
    if values.dtype.kind == "c":
        wide = values.astype(np.complex128)
        if by_parts:
            re, im = wide.real, wide.imag
            return re * re + im * im
        return (_lazy(np.conjugate, wide) * wide).real
    wide = values.astype(np.float64)
    return wide * wide


def _vector_norm(values: Array, ord: Any, axis: int, keepdims: bool) -> Array:
    if ord is None or ord == 2:
        return _lazy(np.sqrt, _squares(values).sum(axis=axis, keepdims=keepdims))
    if isinstance(ord, str):
        raise ValueError(f"Invalid norm order '{ord}' for vectors")
    magnitude = _lazy(np.abs, values)
    if ord == np.inf:
        return magnitude.max(axis=axis, keepdims=keepdims, initial=0)
    if ord == -np.inf:
        return magnitude.min(axis=axis, keepdims=keepdims)
    if ord == 0:
        return (values != 0).sum(axis=axis, keepdims=keepdims).astype(np.float64)
    if ord == 1:
        return magnitude.sum(axis=axis, dtype=np.float64, keepdims=keepdims)
    power = float(ord)
    total = (magnitude.astype(np.float64) ** power).sum(axis=axis, keepdims=keepdims)
    return total ** (1.0 / power)


def _matrix_norm(
    values: Array, ord: Any, axis: tuple[int, ...], keepdims: bool, ndim: int
) -> Array:
    row_axis, col_axis = (a % ndim for a in axis)
    if row_axis == col_axis:
        raise ValueError("Duplicate axes given.")
    if ord in (2, -2, "nuc"):
        raise ValueError(
            f"np.linalg.norm(x, ord={ord!r}) over the row axis needs the singular values of "
            "the whole matrix, which one pass over row blocks does not give; use "
            "ord='fro', 1 or inf, or compute() first"
        )
    magnitude = _lazy(np.abs, values)
    if ord in (None, "fro", "f"):
        result = _lazy(np.sqrt, _squares(values).sum(axis=(row_axis, col_axis)))
    elif ord in (1, -1):
        sums = magnitude.sum(axis=row_axis, dtype=np.float64)
        after = col_axis - 1 if col_axis > row_axis else col_axis
        result = sums.max(axis=after, initial=0) if ord == 1 else sums.min(axis=after)
    elif ord in (np.inf, -np.inf):
        sums = magnitude.sum(axis=col_axis, dtype=np.float64)
        after = row_axis - 1 if row_axis > col_axis else row_axis
        result = sums.max(axis=after, initial=0) if ord > 0 else sums.min(axis=after)
    else:
        raise ValueError("Invalid norm order for matrices.")
    if keepdims:
        shape = [1 if i in (row_axis, col_axis) else n for i, n in enumerate(values.shape)]
        result = result.reshape(shape)
    return result


# -- np.einsum --------------------------------------------------------------------------


@dispatch.implements(np.einsum)
def einsum(*operands: Any, out: Any = None, dtype: Any = None, **kwargs: Any) -> Any:
    """``np.einsum(subscripts, *operands)`` with lazy operands that share their rows.

    The row axis is each lazy operand's first subscript letter. Kept as the first axis
    of the output, the einsum runs on each block (``"ij,jk->ik"``, ``"ij,ij->i"``); summed
    over, it is a reduction whose partials are the einsum of each block, added in
    float64 (``"ij->j"``, ``"ij,ij->"``, ``"ij,ik->jk"``). Anything else raises
    ValueError saying how to write it."""
    _no_extras("einsum", out)
    kwargs.pop("optimize", None)  # the contraction order is NumPy's on each block
    if not operands or not isinstance(operands[0], str):
        raise TypeError(
            "np.einsum on lazy arrays takes the subscripts as a string ('ij,jk->ik'), not "
            "the sublist form"
        )
    subscripts = operands[0].replace(" ", "")
    arrays = list(operands[1:])
    if dtype is not None:
        kwargs["dtype"] = np.dtype(dtype)
    nodes = [build.node_of(a) for a in arrays]
    if not any(isinstance(n, Chunked) for n in nodes):
        return _in_memory(np.einsum, "einsum", subscripts, *arrays, **kwargs)
    if "..." in subscripts:
        raise ValueError(
            f"np.einsum({subscripts!r}) on a lazy array: spell out every axis instead of "
            "'...' (the row axis must be named)"
        )
    inputs, arrow, output = subscripts.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(arrays):
        raise ValueError(
            f"np.einsum({subscripts!r}): {len(terms)} operand(s) in the subscripts, "
            f"{len(arrays)} given"
        )
    if not arrow:
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    row = _row_letter(subscripts, terms, nodes)
    arrays = [
        from_array(a) if isinstance(n, np.ndarray) and row in t else a
        for a, n, t in zip(arrays, nodes, terms, strict=True)
    ]
    nodes = [build.node_of(a) for a in arrays]
    chunked = [n for n in nodes if isinstance(n, Chunked)]
    if build.line_up_later(chunked):  # different masks, block sizes, or known rows

        def again(xs: list[Array]) -> Any:
            picked = iter(xs)
            return einsum(
                subscripts,
                *(
                    next(picked) if isinstance(n, Chunked) else a
                    for a, n in zip(arrays, nodes, strict=True)
                ),
                **kwargs,
            )

        return build.defer_function(again, chunked, f"einsum({subscripts!r})")
    _refuse_other_rows(subscripts, nodes)
    for n, t in zip(nodes, terms, strict=True):
        if not isinstance(n, Chunked) and row in t:
            raise ValueError(
                f"np.einsum({subscripts!r}): the row axis '{row}' of the lazy operands also "
                f"indexes an in-memory result of shape {build.describe_shape(n.shape)}; only "
                "arrays with the same rows (lazy, or in memory with the rows first) can share it"
            )
    full = f"{inputs}->{output}"
    if row in output:
        if output[0] != row:
            rest = output.replace(row, "")
            raise ValueError(
                f"np.einsum({subscripts!r}) moves the row axis '{row}' to position "
                f"{output.index(row)} of the output; a lazy array keeps its rows first: write "
                f"'{inputs}->{row}{rest}' and move the axis after compute(), or compute() first"
            )
        return on_blocks("einsum", _einsum_rows, arrays, subscripts=full, **kwargs)
    return _einsum_over_rows(full, arrays, nodes, kwargs)


def _refuse_other_rows(subscripts: str, nodes: Sequence[Any]) -> None:
    """NumPy's error for lazy operands whose (known) rows differ: NumPy's own check, on
    zero-strided stand-ins of their shapes (no memory), raises it before any work."""
    rows = {int(n.n_rows) for n in nodes if isinstance(n, Chunked) and n.n_rows is not None}
    if len(rows) < 2:
        return
    if 1 in rows:  # NumPy would broadcast the one row: not over row blocks
        raise ValueError(
            f"np.einsum({subscripts!r}) with an operand of one row and others of "
            f"{max(rows)} broadcasts that row over the others, which is not lazy; "
            "compute() the one-row operand first"
        )
    standins = [
        build.shape_only(n)
        if isinstance(n, Chunked)
        else graph.placeholder(n)
        if isinstance(n, Value)
        else n
        for n in nodes
    ]
    np.einsum(subscripts, *standins)
    raise ValueError(f"np.einsum({subscripts!r}): the arrays have different rows: {sorted(rows)}")


def _row_letter(subscripts: str, terms: Sequence[str], nodes: Sequence[Any]) -> str:
    """The letter of the row axis, shared by every lazy chunked operand."""
    letters = set()
    for term, node in zip(terms, nodes, strict=True):
        if not isinstance(node, Chunked):
            continue
        if not term:
            raise ValueError(f"np.einsum({subscripts!r}): a lazy operand needs subscripts")
        if term.count(term[0]) > 1:
            raise ValueError(
                f"np.einsum({subscripts!r}) repeats the row axis '{term[0]}' within one "
                "operand (a diagonal across rows); compute() first"
            )
        letters.add(term[0])
    if len(letters) > 1:
        raise ValueError(
            f"np.einsum({subscripts!r}): the lazy operands name their row axes "
            f"{', '.join(sorted(letters))}; arrays with the same rows must share one letter "
            "(a product across two row axes would not fit in memory)"
        )
    return letters.pop()


def _einsum_rows(*operands: Any, subscripts: str, **kwargs: Any) -> Any:
    return np.einsum(subscripts, *operands, **kwargs)


def _einsum_partial(
    subscripts: str, template: tuple[Any, ...], kwargs: dict[str, Any], *blocks: np.ndarray
) -> np.ndarray:
    next_block = iter(blocks)
    operands = [next(next_block) if t is None else t for t in template]
    return np.asarray(np.einsum(subscripts, *operands, **kwargs))


def _einsum_over_rows(
    subscripts: str, arrays: Sequence[Any], nodes: Sequence[Any], kwargs: dict[str, Any]
) -> Array:
    if any(isinstance(n, Value) for n in nodes):
        raise ValueError(
            f"np.einsum({subscripts!r}) sums over the rows with a lazy in-memory operand (a "
            "reduction's result); compute() that operand first"
        )
    chunked = tuple(n for n in nodes if isinstance(n, Chunked))
    template = tuple(None if isinstance(n, Chunked) else np.asarray(n) for n in nodes)
    zeros = [np.zeros((1, *n.row_shape), n.dtype) for n in chunked]
    probe = _einsum_partial(subscripts, template, kwargs, *zeros)
    out_dtype = probe.dtype
    acc = _float_acc(out_dtype) if out_dtype.kind in "fc" else out_dtype
    chunk = functools.partial(_einsum_partial, subscripts, template, {**kwargs, "dtype": acc})
    options = red.ReductionOptions(
        n_inputs=len(chunked), out_dtype=out_dtype, out_shape=probe.shape,
        partial_bytes=max(1, probe.size) * acc.itemsize + 64, name="einsum",
    )  # fmt: skip
    finish = functools.partial(_cast_result, out_dtype)
    op = red.Reduction(chunk, np.add, finish, options)
    return build.wrap(graph.Reduce(specs.UserSpec(op, (chunk, np.add, finish)), chunked))


def _cast_result(dtype: np.dtype, partial: Any) -> Any:
    return _scalar_or_array(np.asarray(partial).astype(dtype))


# -- vstack, hstack, column_stack -------------------------------------------------------


@dispatch.implements(np.vstack)
def vstack(tup: Sequence[Any], *, dtype: Any = None, casting: str = "same_kind") -> Any:
    """``np.vstack``: arrays of two or more dimensions one after the other along the
    rows (lazy, nothing copied until computed). A 1-D lazy array would become one
    row: refused."""
    from .functions import cast_joined, concatenate

    items = [from_array(a) for a in _sequence("vstack", tup)]
    for item in items:
        if item.ndim < 2 and isinstance(item._node, Chunked):
            raise ValueError(
                f"np.vstack of a 1-D lazy array of shape {build.describe_shape(item.shape)} would "
                "make its rows one row; stack with np.column_stack (its values as a column) "
                "or np.stack(..., axis=1), or reshape it to (-1, 1) first"
            )
    items = [i if i.ndim >= 2 else _in_memory(np.atleast_2d, "atleast_2d", i) for i in items]
    return cast_joined(concatenate(items, axis=0), dtype, casting)


@dispatch.implements(np.hstack)
def hstack(tup: Sequence[Any], *, dtype: Any = None, casting: str = "same_kind") -> Any:
    """``np.hstack``: 1-D arrays one after the other (along the rows); arrays of two or
    more dimensions side by side along axis 1 (they must have the same rows)."""
    from .functions import cast_joined, concatenate

    items = [from_array(a) for a in _sequence("hstack", tup)]
    axis = 0 if items and items[0].ndim == 1 else 1
    return cast_joined(concatenate(items, axis=axis), dtype, casting)


@dispatch.implements(np.column_stack)
def column_stack(tup: Sequence[Any]) -> Any:
    """``np.column_stack``: 1-D arrays as columns, 2-D arrays as they are, side by side
    (same rows)."""
    from .functions import concatenate

    items = [from_array(a) for a in _sequence("column_stack", tup)]
    columns = [i.reshape(-1, 1) if i.ndim == 1 else i for i in items]
    return concatenate(columns, axis=1)


def _sequence(name: str, tup: Any) -> list[Any]:
    if build.is_array(tup) or not isinstance(tup, (list, tuple)):
        raise TypeError(f"np.{name} takes a sequence of arrays (a list or a tuple)")
    if not tup:
        raise ValueError("need at least one array to concatenate")
    return list(tup)


# -- nan-reductions ---------------------------------------------------------------------


def _nan_setup(name: str, a: Any, axis: Any) -> tuple[Array, bool, bool]:
    """(the array, whether it can hold NaN, whether ``axis`` includes the rows)."""
    array = from_array(a)
    floats = array.dtype.kind in "fc"
    _numpy_dtype(getattr(np, name), array.dtype, _row_shape(array), axis=axis)  # its errors
    if axis is not None and not isinstance(axis, tuple):
        axis = operator.index(axis)
    over_rows = isinstance(array._node, Chunked) and 0 in _axes(axis, array.ndim)
    return array, floats, over_rows


def _within_rows(name: str, fn: Callable[..., Any], array: Array, **kwargs: Any) -> Any:
    """NumPy's ``fn`` itself: on each block, or on an in-memory result."""
    if isinstance(array._node, Value):
        return _in_memory(fn, name, array, **kwargs)
    return on_blocks(name, fn, [array], **kwargs)


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
    _no_extras(name, out, initial=initial, where=where)
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
    _no_extras(name, out)
    keep = _keep(keepdims)
    array, floats, over_rows = _nan_setup(name, a, axis)
    kind = name[3:]
    if not over_rows:
        return _within_rows(name, getattr(np, name), array, axis=axis, keepdims=keep)
    if not floats:
        return array._reduce(kind, axis, keep)
    missing = _lazy(np.isnan, array)
    filled = _fill(array, missing, np.inf if kind == "argmin" else -np.inf)
    found = filled._reduce(kind, axis, keep)
    empty = missing.all(axis=axis, keepdims=keep)
    return _in_memory(_finish_arg, name, found, empty)


def _finish_arg(found: Any, empty: Any) -> Any:
    if np.any(empty):
        raise ValueError("All-NaN slice encountered")
    return _scalar_or_array(np.asarray(found))


@dispatch.implements(np.nanprod)
def nanprod(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: Any = np._NoValue,
    initial: Any = np._NoValue, where: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanprod``: NaN counted as 1."""
    _no_extras("nanprod", out, initial=initial, where=where)
    array, floats, _ = _nan_setup("nanprod", a, axis)
    if floats:
        array = _fill(array, _lazy(np.isnan, array), 1)
    return array.prod(axis=axis, dtype=dtype, keepdims=_keep(keepdims))


@dispatch.implements(np.nanmean)
def nanmean(  # noqa: PLR0913 -- NumPy's signature
    a: Any, axis: Any = None, dtype: Any = None, out: Any = None, keepdims: Any = np._NoValue,
    *, where: Any = np._NoValue,
) -> Any:  # fmt: skip
    """``np.nanmean``: the mean of the values that are not NaN; an all-NaN slice gives
    NaN and NumPy's warning "Mean of empty slice"."""
    _no_extras("nanmean", out, where=where)
    keep = _keep(keepdims)
    array, floats, over_rows = _nan_setup("nanmean", a, axis)
    if not floats:
        return array.mean(axis=axis, dtype=dtype, keepdims=keep)
    _check_inexact(dtype)
    if not over_rows:
        return _within_rows("nanmean", np.nanmean, array, axis=axis, dtype=dtype, keepdims=keep)
    result = _numpy_dtype(np.nanmean, array.dtype, _row_shape(array), dtype=dtype)
    total, count = _nan_sums(array, axis, keep, result)
    return _in_memory(_finish_mean, "nanmean", total, count, dtype=result)


def _check_inexact(dtype: Any) -> None:
    if dtype is not None and not issubclass(np.dtype(dtype).type, np.inexact):
        raise TypeError("If a is inexact, then dtype must be inexact")


def _nan_sums(array: Array, axis: Any, keep: bool, result: np.dtype) -> tuple[Array, Array]:
    """The sums of the values that are not NaN, in float64 for a real ``result`` (of
    complex data: the real parts, as NumPy's sum in a real dtype, with its
    ComplexWarning) and complex128 for a complex one; and their counts."""
    missing = _lazy(np.isnan, array)
    acc = _float_acc(result)
    total = _fill(array, missing, 0).sum(axis=axis, dtype=acc, keepdims=keep)
    count = (~missing).sum(axis=axis, dtype=np.intp, keepdims=keep)
    return total, count


def _finish_mean(total: Any, count: Any, dtype: np.dtype) -> Any:
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.true_divide(total, count)
    if np.any(np.asarray(count) == 0):
        warnings.warn("Mean of empty slice", RuntimeWarning, stacklevel=2)
    return _scalar_or_array(np.asarray(mean).astype(dtype))


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
    _no_extras(name, out, where=where, mean=mean)
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
    result = _numpy_dtype(fn, array.dtype, _row_shape(array), dtype=dtype)
    # The mean of complex data is complex, though its variance is real; NumPy's mean in
    # a real dtype= keeps the real parts (its ComplexWarning), and the deviations from
    # it stay complex.
    real_mean = array.dtype.kind == "c" and dtype is not None and np.dtype(dtype).kind != "c"
    mean_dtype = result if real_mean else np.result_type(array.dtype, result)
    total, count = _nan_sums(array, axis, True, mean_dtype)
    center = _in_memory(_center, "nanmean", total, count)
    missing = _lazy(np.isnan, array)
    deviations = _fill(array - center, missing, 0)
    squares = _squares(deviations).sum(axis=axis, keepdims=keep)
    count = count if keep else (~missing).sum(axis=axis, dtype=np.intp)
    return _in_memory(
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
    return _scalar_or_array(np.asarray(var).astype(dtype))
