"""``x.map_overlap(fn, depth=k, boundary=...)``: a function of each row block with
``k`` rows of its neighbours on each side (the halo), its result trimmed back to the
block's rows. Rolling windows, filters and differences along the rows need it.

Each task reads its block's rows and the halo as one row range of the input
(``[a - before, b + after)``, clipped to the array): a block's rows are read once, and
only the ``before + after`` halo rows are read by two tasks. Where the halo runs past
the first or the last row, ``boundary`` says what the function sees there:

* ``"none"`` (the default, as dask's): nothing; the function gets fewer rows at the
  edges, and the trim takes the rows it has;
* ``"reflect"``: the edge rows mirrored, the edge row included (``np.pad``'s
  ``"symmetric"``, dask's ``"reflect"``);
* ``"nearest"``: the edge row repeated;
* ``"periodic"``: the rows of the other end (the array wraps around);
* a number: rows of that value.

Out-of-memory halving keeps the halo: a piece of the block is retried with its own
rows and ``before`` / ``after`` rows around it (sliced from the rows already read).
The function must return one row per row it is given (halo and padding included):
anything else raises :class:`~tierflow.errors.BlockError` naming the block.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...operators.types import block_bytes
from .. import graph
from ..graph import Chunked, Node
from ..graph.keyed import Keyed
from ..program import halving
from ..program.context import Context, operator_call
from ..program.steps import Step
from ..types import Request, RowRange, TaskMemory

__all__ = ["BOUNDARIES", "Halo", "OverlapStep", "Overlapped"]

BOUNDARIES = ("none", "reflect", "nearest", "periodic")
_PAD_MODES: dict[str, Any] = {"reflect": "symmetric", "nearest": "edge", "periodic": "wrap"}


@dataclass(frozen=True)
class Halo(Keyed):
    """Rows of the neighbours a block is given: ``before`` and ``after`` it, and what
    stands in for them past the array's ends (``boundary``: one of
    :data:`BOUNDARIES`, or ``fill``'s value when ``boundary`` is ``"constant"``)."""

    before: int
    after: int
    boundary: str = "none"
    fill: float | int | complex | bool | None = None

    def label(self) -> str:
        depth = self.before if self.before == self.after else (self.before, self.after)
        edge = repr(self.fill) if self.boundary == "constant" else repr(self.boundary)
        return f"depth={depth}, boundary={edge}"

    def pad(self, top: Any, bottom: Any, rows: np.ndarray, missing: tuple[int, int]) -> np.ndarray:
        """``rows`` with ``missing`` rows stood in for above and below: ``top(k)`` and
        ``bottom(k)`` give the array's rows that the boundary pads from (its first and
        last ``min(k, n)`` rows; the other way round for ``"periodic"``)."""
        above, below = missing
        if self.boundary == "none" or (above == 0 and below == 0):
            return rows
        parts = []
        if above:
            parts.append(self._edge(top, above, first=True, like=rows))
        parts.append(rows)
        if below:
            parts.append(self._edge(bottom, below, first=False, like=rows))
        return np.concatenate(parts, axis=0)

    def _edge(self, edge: Any, count: int, first: bool, like: np.ndarray) -> np.ndarray:
        """``count`` rows to stand beyond the array's first (``first``) or last row."""
        widths = [(0, 0)] * like.ndim
        if self.boundary == "constant":
            return np.full((count, *like.shape[1:]), self.fill, like.dtype)
        # the array's first (last; for "periodic" the other end's) min(count, n) rows
        rows = edge(count)
        widths[0] = (count, 0) if first else (0, count)
        padded = np.pad(rows, widths, mode=_PAD_MODES[self.boundary])
        return padded[:count] if first else padded[-count:]

    def needs_edges(self) -> bool:
        return self.boundary in ("reflect", "nearest", "periodic")


def halo(depth: Any, boundary: Any, ndim: int, dtype: np.dtype) -> Halo:
    """The :class:`Halo` of dask's ``depth=`` and ``boundary=`` for an array of
    ``ndim`` dimensions and ``dtype``: ``depth`` an int, a pair ``(before, after)``, or
    a dict by axis where every axis but 0 has depth 0; ``boundary`` one of
    :data:`BOUNDARIES`, a number, or a dict by axis."""
    if isinstance(depth, dict):
        extra = {k: v for k, v in depth.items() if _axis(k, ndim) != 0 and v not in (0, (0, 0))}
        if extra:
            raise ValueError(
                f"map_overlap: depth={depth} asks for neighbours along axis "
                f"{sorted(extra)}; a lazy array is cut into row blocks, so blocks have whole "
                "trailing axes already: give depth along axis 0 only"
            )
        depth = next((v for k, v in depth.items() if _axis(k, ndim) == 0), 0)
    if isinstance(depth, (tuple, list)) and len(depth) == 2:
        before, after = (_count(d) for d in depth)
    elif isinstance(depth, (tuple, list)):
        raise ValueError(
            f"map_overlap: depth={depth!r}: give one number of rows, a pair (before, after), "
            "or {0: rows}"
        )
    else:
        before = after = _count(depth)
    if isinstance(boundary, dict):
        boundary = next((v for k, v in boundary.items() if _axis(k, ndim) == 0), "none")
    if boundary is None:
        boundary = "none"
    if isinstance(boundary, str):
        if boundary not in BOUNDARIES:
            raise ValueError(
                f"map_overlap: boundary={boundary!r}: use one of {', '.join(BOUNDARIES)} or a "
                "number"
            )
        return Halo(before, after, boundary)
    if not isinstance(boundary, (numbers.Number, np.generic)):
        raise TypeError(f"map_overlap: boundary={boundary!r} is not a boundary mode or a number")
    with np.errstate(invalid="raise", over="raise"):
        try:
            fill = np.asarray(boundary).astype(dtype)[()]
        except (FloatingPointError, ValueError, TypeError, OverflowError) as exc:
            raise ValueError(
                f"map_overlap: boundary={boundary!r} does not fit the array's {dtype} values: {exc}"
            ) from exc
    if fill != boundary and not (np.isnan(fill) and np.isnan(np.asarray(boundary))):
        raise ValueError(
            f"map_overlap: boundary={boundary!r} is {fill!r} as the array's {dtype} values; "
            "give a value the dtype holds"
        )
    return Halo(before, after, "constant", fill.item())


