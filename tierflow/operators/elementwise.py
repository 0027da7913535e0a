"""Elementwise expressions over row blocks: representation, dtype inference, reference evaluation.

An expression is a small tree of nodes (a DAG when a node is used twice, which is then
evaluated once):

* :class:`Input` ``(i)`` — the ``i``-th block input. All block inputs of an expression have
  the same number of rows and the same number of dimensions; their trailing axes
  broadcast against each other the NumPy way.
* :class:`Const` — a Python or NumPy scalar, or an in-memory array that broadcasts against
  the trailing axes of a block (a row vector of column means has shape ``(k,)`` or
  ``(1, k)``).
* :class:`Apply` — any single-output elementwise NumPy ufunc (``np.add``, ``np.power``,
  comparisons, ``np.invert``, ...) with its ``dtype`` / ``casting`` / ``signature``
  keywords; and :class:`Where`, :class:`Clip`, :class:`AsType`, :class:`Round`.

The meaning of an expression is plain NumPy evaluation, :func:`evaluate`: the same calls,
in the same order, on whole blocks. That fixes every result dtype, NEP 50 weak Python
scalars included (``float32_block * 2.0`` stays float32; ``uint8_block + 300`` raises
OverflowError). :func:`infer` and :func:`result_dtype` get NumPy's own resolution by
evaluating the expression on zero-row arrays, so such errors surface when the pipeline
is built, not halfway through it. The fused, cache-blocked evaluation lives in
:mod:`tierflow.operators.fused`.

>>> result_dtype(call(np.sqrt, Input(0) * 2.0 + 1), [np.float32])
dtype('float32')
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dag import postorder

__all__ = [
    "Apply",
    "AsType",
    "Clip",
    "Const",
    "Expr",
    "Inferred",
    "Input",
    "Round",
    "Where",
    "astype",
    "call",
    "clip",
    "evaluate",
    "infer",
    "input_count",
    "result_dtype",
    "round_",
    "token",
    "walk",
    "where",
]

# Keywords of a ufunc call that keep it elementwise and row-independent. ``out`` and
# ``where`` are left out on purpose: the kernel owns its outputs, and a ``where=`` mask
# leaves unwritten elements uninitialised.
UFUNC_KEYWORDS = frozenset({"dtype", "casting", "signature"})


class Expr:
    """Base of expression nodes; arithmetic operators build :class:`Apply` nodes.

    Comparisons are not overloaded (``==`` keeps meaning identity, so nodes hash and
    compare as objects); write ``call(np.less, a, b)``.
    """

    # Makes ``np.float32(2) * expr`` call ``Expr.__rmul__`` instead of NumPy trying to
    # build an object array around the node.
    __array_ufunc__ = None

    def children(self) -> tuple[Expr, ...]:
        """The operand nodes, in call order."""
        return ()

    def __add__(self, other: Any) -> Apply:
        return call(np.add, self, other)

    def __radd__(self, other: Any) -> Apply:
        return call(np.add, other, self)

    def __sub__(self, other: Any) -> Apply:
        return call(np.subtract, self, other)

    def __rsub__(self, other: Any) -> Apply:
        return call(np.subtract, other, self)

    def __mul__(self, other: Any) -> Apply:
        return call(np.multiply, self, other)

    def __rmul__(self, other: Any) -> Apply:
        return call(np.multiply, other, self)

    def __truediv__(self, other: Any) -> Apply:
        return call(np.true_divide, self, other)

    def __rtruediv__(self, other: Any) -> Apply:
        return call(np.true_divide, other, self)

    def __floordiv__(self, other: Any) -> Apply:
        return call(np.floor_divide, self, other)

    def __rfloordiv__(self, other: Any) -> Apply:
        return call(np.floor_divide, other, self)

    def __mod__(self, other: Any) -> Apply:
        return call(np.remainder, self, other)

    def __rmod__(self, other: Any) -> Apply:
        return call(np.remainder, other, self)

    def __pow__(self, other: Any) -> Apply:
        return call(np.power, self, other)

    def __rpow__(self, other: Any) -> Apply:
        return call(np.power, other, self)

    def __and__(self, other: Any) -> Apply:
        return call(np.bitwise_and, self, other)

    def __rand__(self, other: Any) -> Apply:
        return call(np.bitwise_and, other, self)

    def __or__(self, other: Any) -> Apply:
        return call(np.bitwise_or, self, other)

    def __ror__(self, other: Any) -> Apply:
        return call(np.bitwise_or, other, self)

    def __xor__(self, other: Any) -> Apply:
        return call(np.bitwise_xor, self, other)

    def __rxor__(self, other: Any) -> Apply:
        return call(np.bitwise_xor, other, self)

    def __lshift__(self, other: Any) -> Apply:
        return call(np.left_shift, self, other)

    def __rshift__(self, other: Any) -> Apply:
        return call(np.right_shift, self, other)

    def __neg__(self) -> Apply:
        return call(np.negative, self)

    def __pos__(self) -> Apply:
        return call(np.positive, self)

    def __abs__(self) -> Apply:
        return call(np.absolute, self)

    def __invert__(self) -> Apply:
        return call(np.invert, self)


@dataclass(frozen=True, eq=False)
class Input(Expr):
    """The ``index``-th block input of the expression."""

    index: int

    def __post_init__(self) -> None:
        if not isinstance(self.index, (int, np.integer)) or self.index < 0:
            raise ValueError(f"Input index must be an integer >= 0, got {self.index!r}")

    def __repr__(self) -> str:
        return f"Input({self.index})"


@dataclass(frozen=True, eq=False)
class Const(Expr):
    """A scalar or an in-memory array; arrays are copied and made read-only.

    Python scalars stay Python scalars, so NumPy treats them as weak (NEP 50); NumPy
    scalars and arrays are strong, exactly as in NumPy.
    """

    value: Any

    def __post_init__(self) -> None:
        value = self.value
        if isinstance(value, (bool, int, float, complex, np.generic)):
            return
        if isinstance(value, Expr):
            raise TypeError("Const wraps a value, not an expression node")
        try:
            array = np.array(value, copy=True)
        except Exception as exc:
            raise TypeError(
                f"cannot use a {type(value).__name__} as an expression operand: "
                "give a scalar, a NumPy array or a list of numbers"
            ) from exc
        if array.dtype == object:
            raise TypeError(
                f"cannot use {type(value).__name__} values of dtype object in an expression; "
                "convert them to a numeric array first"
            )
        array.flags.writeable = False
        object.__setattr__(self, "value", array)

    def __repr__(self) -> str:
        value = self.value
        if isinstance(value, np.ndarray):
            return f"Const(<{value.dtype} array of shape {value.shape}>)"
        return f"Const({value!r})"


@dataclass(frozen=True, eq=False)
class Apply(Expr):
    """``ufunc(*args, **kwargs)`` for a single-output elementwise ufunc."""

    ufunc: np.ufunc
    args: tuple[Expr, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()

    def children(self) -> tuple[Expr, ...]:
        return self.args

    def __repr__(self) -> str:
        inner = ", ".join([repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs])
        return f"{self.ufunc.__name__}({inner})"


@dataclass(frozen=True, eq=False)
class Where(Expr):
    """``np.where(cond, a, b)``; a non-boolean ``cond`` counts by truth (NaN is true)."""

    cond: Expr
    a: Expr
    b: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.cond, self.a, self.b)


@dataclass(frozen=True, eq=False)
class Clip(Expr):
    """``np.clip(a, lo, hi)``; one bound may be None."""

    a: Expr
    lo: Expr | None
    hi: Expr | None

    def children(self) -> tuple[Expr, ...]:
        return tuple(n for n in (self.a, self.lo, self.hi) if n is not None)


@dataclass(frozen=True, eq=False)
class AsType(Expr):
    """``a.astype(dtype)`` (casting="unsafe", as ``ndarray.astype``)."""

    a: Expr
    dtype: np.dtype

    def children(self) -> tuple[Expr, ...]:
        return (self.a,)


@dataclass(frozen=True, eq=False)
class Round(Expr):
    """``np.round(a, decimals)``."""

    a: Expr
    decimals: int = 0

    def children(self) -> tuple[Expr, ...]:
        return (self.a,)


def as_expr(value: Any) -> Expr:
    """``value`` itself if it is a node, else a :class:`Const` around it."""
    return value if isinstance(value, Expr) else Const(value)


def call(ufunc: np.ufunc, *args: Any, **kwargs: Any) -> Apply:
    """A node applying ``ufunc`` to ``args`` (nodes or constants).

    Raises TypeError for something that is not an elementwise single-output ufunc or for
    the wrong number of operands, ValueError for keywords other than ``dtype``,
    ``casting`` and ``signature``.
    """
    if not isinstance(ufunc, np.ufunc):
        raise TypeError(f"{ufunc!r} is not a NumPy ufunc; wrap other functions with map_blocks")
    if ufunc.signature is not None:
        raise TypeError(
            f"np.{ufunc.__name__} is a generalized ufunc with signature {ufunc.signature}; "
            "only elementwise ufuncs fuse (use the linalg operators for matmul)"
        )
    if ufunc.nout != 1:
        raise TypeError(
            f"np.{ufunc.__name__} has {ufunc.nout} outputs; elementwise expressions take "
            "single-output ufuncs"
        )
    if len(args) != ufunc.nin:
        raise TypeError(f"np.{ufunc.__name__} takes {ufunc.nin} operand(s), {len(args)} were given")
    unknown = sorted(set(kwargs) - UFUNC_KEYWORDS)
    if unknown:
        raise ValueError(
            f"np.{ufunc.__name__}: keyword(s) {', '.join(unknown)} are not supported in an "
            f"elementwise expression; supported: {', '.join(sorted(UFUNC_KEYWORDS))}"
        )
    if "dtype" in kwargs and kwargs["dtype"] is not None:
        kwargs["dtype"] = np.dtype(kwargs["dtype"])
    return Apply(ufunc, tuple(as_expr(a) for a in args), tuple(sorted(kwargs.items())))


def where(cond: Any, a: Any, b: Any) -> Where:
    """A node for ``np.where(cond, a, b)``."""
    return Where(as_expr(cond), as_expr(a), as_expr(b))


def clip(a: Any, lo: Any, hi: Any) -> Clip:
    """A node for ``np.clip(a, lo, hi)``; ``lo`` or ``hi`` may be None."""
    return Clip(
        as_expr(a),
        None if lo is None else as_expr(lo),
        None if hi is None else as_expr(hi),
    )


def astype(a: Any, dtype: Any) -> AsType:
    """A node for ``a.astype(dtype)``."""
    return AsType(as_expr(a), np.dtype(dtype))


def round_(a: Any, decimals: int = 0) -> Round:
    """A node for ``np.round(a, decimals)``."""
    if not isinstance(decimals, (int, np.integer)):
        raise TypeError(f"decimals must be an integer, got {decimals!r}")
    return Round(as_expr(a), int(decimals))


def walk(expr: Expr) -> list[Expr]:
    """Every distinct node of ``expr``, operands before their users (a node used twice is
    listed once)."""
    return postorder([expr], _operands)


def _operands(node: Expr) -> tuple[Expr, ...]:
    return node.children()


def input_count(expr: Expr) -> int:
    """1 + the highest input index the expression reads (0 if it reads none)."""
    indices = [n.index for n in walk(expr) if isinstance(n, Input)]
    return max(indices) + 1 if indices else 0


def compute(node: Expr, args: Sequence[Any]) -> Any:
    """NumPy's result of one non-leaf node on evaluated operands (the reference semantics)."""
    if isinstance(node, Apply):
        return node.ufunc(*args, **dict(node.kwargs))
    if isinstance(node, Where):
        return np.where(*args)
    if isinstance(node, Clip):
        values = iter(args)
        a = next(values)
        lo = None if node.lo is None else next(values)
        hi = None if node.hi is None else next(values)
        return np.clip(a, lo, hi)
    if isinstance(node, AsType):
        return np.asarray(args[0]).astype(node.dtype)
    if isinstance(node, Round):
        return np.round(args[0], node.decimals)
    raise TypeError(f"not an operation node: {node!r}")


