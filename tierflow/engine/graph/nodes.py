"""The lazy graph: nodes, their metadata, how their rows map, and their content keys.

Two kinds of node:

* **chunked** nodes are arrays in row blocks along axis 0 (sources, elementwise
  expressions, block maps, row slices, filters, concatenations). Their ``bounds`` are
  the block boundaries ``(0, r1, r2, ..., n)``. When every row count is known the node
  is *flexible*: any row range ``[a, b)`` can be computed by itself, since every
  operator between it and its sources maps rows to rows. After a boolean mask (or
  ``from_files`` with a varying number of rows per file) the row counts are unknown
  until computed; such a node has ``bounds`` None, ``nblocks`` blocks and an
  ``origin``: nodes that share an origin have equal block sizes, so they can be combined
  row by row.
* **value** nodes are small results held whole in memory once computed: reductions,
  constants, and NumPy functions applied to other values. A value used by a chunked
  expression is a broadcast constant there, computed before the expression runs.

Every node has a deterministic :attr:`Node.key` (see :mod:`tierflow.storage.identity`): a
digest of its type, its parameters and its inputs' keys, and for sources of the file's
identity. Keys are computed on first use and remembered.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar

import numpy as np

from ...operators import elementwise as ew
from ...operators import selection
from ...operators.dag import postorder
from ...storage import identity
from . import blocksize, callsites, portable
from .keyed import Keyed

__all__ = [
    "Apply",
    "BlockMap",
    "Blocks",
    "Chunked",
    "Concat",
    "Const",
    "Counted",
    "Deferred",
    "DeferredRows",
    "DeferredValue",
    "ElemOp",
    "Elementwise",
    "Filter",
    "Node",
    "Reduce",
    "RowSlice",
    "RowTake",
    "Source",
    "Value",
    "placeholder",
    "quiet",
    "substitute",
    "walk",
]


class Node:
    """Base of graph nodes: ``inputs``, ``dtype``, ``shape`` (None for an unknown row
    count), and a lazily computed ``key``."""

    kind: ClassVar[str] = "node"
    built_at: callsites.CallSite | None = None

    def __init__(self, inputs: Iterable[Node], dtype: Any, shape: tuple[int | None, ...]) -> None:
        # The line of user code that built this node: what its warnings and errors name.
        self.built_at = callsites.here()
        self.inputs: tuple[Node, ...] = tuple(inputs)
        self.dtype = np.dtype(dtype) if dtype is not None else None
        self.shape = tuple(shape)
        self._key: str | None = None
        self._ident: str | None = None
        # Set by ``Array.cache()``: True (the compute's cache store) or a store to keep
        # this node's blocks in (see tierflow.engine.io.cache); None when not marked.
        self.cache_mark: Any = None

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def key(self) -> str:
        """A 32-digit hex digest of what this node computes (stable across runs)."""
        if self._key is None:
            parts = [type(self).__name__, self.params(), *(i.key for i in self.inputs)]
            self._key = identity.digest("|".join(parts))
        return self._key

    @property
    def ident(self) -> str:
        """What a compute tells nodes apart by: the key, unless computing it would mean
        hashing a big in-memory array (then this object's identity; see :attr:`key`)."""
        found = self._ident
        if found is None:
            costly = self._costly() or any(i.ident.startswith("id:") for i in self.inputs)
            found = self._ident = f"id:{id(self)}" if costly else self.key
        return found

    def _costly(self) -> bool:
        """Whether this node's own parameters are expensive to key."""
        return False

    def __getstate__(self) -> dict[str, Any]:
        # ``ident`` may be made of id(self), which names an object of this process only;
        # the key is a content digest and travels (see tierflow.engine.graph.portable).
        state = self.__dict__.copy()
        state["_ident"] = None
        return state

    def params(self) -> str:
        """The canonical text of this node's parameters (inputs excluded)."""
        return ""

    def label(self) -> str:
        """A short name of the operation, for ``repr`` and ``visualize``."""
        return type(self).__name__.lower()

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        """This operation built again on ``inputs`` (one for each of :attr:`inputs`, in
        order; some replaced, as counting does, :mod:`tierflow.engine.planning.counting`). Every
        node type that has inputs says how; a new one that does not is refused here,
        not rebuilt wrongly."""
        raise TypeError(f"cannot build {self!r} again on other inputs")

    def __repr__(self) -> str:
        return f"<{self.label()} {self.shape} {self.dtype}>"


@dataclass(frozen=True, eq=False)
class Blocks:
    """How a chunked node's rows fall into blocks.

    ``bounds``: the first row of every block, then the row count, when the sizes are
    known. Otherwise ``count`` blocks whose sizes are known only once computed, cut as
    ``origin`` cuts them (nodes of the same origin have the same blocks).
    """

    bounds: tuple[int, ...] | None
    count: int = 0
    origin: Any = None


class Chunked(Node):
    """A node computed in row blocks (see the module docstring)."""

    kind = "chunked"

    def __init__(
        self, inputs: Iterable[Node], dtype: Any, shape: tuple[int | None, ...], blocks: Blocks
    ) -> None:
        super().__init__(inputs, dtype, shape)
        self.bounds = blocks.bounds
        self.nblocks = len(self.bounds) - 1 if self.bounds is not None else blocks.count
        self.origin = blocks.origin
        # Rows of each block once counted (:mod:`tierflow.engine.planning.counting`), on the node
        # that decides an unknown layout (a filter, a source of files); None until then.
        self.row_counts: tuple[int, ...] | None = None

    def layout(self) -> Blocks:
        """This node's blocks, for a node cut as this one is (elementwise, a block map)."""
        return Blocks(self.bounds, self.nblocks, self.origin)

    def rows_from(self) -> tuple[Node, ...]:
        """The nodes whose row counts decide this node's while they are unknown: its
        chunked inputs, unless it reaches them through a value (an external sort's
        runs)."""
        return tuple(i for i in self.inputs if isinstance(i, Chunked))

    @property
    def n_rows(self) -> int | None:
        """Rows of the array, None while unknown."""
        return self.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row."""
        return tuple(self.shape[1:])  # type: ignore[arg-type]

    @property
    def flexible(self) -> bool:
        """Whether any row range can be computed by itself (all row counts known)."""
        return self.bounds is not None

    def partition(self) -> tuple[Any, ...]:
        """What decides the blocks: equal partitions compute in the same tasks."""
        if self.bounds is not None:
            return ("rows", self.bounds)
        return ("blocks", self.origin, self.nblocks)

    def block_pairs(self) -> list[tuple[int, int]]:
        """``[(start, stop), ...]`` of the blocks (known row counts only)."""
        assert self.bounds is not None
        return list(zip(self.bounds[:-1], self.bounds[1:], strict=False))


class Value(Node):
    """A node whose whole value is held in memory once computed."""

    kind = "value"
    meta_known = True

    @property
    def sized(self) -> bool:
        """Whether the length of every axis is known. A value whose length depends on
        the data (``np.unique`` or ``np.bincount`` of a lazy array, ``head`` after a
        mask) has None there until it is computed (:mod:`tierflow.engine.planning.counting`)."""
        return None not in self.shape


def placeholder(node: Node) -> Any:
    """A zero value with ``node``'s dtype and shape (unknown rows count as 1), standing
    in for the value while dtypes and shapes are worked out. None for a value without a
    dtype (the runs of an external sort, :mod:`tierflow.engine.rowwide.external_sort`)."""
    if node.dtype is None:
        return None
    shape = tuple(1 if n is None else n for n in node.shape)
    if not shape:
        return node.dtype.type(0)
    return np.zeros(shape, node.dtype)


def walk(roots: Iterable[Node], stop: Callable[[Node], bool] | None = None) -> list[Node]:
    """Every node reachable from ``roots``, inputs before the nodes that use them.

    ``stop(node)`` True keeps ``node`` but not what lies below it (a value already
    known, such as one read from the cache)."""
    return postorder(roots, _inputs, stop)


def _inputs(node: Node) -> Sequence[Node]:
    return node.inputs


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Warnings and floating-point errors silenced while zeros stand in for values."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        yield


# -- chunked nodes ----------------------------------------------------------------------


class Source(Chunked):
    """Rows of a reader (:mod:`tierflow.engine.io.readers`)."""

    def __init__(
        self, reader: Any, bounds: tuple[int, ...] | None, *, key: str | None = None
    ) -> None:
        n_rows = reader.n_rows
        nblocks = getattr(reader, "nblocks", None)
        super().__init__(
            (),
            reader.dtype,
            (n_rows, *reader.row_shape),
            Blocks(bounds, int(nblocks or 0), None if bounds is not None else ("source", self)),
        )
        self.reader = reader
        if key is not None:
            self._key = key

    def _costly(self) -> bool:
        return self._key is None and bool(getattr(self.reader, "costly_token", lambda: False)())

    def params(self) -> str:
        # The blocks are not part of the key: they change how rows are computed, not
        # which rows (a cache keyed by content must not miss on a different rows=).
        return str(self.reader.token())

    def label(self) -> str:
        return str(self.reader.label)


@dataclass(frozen=True, eq=False)
class ElemOp(Keyed):
    """One elementwise operation: a ufunc call, ``where``, ``clip``, ``astype`` or ``round``.

    ``ufunc`` and its ``kwargs`` for a call, ``dtype`` for ``astype``, ``decimals`` for
    ``round``; ``has_lo`` and ``has_hi`` say which bounds a ``clip`` was given. Its key
    is its fields' (:class:`~tierflow.engine.graph.keyed.Keyed`).
    """

    kind: str
    _: KW_ONLY
    ufunc: np.ufunc | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: np.dtype | None = None
    decimals: int = 0
    has_lo: bool = True
    has_hi: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        object.__setattr__(self, "dtype", None if self.dtype is None else np.dtype(self.dtype))
        object.__setattr__(self, "decimals", int(self.decimals))

    def label(self) -> str:
        if self.kind == "ufunc":
            assert self.ufunc is not None
            return self.ufunc.__name__
        if self.kind == "astype":
            return f"astype({self.dtype})"
        if self.kind == "round":
            return f"round({self.decimals})"
        return self.kind

    def _clip_args(self, args: Sequence[Any]) -> tuple[Any, Any, Any]:
        """``(a, lo, hi)`` of a clip, whose operands hold only the bounds it was given."""
        items = iter(args)
        a = next(items)
        lo = next(items) if self.has_lo else None
        hi = next(items) if self.has_hi else None
        return a, lo, hi

    def expr(self, args: list[Any]) -> ew.Expr:
        """The operators layer's expression node over ``args`` (nodes or constants)."""
        if self.kind == "ufunc":
            assert self.ufunc is not None
            return ew.call(self.ufunc, *args, **self.kwargs)
        if self.kind == "where":
            return ew.where(*args)
        if self.kind == "clip":
            return ew.clip(*self._clip_args(args))
        if self.kind == "astype":
            return ew.astype(args[0], self.dtype)
        if self.kind == "round":
            return ew.round_(args[0], self.decimals)
        raise ValueError(f"unknown elementwise operation {self.kind!r}")

    def apply(self, *values: Any) -> Any:
        """NumPy's result on in-memory values."""
        if self.kind == "ufunc":
            assert self.ufunc is not None
            return self.ufunc(*values, **self.kwargs)
        if self.kind == "where":
            return np.where(*values)
        if self.kind == "clip":
            return np.clip(*self._clip_args(values))
        if self.kind == "astype":
            return np.asarray(values[0]).astype(self.dtype)
        if self.kind == "round":
            return np.round(values[0], self.decimals)
        raise ValueError(f"unknown elementwise operation {self.kind!r}")


def _swapped(operands: Sequence[Any], old: Sequence[Node], new: Sequence[Node]) -> list[Any]:
    """``operands`` with each node of ``old`` replaced by the node of ``new`` at its place."""
    table = dict(zip(map(id, old), new, strict=True))
    return [table.get(id(o), o) if isinstance(o, Node) else o for o in operands]


class Elementwise(Chunked):
    """An elementwise operation on row-aligned chunked operands, values and scalars.

    ``operands`` hold chunked nodes (all with the same rows), value nodes (broadcast
    constants) and Python or NumPy scalars, in the operation's argument order.
    """

    def __init__(self, op: ElemOp, operands: tuple[Any, ...]) -> None:
        chunked = [o for o in operands if isinstance(o, Chunked)]
        if not chunked:
            raise ValueError("an elementwise node needs a chunked operand")
        first = chunked[0]
        leaves: dict[int, int] = {}
        args: list[Any] = []
        for o in operands:
            if isinstance(o, Chunked):
                args.append(ew.Input(leaves.setdefault(id(o), len(leaves))))
            elif isinstance(o, Node):
                args.append(ew.Const(placeholder(o)))
            else:
                args.append(o)
        unique = list({id(o): o for o in chunked}.values())
        with quiet():
            inferred = ew.infer(
                op.expr(args), [c.dtype for c in unique], [c.row_shape for c in unique]
            )
        inputs = list({id(o): o for o in operands if isinstance(o, Node)}.values())
        super().__init__(
            inputs,
            inferred.dtype,
            (first.n_rows, *inferred.row_shape),
            first.layout(),
        )
        self.op = op
        self.operands = operands

    def params(self) -> str:
        # Operand positions matter (x - y is not y - x): scalars inline, nodes by position.
        slots = [
            f"in{next(i for i, n in enumerate(self.inputs) if n is o)}"
            if isinstance(o, Node)
            else identity.token(o)
            for o in self.operands
        ]
        return self.op.params() + "|" + ",".join(slots)

    def label(self) -> str:
        return self.op.label()

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        return Elementwise(self.op, tuple(_swapped(self.operands, self.inputs, inputs)))


class BlockMap(Chunked):
    """A row-independent block operator built by ``spec`` (see :mod:`tierflow.engine.graph.specs`)
    on row-aligned chunked inputs, with value nodes as parameters.

    Its blocks are its first input's, cut where its output rows are wider than its
    inputs' (:func:`tierflow.engine.graph.blocksize.output_bounds`): the inputs are then
    read by row ranges of the smaller blocks."""

    def __init__(
        self, spec: Any, chunked: tuple[Chunked, ...], values: tuple[Value, ...] = ()
    ) -> None:
        first = chunked[0]
        op = spec.build(
            [c.dtype for c in chunked],
            [c.row_shape for c in chunked],
            [placeholder(v) for v in values],
        )
        bounds = first.bounds
        if bounds is not None:
            in_row = sum(np.dtype(c.dtype).itemsize * math.prod(c.row_shape) for c in chunked)
            out_row = np.dtype(op.out_dtype).itemsize * math.prod(op.out_row_shape)
            bounds = blocksize.output_bounds(bounds, in_row, out_row)
        super().__init__(
            (*chunked, *values),
            op.out_dtype,
            (first.n_rows, *op.out_row_shape),
            Blocks(bounds, first.nblocks, first.origin),
        )
        self.spec = spec
        self.n_chunked = len(chunked)

    def params(self) -> str:
        return str(self.spec.params())

    def label(self) -> str:
        return str(self.spec.label())

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        n = self.n_chunked
        return BlockMap(self.spec, tuple(inputs[:n]), tuple(inputs[n:]))  # type: ignore[arg-type]


def _slice_bounds(key: slice, pairs: list[tuple[int, int]]) -> tuple[int, ...]:
    pieces = selection.plan_slice(key, pairs)
    bounds = [0]
    for piece in pieces:
        bounds.append(piece.out_stop)
    return tuple(bounds)


class RowSlice(Chunked):
    """``x[start:stop:step]`` on the rows of an array with a known row count.

    Output blocks follow the input's: each comes from one input block.
    """

    def __init__(self, source: Chunked, key: slice) -> None:
        assert source.n_rows is not None
        first, last, step = key.indices(source.n_rows)
        n = len(range(first, last, step))
        super().__init__(
            (source,),
            source.dtype,
            (n, *source.row_shape),
            Blocks(_slice_bounds(key, source.block_pairs())),
        )
        self.first, self.step = first, step
        self.key_slice = key

    def input_rows(self, a: int, b: int) -> tuple[int, int, slice]:
        """Input rows ``[lo, hi)`` holding output rows ``a:b``, and the slice to take."""
        if b <= a:
            return 0, 0, slice(0, 0)
        first, step = self.first, self.step
        if step > 0:
            return first + a * step, first + (b - 1) * step + 1, slice(None, None, step)
        return first + (b - 1) * step, first + a * step + 1, slice(None, None, step)

    def params(self) -> str:
        return f"{self.first},{self.step},{self.shape[0]}"

    def label(self) -> str:
        stop = self.first + self.step * (self.shape[0] or 0)
        return f"rows[{self.first}:{stop}:{self.step}]"

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        return RowSlice(inputs[0], self.key_slice)  # type: ignore[arg-type]


class RowTake(Chunked):
    """``x[positions]``: rows of an array with a known row count, by position.

    Sorted positions (repeats allowed, ``ordered``): output blocks follow the input's,
    each holding the rows picked from one input block; input blocks nothing is picked
    from have no output block. Positions in any other order are only taken from a
    source whose rows are read as views (a file's memory map, an array in memory):
    output blocks then have ``rows`` rows each, and each picks from anywhere.
    """

    def __init__(self, source: Chunked, positions: np.ndarray, rows: int = 0) -> None:
        assert source.n_rows is not None and source.bounds is not None
        self.ordered = bool(np.all(positions[1:] >= positions[:-1]))
        if self.ordered:
            counts = np.diff(np.searchsorted(positions, np.asarray(source.bounds), side="left"))
            bounds = (0, *np.cumsum(counts[counts > 0]).tolist())
        else:
            assert rows > 0, "positions out of order need the rows of an output block"
            bounds = (*range(0, len(positions), rows), len(positions))
        super().__init__(
            (source,), source.dtype, (len(positions), *source.row_shape), Blocks(bounds)
        )
        self.positions = positions
        self.rows = rows

    def input_rows(self, a: int, b: int) -> tuple[int, int, np.ndarray]:
        """Input rows ``[lo, hi)`` holding output rows ``a:b``, and the rows to take from
        them (relative to ``lo``)."""
        picked = self.positions[a:b]
        if not len(picked):
            return 0, 0, picked
        lo, hi = (picked[0], picked[-1]) if self.ordered else (picked.min(), picked.max())
        return int(lo), int(hi) + 1, picked - lo

    def params(self) -> str:
        return identity.array_digest(self.positions)

    def label(self) -> str:
        return f"rows[{len(self.positions):,} picked]"

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        return RowTake(inputs[0], self.positions, self.rows)  # type: ignore[arg-type]


def _same_rows(mask: Chunked | None, node: Chunked) -> Any:
    """What tells a filter's rows apart: the mask's key (a mask built twice from the same
    expression selects the same rows), or the mask (or the filter) itself where the key
    is not taken (a mask over a big in-memory array, see :attr:`Node.ident`)."""
    if mask is None:
        return node
    ident = mask.ident
    return mask if ident.startswith("id:") else ident


class Filter(Chunked):
    """Rows (or elements) of ``source`` where ``mask`` is True, or where ``fn(block)`` is.

    A mask over the first ``k`` axes selects elements: the output's rows have shape
    ``source.shape[k:]``. Row counts are unknown until computed.
    """

    def __init__(
        self, source: Chunked, mask: Chunked | None = None, fn: Callable[..., Any] | None = None
    ) -> None:
        k = 1 if mask is None else max(1, mask.ndim)
        inputs = (source,) if mask is None else (source, mask)
        super().__init__(
            inputs,
            source.dtype,
            (None, *source.shape[k:]),
            Blocks(None, source.nblocks, ("filter", _same_rows(mask, self), source.partition())),
        )
        self.fn = fn
        self.mask_ndim = k

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["fn"] = portable.by_value(self.fn)
        return state

    def params(self) -> str:
        return identity.token(self.fn) if self.fn is not None else "mask"

    def label(self) -> str:
        if self.fn is not None:
            return f"filter({getattr(self.fn, '__qualname__', 'fn')})"
        return "mask"

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        mask = inputs[1] if len(inputs) > 1 else None
        return Filter(inputs[0], mask, self.fn)  # type: ignore[arg-type]


class Concat(Chunked):
    """``np.concatenate(inputs, axis=0)``: the inputs' blocks, one after the other."""

    def __init__(self, inputs: tuple[Chunked, ...]) -> None:
        dtype, row_shape = selection.concat_result(
            [i.dtype for i in inputs], [i.row_shape for i in inputs]
        )
        known = all(i.bounds is not None for i in inputs)
        if known:
            bounds = [0]
            for i in inputs:
                assert i.bounds is not None
                start = bounds[-1]
                bounds.extend(start + b for b in i.bounds[1:])
            total: int | None = bounds[-1]
            super().__init__(inputs, dtype, (total, *row_shape), Blocks(tuple(bounds)))
        else:
            super().__init__(
                inputs,
                dtype,
                (None, *row_shape),
                Blocks(None, sum(i.nblocks for i in inputs), ("concat", self)),
            )
        # (input, first block of it in the output)
        self.block_table: list[tuple[int, int]] = [
            (k, j) for k, i in enumerate(inputs) for j in range(i.nblocks)
        ]
        self.starts: list[int] = []
        if known:
            offset = 0
            for i in inputs:
                self.starts.append(offset)
                offset += i.n_rows or 0

    def pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(input, lo, hi)``: output rows ``a:b`` as row ranges of the inputs."""
        out = []
        for k, (start, node) in enumerate(zip(self.starts, self.inputs, strict=False)):
            n = node.shape[0] or 0
            lo, hi = max(a, start), min(b, start + n)
            if hi > lo:
                out.append((k, lo - start, hi - start))
        return out

    def label(self) -> str:
        return "concatenate"

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        return Concat(tuple(inputs))  # type: ignore[arg-type]


class Counted(Chunked):
    """An array of unknown row counts whose blocks were counted: the same rows as
    ``source``, with known bounds, so any row range can be computed (see
    :mod:`tierflow.engine.planning.counting`).

    Its blocks are ``source``'s blocks that have rows (``index`` names them); rows
    ``[a, b)`` are read from the blocks that hold them, each computed whole and cut.
    """

    def __init__(self, source: Chunked, counts: Sequence[int]) -> None:
        sizes = np.asarray(counts, dtype=np.int64)
        if len(sizes) != source.nblocks:
            raise ValueError(f"{len(sizes)} counts for {source.nblocks} blocks")
        index = np.flatnonzero(sizes)
        bounds = (0, *np.cumsum(sizes[index]).tolist())
        super().__init__(
            (source,), source.dtype, (bounds[-1], *source.row_shape), Blocks(tuple(bounds))
        )
        self.counts = tuple(int(c) for c in sizes)
        self.index = tuple(int(j) for j in index)

    def pieces(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """``(block, lo, hi)``: rows ``a:b`` as rows ``lo:hi`` of blocks of ``source``."""
        assert self.bounds is not None
        bounds = self.bounds
        first = int(np.searchsorted(bounds, a, side="right")) - 1
        out = []
        for k in range(max(first, 0), len(self.index)):
            start, stop = bounds[k], bounds[k + 1]
            if start >= b:
                break
            lo, hi = max(a, start), min(b, stop)
            if hi > lo:
                out.append((self.index[k], lo - start, hi - start))
        return out

    def params(self) -> str:
        return identity.token(self.counts)

    def label(self) -> str:
        return "counted rows"

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        if isinstance(inputs[0], Counted):
            return inputs[0]  # its input was counted again, with the same counts
        return Counted(inputs[0], self.counts)  # type: ignore[arg-type]


class _Deferred:
    """What the two deferred nodes share: ``make`` travels by value, and ``what`` and
    the token name the operation."""

    make: Callable[[list[Node]], Node]
    what: str
    token: str

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state["make"] = portable.by_value(self.make)
        return state

    def params(self) -> str:
        return self.token

    def label(self) -> str:
        return self.what


class DeferredRows(_Deferred, Chunked):
    """An operation that needs the row count of an input whose rows are unknown until
    computed (``x[m][::-1]``, ``x[m][[3, 0]]``, ``x[m] + y``): ``make(inputs)`` builds it
    once the inputs' rows are counted (inputs of known rows in place of the unknown
    ones). Its own rows are unknown until then. A compute counts first and builds it
    (:mod:`tierflow.engine.planning.counting`); it is never lowered itself.
    """

    def __init__(
        self,
        inputs: Sequence[Node],
        make: Callable[[list[Node]], Node],
        meta: tuple[Any, tuple[int, ...]],
        what: str,
        token: Any = None,
    ) -> None:
        dtype, row_shape = meta
        first = next(i for i in inputs if isinstance(i, Chunked))
        super().__init__(
            inputs, dtype, (None, *row_shape), Blocks(None, first.nblocks, ("deferred", self))
        )
        self.make = make
        self.what = what
        self.raw_token = token
        self.token = identity.token((what, token))
        # The same operation built twice (the same key) has the same rows.
        ident = self.ident
        self.origin = ("deferred", self if ident.startswith("id:") else ident)

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        meta = (self.dtype, self.row_shape)
        return DeferredRows(inputs, self.make, meta, self.what, self.raw_token)


class DeferredValue(_Deferred, Value):
    """A value (``x[m][-1]``, ``x[m].argmax(0)``, ``w @ x[m]``) that needs the row count
    of an input whose rows are unknown until computed: as :class:`DeferredRows`, with
    the value's dtype and shape known now."""

    def __init__(
        self,
        inputs: Sequence[Node],
        make: Callable[[list[Node]], Node],
        meta: tuple[Any, tuple[int | None, ...]],
        what: str,
        token: Any = None,
    ) -> None:
        dtype, shape = meta
        super().__init__(inputs, dtype, shape)
        self.make = make
        self.what = what
        self.raw_token = token
        self.token = identity.token((what, token))

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        made = DeferredValue(inputs, self.make, (self.dtype, self.shape), self.what, self.raw_token)
        made.meta_known = self.meta_known
        return made


