"""The source of a compiled kernel: a fused reduction as one loop over a block.

:func:`reduction_source` writes the Python source of one function that numba compiles
(:mod:`tierflow.operators.compiled.kernels`): it reads each element of the block once,
evaluates the elementwise expression on it in registers, and folds the value into
per-lane partials (the lanes of :mod:`tierflow.operators.reductions`: ``fold`` rows of
``W`` elements side by side, so the inner loop is long, has no dependency from one
element to the next and vectorises)::

    def kernel(n, i0, c0, c1, lanes0):
        whole = n - n % 128
        for base in range(0, whole, 128):
            for l in range(128):
                e = base + l
                v0 = i0[e]  # input 0
                v1 = np.float32(v0 * c0)  # multiply
                v2 = np.float32(v1 + c1)  # add
                v3 = np.float32(np.sqrt(v2))  # sqrt
                lanes0[l] += np.float64(v3)
        for e in range(whole, n):  # the last rows
            l = e - whole
            ...

Semantics are NumPy's, written out: every operation casts its operands to the dtypes of
the loop NumPy picks for it (``ufunc.resolve_dtypes``, NEP 50 weak scalars included) and
its result to the node's dtype, so ``float32 * 2`` stays float32 (numba alone would
widen it to float64) and integers wrap as NumPy's do (64-bit signed arithmetic runs on
unsigned values, which wrap by definition). ``minimum``/``maximum`` return the second
operand on a tie, as NumPy's loops do (the sign of zero), and propagate NaN; ``clip`` is
NumPy's ``max`` then ``min``.

Floating-point errors: NumPy warns (or raises, under ``np.errstate``) where an operation
makes a NaN from operands without one (invalid) or an infinity from finite operands
(overflow, divide by zero). The kernel does not test each result for it; the caller
sends a block back to the NumPy path, which warns or raises as NumPy does and gives the
same values, whenever a lane ends up NaN or infinite. That catches every error whose
NaN or infinity reaches the reduced value: through a sum, product, mean or variance,
and through operations that surely pass a NaN or an infinity on (``+ - *``, the
dividend of ``/``, sqrt, log, ...: ``_PROPAGATES``). A result that may not reach it
(an operand of a comparison, of ``where`` or of a min) adds ``v - v`` to a
witness lane: 0 for a finite value, NaN otherwise. Data holding NaN or infinity take
the NumPy path too (slower, never wrong).

What it does not compile gets :class:`Unsupported` with the reason (shown by
``describe()``): transcendental functions (``exp``, ``log``, ``sin``, ``power``, ...:
numba calls libm for each element, where NumPy's loops are vectorised and faster),
float16 and complex values, float to integer casts (NumPy's result for NaN or an
out-of-range value is the machine's), integer division and remainders other than by a
constant that is neither 0 nor -1 (NumPy warns, or the smallest value overflows), powers
and shifts, ufunc keywords, rounding, broadcasting between inputs of different row
shapes, and reductions over trailing axes for var/std, argmin and argmax.

Constants do not enter the source: each is an argument (``c0``, ...), cast to the dtype
its operation reads it in and, for arrays, tiled over the lanes. So the source, and the
key of the compiled kernel (:attr:`KernelSource.key`), depend on the expression's shape
and dtypes only: ``(x - m) / s`` compiles once for every ``m`` and ``s``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..elementwise import Apply, AsType, Clip, Expr, Input, Where, infer, walk
from ..reductions import RowReduction, accumulator_dtype

__all__ = [
    "SOURCE_VERSION",
    "KernelSource",
    "Unsupported",
    "bincount_source",
    "elementwise_source",
    "histogram_source",
    "lanes_for",
    "masked_source",
    "reduction_source",
]

SOURCE_VERSION = 2  # part of every key: bump when the generated code changes meaning
LANE_ELEMENTS = 128  # lanes of the inner loop for narrow rows (a multiple of the vector width)
_MIN_LANE_ELEMENTS = 32  # and at least this many lanes per array
_MAX_FOLD_ELEMENTS = 1024  # rows at least this wide get one lane per element of a row


class Unsupported(Exception):
    """The kernel cannot be compiled; the message says why (the NumPy path runs)."""


@dataclass(frozen=True)
class KernelSource:
    """A kernel's module source and what calling it takes.

    ``key`` identifies the compiled code (a hash of the source, which names every dtype);
    ``consts`` are the constant arguments in order; ``lanes`` the lanes per reduction;
    ``lane_inits`` the dtype and initial value of each lanes array the kernel folds into,
    and whether a NaN or an infinity there sends the block to the NumPy path.
    """

    text: str
    consts: tuple[Any, ...] = field(compare=False)
    inputs: tuple[int, ...]  # the block inputs the kernel reads, in argument order
    input_dtypes: tuple[np.dtype, ...]  # their dtypes
    lanes: int
    row_elements: int
    lane_inits: tuple[tuple[np.dtype, Any, bool], ...]  # dtype, initial value, checked
    pilot: bool  # the kernel takes the var/std pilot shift (float64 per lane) first
    out_dtype: np.dtype | None = None  # an elementwise kernel's output (its last argument)
    masked: bool = False  # a reduction of the rows a mask keeps (masked_source)
    edges_dtype: np.dtype | None = None  # a histogram's (histogram_source): edges, counts last
    counts: bool = False  # a bincount's (bincount_source): counts, then what it saw, last
    key: str = field(init=False)

    def __post_init__(self) -> None:
        # The module ends with warm(), which names every argument's type: two kernels
        # that differ in a constant's dtype only have different keys.
        object.__setattr__(self, "text", self.text + _warm_source(self))
        digest = hashlib.sha256(f"{SOURCE_VERSION}\n{self.text}".encode()).hexdigest()
        object.__setattr__(self, "key", digest[:32])


def _warm_source(source: KernelSource) -> str:
    """``warm()``: the kernel called on no elements with arguments of its own types,
    which compiles it, or loads it from numba's cache (strided inputs too for a column:
    ``x[:, 0]`` of a wider block comes strided)."""

    def arguments(strided: bool) -> str:
        args = ["0"]
        if source.pilot:
            args.append(f"np.zeros({source.lanes})")
        for d in source.input_dtypes:
            args.append(
                f"np.empty(4, np.{d.name})[::2]" if strided else f"np.empty(0, np.{d.name})"
            )
        for c in source.consts:
            dtype = np.asarray(c).dtype
            args.append(f"np.zeros(1, np.{dtype.name})" if np.ndim(c) else f"np.{dtype.name}(0)")
        args += [f"np.zeros({source.lanes}, np.{d.name})" for d, _, _ in source.lane_inits]
        if source.out_dtype is not None:
            args.append(f"np.empty(0, np.{source.out_dtype.name})")
        if source.masked:
            args.append("np.zeros(1, np.int64)")
        if source.edges_dtype is not None:
            args += [f"np.zeros(2, np.{source.edges_dtype.name})", "np.zeros(1, np.intp)"]
        if source.counts:
            args += ["np.zeros(1, np.intp)", "np.zeros(2, np.int64)"]
        return ", ".join(args)

    lines = ["", "", "def warm():", f"    kernel({arguments(False)})"]
    if source.row_elements == 1:
        lines.append(f"    kernel({arguments(True)})")
    return "\n".join(lines) + "\n"


def lanes_for(row_elements: int, arrays: int = 1) -> int:
    """Lanes of the inner loop for rows of ``row_elements`` elements folded into
    ``arrays`` lanes arrays: a whole number of rows, and for narrow rows at least
    :data:`LANE_ELEMENTS` elements over all the arrays together (128 lanes for a sum,
    64 for the two sums of a variance: 128 there spill out of the vector registers and
    run at 0.6x).

    >>> lanes_for(8), lanes_for(8, 2), lanes_for(3), lanes_for(2000)
    (128, 64, 384, 2000)
    """
    if row_elements >= _MAX_FOLD_ELEMENTS:
        return row_elements
    elements = max(_MIN_LANE_ELEMENTS, LANE_ELEMENTS >> (max(arrays, 1) - 1).bit_length())
    fold = elements // math.gcd(row_elements, elements)
    return row_elements * fold


_FLOATS = {np.dtype(np.float32): "np.float32", np.dtype(np.float64): "np.float64"}
_INTS = {
    np.dtype(t): f"np.{np.dtype(t).name}"
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
}


def _type(dtype: np.dtype, what: str) -> str:
    """The numba constructor of ``dtype`` (``np.float32``), or Unsupported."""
    if dtype in _FLOATS:
        return _FLOATS[dtype]
    if dtype in _INTS:
        return _INTS[dtype]
    if dtype == np.bool_:
        return "np.bool_"
    raise Unsupported(f"{what} has dtype {dtype}, which the compiler does not handle")


def _cast(code: str, src: np.dtype, dst: np.dtype, what: str) -> str:
    """``code`` (a value of ``src``) as a value of ``dst``, NumPy's unsafe cast."""
    _type(src, what)
    ctor = _type(dst, what)
    if src == dst:
        return code
    if dst == np.bool_:
        return f"({code} != 0)"
    if src.kind == "f" and dst.kind in "iu":
        raise Unsupported(
            f"{what} casts {src} to {dst}: NumPy's result for NaN and values out of range "
            "is the machine's"
        )
    return f"{ctor}({code})"


