"""The case of every entry of the function table: how to call it on a lazy array and on
a NumPy array, with which arguments, and how its result is compared.

A case is a function of the corpus point and NumPy's operands (see conformance.py)
that lists the calls suiting that input: an axis that exists, a ``kth`` or positions
in range as well as out of range, two operands of the rows. A call runs the same code
on both sides wherever NumPy's own function or method does the job (``np.median(o.x,
axis=0)`` answers through ``__array_function__`` on a lazy array); tierflow's own
functions give an ``oracle`` written with NumPy. A call that docs/engine.md documents
as refused on lazy arrays says so (``refused=``): tierflow must raise that error.

Entries that need no code of their own: every elementwise ufunc (:func:`ufunc_case`),
the reductions of ``REDUCE_UFUNCS`` and the Python operators (:func:`operator_case`).
Every other entry is in :data:`CASES`, keyed by the name test_conformance.py gives it
(``np.median``, ``Array.sum``, ``Array.__getitem__``, ``tw.topk``).
"""

from __future__ import annotations

import operator
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import tierflow as tw
from tierflow.engine.api import products

from .conformance import (
    ELEMENTWISE,
    EXACT,
    PRODUCT,
    PRODUCTS,
    ROUNDED,
    SIGNED,
    SQUARES,
    UNSIGNED_ELEMENTWISE,
    Call,
    Operands,
    Point,
    Rule,
)

Calls = Callable[[Point, Operands], list[Call]]


@dataclass(frozen=True)
class Case:
    """How an entry is called (``calls``) and compared (``rule``, unless a call has
    its own)."""

    calls: Calls
    rule: Rule = EXACT


CASES: dict[str, Case] = {}


def case(*names: str, rule: Rule = EXACT) -> Callable[[Calls], Calls]:
    """Register the decorated calls function as the case of ``names``."""

    def register(calls: Calls) -> Calls:
        for name in names:
            CASES[name] = Case(calls, rule)
        return calls

    return register


# -- shared pieces ------------------------------------------------------------------------


def axes(p: Point) -> list[Any]:
    """Axes that exist for ``p``: None (all), the rows, and the trailing ones."""
    out: list[Any] = [None, 0]
    if p.ndim == 2:
        out += [1, -1, (0, 1)]
    return out


def trailing(p: Point) -> list[int]:
    """The trailing axes of ``p`` (none for 1-D), as positive and negative numbers."""
    return [1, -1] if p.ndim == 2 else []


