"""Building graph nodes for lazy arrays: the helpers every module that implements a
NumPy function uses, and the one way they get an Array back.

Operands (:func:`node_of`, :func:`align`, :func:`as_value`), NumPy's broadcasting with
unknown row counts (:func:`result_shape`), elementwise operations
(:func:`elementwise`), functions of in-memory values (:func:`value_apply`) and
operations that wait for row counts (:func:`deferred`, :func:`defer_function`,
:func:`defer_method`; see :mod:`tierflow.engine.planning.counting`).

A builder returns an Array through :func:`wrap`, whose type
:mod:`tierflow.engine.api.array` registers once (:func:`register_array`), as dask's
``new_collection`` does: so no module that builds nodes imports the Array class, and
the class imports none of them (they register in :mod:`tierflow.engine.api.dispatch`).
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import format_bytes
from .. import graph
from ..graph import Chunked, ElemOp, Node, Value, blocksize, callsites, specs
from ..io.memory import ArrayReader

if TYPE_CHECKING:
    from .array import Array

# A lazy operand that is not row-aligned is held whole in memory as a broadcast constant;
# above this share of the RAM budget that is refused rather than risked.
CONSTANT_SHARE = 8

_ARRAY: type[Any] | None = None  # the Array class, once registered


def register_array(cls: type[Any]) -> None:
    """Make ``cls`` (:class:`tierflow.engine.api.array.Array`, once) the type that
    :func:`wrap` returns and :func:`is_array` recognises."""
    global _ARRAY
    if _ARRAY is not None and _ARRAY is not cls:
        raise TypeError(f"the array type is already {_ARRAY.__qualname__}, not {cls.__qualname__}")
    _ARRAY = cls


def wrap(node: Node) -> Array:
    """An Array over ``node``."""
    if _ARRAY is None:
        raise RuntimeError("no array type registered: import tierflow first")
    return _ARRAY(node)


def is_array(value: Any) -> bool:
    """Whether ``value`` is an Array."""
    return _ARRAY is not None and isinstance(value, _ARRAY)


def array_node(a: np.ndarray, rows: Any = None) -> Node:
    """The node of an in-memory array: its rows in blocks of ``rows`` (default from the
    budget), or a constant for a 0-d array."""
    if a.ndim == 0:
        return graph.Const(a[()])
    reader = ArrayReader(a)
    return graph.Source(reader, blocksize.bounds(a.shape[0], rows, reader.row_nbytes))


def node_of(value: Any) -> Any:
    """An Array's node; in-memory arrays stay arrays (decided later), scalars stay scalars."""
    if is_array(value):
        return value._node
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return value
    if isinstance(value, Node):
        return value
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.hasobject:
        raise TypeError(
            f"cannot use a {type(value).__name__} as an operand of a lazy array: it is not "
            "numeric (dtype object)"
        )
    return array


def shape_of(value: Any) -> tuple[int | None, ...]:
    if isinstance(value, Node):
        return value.shape
    return tuple(np.shape(value))


def describe_shape(shape: tuple[int | None, ...]) -> str:
    return (
        "("
        + ", ".join("?" if n is None else str(n) for n in shape)
        + ("," if len(shape) == 1 else "")
        + ")"
    )


def shape_only(node: Any) -> np.ndarray:
    """An array of ``node``'s dtype and shape that holds no data (one element, every
    stride 0; an unknown row count stands as one row). NumPy's own checks of the
    arguments of a function that makes a view, or fails before it computes, run on it
    at no cost whatever the size, and raise NumPy's error with NumPy's message."""
    shape = tuple(1 if n is None else n for n in shape_of(node))
    return np.broadcast_to(np.empty((), np.dtype(node.dtype)), shape)


class NeedsCount(ValueError):
    """Operands line up only once their rows are counted (see :func:`deferred`)."""


