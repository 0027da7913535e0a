"""Exact quantiles over all rows: the passes of ``np.quantile``, ``np.percentile``,
``np.median`` and their nan-versions, along the rows (``axis=0``) or over all values
(``axis=None``), and NumPy's interpolation on the values they find. The NumPy functions
themselves (their arguments, the lazy results) are :mod:`tierflow.engine.api.quantiles`.

A quantile is read from a few *order statistics* (the values of given ranks in sorted
order), which :mod:`tierflow.operators.order_stats` finds out of core, as a chain of
reductions over the same rows, each in its own stage (``describe()`` shows them)::

    stage 0   order stats       count, NaN, min, max per column
    stage 1   narrow 1          a histogram per column: the bin of each wanted rank
                                (or, for a small column, its values)
    stage 2.. narrow 2, ...     inside those bins only: a finer histogram, or the few
                                values left, collected
    then      quantile          NumPy's own interpolation on the values found

The number of narrowing passes is fixed in advance by the dtype and the number of
columns (a histogram of ``2**b`` bins cuts ``b`` bits off the width of a range of
keys, and a range of one key is settled): for 8 columns with the default limits, 3
for 32-bit values, 5 for 64-bit ones, 1 or 2 up to 16 bits. Usually the second already
collects the values left and settles every rank; a pass with nothing left open reads
no block. Memory per pass is bounded by :func:`limits_for` (a share of the budget):
histogram counts and collected values, never the column.

The result is NumPy's, bit for bit: the ranks NumPy reads are found by running
NumPy's own index arithmetic (its method table) and the final interpolation is
NumPy's ``_lerp`` / ``mean`` on the values of those ranks, per column, with NumPy's
result dtype (``weak`` promotion for a Python float ``q`` included).
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...operators import order_stats
from ...operators.order_stats import Limits, Search, Stats
from ...system import budget as budget_module
from .. import graph
from ..graph import Chunked, specs
from ..graph.keyed import NOT_KEY
from ..graph.specs import Dtypes, Shapes, Values

__all__ = ["NarrowSpec", "Rule", "StatsSpec", "finish", "limits_for", "passes"]


def _numpy_quantile_module() -> Any:
    """NumPy's module of quantile arithmetic (``_QuantileMethods``, ``_get_indexes``,
    ``_get_gamma``, ``_lerp``): using it makes results match NumPy's bit for bit."""
    try:
        return importlib.import_module("numpy.lib._function_base_impl")
    except ImportError:  # NumPy < 2
        return importlib.import_module("numpy.lib.function_base")


_fb = _numpy_quantile_module()


