"""Scans along the rows: ``np.cumsum``, ``np.cumprod``, ``np.nancumsum`` and
``np.nancumprod`` along axis 0, and ``tw.ffill`` / ``tw.bfill`` (the forward and
backward fills that xarray's ``ffill`` and ``bfill`` run), in two passes::

    np.cumsum(x, axis=0)

    pass 1: Reduce(ScanCarries)  <- x       each block's total (its sum, its product,
                                            its last valid value and row), with the
                                            block's first row; merged in row order into
                                            the carry before each block (Carries)
    pass 2: ScannedRows(x, carries)         each block scanned from its carry: the
                                            block's rows only, any block in parallel

Both passes read each block once and hold one block at a time, so a file bigger than
RAM is scanned in a flat budget. A request that starts inside a pass-1 block (pass 2
cut differently, an out-of-memory halving) reads from that block's first row, so any
row range gives the right rows.

**What equals NumPy's.** Integer scans are NumPy's exactly (wrapping included). A
float scan starts each block from the sum (product) of the blocks before it, each
block's total summed pairwise, where NumPy adds every row to the running sum one after
the other: the two agree to rounding (dask's ``cumsum`` does the same; the first block
is NumPy's bit for bit). The fills move values only: they are exact. Result dtypes are
NumPy's (``np.cumsum`` of int8 or bool gives the platform integer), in native byte
order.

**The fills.** ``ffill`` gives each NaN the last non-NaN value above it in its column
(``limit``: only when at most ``limit`` rows above; bottleneck's ``push``, which
xarray's ``ffill`` calls); ``bfill`` the first below. Arrays that cannot hold NaN are
returned as they are. A block's carry is, per column, the value and the global row of
its last (first) valid element, so a limit that reaches across blocks counts right.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ...operators.types import block_bytes
from .. import graph
from ..graph import Chunked, Node, portable, specs
from ..graph.keyed import Keyed
from ..graph.specs import Dtypes, Shapes, Values
from ..program.context import Context
from ..program.steps import Step
from ..types import Request, RowRange, TaskMemory

__all__ = [
    "KINDS",
    "Carries",
    "CarriesSpec",
    "ScanCarries",
    "ScanStep",
    "ScannedRows",
    "Scanning",
    "UserScan",
    "scan_dtype",
    "scanned_node",
]

# The scans and the NumPy function each one is along a trailing axis.
_NUMPY: dict[str, Callable[..., Any]] = {
    "cumsum": np.cumsum,
    "cumprod": np.cumprod,
    "nancumsum": np.nancumsum,
    "nancumprod": np.nancumprod,
}
KINDS = (*_NUMPY, "ffill", "bfill")


def scan_dtype(kind: str, dtype: Any, scan_as: Any = None) -> np.dtype:
    """The result dtype of scan ``kind`` of ``dtype`` values (``scan_as``: the
    ``dtype=`` argument), NumPy's, in native byte order."""
    dtype = np.dtype(dtype)
    if kind in ("ffill", "bfill"):
        found = dtype
    else:
        found = _NUMPY[kind](np.zeros(1, dtype), dtype=scan_as).dtype
    return found.newbyteorder("=")


