"""Elementwise expressions and row reductions evaluated with torch, on any torch device.

The same operators as :mod:`tierflow.operators.fused` and
:mod:`tierflow.operators.reductions`, for blocks that are torch tensors (on a GPU, or on
the CPU where a simulated GPU stands for one):

* :class:`TorchKernel` evaluates an elementwise expression (:mod:`.elementwise`) node by
  node with torch functions. NumPy's dtype resolution stays the reference: every node's
  operands are cast to the dtype NumPy gives that node (read once from
  :func:`~tierflow.operators.elementwise.infer`), so ``float32 * 2.0`` stays float32 and
  ``int8 + float64`` is float64 as in NumPy, whatever torch's own promotion says.
  Comparisons and other boolean-valued nodes compute in the operands' common NumPy dtype.
* :class:`TorchReduction` computes a block's partial of a built-in row reduction (sum,
  prod, min, max, any, all, mean, count_nonzero) in the partial format the NumPy
  reduction uses, so partials from both combine. Float sums and means accumulate in
  float64, as on the CPU; the order of additions differs (torch's tree reduction), so a
  float32 result differs from NumPy's in the last bits: within ``rtol=1e-6`` of a float64
  reference where NumPy's own float32 sum is within it too.

What torch cannot do the NumPy way (a ufunc without a torch counterpart, complex or
unsigned 16/32/64-bit dtypes, an epilogue, round with negative decimals on integers) is
reported by :func:`kernel_supported` and :func:`reduction_supported`; the engine then runs
that operator on the CPU. torch is imported lazily, when a kernel first runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .byteorder import native_dtype
from .elementwise import Apply, AsType, Clip, Expr, Input, Round, Where, infer, walk
from .reductions import RowReduction

__all__ = [
    "TORCH_DTYPES",
    "TorchKernel",
    "TorchReduction",
    "kernel_supported",
    "reduction_supported",
    "torch_dtype",
]

TORCH_DTYPES = frozenset(
    np.dtype(d)
    for d in (
        bool,
        np.uint8,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.float16,
        np.float32,
        np.float64,
    )
)
"""NumPy dtypes whose arithmetic torch does on every device as NumPy does."""

# NumPy ufunc name -> torch function name (same arguments, same meaning).
_UFUNCS = {
    "add": "add",
    "subtract": "sub",
    "multiply": "mul",
    "true_divide": "true_divide",
    "divide": "true_divide",
    "floor_divide": "floor_divide",
    "remainder": "remainder",
    "fmod": "fmod",
    "power": "pow",
    "float_power": "float_power",
    "negative": "neg",
    "positive": "positive",
    "absolute": "abs",
    "fabs": "abs",
    "sqrt": "sqrt",
    "square": "square",
    "reciprocal": "reciprocal",
    "exp": "exp",
    "exp2": "exp2",
    "expm1": "expm1",
    "log": "log",
    "log2": "log2",
    "log10": "log10",
    "log1p": "log1p",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "arcsin": "asin",
    "arccos": "acos",
    "arctan": "atan",
    "arctan2": "atan2",
    "sinh": "sinh",
    "cosh": "cosh",
    "tanh": "tanh",
    "arcsinh": "asinh",
    "arccosh": "acosh",
    "arctanh": "atanh",
    "hypot": "hypot",
    "maximum": "maximum",
    "minimum": "minimum",
    "fmax": "fmax",
    "fmin": "fmin",
    "floor": "floor",
    "ceil": "ceil",
    "trunc": "trunc",
    "rint": "round",
    "copysign": "copysign",
    "deg2rad": "deg2rad",
    "rad2deg": "rad2deg",
    "equal": "eq",
    "not_equal": "ne",
    "less": "lt",
    "less_equal": "le",
    "greater": "gt",
    "greater_equal": "ge",
    "logical_and": "logical_and",
    "logical_or": "logical_or",
    "logical_xor": "logical_xor",
    "logical_not": "logical_not",
    "bitwise_and": "bitwise_and",
    "bitwise_or": "bitwise_or",
    "bitwise_xor": "bitwise_xor",
    "invert": "bitwise_not",
    "bitwise_not": "bitwise_not",
    "left_shift": "bitwise_left_shift",
    "right_shift": "bitwise_right_shift",
    "isnan": "isnan",
    "isinf": "isinf",
    "isfinite": "isfinite",
    "signbit": "signbit",
}

# What torch computes on booleans as NumPy does (NumPy's add is a logical or there, its
# subtract raises, torch's abs and arithmetic have no boolean kernels).
_BOOLEAN_UFUNCS = frozenset(
    {
        "logical_and", "logical_or", "logical_xor", "logical_not", "bitwise_and",
        "bitwise_or", "bitwise_xor", "invert", "bitwise_not", "equal", "not_equal", "less",
        "less_equal", "greater", "greater_equal", "maximum", "minimum",
    }
)  # fmt: skip

# Integer divisions run on the GPU only by a constant other than zero.
_INTEGER_DIVISIONS = frozenset({"floor_divide", "remainder", "fmod"})

_REDUCTIONS = frozenset({"sum", "prod", "min", "max", "any", "all", "mean", "count_nonzero"})


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype of a NumPy dtype in :data:`TORCH_DTYPES`, in either byte order
    (tensors have only the native one)."""
    import torch

    return torch.from_numpy(np.zeros(0, native_dtype(dtype))).dtype


