"""Reductions of row-blocked arrays as chunk / combine / aggregate.

:func:`reduction` builds every NumPy reduction the engine offers — ``sum``, ``prod``,
``mean``, ``var``, ``std``, ``min``, ``max``, ``any``, ``all``, ``count_nonzero``,
``argmin``, ``argmax`` — for an array of a given dtype and row shape, with NumPy's
``axis`` (None, an int, a tuple, negative), ``keepdims``, ``dtype`` and ``ddof``.
:class:`Histogram` and the user-defined :class:`Reduction` complete the set.

Two kinds come back:

* An axis set that includes axis 0 gives a :class:`~tierflow.operators.types.ReductionOp`:
  ``chunk`` reduces one block to a partial of the output's size, ``combine`` merges
  partials in any order, ``aggregate`` finishes.
* An axis set without axis 0 reduces within rows only: a :class:`RowwiseReduction`, a
  :class:`~tierflow.operators.types.BlockOp` that is NumPy itself applied to each block
  (bitwise NumPy's result), and that fuses like an elementwise operator.

What is NumPy's, and what differs:

* Result dtypes are NumPy's, read from NumPy on a one-element probe: int sums give int64
  (uint64 for unsigned), bool sums int64, means of integers float64, float16 means
  float16, variances of complex numbers real.
* Integer sums and products accumulate in the result dtype, so they wrap around exactly
  as NumPy's do (modular arithmetic does not depend on the order). min, max, any, all,
  count_nonzero, argmin and argmax are exact.
* Float sums, products and means accumulate in float64 (complex128) and are cast to
  NumPy's result dtype at the end. The order of additions differs from NumPy's (blocks,
  then sub-blocks), so results differ in the last bits; for float32 and float16 data
  they are usually *more* accurate than NumPy's own float32 accumulation. A float32
  product that overflows only in an intermediate float32 step is finite here.
* var and std merge per-block (count, mean, M2) with Chan's parallel formula; within a
  block they sum squared deviations from a pilot shift (below), never squares of the
  raw values. An integer ``dtype`` for var/std is refused.
* NaN propagates through sum, mean, min, max and var; argmin and argmax return the first
  NaN; ties go to the first occurrence. (min/max of 0.0 and -0.0 may return either
  zero: NumPy's choice depends on the order too.)
* Empty input: an array without rows gets NumPy's own result for an empty array —
  min/max raise ``ValueError: zero-size array to reduction operation minimum which has
  no identity``, argmin raises, mean warns "Mean of empty slice" and gives nan, sum gives
  0. var/std warn "Degrees of freedom <= 0 for slice" when ``ddof`` >= the count.

Fast path: a reduction over axis 0 of a C-contiguous ``[n, k]`` block with small ``k``
runs over the wide view ``[n / m, m * k]`` (``m * k`` about ``WIDE_ELEMENTS``) and keeps
one partial per *lane* (column of the wide view; lane ``j`` holds column ``j % k``); rows
that do not fill a wide row fold into the first lanes, and the lanes fold into the ``k``
columns once per block (:func:`reduce_rows`). NumPy's own axis-0 loop over 8 columns runs
its inner loop 8 elements at a time. Measured on float32 ``[1M, 8]`` into float64 (one
thread): plain ``sum(axis=0, dtype=float64)`` 1.1 GB/s, wide view 5.4 GB/s, the same as
a flat float64-accumulating ``np.add.reduce`` of the block (the float32 to float64 cast
bounds both); ``min(axis=0)`` 0.8 vs 11.8 GB/s; int32 sums 1.3 vs 5.5 GB/s. Lanes of 1024
elements run as fast as lanes of 4096 and make the per-block fold four times cheaper;
a small block gets fewer lanes (at least 16 wide rows), and one of fewer than 4096
elements none (1000 rows of 8: 31 us plain, 21 us in lanes, on the same machine).

var and std run one pass over the block in the same lanes: the values are cast to
float64 in cache-sized pieces, a pilot shift is subtracted (the column means of the
block's first piece: 16384 values, 2048 rows of 8), and the deviations' sum and sum of
squares are kept per lane; the block's ``M2`` is the sum of squares minus the squared
sum over the count, and blocks merge with Chan's formula. The pilot is the mean of
``m`` of the block's ``n`` rows, so the squared distance from the block's mean to it is
at most ``n / m`` times the block's variance, and the subtraction amplifies the
rounding of the float64 sums by at most ``1 + 3 n / m``: for 1M rows of 8 columns at
most 11 of float64's 53 bits in the worst case (the first rows alone shifted far from
the rest), nothing a float32 result can see; for data without such a trend the pilot
misses the mean by about ``sigma / sqrt(m)``, an amplification of ``1 + 3 / m``.
Measured on float32 ``[1M, 8]`` (one thread): the former corrected two-pass per
sub-block 0.67 GB/s, the one pass 1.3 GB/s, bound by four float64 passes over L2
(NumPy's own ``var(axis=0, dtype=float64)`` 0.3 GB/s, ``sum`` 5 GB/s).

The same lanes serve :class:`~tierflow.operators.fused.FusedReduction`, which feeds them
each sub-block of its expression and folds once per block.

A float32 (or float16) block whose var/std result is float32 (or float16) takes a
narrower road when it comes whole and holds at least 65536 values (a smaller block
would spend more on the road's fixed costs than it saves; :func:`_narrow_moments`):
deviations from a float32 shift are taken in float32, pieces of 2**18 elements (1 MiB)
at a time; ``np.einsum`` sums their squares four rows of lanes at a time in float32 (the
deviations themselves 16 rows at a time), and those partial sums add up in float64.
The shift of a column is its mean over the block's first 16384 values where that mean
is more than two standard deviations from zero, and zero elsewhere (then the data are
summed where they lie, without a subtraction). So a deviation is exact either way:
``x - 0``, or ``x - s`` of two nearby float32 values (Sterbenz; values farther than
``s / 2`` from a shift of more than two deviations are rare, and off by half a unit of
the deviation). A square is off by half a float32 unit, a sum of four terms by at most
three units of itself. These errors are relative to each term or partial sum, so no
value, however far out, drowns its neighbours (lanes summed over 64 rows in float32
lost 1e-6 of the variance to one outlier in 60,000 rows), and their signs vary, so they
shrink in the sum: the result keeps float32's accuracy (4 units of the last place in
the tests, 1e6 + noise and outliers included). The deviations' own sums only move the
mean, whose share in ``M2`` the shift keeps below 4 variances, so 16 terms a partial
sum are enough for them. A deviation or square that is not finite in float32 (NaN or
inf in the data, or squares past 3.4e38) sends the block back to the float64 road
above; a block whose mean lies more than two standard deviations from its shift is
summed again, shifted by its own mean by the same rule, so that the subtraction in
``M2`` amplifies the sums' rounding at most about 5 times (a linear trend across a
block puts the first rows' mean 1.7 standard deviations off, and is not summed twice).
A float32 mean taken from these partials (``tw.compute(x.mean(0), x.std(0))``, see
:meth:`_Mean.derive_from`) is within 5e-11 standard deviations of the float64
mean. Measured on float32 ``[1M, 8]`` (one thread, the same machine, shared): 3.3-4.3
GB/s against the float64 road's 0.9-1.3 and the column sum's 5-6. The pieces are 1 MiB,
not the 256 KiB that fits L2 best on one thread: each piece costs a few NumPy calls
under the GIL, and with two worker threads pieces of 2**16 elements left the second
thread waiting (2 threads 3.0 GB/s against 1 thread 2.8; with 2**18, 5.1 GB/s).
"""

from __future__ import annotations

import abc
import copy
import functools
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._blocks import check_blocks, prepare_out, wide_fold
from .types import Partial, combine_partials

try:
    from numpy.lib.array_utils import normalize_axis_tuple
except ImportError:  # NumPy < 2
    from numpy.core.numeric import normalize_axis_tuple  # type: ignore[no-redef]

__all__ = [
    "KINDS",
    "WIDE_ELEMENTS",
    "Histogram",
    "Reduction",
    "ReductionOptions",
    "RowReduction",
    "RowwiseReduction",
    "accumulator_dtype",
    "partial_sum",
    "reduce_rows",
    "reduction",
]