def _evaluate(expr: Expr, leaf: Callable[[Expr], Any]) -> dict[int, Any]:
    values: dict[int, Any] = {}
    for node in walk(expr):
        if isinstance(node, (Input, Const)):
            values[id(node)] = leaf(node)
        else:
            values[id(node)] = compute(node, [values[id(c)] for c in node.children()])
    return values


def evaluate(expr: Expr, *blocks: np.ndarray) -> Any:
    """Plain NumPy evaluation of ``expr`` on whole blocks: the reference semantics.

    >>> evaluate(Input(0) * 2 + 1, np.arange(3, dtype=np.int8))
    array([1, 3, 5], dtype=int8)
    """

    def leaf(node: Expr) -> Any:
        if isinstance(node, Input):
            if node.index >= len(blocks):
                raise ValueError(
                    f"the expression reads input {node.index} but {len(blocks)} block(s) were given"
                )
            return blocks[node.index]
        return node.value  # type: ignore[attr-defined]

    return _evaluate(expr, leaf)[id(expr)]


@dataclass(frozen=True)
class Inferred:
    """What NumPy's resolution says about an expression on row blocks.

    ``row_shape`` is the trailing shape of the result (the row count is the inputs').
    ``values`` maps ``id(node)`` to the probe value of every node: a zero-row array for
    nodes that depend on a block input, the actual value for constant sub-expressions
    (which the fused kernel folds); ``varying`` holds the ids of the former.
    """

    dtype: np.dtype
    row_shape: tuple[int, ...]
    values: dict[int, Any]
    varying: frozenset[int]

    def depends_on_input(self, node: Expr) -> bool:
        """Whether ``node`` reads a block input (else it is a constant, folded once)."""
        return id(node) in self.varying


