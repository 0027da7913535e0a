"""Exact order statistics of the columns of a row-blocked array, in a few passes.

The k-th smallest value of a column that does not fit in memory is found by narrowing
down, pass by pass, the range of values that holds it (a radix select over the
values' bits), then collecting the few values left:

1. :class:`ColumnStats` (one pass): per column, the count of values, of NaN, and the
   smallest and largest value, as *keys*.
2. :class:`Narrowing` (each later pass): for every wanted rank still open, either a
   histogram of the keys in its range (``2**bits`` bins), which gives the bin holding
   the rank, or, once the range holds few enough values, those values themselves.
   :meth:`Search.after` turns the pass's result into the next, narrower ranges.

Keys are the values mapped to unsigned 64-bit integers in the same order
(:func:`to_keys`): integers shifted, floats by their bits (the sign bit flipped for
positive numbers, all bits for negative ones; ``-0.0`` counts as ``0.0``, NaN is left
out). A histogram bin is a power-of-two run of keys, so its index is a shift, and a
range of ``2**w`` keys is narrowed to one key in at most ``ceil(w / bits)`` histogram
passes: the search ends within a number of passes known in advance from the dtype,
however the values are spread or tied (:func:`passes_needed`). A range holding a
single key is settled without reading anything.

Memory is bounded by :class:`Limits`: at most ``bins`` histogram counts and at most
``collect`` collected keys per pass, whatever the number of rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .byteorder import native, native_dtype
from .reductions import reduce_rows
from .types import Partial, combine_partials

__all__ = [
    "ColumnStats",
    "Limits",
    "Narrowing",
    "Search",
    "Stats",
    "from_keys",
    "key_bits",
    "passes_needed",
    "to_keys",
]

_SUB_ELEMENTS = 1 << 20  # values per sub-block: 4 MiB of 32-bit keys, as L2 holds
_MAX_BITS = 16  # bins of one histogram at most 2**16 (512 KiB of counts)


def key_bits(dtype: Any) -> int:
    """Bits that can differ between two keys of ``dtype`` values (1 for bool)."""
    dtype = np.dtype(dtype)
    return 1 if dtype.kind == "b" else 8 * dtype.itemsize


def supported(dtype: Any) -> bool:
    """Whether values of ``dtype`` have keys (bool, integers, floats up to 64 bits)."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biu" or (dtype.kind == "f" and dtype.itemsize <= 8)


def key_dtype(dtype: Any) -> np.dtype:
    """The unsigned integers keys of ``dtype`` values are: 32 bits up to 4-byte values
    (half the memory traffic of 64), else 64."""
    return np.dtype(np.uint32 if np.dtype(dtype).itemsize <= 4 else np.uint64)


def to_keys(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Unsigned integer keys (:func:`key_dtype`) in the order of ``values`` (bool,
    ints, floats).

    ``-0.0`` has the key right below ``0.0``'s (NumPy counts them equal; a rank among
    them may give either zero). A NaN's key lies outside the keys of every other value,
    so a range of keys between two numbers never holds one. ``out``: a buffer of the
    keys' dtype and the values' shape to write them into (reused: no page faults).
    Values in either byte order (:mod:`tierflow.operators.byteorder`).

    >>> to_keys(np.array([-1.5, -0.0, 0.0, 2.0])).argsort().tolist()
    [0, 1, 2, 3]
    """
    values = native(values)
    dtype = values.dtype
    kind, size = dtype.kind, dtype.itemsize
    key = key_dtype(dtype)
    if out is None or out.shape != values.shape:
        out = np.empty(values.shape, key)
    if kind == "f":
        unsigned = np.dtype(f"u{size}")
        bits = values.view(unsigned)
        sign = unsigned.type(1 << (8 * size - 1))
        if unsigned != key:  # float16: widen first, then flip in 32 bits
            wide = bits.astype(key)
            flip = (wide >> key.type(15)) * key.type(0xFFFF) | key.type(0x8000)
            np.bitwise_xor(flip, wide, out=out)
            return out
        # key = bits ^ (sign set ? all ones : the sign bit), in four passes in place
        np.right_shift(bits, unsigned.type(8 * size - 1), out=out)
        np.negative(out, out=out)
        out |= sign
        out ^= bits
        return out
    top = key.type(1 << (8 * key.itemsize - 1))
    if kind == "i":
        np.copyto(
            out, values.view(f"u{size}") if size == key.itemsize else values, casting="unsafe"
        )
        out ^= top
        return out
    np.copyto(out, values, casting="unsafe")
    return out


def from_keys(keys: np.ndarray, dtype: Any) -> np.ndarray:
    """The values of ``dtype`` whose keys are ``keys`` (inverse of :func:`to_keys`), in
    ``dtype``'s byte order."""
    dtype = np.dtype(dtype)
    keys = np.asarray(keys).astype(key_dtype(dtype))
    if dtype.kind == "f":
        unsigned = np.dtype(f"u{dtype.itemsize}")
        sign = unsigned.type(1 << (8 * dtype.itemsize - 1))
        small = keys.astype(unsigned)
        bits = np.where(small >= sign, small ^ sign, ~small)
        return bits.astype(unsigned).view(native_dtype(dtype)).astype(dtype, copy=False)
    if dtype.kind == "i":
        top = keys.dtype.type(1 << (8 * keys.dtype.itemsize - 1))
        return (keys ^ top).view(f"i{keys.dtype.itemsize}").astype(dtype)
    return keys.astype(dtype)


