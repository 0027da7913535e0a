"""Operator specifications: what a graph node stores to build its operator later.

A node cannot hold its operator outright: a parameter may be a lazy value (``x @ w``
with ``w`` computed by an earlier reduction), and the operator is built once per
compute with the values bound. A spec builds it — with zero placeholders while the
graph is built (for dtypes and shapes), with the real values when a compute runs — and
gives the node its key parameters and its label.

Specs are frozen dataclasses (:class:`~tierflow.engine.graph.keyed.Keyed`): their key is
derived from their fields, so a new field cannot be left out of it.

Block specs build a :class:`~tierflow.operators.types.BlockOp`:
``build(dtypes, row_shapes, values)``. Reduction specs build a
:class:`~tierflow.operators.types.ReductionOp`: ``build(dtypes, row_shapes, n_rows,
values)``, and say the result's ``meta`` (dtype and shape). ``dtypes`` and
``row_shapes`` are the chunked inputs' (:data:`Dtypes`, :data:`Shapes`), ``values`` the
value nodes' results, or placeholders while the graph is built (:data:`Values`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ...operators import linalg, reductions, selection
from . import block_operators, portable
from .keyed import NOT_KEY, Keyed

__all__ = [
    "VALUE",
    "AlongAxisSpec",
    "CollectSpec",
    "ContractSpec",
    "Dtypes",
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
    "Shapes",
    "Spec",
    "StackSpec",
    "UfuncOutSpec",
    "UserSpec",
    "Values",
]

Dtypes = Sequence[np.dtype]  # of the chunked inputs, in order
Shapes = Sequence[tuple[int, ...]]  # their row shapes (trailing axes)
Values = Sequence[Any]  # the value inputs' results


def _fn_name(fn: Any) -> str:
    return str(
        getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    )


def _axis_text(axis: Any) -> str:
    return "" if axis is None else f"axis={axis}"


@dataclass(frozen=True, eq=False)
class Spec(Keyed):
    """Base of the specs; the key (:meth:`params`) is the fields', by the rule of
    :class:`~tierflow.engine.graph.keyed.Keyed`."""

    user: ClassVar[bool] = False  # True: the operator runs user code; its errors name the block
    epilogue: ClassVar[bool] = False  # True: its operator can end a fused elementwise kernel


@dataclass(frozen=True)
class ReduceOptions:
    """A NumPy reduction and its keywords as the caller gave them (``initial`` is
    ``np._NoValue`` when not given, and then not part of the key: keys made before it
    stay)."""

    kind: str
    axis: Any
    keepdims: bool
    dtype: Any
    ddof: float
    initial: Any = np._NoValue

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


@dataclass(frozen=True)
class RowwiseSpec(Spec):
    """A reduction over trailing axes only (``x.sum(axis=1)``): a block op."""

    options: ReduceOptions
    epilogue: ClassVar[bool] = True

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return self.options.build(dtypes[0], row_shapes[0])

    def label(self) -> str:
        o = self.options
        args = ", ".join(a for a in (_axis_text(o.axis), "keepdims" if o.keepdims else "") if a)
        return f"{o.kind}({args})"


@dataclass(frozen=True, eq=False)
class MatmulSpec(Spec):
    """``x @ w`` for 2-D and wider ``x``; ``w`` in memory, or a lazy value (``values[0]``)."""

    w: np.ndarray | None
    epilogue: ClassVar[bool] = True

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        w = self.w if self.w is not None else values[0]
        return linalg.Matmul(dtypes[0], row_shapes[0], w)

    def label(self) -> str:
        shape = self.w.shape if self.w is not None else "lazy"
        return f"@ w{shape}"


@dataclass(frozen=True, eq=False)
class IndexSpec(Spec):
    """``x[:, key]``: indexing of trailing axes."""

    key: tuple[Any, ...]
    epilogue: ClassVar[bool] = True

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return selection.TrailingIndex(dtypes[0], row_shapes[0], self.key)

    def label(self) -> str:
        inner = ", ".join(
            "..." if k is Ellipsis else ":" if k == slice(None) else repr(k) for k in self.key
        )
        return f"[:, {inner}]"


@dataclass(frozen=True, eq=False)
class MapSpec(Spec):
    """``map_blocks(fn)``: a user function on blocks, on the CPU or a torch device (not
    part of the key: the result is the same wherever it runs)."""

    fn: Callable[..., Any]
    dtype: np.dtype
    row_shape: tuple[int, ...]
    device: str | None = field(metadata=NOT_KEY)
    kwargs: dict[str, Any]
    user: ClassVar[bool] = True

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fn": portable.by_value(self.fn)}

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return block_operators.MapBlocks(
            self.fn, len(dtypes), self.dtype, self.row_shape, device=self.device,
            kwargs=self.kwargs, name=f"map_blocks({_fn_name(self.fn)})",
        )  # fmt: skip

    def label(self) -> str:
        where = f", {self.device}" if self.device else ""
        return f"map_blocks({_fn_name(self.fn)}{where})"


@dataclass(frozen=True, eq=False)
class AlongAxisSpec(Spec):
    """``np.sort(x, axis=1)``, ``np.cumsum(x, axis=-1)``...: a NumPy function along a
    trailing axis (``axis`` counts the row axis, as NumPy does)."""

    name: str
    axis: int
    kwargs: dict[str, Any]

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return block_operators.AlongAxis(
            self.name, dtypes[0], row_shapes[0], self.axis, self.kwargs
        )

    def label(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}(axis={self.axis}{extra})"


@dataclass(frozen=True)
class ReshapeSpec(Spec):
    """``x.reshape(n, *row_shape)``: new trailing axes, same rows."""

    row_shape: tuple[int, ...]

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return block_operators.Reshape(dtypes[0], row_shapes[0], self.row_shape)

    def label(self) -> str:
        return f"reshape(rows, {', '.join(map(str, self.row_shape))})"


@dataclass(frozen=True, eq=False)
class StackSpec(Spec):
    """``np.concatenate`` / ``np.stack`` of row-aligned arrays along a trailing axis."""

    function: Callable[..., Any]
    axis: int

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        return block_operators.Stack(self.function, self.axis, dtypes, row_shapes)

    def label(self) -> str:
        return f"{self.function.__name__}(axis={self.axis})"


@dataclass(frozen=True, eq=False)
class UfuncOutSpec(Spec):
    """One output of a ufunc with several (``np.divmod(x, 3)[1]``).

    ``template`` holds the ufunc's operands in order: None where a block goes, the
    constant otherwise; value nodes come as ``values``, in template order (marked by
    :data:`VALUE`)."""

    ufunc: np.ufunc
    index: int
    kwargs: dict[str, Any]
    template: tuple[Any, ...]

    def build(self, dtypes: Dtypes, row_shapes: Shapes, values: Values) -> Any:
        call = block_operators.UfuncCall(self.ufunc, self.index, self.kwargs, self.template)
        return block_operators.UfuncOutput(call, dtypes, row_shapes, values)

    def label(self) -> str:
        return f"{self.ufunc.__name__}[{self.index}]"


class _ValueSlot:
    """The marker of a value operand in a template (one object, :data:`VALUE`)."""

    def __repr__(self) -> str:
        return "<value>"

    def __reduce__(self) -> str:
        # By name: the marker unpickles as this module's VALUE in every process, and
        # keys it by name, not by its class's code.
        return "VALUE"


VALUE = _ValueSlot()


# -- reductions -------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ReduceSpec(Spec):
    """Base of the reduction specs."""

    @property
    def needs_offset(self) -> bool:
        """True: chunk needs the global row offset of its block."""
        return False

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...] | None]:
        return op.out_dtype, op.out_shape


@dataclass(frozen=True)
class KindSpec(ReduceSpec):
    """A NumPy reduction whose axes include the row axis (``sum``, ``std``, ``argmax``...)."""

    options: ReduceOptions

    @property
    def needs_offset(self) -> bool:
        return self.options.kind in ("argmin", "argmax")

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return self.options.build(dtypes[0], row_shapes[0])

    def label(self) -> str:
        return f"{self.options.kind}({', '.join(self.options.texts())})"


@dataclass(frozen=True, eq=False)
class HistogramSpec(ReduceSpec):
    """``np.histogram(x, bins, range)``: counts per bin (the edges are known at once)."""

    bins: Any
    range: Any
    density: bool

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
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


@dataclass(frozen=True, eq=False)
class UserSpec(ReduceSpec):
    """``x.reduction(chunk, combine, aggregate)`` (``aggregate`` None: the partial)."""

    chunk: Callable[..., Any]
    combine: Callable[[Any, Any], Any]
    aggregate: Callable[[Any], Any] | None
    options: reductions.ReductionOptions
    user: ClassVar[bool] = True

    def __getstate__(self) -> Any:
        # One cloudpickle for all the functions: those they share stay shared.
        return portable.by_value(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def needs_offset(self) -> bool:
        return self.options.with_offset

    @property
    def reduction(self) -> reductions.Reduction:
        """The user's reduction, for inputs not yet known."""
        return reductions.Reduction(self.chunk, self.combine, self.aggregate, self.options)

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return self.reduction.over(dtypes, row_shapes)

    def label(self) -> str:
        return f"reduction({self.reduction.name})"