# Operations of the float loops: a format of the operand names a, b.
_FLOAT_UNARY = {
    "negative": "-{a}",
    "positive": "{a}",
    "absolute": "abs({a})",
    "fabs": "abs({a})",
    "square": "{a} * {a}",
    "sqrt": "np.sqrt({a})",
    "cbrt": "np.cbrt({a})",
    "reciprocal": "{one} / {a}",
    "exp": "np.exp({a})",
    "exp2": "np.exp2({a})",
    "expm1": "np.expm1({a})",
    "log": "np.log({a})",
    "log2": "np.log2({a})",
    "log10": "np.log10({a})",
    "log1p": "np.log1p({a})",
    "sin": "np.sin({a})",
    "cos": "np.cos({a})",
    "tan": "np.tan({a})",
    "arcsin": "np.arcsin({a})",
    "arccos": "np.arccos({a})",
    "arctan": "np.arctan({a})",
    "sinh": "np.sinh({a})",
    "cosh": "np.cosh({a})",
    "tanh": "np.tanh({a})",
    "arcsinh": "np.arcsinh({a})",
    "arccosh": "np.arccosh({a})",
    "arctanh": "np.arctanh({a})",
    "floor": "np.floor({a})",
    "ceil": "np.ceil({a})",
    "trunc": "np.trunc({a})",
    "rint": "np.rint({a})",
}
_FLOAT_BINARY = {
    "add": "{a} + {b}",
    "subtract": "{a} - {b}",
    "multiply": "{a} * {b}",
    "divide": "{a} / {b}",
    "true_divide": "{a} / {b}",
    "power": "{a} ** {b}",
    "arctan2": "np.arctan2({a}, {b})",
    "hypot": "np.hypot({a}, {b})",
    "minimum": "_minimum({a}, {b})",
    "maximum": "_maximum({a}, {b})",
    "fmin": "_fmin({a}, {b})",
    "fmax": "_fmax({a}, {b})",
}
# Where a NaN or an infinity in operand k of a float operation surely gives a NaN or an
# infinity (so that it reaches a sum of the results): x / inf is 0, exp(-inf) is 0,
# min(inf, 1) is 1, so those do not pass on their operands.
_PROPAGATES: dict[str, tuple[int, ...]] = {
    **{name: (0, 1) for name in ("add", "subtract", "multiply")},
    **{name: (0,) for name in ("divide", "true_divide", "astype", "negative", "positive",
                               "absolute", "fabs", "square", "sqrt", "cbrt", "log", "log2",
                               "log10", "log1p", "sin", "cos", "tan", "arcsin", "arccos",
                               "sinh", "cosh", "arcsinh", "arccosh", "arctanh", "floor",
                               "ceil", "trunc", "rint")},
}  # fmt: skip
# Float operations numba calls libm for, one element at a time, where NumPy's loops
# are vectorised (AVX2, AVX-512): a kernel with one of them runs at 0.1-0.7x the NumPy
# path's speed (tanh 0.12x, sin 0.40x, exp 0.45-0.69x, on 2 GB of float32), so those
# programs keep the NumPy path.
_SLOWER = frozenset(
    {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "arcsin",
     "arccos", "arctan", "sinh", "cosh", "tanh", "arcsinh", "arccosh", "arctanh", "cbrt",
     "power", "arctan2", "hypot"}
)  # fmt: skip
# Float operations that never raise a floating-point error.
_QUIET = frozenset(
    {"negative", "positive", "absolute", "fabs", "floor", "ceil", "trunc", "rint", "minimum",
     "maximum", "fmin", "fmax"}
)  # fmt: skip
_COMPARE = {
    "greater": ">",
    "greater_equal": ">=",
    "less": "<",
    "less_equal": "<=",
    "equal": "==",
    "not_equal": "!=",
}
_PREDICATES = {"isnan": "np.isnan({a})", "isinf": "np.isinf({a})", "isfinite": "np.isfinite({a})"}
_LOGICAL = {
    "logical_and": "(({a} != 0) & ({b} != 0))",
    "logical_or": "(({a} != 0) | ({b} != 0))",
    "logical_xor": "(({a} != 0) != ({b} != 0))",
}
_INT_EXACT = {  # integer operations whose result fits the 64-bit intermediate
    "bitwise_and": "{a} & {b}",
    "bitwise_or": "{a} | {b}",
    "bitwise_xor": "{a} ^ {b}",
    "invert": "~{a}",
    "minimum": "({a} if {a} < {b} else {b})",
    "maximum": "({a} if {a} > {b} else {b})",
    "fmin": "({a} if {a} < {b} else {b})",
    "fmax": "({a} if {a} > {b} else {b})",
}
_INT_WRAPPING = {"add": "+", "subtract": "-", "multiply": "*"}
_INT_DIVIDING = {"floor_divide": "//", "remainder": "%"}
_BOOL = {
    "logical_and": "({a} & {b})",
    "logical_or": "({a} | {b})",
    "logical_xor": "({a} != {b})",
    "bitwise_and": "({a} & {b})",
    "bitwise_or": "({a} | {b})",
    "bitwise_xor": "({a} != {b})",
    "add": "({a} | {b})",
    "multiply": "({a} & {b})",
    "minimum": "({a} & {b})",
    "maximum": "({a} | {b})",
    "fmin": "({a} & {b})",
    "fmax": "({a} | {b})",
}