KINDS = (
    "sum", "prod", "mean", "var", "std", "min", "max", "nanmin", "nanmax",
    "any", "all", "count_nonzero", "argmin", "argmax",
)  # fmt: skip

WIDE_ELEMENTS = 1024  # lanes of the wide view in reduce_rows and var/std (measured above)
_LANES_MIN_ELEMENTS = 4096  # below this many elements a block reduces faster as it is
_CHUNK_BYTES = 1 << 20  # float64 scratch per sub-block inside var/std, argmin, count_nonzero
_MOMENT_ELEMENTS = 16384  # float64 deviations per piece in var/std (with squares 256 KiB)
_ITER_BYTES = 64 * 1024  # NumPy's casting buffers in a reduction with a dtype
_NARROW_ELEMENTS = 1 << 18  # float32 deviations per piece in float32 var/std (1 MiB)
_NARROW_MIN = 65536  # values a block needs to take the float32 var/std road
_NARROW_DTYPES = frozenset({np.dtype(np.float16), np.dtype(np.float32)})
_NARROW_TERMS = 4  # float32 squares per partial sum in float32 var/std, before float64
_NARROW_SUM_TERMS = 16  # float32 deviations per partial sum there (module docstring)
_PILOT_ELEMENTS = 16384  # values of a block's first rows that choose its shifts
_PILOT_SPREAD = 4  # squared distance of a block's mean from its pilot, in variances

_UFUNCS: dict[str, np.ufunc] = {
    "sum": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "nanmin": np.fmin,  # NaN left out, as np.nanmin does it
    "nanmax": np.fmax,
    "any": np.logical_or,
    "all": np.logical_and,
}
_TAKES_DTYPE = frozenset({"sum", "prod", "mean", "var", "std"})
_TAKES_INITIAL = frozenset({"sum", "prod", "min", "max"})


def reduce_rows(ufunc: np.ufunc, block: np.ndarray, dtype: Any = None) -> np.ndarray:
    """``ufunc.reduce(block, axis=0, dtype=dtype)`` as an array of shape ``block.shape[1:]``.

    Uses the wide view described in the module docstring when the block is C-contiguous
    and its rows are narrow; ``block`` must have at least one row for ufuncs without an
    identity (NumPy raises otherwise). ``ufunc`` must be commutative (add, multiply,
    minimum, maximum, logical_or, logical_and).

    >>> reduce_rows(np.add, np.ones((10_000, 3), np.float32), np.float64)
    array([10000., 10000., 10000.])
    """
    plan = _lane_plan(ufunc, block.dtype, dtype, block.shape) if block.flags.c_contiguous else None
    if plan is not None:
        # _UfuncLanes inlined for one piece: this runs once per block, often a small one.
        lane_dtype, wide_rows, lanes, whole, fold, width = plan
        flat = block.reshape(-1)
        part = ufunc.reduce(flat[:whole].reshape(wide_rows, lanes), axis=0, dtype=lane_dtype)
        if whole < flat.size:
            head = part[: flat.size - whole]
            ufunc(head, flat[whole:], out=head, dtype=lane_dtype, casting="unsafe")
        folded = ufunc.reduce(part.reshape(fold, width), axis=0, dtype=lane_dtype)
        return folded.reshape(block.shape[1:])
    row_shape = block.shape[1:]
    return np.asarray(ufunc.reduce(block, axis=0, dtype=dtype, keepdims=True)).reshape(row_shape)


@functools.lru_cache(maxsize=256)
def _lane_plan(
    ufunc: np.ufunc, in_dtype: np.dtype, dtype: Any, shape: tuple[int, ...]
) -> tuple[np.dtype, int, int, int, int, int] | None:
    """How reduce_rows folds a C-contiguous block of ``shape`` in lanes: (lane dtype,
    wide rows, lanes, elements in whole wide rows, rows per wide row, row elements);
    None to reduce it as it is. Cached: an array's blocks share a few shapes."""
    rows, width = shape[0], math.prod(shape[1:])
    fold = _lane_fold(width, rows)
    # One column is already a contiguous (pairwise) reduction; from two columns on, NumPy's
    # axis-0 loop runs `width` elements at a time (0.4 GB/s at two float32 columns).
    if width < 2 or fold < 2:
        return None
    lanes = fold * width
    wide_rows = rows // fold  # at least 16 (see _lane_fold)
    return (_lane_dtype(ufunc, in_dtype, dtype), wide_rows, lanes, wide_rows * lanes, fold, width)


def _lane_fold(row_elements: int, rows: int) -> int:
    """Rows per wide row of the lanes for a block of ``rows`` rows of ``row_elements``
    elements; 1 where the block reduces faster as it is.

    At most ``WIDE_ELEMENTS`` lanes, and fewer for small blocks (at least 16 wide rows),
    whose fold of the lanes into columns would otherwise cost more than the lanes save.

    >>> _lane_fold(8, 1_000_000), _lane_fold(8, 1000), _lane_fold(8, 300)
    (128, 32, 1)
    """
    if rows * row_elements < _LANES_MIN_ELEMENTS:
        return 1
    fold = wide_fold(row_elements, WIDE_ELEMENTS)
    limit = rows // 16
    return min(fold, 1 << (limit.bit_length() - 1)) if limit >= 2 else 1


@functools.lru_cache(maxsize=256)
def _lane_dtype(ufunc: np.ufunc, in_dtype: np.dtype, dtype: Any) -> np.dtype:
    """The dtype ``ufunc.reduce`` gives for ``in_dtype`` data with ``dtype=dtype``."""
    if dtype is not None:
        return np.dtype(dtype)
    return np.asarray(ufunc.reduce(np.zeros(1, in_dtype))).dtype


class _UfuncLanes:
    """``ufunc.reduce(rows, axis=0, dtype=dtype)`` kept per lane of the wide view.

    Rows arrive with :meth:`add` as C-contiguous pieces that each start at a row, in any
    order (the ufunc is commutative); lane ``j`` of the ``fold * row_elements`` lanes
    holds column ``j % row_elements``. A piece's whole wide rows reduce into all lanes;
    its last rows, fewer than ``fold``, fold elementwise into the first lanes. Only the
    first ``filled`` lanes hold values until a whole wide row has arrived.
    """

    __slots__ = ("dtype", "filled", "lanes", "row_elements", "rows", "ufunc", "width")

    def __init__(self, ufunc: np.ufunc, dtype: np.dtype, row_elements: int, fold: int) -> None:
        self.ufunc = ufunc
        self.dtype = dtype
        self.row_elements = row_elements
        self.width = fold * row_elements
        self.lanes: np.ndarray | None = None
        self.filled = 0
        self.rows = 0

    def add(self, values: np.ndarray, start: int = 0, stop: int = 0) -> None:
        """Fold the rows of ``values`` in (``start`` and ``stop`` are not needed)."""
        flat = values.reshape(-1)
        width, ufunc = self.width, self.ufunc
        self.rows += flat.size // self.row_elements
        n = flat.size // width
        if n:
            part = ufunc.reduce(flat[: n * width].reshape(n, width), axis=0, dtype=self.dtype)
            if self.filled == width:
                ufunc(self.lanes, part, out=self.lanes)
            else:
                if self.filled:
                    head = part[: self.filled]
                    ufunc(head, self.lanes[: self.filled], out=head)  # type: ignore[index]
                self.lanes, self.filled = part, width
        if n * width < flat.size:
            self._add_short(flat[n * width :])

    def _add_short(self, values: np.ndarray) -> None:
        """Fold fewer than ``fold`` rows into the first lanes."""
        if self.lanes is None:
            self.lanes = np.empty(self.width, self.dtype)
        size, filled = values.size, self.filled
        both = min(size, filled)
        if both:
            head = self.lanes[:both]
            self.ufunc(head, values[:both], out=head, dtype=self.dtype, casting="unsafe")
        if size > filled:
            np.copyto(self.lanes[filled:size], values[filled:size], casting="unsafe")
            self.filled = size

    def fold(self) -> np.ndarray:
        """The reduction of all rows added, shape ``(row_elements,)``; at least one row
        must have been added."""
        lanes = self.lanes[: self.filled]  # type: ignore[index]
        return np.asarray(
            self.ufunc.reduce(lanes.reshape(-1, self.row_elements), axis=0, dtype=self.dtype)
        )