@dataclass(frozen=True)
class Scanning(Keyed):
    """Which scan: ``kind`` (one of :data:`KINDS`), the result's ``dtype`` and, for the
    fills, ``limit`` (None: no limit)."""

    kind: str
    dtype: str
    limit: int | None = None

    @property
    def out_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def backward(self) -> bool:
        """Whether the scan runs from the last row up (``bfill``)."""
        return self.kind == "bfill"

    @property
    def fills(self) -> bool:
        return self.kind in ("ffill", "bfill")

    def label(self) -> str:
        if self.fills:
            limit = "" if self.limit is None else f"limit={self.limit}"
            return f"{self.kind}({limit})"
        return f"{self.kind}(axis=0)"

    # -- pass 1: a block's total ----------------------------------------------------

    def total(self, block: np.ndarray, first: int) -> Any:
        """What block rows ``first...`` carry to the rows after them (before them, for
        ``bfill``): a sum or a product as a row of the result's dtype, or for a fill
        ``(values, rows)``: per column the last (first) valid value and its global row,
        row -1 where the column has none."""
        dtype = self.out_dtype
        kind = self.kind
        if kind == "cumsum":
            return np.add.reduce(block, axis=0, dtype=dtype)
        if kind == "cumprod":
            return np.multiply.reduce(block, axis=0, dtype=dtype)
        if kind == "nancumsum":
            return np.nansum(block, axis=0, dtype=dtype)
        if kind == "nancumprod":
            return np.nanprod(block, axis=0, dtype=dtype)
        values = np.asarray(block, dtype)
        if values.dtype.kind not in "fc":
            return None  # nothing to fill
        valid = ~np.isnan(values)
        rows = values.shape[0]
        has = valid.any(axis=0)
        if self.backward:
            at = np.argmax(valid, axis=0)
        else:
            at = rows - 1 - np.argmax(valid[::-1], axis=0)
        picked = np.take_along_axis(values, at[None], axis=0)[0]
        where = np.where(has, at + first, -1).astype(np.int64)
        return (np.where(has, picked, np.nan).astype(dtype), where)

    def follow(self, carry: Any, total: Any) -> Any:
        """The carry after a block of ``total`` that follows ``carry`` (in the scan's
        direction)."""
        if carry is None:
            return total
        if total is None:
            return carry
        kind = self.kind
        if kind in ("cumsum", "nancumsum"):
            return np.add(carry, total, dtype=self.out_dtype)
        if kind in ("cumprod", "nancumprod"):
            return np.multiply(carry, total, dtype=self.out_dtype)
        values, rows = total
        known = rows >= 0
        return (np.where(known, values, carry[0]), np.where(known, rows, carry[1]))

    # -- pass 2: a block from its carry ---------------------------------------------

    def scan(self, block: np.ndarray, carry: Any, first: int) -> np.ndarray:
        """The scan of block rows ``first...`` after ``carry`` (None: nothing before)."""
        if self.fills:
            return self._fill(block, carry, first)
        dtype = self.out_dtype
        function = _NUMPY[self.kind]
        if carry is None:
            return np.asarray(function(block, axis=0, dtype=dtype), dtype)
        # From the carry on, one row after the other, as NumPy's own loop adds them.
        out = np.empty((block.shape[0] + 1, *block.shape[1:]), dtype)
        out[0] = carry
        out[1:] = block
        if self.kind in ("nancumsum", "nancumprod"):
            np.copyto(out[1:], 0 if self.kind == "nancumsum" else 1, where=np.isnan(out[1:]))
        base = np.cumsum if self.kind in ("cumsum", "nancumsum") else np.cumprod
        base(out, axis=0, out=out)
        return out[1:]

    def _fill(self, block: np.ndarray, carry: Any, first: int) -> np.ndarray:
        values = np.array(block, self.out_dtype)  # a copy: the result
        if values.dtype.kind not in "fc" or values.shape[0] == 0:
            return values
        rows = values.shape[0]
        flat = values.reshape(rows, -1)
        backward = self.backward
        if backward:
            flat = flat[::-1]
        valid = ~np.isnan(flat)
        order = np.arange(rows, dtype=np.int64)[:, None]
        # the row (in scan order) of the last valid value so far, -1 for none yet
        seen = np.where(valid, order, -1)
        np.maximum.accumulate(seen, axis=0, out=seen)
        step = -1 if backward else 1
        start = first + rows - 1 if backward else first
        own = seen >= 0
        global_row = np.where(own, start + step * seen, -1)
        filled = np.take_along_axis(flat, np.maximum(seen, 0), axis=0)
        if carry is not None:
            carry_values, carry_rows = (c.reshape(-1) for c in carry)
            from_carry = ~own & (carry_rows >= 0)[None]
            global_row = np.where(from_carry, carry_rows[None], global_row)
            filled = np.where(from_carry, carry_values[None], filled)
        # a NaN takes the value found for it, if any, within the limit; else it stays
        fill = ~valid & (global_row >= 0)
        if self.limit is not None:
            here = start + step * order
            fill &= np.abs(here - global_row) <= self.limit
        out = np.where(fill, filled, flat).astype(values.dtype, copy=False)
        if backward:
            out = out[::-1]
        return np.ascontiguousarray(out).reshape(values.shape)