def _dtype_of(value: Any) -> np.dtype | None:
    """The NumPy dtype of a probe value; None for a Python scalar (weak, NEP 50)."""
    if isinstance(value, (bool, int, float, complex)):
        return None
    return np.asarray(value).dtype


def _work_dtype(out: np.dtype, operands: Sequence[Any]) -> np.dtype:
    """The dtype a node computes in: its own, or for a boolean result of non-boolean
    operands (a comparison) the operands' common dtype (NumPy's promotion)."""
    dtypes = [_dtype_of(v) for v in operands]
    if out.kind == "b" and not all(d is None or d.kind == "b" for d in dtypes):
        return np.result_type(
            *[v if d is None else d for v, d in zip(operands, dtypes, strict=True)]
        )
    return out


def _fits(value: Any, dtype: np.dtype) -> bool:
    """Whether a Python number operand means the same in ``dtype``: an integer outside an
    integer dtype's range does not (NumPy compares it as it is; a cast would wrap it)."""
    if dtype.kind not in "biu" or not isinstance(value, int):
        return True
    with np.errstate(all="ignore"):
        return bool(np.asarray(value).astype(dtype) == value)


def kernel_supported(expr: Expr, input_dtypes: Sequence[Any], epilogue: Any = None) -> bool:
    """Whether :class:`TorchKernel` evaluates ``expr`` exactly as NumPy would."""
    if epilogue is not None:
        return False
    try:
        inferred = infer(expr, input_dtypes)
    except Exception:
        return False
    for node in walk(expr):
        dtype = _dtype_of(inferred.values[id(node)])
        if dtype is not None and dtype not in TORCH_DTYPES:
            return False
        operands = [inferred.values[id(c)] for c in node.children()]
        if dtype is not None and operands and not isinstance(node, AsType):
            work = _work_dtype(dtype, operands)
            if not all(_fits(v, work) for v in operands if _dtype_of(v) is None):
                return False  # NumPy handles an out-of-range Python number specially
        if isinstance(node, Apply):
            if node.ufunc.__name__ not in _UFUNCS or node.kwargs:
                return False
            assert dtype is not None
            if (
                _work_dtype(dtype, operands).kind == "b"
                and node.ufunc.__name__ not in _BOOLEAN_UFUNCS
            ):
                return False
            if (
                node.ufunc.__name__ in _INTEGER_DIVISIONS
                and _work_dtype(dtype, operands).kind in "iu"
                and not (np.ndim(operands[1]) == 0 and operands[1] != 0)
            ):
                return False  # NumPy gives 0 for a division by zero, torch raises or not
            if (
                node.ufunc.__name__ == "power"
                and _work_dtype(dtype, operands).kind in "iu"
                and not (np.ndim(operands[1]) == 0 and operands[1] >= 0)
            ):
                return False  # NumPy refuses negative integer powers
        elif (
            isinstance(node, Round)
            and dtype is not None
            and dtype.kind in "biu"
            and node.decimals < 0
        ):
            return False
    return True