def limits_for(budget: int) -> Limits:
    """What a narrowing pass may hold under a RAM budget of ``budget`` bytes: a
    sixteenth of it, half for histogram counts and half for collected values. At most
    2**18 counts (2 MiB: a histogram's random increments stay in L2) and 2**23 values
    (64 MiB)."""
    share = max(1 << 16, budget // 16) // 16  # counts and keys are 8 bytes each
    bins = max(1 << 10, min(1 << 18, share))
    return Limits(bins=bins, collect=max(1 << 10, min(1 << 23, share)))


@dataclass(frozen=True)
class Rule:
    """Which NumPy function, with which arguments, on which array: what the passes
    look for and how the result is made from the values found."""

    function: str  # quantile, nanquantile, median, nanmedian
    q: Any  # None for the medians; the q NumPy validated (an ndarray)
    weak_q: bool
    method: str
    flat: bool  # axis=None
    keepdims: bool
    dtype: np.dtype
    row_shape: tuple[int, ...]
    # Made from the fields above: not part of a pass's key.
    out_dtype: np.dtype = field(metadata=NOT_KEY)
    out_shape: tuple[int, ...] = field(metadata=NOT_KEY)

    @property
    def nan(self) -> bool:
        return self.function.startswith("nan")

    @property
    def median(self) -> bool:
        return self.function.endswith("median")

    @property
    def columns(self) -> int:
        return 1 if self.flat else math.prod(self.row_shape)

    # -- ranks and values -------------------------------------------------------------

    def column_result(self, n: int, take: Callable[[np.ndarray], np.ndarray]) -> Any:
        """NumPy's result for one column of ``n`` values (none of them NaN), where
        ``take(indices)`` gives the values of those ranks (negative counts from the end)."""
        if self.median:
            half = n // 2
            kth = np.array([half] if n % 2 else [half - 1, half], np.intp)
            return np.mean(take(kth))
        props = _fb._QuantileMethods[self.method]
        virtual = np.asanyarray(props["get_virtual_index"](n, self.q))
        if props["fix_gamma"] is None:
            whole = True
        else:
            whole = self.method == "linear" and np.issubdtype(virtual.dtype, np.integer)
        if whole:
            return _scalar(take(np.asarray(virtual, np.intp)))
        previous, following = _fb._get_indexes(np.empty(0, self.dtype), virtual, n)
        low, high = _scalar(take(previous)), _scalar(take(following))
        gamma = _fb._get_gamma(virtual, previous, props)
        gamma = float(gamma) if self.weak_q else gamma.reshape(virtual.shape)
        return _fb._lerp(low, high, gamma)

    def masked_median(self, n: int, take: Callable[[np.ndarray], np.ndarray]) -> Any:
        """NumPy's ``nanmedian`` of one column of ``n`` values out of fewer than 600
        rows of a 2-D or wider array: NumPy runs ``np.ma.median`` there, which sums the
        two middle values (the middle one twice for odd ``n``) in the data's dtype for
        floats and halves the sum, and takes their mean otherwise."""
        half, odd = divmod(n, 2)
        pair = take(np.array([half, half] if odd else [half - 1, half], np.intp))
        if self.dtype.kind != "f":
            return np.mean(pair)
        total = np.add.reduce(pair.reshape(2, 1), axis=0)
        np.true_divide(total, 2.0, casting="unsafe", out=total)
        return total[0]

    def ranks(self, n: int) -> list[int]:
        """The ranks (0-based, sorted) :meth:`column_result` reads for ``n`` values."""
        seen: set[int] = set()

        def record(indices: np.ndarray) -> np.ndarray:
            flat = np.asarray(indices, np.int64).reshape(-1)
            seen.update(int(i) % n for i in flat)
            return np.zeros(np.shape(indices), self.dtype)

        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            self.column_result(n, record)
        return sorted(seen)

    def counts(self, stats: Stats) -> np.ndarray:
        """The number of values each column's result is taken over."""
        return stats.valid if self.nan else stats.valid + stats.nans

    def wanted(self, stats: Stats) -> dict[int, list[int]]:
        """The ranks to find, per column (none where the result is NaN or the column
        has no values)."""
        found: dict[int, list[int]] = {}
        by_n: dict[int, list[int]] = {}
        for col in range(self.columns):
            if not self.nan and stats.nans[col]:
                continue
            n = int(stats.valid[col])
            if n:
                found[col] = by_n.setdefault(n, self.ranks(n))
        return found

    def max_ranks(self) -> int:
        """At most how many ranks one column needs."""
        return 2 if self.median else 2 * max(1, int(np.size(self.q)))


def _scalar(values: np.ndarray) -> Any:
    """``arr[index]`` as NumPy gives it: a scalar for a 0-d index."""
    return values[()] if values.ndim == 0 else values


# -- the passes -------------------------------------------------------------------------


@dataclass(frozen=True)
class StatsSpec(specs.ReduceSpec):
    """Pass 1 of a quantile: count, NaN, min and max per column."""

    flat: bool

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return order_stats.ColumnStats(dtypes[0], row_shapes[0], self.flat)

    def label(self) -> str:
        return "order stats" + (" (all values)" if self.flat else " (per column)")


@dataclass(frozen=True, eq=False)
class NarrowSpec(specs.ReduceSpec):
    """Narrowing pass ``level`` (1, 2, ...) of a quantile: its value parameter is the
    previous pass's result (:class:`Stats` for the first, a :class:`Search` after)."""

    rule: Rule
    level: int
    limits: Limits

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        before = values[0]
        search: Search | None
        if isinstance(before, Stats):
            search = Search.start(before, self.rule.wanted(before))
        elif isinstance(before, Search):
            search = before
        else:  # a placeholder while the graph is built
            search = None
        return order_stats.Narrowing(dtypes[0], row_shapes[0], self.rule.flat, search, self.limits)

    def label(self) -> str:
        return f"narrow {self.level}"


def passes(node: Chunked, rule: Rule, limits: Limits | None = None) -> list[graph.Reduce]:
    """The passes of ``rule`` over ``node``, in order: the stats, then each narrowing
    pass (its :class:`~tierflow.operators.order_stats.Search`). ``limits``: what a pass
    may hold (default: :func:`limits_for` the RAM budget)."""
    limits = limits if limits is not None else limits_for(budget_module.budget_bytes())
    found: list[graph.Reduce] = [graph.Reduce(StatsSpec(rule.flat), (node,))]
    count = order_stats.passes_needed(rule.dtype, rule.columns, rule.max_ranks(), limits)
    for level in range(1, count + 1):
        found.append(graph.Reduce(NarrowSpec(rule, level, limits), (node,), (found[-1],)))
    return found


def finish(search: Any, rule: Rule) -> Any:
    """NumPy's result from the last pass's :class:`Search` (zeros of the result's
    dtype and shape for a placeholder)."""
    if not isinstance(search, Search):
        return np.zeros(rule.out_shape, rule.out_dtype)[()]
    stats = search.stats
    counts = rule.counts(stats)
    if int((stats.valid + stats.nans).sum()) == 0:
        return _numpy_empty(rule)
    results = []
    for col in range(rule.columns):
        results.append(_column(rule, search, col, int(counts[col])))
    return _assemble(rule, results)


def _column(rule: Rule, search: Search, col: int, n: int) -> Any:
    stats = search.stats
    nan = rule.dtype.type(np.nan) if rule.dtype.kind == "f" else None
    if not rule.nan and stats.nans[col]:
        shape = () if rule.median else np.shape(rule.q)
        if rule.flat and not shape:  # NumPy gives the NaN it sorted last, as it is
            return nan
        return np.full(shape, nan, rule.out_dtype)[()]
    if n == 0:  # nan-versions: every value of the column is NaN
        warnings.warn("All-NaN slice encountered", RuntimeWarning, stacklevel=4)
        if rule.median:
            return nan
        return np.full(np.shape(rule.q), np.nan, rule.dtype)[()]

    def take(indices: np.ndarray) -> np.ndarray:
        flat = np.asarray(indices, np.int64).reshape(-1) % n
        keys = np.array([search.key(col, int(r)) for r in flat], np.uint64)
        return order_stats.from_keys(keys, rule.dtype).reshape(np.shape(indices))

    rows = int(stats.valid[col] + stats.nans[col])
    if rule.function == "nanmedian" and not rule.flat and rule.row_shape and rows < 600:
        return rule.masked_median(n, take)
    return rule.column_result(n, take)


def _assemble(rule: Rule, results: list[Any]) -> Any:
    """The columns' results as NumPy shapes them (q's axes first, then the row's)."""
    if rule.flat:
        value = results[0]
        if rule.keepdims:
            value = np.asarray(value).reshape(np.shape(value) + (1,) * (1 + len(rule.row_shape)))
        return value
    q_shape = () if rule.median else np.shape(rule.q)
    dtype = rule.out_dtype
    if rule.nan:  # apply_along_axis: the first column's result decides the dtype
        dtype = np.asarray(results[0]).dtype
    out = np.empty((*q_shape, len(results)), dtype)
    for col, value in enumerate(results):
        out[..., col] = value
    shape = (*q_shape, *((1,) if rule.keepdims else ()), *rule.row_shape)
    return out.reshape(shape)


def _numpy_empty(rule: Rule) -> Any:
    """NumPy's own answer (or error) for an array without values."""
    empty = np.empty((0, *rule.row_shape), rule.dtype)
    return _call_numpy(rule, empty)


def _call_numpy(rule: Rule, a: np.ndarray) -> Any:
    axis = None if rule.flat else 0
    fn = getattr(np, rule.function)
    if rule.median:
        return fn(a, axis=axis, keepdims=rule.keepdims)
    q = float(np.asarray(rule.q)) if rule.weak_q else rule.q
    return fn(a, q, axis=axis, method=rule.method, keepdims=rule.keepdims)
