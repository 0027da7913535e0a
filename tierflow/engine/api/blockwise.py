"""NumPy's own function on each block (:class:`BlockFunction`), and the helpers the
API modules that answer NumPy's functions row by row or over the rows share
(:mod:`.einsum`, :mod:`.nanfunctions`, :mod:`.stacking`, ``np.linalg.norm`` in
:mod:`.linalg`).

Within rows (``norm(x, axis=1)``, ``einsum("ij,jk->ik", x, w)``, ``nanmean(x,
axis=1)``) a function is NumPy's own on each block, in the block's task: the result
has the rows of the input and is NumPy's, bitwise, warnings included (raised in the
worker that ran the block). Over the rows it is built from the engine's reductions
(float64 accumulation), finished in memory with NumPy's warnings, dtypes and errors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...operators import reductions as red
from ...operators.types import block_bytes
from .. import graph
from ..graph import Chunked, Value, specs
from ..graph.specs import Dtypes, Shapes, Values
from . import build

if TYPE_CHECKING:
    from .array import Array

try:
    from numpy.lib.array_utils import normalize_axis_tuple
except ImportError:  # NumPy < 2
    from numpy.core.numeric import normalize_axis_tuple  # type: ignore[no-redef]

__all__ = [
    "BlockFunction",
    "BlockFunctionSpec",
    "axes",
    "cast_result",
    "float_acc",
    "in_memory",
    "lazy",
    "no_extras",
    "numpy_dtype",
    "on_blocks",
    "scalar_or_array",
    "squares",
]


# -- NumPy's function on each block ----------------------------------------------------


class BlockFunction:
    """``fn(*operands, **kwargs)`` on each block: a row-independent BlockOp.

    ``template`` lists ``fn``'s positional operands: None for the next block,
    :data:`~tierflow.engine.graph.specs.VALUE` for the next value, anything else a constant.
    ``fn`` must give one row per row of its blocks; its dtype and row shape are read from
    ``fn`` on blocks of one zero row, so NumPy's errors (a bad ``ord``, subscripts that
    do not match) are raised when the pipeline is built.
    """

    row_independent = True

    def __init__(  # noqa: PLR0913 -- what the spec holds, and what the node gives
        self,
        fn: Callable[..., Any],
        kwargs: dict[str, Any],
        template: tuple[Any, ...],
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> None:
        self.fn = fn
        self.kwargs = kwargs
        self.template = template
        self.values = tuple(values)
        self.n_inputs = len(dtypes)
        self.in_bytes = sum(
            np.dtype(d).itemsize * math.prod(s) for d, s in zip(dtypes, row_shapes, strict=True)
        )
        zeros = [np.zeros((1, *s), d) for d, s in zip(dtypes, row_shapes, strict=True)]
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            probe = np.asarray(self._call(zeros))
        if probe.ndim == 0 or probe.shape[0] != 1:
            raise ValueError(
                f"{getattr(fn, '__name__', fn)} does not keep the rows: one row in gave shape "
                f"{probe.shape}"
            )
        self.out_dtype = probe.dtype
        self.out_row_shape = tuple(probe.shape[1:])

    def __repr__(self) -> str:
        return f"BlockFunction({getattr(self.fn, '__name__', self.fn)}, {self.kwargs})"

    def _call(self, blocks: Sequence[np.ndarray]) -> Any:
        next_block = iter(blocks)
        next_value = iter(self.values)
        operands = [
            next(next_block) if t is None else next(next_value) if t is specs.VALUE else t
            for t in self.template
        ]
        return self.fn(*operands, **self.kwargs)

    def apply(self, *blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """NumPy's function on the blocks; copied into ``out`` when given."""
        result = np.asarray(self._call(blocks))
        if out is not None:
            np.copyto(out, result)
            return out
        return result

    def temp_bytes(self, rows: int) -> int:
        """The result and as much as the inputs again (NumPy's casts and einsum's
        intermediates)."""
        return block_bytes(rows, self.out_row_shape, self.out_dtype) + rows * self.in_bytes