def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype partial sums are kept in for a result of ``dtype``: float64 for float16,
    float32 and float64, complex128 for complex64 and complex128, ``dtype`` itself otherwise
    (integers and bool wrap exactly like NumPy's; long double stays long double)."""
    if dtype.kind == "f":
        return np.dtype(np.float64) if dtype.itemsize <= 8 else dtype
    if dtype.kind == "c":
        return np.dtype(np.complex128) if dtype.itemsize <= 16 else dtype
    return dtype


def partial_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b`` in a new array of ``a``'s dtype (a partial sum stays in its
    :func:`accumulator_dtype`); neither is modified."""
    return np.add(a, b, out=np.empty_like(a))


def _numpy(kind: str, x: np.ndarray, kwargs: dict[str, Any], out: np.ndarray | None = None) -> Any:
    """NumPy's own reduction ``kind`` of ``x`` (the reference, and the empty-array answer)."""
    if kind == "count_nonzero":
        result = np.count_nonzero(x, **kwargs)
        if out is not None:
            np.copyto(out, result)
            return out
        return result
    fn = getattr(np, kind)
    return fn(x, **kwargs) if out is None else fn(x, out=out, **kwargs)


def _probe_dtype(
    kind: str, dtype: np.dtype, row_shape: tuple[int, ...], kwargs: dict[str, Any]
) -> np.dtype:
    """The dtype of NumPy's ``kind`` with ``kwargs`` on one row of zeros (a row with at
    least one element on each axis, so that no axis is empty); what NumPy raises for
    the arguments (an axis out of range or given twice, an unusable dtype or ``ddof``)
    comes from here, with NumPy's type and message."""
    sample = np.zeros((1, *(max(n, 1) for n in row_shape)), dtype=dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.asarray(_numpy(kind, sample, kwargs)).dtype


def _given(  # noqa: PLR0913 -- NumPy's reduction keywords
    kind: str, axis: Any, keepdims: bool, dtype: Any, ddof: Any, initial: Any
) -> dict[str, Any]:
    """NumPy's keywords for ``kind`` as the caller gave them (those ``kind`` takes)."""
    given: dict[str, Any] = {"axis": axis, "keepdims": keepdims}
    if dtype is not None:
        given["dtype"] = dtype
    if kind in ("var", "std"):
        given["ddof"] = ddof
    if initial is not np._NoValue:
        given["initial"] = initial
    return given


def _normalize_axes(kind: str, axis: Any, ndim: int) -> tuple[int, ...]:
    if kind in ("argmin", "argmax"):
        if axis is None:
            return tuple(range(ndim))
        return tuple(normalize_axis_tuple(operator.index(axis), ndim))
    if axis is None:
        return tuple(range(ndim))
    return tuple(sorted(normalize_axis_tuple(axis, ndim)))


def reduction(  # noqa: PLR0913 -- axis, keepdims, dtype, ddof: NumPy's reduction keywords
    kind: str,
    in_dtype: Any,
    row_shape: tuple[int, ...],
    *,
    axis: int | tuple[int, ...] | None = None,
    keepdims: bool = False,
    dtype: Any = None,
    ddof: float = 0,
    initial: Any = np._NoValue,
) -> RowReduction | RowwiseReduction:
    """The reduction ``kind`` of an array of ``in_dtype`` whose rows have ``row_shape``.

    Axes count in the whole array (axis 0 is the row axis). Returns a
    :class:`RowReduction` when the axes include axis 0, else a :class:`RowwiseReduction`.
    ``initial`` (sum, prod, min, max) is NumPy's: the start of the reduction, and the
    result over no rows. Raises ValueError for an unknown kind, TypeError for a keyword
    the kind does not take (``dtype`` for min, ``ddof`` for sum), and what NumPy raises
    for the arguments (checked by NumPy on one row of zeros: an axis out of range or
    repeated, a tuple axis for argmin, an unusable dtype or ``ddof``), with NumPy's type
    and message.

    >>> op = reduction("sum", np.float32, (8,), axis=0)
    >>> op.out_dtype, op.out_shape
    (dtype('float32'), (8,))
    """
    if kind not in KINDS:
        raise ValueError(f"unknown reduction {kind!r}; known: {', '.join(KINDS)}")
    in_dtype = np.dtype(in_dtype)
    row_shape = tuple(int(n) for n in row_shape)
    if dtype is not None and kind not in _TAKES_DTYPE:
        raise TypeError(f"{kind} takes no dtype argument (got dtype={dtype!r})")
    if ddof != 0 and kind not in ("var", "std"):
        raise TypeError(f"{kind} takes no ddof argument (got ddof={ddof!r})")
    if initial is not np._NoValue and kind not in _TAKES_INITIAL:
        raise TypeError(f"{kind} takes no initial argument (got initial={initial!r})")
    _probe_dtype(kind, in_dtype, row_shape, _given(kind, axis, keepdims, dtype, ddof, initial))
    if kind in ("var", "std") and dtype is not None and np.dtype(dtype).kind in "biu":
        raise TypeError(
            f"{kind} with the integer dtype {np.dtype(dtype)} would truncate intermediate means; "
            "give a float dtype (or none: float64 for integer data)"
        )
    ndim = len(row_shape) + 1
    axes = _normalize_axes(kind, axis, ndim)
    numpy_axis: Any = None
    if axis is not None:
        numpy_axis = axes[0] if kind in ("argmin", "argmax") else axes
    kwargs: dict[str, Any] = {"axis": numpy_axis, "keepdims": keepdims}
    if kind in _TAKES_DTYPE:
        kwargs["dtype"] = None if dtype is None else np.dtype(dtype)
    if kind in ("var", "std"):
        kwargs["ddof"] = ddof
    if initial is not np._NoValue:
        kwargs["initial"] = initial
    if 0 not in axes:
        return RowwiseReduction(kind, in_dtype, row_shape, axes, kwargs)
    cls: type[RowReduction]
    if kind in _UFUNCS:
        cls = _UfuncReduction
    elif kind == "count_nonzero":
        cls = _CountNonzero
    elif kind == "mean":
        cls = _Mean
    elif kind in ("var", "std"):
        real_mean = in_dtype.kind == "c" and dtype is not None and np.dtype(dtype).kind != "c"
        cls = _RealMeanMoments if real_mean else _Moments
    else:
        cls = _ArgReduction
    return cls(kind, in_dtype, row_shape, axes, kwargs)


class _NamedReduction:
    """What every built-in reduction is told: NumPy's name for it (``kind``), the input's
    dtype and row shape, the axes (0 is the row axis) and NumPy's keyword arguments
    (``axis``, ``keepdims`` and the kind's others); the result's dtype follows from them
    as NumPy gives it."""

    def __init__(
        self,
        kind: str,
        in_dtype: np.dtype,
        row_shape: tuple[int, ...],
        axes: tuple[int, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.kind = kind
        self.in_dtype = in_dtype
        self.in_row_shape = row_shape
        self.axes = axes
        self.keepdims: bool = kwargs["keepdims"]
        self._kwargs = kwargs
        self.out_dtype: np.dtype = _probe_dtype(kind, in_dtype, row_shape, kwargs)
        self._derive()

    def _derive(self) -> None:
        """Set what a kind of reduction derives from the fields above (its shapes)."""


class RowwiseReduction(_NamedReduction):
    """A reduction over trailing axes only: NumPy's reduction applied to each block.

    A :class:`~tierflow.operators.types.BlockOp`; the result of a block is rows of the
    result of the whole array, bitwise.
    """

    row_independent = True
    n_inputs = 1

    def _derive(self) -> None:
        axes, keepdims = self.axes, self.keepdims
        self.out_row_shape = tuple(
            1 if i + 1 in axes else n
            for i, n in enumerate(self.in_row_shape)
            if keepdims or i + 1 not in axes
        )

    def __repr__(self) -> str:
        return f"RowwiseReduction({self.kind}, {self._kwargs})"

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """NumPy's reduction of the block; written into ``out`` when given."""
        rows = check_blocks(blocks, [self.in_dtype], [self.in_row_shape], self.kind)
        if out is not None:
            out = prepare_out(out, (rows, *self.out_row_shape), self.out_dtype, blocks, self.kind)
        return np.asarray(_numpy(self.kind, blocks[0], self._kwargs, out))

    def temp_bytes(self, rows: int) -> int:
        """Scratch of one ``apply``: block-sized float64 temporaries for var/std and
        argmin/argmax over a non-last axis, a boolean copy for count_nonzero."""
        elements = rows * math.prod(self.in_row_shape)
        if self.kind in ("var", "std"):
            return 2 * elements * accumulator_dtype(self.out_dtype).itemsize
        if self.kind == "count_nonzero":
            return elements
        if self.kind in ("argmin", "argmax") and self.axes[0] != len(self.in_row_shape):
            return elements * self.in_dtype.itemsize
        return _ITER_BYTES


class _Accumulator(Protocol):
    """A block's partial built from pieces of its rows (the fused fast path).

    ``add(values, start, stop)`` takes rows ``[start, stop)`` of the block as any
    C-contiguous array of their elements in row order, pieces in any order; ``partial``
    gives the block's partial, as ``chunk`` would.
    """

    def add(self, values: np.ndarray, start: int, stop: int) -> None: ...

    def partial(self) -> Partial: ...


class RowReduction(_NamedReduction, abc.ABC):
    """Base of the built-in reductions over the row axis (a ReductionOp).

    Partials are tuples of small arrays shaped like the output without kept dimensions;
    None is the partial of no rows.
    """

    row_independent = False
    commutative = True
    n_inputs = 1
    folds_in_lanes = False  # whether partial_of_lanes builds its partials

    def _derive(self) -> None:
        axes, row_shape = self.axes, self.in_row_shape
        self.trailing = tuple(a - 1 for a in axes if a != 0)
        self.reduced_per_row = math.prod(row_shape[a] for a in self.trailing)
        self.core_shape = tuple(n for i, n in enumerate(row_shape) if i not in self.trailing)
        self.out_shape: tuple[int, ...] = (
            tuple(1 if i in axes else n for i, n in enumerate((1, *row_shape)))
            if self.keepdims
            else self.core_shape
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}, {self._kwargs})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The partial of one block; None for a block without rows."""
        rows = check_blocks(blocks, [self.in_dtype], [self.in_row_shape], self.kind)
        if rows == 0:
            return None
        return self._chunk(blocks[0], int(row_offset))

    def combine(self, a: Partial, b: Partial) -> Partial:
        """Merge two partials (None is the partial of no rows)."""
        return combine_partials(a, b, self._combine)

    def aggregate(self, partial: Partial) -> Any:
        """The result: an array of ``out_shape``, or a NumPy scalar when that is ``()``."""
        if partial is None:
            return _numpy(self.kind, np.empty((0, *self.in_row_shape), self.in_dtype), self._kwargs)
        result = np.asarray(self._finish(partial)).reshape(self.out_shape)
        return result[()] if result.ndim == 0 else result

    def temp_bytes(self, rows: int) -> int:
        """Scratch of one ``chunk``: partial-sized arrays and NumPy's casting buffers."""
        return 4 * self.partial_bytes() + _ITER_BYTES

    def partial_bytes(self) -> int:
        """Bytes of one partial."""
        return max(1, math.prod(self.core_shape)) * 16 + 64

    def _reduce(self, ufunc: np.ufunc, block: np.ndarray, dtype: Any) -> np.ndarray:
        """``ufunc`` over axis 0 and the reduced trailing axes, shaped ``core_shape``."""
        return self._reduce_trailing(ufunc, reduce_rows(ufunc, block, dtype), dtype)

    def _reduce_trailing(self, ufunc: np.ufunc, part: np.ndarray, dtype: Any) -> np.ndarray:
        """``part`` (one row, reduced over rows) reduced over the trailing axes too."""
        part = part.reshape(self.in_row_shape)
        if self.trailing:
            part = np.asarray(ufunc.reduce(part, axis=self.trailing, dtype=dtype))
        return part

    def derive_from(self, other: RowReduction) -> Callable[[Partial], Partial] | None:
        """How to make this reduction's partial of a block from ``other``'s partial of
        the same block, or None where it cannot (then both chunk the block)."""
        return None

    def _accumulator(self, rows: int) -> _Accumulator | None:
        """A fresh accumulator for one block of ``rows`` rows, or None where this
        reduction has none or it would not pay (the caller then calls ``_chunk`` per
        piece and combines). Used by FusedReduction."""
        return None

    def partial_of_lanes(
        self,
        lanes: Sequence[np.ndarray],
        rows: int,
        shift: np.ndarray | None = None,
        row_offset: int = 0,
    ) -> Partial:
        """The partial of a block of ``rows`` rows from per-lane values that a compiled
        kernel folded (:mod:`tierflow.operators.compiled`): each array holds lanes of
        whole rows (lane ``j`` is element ``j % row_elements`` of a row), in the dtype
        the kernel was told; var/std take the lanes' sums of deviations from ``shift``
        (one row, float64) and of their squares; argmin/argmax the best value of each
        lane and its element in the block (``row_offset``: the block's first row in the
        array). Raises TypeError for a reduction without lanes."""
        raise TypeError(f"{self!r} has no partial of lanes")

    def _fold_lanes(self, ufunc: np.ufunc, lanes: np.ndarray, dtype: Any) -> np.ndarray:
        """Lanes of whole rows folded into one row, then over the reduced trailing axes."""
        row_elements = math.prod(self.in_row_shape)
        folded = ufunc.reduce(lanes.reshape(-1, row_elements), axis=0, dtype=dtype)
        return self._reduce_trailing(ufunc, np.asarray(folded), dtype)

    @abc.abstractmethod
    def _chunk(self, block: np.ndarray, row_offset: int) -> Partial:
        """The partial of one block (``row_offset``: its first row in the array)."""

    @abc.abstractmethod
    def _combine(self, a: Partial, b: Partial) -> Partial:
        """Two partials merged (``a`` covers the rows before ``b``)."""

    @abc.abstractmethod
    def _finish(self, partial: Partial) -> np.ndarray:
        """The reduced values of the partial of every row."""


def _abs2(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``|values|**2`` (real), in place into ``out`` for real values when given."""
    if values.dtype.kind == "c":
        return np.square(values.real) + np.square(values.imag)
    return np.multiply(values, values, out=out)


def _subblocks(block: np.ndarray, bytes_per_element: int) -> list[tuple[int, np.ndarray]]:
    """(first row, rows) pieces of ``block`` whose scratch stays near ``_CHUNK_BYTES``."""
    row_elements = max(1, math.prod(block.shape[1:]))
    step = max(1, _CHUNK_BYTES // (row_elements * bytes_per_element))
    return [(start, block[start : start + step]) for start in range(0, block.shape[0], step)]


class _UfuncReduction(RowReduction):
    """sum, prod, min, max, nanmin, nanmax, any, all: one ufunc folds blocks and
    partials; ``initial``, when given, once more at the end (as NumPy starts from it).
    nanmin and nanmax fold with ``fmin`` and ``fmax``, which leave NaN out, and warn
    "All-NaN slice encountered" for a result that is NaN, as NumPy's do."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ufunc = _UFUNCS[self.kind]
        self.initial = self._kwargs.get("initial", np._NoValue)
        if self.kind in ("sum", "prod"):
            self.acc: np.dtype | None = accumulator_dtype(self.out_dtype)
        elif self.kind in ("any", "all"):
            self.acc = np.dtype(bool)
        else:
            self.acc = None
        # NumPy's complex min and max give the first value holding a NaN (its other part
        # shows which): values are folded in NumPy's order, blocks in row order.
        self._in_order = self.kind in ("min", "max") and self.in_dtype.kind == "c"
        self.commutative = not self._in_order
        self.folds_in_lanes = not self._in_order

    def _chunk(self, block: np.ndarray, row_offset: int) -> Partial:
        if self._in_order:  # every reduced axis at once, in NumPy's order
            axes = (0, *(a + 1 for a in self.trailing))
            return np.asarray(self.ufunc.reduce(block, axis=axes))
        return self._reduce(self.ufunc, block, self.acc)

    def _accumulator(self, rows: int) -> _Accumulator | None:
        row_elements = math.prod(self.in_row_shape)
        fold = _lane_fold(row_elements, rows)
        if fold < 2 or self._in_order:
            return None
        dtype = _lane_dtype(self.ufunc, self.in_dtype, self.acc)
        return _Accumulated(self, _UfuncLanes(self.ufunc, dtype, row_elements, fold))

    def partial_of_lanes(
        self,
        lanes: Sequence[np.ndarray],
        rows: int,
        shift: np.ndarray | None = None,
        row_offset: int = 0,
    ) -> Partial:
        return self._fold_lanes(self.ufunc, lanes[0], lanes[0].dtype)

    def _combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(self.ufunc(a, b, out=np.empty_like(a)))

    def _finish(self, partial: np.ndarray) -> np.ndarray:
        if self.initial is not np._NoValue:
            partial = np.asarray(self.ufunc(partial, self.initial))
        if self.kind in ("nanmin", "nanmax") and np.isnan(partial).any():
            warnings.warn("All-NaN slice encountered", RuntimeWarning, stacklevel=3)
        return partial.astype(self.out_dtype, copy=False)


class _CountNonzero(RowReduction):
    folds_in_lanes = True

    def _chunk(self, block: np.ndarray, row_offset: int) -> Partial:
        if len(self.axes) == block.ndim:
            return np.asarray(np.count_nonzero(block), dtype=np.intp)
        total = np.zeros(self.core_shape, dtype=np.intp)
        for _, piece in _subblocks(block, 1):
            total += self._reduce(np.add, piece.astype(bool), np.intp)
        return total

    def partial_of_lanes(
        self,
        lanes: Sequence[np.ndarray],
        rows: int,
        shift: np.ndarray | None = None,
        row_offset: int = 0,
    ) -> Partial:
        return self._fold_lanes(np.add, lanes[0], np.intp)

    def _combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.add(a, b, out=np.empty_like(a))

    def _finish(self, partial: np.ndarray) -> np.ndarray:
        return partial.astype(self.out_dtype, copy=False)

    def temp_bytes(self, rows: int) -> int:
        return _CHUNK_BYTES + super().temp_bytes(rows)


class _Mean(RowReduction):
    """Partial (count per output element, sum in the accumulator dtype)."""

    folds_in_lanes = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.acc = accumulator_dtype(self.out_dtype)

    def _chunk(self, block: np.ndarray, row_offset: int) -> Partial:
        return (block.shape[0] * self.reduced_per_row, self._reduce(np.add, block, self.acc))

    def _accumulator(self, rows: int) -> _Accumulator | None:
        row_elements = math.prod(self.in_row_shape)
        fold = _lane_fold(row_elements, rows)
        if fold < 2:
            return None
        return _Accumulated(self, _UfuncLanes(np.add, self.acc, row_elements, fold))

    def partial_of_lanes(
        self,
        lanes: Sequence[np.ndarray],
        rows: int,
        shift: np.ndarray | None = None,
        row_offset: int = 0,
    ) -> Partial:
        return (rows * self.reduced_per_row, self._fold_lanes(np.add, lanes[0], self.acc))

    def _combine(self, a: Partial, b: Partial) -> Partial:
        return (a[0] + b[0], np.add(a[1], b[1], out=np.empty_like(a[1])))

    def derive_from(self, other: RowReduction) -> Callable[[Partial], Partial] | None:
        """A var/std of the same rows (over axis 0 only, float64 sums) holds the count and
        the mean, ``shift + offset``: the sum is their product. Where the var/std sums
        float32 deviations, only a float32 (or float16) mean takes it: the mean is then
        within 5e-11 standard deviations of the float64 one, not within float64's
        rounding."""
        if (
            type(other) is _Moments
            and other.in_dtype == self.in_dtype
            and other.in_row_shape == self.in_row_shape
            and other.axes == self.axes == (0,)
            and other.acc == self.acc == np.float64
            and (not other._narrow or self.out_dtype in _NARROW_DTYPES)
        ):
            return _mean_of_moments
        return None

    def _finish(self, partial: Partial) -> np.ndarray:
        count, total = partial
        if count == 0:
            warnings.warn("Mean of empty slice", RuntimeWarning, stacklevel=3)
        return np.asarray(np.true_divide(total, np.intp(count))).astype(self.out_dtype)


def _mean_of_moments(partial: Partial) -> Partial:
    """A mean's partial ``(count, sum)`` from a var/std partial ``(count, shift,
    offset, M2)`` of the same rows."""
    count, shift, offset, _ = partial
    return (count, (shift + offset) * count)


class _Moments(RowReduction):
    """var and std: partial (count, shift, offset, M2) merged with Chan's formula.

    The mean is ``shift + offset``: a first estimate and its small correction, kept
    apart so that two block means near 1e9 still subtract to their exact difference
    (a mean stored as one float64 near 1e9 is off by up to 6e-8, which Chan's merge
    would multiply into M2).
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ddof = self._kwargs["ddof"]
        complex_in = self.in_dtype.kind == "c" or (
            self._kwargs["dtype"] is not None and self._kwargs["dtype"].kind == "c"
        )
        self.acc = np.dtype(np.complex128) if complex_in else accumulator_dtype(self.out_dtype)
        if self.acc.kind not in "fc":
            self.acc = np.dtype(np.float64)
        self.keep_shape = tuple(
            1 if i in self.trailing else n for i, n in enumerate(self.in_row_shape)
        )
        # One pass in lanes (module docstring) for real data reduced over axis 0 only.
        row_elements = math.prod(self.in_row_shape)
        real = self.in_dtype.kind in "biu" or (
            self.in_dtype.kind == "f" and self.in_dtype.itemsize <= 8
        )
        self._one_pass = real and self.acc == np.float64 and not self.trailing and row_elements > 0
        # float32 deviations where the result is float32 or narrower (module docstring).
        self._narrow = (
            self._one_pass and self.in_dtype in _NARROW_DTYPES and self.out_dtype in _NARROW_DTYPES
        )
        self.folds_in_lanes = self._one_pass

    def _accumulator(self, rows: int) -> _Accumulator | None:
        if not self._one_pass:
            return None
        row_elements = math.prod(self.in_row_shape)
        fold = max(1, _lane_fold(row_elements, rows))
        return _MomentLanes(row_elements, fold, self.core_shape)

    def _chunk(self, block: np.ndarray, row_offset: int) -> Partial:
        if self._narrow and block.flags.c_contiguous and block.size >= _NARROW_MIN:
            found = _narrow_moments(block, self.core_shape)
            if found is not None:
                return found
        if self._one_pass and block.flags.c_contiguous:
            lanes = self._accumulator(block.shape[0])
            lanes.add(block, 0, block.shape[0])  # type: ignore[union-attr]
            return lanes.partial()  # type: ignore[union-attr]
        partial: Partial = None
        for _, piece in _subblocks(block, 2 * self.acc.itemsize):
            count = piece.shape[0] * self.reduced_per_row
            if count == 0:
                zeros = np.zeros(self.core_shape, self.acc)
                one = (0, zeros, zeros, zeros.real.copy())
            else:
                # Corrected two-pass (Chan, Golub, LeVeque): the deviations' own sum
                # corrects the rounding of the first mean estimate.
                guess = self._reduce(np.add, piece, self.acc) / count
                dev = np.subtract(piece, guess.reshape((1, *self.keep_shape)), dtype=self.acc)
                correction = self._reduce(np.add, dev, self.acc) / count
                square = _abs2(dev, out=dev if dev.dtype.kind != "c" else None)
                m2 = self._reduce(np.add, square, square.dtype) - count * _abs2(correction)
                one = (count, guess, correction, m2)
            partial = one if partial is None else self._combine(partial, one)
        return partial

    def partial_of_lanes(
        self,
        lanes: Sequence[np.ndarray],
        rows: int,
        shift: np.ndarray | None = None,
        row_offset: int = 0,
    ) -> Partial:
        if not self._one_pass or shift is None:
            raise TypeError(f"{self!r} has no partial of lanes")
        row_elements = math.prod(self.in_row_shape)
        total = np.add.reduce(lanes[0].reshape(-1, row_elements), axis=0)
        squares = np.add.reduce(lanes[1].reshape(-1, row_elements), axis=0)
        return _moments_of_sums(rows, shift, total, squares, self.core_shape)

    def _combine(self, a: Partial, b: Partial) -> Partial:
        na, shift_a, offset_a, m2_a = a
        nb, shift_b, offset_b, m2_b = b
        if na == 0:
            return b
        if nb == 0:
            return a
        n = na + nb
        delta = (shift_b - shift_a) + (offset_b - offset_a)
        return (
            n,
            shift_a,
            offset_a + delta * (nb / n),
            m2_a + m2_b + _abs2(delta) * (na * nb / n),
        )

    def _finish(self, partial: Partial) -> np.ndarray:
        count, _, _, m2 = partial
        if self.ddof >= count:
            warnings.warn("Degrees of freedom <= 0 for slice", RuntimeWarning, stacklevel=3)
        var = np.true_divide(m2, max(count - self.ddof, 0))
        if self.kind == "std":
            var = np.sqrt(var)
        return np.asarray(var).astype(self.out_dtype)

    def temp_bytes(self, rows: int) -> int:
        return 2 * _CHUNK_BYTES + super().temp_bytes(rows)


class _RealMeanMoments(_Moments):
    """var and std of complex values with a real ``dtype=``, as NumPy computes them: its
    mean, summed in that dtype, keeps only the real parts (with NumPy's ComplexWarning),
    and the deviations from it stay complex. So the result is the variance of the real
    parts plus the mean square of the imaginary parts (not their variance). Partial:
    the real parts' ``(count, shift, offset, M2)`` and the imaginary parts' sum of
    squares."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.acc = np.dtype(np.float64)
        self._one_pass = self._narrow = self.folds_in_lanes = False

    def _chunk(self, block: np.ndarray, row_offset: int) -> Partial:
        squares = np.zeros(self.core_shape, np.float64)
        for _, piece in _subblocks(block, 8):
            squares += self._reduce(np.add, np.square(piece.imag, dtype=np.float64), np.float64)
        return (*super()._chunk(block.real, row_offset), squares)

    def _combine(self, a: Partial, b: Partial) -> Partial:
        return (*super()._combine(a[:4], b[:4]), a[4] + b[4])

    def _finish(self, partial: Partial) -> np.ndarray:
        count, shift, offset, m2, squares = partial
        warnings.warn(
            "Casting complex values to real discards the imaginary part",
            np.exceptions.ComplexWarning,
            stacklevel=3,
        )
        return super()._finish((count, shift, offset, m2 + squares))


class _Accumulated:
    """The accumulator of sum, prod, min, max, any, all and mean: lanes, folded and
    finished the way the reduction's ``_chunk`` finishes a block."""

    __slots__ = ("_lanes", "_op", "add")

    def __init__(self, op: RowReduction, lanes: _UfuncLanes) -> None:
        self._op = op
        self._lanes = lanes
        self.add = lanes.add

    def partial(self) -> Partial:
        lanes = self._lanes
        total = self._op._reduce_trailing(lanes.ufunc, lanes.fold(), lanes.dtype)
        if isinstance(self._op, _Mean):
            return (lanes.rows * self._op.reduced_per_row, total)
        return total


class _MomentLanes:
    """var/std of one block in one pass: (count, shift, offset, M2) from per-lane sums.

    ``shift`` is the pilot: the column means of the first piece of rows added (up to
    ``_MOMENT_ELEMENTS`` elements; its whole wide rows when it has two or more). Each
    piece of rows is cast to float64 into a reused buffer and padded with the shift to
    whole wide rows (padding deviates by exactly 0); the shift, tiled to the piece's
    length, is subtracted (NumPy subtracts a same-shape operand twice as fast as a
    broadcast row), the squares go into the buffer's second half, and one reduction sums
    both halves per lane. See the module docstring for why the pilot keeps the result
    accurate.
    """

    __slots__ = (
        "_buffer", "_core_shape", "_fold", "_shift", "_sums", "_tiled", "row_elements", "rows",
        "width",
    )  # fmt: skip

    def __init__(self, row_elements: int, fold: int, core_shape: tuple[int, ...]) -> None:
        self.row_elements = row_elements
        self.width = fold * row_elements
        self.rows = 0
        self._fold = fold
        self._core_shape = core_shape
        self._shift: np.ndarray | None = None
        self._tiled: np.ndarray | None = None  # the shift repeated over a piece
        self._sums: np.ndarray | None = None  # (2, width): deviations, squared deviations
        self._buffer: np.ndarray | None = None

    def add(self, values: np.ndarray, start: int = 0, stop: int = 0) -> None:
        """Fold the rows of ``values`` in (``start`` and ``stop`` are not needed)."""
        flat = values.reshape(-1)
        row_elements = self.row_elements
        rows = flat.size // row_elements
        if not rows:
            return
        step = max(1, _MOMENT_ELEMENTS // self.width) * self.width
        self.rows += rows
        for first in range(0, flat.size, step):
            self._fold_in(flat[first : first + step])

    def _pilot(self, head: np.ndarray) -> np.ndarray:
        """Column means of the rows of ``head`` (float64, flat, whole rows: the first
        piece, in cache), summed in lanes when there are many."""
        row_elements, width = self.row_elements, self.width
        wide_rows = head.size // width
        if self._fold > 1 and wide_rows >= 2:
            lanes = np.add.reduce(head[: wide_rows * width].reshape(wide_rows, width), axis=0)
            total = np.add.reduce(lanes.reshape(self._fold, row_elements), axis=0)
            return np.asarray(total / (wide_rows * self._fold))
        rows = head.size // row_elements
        return np.asarray(np.add.reduce(head.reshape(rows, row_elements), axis=0) / rows)

    def _fold_in(self, values: np.ndarray) -> None:
        """Add the deviations of ``values`` (flat, whole rows) and their squares to the
        per-lane sums; the first piece sets the pilot shift."""
        width = self.width
        size = values.size
        wide_rows = -(-size // width)
        padded = wide_rows * width
        if self._buffer is None or self._buffer.size < 2 * padded:
            self._buffer = np.empty(2 * padded)
        pair = self._buffer[: 2 * padded].reshape(2, wide_rows, width)
        dev = pair[0].reshape(-1)
        cast = values.dtype != np.float64
        if cast:
            # Cast, then subtract in place: twice as fast as a subtract that casts.
            np.copyto(dev[:size], values, casting="unsafe")
        if self._shift is None:
            self._shift = self._pilot(dev[:size] if cast else values)
        tiled = self._tiled
        if tiled is None or tiled.size < padded:
            tiled = self._tiled = np.empty(padded)
            tiled.reshape(-1, self.row_elements)[...] = self._shift
        shift = tiled[:padded]
        if cast:
            dev[size:] = shift[size:]
            np.subtract(dev, shift, out=dev)
        else:
            np.subtract(values, shift[:size], out=dev[:size])
            dev[size:] = 0.0
        np.multiply(dev, dev, out=pair[1].reshape(-1))
        if self._sums is None:
            self._sums = np.add.reduce(pair, axis=1)
        else:
            np.add(self._sums, np.add.reduce(pair, axis=1), out=self._sums)

    def partial(self) -> Partial:
        """``(count, shift, offset, M2)`` of the rows added (the partial of _Moments)."""
        sums = self._sums.reshape(2, self._fold, self.row_elements)  # type: ignore[union-attr]
        total, squares = np.add.reduce(sums, axis=1) if self._fold > 1 else sums[:, 0]
        return _moments_of_sums(self.rows, self._shift, total, squares, self._core_shape)  # type: ignore[arg-type]


def _moments_of_sums(
    rows: int, shift: np.ndarray, total: np.ndarray, squares: np.ndarray, shape: tuple[int, ...]
) -> Partial:
    """``(count, shift, offset, M2)`` of ``rows`` rows whose deviations from ``shift``
    sum to ``total`` per column, and their squares to ``squares`` (float64)."""
    offset = total / rows
    m2 = squares - total * offset
    # sum((x - shift)**2) - n * offset**2 rounds below zero when the variance is nil
    # and the shift is off; NumPy's variance never is (np.maximum keeps NaN).
    np.maximum(m2, 0.0, out=m2)
    return (rows, shift.reshape(shape), offset.reshape(shape), m2.reshape(shape))


def _narrow_moments(block: np.ndarray, core_shape: tuple[int, ...]) -> Partial | None:
    """``(count, shift, offset, M2)`` of a C-contiguous float32 or float16 block with
    float32 deviations (the module docstring says why that keeps a float32 result's
    accuracy); None where a deviation or its square is not finite in float32 (NaN or
    inf in the data, or a square past float32's range): the caller then takes the
    float64 path.

    The shift of a column is the float32 rounding of its mean over the first
    ``_PILOT_ELEMENTS`` elements where that mean lies more than ``sqrt(_PILOT_SPREAD)``
    standard deviations from zero, and zero elsewhere (then every deviation is exact).
    When the block's mean lies more than that from the shift, the sums are taken again,
    shifted by the block's own mean by the same rule (the module docstring says why).
    """
    rows = block.shape[0]
    row_elements = math.prod(block.shape[1:])
    flat = block.reshape(-1)
    head = min(rows, max(1, _PILOT_ELEMENTS // row_elements))
    first = flat[: head * row_elements].reshape(head, row_elements).astype(np.float64)
    mean = reduce_rows(np.add, first) / head
    np.subtract(first, mean, out=first)
    np.multiply(first, first, out=first)
    shift = _shift_for(mean, reduce_rows(np.add, first) / head)
    for attempt in range(2):
        pilot = shift.astype(np.float32)
        if not np.isfinite(pilot).all():
            return None
        with np.errstate(over="ignore", invalid="ignore"):  # the float64 road warns
            sums = _narrow_sums(flat, pilot, row_elements, _lane_fold(row_elements, rows))
        if not np.isfinite(sums).all():
            return None
        total, squares = sums
        offset = total / rows
        m2 = squares - total * offset
        np.maximum(m2, 0.0, out=m2)  # as in _MomentLanes.partial
        if attempt or not np.any(offset * offset * rows > _PILOT_SPREAD * m2):
            break
        shift = _shift_for(pilot + offset, m2 / rows)
    return (
        rows,
        pilot.astype(np.float64).reshape(core_shape),
        offset.reshape(core_shape),
        m2.reshape(core_shape),
    )


def _shift_for(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """The shift of each column for float32 deviations: its mean where that is more than
    ``sqrt(_PILOT_SPREAD)`` standard deviations from zero, else zero."""
    return np.where(mean * mean > _PILOT_SPREAD * var, mean, 0.0)


def _narrow_sums(flat: np.ndarray, pilot: np.ndarray, row_elements: int, fold: int) -> np.ndarray:
    """``(2, row_elements)`` float64: per column, the sum of ``flat - pilot`` and of its
    squares, whole rows of ``flat`` at a time.

    Each piece of about ``_NARROW_ELEMENTS`` elements is subtracted into a reused float32
    buffer padded with zeros to whole groups of ``_NARROW_SUM_TERMS`` wide rows of
    ``fold`` rows (a whole piece of float32 data with a zero shift is summed where it
    lies). ``np.einsum`` sums the squares ``_NARROW_TERMS`` wide rows at a time and the
    deviations ``_NARROW_SUM_TERMS`` at a time, per lane, in one read each (no square is
    ever stored), and those partial sums add up in float64.
    """
    width = fold * row_elements
    group = _NARROW_SUM_TERMS * width
    step = max(1, _NARROW_ELEMENTS // group) * group
    size = flat.size
    # A zero shift everywhere (data within two deviations of zero) needs no subtraction:
    # whole pieces of float32 data are summed where they lie.
    direct = flat.dtype == np.float32 and not pilot.any()
    tiled = None if direct else np.tile(pilot, min(step, size) // row_elements)
    buffer = np.empty(min(step, -(-size // group) * group), np.float32)
    lanes = np.zeros((2, width))
    for first in range(0, size, step):
        piece = flat[first : first + step]
        n = piece.size
        if direct and n == step:
            dev = piece
        else:
            dev = buffer[: -(-n // group) * group]
            if tiled is None:
                np.copyto(dev[:n], piece)
            else:
                np.subtract(piece, tiled[:n], out=dev[:n])
            dev[n:] = 0.0
        sums = np.einsum("aij->aj", dev.reshape(-1, _NARROW_SUM_TERMS, width))
        lanes[0] += np.add.reduce(sums, axis=0, dtype=np.float64)
        wide = dev.reshape(-1, _NARROW_TERMS, width)
        lanes[1] += np.add.reduce(np.einsum("aij,aij->aj", wide, wide), axis=0, dtype=np.float64)
    return lanes.reshape(2, fold, row_elements).sum(axis=1)


class _ArgReduction(RowReduction):
    """argmin / argmax over all axes or axis 0: partial (values, global indices)."""

    folds_in_lanes = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.find = np.argmin if self.kind == "argmin" else np.argmax
        self.better = np.less if self.kind == "argmin" else np.greater
        self.flat = len(self.axes) == len(self.in_row_shape) + 1 and self._kwargs["axis"] is None
        self.has_nan = self.in_dtype.kind in "fc"

    def _chunk(self, block: np.ndarray, row_offset: int) -> Partial:
        if self.flat:
            flat_index = int(self.find(block))
            value = np.asarray(block[np.unravel_index(flat_index, block.shape)])
            row_size = math.prod(self.in_row_shape)
            return (value, np.asarray(row_offset * row_size + flat_index, dtype=np.int64))
        partial: Partial = None
        for start, piece in _subblocks(block, self.in_dtype.itemsize):
            local = np.asarray(self.find(piece, axis=0))
            values = np.take_along_axis(piece, local[np.newaxis], axis=0)[0]
            one = (values, local.astype(np.int64) + (row_offset + start))
            partial = one if partial is None else self._combine(partial, one)
        return partial

    def _combine(self, a: Partial, b: Partial) -> Partial:
        va, ia = a
        vb, ib = b
        # NaN is ranked below; complex comparisons with NaN parts would warn meanwhile.
        with np.errstate(invalid="ignore"):
            wins = self.better(vb, va)
            tie = vb == va
        if self.has_nan:
            nan_a, nan_b = np.isnan(va), np.isnan(vb)
            wins = wins | (nan_b & ~nan_a)
            tie = tie | (nan_a & nan_b)
        wins = wins | (tie & (ib < ia))
        return (np.where(wins, vb, va), np.where(wins, ib, ia))

    def partial_of_lanes(
        self,
        lanes: Sequence[np.ndarray],
        rows: int,
        shift: np.ndarray | None = None,
        row_offset: int = 0,
    ) -> Partial:
        """Lanes of the best value and its element of the block (-1 where a lane got
        none): per column (or over all, for ``axis=None``), the first NaN, else the
        best value's first element."""
        row_elements = math.prod(self.in_row_shape)
        width = 1 if self.flat else row_elements
        values, found = lanes[0].reshape(-1, width), lanes[1].reshape(-1, width)
        valid = found >= 0
        nan = valid & np.isnan(values) if self.has_nan else np.zeros_like(valid)
        plain = valid & ~nan
        if values.dtype.kind == "f":
            fill = np.inf if self.kind == "argmin" else -np.inf
        else:
            info = np.iinfo(values.dtype)
            fill = info.max if self.kind == "argmin" else info.min
        masked = np.where(plain, values, fill)
        best = masked.min(axis=0) if self.kind == "argmin" else masked.max(axis=0)
        never = np.iinfo(np.int64).max
        first = np.where(plain & (masked == best), found, never).min(axis=0)
        first_nan = np.where(nan, found, never).min(axis=0)
        element = np.where(first_nan < never, first_nan, first)
        value = np.where(first_nan < never, np.nan, best).astype(values.dtype)
        if self.flat:
            index = row_offset * row_elements + element
            return (value.reshape(()), index.reshape(()).astype(np.int64))
        index = (row_offset + element // row_elements).astype(np.int64)
        return (value.reshape(self.core_shape), index.reshape(self.core_shape))

    def _finish(self, partial: Partial) -> np.ndarray:
        return np.asarray(partial[1]).astype(np.intp)

    def temp_bytes(self, rows: int) -> int:
        return _CHUNK_BYTES + super().temp_bytes(rows)


class Histogram:
    """``np.histogram`` of all values of a row-blocked array, as a ReductionOp.

    ``bins`` is a number of equal bins (then ``range=(lo, hi)`` is required: the data's
    range is unknown until every block is read) or a monotonic array of bin edges. Values
    outside the range are left out, the last bin includes its right edge, NaN is left out,
    as in NumPy. ``aggregate`` returns ``(hist, bin_edges)``; with ``density=True`` the
    histogram is normalised like NumPy's.
    """

    row_independent = False
    commutative = True
    n_inputs = 1

    def __init__(
        self,
        in_dtype: Any,
        bins: int | np.ndarray | list[float] = 10,
        range: tuple[float, float] | None = None,
        *,
        density: bool = False,
    ) -> None:
        self.in_dtype = np.dtype(in_dtype)
        if isinstance(bins, str):
            raise ValueError(
                f"histogram bins={bins!r} estimates bins from all the data; give a number of "
                "bins with range=(lo, hi), or the bin edges"
            )
        if np.ndim(bins) == 0 and range is None:
            raise ValueError(
                f"histogram with bins={bins} needs range=(lo, hi): the data's range is unknown "
                "until every block is read (compute min and max first, or give bin edges)"
            )
        self._bins = bins
        self._range = range
        self.density = density
        self.edges = np.histogram_bin_edges(np.empty(0, self.in_dtype), bins=bins, range=range)
        self.out_shape = (len(self.edges) - 1,)
        self.out_dtype = np.dtype(np.float64) if density else np.dtype(np.intp)

    def __repr__(self) -> str:
        return f"Histogram({self.out_shape[0]} bins from {self.edges[0]} to {self.edges[-1]})"

    @property
    def uniform(self) -> tuple[Any, Any, int] | None:
        """``(first_edge, last_edge, bins)`` as NumPy's equal-bins loop takes them (the
        range's own values, an empty range widened by 0.5 each way), or None for bins
        given as edges."""
        if np.ndim(self._bins) != 0 or self._range is None:
            return None
        first, last = self._range
        if first == last:
            first, last = first - 0.5, last + 0.5
        return first, last, int(np.asarray(self._bins).item())

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """Counts per bin of one block (None without rows)."""
        if len(blocks) != 1:
            raise ValueError(f"histogram takes one block, {len(blocks)} were given")
        block = blocks[0]
        if block.dtype != self.in_dtype:
            raise ValueError(f"histogram was built for dtype {self.in_dtype}, got {block.dtype}")
        if block.shape[0] == 0:
            return None
        return np.histogram(block, bins=self._bins, range=self._range)[0]

    def combine(self, a: Partial, b: Partial) -> Partial:
        """Add two count arrays."""
        return combine_partials(a, b, np.add)

    def aggregate(self, partial: Partial) -> tuple[np.ndarray, np.ndarray]:
        """``(hist, bin_edges)`` as ``np.histogram`` returns them."""
        counts = np.zeros(self.out_shape, np.intp) if partial is None else partial
        edges = self.edges.copy()
        if self.density:
            widths = np.array(np.diff(edges), float)
            return counts / widths / counts.sum(), edges
        return counts, edges

    def temp_bytes(self, rows: int) -> int:
        """NumPy's histogram works through its input 65536 values at a time."""
        return 65536 * 24 + self.partial_bytes()

    def partial_bytes(self) -> int:
        """Bytes of the counts."""
        return self.out_shape[0] * 8 + 64


@dataclass(frozen=True, kw_only=True)
class ReductionOptions:
    """How a :class:`Reduction` is run and planned.

    ``with_offset``: ``chunk`` also gets the block's first row. ``n_inputs``: blocks per
    chunk. ``commutative=False`` makes the engine combine neighbouring row ranges only,
    left before right. ``out_dtype`` and ``out_shape`` describe the result when known.
    ``partial_bytes`` (bytes of a partial) and ``temp_bytes(rows)`` (scratch of a chunk)
    feed the memory plan. ``name`` labels it (default: ``chunk``'s name).
    """

    with_offset: bool = False
    n_inputs: int = 1
    commutative: bool = True
    out_dtype: Any = None
    out_shape: tuple[int, ...] | None = None
    partial_bytes: int = 1024
    temp_bytes: Callable[[int], int] | None = None
    name: str | None = None


class Reduction:
    """A user-defined reduction from three functions: a ReductionOp.

    ``chunk(block)`` (or ``chunk(block, row_offset)`` with ``with_offset=True``) gives a
    partial; ``combine(a, b)`` merges two, and must not modify them; ``aggregate(p)``
    finishes (the partial itself when omitted). ``options`` as :class:`ReductionOptions`.

    >>> r = Reduction(lambda b: b.shape[0], lambda a, b: a + b)
    >>> r.aggregate(r.combine(r.chunk(np.ones((3, 2))), r.chunk(np.ones((4, 2)))))
    7
    """

    row_independent = False
    sees_empty_blocks = True  # the user's chunk sees every block, as dask's does

    def __init__(
        self,
        chunk: Callable[..., Any],
        combine: Callable[[Any, Any], Any],
        aggregate: Callable[[Any], Any] | None = None,
        options: ReductionOptions | None = None,
    ) -> None:
        options = options or ReductionOptions()
        self._chunk = chunk
        self._combine = combine
        self._aggregate = aggregate
        self.with_offset = options.with_offset
        self.n_inputs = options.n_inputs
        self.commutative = options.commutative
        self.out_dtype = None if options.out_dtype is None else np.dtype(options.out_dtype)
        self.out_shape = options.out_shape
        self._partial_bytes = options.partial_bytes
        self._temp_bytes = options.temp_bytes
        self.name = options.name or getattr(chunk, "__name__", "reduction")
        self._empty: tuple[np.ndarray, ...] | None = None

    def over(self, dtypes: Sequence[Any], row_shapes: Sequence[tuple[int, ...]]) -> Reduction:
        """This reduction of inputs of ``dtypes`` and ``row_shapes``: over no rows at
        all, its result is the user's functions on blocks of no rows (``aggregate``),
        as for an array of one empty block."""
        bound = copy.copy(self)
        bound._empty = tuple(np.empty((0, *s), d) for d, s in zip(dtypes, row_shapes, strict=True))
        return bound

    def __repr__(self) -> str:
        return f"Reduction({self.name})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        """The user's chunk of these blocks."""
        if len(blocks) != self.n_inputs:
            raise ValueError(
                f"{self.name} takes {self.n_inputs} block(s), {len(blocks)} were given"
            )
        if self.with_offset:
            return self._chunk(*blocks, row_offset)
        return self._chunk(*blocks)

    def combine(self, a: Partial, b: Partial) -> Partial:
        """The user's combine; None (no rows) passes the other partial through."""
        return combine_partials(a, b, self._combine)

    def aggregate(self, partial: Partial) -> Any:
        """The user's aggregate, or the partial itself; of no rows (None), of the user's
        chunk of empty blocks when the inputs are known (:meth:`over`)."""
        if partial is None and self._empty is not None:
            partial = self.chunk(*self._empty)
        return partial if self._aggregate is None else self._aggregate(partial)

    def temp_bytes(self, rows: int) -> int:
        """The user's estimate, else 0."""
        return 0 if self._temp_bytes is None else int(self._temp_bytes(rows))

    def partial_bytes(self) -> int:
        """The size given at construction."""
        return self._partial_bytes