def positions(o: Operands) -> np.ndarray:
    """Row positions in range, unsorted with a repeat (empty without rows)."""
    n = o.n
    return np.array([n - 1, 0, n // 2, 0], np.intp) if n else np.zeros(0, np.intp)


def vector(o: Operands) -> np.ndarray:
    """An in-memory vector with one value per row."""
    return np.arange(o.n, dtype=np.float64) % 3 - 1


def weights(p: Point) -> np.ndarray:
    """An in-memory ``(k, 2)`` matrix for ``x @ w``, ``k`` a row's length (1 for 1-D)."""
    k = p.row_shape[0] if p.row_shape else 1
    return np.arange(2 * k, dtype=np.float64).reshape(k, 2) / 4 - 0.5


def sortable(p: Point) -> type[BaseException] | None:
    """tierflow's sorts take booleans, integers and floats: TypeError for complex."""
    return TypeError if p.kind == "c" else None


def sortable_rows(p: Point) -> Any:
    """As :func:`sortable` for NumPy's sorts along the rows, which give NumPy's answer
    where the rows are known to be none (there is nothing to sort)."""
    return None if p.kind != "c" else lambda o: None if o.x.shape[0] == 0 else TypeError


def first_values(a: Any) -> Any:
    """Each row's first value (a block's or an array's), a 1-D array."""
    return a[:, 0] if a.ndim > 1 else a


def counted(a: Any) -> Any:
    """``a`` with its rows counted (``len``), as a user does before asking for its
    shape after a mask (docs/engine.md: ``None`` in ``x.shape`` until counted)."""
    if isinstance(a, tw.Array) and a.shape and a.shape[0] is None:
        len(a)
    return a


def _stable_order(columns: Sequence[np.ndarray], descending: bool) -> np.ndarray:
    """Row order by ``columns`` (the first deciding first), stable, NaN last."""
    keys = []
    for c in columns:
        c = np.asarray(c)
        nan = np.isnan(c) if c.dtype.kind == "f" else np.zeros(len(c), bool)
        # Ranks keep -0.0 and 0.0 equal, and never overflow when reversed.
        rank = np.unique(np.where(nan, 0, c), return_inverse=True)[1].reshape(-1)
        keys.append((nan, -rank if descending else rank))
    flat = [k for pair in reversed(keys) for k in reversed(pair)]
    return np.lexsort(flat) if flat else np.arange(0)


# -- reductions ---------------------------------------------------------------------------


def _reduction(
    fn: Callable[..., Any],
    *extras: tuple[str, dict[str, Any]],
    numpy: Callable[..., Any] | None = None,
) -> Calls:
    """Calls of a reduction over each axis, with keepdims and ``extras``; ``numpy``
    gives NumPy's answer where ``fn`` is not NumPy's (a method ndarray lacks)."""

    def calls(p: Point, o: Operands) -> list[Call]:
        options = [(f"axis={a!r}", {"axis": a}) for a in axes(p)]
        options += [("axis=0, keepdims", {"axis": 0, "keepdims": True}), *extras]
        return [
            Call(
                label,
                lambda o, k=kwargs: fn(o.x, **k),
                oracle=None if numpy is None else lambda o, k=kwargs: numpy(o.x, **k),
            )
            for label, kwargs in options
        ]

    return calls


def _method(name: str) -> Callable[..., Any]:
    return lambda a, *args, **kwargs: getattr(a, name)(*args, **kwargs)


_AS_F8 = ("axis=0, dtype=float64", {"axis": 0, "dtype": np.float64})
# NumPy's nanvar keeps its deviations in the input's dtype (conformance.Rule).
NAN_MOMENTS = Rule("sums", power=2, input_precision=True)
_AS_I8 = ("axis=None, dtype=int64", {"axis": None, "dtype": np.int64})
_DDOF = ("axis=0, ddof=1", {"axis": 0, "ddof": 1})

for _name, _fn, _rule, _extras in [
    ("sum", np.sum, ROUNDED, (_AS_F8, _AS_I8)),
    ("prod", np.prod, PRODUCT, (_AS_F8, _AS_I8)),
    ("mean", np.mean, ROUNDED, (_AS_F8,)),
    ("std", np.std, SQUARES, (_DDOF, _AS_F8)),
    ("var", np.var, SQUARES, (_DDOF, _AS_F8)),
    ("min", np.min, EXACT, ()),
    ("max", np.max, EXACT, ()),
    ("amin", np.amin, EXACT, ()),
    ("amax", np.amax, EXACT, ()),
    ("any", np.any, EXACT, ()),
    ("all", np.all, EXACT, ()),
    ("argmin", np.argmin, EXACT, ()),
    ("argmax", np.argmax, EXACT, ()),
    ("count_nonzero", np.count_nonzero, EXACT, ()),
    ("nansum", np.nansum, ROUNDED, (_AS_F8,)),
    ("nanprod", np.nanprod, PRODUCT, (_AS_F8,)),
    ("nanmean", np.nanmean, ROUNDED, (_AS_F8,)),
    ("nanstd", np.nanstd, NAN_MOMENTS, (_DDOF, _AS_F8)),
    ("nanvar", np.nanvar, NAN_MOMENTS, (_DDOF, _AS_F8)),
    ("nanmin", np.nanmin, EXACT, ()),
    ("nanmax", np.nanmax, EXACT, ()),
    ("nanargmin", np.nanargmin, EXACT, ()),
    ("nanargmax", np.nanargmax, EXACT, ()),
]:
    CASES[f"np.{_name}"] = Case(_reduction(_fn, *_extras), _rule)
    if _name in ("sum", "prod", "mean", "std", "var", "min", "max", "any", "all",
                 "argmin", "argmax", "count_nonzero"):  # fmt: skip
        _extras_m = _extras if _name not in ("argmin", "argmax") else ()
        _numpy = np.count_nonzero if _name == "count_nonzero" else None  # no ndarray method
        CASES[f"Array.{_name}"] = Case(_reduction(_method(_name), *_extras_m, numpy=_numpy), _rule)


def reduce_ufunc_case(ufunc: np.ufunc) -> Case:
    """``np.add.reduce(x, axis)`` and the other reductions of ``REDUCE_UFUNCS``."""

    def calls(p: Point, o: Operands) -> list[Call]:
        out = [Call(f"axis={a!r}", lambda o, a=a: ufunc.reduce(o.x, axis=a)) for a in axes(p)]
        out.append(Call("(default axis 0)", lambda o: ufunc.reduce(o.x)))
        out.append(Call("axis=0, keepdims", lambda o: ufunc.reduce(o.x, axis=0, keepdims=True)))
        out.append(Call("axis=0, dtype=float64", lambda o: ufunc.reduce(o.x, axis=0, dtype="f8")))
        return out

    rule = {np.add: ROUNDED, np.multiply: PRODUCT}.get(ufunc, EXACT)
    return Case(calls, rule)


# -- quantiles ----------------------------------------------------------------------------


def _refused_with_rows(error: type[BaseException]) -> Callable[[Operands], Any]:
    """Refused as documented, unless the array is known to have no rows: then NumPy's
    own answer (or error) is the array's, and tierflow gives it (docs/engine.md, "No
    rows")."""
    return lambda o: None if np.shape(o.x)[:1] == (0,) else error


def _quantiles(fn: Callable[..., Any], percent: bool) -> Calls:
    s = 100 if percent else 1

    def calls(p: Point, o: Operands) -> list[Call]:
        if p.kind == "c":  # docs/engine.md: complex data needs compute() first
            return [
                Call(
                    "q=0.5 (complex)",
                    lambda o: fn(o.x, 0.5 * s),
                    refused=_refused_with_rows(TypeError),
                )
            ]
        out = [
            Call("q=0.5", lambda o: fn(o.x, 0.5 * s)),
            Call("q=0.5, axis=0", lambda o: fn(o.x, 0.5 * s, axis=0)),
            Call("q=[0, 0.1, 1], axis=0", lambda o: fn(o.x, np.array([0, 0.1, 1]) * s, axis=0)),
            Call("q=0.25, axis=0, keepdims", lambda o: fn(o.x, 0.25 * s, axis=0, keepdims=True)),
            Call("q=1.5 (out of range)", lambda o: fn(o.x, 1.5 * s, axis=0)),
        ]
        for method in ("nearest", "midpoint", "inverted_cdf", "hazen", "closest_observation"):
            out.append(
                Call(
                    f"q=0.3, axis=0, method={method}",
                    lambda o, m=method: fn(o.x, 0.3 * s, axis=0, method=m),
                )
            )
        out += [
            Call(
                f"q=0.5, axis={a} (a trailing axis)",
                lambda o, a=a: fn(o.x, 0.5 * s, axis=a),
                refused=_refused_with_rows(ValueError),
            )
            for a in trailing(p)
        ]
        return out

    return calls


def _medians(fn: Callable[..., Any]) -> Calls:
    def calls(p: Point, o: Operands) -> list[Call]:
        if p.kind == "c":  # docs/engine.md: complex data needs compute() first
            return [Call("(complex)", lambda o: fn(o.x), refused=_refused_with_rows(TypeError))]
        out = [
            Call("axis=None", lambda o: fn(o.x)),
            Call("axis=0", lambda o: fn(o.x, axis=0)),
            Call("axis=0, keepdims", lambda o: fn(o.x, axis=0, keepdims=True)),
        ]
        out += [
            Call(
                f"axis={a} (a trailing axis)",
                lambda o, a=a: fn(o.x, axis=a),
                refused=_refused_with_rows(ValueError),
            )
            for a in trailing(p)
        ]
        return out

    return calls


# NumPy's quantiles of a column holding NaN interpolate it first (conformance.Rule).
NAN_FILLED = Rule(nan_filled=True)
CASES["np.quantile"] = Case(_quantiles(np.quantile, False), NAN_FILLED)
CASES["np.nanquantile"] = Case(_quantiles(np.nanquantile, False))
CASES["np.percentile"] = Case(_quantiles(np.percentile, True), NAN_FILLED)
CASES["np.nanpercentile"] = Case(_quantiles(np.nanpercentile, True))
CASES["np.median"] = Case(_medians(np.median), NAN_FILLED)
CASES["np.nanmedian"] = Case(_medians(np.nanmedian))


# -- counting -----------------------------------------------------------------------------


@case("np.histogram", "Array.histogram")
def _histogram(p: Point, o: Operands) -> list[Call]:
    def h(a: Any, **kwargs: Any) -> Any:
        return a.histogram(**kwargs) if isinstance(a, tw.Array) else np.histogram(a, **kwargs)

    return [
        Call("bins=5, range=(-4, 4)", lambda o: np.histogram(o.x, bins=5, range=(-4, 4))),
        Call("bins=edges", lambda o: np.histogram(o.x, bins=[-3, -0.5, 0, 1, 2.5, 9])),
        Call(
            "bins=4, range=(0, 8), density",
            lambda o: np.histogram(o.x, 4, range=(0, 8), density=True),
        ),
        Call("method: bins=5, range=(-4, 4)", lambda o: h(o.x, bins=5, range=(-4, 4))),
        Call("bins=5 without range", lambda o: np.histogram(o.x, bins=5), refused=ValueError),
    ]


@case("np.unique")
def _unique(p: Point, o: Operands) -> list[Call]:
    if p.kind == "c":  # docs/engine.md: booleans, integers and floats
        return [Call("(complex)", lambda o: np.unique(o.x), refused=TypeError)]
    out = [
        Call("", lambda o: np.unique(o.x)),
        Call("counts", lambda o: np.unique(o.x, return_counts=True)),
        Call("index, counts", lambda o: np.unique(o.x, return_index=True, return_counts=True)),
        Call("inverse", lambda o: np.unique(o.x, return_inverse=True)),
        Call("equal_nan=False", lambda o: np.unique(o.x, equal_nan=False), refused=TypeError),
    ]
    if p.ndim == 2:
        out.append(Call("axis=0", lambda o: np.unique(o.x, axis=0)))
        out.append(
            Call(
                "axis=0, counts, index",
                lambda o: np.unique(o.x, axis=0, return_counts=True, return_index=True),
            )
        )
    return out


@case("tw.value_counts")
def _value_counts(p: Point, o: Operands) -> list[Call]:
    def oracle(a: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
        values, counts = np.unique(a, return_counts=True, axis=axis)
        order = np.argsort(-counts, kind="stable")
        return values[order], counts[order]

    if p.kind == "c":  # as np.unique: booleans, integers and floats
        return [Call("(complex)", lambda o: tw.value_counts(o.x), refused=TypeError)]
    out = [Call("", lambda o: tw.value_counts(o.x), oracle=lambda o: oracle(o.x, None))]
    if p.ndim == 2:
        out.append(
            Call("axis=0", lambda o: tw.value_counts(o.x, axis=0), oracle=lambda o: oracle(o.x, 0))
        )
    return out


@case("np.bincount", rule=ROUNDED)
def _bincount(p: Point, o: Operands) -> list[Call]:
    return [
        Call("", lambda o: np.bincount(o.x)),
        Call("minlength=9", lambda o: np.bincount(o.x, minlength=9)),
        Call("weights=vector", lambda o: np.bincount(o.x, weights=vector(o))),
        Call("weights=y", lambda o: np.bincount(o.x, weights=o.y)),
    ]


# -- sorting ------------------------------------------------------------------------------


def _sorts(fn: Callable[..., Any], numpy: Callable[..., Any]) -> Calls:
    """Calls of a sort. NumPy's default sort is not stable, so its order of equal
    values (-0.0 and 0.0 too) is one of several right answers; tierflow's sort is
    stable, and NumPy's stable sort is the answer it is compared with."""

    def call(label: str, refused: Any = None, **kwargs: Any) -> Call:
        stable = {**kwargs, "kind": "stable"}
        return Call(
            label,
            lambda o: fn(o.x, **kwargs),
            oracle=lambda o: numpy(o.x, **stable),
            refused=refused,
        )

    def calls(p: Point, o: Operands) -> list[Call]:
        bad = sortable_rows(p)
        out = [
            call("axis=0", bad, axis=0),
            call("axis=0, stable", bad, axis=0, kind="stable"),
            call("(default axis -1)", bad if p.ndim == 1 else None),
        ]
        out += [call(f"axis={a}", axis=a) for a in trailing(p)]
        out.append(call("axis=None", ValueError if p.ndim == 2 else bad, axis=None))
        return out

    return calls


CASES["np.sort"] = Case(_sorts(np.sort, np.sort), SIGNED)
CASES["np.argsort"] = Case(_sorts(np.argsort, np.argsort))
CASES["Array.argsort"] = Case(_sorts(_method("argsort"), np.argsort))


def _partitioned(kth: Any, axis: int) -> Callable[[Any], Any]:
    """What a partition must get right: the values at ``kth``, every value kept, and
    no value on the wrong side of a ``kth`` (NaN sorts last, as NumPy's)."""

    def post(result: Any) -> Any:
        r = np.moveaxis(np.asarray(result), axis, 0)
        ks = [k % len(r) for k in np.atleast_1d(kth)] if len(r) else []
        order = np.argsort(r, axis=0, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(len(r)).reshape(-1, *[1] * (r.ndim - 1)), 0)
        fine = all(
            bool(np.all(np.sort(r, axis=0)[k] == r[k]) or np.all(np.isnan(r[k]))) for k in ks
        )
        return r[ks] if ks else r[:0], np.sort(r, axis=0), fine

    return post


def _complex_partition(kth: Any) -> Callable[[Operands], type[BaseException] | None]:
    """np.partition of complex data is refused (TypeError, as the sorts), except where
    NumPy's answer comes first: no rows (known), or a ``kth`` out of bounds for known
    rows (NumPy's ValueError: the rows are not counted for it)."""

    def refusal(o: Operands) -> type[BaseException] | None:
        n = o.x.shape[0]
        if n is None:
            return TypeError
        out = any(not -n <= k < n for k in np.atleast_1d(kth).tolist())
        return None if n == 0 or out else TypeError

    return refusal


@case("np.partition")
def _partition(p: Point, o: Operands) -> list[Call]:
    n = o.n
    complex_ = p.kind == "c"
    out = []
    for kth in (0, 2, -1, [0, 3]):
        out.append(
            Call(
                f"kth={kth}, axis=0",
                lambda o, k=kth: np.partition(o.x, k, axis=0),
                post=_partitioned(kth, 0),
                refused=_complex_partition(kth) if complex_ else None,
            )
        )
    out.append(
        Call(
            f"kth={n} (out of bounds), axis=0",
            lambda o: np.partition(o.x, o.n, axis=0),
            refused=_complex_partition(n) if complex_ else None,
        )
    )
    for a in trailing(p):
        out.append(
            Call(
                f"kth=0, axis={a}",
                lambda o, a=a: np.partition(o.x, 0, axis=a),
                post=_partitioned(0, a),
            )
        )
    return out


def _sort_rows_oracle(a: np.ndarray, by: Any, descending: bool) -> np.ndarray:
    if a.ndim == 1:
        return a[_stable_order([a], descending)]
    columns = range(a.shape[1]) if by is None else [by] if np.ndim(by) == 0 else by
    return a[_stable_order([a[:, c] for c in columns], descending)]


@case("tw.sort_rows", rule=SIGNED)
def _sort_rows(p: Point, o: Operands) -> list[Call]:
    bad = sortable(p)
    bys: list[Any] = [None] if p.ndim == 1 else [None, 0, -1]
    if p.row_shape == (3,):
        bys.append([2, 0])
    out = []
    for by in bys:
        for descending in (False, True):
            out.append(
                Call(
                    f"by={by}, descending={descending}",
                    lambda o, b=by, d=descending: tw.sort_rows(o.x, by=b, descending=d),
                    oracle=lambda o, b=by, d=descending: _sort_rows_oracle(o.x, b, d),
                    refused=bad,
                )
            )
    out.append(
        Call(
            "by=0, then rows 1:4 reversed",
            lambda o: tw.sort_rows(o.x, by=None)[1:4][::-1],
            oracle=lambda o: _sort_rows_oracle(o.x, None, False)[1:4][::-1],
            refused=bad,
        )
    )
    return out


def _topk_oracle(a: np.ndarray, k: int) -> np.ndarray:
    if k < 1 or k > len(a):
        raise ValueError(f"k={k} out of range for {len(a)} rows")
    flat = a.reshape(len(a), -1)
    columns = [flat[_stable_order([flat[:, c]], True), c][:k] for c in range(flat.shape[1])]
    return np.stack(columns, axis=1).reshape(k, *a.shape[1:])


@case("tw.topk", rule=SIGNED)
def _topk(p: Point, o: Operands) -> list[Call]:
    bad = sortable(p)
    return [
        Call(
            f"k={k}",
            lambda o, k=k: tw.topk(o.x, k),
            oracle=lambda o, k=k: _topk_oracle(o.x, k),
            refused=bad,
        )
        for k in sorted({1, 3, o.n, o.n + 1})
    ]


# -- along a trailing axis -----------------------------------------------------------------


def _along(fn: Callable[..., Any], rows: Rule) -> Calls:
    """A cum-function: along a trailing axis one block at a time (exact), along the
    rows in two passes, each block from the total before it (``rows``: within
    rounding; docs/engine.md)."""

    def calls(p: Point, o: Operands) -> list[Call]:
        out = [Call(f"axis={a}", lambda o, a=a: fn(o.x, axis=a)) for a in trailing(p)]
        out.append(Call("axis=0", lambda o: fn(o.x, axis=0), rule=rows))
        out.append(
            Call("axis=0, dtype=float64", lambda o: fn(o.x, axis=0, dtype=np.float64), rule=rows)
        )
        # The flattened array runs along the rows across the trailing axes.
        flat = ValueError if p.ndim > 1 else None
        out.append(Call("axis=None", lambda o: fn(o.x), rule=rows, refused=flat))
        if p.ndim == 2:
            out.append(Call("axis=1, dtype=float64", lambda o: fn(o.x, axis=1, dtype=np.float64)))
        return out

    return calls


for _name in ("cumsum", "cumprod", "nancumsum", "nancumprod"):
    _rows = PRODUCT if "prod" in _name else ROUNDED
    CASES[f"np.{_name}"] = Case(_along(getattr(np, _name), _rows))
CASES["Array.cumsum"] = Case(_along(_method("cumsum"), ROUNDED))
CASES["Array.cumprod"] = Case(_along(_method("cumprod"), PRODUCT))


@case("tw.cumreduction", rule=ROUNDED)
def _cumreduction(p: Point, o: Operands) -> list[Call]:
    return [
        Call(
            "np.cumsum, np.add, 0",
            lambda o: tw.cumreduction(np.cumsum, np.add, 0, o.x, axis=0),
            oracle=lambda o: np.cumsum(o.x, axis=0),
        ),
        Call(
            "np.cumsum, np.add, 0, preop=np.sum",
            lambda o: tw.cumreduction(np.cumsum, np.add, 0, o.x, axis=0, preop=np.sum),
            oracle=lambda o: np.cumsum(o.x, axis=0),
        ),
        Call(
            "axis=1",
            lambda o: tw.cumreduction(np.cumsum, np.add, 0, o.x, axis=1),
            oracle=lambda o: np.cumsum(o.x, axis=1),
            refused=ValueError,
        ),
    ]


def _filled(x: np.ndarray, limit: int | None, backward: bool) -> np.ndarray:
    """bottleneck's ``push`` along the rows, written out: each NaN takes the last
    value above it (below, ``backward``) that is not NaN, at most ``limit`` rows away."""
    out = np.array(x)
    if out.dtype.kind not in "fc" or not out.shape[0]:
        return out
    flat = out.reshape(out.shape[0], -1)
    rows = range(flat.shape[0] - 1, -1, -1) if backward else range(flat.shape[0])
    for j in range(flat.shape[1]):
        last, at = None, 0
        for i in rows:
            if not np.isnan(flat[i, j]):
                last, at = flat[i, j], i
            elif last is not None and (limit is None or abs(i - at) <= limit):
                flat[i, j] = last
    return out


@case("tw.ffill", "tw.bfill")
def _fills(p: Point, o: Operands) -> list[Call]:
    out = []
    for backward, fill in ((False, tw.ffill), (True, tw.bfill)):
        for limit in (None, 0, 2):
            out.append(
                Call(
                    f"{fill.__name__}(limit={limit})",
                    lambda o, f=fill, k=limit: f(o.x, limit=k),
                    oracle=lambda o, b=backward, k=limit: _filled(o.x, k, b),
                )
            )
    return out


@case("np.pad")
def _pad(p: Point, o: Operands) -> list[Call]:
    trailing = [(0, 0)] * (p.ndim - 1)
    out = [
        Call("rows (2, 1), constant", lambda o: np.pad(o.x, [(2, 1), *trailing])),
        Call(
            "rows (1, 3), constant_values=5",
            lambda o: np.pad(o.x, [(1, 3), *trailing], constant_values=5),
        ),
        Call("rows 0", lambda o: np.pad(o.x, 0)),
    ]
    for mode in ("edge", "symmetric", "wrap", "reflect"):
        most = {"reflect": 1}.get(mode, 2)  # NumPy pads further; tierflow up to the rows
        refused = None if p.rows > most else ValueError
        if p.mask != "mask_none":
            refused = lambda o, m=most: None if len(o.x) > m else ValueError  # noqa: E731
        out.append(
            Call(
                f"rows (2, 1), {mode}",
                lambda o, m=mode: np.pad(o.x, [(2, 1), *trailing], mode=m),
                refused=refused,
            )
        )
    if p.ndim == 2:
        out.append(Call("trailing (1, 2)", lambda o: np.pad(o.x, [(0, 0), (1, 2)])))
        out.append(
            Call(
                "both, edge",
                lambda o: np.pad(o.x, 1, mode="edge"),
                refused=None if p.rows > 1 else ValueError,
            )
        )
    out.append(
        Call("mean", lambda o: np.pad(o.x, [(1, 1), *trailing], mode="mean"), refused=ValueError)
    )
    return out


@case("np.moveaxis", rule=ROUNDED)
def _moveaxis(p: Point, o: Operands) -> list[Call]:
    out = [Call("0 to 0", lambda o: np.moveaxis(o.x, 0, 0))]
    if p.ndim == 2:
        out.append(
            Call(
                "rows last, then summed over them",
                lambda o: np.sum(np.moveaxis(o.x, 0, -1), axis=-1),
                oracle=lambda o: np.sum(np.moveaxis(o.x, 0, -1), axis=-1),
            )
        )
        out.append(
            Call("rows last, then back", lambda o: np.moveaxis(np.moveaxis(o.x, 0, 1), 1, 0))
        )
    return out


@case("np.flip")
def _flip(p: Point, o: Operands) -> list[Call]:
    out = [
        Call("every axis", lambda o: np.flip(o.x)),
        Call("the rows", lambda o: np.flip(o.x, 0)),
        Call("axis 5", lambda o: np.flip(o.x, 5), refused=np.exceptions.AxisError),
    ]
    if p.ndim == 2:
        out.append(Call("the last axis", lambda o: np.flip(o.x, -1)))
        out.append(Call("reversed twice, summed", lambda o: np.sum(np.flip(np.flip(o.x, 0)), 0)))
    return out


@case("np.flipud")
def _flipud(p: Point, o: Operands) -> list[Call]:
    return [Call("the rows", lambda o: np.flipud(o.x))]


@case("np.lib.stride_tricks.sliding_window_view")
def _windows(p: Point, o: Operands) -> list[Call]:
    view = np.lib.stride_tricks.sliding_window_view
    out = [Call("window 1 along the rows", lambda o: view(o.x, 1, axis=0))]
    out.append(
        Call(
            "window 3 along the rows",
            lambda o: view(o.x, 3, axis=0),
            refused=lambda o: None if len(o.x) >= 3 else ValueError,
        )
    )
    if p.ndim == 2:
        out.append(Call("window 2 along axis 1", lambda o: view(o.x, 2, axis=1)))
    return out


@case("np.diff")
def _diff(p: Point, o: Operands) -> list[Call]:
    out = [Call("axis=0", lambda o: np.diff(o.x, axis=0), refused=ValueError)]
    if p.ndim == 2:
        out += [
            Call("(default axis -1)", lambda o: np.diff(o.x)),
            Call("axis=1, n=2", lambda o: np.diff(o.x, n=2, axis=1)),
            Call("axis=1, prepend=0", lambda o: np.diff(o.x, axis=1, prepend=0)),
            Call("axis=1, append=5", lambda o: np.diff(o.x, axis=1, append=5)),
            Call(
                "axis=1, append=zeros (n, 1)",
                lambda o: np.diff(o.x, axis=1, append=np.zeros((o.n, 1))),
            ),
        ]
    return out


@case("Array.along")
def _along_method(p: Point, o: Operands) -> list[Call]:
    fns = {"sort": np.sort, "cumsum": np.cumsum, "diff": np.diff, "nancumprod": np.nancumprod}
    out = []
    for name, fn in fns.items():
        for a in trailing(p):
            out.append(
                Call(
                    f"{name}, axis={a}",
                    lambda o, n=name, a=a: o.x.along(n, a),
                    oracle=lambda o, f=fn, a=a: f(o.x, axis=a),
                )
            )
    out.append(
        Call(
            "sort, axis=0",
            lambda o: o.x.along("sort", 0),
            oracle=lambda o: np.sort(o.x, axis=0),
            refused=sortable_rows(p),
        )
    )
    out.append(
        Call(
            "cumsum, axis=0",
            lambda o: o.x.along("cumsum", 0),
            oracle=lambda o: np.cumsum(o.x, axis=0),
            rule=ROUNDED,
        )
    )
    return out


# -- elementwise functions ------------------------------------------------------------------


@case("np.where", "tw.where", rule=SIGNED)
def _where(p: Point, o: Operands) -> list[Call]:
    return [
        Call("y != 0, x, y", lambda o: np.where(o.y != 0, o.x, o.y)),
        Call("x != 0, x, 5", lambda o: np.where(o.x != 0, o.x, 5)),
        Call("x != 0, row, x", lambda o: np.where(o.x != 0, o.row, o.x)),
        Call(
            "tw: y != 0, x, y",
            lambda o: tw.where(o.y != 0, o.x, o.y),
            oracle=lambda o: np.where(o.y != 0, o.x, o.y),
        ),
        Call("x != 0 alone", lambda o: np.where(o.x != 0), refused=TypeError),
    ]


@case("np.clip", "Array.clip", rule=SIGNED)
def _clip(p: Point, o: Operands) -> list[Call]:
    return [
        Call("-2, 3", lambda o: np.clip(o.x, -2, 3)),
        Call("None, 2", lambda o: np.clip(o.x, None, 2)),
        Call("row, None", lambda o: np.clip(o.x, o.row, None)),
        Call("y, 4", lambda o: np.clip(o.x, o.y, 4)),
        Call("None, None", lambda o: np.clip(o.x, None, None)),
        Call("method: 0, 1", lambda o: o.x.clip(0, 1)),
        Call("method: min=-1", lambda o: o.x.clip(min=-1)),
    ]


# NumPy rounds integers to tens in float64 and casts back (conformance.Rule).
@case(
    "np.round",
    "np.around",
    "Array.round",
    "Array.__round__",
    rule=Rule(signed=True, cast_back=True),
)
def _round(p: Point, o: Operands) -> list[Call]:
    return [
        Call("decimals=0", lambda o: np.round(o.x)),
        Call("decimals=1", lambda o: np.round(o.x, 1)),
        Call("decimals=-1", lambda o: np.around(o.x, -1)),
        Call("method: decimals=2", lambda o: o.x.round(2)),
        Call(
            "round(x)",
            lambda o: round(o.x),
            oracle=lambda o: np.round(o.x),
        ),
    ]


_CASTS = ("bool", "int8", "uint16", "int64", "float16", "float32", "float64", "complex64", ">f8")


@case("np.astype", "Array.astype", rule=SIGNED)
def _astype(p: Point, o: Operands) -> list[Call]:
    return [Call(f"np.astype {t}", lambda o, t=t: np.astype(o.x, t)) for t in _CASTS] + [
        Call(f"method {t}", lambda o, t=t: o.x.astype(t)) for t in _CASTS
    ]


# -- products -------------------------------------------------------------------------------


def _products(fn: Callable[[Any, Any], Any]) -> Calls:
    def calls(p: Point, o: Operands) -> list[Call]:
        out = [
            Call("vector (n,) @ x", lambda o: fn(vector(o), o.x)),
            Call(
                "x.T @ y", lambda o: fn(np.transpose(o.x), o.y) if o.x.ndim == 2 else fn(o.x, o.y)
            ),
        ]
        if p.ndim == 2:
            out += [
                Call("x @ w (k, 2)", lambda o: fn(o.x, weights(p))),
                Call("x @ row (k,)", lambda o: fn(o.x, o.row)),
                Call("x.T @ x", lambda o: fn(o.x.T, o.x)),
                Call("x.T @ vector (n,)", lambda o: fn(o.x.T, vector(o))),
                Call("x.T @ ones (n, 1)", lambda o: fn(o.x.T, np.ones((o.n, 1)))),
            ]
        else:
            out += [
                Call("x @ y (1-D)", lambda o: fn(o.x, o.y)),
                Call("x @ vector (n,)", lambda o: fn(o.x, vector(o))),
            ]
        return out

    return calls


CASES["np.dot"] = Case(_products(np.dot), PRODUCTS)
CASES["np.matmul"] = Case(_products(np.matmul), PRODUCTS)
CASES["Array.__matmul__"] = Case(_products(operator.matmul), PRODUCTS)


@case("Array.dot", rule=PRODUCTS)
def _dot_method(p: Point, o: Operands) -> list[Call]:
    if p.ndim == 1:
        return [
            Call("x.dot(y)", lambda o: o.x.dot(o.y)),
            Call("x.dot(vector)", lambda o: o.x.dot(vector(o))),
            Call("x.dot(2)", lambda o: o.x.dot(2)),
        ]
    return [
        Call("x.dot(w)", lambda o: o.x.dot(weights(p))),
        Call("x.dot(row)", lambda o: o.x.dot(o.row)),
    ]


@case("Array.__rmatmul__", rule=PRODUCTS)
def _rmatmul(p: Point, o: Operands) -> list[Call]:
    return [
        Call("vector (n,) @ x", lambda o: vector(o) @ o.x),
        Call("ones (2, n) @ x", lambda o: np.ones((2, o.n)) @ o.x),
    ]


@case("np.transpose", "Array.transpose", "Array.T", rule=PRODUCTS)
def _transpose(p: Point, o: Operands) -> list[Call]:
    out = [
        Call("np.transpose(x) @ y", lambda o: np.transpose(o.x) @ o.y),
        Call("x.T @ y", lambda o: o.x.T @ o.y),
        Call("x.transpose() @ x", lambda o: o.x.transpose() @ o.x),
    ]
    if p.ndim == 2:
        out += [
            Call("np.transpose(x, (0, 1)) (rows kept)", lambda o: np.transpose(o.x, (0, 1))),
            Call("x.T + 1 (not on the left of @)", lambda o: o.x.T + 1, refused=TypeError),
        ]
    return out


@case("np.vecdot", "np.matvec", "np.vecmat")
def _vector_products(p: Point, o: Operands) -> list[Call]:
    # Gufuncs other than matmul: only elementwise ufuncs fuse (docs/engine.md).
    return [
        Call("vecdot(x, y)", lambda o: np.vecdot(o.x, o.y), refused=TypeError),
        Call(
            "matvec(x[..., None], row)",
            lambda o: np.matvec(o.x[..., None], o.row[..., None]),
            refused=TypeError,
        ),
        Call("vecmat(x, w)", lambda o: np.vecmat(o.x, weights(p)), refused=TypeError),
    ]


@case("np.cov", "np.corrcoef", rule=PRODUCTS)
def _covariances(p: Point, o: Operands) -> list[Call]:
    fns = {"cov": np.cov, "corrcoef": np.corrcoef}
    out: list[Call] = []
    for name, fn in fns.items():
        out += [
            Call(f"{name}(x, rowvar=False)", lambda o, f=fn: f(o.x, rowvar=False)),
            Call(f"{name}(x, y, rowvar=False)", lambda o, f=fn: f(o.x, o.y, rowvar=False)),
        ]
        if p.ndim == 1:
            out.append(Call(f"{name}(x)", lambda o, f=fn: f(o.x)))
        else:
            out.append(Call(f"{name}(x) (rowvar=True)", lambda o, f=fn: f(o.x), refused=_many_rows))
    out += [
        Call("cov(x, rowvar=False, ddof=0)", lambda o: np.cov(o.x, rowvar=False, ddof=0)),
        Call("cov(x, rowvar=False, bias=True)", lambda o: np.cov(o.x, rowvar=False, bias=True)),
    ]
    return out


def _many_rows(o: Operands) -> type[BaseException] | None:
    """np.cov(x) with rowvar=True makes each row a variable: refused where the rows are
    unknown (after a mask) or more than products.SMALL_ROWVAR."""
    rows = o.x.shape[0]
    return ValueError if rows is None or rows > products.SMALL_ROWVAR else None


@case("np.linalg.norm", rule=SQUARES)
def _norm(p: Point, o: Operands) -> list[Call]:
    norm = np.linalg.norm
    out = [
        Call("", lambda o: norm(o.x)),
        Call("axis=0", lambda o: norm(o.x, axis=0)),
        Call("ord=1, axis=0", lambda o: norm(o.x, ord=1, axis=0)),
        Call("ord=inf, axis=0", lambda o: norm(o.x, ord=np.inf, axis=0)),
        Call("ord=-inf, axis=0", lambda o: norm(o.x, ord=-np.inf, axis=0)),
        Call("ord=0, axis=0", lambda o: norm(o.x, ord=0, axis=0)),
        Call("ord=3, axis=0, keepdims", lambda o: norm(o.x, ord=3, axis=0, keepdims=True)),
    ]
    if p.ndim == 2:
        out += [
            Call("axis=1", lambda o: norm(o.x, axis=1)),
            Call("ord='fro'", lambda o: norm(o.x, ord="fro")),
            Call("ord=1 (matrix)", lambda o: norm(o.x, ord=1)),
            Call("ord=inf (matrix)", lambda o: norm(o.x, ord=np.inf)),
            Call(
                "ord=2 (matrix)",
                lambda o: norm(o.x, ord=2),
                # Refused (singular values over the rows); float16, NumPy's TypeError.
                refused=None if p.native == np.float16 else ValueError,
            ),
        ]
    return out


@case("np.einsum", rule=PRODUCTS)
def _einsum(p: Point, o: Operands) -> list[Call]:
    if p.ndim == 1:
        return [
            Call("i->", lambda o: np.einsum("i->", o.x)),
            Call("i,i->", lambda o: np.einsum("i,i->", o.x, o.y)),
            Call("i->i", lambda o: np.einsum("i->i", o.x)),
            Call("i,i->i", lambda o: np.einsum("i,i->i", o.x, o.y)),
        ]
    return [
        Call("ij->j", lambda o: np.einsum("ij->j", o.x)),
        Call("ij->i", lambda o: np.einsum("ij->i", o.x)),
        Call("ij->", lambda o: np.einsum("ij->", o.x)),
        Call("ij,ij->j", lambda o: np.einsum("ij,ij->j", o.x, o.y)),
        Call("ij,ik->jk", lambda o: np.einsum("ij,ik->jk", o.x, o.y)),
        Call("ij,j->i", lambda o: np.einsum("ij,j->i", o.x, o.row)),
        Call("ij->ji (row axis moved)", lambda o: np.einsum("ij->ji", o.x), refused=ValueError),
    ]


# -- joining and shaping ----------------------------------------------------------------------


@case("np.concatenate", "tw.concatenate", rule=SIGNED)
def _concatenate(p: Point, o: Operands) -> list[Call]:
    out = [
        Call("[x, y]", lambda o: np.concatenate([o.x, o.y])),
        Call("[x, y, x], axis=0", lambda o: np.concatenate([o.x, o.y, o.x], axis=0)),
        Call("[x, y], dtype=float64", lambda o: np.concatenate([o.x, o.y], dtype=np.float64)),
        Call(
            "tw: [x, y]",
            lambda o: tw.concatenate([o.x, o.y]),
            oracle=lambda o: np.concatenate([o.x, o.y]),
        ),
        Call(
            "[x, y], axis=None", lambda o: np.concatenate([o.x, o.y], axis=None), refused=TypeError
        ),
    ]
    if p.ndim == 2:
        out += [
            Call("[x, y], axis=1", lambda o: np.concatenate([o.x, o.y], axis=1)),
            Call(
                "tw: [x, x], axis=-1",
                lambda o: tw.concatenate([o.x, o.x], axis=-1),
                oracle=lambda o: np.concatenate([o.x, o.x], axis=-1),
            ),
        ]
    return out


@case("np.stack", "tw.stack", rule=SIGNED)
def _stack(p: Point, o: Operands) -> list[Call]:
    return [
        Call("[x, y], axis=1", lambda o: np.stack([o.x, o.y], axis=1)),
        Call("[x, y], axis=-1", lambda o: np.stack([o.x, o.y], axis=-1)),
        Call("[x, y], axis=1, dtype=float32", lambda o: np.stack([o.x, o.y], 1, dtype=np.float32)),
        Call(
            "tw: [x, y, x]",
            lambda o: tw.stack([o.x, o.y, o.x]),
            oracle=lambda o: np.stack([o.x, o.y, o.x], axis=1),
        ),
        Call("[x, y] (axis 0)", lambda o: np.stack([o.x, o.y]), refused=ValueError),
    ]


@case("np.vstack", "np.hstack", "np.column_stack", rule=SIGNED)
def _stacks(p: Point, o: Operands) -> list[Call]:
    out = [
        Call("hstack([x, y])", lambda o: np.hstack([o.x, o.y])),
        Call("column_stack([x, y])", lambda o: np.column_stack([o.x, o.y])),
        Call("hstack([x, y], dtype=float32)", lambda o: np.hstack([o.x, o.y], dtype=np.float32)),
    ]
    if p.ndim == 2:
        out.append(Call("vstack([x, y])", lambda o: np.vstack([o.x, o.y])))
    else:
        # Two 1-D arrays stacked as rows: each becomes one row (mixes the rows).
        out.append(
            Call("vstack([x, y]) (1-D)", lambda o: np.vstack([o.x, o.y]), refused=ValueError)
        )
    return out


@case("np.reshape", "Array.reshape", rule=SIGNED)
def _reshape(p: Point, o: Operands) -> list[Call]:
    n = o.n
    out = [
        Call("(n, *row, 1)", lambda o: np.reshape(o.x, (o.n, *p.row_shape, 1))),
        Call("(-1, *row)", lambda o: np.reshape(o.x, (-1, *p.row_shape))),
        Call("method: (n, -1)", lambda o: o.x.reshape(o.n, -1)),
        Call(f"({n + 1}, -1) (wrong rows)", lambda o: np.reshape(o.x, (o.n + 1, -1))),
    ]
    if p.row_shape == (3,):
        out.append(
            Call(
                "(-1,) (mixes rows)",
                lambda o: np.reshape(o.x, (-1,)),
                refused=_refused_with_rows(ValueError),
            )
        )
    else:
        out.append(Call("(-1,)", lambda o: np.reshape(o.x, (-1,))))
    return out


@case("np.shape", "np.ndim", "np.size")
def _metadata(p: Point, o: Operands) -> list[Call]:
    return [
        Call("np.shape (counted)", lambda o: np.shape(counted(o.x))),
        Call("np.ndim", lambda o: np.ndim(o.x)),
        Call("np.size (counted)", lambda o: np.size(counted(o.x))),
        Call("np.size(axis=-1)", lambda o: np.size(o.x, axis=-1)),
    ]


# -- tw.linalg --------------------------------------------------------------------------------


def _tall_dtype(a: np.ndarray) -> np.dtype:
    return (
        np.dtype(np.float32)
        if a.dtype.kind == "f" and a.dtype.itemsize <= 4
        else np.dtype(np.float64)
    )


def _flip_rows(r: np.ndarray) -> np.ndarray:
    signs = np.sign(np.diag(r)) if r.size else np.ones(0)
    signs[signs == 0] = 1
    return r * signs[:, None]


def _numpy_r(o: Operands) -> np.ndarray:
    a = o.x.astype(_tall_dtype(o.x))
    return _flip_rows(np.linalg.qr(a, mode="r"))


@case(
    "tw.linalg.qr",
    "tw.linalg.svd",
    "tw.linalg.pca",
    rule=Rule("sums", power=2, blas=True, lapack=True),
)
def _linalg(p: Point, o: Operands) -> list[Call]:
    complex_ = TypeError if p.kind == "c" else None
    if p.ndim == 1:
        return [Call("qr of a 1-D array", lambda o: tw.linalg.qr(o.x), refused=ValueError)]
    return [
        Call(
            "qr(x, mode='r')",
            lambda o: tw.linalg.qr(o.x, mode="r"),
            oracle=_numpy_r,
            post=lambda r: _flip_rows(np.asarray(r)),
            refused=complex_,
        ),
        Call(
            "svd(x, compute_uv=False)",
            lambda o: tw.linalg.svd(o.x, compute_uv=False),
            oracle=lambda o: np.linalg.svd(o.x.astype(_tall_dtype(o.x)), compute_uv=False),
            refused=complex_,
        ),
        Call(
            "pca(x): explained variance",
            lambda o: tw.linalg.pca(o.x).explained_variance,
            oracle=lambda o: _numpy_explained_variance(o.x),
            refused=complex_,
        ),
    ]


def _numpy_explained_variance(a: np.ndarray) -> np.ndarray:
    if len(a) < 2:
        raise ValueError("pca needs two rows")
    centred = a.astype(np.float64) - a.astype(np.float64).mean(axis=0)
    s = np.linalg.svd(centred, compute_uv=False)
    return (s**2 / (len(a) - 1)).astype(_tall_dtype(a))


# -- selection ---------------------------------------------------------------------------------


@case("Array.__getitem__", rule=SIGNED)
def _getitem(p: Point, o: Operands) -> list[Call]:
    out = [
        Call("[2:9:3]", lambda o: o.x[2:9:3]),
        Call("[::-1]", lambda o: o.x[::-1]),
        Call("[-5:]", lambda o: o.x[-5:]),
        Call("[::-2][1:]", lambda o: o.x[::-2][1:]),
        Call("[-1]", lambda o: o.x[-1]),
        Call("[3]", lambda o: o.x[3]),
        Call("[positions]", lambda o: o.x[positions(o)]),
        Call("[sorted positions]", lambda o: o.x[np.sort(positions(o))]),
        Call("[positions + n] (out of range)", lambda o: o.x[positions(o)[:1] + o.n]),
        Call("[y != 0] (mask by another array)", lambda o: o.x[first_values(o.y) != 0]),
        Call("[...]", lambda o: o.x[...]),
    ]
    if p.ndim == 2:
        out += [
            Call("[:, 0]", lambda o: o.x[:, 0]),
            Call("[:, [0, -1]]", lambda o: o.x[:, [0, -1]]),
            Call("[..., 1:]", lambda o: o.x[..., 1:]),
            Call("[1:, -1]", lambda o: o.x[1:, -1]),
        ]
    return out


@case("Array.take")
def _take(p: Point, o: Operands) -> list[Call]:
    out = [Call("positions, axis=0", lambda o: o.x.take(positions(o), axis=0))]
    if p.ndim == 2:
        out += [
            Call("[0, -1], axis=1", lambda o: o.x.take([0, -1], axis=1)),
            Call("positions (no axis)", lambda o: o.x.take(positions(o)), refused=ValueError),
        ]
    else:
        out.append(Call("positions (no axis)", lambda o: o.x.take(positions(o))))
    return out


@case("Array.compress")
def _compress(p: Point, o: Operands) -> list[Call]:
    out = [Call("every 3rd row, axis=0", lambda o: o.x.compress(np.arange(o.n) % 3 == 0, axis=0))]
    if p.ndim == 2:
        out.append(
            Call(
                "[True, False, True], axis=1",
                lambda o: o.x.compress([True, False, True][: o.x.shape[1]], axis=1),
            )
        )
    else:
        out.append(Call("every 2nd row (no axis)", lambda o: o.x.compress(np.arange(o.n) % 2 == 0)))
    return out


@case("Array.repeat")
def _repeat(p: Point, o: Operands) -> list[Call]:
    out = [Call("2 (no axis)", lambda o: o.x.repeat(2), refused=ValueError)]
    if p.ndim == 2:
        out.append(Call("2, axis=1", lambda o: o.x.repeat(2, axis=1)))
    return out


@case("Array.swapaxes", "Array.diagonal", "Array.trace")
def _two_axes(p: Point, o: Operands) -> list[Call]:
    # Two trailing axes need three dimensions; the corpus has two: these mix rows.
    out = [
        Call(
            "swapaxes(-1, -1)",
            lambda o: o.x.swapaxes(-1, -1) if o.x.ndim > 1 else o.x.swapaxes(0, 0),
            refused=ValueError if p.ndim == 1 else None,
        ),
    ]
    if p.ndim == 2:
        out += [
            Call("swapaxes(0, 1)", lambda o: o.x.swapaxes(0, 1), refused=ValueError),
            Call("diagonal()", lambda o: o.x.diagonal(), refused=ValueError),
            Call("trace()", lambda o: o.x.trace(), refused=ValueError),
            Call(
                "x[..., None] diagonal(axis1=1, axis2=2)",
                lambda o: o.x[..., None].diagonal(axis1=1, axis2=2),
            ),
            Call(
                "x[..., None] trace(axis1=1, axis2=2)",
                lambda o: o.x[..., None].trace(axis1=1, axis2=2),
            ),
        ]
    return out


@case("Array.squeeze")
def _squeeze(p: Point, o: Operands) -> list[Call]:
    out = [Call("()", lambda o: o.x.squeeze())]
    if p.row_shape == (1,):
        out.append(Call("axis=1", lambda o: o.x.squeeze(axis=1)))
    if p.ndim == 2:
        out.append(Call("axis=-1", lambda o: o.x.squeeze(axis=-1)))
    return out


@case("Array.ravel")
def _ravel(p: Point, o: Operands) -> list[Call]:
    return [Call("()", lambda o: o.x.ravel(), refused=ValueError if p.ndim == 2 else None)]


@case("Array.view")
def _view(p: Point, o: Operands) -> list[Call]:
    # A view to another item size changes a 1-D array's rows: refused (a lazy array
    # keeps its rows; ndarray_methods.view).
    resized = ValueError if p.ndim == 1 else None
    out = [
        Call(
            "uint8",
            lambda o: o.x.view(np.uint8),
            refused=resized if p.native.itemsize > 1 else None,
        ),
        Call("same dtype", lambda o: o.x.view(o.x.dtype)),
    ]
    if p.native.itemsize >= 2:
        order = np.dtype(p.dtype).byteorder
        out.append(
            Call(
                "int16 of the same order",
                lambda o: o.x.view(np.dtype("i2").newbyteorder(order)),
                refused=resized if p.native.itemsize > 2 else None,
            )
        )
    return out


@case("Array.filter")
def _filter(p: Point, o: Operands) -> list[Call]:
    def keep(b: np.ndarray) -> np.ndarray:
        return first_values(b) != 0

    return [Call("first value != 0", lambda o: o.x.filter(keep), oracle=lambda o: o.x[keep(o.x)])]


@case("Array.head")
def _head(p: Point, o: Operands) -> list[Call]:
    return [
        Call(f"head({k})", lambda o, k=k: o.x.head(k), oracle=lambda o, k=k: o.x[:k])
        for k in (0, 3, 30)
    ] + [Call("head()", lambda o: o.x.head(), oracle=lambda o: o.x[:5])]


@case("Array.rechunk")
def _rechunk(p: Point, o: Operands) -> list[Call]:
    return [
        Call(f"rechunk({k})", lambda o, k=k: o.x.rechunk(k), oracle=lambda o: o.x) for k in (1, 5)
    ]


# -- blockwise and user reductions ---------------------------------------------------------


@case("Array.map_blocks", rule=SIGNED)
def _map_blocks(p: Point, o: Operands) -> list[Call]:
    return [
        Call("b * 2", lambda o: o.x.map_blocks(lambda b: b * 2), oracle=lambda o: o.x * 2),
        Call(
            "np.add with y, dtype and row_shape",
            lambda o: o.x.map_blocks(
                np.add, o.y, dtype=np.add(o.x[:0], o.y[:0]).dtype, row_shape=p.row_shape
            ),
            oracle=lambda o: np.add(o.x, o.y),
        ),
        Call(
            "first values as a column",
            lambda o: o.x.map_blocks(lambda b: first_values(b)[:, None]),
            oracle=lambda o: first_values(o.x)[:, None],
        ),
    ]


def _shifted(x: np.ndarray) -> np.ndarray:
    """Each row replaced by the row above it (the first kept)."""
    return np.concatenate([x[:1], x[:-1]])


@case("Array.map_overlap", rule=SIGNED)
def _map_overlap(p: Point, o: Operands) -> list[Call]:
    return [
        Call(
            "np.roll by 1, depth 1, periodic",
            lambda o: o.x.map_overlap(
                lambda b: np.roll(b, 1, axis=0), depth=1, boundary="periodic"
            ),
            oracle=lambda o: np.roll(o.x, 1, axis=0),
        ),
        Call(
            "the row above, depth (1, 0), nearest",
            lambda o: o.x.map_overlap(_shifted, depth=(1, 0), boundary="nearest"),
            oracle=lambda o: _shifted(o.x),
        ),
        Call(
            "with y, depth 2, reflect",
            lambda o: o.x.map_overlap(
                lambda b, c: np.roll(b, -2, axis=0) + np.roll(c, 2, axis=0),
                o.y,
                depth=2,
                boundary="reflect",
            ),
            oracle=_rolled_reflected,
        ),
    ]


def _rolled_reflected(o: Operands) -> np.ndarray:
    """Rows 2 below in x plus rows 2 above in y, each mirrored past its ends (no rows:
    none, where np.pad refuses to mirror)."""
    if o.n == 0:
        return o.x + o.y

    def pad(a: np.ndarray) -> np.ndarray:
        return np.pad(a, [(2, 2)] + [(0, 0)] * (a.ndim - 1), "symmetric")

    return (np.roll(pad(o.x), -2, 0) + np.roll(pad(o.y), 2, 0))[2 : 2 + o.n]


@case("Array.reduction")
def _reduction_method(p: Point, o: Operands) -> list[Call]:
    return [
        Call(
            "rows counted",
            lambda o: o.x.reduction(lambda b: np.array(len(b)), np.add, dtype=np.int64, shape=()),
            oracle=lambda o: np.array(len(o.x)),
        ),
        Call(
            "largest offset, with_offset",
            lambda o: o.x.reduction(
                lambda b, off: np.array(off + len(b)),
                np.maximum,
                with_offset=True,
                dtype=np.int64,
                shape=(),
            ),
            oracle=lambda o: np.array(len(o.x)),
        ),
        Call(
            "first values, commutative=False",
            lambda o: o.x.reduction(
                lambda b: first_values(b)[:2].real.astype(np.float64),
                lambda a, b: np.concatenate([a, b])[:2],
                commutative=False,
                dtype=np.float64,
                shape=(2,),
            ),
            oracle=lambda o: first_values(o.x)[:2].real.astype(np.float64),
        ),
    ]


# -- conversions and metadata ----------------------------------------------------------------


@case("Array.real", "Array.imag", "Array.conj", "Array.conjugate", "Array.copy", rule=SIGNED)
def _parts(p: Point, o: Operands) -> list[Call]:
    return [
        Call("x.real", lambda o: o.x.real),
        Call("x.imag", lambda o: o.x.imag),
        Call("x.conj()", lambda o: o.x.conj()),
        Call("x.conjugate()", lambda o: o.x.conjugate()),
        Call("x.copy()", lambda o: o.x.copy()),
    ]


@case("Array.dtype", "Array.ndim", "Array.shape", "Array.size", "Array.nbytes", "Array.itemsize")
def _attributes(p: Point, o: Operands) -> list[Call]:
    return [
        Call("dtype", lambda o: o.x.dtype),
        Call("ndim", lambda o: o.x.ndim),
        Call("shape (counted)", lambda o: counted(o.x).shape),
        Call("size (counted)", lambda o: counted(o.x).size),
        Call("nbytes (counted)", lambda o: counted(o.x).nbytes),
        Call("itemsize", lambda o: o.x.itemsize),
    ]


@case("Array.device", "Array.to_device")
def _device(p: Point, o: Operands) -> list[Call]:
    return [
        Call("device", lambda o: o.x.device),
        Call("to_device('cpu')", lambda o: o.x.to_device("cpu")),
    ]


@case("Array.item", "Array.tolist", rule=SIGNED)
def _python(p: Point, o: Operands) -> list[Call]:
    return [
        Call("item()", lambda o: o.x.item()),
        Call("item(0)", lambda o: o.x.item(0)),
        Call("item(-1)", lambda o: o.x.item(-1)),
        Call("tolist()", lambda o: o.x.tolist()),
    ]


@case(
    "Array.compute", "Array.persist", "Array.to_npy", "Array.to_zarr", "Array.to_dask", rule=SIGNED
)
def _sinks(p: Point, o: Operands) -> list[Call]:
    return [
        Call("compute()", lambda o: o.x.compute(progress=False), oracle=lambda o: o.x),
        Call("persist()", lambda o: o.x.persist(progress=False), oracle=lambda o: o.x),
        Call("to_npy()", lambda o: _through_npy(o.x), oracle=lambda o: o.x),
        Call("to_zarr()", lambda o: _through_zarr(o.x), oracle=lambda o: o.x),
        Call("to_dask()", lambda o: o.x.to_dask().compute(scheduler="sync"), oracle=lambda o: o.x),
    ]


@case("tw.compute", "tw.persist", "tw.to_npy", rule=SIGNED)
def _sink_functions(p: Point, o: Operands) -> list[Call]:
    return [
        Call(
            "compute(x, y)",
            lambda o: tw.compute(o.x, o.y, progress=False),
            oracle=lambda o: (o.x, o.y),
        ),
        Call("persist(x)", lambda o: tw.persist(o.x, progress=False), oracle=lambda o: o.x),
        Call("to_npy(x)", lambda o: _through_npy(o.x, tw.to_npy), oracle=lambda o: o.x),
    ]


def _through_npy(x: tw.Array, write: Callable[..., None] = tw.Array.to_npy) -> np.ndarray:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "out.npy"
        write(x, path, progress=False)
        return np.load(path)


def _through_zarr(x: tw.Array) -> np.ndarray:
    import zarr

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "out.zarr"
        x.to_zarr(path, progress=False)
        return zarr.open_array(path, mode="r")[...]


# -- generic entries: ufuncs and operators -------------------------------------------------------

_SCALARS: tuple[Any, ...] = (3, -2.5)


def ufunc_case(ufunc: np.ufunc) -> Case | None:
    """The case of an elementwise ufunc (None for a gufunc: those need their own)."""
    if ufunc.signature is not None:
        return None

    def calls(p: Point, o: Operands) -> list[Call]:
        if ufunc.nin == 1:
            return [
                Call("x", lambda o: ufunc(o.x)),
                Call("x, dtype=float64", lambda o: ufunc(o.x, dtype=np.float64)),
            ]
        out = [
            Call("x, y", lambda o: ufunc(o.x, o.y)),
            Call("x, row", lambda o: ufunc(o.x, o.row)),
            Call("row, x", lambda o: ufunc(o.row, o.x)),
        ]
        for s in _SCALARS:
            out.append(Call(f"x, {s!r}", lambda o, s=s: ufunc(o.x, s)))
            out.append(Call(f"{s!r}, x", lambda o, s=s: ufunc(s, o.x)))
        return out

    free_zero = ufunc in (np.maximum, np.minimum, np.fmax, np.fmin)  # ties of 0.0 and -0.0
    return Case(calls, UNSIGNED_ELEMENTWISE if free_zero else ELEMENTWISE)


_PROTOCOLS: dict[str, Callable[..., Any]] = {
    "len": len,
    "bool": bool,
    "int": int,
    "float": float,
    "complex": complex,
    "array": np.asarray,
}


def _python_operator(name: str) -> tuple[Callable[..., Any], bool] | None:
    """The ``operator`` function of a dunder name and whether it is reflected."""
    core = name[2:-2]
    for candidate in (core, core + "_"):
        fn = getattr(operator, candidate, None)
        if callable(fn):
            return fn, False
    if core.startswith("r"):
        for candidate in (core[1:], core[1:] + "_"):
            fn = getattr(operator, candidate, None)
            if callable(fn):
                return fn, True
    return None


_UNARY = frozenset({"neg", "pos", "abs", "invert"})


def operator_case(name: str) -> Case | None:
    """The case of a Python operator or conversion of ``Array`` (``__add__``,
    ``__rsub__``, ``__neg__``, ``__float__``...); None for other names."""
    core = name[2:-2] if name.startswith("__") else ""
    protocol = _PROTOCOLS.get(core)
    if protocol is not None:
        return Case(lambda p, o: [Call(f"{core}(x)", lambda o: protocol(o.x))], SIGNED)
    found = _python_operator(name) if core else None
    if found is None:
        return None
    fn, reflected = found
    if core in _UNARY:
        return Case(lambda p, o: [Call(f"{core} x", lambda o: fn(o.x))], ELEMENTWISE)
    if reflected:
        return Case(
            lambda p, o: [
                Call(f"{s!r} {core[1:]} x", lambda o, s=s: fn(s, o.x)) for s in (*_SCALARS, 2)
            ],
            ELEMENTWISE,
        )

    def calls(p: Point, o: Operands) -> list[Call]:
        out = [
            Call(f"x {core} y", lambda o: fn(o.x, o.y)),
            Call(f"x {core} row", lambda o: fn(o.x, o.row)),
        ]
        out += [Call(f"x {core} {s!r}", lambda o, s=s: fn(o.x, s)) for s in (*_SCALARS, 2)]
        return out

    return Case(calls, ELEMENTWISE)


@case("Array.__iter__")
def _iter(p: Point, o: Operands) -> list[Call]:
    # docs/engine.md: a lazy array is not iterated row by row (compute() first).
    return [Call("list(x)", lambda o: list(o.x), refused=TypeError)]