def _check_const(value: Any, block_ndim: int, row_shape: tuple[int, ...]) -> None:
    shape = np.shape(value)
    if len(shape) > block_ndim or (len(shape) == block_ndim and block_ndim > 0 and shape[0] != 1):
        raise ValueError(
            f"an in-memory operand of shape {shape} does not broadcast against row blocks "
            f"of shape (rows, {', '.join(map(str, row_shape))}): it must match the trailing "
            f"axes, e.g. shape {row_shape} or {(1, *row_shape)}"
        )


def infer(
    expr: Expr,
    input_dtypes: Sequence[Any],
    input_row_shapes: Sequence[tuple[int, ...]] | None = None,
) -> Inferred:
    """Result dtype and row shape of ``expr`` on blocks of the given dtypes and row shapes.

    Evaluates the expression on zero-row arrays, so the answer is NumPy's own (NEP 50
    included) and errors NumPy raises during type resolution — OverflowError for a Python
    integer that does not fit, TypeError/UFuncTypeError for unsupported dtypes — are raised
    here. Without row shapes the inputs are taken as columns of size 1, which broadcast
    against any constant.

    Raises ValueError for inputs of different dimensions, an input index without a dtype,
    an expression without block inputs, or a constant that does not broadcast against the
    trailing axes.
    """
    dtypes = [np.dtype(d) for d in input_dtypes]
    nodes = walk(expr)
    consts = [n for n in nodes if isinstance(n, Const)]
    if input_row_shapes is None:
        depth = max((np.ndim(c.value) for c in consts), default=0)
        row_shapes = [(1,) * depth for _ in dtypes]
    else:
        row_shapes = [tuple(int(d) for d in s) for s in input_row_shapes]
        if len(row_shapes) != len(dtypes):
            raise ValueError(
                f"{len(dtypes)} input dtypes but {len(row_shapes)} row shapes were given"
            )
    used = sorted({n.index for n in nodes if isinstance(n, Input)})
    if not used:
        raise ValueError(f"the expression {expr!r} reads no block input; evaluate it directly")
    if used[-1] >= len(dtypes):
        raise ValueError(
            f"the expression reads input {used[-1]} but only {len(dtypes)} input dtype(s) were given"
        )
    ndims = {len(row_shapes[i]) + 1 for i in used}
    if len(ndims) > 1:
        shapes = ", ".join(f"input {i}: (rows, *{row_shapes[i]})" for i in used)
        raise ValueError(
            f"block inputs of one expression must have the same number of dimensions ({shapes}); "
            "add the missing trailing axes with a reshape first"
        )
    block_ndim = ndims.pop()
    broadcast_rows = np.broadcast_shapes(*(row_shapes[i] for i in used))
    for c in consts:
        _check_const(c.value, block_ndim, tuple(broadcast_rows))

    probes = [np.empty((0, *s), dtype=d) for d, s in zip(dtypes, row_shapes, strict=True)]
    varying: set[int] = set()
    values: dict[int, Any] = {}
    for node in nodes:
        if isinstance(node, Input):
            values[id(node)] = probes[node.index]
            varying.add(id(node))
        elif isinstance(node, Const):
            values[id(node)] = node.value
        else:
            result = compute(node, [values[id(c)] for c in node.children()])
            if any(id(c) in varying for c in node.children()):
                varying.add(id(node))
            else:
                _check_const(result, block_ndim, tuple(broadcast_rows))
            values[id(node)] = result
    root = values[id(expr)]
    return Inferred(np.dtype(root.dtype), tuple(root.shape[1:]), values, frozenset(varying))