@dataclass(frozen=True, eq=False)
class UserScan(Keyed):
    """dask's ``cumreduction`` along the rows: ``func(block, axis=0, dtype=dtype)`` scans
    a block, ``binop(carry, scanned)`` adds what the blocks before it carry (a row),
    which is ``preop(block, axis=0, keepdims=True)`` of each block when given, else the
    last row of its scan, folded with ``binop``. ``ident`` is what nothing carries
    (dask's identity: ``binop(ident, x)`` is ``x``; a block with nothing before it is
    scanned without it)."""

    func: Callable[..., Any]
    binop: Callable[..., Any]
    ident: Any
    preop: Callable[..., Any] | None
    dtype: str
    kind: ClassVar[str] = "user"
    limit: ClassVar[None] = None
    user: ClassVar[bool] = True

    def __getstate__(self) -> Any:
        # One cloudpickle for all the functions: those they share stay shared.
        return portable.by_value(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def out_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    backward: ClassVar[bool] = False
    fills: ClassVar[bool] = False

    def label(self) -> str:
        return f"cumreduction({getattr(self.func, '__name__', 'func')})"

    def _scan(self, block: np.ndarray) -> np.ndarray:
        return np.asarray(self.func(block, axis=0, dtype=self.out_dtype))

    def total(self, block: np.ndarray, first: int) -> Any:
        if self.preop is not None:
            return np.asarray(self.preop(block, axis=0, keepdims=True))
        return self._scan(block)[-1:]

    def follow(self, carry: Any, total: Any) -> Any:
        return total if carry is None else np.asarray(self.binop(carry, total))

    def scan(self, block: np.ndarray, carry: Any, first: int) -> np.ndarray:
        scanned = self._scan(block)
        if carry is None:
            return scanned.astype(self.out_dtype, copy=False)
        return np.asarray(self.binop(carry, scanned)).astype(self.out_dtype, copy=False)


How = Scanning | UserScan  # what a scan does, built in or given


# -- pass 1 ---------------------------------------------------------------------------


class ScanCarries:
    """Each block's total as a reduction: a partial is ``[(first row, rows, total),
    ...]``, merged in any order and put in row order by :meth:`aggregate`."""

    row_independent = False
    n_inputs = 1
    commutative = True
    out_dtype = None
    out_shape = None

    def __init__(self, how: How, dtype: np.dtype, row_shape: tuple[int, ...]) -> None:
        self.how = how
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(row_shape)

    def __repr__(self) -> str:
        return f"ScanCarries({self.how.label()})"

    def chunk(self, block: np.ndarray, row_offset: int = 0) -> Any:
        rows = block.shape[0]
        if rows == 0:
            return None
        return [(int(row_offset), rows, self.how.total(block, int(row_offset)))]

    def combine(self, a: Any, b: Any) -> Any:
        if a is None:
            return b
        if b is None:
            return a
        return [*a, *b]

    def aggregate(self, partial: Any) -> Carries:
        pieces = sorted(partial or [], key=lambda p: p[0])
        return Carries.of(self.how, pieces)

    def temp_bytes(self, rows: int) -> int:
        # the fills' mask, rows and picks; the nan-scans' copy without NaN
        return 3 * block_bytes(rows, self.row_shape, np.dtype(np.int64))

    def partial_bytes(self) -> int:
        return 2 * 8 * max(1, math.prod(self.row_shape)) + 64


@dataclass(frozen=True, eq=False)
class Carries:
    """The carries of pass 1: ``starts`` (each pass-1 block's first row, in order),
    ``stops`` (its end) and ``before[j]``: what the rows before block ``j`` carry into
    it (after it, for ``bfill``), None for nothing."""

    starts: np.ndarray
    stops: np.ndarray
    before: list[Any]

    @classmethod
    def of(cls, how: How, pieces: Sequence[tuple[int, int, Any]]) -> Carries:
        starts = np.array([p[0] for p in pieces], np.int64)
        stops = np.array([p[0] + p[1] for p in pieces], np.int64)
        if len(pieces) and (starts[0] != 0 or np.any(starts[1:] != stops[:-1])):
            raise AssertionError(
                f"scan blocks do not tile the rows: {list(zip(starts, stops, strict=True))}"
            )
        order = range(len(pieces) - 1, -1, -1) if how.backward else range(len(pieces))
        before: list[Any] = [None] * len(pieces)
        carry = None
        for j in order:
            before[j] = carry
            carry = how.follow(carry, pieces[j][2])
        return cls(starts, stops, before)

    def block_of(self, row: int) -> int:
        """The pass-1 block holding ``row``."""
        return int(np.searchsorted(self.starts, row, side="right")) - 1


@dataclass(frozen=True)
class CarriesSpec(specs.ReduceSpec):
    """Builds :class:`ScanCarries` for a :class:`~tierflow.engine.graph.nodes.Reduce`; its
    value (:class:`Carries`) has no dtype or shape and is used by :class:`ScannedRows`."""

    how: How

    @property
    def needs_offset(self) -> bool:
        return True

    def build(
        self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values
    ) -> ScanCarries:
        return ScanCarries(self.how, dtypes[0], row_shapes[0])

    def meta(self, op: Any, first: Any) -> tuple[None, None]:
        return None, None

    def label(self) -> str:
        return f"block totals of {self.how.label()}"


# -- pass 2 ---------------------------------------------------------------------------


class ScannedRows(Chunked):
    """The scan of ``source`` (its first input) from the carries (its second, a
    :class:`~tierflow.engine.graph.nodes.Reduce` of :class:`CarriesSpec`): cut as
    ``source`` is, whose row counts are known."""

    def __init__(self, source: Chunked, carries: graph.Reduce, how: How) -> None:
        assert source.bounds is not None
        super().__init__(
            (source, carries), how.out_dtype, source.shape, graph.Blocks(source.bounds)
        )
        self.how = how

    def params(self) -> str:
        return self.how.params()

    def label(self) -> str:
        return self.how.label()

    def rows_from(self) -> tuple[Node, ...]:
        return (self.inputs[0],)

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        source = inputs[0]
        assert isinstance(source, Chunked)
        return scanned_node(source, self.how)


def scanned_node(source: Chunked, how: How) -> ScannedRows:
    """The lazy scan of ``source`` (rows known; see the module docstring)."""
    return ScannedRows(source, graph.Reduce(CarriesSpec(how), (source,)), how)


class ScanStep(Step):
    """Rows ``[a, b)`` of a :class:`ScannedRows`: read from the first row of the
    pass-1 block holding ``a`` (holding ``b - 1`` for ``bfill``), scanned from that
    block's carry. ``carries`` is None while planning."""

    node: ScannedRows

    def __init__(self, node: ScannedRows, source: Step, carries: Carries | None) -> None:
        self.node = node
        self.source = source
        self.carries = carries

    def _span(self, a: int, b: int) -> tuple[int, int, Any]:
        """The rows to read for ``[a, b)`` and their carry."""
        carries = self.carries
        assert carries is not None
        if self.node.how.backward:
            j = carries.block_of(b - 1)
            return a, int(carries.stops[j]), carries.before[j]
        j = carries.block_of(a)
        return int(carries.starts[j]), b, carries.before[j]

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        assert isinstance(req, RowRange)
        a, b = req.start, req.stop
        how = self.node.how
        if b <= a:
            return np.empty((0, *self.node.row_shape), how.out_dtype)
        lo, hi, carry = self._span(a, b)
        block = self.source.host(ctx, RowRange(lo, hi))
        out = how.scan(block, carry, lo)
        return out[a - lo : b - lo]

    def children(self) -> list[Step]:
        return [self.source]

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        if isinstance(req, RowRange) and self.carries is not None and req.stop > req.start:
            lo, hi, _ = self._span(req.start, req.stop)
            yield from self.source.sources(RowRange(lo, hi))
            return
        yield from self.source.sources(req)

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        node = self.node
        dtype = np.dtype(node.dtype)
        out = 0 if into_sink else block_bytes(rows, node.row_shape, dtype)
        # the scanned rows (one more), and for the fills their rows and masks
        temps = block_bytes(rows + 1, node.row_shape, dtype)
        if node.how.fills:
            temps += 3 * block_bytes(rows, node.row_shape, np.dtype(np.int64))
        return TaskMemory(outputs=out, temps=temps)