@dataclass(frozen=True, eq=False)
class ContractSpec(ReduceSpec):
    """``x @ w`` for 1-D ``x`` and ``w @ x``: a product over the row axis."""

    w: np.ndarray | None
    side: str

    @property
    def needs_offset(self) -> bool:
        return True

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        w = self.w if self.w is not None else values[0]
        if n_rows is None:
            raise ValueError(
                "a matrix product over the rows needs the row count, which is unknown after "
                "a boolean mask; persist() the array first"
            )
        return linalg.RowContraction(dtypes[0], row_shapes[0], w, n_rows=n_rows, side=self.side)

    def label(self) -> str:
        return "x @ w" if self.side == "right" else "w @ x"


@dataclass(frozen=True)
class HeadSpec(ReduceSpec):
    """``head(n)`` of an array whose row count is unknown."""

    n: int

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return block_operators.Head(self.n, dtypes[0], row_shapes[0])

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...]]:
        return op.out_dtype, (None, *source.row_shape)

    def label(self) -> str:
        return f"head({self.n})"


@dataclass(frozen=True)
class CollectSpec(ReduceSpec):
    """All rows in memory (a small lazy array used as a broadcast constant)."""

    def build(self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values) -> Any:
        return block_operators.Collect(dtypes[0], row_shapes[0], n_rows)

    def meta(self, op: Any, source: Any) -> tuple[Any, tuple[int | None, ...]]:
        return op.out_dtype, tuple(source.shape)

    def label(self) -> str:
        return "collect"