def _axis(k: Any, ndim: int) -> int:
    axis = int(k)
    if not -ndim <= axis < ndim:
        raise np.exceptions.AxisError(axis, ndim)
    return axis % ndim


def _count(d: Any) -> int:
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (numbers.Integral, np.integer)):
        raise TypeError(f"map_overlap: depth {d!r} is not a whole number of rows")
    if d < 0:
        raise ValueError(f"map_overlap: depth {d} is negative")
    return int(d)


class Overlapped(Chunked):
    """``map_overlap``'s result: the function of ``spec`` (a
    :class:`~tierflow.engine.graph.specs.MapSpec`) on each block of the chunked
    ``sources`` (same rows, known) with ``halo``; cut as the first source is."""

    def __init__(self, spec: Any, sources: tuple[Chunked, ...], halo: Halo) -> None:
        first = sources[0]
        assert first.bounds is not None
        super().__init__(
            sources,
            spec.dtype,
            (first.n_rows, *spec.row_shape),
            graph.Blocks(first.bounds),
        )
        self.spec = spec
        self.halo = halo

    def params(self) -> str:
        return f"{self.spec.params()}|{self.halo.params()}"

    def label(self) -> str:
        return f"map_overlap({self.spec.label()[len('map_blocks(') : -1]}, {self.halo.label()})"

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        return Overlapped(self.spec, tuple(inputs), self.halo)  # type: ignore[arg-type]


class OverlapStep(Step):
    """Rows ``[a, b)`` of an :class:`Overlapped`: the inputs' rows ``[a - before,
    b + after)`` read once, padded at the array's ends, the function called (halved on
    out-of-memory, each piece with its own halo), the halo trimmed."""

    node: Overlapped
    user = True  # the function's errors name it and the block

    def __init__(self, node: Overlapped, inputs: list[Step], op: Any) -> None:
        self.node = node
        self.inputs = inputs
        self.op = op
        self.site = halving.Site(node.ident, node.label())

    def _read(self, a: int, b: int) -> tuple[int, int]:
        n = self.node.n_rows
        assert n is not None
        h = self.node.halo
        return max(0, a - h.before), min(n, b + h.after)

    def _eval(self, ctx: Context, req: Request) -> np.ndarray:
        assert isinstance(req, RowRange)
        a, b = req.start, req.stop
        node, h = self.node, self.node.halo
        if b <= a:
            return np.empty((0, *node.row_shape), node.dtype)
        n = node.n_rows
        assert n is not None
        lo, hi = self._read(a, b)
        blocks = [s.host(ctx, RowRange(lo, hi)) for s in self.inputs]

        def ends(step: Step) -> tuple[Any, Any]:
            """What stands above the first row and below the last: the array's first
            and last rows (read when needed), the other way round when it wraps."""

            def first(count: int) -> np.ndarray:
                return step.host(ctx, RowRange(0, min(count, n)))

            def last(count: int) -> np.ndarray:
                return step.host(ctx, RowRange(n - min(count, n), n))

            return (last, first) if h.boundary == "periodic" else (first, last)

        def run(positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            pa, pb = int(positions[0]), int(positions[-1]) + 1
            ra, rb = max(0, pa - h.before), min(n, pb + h.after)
            missing = (h.before - (pa - ra), h.after - (rb - pb))
            pieces = [
                h.pad(*ends(s), block[ra - lo : rb - lo], missing)
                for s, block in zip(self.inputs, blocks, strict=True)
            ]
            top = h.before if h.boundary != "none" else pa - ra
            core = self.op.apply(*pieces)[top : top + (pb - pa)]
            if out is None:
                return core
            out[...] = core
            return out

        positions = np.arange(a, b, dtype=np.int64)
        return operator_call(
            self,
            ctx,
            req,
            self.op,
            lambda: halving.call(self.site, ctx.describe, run, [positions], None),
        )

    def children(self) -> list[Step]:
        return list(self.inputs)

    def sources(self, req: Request) -> Iterator[tuple[Any, int, int]]:
        if isinstance(req, RowRange) and req.stop > req.start:
            lo, hi = self._read(req.start, req.stop)
            for s in self.inputs:
                yield from s.sources(RowRange(lo, hi))

    def memory(self, rows: int, into_sink: bool) -> TaskMemory:
        node, h = self.node, self.node.halo
        dtype = np.dtype(node.dtype)
        out = 0 if into_sink else block_bytes(rows, node.row_shape, dtype)
        wide = rows + h.before + h.after
        inputs = sum(
            block_bytes(wide, c.row_shape, np.dtype(c.dtype))
            for c in node.inputs
            if isinstance(c, Chunked)
        )
        # the padded copies, the function's result and its scratch
        temps = inputs + block_bytes(wide, node.row_shape, dtype) + int(self.op.temp_bytes(wide))
        return TaskMemory(temps=temps, outputs=out)