@dataclass(frozen=True, eq=False)
class BlockFunctionSpec(specs.Spec):
    """A NumPy function on each block (see :class:`BlockFunction`), named ``name``."""

    name: str
    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    template: tuple[Any, ...]

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return BlockFunction(self.fn, self.kwargs, self.template, dtypes, row_shapes, values)

    def label(self) -> str:
        shown = "".join(f", {k}={v!r}" for k, v in self.kwargs.items() if v is not None)
        return f"{self.name}({shown.lstrip(', ')})"


def on_blocks(name: str, fn: Callable[..., Any], operands: Sequence[Any], **kwargs: Any) -> Array:
    """``fn(*operands, **kwargs)`` on each block of the chunked operands (same rows);
    in-memory operands are constants, lazy in-memory results values."""
    nodes = [build.node_of(o) for o in operands]
    chunked = [n for n in nodes if isinstance(n, Chunked)]
    values = tuple(n for n in nodes if isinstance(n, Value))
    template = tuple(
        None if isinstance(n, Chunked) else specs.VALUE if isinstance(n, Value) else n
        for n in nodes
    )
    spec = BlockFunctionSpec(name, fn, kwargs, template)
    return build.wrap(graph.BlockMap(spec, tuple(chunked), values))


def in_memory(fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Array:
    """``fn`` of in-memory (or lazy in-memory) operands, as a lazy value."""
    nodes = [build.node_of(a) if build.is_array(a) else a for a in args]
    return build.value_apply(fn, *nodes, name=name, **kwargs)


def axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    return tuple(normalize_axis_tuple(axis, ndim, allow_duplicate=False))


def no_extras(name: str, out: Any = None, **extra: Any) -> None:
    if out is not None:
        raise TypeError(
            f"np.{name}(..., out=...) is not supported on lazy arrays: results are placed by "
            "tierflow; assign the returned array instead"
        )
    given = sorted(k for k, v in extra.items() if v is not np._NoValue and v is not None)
    if given:
        raise TypeError(
            f"np.{name}: {', '.join(given)}= is not supported on lazy arrays; use tw.where to "
            "leave elements out, or compute() first"
        )


def scalar_or_array(value: np.ndarray) -> Any:
    return value[()] if value.ndim == 0 else value


def numpy_dtype(
    fn: Callable[..., Any], in_dtype: np.dtype, row_shape: tuple[int, ...], **kw: Any
) -> np.dtype:
    """The dtype NumPy's ``fn`` gives for one row of zeros of ``in_dtype``."""
    sample = np.zeros((1, *(max(n, 1) for n in row_shape)), in_dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.asarray(fn(sample, **kw)).dtype


def lazy(ufunc: np.ufunc, *operands: Any) -> Array:
    """``ufunc`` of lazy operands, as the lazy array it gives."""
    result = ufunc(*operands)
    assert build.is_array(result)
    return result


def float_acc(dtype: np.dtype) -> np.dtype:
    """float64 (complex128) for float sums whose result is ``dtype``."""
    return red.accumulator_dtype(np.dtype(dtype))


def cast_result(dtype: np.dtype, partial: Any) -> Any:
    return scalar_or_array(np.asarray(partial).astype(dtype))


def squares(values: Array, by_parts: bool = False) -> Array:
    """``|values|**2`` in float64, as NumPy's norm finds it for complex data:
    ``(conj(x) * x).real``, or ``re**2 + im**2`` with ``by_parts`` (its norm of all
    values). Either way an infinite part beside a NaN part gives NaN, where ``abs(x)``
    would give inf; the first also warns as NumPy's does (``inf - inf`` inside)."""
    if values.dtype.kind == "c":
        wide = values.astype(np.complex128)
        if by_parts:
            re, im = wide.real, wide.imag
            return re * re + im * im
        return (lazy(np.conjugate, wide) * wide).real
    wide = values.astype(np.float64)
    return wide * wide