def result_shape(operands: Sequence[Any]) -> tuple[int | None, ...]:
    """NumPy's broadcast shape, with None for an unknown row count."""
    if _value_nodes(list(operands), lambda n: not n.sized):
        raise NeedsCount("a value whose length is known once computed")
    shapes = [shape_of(o) for o in operands]
    ndim = max(len(s) for s in shapes)
    unknown = [
        o
        for o, s in zip(operands, shapes, strict=False)
        if len(s) == ndim and ndim and s[0] is None
    ]
    known_rows = {
        s[0] for s in shapes if len(s) == ndim and ndim and s[0] is not None and s[0] != 1
    }
    if unknown and known_rows:
        raise NeedsCount(
            "row counts do not match: "
            + " and ".join(describe_shape(s) for s in shapes if len(s) == ndim)
            + " ('?' is a row count that is unknown until computed, after a boolean mask); "
            "they are compared once counted"
        )
    if len(unknown) > 1:
        first = unknown[0].origin
        if any(o.origin != first for o in unknown[1:]):
            raise NeedsCount(
                "arrays whose row counts are unknown and come from different masks or files "
                "line up only once counted"
            )
    big = 2**31 - 1  # stands in for the unknown row count while NumPy checks the rest
    subst = [tuple(big if n is None else n for n in s) for s in shapes]
    try:
        result = np.broadcast_shapes(*subst)
    except ValueError:
        text = ", ".join(f"arg {i} with shape {describe_shape(s)}" for i, s in enumerate(shapes))
        raise ValueError(
            f"shape mismatch: objects cannot be broadcast to a single shape ({text})"
        ) from None
    return tuple(None if n == big else n for n in result)


def as_value(node: Any) -> Any:
    """A chunked node as a value node (held whole), or in-memory data as a constant."""
    if isinstance(node, Value):
        return node
    if isinstance(node, np.ndarray):
        return graph.Const(node)
    if isinstance(node, Chunked):
        if isinstance(node, graph.Source) and isinstance(node.reader, ArrayReader):
            return graph.Const(node.reader.array)
        from ...system import budget

        limit = budget.budget_bytes() // CONSTANT_SHARE
        if node.n_rows is not None:
            nbytes = node.n_rows * node.dtype.itemsize * math.prod(node.row_shape)  # type: ignore[union-attr]
            if nbytes > limit:
                raise ValueError(
                    f"an operand of shape {describe_shape(node.shape)} does not have the rows "
                    f"of the result, so it would be held whole in memory ({format_bytes(nbytes)}), "
                    f"more than 1/{CONSTANT_SHARE} of the RAM budget ({format_bytes(limit * CONSTANT_SHARE)}); "
                    "give it the rows of the other operand, or raise the budget"
                )
        return graph.Reduce(specs.CollectSpec(), (node,))
    return node


def align(operands: Sequence[Any], shape: tuple[int | None, ...]) -> list[Any]:
    """Operands as chunked nodes where they have the result's rows, values elsewhere."""
    ndim = len(shape)
    rows = shape[0] if ndim else 1

    def aligned(o: Any) -> bool:
        s = shape_of(o)
        return ndim > 0 and len(s) == ndim and s[0] == rows

    # In-memory arrays ride along in row blocks only beside a lazy chunked operand.
    chunked = any(isinstance(o, Chunked) and aligned(o) for o in operands)
    out = []
    for o in operands:
        if isinstance(o, Chunked):
            out.append(o if aligned(o) else as_value(o))
        elif isinstance(o, np.ndarray):
            if chunked and aligned(o) and rows != 1:
                out.append(array_node(o))
            else:
                out.append(graph.Const(o) if o.ndim else o[()])
        else:
            out.append(o)
    return out


def check_meta(node: Any) -> None:
    if isinstance(node, Value) and not node.meta_known:
        raise TypeError(
            f"the result of {node.label()} has no declared dtype and shape, so it cannot be "
            "used in further operations; give dtype= and shape= to x.reduction(...), or "
            "compute() it first"
        )


def elementwise(op: ElemOp, *operands: Any) -> Array:
    nodes = [node_of(o) for o in operands]
    for n in nodes:
        check_meta(n)
    try:
        shape = result_shape(nodes)
    except NeedsCount:
        return _deferred_elementwise(op, nodes)
    except ValueError:
        if all(None not in shape_of(n) for n in nodes if isinstance(n, Node)):
            # NumPy's own error (its message, its shapes), raised before it computes
            op.apply(*(shape_only(n) if isinstance(n, (Node, np.ndarray)) else n for n in nodes))
        raise
    aligned = align(nodes, shape)
    if any(isinstance(a, Chunked) for a in aligned):
        node = graph.Elementwise(op, tuple(aligned))
        _cast_warning(op, node)
        return wrap(node)
    return wrap(graph.Apply(op.apply, tuple(aligned), name=op.label()))


