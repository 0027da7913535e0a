"""Operator specifications: what a graph node stores to build its operator later.

A node cannot hold its operator outright: a parameter may be a lazy value (``x @ w``
with ``w`` computed by an earlier reduction), and the operator is built once per
compute with the values bound. A spec builds it — with zero placeholders while the
graph is built (for dtypes and shapes), with the real values when a compute runs — and
gives the node its key parameters and its label.

Block specs build a :class:`~tierflow.operators.types.BlockOp`:
``build(dtypes, row_shapes, values)``. Reduction specs build a
:class:`~tierflow.operators.types.ReductionOp`: ``build(dtypes, row_shapes, n_rows,
values)``, and say the result's ``meta`` (dtype and shape).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...operators import linalg, reductions, selection
from ...storage import identity
from . import block_operators, portable

__all__ = [
    "VALUE",
    "AlongAxisSpec",
    "CollectSpec",
    "ContractSpec",
    "HeadSpec",
    "HistogramSpec",
    "IndexSpec",
    "KindSpec",
    "MapSpec",
    "MatmulSpec",
    "ReduceOptions",
    "ReduceSpec",
    "ReshapeSpec",
    "RowwiseSpec",
    "Spec",
    "StackSpec",
    "UfuncOutSpec",
    "UserSpec",
]


def _fn_name(fn: Any) -> str:
    return str(
        getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    )


def _axis_text(axis: Any) -> str:
    return "" if axis is None else f"axis={axis}"


class Spec:
    user = False  # True: the operator runs user code; its errors name the block
    epilogue = False  # True: its operator can end a fused elementwise kernel
    device: str | None = None

    def params(self) -> str:
        return identity.token(self._fields())

    def _fields(self) -> tuple[Any, ...]:
        return ()


@dataclass(frozen=True)
class ReduceOptions:
    """A NumPy reduction and its keywords as the caller gave them (``initial`` is
    ``np._NoValue`` when not given)."""

    kind: str
    axis: Any
    keepdims: bool
    dtype: Any
    ddof: float
    initial: Any = np._NoValue

    def fields(self) -> tuple[Any, ...]:
        """What the key holds (``initial`` only when given: keys made before it stay)."""
        base = (self.kind, self.axis, self.keepdims, self.dtype, self.ddof)
        return base if self.initial is np._NoValue else (*base, ("initial", self.initial))

    def build(self, dtype: Any, row_shape: tuple[int, ...]) -> Any:
        """The operator (:func:`tierflow.operators.reductions.reduction`)."""
        return reductions.reduction(
            self.kind, dtype, row_shape, axis=self.axis, keepdims=self.keepdims,
            dtype=self.dtype, ddof=self.ddof, initial=self.initial,
        )  # fmt: skip

    def texts(self) -> list[str]:
        """The keywords given, as a label shows them."""
        extra = [_axis_text(self.axis)]
        if self.keepdims:
            extra.append("keepdims")
        if self.dtype is not None:
            extra.append(f"dtype={np.dtype(self.dtype)}")
        if self.ddof:
            extra.append(f"ddof={self.ddof}")
        if self.initial is not np._NoValue:
            extra.append(f"initial={self.initial!r}")
        return [e for e in extra if e]


class RowwiseSpec(Spec):
    """A reduction over trailing axes only (``x.sum(axis=1)``): a block op."""

    epilogue = True

    def __init__(self, options: ReduceOptions) -> None:
        self.options = options
        self.kind = options.kind

    def _fields(self) -> tuple[Any, ...]:
        return self.options.fields()

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        return self.options.build(dtypes[0], row_shapes[0])

    def label(self) -> str:
        o = self.options
        args = ", ".join(a for a in (_axis_text(o.axis), "keepdims" if o.keepdims else "") if a)
        return f"{self.kind}({args})"


class MatmulSpec(Spec):
    """``x @ w`` for 2-D and wider ``x``; ``w`` in memory, or a lazy value (``values[0]``)."""

    epilogue = True

    def __init__(self, w: np.ndarray | None) -> None:
        self.w = w

    def _fields(self) -> tuple[Any, ...]:
        return (self.w,)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        w = self.w if self.w is not None else values[0]
        return linalg.Matmul(dtypes[0], row_shapes[0], w)

    def label(self) -> str:
        shape = self.w.shape if self.w is not None else "lazy"
        return f"@ w{shape}"


class IndexSpec(Spec):
    """``x[:, key]``: indexing of trailing axes."""

    epilogue = True

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key

    def _fields(self) -> tuple[Any, ...]:
        return (self.key,)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        return selection.TrailingIndex(dtypes[0], row_shapes[0], self.key)

    def label(self) -> str:
        inner = ", ".join(
            "..." if k is Ellipsis else ":" if k == slice(None) else repr(k) for k in self.key
        )
        return f"[:, {inner}]"


class MapSpec(Spec):
    """``map_blocks(fn)``: a user function on blocks, on the CPU or a torch device."""

    user = True

    def __init__(
        self,
        fn: Callable[..., Any],
        dtype: np.dtype,
        row_shape: tuple[int, ...],
        device: str | None,
        kwargs: dict[str, Any],
    ) -> None:
        self.fn = fn
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(row_shape)
        self.device = device
        self.kwargs = kwargs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fn": portable.by_value(self.fn)}

    def _fields(self) -> tuple[Any, ...]:
        # The device is not part of the key: the result is the same wherever it runs.
        return (self.fn, self.dtype, self.row_shape, self.kwargs)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        return block_operators.MapBlocks(
            self.fn, len(dtypes), self.dtype, self.row_shape, device=self.device,
            kwargs=self.kwargs, name=f"map_blocks({_fn_name(self.fn)})",
        )  # fmt: skip

    def label(self) -> str:
        where = f", {self.device}" if self.device else ""
        return f"map_blocks({_fn_name(self.fn)}{where})"


class AlongAxisSpec(Spec):
    """``np.sort(x, axis=1)``, ``np.cumsum(x, axis=-1)``...: a NumPy function along a
    trailing axis (``axis`` counts the row axis, as NumPy does)."""

    def __init__(self, name: str, axis: int, kwargs: dict[str, Any]) -> None:
        self.name = name
        self.axis = axis
        self.kwargs = kwargs

    def _fields(self) -> tuple[Any, ...]:
        return (self.name, self.axis, self.kwargs)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        return block_operators.AlongAxis(
            self.name, dtypes[0], row_shapes[0], self.axis, self.kwargs
        )

    def label(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}(axis={self.axis}{extra})"


class ReshapeSpec(Spec):
    """``x.reshape(n, *row_shape)``: new trailing axes, same rows."""

    def __init__(self, row_shape: tuple[int, ...]) -> None:
        self.row_shape = row_shape

    def _fields(self) -> tuple[Any, ...]:
        return (self.row_shape,)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        return block_operators.Reshape(dtypes[0], row_shapes[0], self.row_shape)

    def label(self) -> str:
        return f"reshape(rows, {', '.join(map(str, self.row_shape))})"


class StackSpec(Spec):
    """``np.concatenate`` / ``np.stack`` of row-aligned arrays along a trailing axis."""

    def __init__(self, function: Callable[..., Any], axis: int) -> None:
        self.function = function
        self.axis = axis

    def _fields(self) -> tuple[Any, ...]:
        return (self.function.__name__, self.axis)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        return block_operators.Stack(self.function, self.axis, dtypes, row_shapes)

    def label(self) -> str:
        return f"{self.function.__name__}(axis={self.axis})"


class UfuncOutSpec(Spec):
    """One output of a ufunc with several (``np.divmod(x, 3)[1]``).

    ``template`` holds the ufunc's operands in order: None where a block goes, the
    constant otherwise; value nodes come as ``values``, in template order (marked by
    ``_VALUE``)."""

    def __init__(
        self, ufunc: np.ufunc, index: int, kwargs: dict[str, Any], template: tuple[Any, ...]
    ) -> None:
        self.ufunc, self.index, self.kwargs, self.template = ufunc, index, kwargs, template

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.ufunc,
            self.index,
            self.kwargs,
            tuple(repr(t) if t is VALUE else t for t in self.template),
        )

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        values: Sequence[Any],
    ) -> Any:
        call = block_operators.UfuncCall(self.ufunc, self.index, self.kwargs, self.template)
        return block_operators.UfuncOutput(call, dtypes, row_shapes, values)

    def label(self) -> str:
        return f"{self.ufunc.__name__}[{self.index}]"


VALUE = type("_ValueSlot", (), {"__repr__": lambda self: "<value>"})()


# -- reductions -------------------------------------------------------------------------


class ReduceSpec(Spec):
    needs_offset = False  # True: chunk needs the global row offset of its block

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...] | None]:
        return op.out_dtype, op.out_shape


class KindSpec(ReduceSpec):
    """A NumPy reduction whose axes include the row axis (``sum``, ``std``, ``argmax``...)."""

    def __init__(self, options: ReduceOptions) -> None:
        self.options = options
        self.kind, self.axis = options.kind, options.axis
        self.needs_offset = options.kind in ("argmin", "argmax")

    def _fields(self) -> tuple[Any, ...]:
        return self.options.fields()

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        n_rows: int | None,
        values: Sequence[Any],
    ) -> Any:
        return self.options.build(dtypes[0], row_shapes[0])

    def label(self) -> str:
        return f"{self.kind}({', '.join(self.options.texts())})"


class HistogramSpec(ReduceSpec):
    """``np.histogram(x, bins, range)``: counts per bin (the edges are known at once)."""

    def __init__(self, bins: Any, range: Any, density: bool) -> None:
        self.bins, self.range, self.density = bins, range, density

    def _fields(self) -> tuple[Any, ...]:
        return (self.bins, self.range, self.density)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        n_rows: int | None,
        values: Sequence[Any],
    ) -> Any:
        return HistogramCounts(
            reductions.Histogram(dtypes[0], self.bins, self.range, density=self.density)
        )

    def label(self) -> str:
        return "histogram"


class HistogramCounts:
    """The counts of a :class:`~tierflow.operators.reductions.Histogram` (its aggregate
    gives counts and edges; the edges are known without computing)."""

    def __init__(self, histogram: Any) -> None:
        self.histogram = histogram
        for name in ("row_independent", "commutative", "n_inputs", "out_dtype", "out_shape"):
            setattr(self, name, getattr(histogram, name))

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Any:
        return self.histogram.chunk(*blocks, row_offset=row_offset)

    def combine(self, a: Any, b: Any) -> Any:
        return self.histogram.combine(a, b)

    def aggregate(self, partial: Any) -> Any:
        return self.histogram.aggregate(partial)[0]

    def temp_bytes(self, rows: int) -> int:
        return int(self.histogram.temp_bytes(rows))

    def partial_bytes(self) -> int:
        return int(self.histogram.partial_bytes())


class UserSpec(ReduceSpec):
    """``x.reduction(chunk, combine, aggregate)``."""

    user = True

    def __init__(self, reduction: reductions.Reduction, fns: tuple[Any, ...]) -> None:
        self.reduction = reduction
        self.fns = fns
        self.needs_offset = reduction.with_offset

    def __getstate__(self) -> Any:
        # One cloudpickle for the reduction and fns: the functions they share stay shared.
        return portable.by_value(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _fields(self) -> tuple[Any, ...]:
        r = self.reduction
        return (*self.fns, r.with_offset, r.commutative, r.out_dtype, r.out_shape)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        n_rows: int | None,
        values: Sequence[Any],
    ) -> Any:
        return self.reduction.over(dtypes, row_shapes)

    def label(self) -> str:
        return f"reduction({self.reduction.name})"


class ContractSpec(ReduceSpec):
    """``x @ w`` for 1-D ``x`` and ``w @ x``: a product over the row axis."""

    needs_offset = True

    def __init__(self, w: np.ndarray | None, side: str) -> None:
        self.w, self.side = w, side

    def _fields(self) -> tuple[Any, ...]:
        return (self.w, self.side)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        n_rows: int | None,
        values: Sequence[Any],
    ) -> Any:
        w = self.w if self.w is not None else values[0]
        if n_rows is None:
            raise ValueError(
                "a matrix product over the rows needs the row count, which is unknown after "
                "a boolean mask; persist() the array first"
            )
        return linalg.RowContraction(dtypes[0], row_shapes[0], w, n_rows=n_rows, side=self.side)

    def label(self) -> str:
        return "x @ w" if self.side == "right" else "w @ x"


class HeadSpec(ReduceSpec):
    """``head(n)`` of an array whose row count is unknown."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _fields(self) -> tuple[Any, ...]:
        return (self.n,)

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        n_rows: int | None,
        values: Sequence[Any],
    ) -> Any:
        return block_operators.Head(self.n, dtypes[0], row_shapes[0])

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...]]:
        return op.out_dtype, (None, *source.row_shape)

    def label(self) -> str:
        return f"head({self.n})"


class CollectSpec(ReduceSpec):
    """All rows in memory (a small lazy array used as a broadcast constant)."""

    def _fields(self) -> tuple[Any, ...]:
        return ()

    def build(
        self,
        dtypes: Sequence[np.dtype],
        row_shapes: Sequence[tuple[int, ...]],
        n_rows: int | None,
        values: Sequence[Any],
    ) -> Any:
        return block_operators.Collect(dtypes[0], row_shapes[0], n_rows)

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...]]:
        return op.out_dtype, tuple(source.shape)

    def label(self) -> str:
        return "collect"