Deferred = DeferredRows | DeferredValue


# -- value nodes ------------------------------------------------------------------------


class Const(Value):
    """An in-memory array or NumPy scalar."""

    def __init__(self, value: Any) -> None:
        array = np.asarray(value)
        super().__init__((), array.dtype, array.shape)
        self.value = value

    def params(self) -> str:
        return identity.token(self.value)

    def label(self) -> str:
        return f"constant {self.shape} {self.dtype}"


class Reduce(Value):
    """A reduction over the rows of chunked inputs (built by ``spec``), with value
    nodes as parameters."""

    def __init__(
        self, spec: Any, chunked: tuple[Chunked, ...], values: tuple[Value, ...] = ()
    ) -> None:
        op = spec.build(
            [c.dtype for c in chunked],
            [c.row_shape for c in chunked],
            chunked[0].n_rows,
            [placeholder(v) for v in values],
        )
        dtype, shape = spec.meta(op, chunked[0])
        super().__init__((*chunked, *values), dtype, shape if shape is not None else ())
        self.meta_known = dtype is not None and shape is not None
        self.spec = spec
        self.n_chunked = len(chunked)
        # What the spec keeps for the length of one compute (an external sort's run
        # files), opened and closed by the plan; a value that refers to it is not cached.
        self.scratch = getattr(spec, "scratch", None)
        self.cacheable = self.scratch is None

    def params(self) -> str:
        return str(self.spec.params())

    def label(self) -> str:
        return str(self.spec.label())

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        n = self.n_chunked
        return Reduce(self.spec, tuple(inputs[:n]), tuple(inputs[n:]))  # type: ignore[arg-type]


