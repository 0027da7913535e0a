"""The conformance suite's parts: the edge-case corpus, the sampler, how a call runs on
each side, and the one rule that compares tierflow's outcome with NumPy's.

A corpus *point* is one input: a dtype in one byte order, a row count, a row shape, a
block size, a mask and a kind of values. Its arrays follow from its id alone (the
random generator is seeded by it), so a failing test id names everything needed to
rebuild the input. The operands a call sees (:class:`Operands`):

* ``x``: the point's array; lazy on tierflow's side, cut into the point's blocks and,
  when the point has a mask, masked by a lazy boolean array of the same blocks;
* ``y``: another array of the same dtype, rows, blocks and mask (other values);
* ``row``: an in-memory operand of one row's shape (a broadcast constant);
* ``n``: the row count after the mask (known to the test, as a user's constant).

See test_conformance.py for how the corpus is sampled and what a case is.
"""

from __future__ import annotations

import math
import random
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import tierflow as tw

# -- the corpus -------------------------------------------------------------------------

DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
ROWS = (0, 1, 23)
ROW_SHAPES: tuple[tuple[int, ...], ...] = ((), (1,), (3,))
BLOCKS = (1, 7, None)  # rows per block; None: the whole array in one block
MASKS = ("none", "some", "all")  # "some" empties some blocks (or rows), "all" every row
VALUES = ("plain", "edges")  # edges: NaN, ±inf, -0.0 (floats); the type's limits (ints)

# How often the sampler draws each choice: most samples have rows to compute on.
_WEIGHTS: dict[Any, int] = {0: 1, 1: 1, 23: 4, "none": 3, "some": 3, "all": 1}


@dataclass(frozen=True)
class Point:
    """One input of the corpus (see the module docstring)."""

    dtype: str  # NumPy's dtype.str: "<f4", ">i8", "|b1"
    rows: int
    row_shape: tuple[int, ...]
    block: int | None
    mask: str
    values: str

    @property
    def native(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("=")

    @property
    def swapped(self) -> bool:
        return not np.dtype(self.dtype).isnative

    @property
    def ndim(self) -> int:
        return 1 + len(self.row_shape)

    @property
    def kind(self) -> str:
        return self.native.kind

    @property
    def id(self) -> str:
        dtype = self.native.name + ("-swapped" if self.swapped else "")
        shape = "x".join(str(d) for d in (self.rows, *self.row_shape))
        block = "whole" if self.block is None else f"b{self.block}"
        return f"{dtype}-{shape}-{block}-mask_{self.mask}-{self.values}"

    def kept(self) -> np.ndarray | None:
        """The mask's rows (None without a mask)."""
        n = self.rows
        if self.mask == "none":
            return None
        if self.mask == "all":
            return np.zeros(n, bool)
        block = self.block or max(n, 1)
        index = np.arange(n) // block
        if index.max(initial=0) == 0:  # one block: keep its second half
            return np.arange(n) >= n // 2
        return index % 2 == 1  # every other block emptied

    @property
    def rows_after(self) -> int:
        kept = self.kept()
        return self.rows if kept is None else int(kept.sum())


def points() -> Iterator[Point]:
    """Every point of the corpus."""
    for name in DTYPES:
        dt = np.dtype(name)
        orders = (dt,) if dt.itemsize == 1 else (dt, dt.newbyteorder())
        for d in orders:
            for rows in ROWS:
                for row_shape in ROW_SHAPES:
                    for block in BLOCKS:
                        for mask in MASKS:
                            for values in VALUES:
                                yield Point(d.str, rows, row_shape, block, mask, values)


def draw(rng: random.Random) -> Point:
    """One point, each dimension drawn by its weights."""

    def pick(options: Sequence[Any]) -> Any:
        return rng.choices(options, [_WEIGHTS.get(o, 1) for o in options])[0]

    dt = np.dtype(pick(DTYPES))
    if dt.itemsize > 1 and rng.random() < 0.5:
        dt = dt.newbyteorder()
    return Point(dt.str, pick(ROWS), pick(ROW_SHAPES), pick(BLOCKS), pick(MASKS), pick(VALUES))


# -- the inputs -------------------------------------------------------------------------


def _seed(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def values(point: Point, shape: tuple[int, ...], salt: str) -> np.ndarray:
    """Values of ``shape`` for ``point`` (native order): small numbers with repeats, and
    for ``edges`` NaN, ±inf and -0.0 (floats) or the type's limits (integers) mixed in."""
    rng = np.random.default_rng(_seed(point.id, salt))
    n = math.prod(shape)
    dt = point.native
    edges = point.values == "edges"
    if dt.kind == "b":
        return (rng.random(n) < 0.5).reshape(shape)
    if dt.kind in "iu":
        low = 0 if dt.kind == "u" else -6
        v = rng.integers(low, 7, n).astype(dt)
        if edges:
            info = np.iinfo(dt)
            limits = np.array([info.min, info.max, 0, 1, info.max - 1], dt)
            spots = rng.random(n) < 0.4
            v[spots] = rng.choice(limits, int(spots.sum()))
        return v.reshape(shape)
    part = dt.type(0).real.dtype
    v = _floats(rng, n, part, edges)
    if dt.kind == "c":
        real, v = v, np.empty(n, dt)
        v.real, v.imag = real, _floats(rng, n, part, edges)
    return v.astype(dt).reshape(shape)


def _floats(rng: np.random.Generator, n: int, dt: np.dtype, edges: bool) -> np.ndarray:
    v = rng.normal(0, 3, n)
    if n:
        repeat = rng.random(n) < 0.3  # ties, for sorting, counting and quantiles
        v[repeat] = v[rng.integers(0, n, int(repeat.sum()))]
    if edges:
        spots = rng.random(n) < 0.4
        v[spots] = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0]), int(spots.sum()))
    return v.astype(dt)