def reduction_supported(op: Any) -> bool:
    """Whether :class:`TorchReduction` computes ``op``'s partials."""
    if not isinstance(op, RowReduction) or op.kind not in _REDUCTIONS:
        return False
    acc = getattr(op, "acc", None)
    return op.in_dtype in TORCH_DTYPES and (acc is None or np.dtype(acc) in TORCH_DTYPES)


class TorchKernel:
    """An elementwise expression on torch tensors (see the module docstring).

    ``apply_tensors(*tensors)`` returns a tensor of the expression's dtype (the NumPy dtype
    ``out_dtype``, as torch's), on the inputs' device. Build it only where
    :func:`kernel_supported` says so.
    """

    def __init__(
        self, expr: Expr, input_dtypes: Sequence[Any], input_row_shapes: Sequence[tuple[int, ...]]
    ) -> None:
        self.expr = expr
        self.input_dtypes = [np.dtype(d) for d in input_dtypes]
        self._row_shapes = [tuple(s) for s in input_row_shapes]
        inferred = infer(expr, self.input_dtypes, self._row_shapes)
        self.out_dtype: np.dtype = inferred.dtype
        self.out_row_shape: tuple[int, ...] = inferred.row_shape
        self._nodes = walk(expr)
        self._dtypes = {id(n): _dtype_of(inferred.values[id(n)]) for n in self._nodes}
        # Nodes that read no block input: NumPy's own value, folded once.
        self._fixed = {
            id(n): inferred.values[id(n)]
            for n in self._nodes
            if not isinstance(n, Input) and not inferred.depends_on_input(n)
        }
        # Bytes per row of every intermediate and the result (the probe values of nodes
        # that read an input are zero-row arrays of the node's row shape and dtype).
        self._row_bytes = sum(
            math.prod(np.shape(inferred.values[id(n)])[1:])
            * np.asarray(inferred.values[id(n)]).itemsize
            for n in self._nodes
            if not isinstance(n, Input) and id(n) not in self._fixed
        )
        self._work: dict[int, np.dtype] = {}  # the dtype each computed node works in
        for n in self._nodes:
            out = self._dtypes[id(n)]
            if out is not None and not isinstance(n, Input) and id(n) not in self._fixed:
                operands = [inferred.values[id(c)] for c in n.children()]
                self._work[id(n)] = _work_dtype(out, operands)
        self._consts: dict[Any, dict[int, Any]] = {}  # device -> node id -> tensor

    def __repr__(self) -> str:
        return f"TorchKernel({self.expr!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt where it lands: its tables are keyed by the ids of expression nodes.
        return (TorchKernel, (self.expr, self.input_dtypes, self._row_shapes))

    def temp_bytes(self, rows: int) -> int:
        """Device bytes of one ``apply`` on ``rows`` rows: every node's block-sized
        tensor, the result's included (torch frees them as they die; this is the bound)."""
        return rows * self._row_bytes

    def apply_tensors(self, *blocks: Any) -> Any:
        """The expression on ``blocks`` (torch tensors on one device)."""
        device = blocks[0].device
        held = self._consts.get(device)
        if held is None:
            held = self._consts[device] = {}
        values: dict[int, Any] = {}
        for node in self._nodes:
            key = id(node)
            if isinstance(node, Input):
                values[key] = blocks[node.index]
            elif key in self._fixed:
                values[key] = self._fixed[key]
            else:
                args = [values[id(c)] for c in node.children()]
                values[key] = self._compute(node, args, held, device)
        return values[id(self.expr)]

    def _compute(self, node: Expr, args: list[Any], held: dict[Any, Any], device: Any) -> Any:
        """One node on evaluated operands: tensors, or constants (NumPy arrays and
        scalars, made tensors of the working dtype on ``device`` once and kept)."""
        import torch

        out = self._dtypes[id(node)]
        assert out is not None
        work = self._work[id(node)]

        def tensor(pos: int, value: Any, dtype: np.dtype) -> Any:
            if isinstance(value, torch.Tensor):
                want = torch_dtype(dtype)
                return value if value.dtype == want else value.to(want)
            key = (id(node), pos)
            found = held.get(key)
            if found is None:
                array = np.ascontiguousarray(np.asarray(value).astype(dtype))
                found = held[key] = torch.from_numpy(array).to(device)
            return found

        if isinstance(node, AsType):
            return tensor(0, args[0], out)
        if isinstance(node, Where):
            cond = args[0]
            if not isinstance(cond, torch.Tensor):
                return tensor(1 if bool(cond) else 2, args[1 if bool(cond) else 2], out)
            cond = cond if cond.dtype == torch.bool else cond != 0
            return torch.where(cond, tensor(1, args[1], out), tensor(2, args[2], out))
        cast = [tensor(i, a, work) for i, a in enumerate(args)]
        if isinstance(node, Apply):
            result = getattr(torch, _UFUNCS[node.ufunc.__name__])(*cast)
        elif isinstance(node, Clip):
            values = iter(cast)
            a = next(values)
            lo = None if node.lo is None else next(values)
            hi = None if node.hi is None else next(values)
            result = torch.clamp(a, lo, hi)
        elif isinstance(node, Round):
            a = cast[0]
            result = a if out.kind in "biu" else torch.round(a, decimals=node.decimals)
        else:
            raise TypeError(f"not an operation node: {node!r}")
        return tensor(-1, result, out)