def result_dtype(
    expr: Expr,
    input_dtypes: Sequence[Any],
    input_row_shapes: Sequence[tuple[int, ...]] | None = None,
) -> np.dtype:
    """NumPy's result dtype of ``expr`` on inputs of ``input_dtypes`` (see :func:`infer`).

    >>> result_dtype(Input(0) * 2.0, [np.float32])
    dtype('float32')
    """
    return infer(expr, input_dtypes, input_row_shapes).dtype


def _token_parts(node: Expr, memo: dict[int, str]) -> str:
    if isinstance(node, Input):
        return f"in{node.index}"
    if isinstance(node, Const):
        value = node.value
        if isinstance(value, np.ndarray):
            digest = hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()
            return f"arr({value.dtype.str},{value.shape},{digest})"
        if isinstance(value, np.generic):
            return f"np({value.dtype.str},{value.item()!r})"
        return f"py({type(value).__name__},{value!r})"
    inner = ",".join(memo[id(c)] for c in node.children())
    if isinstance(node, Apply):
        return f"{node.ufunc.__name__}({inner};{node.kwargs!r})"
    if isinstance(node, Where):
        return f"where({inner})"
    if isinstance(node, Clip):
        return f"clip({inner};lo={node.lo is not None},hi={node.hi is not None})"
    if isinstance(node, AsType):
        return f"astype({inner};{node.dtype.str})"
    if isinstance(node, Round):
        return f"round({inner};{node.decimals})"
    raise TypeError(f"unknown node {node!r}")


def token(expr: Expr) -> str:
    """A deterministic key of the expression (equal for equal expressions across runs).

    Constant arrays enter by content hash, so the key is safe for a persistent cache.
    """
    memo: dict[int, str] = {}
    for node in walk(expr):
        memo[id(node)] = _token_parts(node, memo)
    return hashlib.sha1(memo[id(expr)].encode()).hexdigest()