@dataclass(frozen=True)
class Operands:
    """What a call is given (see the module docstring)."""

    x: Any
    y: Any
    row: np.ndarray
    n: int
    point: Point


def numpy_operands(point: Point) -> Operands:
    shape = (point.rows, *point.row_shape)
    stored = np.dtype(point.dtype)
    x = values(point, shape, "x").astype(stored)
    y = values(point, shape, "y").astype(stored)
    row = values(point, point.row_shape, "row").astype(stored)
    kept = point.kept()
    if kept is not None:
        x, y = x[kept], y[kept]
    return Operands(x, y, row, point.rows_after, point)


def lazy_operands(point: Point, salt: str) -> Operands:
    """The point's operands on tierflow's side. The mask is lazy, ``r > 0.75`` over a
    lazy ``r`` that is 1 to 1.5 on the kept rows and 0 to 0.5 on the others, drawn by
    ``salt``: each test's mask has a key of its own, so no test finds row counts that
    another counted (tierflow remembers counts by the mask's key)."""
    shape = (point.rows, *point.row_shape)
    stored = np.dtype(point.dtype)
    block = point.block or max(point.rows, 1)
    x = tw.from_array(values(point, shape, "x").astype(stored), rows=block)
    y = tw.from_array(values(point, shape, "y").astype(stored), rows=block)
    row = values(point, point.row_shape, "row").astype(stored)
    kept = point.kept()
    if kept is not None:
        rng = np.random.default_rng(_seed(point.id, salt))
        r = tw.from_array(kept + rng.uniform(0, 0.5, point.rows), rows=block)
        x, y = x[r > 0.75], y[r > 0.75]
    return Operands(x, y, row, point.rows_after, point)