def _cast_warning(op: ElemOp, node: graph.Elementwise) -> None:
    """NumPy's ComplexWarning of ``op``, a cast of complex values to a real dtype
    (``astype``, a ufunc with ``casting="unsafe"``), given now at the caller's line.

    NumPy decides it by the dtypes alone and gives it whatever the values, for no rows
    too, where no block runs: so it is given when the pipeline is built, as NumPy's
    errors of the dtypes are, from ``op`` on stand-ins without rows. The blocks of an
    ``astype`` then cast quietly (:mod:`tierflow.operators.fused`)."""
    if np.dtype(node.dtype).kind == "c":
        return
    standins = [
        np.zeros((0, *o.row_shape), o.dtype)
        if isinstance(o, Chunked)
        else graph.placeholder(o)
        if isinstance(o, Node)
        else o
        for o in node.operands
    ]
    if not any(np.asarray(v).dtype.kind == "c" for v in standins):
        return
    with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
        warnings.simplefilter("always")
        op.apply(*standins)
    for w in caught:
        if issubclass(w.category, np.exceptions.ComplexWarning):
            callsites.warn_here(str(w.message), w.category)
            return


def apply_ufunc(ufunc: np.ufunc, *operands: Any, **kwargs: Any) -> Array:
    return elementwise(ElemOp("ufunc", ufunc=ufunc, kwargs=kwargs), *operands)


def value_apply(
    fn: Callable[..., Any],
    *args: Any,
    name: str | None = None,
    data_length: bool = False,
    **kwargs: Any,
) -> Array:
    """``fn`` applied to in-memory values: chunked operands are collected first. On a
    value whose length is known only once computed, it waits for that (see
    :func:`_apply_later`). ``data_length``: the length of the result's first axis
    depends on the data (``np.unique``), so it is unknown (None) until computed."""
    args2, kwargs2 = graph.substitute(
        (args, kwargs), lambda n: n if isinstance(n, Value) else as_value(n)
    )
    call = (tuple(args2), dict(kwargs2))
    if _value_nodes(call, lambda n: not n.sized):
        return _apply_later(fn, call, name, data_length)
    shape = None
    if data_length or _value_nodes(call, lambda n: n.dtype == bool):
        # Which elements a boolean value picks decides lengths too (``s[s > 2]``).
        shape = _probe_shape(fn, call, first_unknown=data_length)[1]
    return wrap(graph.Apply(fn, *call, name=name, shape=shape))


def _value_nodes(call: Any, which: Callable[[Value], bool]) -> list[Node]:
    """The value nodes in ``call`` for which ``which`` is true."""
    found: dict[int, Node] = {}

    def note(node: Node) -> Node:
        if isinstance(node, Value) and which(node):
            found[id(node)] = node
        return node

    graph.substitute(call, note)
    return list(found.values())


# An index reads a few elements of what it indexes: its stand-in for a length unknown
# until computed is a zero-strided view this long (no memory), so any position fits.
_INDEXED_LENGTH = 1 << 32


_Standin = Callable[[Node], Any]


def _standins(
    fn: Callable[..., Any], call: tuple[tuple[Any, ...], dict[str, Any]]
) -> list[_Standin]:
    """Two ways to stand in for the nodes of ``fn(*args, **kwargs)`` while its shape is
    worked out: unknown lengths 1 then 2 (zeros that broadcast, then not), booleans
    False then True. An index of a value of unknown length by positions or slices has
    stand-ins of a length any position fits (one more the second time)."""

    def filled(length: int, fill: bool) -> _Standin:
        def standin(node: Node) -> Any:
            shape = tuple(length if d is None else d for d in node.shape)
            value = (
                np.full(shape, fill, bool) if node.dtype == bool else np.zeros(shape, node.dtype)
            )
            return value if shape else value[()]

        return standin

    args = call[0]
    if fn is not operator.getitem or _value_nodes(args[1:], lambda n: True):
        return [filled(1, False), filled(2, True)]
    first = index_items(args[1])[0] if index_items(args[1]) else None
    mask = np.asarray(first) if isinstance(first, (np.ndarray, list)) else None
    picks = mask is not None and mask.dtype == bool  # as long as its mask, both times

    def indexed(length: int) -> _Standin:
        def standin(node: Node) -> Any:
            shape = tuple(length if d is None else d for d in node.shape)
            return np.broadcast_to(np.zeros((), node.dtype), shape)

        return standin

    length = len(mask) if picks else _INDEXED_LENGTH  # type: ignore[arg-type]
    return [indexed(length), indexed(length + (not picks))]