def _nodes_in(value: Any) -> Iterator[Node]:
    if isinstance(value, Node):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _nodes_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _nodes_in(v)


def substitute(value: Any, lookup: Callable[[Node], Any]) -> Any:
    """``value`` with every node in it (also inside tuples, lists, dicts) replaced."""
    if isinstance(value, Node):
        return lookup(value)
    if isinstance(value, tuple):
        return tuple(substitute(v, lookup) for v in value)
    if isinstance(value, list):
        return [substitute(v, lookup) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, lookup) for k, v in value.items()}
    return value


class Apply(Value):
    """``fn(*args, **kwargs)`` on in-memory values; nodes in ``args`` are replaced by
    their values. Dtype and shape come from ``fn`` on zero placeholders; ``shape``,
    where given, is the shape instead (None for a length known once computed)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        name: str | None = None,
        shape: tuple[int | None, ...] | None = None,
    ) -> None:
        kwargs = dict(kwargs or {})
        inputs = list({id(n): n for n in _nodes_in((args, kwargs))}.values())
        for node in inputs:
            if isinstance(node, Chunked):
                raise TypeError("Apply takes value nodes; collect chunked ones first")
            if isinstance(node, Value) and not node.meta_known:
                raise TypeError(
                    f"the result of {node.label()} has no declared dtype and shape, so it "
                    "cannot be used in further operations; give dtype= and shape= to "
                    "x.reduction(...), or compute() it first"
                )
        with quiet():
            probe = np.asarray(
                fn(*substitute(args, placeholder), **substitute(kwargs, placeholder))
            )
        super().__init__(inputs, probe.dtype, probe.shape if shape is None else shape)
        self.given_shape = shape
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.name = name or getattr(fn, "__name__", "apply")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["fn"] = portable.by_value(self.fn)
        return state

    def evaluate(self, values: Callable[[Node], Any]) -> Any:
        """The result, given the values of the input nodes."""
        return self.fn(*substitute(self.args, values), **substitute(self.kwargs, values))

    def params(self) -> str:
        slots = substitute((self.args, self.kwargs), lambda n: f"in{self.inputs.index(n)}")
        return identity.token(self.fn) + "|" + identity.token(slots)

    def label(self) -> str:
        return str(self.name)

    def with_inputs(self, inputs: Sequence[Node]) -> Node:
        new = dict(zip(map(id, self.inputs), inputs, strict=True))

        def swap(node: Node) -> Node:
            return new.get(id(node), node)

        args, kwargs = substitute(self.args, swap), substitute(self.kwargs, swap)
        return Apply(self.fn, args, kwargs, name=self.name, shape=self.given_shape)
