"""Products across the rows: the lazy transpose ``x.T``, ``x.T @ y``, ``np.cov`` and
``np.corrcoef`` of the columns.

A chunked array is cut into row blocks, so its transpose cannot be a chunked array: the
rows would become columns no block holds whole. ``x.T`` of a 2-D chunked array is a
:class:`Transposed`: a marker that is valid in one place only, as the left operand of
``@`` (``np.matmul``, ``np.dot``) with an array of the same rows::

    x.T @ y    -> Reduce(CrossProduct, x, y)   [k, m], one pass over both
    x.T @ x    -> Reduce(CrossProduct, x)      [k, k], each block multiplied once

Used any other way, it raises a TypeError that says what to write instead. A 1-D
array's transpose is itself, as in NumPy, and an in-memory value transposes lazily.

``np.cov(x, rowvar=False)`` and ``np.corrcoef`` reduce the columns' co-moments in one
pass (:class:`~tierflow.operators.crossprod.CoMoments`). ``rowvar=True`` (NumPy's
default) on an ``(N, k)`` array asks for an ``N x N`` matrix: refused unless ``N`` is
small, since the answer itself would not fit.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ...operators import crossprod
from .. import graph
from ..graph import Chunked, Value, specs
from ..graph.specs import Dtypes, Shapes, Values
from . import build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["Transposed", "corrcoef", "cov", "transpose"]

SMALL_ROWVAR = 2048  # rows up to which np.cov(x) of a chunked (N, k) array is an N x N matrix


@dataclass(frozen=True)
class CrossSpec(specs.ReduceSpec):
    """``x.T @ y`` (two inputs) or ``x.T @ x`` (one)."""

    symmetric: bool

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return crossprod.CrossProduct(list(dtypes), list(row_shapes), symmetric=self.symmetric)

    def label(self) -> str:
        return "x.T @ x" if self.symmetric else "x.T @ y"


@dataclass(frozen=True)
class CoMomentSpec(specs.ReduceSpec):
    """The covariance of the columns of one or two arrays (``dtype`` None: NumPy's)."""

    ddof: int
    dtype: np.dtype | None

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return crossprod.CoMoments(list(dtypes), list(row_shapes), ddof=self.ddof, dtype=self.dtype)

    def label(self) -> str:
        return f"cov(rowvar=False, ddof={self.ddof})"


class TransposeError(TypeError, AttributeError):
    """A use of a transposed chunked array that is not lazy. An AttributeError too, so
    that ``hasattr(x.T, name)`` is False, as duck-typing libraries (xarray) ask it."""


def _refuse(what: str, instead: str) -> NoReturn:
    raise TransposeError(
        f"x.T is only lazy as the left operand of @ (np.matmul, np.dot) with an array of the "
        f"same rows, as in x.T @ y or x.T @ x, or reduced over the rows it moved (np.sum, "
        f"np.nanquantile... with that axis); {what} is not: {instead}"
    )


# Functions of one array that reduce over ``axis``: on a transpose that moved the rows,
# run on the array itself over the same axes, the result's axes put in the transpose's
# order (xarray's quantile moves the reduced dimension last, then reduces it).
_REDUCING = frozenset(
    getattr(np, name)
    for name in (
        "sum", "prod", "mean", "std", "var", "min", "max", "amin", "amax", "any", "all",
        "nansum", "nanprod", "nanmean", "nanstd", "nanvar", "nanmin", "nanmax",
        "median", "nanmedian", "quantile", "nanquantile", "percentile", "nanpercentile",
        "count_nonzero", "argmin", "argmax", "nanargmin", "nanargmax",
    )
)  # fmt: skip


class Transposed:
    """A chunked array with its axes in another order where the row axis is not first:
    ``x.T`` of an ``(N, k)`` array, or ``x.transpose(1, 2, 0)``. Lazy as ``x.T @ y``, in
    a reduction over the axis the rows moved to (and any others:
    ``np.nanquantile(x.transpose(1, 2, 0), q, axis=-1)`` is ``np.nanquantile(x, q,
    axis=0)`` with its axes in the transpose's order), and transposed back; every other
    use says what to write (see the module docstring). ``shape``, ``ndim`` and
    ``dtype`` are the transpose's; ``.T`` of a 2-D one is ``x``."""

    __array_priority__ = 100

    def __init__(self, array: Array, order: tuple[int, ...] | None = None) -> None:
        self._array = array
        self._order = tuple(reversed(range(array.ndim))) if order is None else tuple(order)

    @property
    def T(self) -> Any:
        """The transpose of this (the array itself for a 2-D ``x.T``)."""
        return self.transpose()

    @property
    def shape(self) -> tuple[int | None, ...]:
        """The transposed shape (``None`` for an unknown row count)."""
        return tuple(self._array.shape[k] for k in self._order)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return self._array.ndim

    @property
    def dtype(self) -> np.dtype:
        """The array's dtype."""
        return self._array.dtype

    def __repr__(self) -> str:
        return f"<transpose of {self._array!r}: lazy only as x.T @ y>"

    def transpose(self, *axes: Any) -> Any:
        """The axes in another order: the array itself, or a transpose of it."""
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            axes = () if axes[0] is None else tuple(axes[0])
        if not axes:
            axes = tuple(reversed(range(self.ndim)))
        np.transpose(np.empty((0,) * self.ndim), axes)  # NumPy's errors for the axes
        order = tuple(self._order[operator.index(a) % self.ndim] for a in axes)
        return transpose(self._array, order)

    def _reduce(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` reducing this transpose: on the array, then the result's axes put
        in this transpose's order (see the class docstring)."""
        import inspect

        bound = inspect.signature(func).bind(*args, **kwargs)
        first = next(iter(bound.arguments))
        axis = bound.arguments.get("axis")
        ndim = self.ndim
        given: tuple[Any, ...] = (
            tuple(range(ndim)) if axis is None else ((axis,) if np.isscalar(axis) else tuple(axis))
        )
        axes = tuple(operator.index(a) % ndim for a in given)
        mine = tuple(self._order[a] for a in axes)
        if 0 not in mine:
            _refuse(
                f"np.{func.__name__} over axes {axes} of the transpose, which keep its rows",
                "reduce x over those axes, then transpose",
            )
        bound.arguments[first] = self._array
        if axis is not None:
            bound.arguments["axis"] = mine if not np.isscalar(axis) else mine[0]
        result = func(*bound.args, **bound.kwargs)
        if axis is None and not bound.arguments.get("keepdims", False):
            return result
        if bound.arguments.get("keepdims", False):
            kept = list(self._order)
        else:
            rest = [k for k in range(ndim) if k not in mine]
            kept = [rest.index(self._order[v]) for v in range(ndim) if v not in axes]
        extra = np.ndim(result) - len(kept)  # a quantile's axis, first
        order = (*range(extra), *(extra + k for k in kept))
        return np.transpose(result, order) if order != tuple(range(len(order))) else result

    # -- the one valid use ----------------------------------------------------------

    def __matmul__(self, other: Any) -> Array:
        return cross(self._array, other)

    def __rmatmul__(self, other: Any) -> NoReturn:
        _refuse(
            "w @ x.T (the right operand)",
            "write (x @ w.T).T for an in-memory w, or compute() x first",
        )

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if ufunc is np.matmul and method == "__call__" and len(inputs) == 2:
            if kwargs.get("out") is not None:
                raise TypeError("np.matmul(x.T, y, out=...) is not supported on lazy arrays")
            if inputs[0] is self:
                return cross(self._array, inputs[1])
            self.__rmatmul__(inputs[0])
        _refuse(
            f"np.{ufunc.__name__}{'' if method == '__call__' else '.' + method}",
            "apply it to x before transposing (e.g. (x + 1).T @ y), or compute() first",
        )

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        name = getattr(func, "__name__", str(func))
        if func in (np.dot, np.matmul) and len(args) >= 2:
            if kwargs.get("out") is not None or len(args) > 2:
                raise TypeError(f"np.{name}(x.T, y, out=...) is not supported on lazy arrays")
            if args[0] is self:
                return cross(self._array, args[1])
            self.__rmatmul__(args[0])
        if func is np.transpose:
            return self.transpose(*(a for a in args[1:] if a is not None), *kwargs.values())
        if func is np.moveaxis:
            return self.transpose(_moved(self.ndim, *args[1:], **kwargs))
        if func in _REDUCING:
            return self._reduce(func, args, kwargs)
        _refuse(
            f"np.{name}(x.T, ...)",
            "call it on x with the axes swapped (x.T's axis 0 is x's axis 1), or compute() first",
        )

    # -- everything else says what to do ----------------------------------------------

    def __array__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(
            "converting it to a NumPy array",
            "use x.compute().T, or keep x.T as the left operand of @",
        )

    def compute(self, **options: Any) -> NoReturn:
        """Refused: see the module docstring."""
        _refuse("x.T.compute()", "use x.compute().T (x must fit in memory)")

    def persist(self, **options: Any) -> NoReturn:
        """Refused: see the module docstring."""
        _refuse("x.T.persist()", "persist x and transpose where it is multiplied")

    def __getitem__(self, key: Any) -> NoReturn:
        _refuse("indexing x.T", "index x with the axes swapped, e.g. x[:, 0] for x.T[0]")

    def __iter__(self) -> NoReturn:
        _refuse("iterating over x.T", "iterate over the columns x[:, j], or compute() first")

    def __len__(self) -> NoReturn:
        _refuse("len(x.T)", f"x.T has shape {build.describe_shape(self.shape)}")

    def __bool__(self) -> NoReturn:
        _refuse("the truth value of x.T", "compute() first")

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__"):
            raise AttributeError(name)
        _refuse(
            f"x.T.{name}",
            f"use x.{name} with the axes swapped (x.T's axis 0 is x's axis 1), or compute() first",
        )


def _binary_refusal(symbol: str) -> Callable[..., NoReturn]:
    def refuse(self: Transposed, other: Any) -> NoReturn:
        _refuse(f"x.T {symbol} ...", f"write (x {symbol} ...).T @ y, or compute() first")

    return refuse


for _name, _symbol in {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%",
    "pow": "**", "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
}.items():  # fmt: skip
    setattr(Transposed, f"__{_name}__", _binary_refusal(_symbol))
    if _name not in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(Transposed, f"__r{_name}__", _binary_refusal(_symbol))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(
        Transposed, f"__{_name}__", lambda self, _n=_name: _refuse(f"{_n}(x.T)", "apply it to x")
    )
Transposed.__hash__ = object.__hash__  # type: ignore[method-assign]


@dispatch.method("transpose")
def transpose(array: Array, axes: Any = None) -> Any:
    """``x.T`` / ``x.transpose(axes)``: a :class:`Transposed` for a chunked 2-D array;
    the array itself for 1-D; a block map when the row axis stays first; a lazy value
    for an in-memory value. Other axes orders raise a TypeError that says why."""
    node = array._node
    ndim = array.ndim
    if axes is None:
        order = tuple(reversed(range(ndim)))
    else:
        np.transpose(build.shape_only(node), axes)  # NumPy's errors for the axes
        order = tuple(operator.index(a) % ndim if ndim else operator.index(a) for a in axes)
    if isinstance(node, Value):
        return build.value_apply(np.transpose, node, axes=order, name="transpose")
    if order == tuple(range(ndim)):
        return array
    if order[0] == 0:
        row_order = tuple(a - 1 for a in order[1:])
        row_shape = tuple(int(array.shape[a]) for a in order[1:])  # type: ignore[arg-type]
        return array.map_blocks(
            np.transpose,
            dtype=array.dtype,
            row_shape=row_shape,
            axes=(0, *(a + 1 for a in row_order)),
        )
    return Transposed(array, order)


def _moved(ndim: int, source: Any, destination: Any) -> tuple[int, ...]:
    """The axes order of ``np.moveaxis(a, source, destination)`` for ``a`` of ``ndim``
    axes: NumPy's own (and its errors), on a stand-in whose axis ``k`` has length
    ``k + 2`` and no values."""
    standin = np.broadcast_to(np.empty(()), tuple(range(2, ndim + 2)))
    return tuple(n - 2 for n in np.moveaxis(standin, source, destination).shape)


@dispatch.implements(np.moveaxis)
def moveaxis(a: Any, source: Any, destination: Any) -> Any:
    """``np.moveaxis``: lazy as the transpose it is (``x.transpose(order)``)."""
    array = from_array(a)
    return transpose(array, _moved(array.ndim, source, destination))


def _refuse_other_rows(x: Chunked, y: Chunked) -> None:
    """NumPy's error for ``x.T @ y`` with rows that differ (known rows only): NumPy's
    own check, on stand-ins of the shapes that hold no data."""
    if x.n_rows != y.n_rows:
        np.matmul(build.shape_only(x).T, build.shape_only(y))
        raise ValueError(f"x.T @ y: the arrays have different rows: {x.n_rows} and {y.n_rows}")


def cross(x: Array, other: Any) -> Array:
    """``x.T @ other`` for a chunked ``(N, k)`` ``x`` and ``other`` of shape ``(N,)`` or
    ``(N, m)`` (lazy, or in memory): a reduction over the rows giving ``(k,)`` or
    ``(k, m)`` in ``np.matmul``'s dtype."""
    if isinstance(other, Transposed):
        _refuse("x.T @ y.T", "write (y @ x).T")
    y = from_array(other)
    node, ynode = x._node, y._node
    assert isinstance(node, Chunked)
    if isinstance(ynode, Value):
        if ynode.ndim == 0 or ynode.shape[0] != node.n_rows:
            _shape_error(node, ynode)
        raise TypeError(
            "x.T @ w with w a lazy in-memory value (a reduction's result) of x's rows is not "
            "supported; compute() w first, or use a chunked array for w"
        )
    assert isinstance(ynode, Chunked)
    if ynode.ndim not in (1, 2):
        _shape_error(node, ynode)
    if build.line_up_later([node, ynode]):  # different masks, block sizes, or known rows
        return build.defer_function(lambda xy: cross(xy[0], xy[1]), [node, ynode], "x.T @ y")
    _refuse_other_rows(node, ynode)
    if ynode.ident == node.ident:
        return build.wrap(graph.Reduce(CrossSpec(symmetric=True), (node,)))
    return build.wrap(graph.Reduce(CrossSpec(symmetric=False), (node, ynode)))


def _shape_error(x: Chunked, y: Any) -> NoReturn:
    k = x.shape[1]
    raise ValueError(
        f"x.T @ y: x.T has shape {build.describe_shape((k, x.n_rows))} and y has shape "
        f"{build.describe_shape(y.shape)}; y must be 1-D or 2-D with x's {x.n_rows} rows"
    )


# -- np.cov and np.corrcoef -------------------------------------------------------------


def _variables(a: Any, rowvar: bool, name: str) -> Array:
    """``a`` as an array whose columns are the variables, or a refusal naming the fix."""
    array = from_array(a)
    if array.ndim > 2:
        raise ValueError(
            f"m has more than 2 dimensions: {name} of an array of shape "
            f"{build.describe_shape(array.shape)}"
        )
    if array.ndim == 2 and rowvar:
        rows = array.shape[0]
        if isinstance(array._node, Chunked) and (rows is None or rows > SMALL_ROWVAR):
            raise ValueError(
                f"{name}(x) with rowvar=True (NumPy's default) takes each of x's "
                f"{rows if rows is not None else 'unknown number of'} rows as a variable and "
                f"gives a {rows if rows is not None else 'N'} x "
                f"{rows if rows is not None else 'N'} matrix; for the columns of a tall "
                f"array pass rowvar=False, or compute() first"
            )
        return _small_transpose(array)
    return array


def _small_transpose(array: Array) -> Array:
    node = array._node
    if isinstance(node, Chunked):
        node = graph.Reduce(specs.CollectSpec(), (node,))
    return build.value_apply(np.transpose, node, name="transpose")


@dispatch.implements(np.cov)
def cov(  # noqa: PLR0913 -- np.cov's own signature
    m: Any,
    y: Any = None,
    rowvar: bool = True,
    bias: bool = False,
    ddof: int | None = None,
    fweights: Any = None,
    aweights: Any = None,
    *,
    dtype: Any = None,
) -> Array:
    """``np.cov(m, y, rowvar=False, ...)`` of the columns of lazy arrays: one pass,
    float64 co-moments merged with Chan's update. ``fweights``/``aweights`` are not
    lazy (TypeError); ``rowvar=True`` on a tall 2-D array is refused (ValueError)."""
    if fweights is not None or aweights is not None:
        raise TypeError(
            "np.cov(..., fweights=/aweights=) is not supported on lazy arrays; compute() first"
        )
    if ddof is not None and ddof != int(ddof):
        raise ValueError("ddof must be integer")
    ddof = (0 if bias else 1) if ddof is None else int(ddof)
    originals = [from_array(a) for a in (m, y) if a is not None]
    first = originals[0]
    if first.ndim == 2 and first.shape[0 if rowvar else 1] == 0:
        # No variables in m: NumPy's empty matrix, before it looks at y or the rows.
        return build.wrap(graph.Const(np.array([]).reshape(0, 0)))
    in_memory = all(isinstance(a._node, Value) for a in originals)
    # NumPy reads a one-row 2-D array as one variable even with rowvar=False.
    if in_memory or any(a.ndim == 2 and a.shape[0] == 1 for a in originals):
        return build.value_apply(
            lambda *v: np.cov(*v, rowvar=rowvar, ddof=ddof, dtype=dtype),  # type: ignore[call-overload]
            *(a._node for a in originals),
            name="cov",
        )
    parts = [_variables(a, rowvar, "np.cov") for a in originals]
    return _comoments([_chunked(p) for p in parts], ddof, dtype)


def _comoments(nodes: list[Chunked], ddof: int, dtype: Any) -> Array:
    """The covariance of the columns of ``nodes`` (the variables as columns)."""
    if len(nodes) == 2 and build.line_up_later(nodes):
        return build.defer_function(
            lambda xy: _comoments([a._node for a in xy], ddof, dtype),
            nodes,
            "cov",
        )
    if len(nodes) == 2 and nodes[0].n_rows != nodes[1].n_rows:
        raise ValueError(
            "all the input array dimensions except for the concatenation axis must match "
            f"exactly, but along dimension 1, the array at index 0 has size {nodes[0].n_rows} "
            f"and the array at index 1 has size {nodes[1].n_rows}"
        )
    return build.wrap(
        graph.Reduce(CoMomentSpec(ddof, None if dtype is None else np.dtype(dtype)), tuple(nodes))
    )


def _chunked(array: Array) -> Chunked:
    """``array``'s chunked node, an in-memory value computed and chunked."""
    node = array._node if isinstance(array._node, Chunked) else from_array(array.compute())._node
    assert isinstance(node, Chunked)
    return node


def _correlate(c: np.ndarray) -> np.ndarray:
    """NumPy's corrcoef from a covariance matrix (the same steps, the same warnings)."""
    try:
        d = np.diag(c)
    except ValueError:
        # scalar covariance: nan if incorrect value (nan, inf, 0), 1 otherwise
        return c / c
    stddev = np.sqrt(d.real)
    c = c / stddev[:, None]
    c = c / stddev[None, :]
    np.clip(c.real, -1, 1, out=c.real)
    if np.iscomplexobj(c):
        np.clip(c.imag, -1, 1, out=c.imag)
    return c


@dispatch.implements(np.corrcoef)
def corrcoef(  # noqa: PLR0913 -- np.corrcoef's own signature
    x: Any,
    y: Any = None,
    rowvar: bool = True,
    bias: Any = np._NoValue,
    ddof: Any = np._NoValue,
    *,
    dtype: Any = None,
) -> Array:
    """``np.corrcoef(x, y, rowvar=False)`` of the columns of lazy arrays: the covariance
    pass of :func:`cov`, then NumPy's normalisation in memory."""
    c = cov(x, y, rowvar=rowvar, dtype=dtype)
    return build.value_apply(_correlate, c._node, name="corrcoef")


@dispatch.implements(np.transpose)
def _transpose(a: Any, axes: Any = None) -> Any:
    return transpose(from_array(a), axes)