class TorchReduction:
    """A built-in row reduction's block partial computed with torch.

    ``chunk(tensor)`` gives the partial in the NumPy reduction's own format with its
    arrays as tensors on the block's device (the caller brings them to the host);
    combine and aggregate stay the NumPy reduction's.
    """

    def __init__(self, op: RowReduction) -> None:
        self.op = op
        self.kind = op.kind
        acc = getattr(op, "acc", None)
        self.acc: np.dtype | None = None if acc is None else np.dtype(acc)
        ndim = 1 + len(op.in_row_shape)
        self._reduced = (0, *[a + 1 for a in op.trailing])
        self._kept = tuple(a for a in range(ndim) if a not in self._reduced)

    def __repr__(self) -> str:
        return f"TorchReduction({self.op!r})"

    def _rows_first(self, block: Any) -> Any:
        """The block with every reduced axis folded into axis 0, kept axes after it."""
        op = self.op
        moved = block.permute(*self._reduced, *self._kept) if self._kept else block
        return moved.reshape(-1, *op.core_shape)

    def chunk(self, block: Any) -> Any:
        """The partial of one block of at least one row (tensors on the block's device)."""
        import torch

        kind = self.kind
        flat = self._rows_first(block)
        acc = None if self.acc is None else torch_dtype(self.acc)
        if kind in ("sum", "mean"):
            total = torch.sum(flat, dim=0, dtype=acc)
            if kind == "mean":
                return (int(block.shape[0]) * self.op.reduced_per_row, total)
            return total
        if kind == "prod":
            return torch.prod(flat, dim=0, dtype=acc)
        if kind == "min":
            return torch.amin(flat, dim=0)
        if kind == "max":
            return torch.amax(flat, dim=0)
        if kind == "any":
            return torch.any(flat, dim=0)
        if kind == "all":
            return torch.all(flat, dim=0)
        if kind == "count_nonzero":
            return torch.count_nonzero(flat, dim=0).to(torch_dtype(np.dtype(np.intp)))
        raise TypeError(f"{self.op!r} has no torch partial")

    def partial_bytes(self) -> int:
        """Bytes of one partial (what comes back to the host per block)."""
        return max(1, math.prod(self.op.core_shape)) * 16 + 64