HELPERS = """
@njit(inline="always")
def _minimum(a, b):
    # NumPy's loop: the second operand on a tie (the sign of zero), NaN from either side
    return a if (a < b or a != a) else b


@njit(inline="always")
def _maximum(a, b):
    return a if (a > b or a != a) else b


@njit(inline="always")
def _fmin(a, b):
    return a if (a < b or b != b) else b


@njit(inline="always")
def _fmax(a, b):
    return a if (a > b or b != b) else b


@njit(inline="always")
def _clip(a, lo, hi):
    # NumPy's clip between bounds that vary: a bound wins a tie (the sign of zero)
    t = a if (a != a or a > lo) else lo
    return t if (t != t or t < hi) else hi


@njit(inline="always")
def _clip_scalar(a, lo, hi):
    # NumPy's clip between two scalar bounds: the value wins a tie
    t = a if (a != a or a >= lo) else lo
    return t if (t != t or t <= hi) else hi

"""


class _Writer:
    """The body of the loop over elements: one line per operation of the expression."""

    def __init__(
        self,
        expr: Expr,
        input_dtypes: Sequence[np.dtype],
        input_row_shapes: Sequence[tuple[int, ...]],
        *,
        reads: dict[int, str] | None = None,
        prefix: str = "",
    ) -> None:
        # ``reads``: the code that reads input i (default ``i{i}[e]``); ``prefix`` goes
        # before every name made here, so that two writers share one function.
        self.reads = reads or {}
        self.prefix = prefix
        self.lines: list[str] = []
        self.consts: list[Any] = []
        self.const_types: list[str] = []
        self.names: dict[int, str] = {}
        self.inputs: set[int] = set()
        self.raising: list[Expr] = []  # nodes whose float result may raise an error
        inferred = infer(expr, input_dtypes, input_row_shapes)
        self.values = inferred.values
        self.varying = inferred.depends_on_input
        for node in walk(expr):
            if self.varying(node) and id(node) not in self.names:
                self._node(node)
        self.result = self.names[id(expr)]
        self.dtype = np.dtype(inferred.dtype)

    def dtype_of(self, node: Expr) -> np.dtype:
        return np.dtype(self.values[id(node)].dtype)

    def _operand(self, node: Expr, dtype: np.dtype, what: str) -> str:
        """``node`` as a value of ``dtype``: a register, or a constant argument cast
        (and tiled) beforehand."""
        if self.varying(node):
            return _cast(self.names[id(node)], self.dtype_of(node), dtype, what)
        value = self.values[id(node)]
        _type(dtype, what)
        name = f"{self.prefix}c{len(self.consts)}"
        if isinstance(value, np.ndarray) and value.ndim and value.size > 1:
            self.consts.append(("array", value, dtype))
            self.const_types.append(f"{dtype.name}[lanes]")
            return f"{name}[l]"
        scalar = np.asarray(value).reshape(-1)[0] if np.ndim(value) else value
        self.consts.append(("scalar", scalar, dtype))
        self.const_types.append(dtype.name)
        return name

    def _bound(self, node: Expr | None, out: np.dtype) -> str | None:
        """A clip bound as a value of ``out``. NumPy clips an integer array by a Python
        integer outside its dtype's range as by the range's end (``np.clip(uint8, -1,
        3)`` leaves 0 and 1 alone), where a cast would wrap -1 to 255."""
        if node is None:
            return None
        value = self.values[id(node)]
        if out.kind in "iu" and type(value) is int and not self.varying(node):
            info = np.iinfo(out)
            clamped = min(max(value, int(info.min)), int(info.max))
            name = f"{self.prefix}c{len(self.consts)}"
            self.consts.append(("scalar", clamped, out))
            self.const_types.append(out.name)
            return name
        return self._operand(node, out, "clip")

    def _emit(self, node: Expr, code: str, raises: bool = False) -> None:
        name = f"{self.prefix}v{len(self.names)}"
        self.names[id(node)] = name
        self.lines.append(f"{name} = {code}  # {_label(node)}")
        if raises:
            self.raising.append(node)

    def _node(self, node: Expr) -> None:
        if isinstance(node, Input):
            dtype = self.dtype_of(node)
            _type(dtype, f"input {node.index}")
            self.inputs.add(node.index)
            self._emit(node, self.reads.get(node.index, f"i{node.index}[e]"))
            return
        out = self.dtype_of(node)
        if isinstance(node, AsType):
            src = self.dtype_of(node.a)
            narrowing = src.kind == "f" and out.kind == "f" and out.itemsize < src.itemsize
            self._emit(node, self._operand(node.a, out, "astype"), narrowing)
            return
        if isinstance(node, Where):
            cond = self._operand(node.cond, np.dtype(bool), "where")
            a = self._operand(node.a, out, "where")
            b = self._operand(node.b, out, "where")
            self._emit(node, f"{a} if {cond} else {b}")
            return
        if isinstance(node, Clip):
            self._clip(node, out)
            return
        if isinstance(node, Apply):
            self._apply(node, out)
            return
        raise Unsupported(f"{type(node).__name__.lower()} is not compiled")

    def _clip(self, node: Clip, out: np.dtype) -> None:
        a = self._operand(node.a, out, "clip")
        lo = self._bound(node.lo, out)
        hi = self._bound(node.hi, out)
        if out.kind == "f":
            if lo is not None and hi is not None:
                # NumPy's loop for two scalar bounds (stride 0) breaks ties the other way
                bounds = [b for b in (node.lo, node.hi) if b is not None]
                scalar = all(
                    not self.varying(b) and np.size(self.values[id(b)]) == 1 for b in bounds
                )
                code = f"{'_clip_scalar' if scalar else '_clip'}({a}, {lo}, {hi})"
            elif lo is not None:
                code = f"({a} if ({a} != {a} or {a} > {lo}) else {lo})"
            else:
                code = f"({a} if ({a} != {a} or {a} < {hi}) else {hi})"
        else:
            code = a
            if lo is not None:
                code = f"max({code}, {lo})"
            if hi is not None:
                code = f"min({code}, {hi})"
        self._emit(node, f"{_type(out, 'clip')}({code})")

    def _apply(self, node: Apply, out: np.dtype) -> None:
        ufunc, name = node.ufunc, node.ufunc.__name__
        if node.kwargs:
            raise Unsupported(f"{name} is called with keywords {dict(node.kwargs)}")
        if ufunc.nout != 1 or ufunc.nin not in (1, 2):
            raise Unsupported(f"{name} is not compiled")
        given = [self._given_dtype(a) for a in node.args]
        try:
            loop = ufunc.resolve_dtypes((*given, None))
        except (TypeError, ValueError) as exc:  # pragma: no cover - infer resolved it before
            raise Unsupported(f"{name}: {exc}") from exc
        ins, result = [np.dtype(d) for d in loop[: ufunc.nin]], np.dtype(loop[-1])
        if result != out:
            raise Unsupported(f"{name} gives {out}, not its loop's {result}")
        doubled = self._doubled(node, ins) if name == "multiply" and result.kind == "f" else None
        if doubled is not None:
            self._emit(node, f"{_type(result, name)}({doubled} + {doubled})", True)
            return
        ops = [self._operand(a, d, name) for a, d in zip(node.args, ins, strict=True)]
        a, b = ops[0], ops[1] if len(ops) > 1 else ""
        kind = ins[0].kind
        if name in _COMPARE and len(ops) == 2 and kind in "fiub":
            self._emit(node, f"({a} {_COMPARE[name]} {b})")
        elif name in _PREDICATES and kind in "fiub":
            # an integer or a bool is finite, and neither NaN nor infinite
            whole = "True" if name == "isfinite" else "False"
            self._emit(node, _PREDICATES[name].format(a=a) if kind == "f" else whole)
        elif name in _LOGICAL and kind in "fiu":
            self._emit(node, _LOGICAL[name].format(a=a, b=b))
        elif name == "logical_not" and kind in "fiub":
            self._emit(node, f"({a} == 0)")
        elif kind == "b" and result.kind == "b" and (name in _BOOL or name == "invert"):
            self._emit(node, f"({a} == 0)" if name == "invert" else _BOOL[name].format(a=a, b=b))
        elif kind == "f":
            self._float(node, name, result, ops)
        elif kind in "iu" and result.kind in "iu":
            self._integer(node, name, result, a, b)
        else:
            raise Unsupported(f"{name} on {ins[0]} is not compiled")

    def _doubled(self, node: Apply, ins: list[np.dtype]) -> str | None:
        """For ``x * 2`` or ``2 * x`` of floats (a scalar constant that is 2 in the
        loop's dtype), ``x`` as a value of the loop's dtype, to be written ``x + x``:
        the same bits (both are 2x rounded once), and an addition leaves the port that
        a square root or a division needs free (``sqrt(x * 2 + 1)`` runs at 1.2x). A
        constant is an argument of the kernel, so the compiler cannot see a 2 there
        itself."""
        for k, other in ((0, 1), (1, 0)):
            constant = node.args[other]
            value = self.values[id(constant)]
            if self.varying(constant) or np.ndim(value) != 0:
                continue
            if np.asarray(value).astype(ins[other]) == 2:
                return self._operand(node.args[k], ins[k], "multiply")
        return None

    def _float(self, node: Apply, name: str, result: np.dtype, ops: list[str]) -> None:
        ctor = _type(result, name)
        if name in _SLOWER:
            raise Unsupported(
                f"{name} of {result}: NumPy's vectorised loop is faster than the kernel's "
                "call to libm for each element"
            )
        a, b = ops[0], ops[-1]
        if len(ops) == 1 and name in _FLOAT_UNARY:
            code = _FLOAT_UNARY[name].format(a=a, one=f"{ctor}(1)")
        elif len(ops) == 2 and name in _FLOAT_BINARY:
            code = _FLOAT_BINARY[name].format(a=a, b=b)
        else:
            raise Unsupported(f"{name} on {result} is not compiled")
        self._emit(node, f"{ctor}({code})", name not in _QUIET)

    def witnesses(self, root: Expr, root_shows: bool) -> list[str]:
        """Values to add to the witness lanes: results of raising nodes minus themselves
        (0 when finite, NaN otherwise), so that every raising node's non-finite value
        reaches the reduced value or a witness. ``root_shows`` says whether the
        reduction shows a non-finite value of the root (a sum does, a min need not).
        Parents come first, and a witness also shows what surely reaches it
        (``_PROPAGATES``): ``sqrt(x * 2 + 1)`` takes one witness, not three."""
        raising = {id(n) for n in self.raising}
        shows = {id(root)} if root_shows else set()
        found = []
        for node in reversed(walk(root)):  # parents before their children
            if id(node) in raising and id(node) not in shows:
                found.append(self.names[id(node)])
                shows.add(id(node))
            if id(node) not in shows or not isinstance(node, (Apply, AsType)):
                continue
            name = node.ufunc.__name__ if isinstance(node, Apply) else "astype"
            if isinstance(node, AsType) and self.dtype_of(node).kind != "f":
                continue
            for k in _PROPAGATES.get(name, ()):
                shows.add(id(node.children()[k]))
        return found

    def _integer(self, node: Apply, name: str, result: np.dtype, a: str, b: str) -> None:
        ctor = _type(result, name)
        wide = result.itemsize == 8
        if name in _INT_EXACT:
            code = _INT_EXACT[name].format(a=a, b=b)
        elif name in _INT_WRAPPING and wide:
            # 64-bit: unsigned arithmetic wraps by definition, signed overflow may not
            code = f"np.uint64({a}) {_INT_WRAPPING[name]} np.uint64({b})"
        elif name in _INT_WRAPPING:
            code = f"np.int64({a}) {_INT_WRAPPING[name]} np.int64({b})"
        elif name == "negative":
            code = f"np.uint64(0) - np.uint64({a})" if wide else f"-np.int64({a})"
        elif name == "positive" or (name == "absolute" and result.kind == "u"):
            code = a
        elif name == "absolute":
            code = (
                f"(np.uint64({a}) if {a} >= 0 else np.uint64(0) - np.uint64({a}))"
                if wide
                else f"abs(np.int64({a}))"
            )
        elif name == "square":
            code = f"np.uint64({a}) * np.uint64({a})" if wide else f"np.int64({a}) * np.int64({a})"
        elif name in _INT_DIVIDING and self._plain_divisor(node.args[1], result):
            # floored, as NumPy's and Python's: the same for any divisor but 0 (NumPy
            # warns) and -1 (the smallest value overflows)
            t = "np.uint64" if result == np.uint64 else "np.int64"
            code = f"{t}({a}) {_INT_DIVIDING[name]} {t}({b})"
        elif name in _INT_DIVIDING:
            raise Unsupported(
                f"{name} on {result} is compiled by a constant divisor other than 0 and -1 only"
            )
        else:
            raise Unsupported(f"{name} on {result} is not compiled")
        self._emit(node, f"{ctor}({code})")

    def _plain_divisor(self, node: Expr, dtype: np.dtype) -> bool:
        """Whether ``node`` is one constant that, as a value of ``dtype``, is neither 0
        nor -1."""
        value = self.values[id(node)]
        if self.varying(node) or np.size(value) != 1:
            return False
        divisor = int(np.asarray(value).reshape(-1)[0].astype(dtype))
        return divisor not in (0, -1)

    def _given_dtype(self, node: Expr) -> Any:
        """What NumPy's type resolution sees for ``node``: a dtype, or the Python type
        of a weak scalar (NEP 50)."""
        value = self.values[id(node)]
        if not self.varying(node) and isinstance(value, bool):
            return np.dtype(bool)  # NumPy's type resolution takes no Python bool
        if not self.varying(node) and isinstance(value, (int, float, complex)):
            return type(value)
        return np.asarray(value).dtype if not hasattr(value, "dtype") else value.dtype