def _probe_shape(
    fn: Callable[..., Any], call: tuple[tuple[Any, ...], dict[str, Any]], first_unknown: bool
) -> tuple[np.dtype, tuple[int | None, ...]]:
    """The dtype of ``fn(*args, **kwargs)`` and its shape, None where it differs
    between the two :func:`_standins` (a length that depends on an unknown length or on
    the data), and on the first axis with ``first_unknown``. A probe that fails the
    second time (a length that no longer broadcasts) leaves every axis unknown."""
    args, kwargs = call
    probes: list[np.ndarray] = []
    with graph.quiet():
        for standin in _standins(fn, call):
            try:
                out = fn(*graph.substitute(args, standin), **graph.substitute(kwargs, standin))
            except Exception:
                if not probes:
                    raise
                break
            probes.append(np.asarray(out))
    last = probes[-1]
    if last.ndim == 0:
        return probes[0].dtype, ()
    if len(probes) == 1 or probes[0].ndim != last.ndim:
        return probes[0].dtype, (None,) * last.ndim
    one, two = probes
    pairs = enumerate(zip(one.shape, two.shape, strict=True))
    shape = tuple(None if a != b or (k == 0 and first_unknown) else a for k, (a, b) in pairs)
    return one.dtype, shape


def _apply_later(
    fn: Callable[..., Any],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    name: str | None,
    data_length: bool,
) -> Array:
    """``fn(*args, **kwargs)`` (``call``) once the values in it whose length is unknown
    are computed (:mod:`tierflow.engine.planning.counting`). Its dtype is known now; its first
    axis stays unknown (None) until then, as do other axes whose lengths depend on the
    unknown ones; a scalar's shape is ()."""
    meta = _probe_shape(fn, call, first_unknown=True)
    nodes: dict[int, Node] = {}
    graph.substitute(call, lambda n: nodes.setdefault(id(n), n))
    slots = graph.substitute(call, lambda n: f"in{list(nodes).index(id(n))}")
    make = functools.partial(_make_apply, fn, call, (name, data_length))
    label = str(name or getattr(fn, "__name__", "apply"))
    return deferred(list(nodes.values()), make, meta, label, (label, fn, slots), rows=False)


def _make_apply(
    fn: Callable[..., Any],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    how: tuple[str | None, bool],
    lookup: Callable[[Node], Node],
) -> Node:
    args, kwargs = graph.substitute(call, lookup)
    name, data_length = how
    return value_apply(fn, *args, name=name, data_length=data_length, **kwargs)._node


def deferred(  # noqa: PLR0913 -- the operation, and what its result is
    inputs: Sequence[Node],
    make: Callable[[Callable[[Node], Node]], Node],
    meta: tuple[Any, tuple[Any, ...]],
    what: str,
    token: Any = None,
    rows: bool = True,
) -> Array:
    """A deferred node over ``inputs``: chunked rows of ``meta = (dtype, row shape)``
    when ``rows``, else a value of ``meta = (dtype, shape)``. ``make(lookup)`` builds
    the operation, ``lookup`` giving the counted node for each input."""
    unique = list({id(n): n for n in inputs}.values())
    kind = graph.DeferredRows if rows else graph.DeferredValue
    return wrap(kind(unique, functools.partial(_made, make, unique, rows), meta, what, token))


def _made(
    make: Callable[[Callable[[Node], Node]], Node], old: list[Node], rows: bool, inputs: list[Node]
) -> Node:
    """``make`` on the counted inputs; a chunked result of a value's operation is held."""
    table = {id(o): n for o, n in zip(old, inputs, strict=True)}
    node = make(lambda n: table.get(id(n), n))
    if not rows and isinstance(node, Chunked):
        return as_value(node)
    return node