@dataclass(frozen=True)
class Limits:
    """What one narrowing pass may hold: ``bins`` histogram counts (int64) and
    ``collect`` collected keys (uint64), over all columns and ranks."""

    bins: int = 1 << 18
    collect: int = 1 << 20

    def hist_bits(self, targets: int) -> int:
        """Bits of each of ``targets`` histograms sharing :attr:`bins` (1 to 16)."""
        share = max(2, self.bins // max(1, targets))
        return max(1, min(_MAX_BITS, share.bit_length() - 1))


def passes_needed(dtype: Any, columns: int, ranks: int, limits: Limits) -> int:
    """Narrowing passes after the stats that always settle every rank: the first
    histograms ``columns`` whole columns, each later one up to ``columns * ranks``
    ranges, and every histogram cuts the bits of a range's width by its bits."""
    width = key_bits(dtype)
    first = limits.hist_bits(columns)
    later = limits.hist_bits(columns * ranks)
    return 1 + max(0, math.ceil((width - first) / later))


def _columns(block: np.ndarray, flat: bool) -> np.ndarray:
    """The block as ``[values, columns]``: one column of everything when ``flat``."""
    width = 1 if flat else math.prod(block.shape[1:])
    return block.reshape(-1 if flat else block.shape[0], width)


def _pieces(values: np.ndarray) -> Any:
    step = max(1, _SUB_ELEMENTS // max(1, values.shape[1]))
    for start in range(0, values.shape[0], step):
        yield values[start : start + step]


@dataclass
class Stats:
    """Per column: values that are not NaN (``valid``), NaN (``nans``), and the keys
    of the smallest and largest (``lo``, ``hi``; ``lo > hi`` for a column without
    values)."""

    valid: np.ndarray
    nans: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def merged(self, other: Stats) -> Stats:
        """The stats of the columns of both."""
        return Stats(
            self.valid + other.valid,
            self.nans + other.nans,
            np.minimum(self.lo, other.lo),
            np.maximum(self.hi, other.hi),
        )


class ColumnStats:
    """Pass 1, a ReductionOp: :class:`Stats` of every column of ``[rows, *row_shape]``
    blocks (the columns are the row's elements; one column of all values if ``flat``)."""

    row_independent = False
    commutative = True
    n_inputs = 1
    out_dtype = np.dtype(object)
    out_shape = ()

    def __init__(self, in_dtype: Any, row_shape: tuple[int, ...], flat: bool) -> None:
        self.in_dtype = np.dtype(in_dtype)
        self.flat = flat
        self.columns = 1 if flat else math.prod(row_shape)

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        values = _columns(blocks[0], self.flat)
        if values.shape[0] == 0:
            return None
        if self.in_dtype.kind == "f":
            smallest = reduce_rows(np.fmin, values)
            largest = reduce_rows(np.fmax, values)
            with_nan = np.flatnonzero(np.isnan(reduce_rows(np.minimum, values)))
            nans = np.zeros(values.shape[1], np.int64)
            for c in with_nan:
                nans[c] = np.count_nonzero(np.isnan(values[:, c]))
            # fmin and fmax may give either zero where both are: the range takes both in.
            smallest = np.where(smallest == 0, -0.0, smallest).astype(values.dtype)
            largest = np.where(largest == 0, 0.0, largest).astype(values.dtype)
        else:
            smallest = reduce_rows(np.minimum, values)
            largest = reduce_rows(np.maximum, values)
            nans = np.zeros(values.shape[1], np.int64)
        valid = values.shape[0] - nans
        lo, hi = to_keys(smallest), to_keys(largest)
        empty = valid == 0
        lo[empty], hi[empty] = np.iinfo(lo.dtype).max, 0
        return Stats(valid, nans, lo, hi)

    def combine(self, a: Partial, b: Partial) -> Partial:
        return combine_partials(a, b, Stats.merged)

    def aggregate(self, partial: Partial) -> Stats:
        if partial is None:
            zero = np.zeros(self.columns, np.int64)
            keys = key_dtype(self.in_dtype)
            top = np.full(self.columns, np.iinfo(keys).max, keys)
            return Stats(zero, zero.copy(), top, zero.astype(keys))
        return partial

    def temp_bytes(self, rows: int) -> int:
        return rows * self.columns  # the NaN mask of a column with NaN, at most

    def partial_bytes(self) -> int:
        return 32 * self.columns + 256


@dataclass
class Target:
    """An open range of column ``col``: keys ``lo..hi`` (inclusive) hold ``count``
    values, ``below`` values of the column lie under ``lo``, and ``ranks`` (sorted,
    0-based among the column's values) fall inside."""

    col: int
    lo: int
    hi: int
    below: int
    count: int
    ranks: tuple[int, ...]


@dataclass
class Search:
    """Where the search stands: the :class:`Stats`, the keys found (``found[(col,
    rank)]``), the ranges still ``open``, and what the passes held at most."""

    stats: Stats
    found: dict[tuple[int, int], int] = field(default_factory=dict)
    open: list[Target] = field(default_factory=list)
    passes: int = 0
    peak_collected: int = 0
    peak_bins: int = 0

    @classmethod
    def start(cls, stats: Stats, ranks: dict[int, list[int]]) -> Search:
        """The search for ``ranks[col]`` (each below the column's count) of each column."""
        search = cls(stats)
        for col, wanted in sorted(ranks.items()):
            if wanted:
                lo, hi = int(stats.lo[col]), int(stats.hi[col])
                count = int(stats.valid[col])
                search.open.append(Target(col, lo, hi, 0, count, tuple(sorted(set(wanted)))))
        search._settle()
        return search

    def _settle(self) -> None:
        """Close the ranges of a single key: their ranks are that key."""
        still = []
        for t in self.open:
            if t.lo == t.hi:
                self.found.update(((t.col, r), t.lo) for r in t.ranks)
            else:
                still.append(t)
        self.open = still

    def key(self, col: int, rank: int) -> int:
        """The key of the value of rank ``rank`` in column ``col`` (found)."""
        return self.found[(col, rank)]

    def after(self, plan: NarrowPlan, partial: Any) -> Search:
        """The search once the pass of ``plan`` has given ``partial``."""
        counts, collected = partial if partial is not None else (None, None)
        nxt = Search(
            self.stats,
            dict(self.found),
            [],
            self.passes + 1,
            max(self.peak_collected, plan.collect_size),
            max(self.peak_bins, plan.total_bins),
        )
        for k, t in enumerate(plan.collect):
            pieces = collected[k] if collected is not None else []
            keys = np.concatenate(pieces) if pieces else np.empty(0, np.uint64)
            if len(keys) != t.count:
                raise RuntimeError(
                    f"column {t.col}: {len(keys)} values collected in a range that counted "
                    f"{t.count} in the pass before; the rows changed between the passes of "
                    "this quantile (a source rewritten, or a map_blocks function that is not "
                    "deterministic): make every read give the same rows, or persist() first"
                )
            keys = np.sort(keys)
            nxt.found.update(((t.col, r), int(keys[r - t.below])) for r in t.ranks)
        for t, shift, first, n in plan.hist:
            hist = counts[first : first + n] if counts is not None else np.zeros(n, np.int64)
            ends = t.below + np.cumsum(hist)
            bins = np.searchsorted(ends, np.asarray(t.ranks), side="right")
            for b in np.unique(bins):
                lo = t.lo + (int(b) << shift)
                hi = min(t.hi, lo + (1 << shift) - 1)
                below = int(ends[b - 1]) if b else t.below
                ranks = tuple(r for r, rb in zip(t.ranks, bins, strict=True) if rb == b)
                nxt.open.append(Target(t.col, lo, hi, below, int(hist[b]), ranks))
        nxt._settle()
        return nxt


@dataclass
class NarrowPlan:
    """What one narrowing pass does: ``hist`` as ``(target, shift, first bin, bins)``
    (counts ``first:first + bins`` of the pass's count array) and the targets whose
    values it ``collect``s."""

    hist: list[tuple[Target, int, int, int]]
    collect: list[Target]
    total_bins: int
    collect_size: int

    @classmethod
    def of(cls, search: Search, limits: Limits) -> NarrowPlan:
        """Collect the smallest ranges while their values fit ``limits.collect``;
        histogram the others."""
        collect: list[Target] = []
        size = 0
        rest: list[Target] = []
        for t in sorted(search.open, key=lambda t: t.count):
            if size + t.count <= limits.collect:
                collect.append(t)
                size += t.count
            else:
                rest.append(t)
        bits = limits.hist_bits(len(rest))
        hist = []
        first = 0
        for t in rest:
            span = t.hi - t.lo
            shift = max(0, span.bit_length() - bits)
            n = (span >> shift) + 1
            hist.append((t, shift, first, n))
            first += n
        return cls(hist, collect, first, size)


def _is_whole(t: Target, stats: Stats) -> bool:
    """Whether ``t`` is a whole column (the first histogram of that column)."""
    return t.below == 0 and t.lo == int(stats.lo[t.col]) and t.hi == int(stats.hi[t.col])


class _WholeColumns:
    """The histograms of whole columns, over all of them at once: a key's bin is
    ``(key - lo) >> shift`` plus its column's first bin. A NaN (in a column that has
    some) goes to the bin past the end, which no range holds."""

    def __init__(
        self, hists: list[tuple[Target, int, int, int]], search: Any, in_dtype: Any
    ) -> None:
        keys = key_dtype(in_dtype)
        cols = [t.col for t, _, _, _ in hists]
        self.cols = np.array(cols, np.intp)
        self.every = cols == list(range(len(search.stats.lo)))
        self.lo = np.array([t.lo for t, _, _, _ in hists], keys)
        self.span = np.array([t.hi - t.lo for t, _, _, _ in hists], keys)
        self.shift = np.array([shift for _, shift, _, _ in hists], keys)
        self.first = np.array([first for _, _, first, _ in hists], keys)
        self.nan = bool(search.stats.nans[self.cols].any())

    def add(self, keys: np.ndarray, counts: np.ndarray, index: np.ndarray) -> None:
        """Count the keys of a sub-block (``[values, columns]``) into ``counts``;
        ``keys`` is overwritten, ``index`` (intp, the same shape) is scratch."""
        mine = keys if self.every else keys[:, self.cols]
        index = index if self.every else np.empty(mine.shape, np.intp)
        np.subtract(mine, self.lo, out=mine)  # below lo wraps round, above the span
        bad = mine > self.span if self.nan else None
        np.right_shift(mine, self.shift, out=mine)
        np.add(mine, self.first, out=index, casting="unsafe")
        if bad is not None:
            index[bad] = len(counts) - 1
        counts += np.bincount(index.reshape(-1), minlength=len(counts))


class Narrowing:
    """A narrowing pass, a ReductionOp: histograms and collected keys of the open
    ranges of a :class:`Search` (see the module docstring). ``idle`` when nothing is
    open: the engine then reads no block for it."""

    row_independent = False
    commutative = True
    n_inputs = 1
    out_dtype = np.dtype(object)
    out_shape = ()

    def __init__(
        self,
        in_dtype: Any,
        row_shape: tuple[int, ...],
        flat: bool,
        search: Search | None,
        limits: Limits,
    ) -> None:
        self.in_dtype = np.dtype(in_dtype)
        self.row_elements = math.prod(row_shape)
        self.flat = flat
        self.search = search
        self.limits = limits
        self.plan = (
            NarrowPlan.of(search, limits) if search is not None else NarrowPlan([], [], 0, 0)
        )
        self.idle = search is None or not search.open
        by_col: dict[int, list[tuple[str, int]]] = {}
        whole = []
        for k, (t, _, _, _) in enumerate(self.plan.hist):
            if search is not None and _is_whole(t, search.stats):
                whole.append(self.plan.hist[k])
            else:
                by_col.setdefault(t.col, []).append(("hist", k))
        self._whole = _WholeColumns(whole, search, in_dtype) if whole else None
        targets = {("hist", k): h[0] for k, h in enumerate(self.plan.hist)}
        targets.update({("collect", k): t for k, t in enumerate(self.plan.collect)})
        self._bounds = {  # the values at either end of each range (by kind and position)
            job: tuple(from_keys(np.array([t.lo, t.hi], np.uint64), self.in_dtype))
            for job, t in targets.items()
        }
        for k, t in enumerate(self.plan.collect):
            by_col.setdefault(t.col, []).append(("collect", k))
        self._by_col = by_col

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        values = _columns(blocks[0], self.flat)
        if self.idle or values.shape[0] == 0:
            return None
        plan = self.plan
        counts = np.zeros(plan.total_bins + 1, np.int64)  # the last: what no bin holds
        parts: list[list[np.ndarray]] = [[] for _ in plan.collect]
        whole = self._whole
        if whole is not None:
            step = max(1, _SUB_ELEMENTS // max(1, values.shape[1]))
            shape = (min(step, values.shape[0]), values.shape[1])
            buffer = np.empty(shape, key_dtype(self.in_dtype))
            index = np.empty(shape, np.intp)
        for piece in _pieces(values):
            piece = native(piece)  # keys of every column and job come from this copy
            for col, jobs in self._by_col.items():
                column = piece[:, col]
                for kind, k in jobs:
                    target = plan.hist[k][0] if kind == "hist" else plan.collect[k]
                    keys = self._inside(column, target, self._bounds[kind, k])
                    if not len(keys):
                        continue
                    if kind == "hist":
                        _, shift, first, n = plan.hist[k]
                        index = (keys - keys.dtype.type(target.lo)) >> keys.dtype.type(shift)
                        counts[first : first + n] += np.bincount(
                            index.astype(np.intp, copy=False), minlength=n
                        )
                    else:
                        parts[k].append(keys)
            if whole is not None:
                rows = piece.shape[0]
                whole.add(to_keys(piece, buffer[:rows]), counts, index[:rows])
        return counts[:-1], parts

    @staticmethod
    def _inside(column: np.ndarray, t: Target, bounds: tuple[Any, Any]) -> np.ndarray:
        """The keys of the values of ``column`` inside ``t``'s range: picked by value
        (between ``bounds``) first, a superset (``-0.0`` and ``0.0`` compare equal),
        then by key."""
        low, high = bounds
        keys = to_keys(column[(column >= low) & (column <= high)])
        return keys[(keys - keys.dtype.type(t.lo)) <= t.hi - t.lo]

    def combine(self, a: Partial, b: Partial) -> Partial:
        return combine_partials(a, b, self._merged)

    @staticmethod
    def _merged(a: Any, b: Any) -> Any:
        """The histograms added, each range's collected keys one after the other."""
        return a[0] + b[0], [x + y for x, y in zip(a[1], b[1], strict=True)]

    def aggregate(self, partial: Partial) -> Search | None:
        return self.search.after(self.plan, partial) if self.search is not None else None

    def temp_bytes(self, rows: int) -> int:
        """Keys, bin indices and masks of one sub-block (and its copy in native byte
        order, for values in the other), and one histogram's counts."""
        per_value = 24 + (0 if self.in_dtype.isnative else self.in_dtype.itemsize)
        return per_value * min(_SUB_ELEMENTS, rows * self.row_elements) + 8 * self.limits.bins

    def partial_bytes(self) -> int:
        """The most a pass may hold (the same before and after the search is known)."""
        return 8 * (self.limits.bins + self.limits.collect) + 256