# -- calls and their outcomes -------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """How a float result is compared with NumPy's (integers and booleans are always
    exact; NaN must be where NumPy has NaN):

    * ``floats``: ``"exact"`` (values moved or picked, not computed: sorts, selections,
      quantiles), ``"ulps"`` (computed value by value, by NumPy's own kernels, whose
      SIMD and plain loops may differ in the last place: within 4 units of it, or of
      a complex value's modulus, as complex products cancel in a part) or
      ``"sums"`` (accumulated in another order and precision: :func:`tolerance`);
    * ``signed``: the sign of a zero must be NumPy's too;
    * ``power``: the power of the inputs a result's terms have (2 for variances and
      products), for the tolerance's scale;
    * ``blas``: NumPy computes it with BLAS, which reports no floating-point error;
    * ``nan_filled``: NumPy interpolates a column that holds NaN before it gives NaN
      there (the quantiles), and warns from that interpolation;
    * ``cast_back``: NumPy computes it in float64 and casts back to the integer dtype
      (``np.round`` of integers to tens);
    * ``input_precision``: NumPy keeps intermediate values in the input's dtype
      whatever ``dtype=`` says (``np.nanvar``'s deviations);
    * ``lapack``: NumPy calls LAPACK (an SVD);
    * ``multiplies``: a product of the values (``np.prod``).

    :func:`assert_conforms` says what each allows. ``free_nonfinite`` (a result's NaN
    and infinities are not told apart) and ``finite_for_inf`` (a finite value where
    NumPy's overflowed) are set there, not by a case."""

    floats: str = "exact"
    signed: bool = False
    power: int = 1
    blas: bool = False
    nan_filled: bool = False
    cast_back: bool = False
    input_precision: bool = False
    lapack: bool = False
    multiplies: bool = False
    free_nonfinite: bool = False
    finite_for_inf: bool = False
    input_dtype: np.dtype | None = None  # set there for input_precision

    @property
    def exact(self) -> bool:
        return self.floats == "exact"


EXACT = Rule()
SIGNED = Rule(signed=True)
ELEMENTWISE = Rule("ulps", signed=True)  # ufuncs and operators
UNSIGNED_ELEMENTWISE = Rule("ulps")  # max, min, fmax, fmin: the sign of tied zeros is free
ROUNDED = Rule("sums")  # sums and means of the values
PRODUCT = Rule("sums", multiplies=True)  # products of the values
SQUARES = Rule("sums", power=2)  # variances and norms
PRODUCTS = Rule("sums", power=2, blas=True)  # x @ w, x.T @ y, einsum, covariances


@dataclass(frozen=True)
class Call:
    """One way to call an entry. ``run`` is called with the lazy operands and with
    NumPy's; ``oracle``, when given, gives NumPy's answer instead (for tierflow's own
    functions). ``post`` turns both computed results into what is compared (a
    factorisation's signs made unique, say). ``refused``: the call is documented as
    refused on lazy arrays (tierflow must raise this type, whatever NumPy does); a
    function of the lazy operands where that depends on what tierflow knows (a row
    count unknown after a mask)."""

    label: str
    run: Callable[[Operands], Any]
    oracle: Callable[[Operands], Any] | None = None
    post: Callable[[Any], Any] | None = None
    rule: Rule | None = None  # the case's rule when None
    refused: type[BaseException] | Callable[[Operands], type[BaseException] | None] | None = None

    def refusal(self, lazy: Operands) -> type[BaseException] | None:
        """The error tierflow must raise on ``lazy``, if it must."""
        if self.refused is None or isinstance(self.refused, type):
            return self.refused
        return self.refused(lazy)


@dataclass
class Outcome:
    """A call's result (computed) or its error, and the categories of its warnings."""

    value: Any = None
    error: BaseException | None = None
    warned: set[type[Warning]] = field(default_factory=set)

    def describe(self) -> str:
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        return _short(self.value)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, np.ndarray) else f"{value.dtype} {value!r}"
    return text if len(text) < 600 else text[:600] + "..."


def materialise(result: Any) -> Any:
    """``result`` with every lazy array in it (also inside tuples) computed, in one
    compute as a user would."""
    lazies: list[tw.Array] = []

    def collect(v: Any) -> None:
        if isinstance(v, tw.Array):
            lazies.append(v)
        elif isinstance(v, tuple):
            for item in v:
                collect(item)

    collect(result)
    computed = iter(tw.compute(*lazies, progress=False) if lazies else ())

    def swap(v: Any) -> Any:
        if isinstance(v, tw.Array):
            return next(computed)
        if isinstance(v, tuple):
            return tuple(swap(item) for item in v)
        return v

    return swap(result)


def _observe(fn: Callable[[], Any]) -> Outcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn()
        except Exception as exc:
            error: BaseException | None = exc
            value = None
        else:
            error = None
    return Outcome(value, error, {w.category for w in caught})


def numpy_outcome(call: Call, ops: Operands) -> Outcome:
    answer = call.oracle or call.run
    outcome = _observe(lambda: answer(ops))
    if outcome.error is None and call.post is not None:
        outcome.value = call.post(outcome.value)
    return outcome


def lazy_outcome(call: Call, ops: Operands) -> Outcome:
    outcome = _observe(lambda: materialise(call.run(ops)))
    if outcome.error is None and call.post is not None:
        outcome.value = call.post(outcome.value)
    return outcome


# -- the comparison -----------------------------------------------------------------------


def tolerance(dtype: np.dtype, scale: float, terms: int) -> tuple[float, float]:
    """``(rtol, atol)`` for a float result of ``dtype`` from ``terms`` input values of
    magnitude ``scale`` (the sum of their absolute finite values, at least 1).

    tierflow accumulates float sums and products in float64 and casts the result, where
    NumPy works in the data's own precision: the two differ by NumPy's own rounding
    error, about ``log2(n) * eps * sum(|x|)`` for a sum (pairwise) and up to ``n * eps``
    relative for a product of ``n`` values. So the tolerance is relative, ``eps`` of the
    result's precision times 16 or four times the terms, and absolute against the
    inputs' scale."""
    eps = float(np.finfo(dtype).eps)
    return eps * max(16, 4 * terms), 16 * eps * scale


def scale_of(ops: Operands, rule: Rule) -> float:
    """The magnitude of the inputs, for :func:`tolerance`: the sum of the absolute
    finite values of ``x``, ``y`` and ``row`` to the rule's power, at least 1."""
    total = 1.0
    for a in (ops.x, ops.y, ops.row):
        v = np.abs(np.asarray(a).astype(np.complex128 if a.dtype.kind == "c" else np.float64))
        v = v[np.isfinite(v)]
        total += float((v**rule.power).sum())
    return total


def assert_conforms(got: Outcome, want: Outcome, rule: Rule, ops: Operands) -> None:
    """tierflow's outcome ``got`` against NumPy's ``want`` on NumPy's operands ``ops``:
    the same error type, or the same warnings (by category), dtypes, shapes and values
    by ``rule``.

    NumPy's error classes of private modules count as their public base (NumPy's
    ``_ArrayMemoryError`` is a MemoryError, ``UFuncTypeError`` a TypeError).

    The allowances, each for a difference that is NumPy's own code path, not its
    answer, and each only where the inputs hold what brings it about:

    * RuntimeWarning (not its subclasses, such as ComplexWarning) where the inputs hold
      a NaN or an infinity (the results are compared as they are): a sum (a rule of
      ``"sums"``) adds in another order than NumPy's, and whether ``inf - inf`` comes
      before a NaN depends on that order; NumPy's products through BLAS
      (``rule.blas``) report no floating-point error at all, where tierflow's float64
      partials do; NumPy's quantiles (``rule.nan_filled``) interpolate the values of a
      column that holds NaN, warning where they are infinite, before NumPy puts NaN
      there, where tierflow gives the NaN at once.
    * Products where the inputs hold an infinity: NaN and infinities are not told
      apart (both must be non-finite at the same places). Through BLAS (``rule.blas``):
      BLAS scales a complex product by ``alpha = 1 + 0j`` (``inf * 0`` is NaN) and its
      matrix-vector product skips the zeros of the vector (no ``inf * 0``), NumPy's own
      loop does neither, and NumPy picks one or the other by the operands' sizes and
      memory layout. A product of complex values (``rule.multiplies``): whether
      ``inf * 0`` meets a part depends on the order of the factors, NumPy's as
      tierflow's.
    * Integers rounded to tens and hundreds (``rule.cast_back``) where NumPy warns
      (``invalid value encountered in cast``): a value rounded past the integer type's
      range is cast back from float64 out of range, an undefined cast whose result and
      warning depend on the loop NumPy runs (its SIMD loop or not, by the array's
      length: ``np.round(np.uint32([2**32 - 1]), -1)`` is 4 without a warning, and 0
      with one in an array of 20). Then only dtypes and shapes are compared.
    * A product of float16 or float32 values (``rule.multiplies``) where NumPy warns of
      an overflow and tierflow does not: NumPy multiplies in the data's precision, and
      a product can overflow to an infinity on the way where tierflow's, in float64
      (operators/reductions.py), stays finite: there a finite value stands for
      NumPy's infinity.
    * Intermediates in the input's dtype (``rule.input_precision``): the tolerance is
      that of the input's float type where it is coarser than the result's (NumPy's
      ``np.nanvar(x, dtype=np.float64)`` of float16 data stores its deviations in
      float16; tierflow's are float64).
    * LAPACK (``rule.lapack``) where the inputs hold a NaN or an infinity: NumPy's SVD
      either raises LinAlgError ("SVD did not converge") or gives NaN, by the matrix;
      tierflow's runs on another matrix (the R of its QR), so one side's LinAlgError
      and the other's NaN are the same outcome."""
    nan, infinite = _special(ops)
    if rule.lapack and (nan or infinite) and _unconverged(got, want):
        return
    if want.error is not None:
        assert got.error is not None, (
            f"NumPy raises {want.describe()}; tierflow answers {got.describe()}"
        )
        assert isinstance(got.error, _public(type(want.error))), (
            f"NumPy raises {want.describe()}; tierflow raises {got.describe()}"
        )
        return
    if got.error is not None:
        raise AssertionError(
            f"NumPy answers {want.describe()}; tierflow raises {got.describe()}"
        ) from got.error
    warned = {"got": set(got.warned), "want": set(want.warned)}
    overflowed = rule.multiplies and (
        RuntimeWarning in warned["want"] and RuntimeWarning not in warned["got"]
    )
    undefined = (
        rule.cast_back
        and np.asarray(ops.x).dtype.kind in "iu"
        and any(RuntimeWarning in found for found in warned.values())
    )
    if (
        (rule.floats == "sums" and nan)
        or (rule.blas and (nan or infinite))
        or (rule.nan_filled and nan)
        or undefined
        or overflowed
    ):
        for found in warned.values():
            found.discard(RuntimeWarning)
    assert _names(warned["got"]) == _names(warned["want"]), (
        f"warnings: NumPy {_names(want.warned)}, tierflow {_names(got.warned)}"
    )
    if undefined:
        g, w = np.asarray(got.value), np.asarray(want.value)
        assert (_native(g.dtype), g.shape) == (_native(w.dtype), w.shape), (
            f"dtype and shape {g.dtype} {g.shape}, NumPy's {w.dtype} {w.shape}"
        )
        return
    values = want.value if isinstance(want.value, tuple) else (want.value,)
    complex_result = any(np.asarray(v).dtype.kind == "c" for v in values)
    if infinite and (rule.blas or (rule.multiplies and complex_result)):
        rule = replace(rule, free_nonfinite=True)
    if rule.input_precision:
        rule = replace(rule, input_dtype=np.asarray(ops.x).dtype)
    if overflowed:
        rule = replace(rule, finite_for_inf=True)
    same(got.value, want.value, rule, scale_of(ops, rule), max(ops.n, 1))


def _unconverged(got: Outcome, want: Outcome) -> bool:
    """Whether one side raised LinAlgError and the other gave only NaN (or both raised
    it)."""

    def outcome(o: Outcome) -> str:
        if isinstance(o.error, np.linalg.LinAlgError):
            return "raised"
        if o.error is None and o.value is not None:
            values = np.asarray(o.value)
            if values.dtype.kind in "fc" and values.size and bool(np.isnan(values).all()):
                return "nan"
        return "other"

    found = {outcome(got), outcome(want)}
    return "raised" in found and "other" not in found


def _public(error: type[BaseException]) -> type[BaseException]:
    """``error``, or its first base outside NumPy's private modules."""
    for cls in error.__mro__:
        if not cls.__module__.startswith("numpy._"):
            return cls
    return error


def _special(ops: Operands) -> tuple[bool, bool]:
    """Whether the inputs hold a NaN, and whether they hold an infinity."""
    floats = [a for a in (ops.x, ops.y, ops.row) if a.dtype.kind in "fc"]
    return (
        any(bool(np.isnan(a).any()) for a in floats),
        any(bool(np.isinf(a).any()) for a in floats),
    )


def _names(categories: set[type[Warning]]) -> list[str]:
    return sorted(c.__name__ for c in categories)


def same(  # noqa: PLR0913 -- the values, the rule and what the tolerance needs
    got: Any, want: Any, rule: Rule, scale: float, terms: int, where: str = "result"
) -> None:
    """``got`` equals ``want`` by ``rule`` (:func:`tolerance` takes ``scale`` and
    ``terms``); tuples item by item."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), (
            f"{where}: NumPy gives a tuple of {len(want)}, tierflow {_short(got)}"
        )
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, rule, scale, terms, f"{where}[{k}]")
        return
    if isinstance(want, (bool, int, float, complex, list, type(None))):
        assert type(got) is type(want), (
            f"{where}: NumPy gives a {type(want).__name__}, tierflow a {type(got).__name__}"
        )
    g, w = np.asarray(got), np.asarray(want)
    # A result's byte order is how it is stored, not its value.
    assert _native(g.dtype) == _native(w.dtype), f"{where}: dtype {g.dtype}, NumPy's {w.dtype}"
    assert g.shape == w.shape, f"{where}: shape {g.shape}, NumPy's {w.shape}"
    tol = (0.0, 0.0)
    if w.dtype.kind in "fc" and rule.floats == "sums":
        tol = tolerance(_coarsest(w.real.dtype, rule.input_dtype), scale, terms)
    elif w.dtype.kind in "fc" and rule.floats == "ulps":
        tol = (4 * float(np.finfo(w.real.dtype).eps), 0.0)
    if w.dtype.kind in "fc" and rule.free_nonfinite:
        assert np.array_equal(np.isfinite(g), np.isfinite(w)), (
            f"{where}: non-finite values at other places\n  got  {g!r}\n  want {w!r}"
        )
        g, w = g[np.isfinite(g)], w[np.isfinite(w)]
    if w.dtype.kind == "c" and rule.floats == "ulps":
        # Complex values within 4 units of their modulus: NumPy's SIMD loop multiplies
        # complex numbers with fused multiply-adds, its plain loop rounds twice, so a
        # part that cancels (a*c - b*d) differs by more than 4 of its own units.
        modulus = np.abs(w)
        tol = (tol[0], tol[0] * np.where(np.isfinite(modulus), modulus, 0.0))
    if w.dtype.kind == "c":
        same_values(g.real, w.real, rule, tol, where + ".real")
        same_values(g.imag, w.imag, rule, tol, where + ".imag")
    else:
        same_values(g, w, rule, tol, where)


def _coarsest(result: np.dtype, given: np.dtype | None) -> np.dtype:
    """``result``, or the float type of ``given`` (an input's dtype) where that is
    coarser."""
    if given is None or np.dtype(given).kind not in "fc":
        return result
    part = np.dtype(given).type(0).real.dtype
    return part if np.finfo(part).eps > np.finfo(result).eps else result


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=") if dtype.byteorder != "|" else dtype


def same_values(
    g: np.ndarray, w: np.ndarray, rule: Rule, tol: tuple[float, Any], where: str
) -> None:
    """Values equal by ``rule``: NaN at NumPy's places, then exact or within ``tol``
    (``(rtol, atol)``, ``atol`` a number or one per value), and the signs of zeros
    where the rule says."""
    if w.dtype.kind != "f":
        assert np.array_equal(g, w), f"{where}: values differ\n  got  {g!r}\n  want {w!r}"
        return
    rtol, atol = tol[0], np.broadcast_to(np.asarray(tol[1], np.float64), w.shape)
    if rule.finite_for_inf:
        kept = ~(np.isinf(w) & np.isfinite(g))
        g, w, atol = g[kept], w[kept], atol[kept]
    nan = np.isnan(w)
    assert np.array_equal(np.isnan(g), nan), (
        f"{where}: NaN at other places\n  got  {g!r}\n  want {w!r}"
    )
    g, w, atol = g[~nan], w[~nan], atol[~nan]
    if rule.exact:
        ok = np.array_equal(g, w)
    else:
        finite = np.isfinite(w)
        gap = np.abs(g[finite].astype(float) - w[finite])
        ok = np.array_equal(g[~finite], w[~finite]) and bool(
            np.all(gap <= atol[finite] + rtol * np.abs(w[finite]))
        )
    how = "exact" if rule.exact else "tolerance"
    assert ok, f"{where}: values differ ({how})\n  got  {g!r}\n  want {w!r}"
    if rule.signed:
        assert np.array_equal(np.signbit(g), np.signbit(w)), (
            f"{where}: signs of zeros differ\n  got  {g!r}\n  want {w!r}"
        )