def _probe_meta(fn: Callable[..., Any], *args: Any) -> tuple[np.dtype, tuple[int, ...]]:
    """Dtype and shape of ``fn`` on zero placeholders (unknown rows count as 1)."""
    with graph.quiet():
        probe = np.asarray(fn(*graph.substitute(args, graph.placeholder)))
    return probe.dtype, probe.shape


def _deferred_elementwise(op: ElemOp, nodes: list[Any]) -> Array:
    """``op`` on operands whose rows line up only once counted."""
    if not any(isinstance(n, Chunked) for n in nodes):
        return value_apply(op.apply, *nodes, name=op.label())
    inputs = [n for n in nodes if isinstance(n, Node)]
    shaped = [
        np.zeros((1, *n.shape[1:]), n.dtype) if isinstance(n, np.ndarray) and n.ndim else n
        for n in nodes
    ]
    dtype, shape = _probe_meta(op.apply, *shaped)
    make = functools.partial(_make_elementwise, op, tuple(nodes))
    return deferred(inputs, make, (dtype, shape[1:]), op.label(), (op.params(), len(nodes)))


def _make_elementwise(op: ElemOp, nodes: tuple[Any, ...], lookup: Callable[[Node], Node]) -> Node:
    return elementwise(op, *(lookup(n) if isinstance(n, Node) else n for n in nodes))._node


def _make_method(
    name: str,
    target: Node,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lookup: Callable[[Node], Node],
) -> Node:
    """``Array(target).<name>(*args, **kwargs)`` on the counted nodes (nodes among
    ``args`` as Arrays)."""
    values = [wrap(lookup(a)) if isinstance(a, Node) else a for a in args]
    return getattr(wrap(lookup(target)), name)(*values, **kwargs)._node


def line_up_later(nodes: Sequence[Node]) -> bool:
    """Whether chunked ``nodes`` have rows that line up (or not) only once counted: some
    unknown, and either some known or from different masks."""
    chunked = [n for n in nodes if isinstance(n, Chunked)]
    unknown = [n for n in chunked if n.n_rows is None]
    if not unknown:
        return False
    return len(unknown) < len(chunked) or any(n.origin != unknown[0].origin for n in unknown)


def defer_function(fn: Callable[..., Array], nodes: Sequence[Node], what: str) -> Array:
    """``fn(arrays)`` for chunked ``nodes`` whose rows line up only once counted (see
    :func:`line_up_later`): a deferred node of the kind ``fn`` gives, rows or a value.
    Its dtype and shape are ``fn``'s with zero rows standing in for the unknown ones,
    as many as the known ones have (two if none has): NumPy's errors on anything but
    the row count are raised now, the row count's once counted."""
    known = [n.n_rows for n in nodes if isinstance(n, Chunked) and n.n_rows is not None]
    rows = known[0] if known else 2

    def standin(n: Node) -> Node:
        if not isinstance(n, Chunked) or n.n_rows is not None:
            return n
        return array_node(np.zeros((rows, *n.row_shape), n.dtype))

    probe = fn([wrap(standin(n)) for n in nodes])._node
    chunked = isinstance(probe, Chunked)
    meta = (probe.dtype, probe.shape[1:] if chunked else probe.shape)

    def make(lookup: Callable[[Node], Node]) -> Node:
        return fn([wrap(lookup(n)) for n in nodes])._node

    token = (what, fn, len(nodes))
    return deferred(nodes, make, meta, what, token, rows=chunked)


def defer_method(  # noqa: PLR0913 -- the method's call, and what the result is
    target: Node,
    name: str,
    args: tuple[Any, ...],
    meta: tuple[Any, tuple[Any, ...]],
    what: str,
    rows: bool = True,
    kwargs: dict[str, Any] | None = None,
) -> Array:
    """``Array(target).<name>(*args, **kwargs)`` once the rows are counted."""
    kwargs = kwargs or {}
    make = functools.partial(_make_method, name, target, args, kwargs)
    inputs = [target, *(a for a in args if isinstance(a, Node))]
    token = (name, [a if not isinstance(a, Node) else "node" for a in args], kwargs)
    return deferred(inputs, make, meta, what, token, rows)


def index_items(key: Any) -> tuple[Any, ...]:
    return key if isinstance(key, tuple) else (key,)