def _label(node: Expr) -> str:
    if isinstance(node, Input):
        return f"input {node.index}"
    if isinstance(node, Apply):
        return node.ufunc.__name__
    return type(node).__name__.lower()


def _arguments(writer: _Writer, row_elements: int, lanes: int) -> tuple[Any, ...]:
    """The constant arguments: scalars cast to their operation's dtype, arrays broadcast
    to a row, cast and tiled over the lanes (read-only)."""
    found: list[Any] = []
    for kind, value, dtype in writer.consts:
        if kind == "scalar":
            found.append(np.asarray(value).astype(dtype)[()])
            continue
        trailing = value.reshape(-1) if value.size == row_elements else None
        if trailing is None:
            raise Unsupported(f"a constant of shape {value.shape} does not fill a row")
        tiled = np.tile(trailing.astype(dtype), lanes // row_elements)
        tiled.flags.writeable = False
        found.append(tiled)
    return tuple(found)


# What each reduction folds into its lanes: (lane dtype, initial value, statement).
def _fold_statement(op: RowReduction, value: str, dtype: np.dtype) -> tuple[np.dtype, Any, str]:
    kind = op.kind
    init: Any
    if kind in ("sum", "mean", "prod"):
        acc = accumulator_dtype(op.out_dtype)
        sign = "+" if kind != "prod" else "*"
        init = 0 if kind != "prod" else 1
        cast = _cast(value, dtype, acc, kind)
        if acc == np.int64 or acc == np.uint64:
            return (
                acc,
                init,
                (f"lanes0[l] = {_type(acc, kind)}(np.uint64(lanes0[l]) {sign} np.uint64({cast}))"),
            )
        if acc.kind not in "fiu":
            raise Unsupported(f"{kind} into {acc} is not compiled")
        return acc, init, f"lanes0[l] {sign}= {cast}"
    if kind in ("min", "max", "nanmin", "nanmax"):
        _type(dtype, kind)
        if dtype == np.bool_:
            init = kind in ("min", "nanmin")
            statement = f"lanes0[l] {'&' if init else '|'}= {value}"
            return dtype, init, statement
        low = kind in ("min", "nanmin")
        if dtype.kind == "f":
            init = np.nan if kind.startswith("nan") else (np.inf if low else -np.inf)
            helper = {"min": "_minimum", "max": "_maximum", "nanmin": "_fmin", "nanmax": "_fmax"}
            return dtype, init, f"lanes0[l] = {helper[kind]}(lanes0[l], {value})"
        info = np.iinfo(dtype)
        init = info.max if low else info.min
        compare = "<" if low else ">"
        statement = f"lanes0[l] = {value} if {value} {compare} lanes0[l] else lanes0[l]"
        return dtype, init, statement
    if kind in ("any", "all"):
        truth = _cast(value, dtype, np.dtype(bool), kind)
        return np.dtype(bool), kind == "all", f"lanes0[l] {'|' if kind == 'any' else '&'}= {truth}"
    if kind == "count_nonzero":
        truth = _cast(value, dtype, np.dtype(bool), kind)
        return np.dtype(np.int64), 0, f"lanes0[l] += np.int64({truth})"
    raise Unsupported(f"{kind} is not compiled")


def _arg_fold(op: RowReduction, value: str, dtype: np.dtype) -> list[str]:
    """argmin/argmax per lane: the best value (``lanes0``) and the element it is
    (``lanes1``, -1 before the first); the first of equal values, the first NaN."""
    _type(dtype, op.kind)
    if dtype == np.bool_:
        raise Unsupported(f"{op.kind} of bools is not compiled")
    better = f"{value} {'<' if op.kind == 'argmin' else '>'} lanes0[l]"
    if dtype.kind == "f":
        better += f" or ({value} != {value} and lanes0[l] == lanes0[l])"
    return [
        f"if lanes1[l] < 0 or ((lanes0[l] == lanes0[l]) and ({better})):",
        f"    lanes0[l] = {value}",
        "    lanes1[l] = e",
    ]


def reduction_source(
    expr: Expr,
    input_dtypes: Sequence[Any],
    input_row_shapes: Sequence[tuple[int, ...]],
    op: RowReduction,
) -> KernelSource:
    """The kernel of ``op`` over ``expr`` on blocks of the given dtypes and row shapes:
    its source, constant arguments and lanes; raises :class:`Unsupported` with the
    reason where it cannot be compiled."""
    dtypes = [np.dtype(d) for d in input_dtypes]
    shapes = [tuple(int(n) for n in s) for s in input_row_shapes]
    row_shape = tuple(op.in_row_shape)
    if any(s != row_shape for s in shapes):
        raise Unsupported("the inputs broadcast against each other (their row shapes differ)")
    row_elements = math.prod(row_shape)
    if row_elements == 0:
        raise Unsupported("rows without elements")
    moments = op.kind in ("var", "std")
    if not op.folds_in_lanes:
        raise Unsupported(f"{op!r} is not compiled (it has no partial of lanes)")
    writer = _Writer(expr, dtypes, shapes)
    if writer.dtype != op.in_dtype:
        raise Unsupported(f"the expression gives {writer.dtype}, the reduction takes {op.in_dtype}")
    value = writer.result
    sum_like = op.kind in ("sum", "mean", "prod", "var", "std") and writer.dtype.kind == "f"
    witnesses = writer.witnesses(expr, sum_like)
    if moments:
        inits: tuple[tuple[np.dtype, Any, bool], ...] = ((np.dtype(np.float64), 0.0, True),) * 2
        dev = f"np.float64({value}) - pilot[l]"
        fold = [f"d = {dev}", "lanes0[l] += d", "lanes1[l] += d * d"]
    elif op.kind in ("argmin", "argmax"):
        fold = _arg_fold(op, value, writer.dtype)
        inits = ((writer.dtype, 0, False), (np.dtype(np.int64), -1, False))
    else:
        lane_dtype, init, statement = _fold_statement(op, value, writer.dtype)
        inits = ((lane_dtype, init, sum_like),)
        fold = [statement]
    if witnesses:
        fold.append(f"lanes{len(inits)}[l] += " + " + ".join(f"({v} - {v})" for v in witnesses))
        inits = (*inits, (np.dtype(np.float64), 0.0, True))
    lanes = lanes_for(row_elements, len(inits))
    consts = _arguments(writer, row_elements, lanes)
    used = sorted(writer.inputs)
    title = f"{op.kind} of {writer.dtype.name} values"
    leading = ["pilot"] if moments else []
    text = _module(writer, used, dtypes, lanes, fold, len(inits), title, leading)
    return KernelSource(
        text,
        consts,
        tuple(used),
        tuple(dtypes[i] for i in used),
        lanes,
        row_elements,
        inits,
        moments,
    )


# Float operations whose result is the correctly rounded one in numba as in NumPy, so
# that an elementwise kernel's output is NumPy's bit for bit (exp, log, sin, ... are
# libm's in numba and NumPy's own code in NumPy: a unit in the last place apart).
# fmin and fmax are left out too: NumPy's own loops give either zero for fmin(0.0, -0.0),
# by the array's length and dtype.
_EXACT = frozenset(
    {"add", "subtract", "multiply", "divide", "true_divide", "negative", "positive",
     "absolute", "fabs", "square", "sqrt", "reciprocal", "minimum", "maximum", "floor",
     "ceil", "trunc", "rint"}
)  # fmt: skip


def elementwise_source(
    expr: Expr, input_dtypes: Sequence[Any], input_row_shapes: Sequence[tuple[int, ...]]
) -> KernelSource:
    """The kernel that writes ``expr`` of the input blocks into an output block (flat,
    C order): its source and constant arguments; raises :class:`Unsupported` with the
    reason where it cannot be compiled, or where its values could differ from NumPy's in
    the last bit (a transcendental function)."""
    dtypes = [np.dtype(d) for d in input_dtypes]
    shapes = [tuple(int(n) for n in s) for s in input_row_shapes]
    writer = _Writer(expr, dtypes, shapes)
    row_shape = tuple(writer.values[id(expr)].shape[1:])
    if any(s != row_shape for s in shapes):
        raise Unsupported("the inputs broadcast against each other (their row shapes differ)")
    if isinstance(expr, Input):
        raise Unsupported("the expression is one of its inputs (nothing to compute)")
    inexact = sorted(
        {
            n.ufunc.__name__
            for n in walk(expr)
            if isinstance(n, Apply)
            and writer.varying(n)
            and writer.dtype_of(n).kind == "f"
            and n.ufunc.__name__ not in _EXACT
        }
    )
    if inexact:
        raise Unsupported(
            f"{', '.join(inexact)} of floats in numba is not NumPy's own code: its values "
            "could differ in the last bit"
        )
    row_elements = math.prod(row_shape)
    if row_elements == 0:
        raise Unsupported("rows without elements")
    lanes = lanes_for(row_elements)
    root = writer.result
    fold = [f"out[e] = {root}"]
    inits: tuple[tuple[np.dtype, Any, bool], ...] = ()
    witnesses = writer.witnesses(expr, False)  # the output is not looked at
    if witnesses:
        fold.append("lanes0[l] += " + " + ".join(f"({v} - {v})" for v in witnesses))
        inits = ((np.dtype(np.float64), 0.0, True),)
    consts = _arguments(writer, row_elements, lanes)
    used = sorted(writer.inputs)
    title = f"{writer.dtype.name} values of an expression"
    text = _module(writer, used, dtypes, lanes, fold, len(inits), title, [], ["out"])
    return KernelSource(
        text,
        consts,
        tuple(used),
        tuple(dtypes[i] for i in used),
        lanes,
        row_elements,
        inits,
        False,
        writer.dtype,
    )


def histogram_source(
    expr: Expr,
    input_dtypes: Sequence[Any],
    input_row_shapes: Sequence[tuple[int, ...]],
    histogram: Any,
) -> KernelSource:
    """The kernel that counts the values of ``expr`` per bin of ``histogram`` (a
    :class:`~tierflow.operators.reductions.Histogram` of equal bins) into its last
    argument, as NumPy's equal-bins loop does: values compared with the range in the
    dtype NumPy compares them in, NaN and values outside left out, the bin guessed from
    the value and then corrected against the edges, the last bin closed."""
    uniform = histogram.uniform
    if uniform is None:
        raise Unsupported("a histogram of bins given as edges is not compiled")
    dtypes = [np.dtype(d) for d in input_dtypes]
    shapes = [tuple(int(n) for n in s) for s in input_row_shapes]
    writer = _Writer(expr, dtypes, shapes)
    row_shape = tuple(writer.values[id(expr)].shape[1:])
    if any(s != row_shape for s in shapes):
        raise Unsupported("the inputs broadcast against each other (their row shapes differ)")
    value, dtype = writer.result, writer.dtype
    if dtype.kind not in "fiu":
        raise Unsupported(f"a histogram of {dtype} values is not compiled")
    first, last, bins = uniform
    edges = np.asarray(histogram.edges)

    def given(v: Any) -> Any:  # a Python number is weak (NEP 50), a NumPy one is not
        return type(v) if type(v) in (int, float) else np.asarray(v).dtype

    compare = np.dtype(np.greater_equal.resolve_dtypes((dtype, given(first), None))[0])
    first_c = np.asarray(first).astype(compare)[()]
    last_c = np.asarray(last).astype(compare)[()]
    edge = edges.dtype
    w = _cast("values[l]", dtype, compare, "histogram")
    u = _cast("values[l]", dtype, edge, "histogram")
    row_elements = math.prod(row_shape)
    if row_elements == 0:
        raise Unsupported("rows without elements")
    lanes = lanes_for(row_elements)
    e_type = _type(edge, "histogram")
    # Two loops over each run of lanes: the values (which vectorises), then the bins
    # (which does not): 3x faster than one loop doing both.
    fold = [f"values[l] = {value}"]
    count = [
        f"u = {u}",
        f"w = {w}",
        f"if w >= {_literal(first_c)} and w <= {_literal(last_c)}:",
        f"    k = np.intp(np.float64(u - {e_type}({_literal(first)})) * "
        f"{_literal(float(bins) / (float(last) - float(first)))})",
        f"    if k >= {bins}:",
        f"        k = {bins - 1}",
        "    elif k < 0:",
        "        k = 0",
        "    if u < edges[k]:",
        "        k -= 1",
        f"    elif k != {bins - 1} and u >= edges[k + 1]:",
        "        k += 1",
        "    counts[k] += 1",
    ]
    witnesses = writer.witnesses(expr, False)
    inits: tuple[tuple[np.dtype, Any, bool], ...] = ()
    if witnesses:
        fold.append("lanes0[l] += " + " + ".join(f"({v} - {v})" for v in witnesses))
        inits = ((np.dtype(np.float64), 0.0, True),)
    consts = _arguments(writer, row_elements, lanes)
    used = sorted(writer.inputs)
    title = f"histogram of {bins} bins of {dtype.name} values"
    text = _module(
        writer,
        used,
        dtypes,
        lanes,
        fold,
        len(inits),
        title,
        trailing=["edges", "counts"],
        setup=[f"values = np.empty({lanes}, {_type(dtype, 'histogram')})"],
        then=count,
    )
    return KernelSource(
        text,
        consts,
        tuple(used),
        tuple(dtypes[i] for i in used),
        lanes,
        row_elements,
        inits,
        False,
        edges_dtype=edge,
    )


def bincount_source(
    expr: Expr, input_dtypes: Sequence[Any], input_row_shapes: Sequence[tuple[int, ...]]
) -> KernelSource:
    """The kernel that counts the values of ``expr`` (one integer or bool value per
    row: a 1-D array itself, or an expression of one) into its ``counts`` argument, as
    ``np.bincount`` does, in one pass: values from 0 to ``len(counts) - 1`` are
    counted, and the largest and the smallest value seen go into ``seen`` (the caller
    sends the block to the NumPy path for a negative value, which NumPy refuses, and
    for one past the counts). Raises :class:`Unsupported` for values of other dtypes
    (NumPy casts them to intp safely: floats it refuses; uint64 is left to NumPy)."""
    dtypes = [np.dtype(d) for d in input_dtypes]
    shapes = [tuple(int(n) for n in s) for s in input_row_shapes]
    writer = _Writer(expr, dtypes, shapes)
    dtype = writer.dtype
    if dtype.kind not in "biu" or dtype == np.uint64:
        raise Unsupported(f"a bincount of {dtype} values is not compiled")
    if tuple(writer.values[id(expr)].shape[1:]) != () or any(s != () for s in shapes):
        raise Unsupported("np.bincount counts one value per row")
    lanes = lanes_for(1)
    fold = [f"values[l] = np.int64({writer.result})"]
    witnesses = writer.witnesses(expr, False)
    inits: tuple[tuple[np.dtype, Any, bool], ...] = ()
    if witnesses:  # float steps before a comparison or a cast: their errors
        fold.append("lanes0[l] += " + " + ".join(f"({v} - {v})" for v in witnesses))
        inits = ((np.dtype(np.float64), 0.0, True),)
    count = [
        "v = values[l]",
        "if v > high:",
        "    high = v",
        "if v < low:",
        "    low = v",
        "if v >= 0 and v < capacity:",
        "    counts[v] += 1",
    ]
    consts = _arguments(writer, 1, lanes)
    used = sorted(writer.inputs)
    text = _module(
        writer,
        used,
        dtypes,
        lanes,
        fold,
        len(inits),
        f"bincount of {dtype.name} values",
        trailing=["counts", "seen"],
        setup=[
            f"values = np.empty({lanes}, np.int64)",
            "capacity = counts.shape[0]",
            "high = np.int64(-1)",
            "low = np.int64(0)",
        ],
        then=count,
        finish=["seen[0] = high", "seen[1] = low"],
    )
    return KernelSource(
        text,
        consts,
        tuple(used),
        tuple(dtypes[i] for i in used),
        lanes,
        1,
        inits,
        False,
        counts=True,
    )


def _literal(value: Any) -> str:
    """A number as exact source text (``repr`` of a float round-trips)."""
    number = value.item() if isinstance(value, np.generic) else value
    if isinstance(number, float) and not math.isfinite(number):
        return "np.inf" if number > 0 else ("-np.inf" if number < 0 else "np.nan")
    return repr(number)


def masked_source(  # noqa: PLR0913 -- the data's expression, then the mask's
    expr: Expr,
    input_dtypes: Sequence[Any],
    input_row_shapes: Sequence[tuple[int, ...]],
    mask: Expr,
    columns: Sequence[tuple[int, int]],
    op: RowReduction,
) -> KernelSource:
    """The kernel of ``op`` over the rows of ``expr`` that ``mask`` keeps, in one pass
    over the unfiltered blocks: ``mask`` is a boolean expression of one value per row,
    its input ``k`` element ``columns[k][1]`` (flat, within a row) of block input
    ``columns[k][0]``. The kernel counts the rows it kept into its last argument.
    Raises :class:`Unsupported` with the reason where it cannot be compiled."""
    dtypes = [np.dtype(d) for d in input_dtypes]
    shapes = [tuple(int(n) for n in s) for s in input_row_shapes]
    row_shape = tuple(op.in_row_shape)
    if any(s != row_shape for s in shapes):
        raise Unsupported("the inputs broadcast against each other (their row shapes differ)")
    row_elements = math.prod(row_shape)
    if row_elements == 0 or not op.folds_in_lanes or op.kind in ("argmin", "argmax"):
        raise Unsupported(f"{op.kind} after a mask is not compiled")
    lanes = lanes_for(row_elements)
    fold_rows = lanes // row_elements
    reads = {k: f"i{d}[base + {c}]" for k, (d, c) in enumerate(columns)}
    mask_dtypes = [dtypes[d] for d, _ in columns]
    masker = _Writer(mask, mask_dtypes, [()] * len(columns), reads=reads, prefix="m")
    if masker.dtype != np.bool_:
        raise Unsupported(f"a mask of {masker.dtype} is not compiled")
    writer = _Writer(expr, dtypes, shapes, reads={i: f"i{i}[s]" for i in range(len(dtypes))})
    if writer.dtype != op.in_dtype:
        raise Unsupported(f"the expression gives {writer.dtype}, the reduction takes {op.in_dtype}")
    value = writer.result
    sum_like = op.kind in ("sum", "mean", "prod", "var", "std") and writer.dtype.kind == "f"
    witnesses = writer.witnesses(expr, sum_like)
    if op.kind in ("var", "std"):
        inits: tuple[tuple[np.dtype, Any, bool], ...] = ((np.dtype(np.float64), 0.0, True),) * 2
        fold = [f"d = np.float64({value}) - pilot[l]", "lanes0[l] += d", "lanes1[l] += d * d"]
    else:
        lane_dtype, init, statement = _fold_statement(op, value, writer.dtype)
        inits = ((lane_dtype, init, sum_like),)
        fold = [statement]
    row_lines = list(masker.lines)
    mask_witnesses = masker.witnesses(mask, False)
    if witnesses or mask_witnesses:
        w = len(inits)
        inits = (*inits, (np.dtype(np.float64), 0.0, True))
        if witnesses:
            fold.append(f"lanes{w}[l] += " + " + ".join(f"({v} - {v})" for v in witnesses))
        if mask_witnesses:
            sums = " + ".join(f"({v} - {v})" for v in mask_witnesses)
            row_lines.append(f"lanes{w}[0] += {sums}")
    used = sorted(writer.inputs | {d for d, _ in columns})
    all_consts = _arguments(writer, row_elements, lanes) + _arguments(masker, 1, 1)
    args = ["pilot"] if op.kind in ("var", "std") else []
    args += [f"i{i}" for i in used]
    args += [f"c{k}" for k in range(len(writer.consts))]
    args += [f"mc{k}" for k in range(len(masker.consts))]
    args += [f"lanes{k}" for k in range(len(inits))]
    body = [*writer.lines, *fold]
    text = "\n".join(
        [
            f"# tierflow compiled kernel: {op.kind} of the {writer.dtype.name} values of the "
            f"rows a mask keeps, {lanes} lanes",
            "import numpy as np",
            "from numba import njit",
            HELPERS,
            "",
            '@njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)',
            f"def kernel(rows, {', '.join(args)}, kept):",
            "    k = 0",
            "    for r in range(rows):",
            f"        base = r * {row_elements}",
            *(f"        {line}" for line in row_lines),
            f"        if {masker.result}:",
            f"            g = (k % {fold_rows}) * {row_elements}",
            "            k += 1",
            f"            for j in range({row_elements}):",
            "                s = base + j",
            "                l = g + j",
            *(f"                {line}" for line in body),
            "    kept[0] = k",
            "",
        ]
    )
    return KernelSource(
        text,
        all_consts,
        tuple(used),
        tuple(dtypes[i] for i in used),
        lanes,
        row_elements,
        inits,
        op.kind in ("var", "std"),
        masked=True,
    )


def _module(  # noqa: PLR0913 -- the parts of one generated module
    writer: _Writer,
    inputs: list[int],
    dtypes: list[np.dtype],
    lanes: int,
    fold: list[str],
    n_lanes: int,
    title: str,
    leading: Sequence[str] = (),
    trailing: Sequence[str] = (),
    *,
    setup: Sequence[str] = (),
    then: Sequence[str] = (),
    finish: Sequence[str] = (),
) -> str:
    """The module of a kernel over ``n`` elements in runs of ``lanes``: ``setup`` once,
    then per run the expression and ``fold`` for each lane, then ``then`` for each
    lane (a second loop), and ``finish`` once at the end."""
    args = [*leading, *(f"i{i}" for i in inputs)]
    args += [f"c{k}" for k in range(len(writer.consts))]
    args += [f"lanes{k}" for k in range(n_lanes)]
    args += trailing
    body = writer.lines + fold
    signature = ", ".join(
        [f"i{i}: {dtypes[i].name}[n]" for i in inputs]
        + [f"c{k}: {t}" for k, t in enumerate(writer.const_types)]
    )
    out = [
        f"# tierflow compiled kernel: {title}, {lanes} lanes",
        f"# arguments: {signature}",
        "import numpy as np",
        "from numba import njit",
        HELPERS,
        "",
        '@njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)',
        f"def kernel(n, {', '.join(args)}):",
        *(f"    {line}" for line in setup),
        f"    whole = n - n % {lanes}",
        f"    for base in range(0, whole, {lanes}):",
        f"        for l in range({lanes}):",
        "            e = base + l",
        *(f"            {line}" for line in body),
        *([f"        for l in range({lanes}):"] if then else []),
        *(f"            {line}" for line in then),
        "    for e in range(whole, n):",
        "        l = e - whole",
        *(f"        {line}" for line in (*body, *then)),
        *(f"    {line}" for line in finish),
        "",
    ]
    return "\n".join(out)
