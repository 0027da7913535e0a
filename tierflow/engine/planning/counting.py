"""Counting rows per block: arrays whose row counts are unknown until computed (after a
boolean mask, a ``filter``, ``from_files`` with a varying number of rows per file) take
every operation that needs the row count.

Such an operation (``x[m][::-1]``, ``x[m][-1]``, ``x[m][[3, 0, 7]]``,
``x[m].argmax(0)``, ``np.ones(n) @ x[m]``, ``x[m] + y``) is a *deferred* node
(:class:`~tierflow.engine.graph.nodes.DeferredRows`, :class:`~tierflow.engine.graph.nodes.DeferredValue`):
it holds its inputs and a function that builds it once their rows are known. A compute
that meets one first *counts*, then builds, then plans as usual::

    x[m][::-1].sum(0)

    pass 1: count rows per block (mask greater)     one partial per block: how many
      Reduce(count) <- greater <- x                 rows the mask keeps; the mask's
                                                    expression is fused, x is read once
    then:  Counted(x[m], counts)                    known bounds: any row range
           RowSlice[::-1] -> sum(0)                 the plan of a known array

* **What is counted.** The node that decides the unknown layout: a filter (by its
  mask's true values when the mask is cut as the array is, else by the rows it keeps)
  or a source of files (by the rows it loads), found through each node's
  ``rows_from()`` (a sort's rows are those of its input, reached through its runs).
  Nodes that share an ``origin`` share their counts, so ``x[m]`` and ``y[m]`` are
  counted once.
* **Values of a length known once computed** (``np.unique(x)``, ``np.bincount(x)``,
  ``head`` after a mask: None in their shape) are "counted" by computing them: an
  operation that needs the length (``u[1:]``, ``u * 2``) is a deferred node on the
  value, and the pass computes the value, which is then a constant of the compute.
  Its length is kept on the node and by its key (the last 256), as counts are.
* **When.** Only when a deferred node needs it: a mask computed or reduced without
  such an operation is not counted. Counts are kept on the counted node, so a second
  compute (and ``len``, ``shape``) does not count again.
* **Rounds.** A deferred node above another one (``x[m][5:][m2][::-1]``) waits for the
  one below to be built: each round counts what the deferred nodes it can reach need,
  in one compute (one pass per block layout).
* **After counting** the counted node is wrapped in a
  :class:`~tierflow.engine.graph.nodes.Counted` node (known bounds: its blocks that have
  rows), every node above it is built again on it (each node type knows how:
  ``with_inputs``), and the deferred nodes build themselves (raising NumPy's errors
  now: an index out of range, rows that differ).
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...operators.types import combine_partials
from .. import graph
from ..graph import Chunked, Node, specs
from ..graph.keyed import NOT_KEY
from ..graph.specs import Dtypes, Shapes, Values

__all__ = ["CountRows", "CountSpec", "known_shape", "resolve"]

Partial = list[tuple[int, int]] | None


class CountRows:
    """Rows per block as a reduction: ``"nonzero"`` counts a mask's true values,
    ``"rows"`` a block's rows.

    A partial is ``[(first row, count), ...]``. Over blocks of known ``bounds`` (a
    mask cut as the array is) each count goes to the block holding its first row, so
    pieces of blocks (a plan's cut, an out-of-memory halving) add up. Over blocks of
    unknown size (requested by index, first row 0) partials merge left before right,
    and a piece that starts at row 0 starts the next block.
    """

    row_independent = False
    n_inputs = 1
    sees_empty_blocks = True  # an empty block's count of 0 starts the next block

    def __init__(self, mode: str, bounds: tuple[int, ...] | None, nblocks: int) -> None:
        self.mode = mode
        self.bounds = bounds
        self.nblocks = nblocks
        self.commutative = bounds is not None
        self.out_dtype = np.dtype(np.int64)
        self.out_shape = (nblocks,)

    def __repr__(self) -> str:
        return f"CountRows({self.mode})"

    def chunk(self, *blocks: np.ndarray, row_offset: int = 0) -> Partial:
        block = blocks[0]
        n = int(np.count_nonzero(block)) if self.mode == "nonzero" else len(block)
        return [(row_offset, n)]

    def combine(self, a: Partial, b: Partial) -> Partial:
        return combine_partials(a, b, operator.add)

    def aggregate(self, partial: Partial) -> np.ndarray:
        counts = np.zeros(self.nblocks, np.int64)
        if not partial:
            return counts
        if self.bounds is not None:
            starts = np.array([s for s, _ in partial], np.int64)
            blocks = np.searchsorted(np.asarray(self.bounds), starts, side="right") - 1
            np.add.at(counts, blocks, [n for _, n in partial])
            return counts
        j = -1
        for start, n in partial:
            j += start == 0
            counts[j] += n
        return counts

    def temp_bytes(self, rows: int) -> int:
        return 0

    def partial_bytes(self) -> int:
        return 64


@dataclass(frozen=True)
class CountSpec(specs.ReduceSpec):
    """The spec of a :class:`CountRows` reduction over a node (a mask or the counted
    node itself) cut at ``bounds`` in ``nblocks`` blocks: its blocks are part of the
    key, since counts are per block. ``what`` names the node, for the label."""

    mode: str
    bounds: tuple[int, ...] | None
    nblocks: int
    what: str = field(metadata=NOT_KEY)

    @classmethod
    def over(cls, mode: str, node: Chunked, what: str) -> CountSpec:
        """The spec counting ``node``'s rows per block (``mode`` as :class:`CountRows`)."""
        return cls(mode, node.bounds, node.nblocks, what)

    def build(
        self, dtypes: Dtypes, row_shapes: Shapes, n_rows: int | None, values: Values
    ) -> CountRows:
        return CountRows(self.mode, self.bounds, self.nblocks)

    def label(self) -> str:
        return f"count rows per block ({self.what})"


# -- which nodes decide an unknown layout ------------------------------------------------


def _roots(node: Node) -> list[Node]:
    """The nodes that decide ``node``'s unknown blocks (filters, sources of files), or
    ``node`` itself for a value whose length is known once computed."""
    if isinstance(node, graph.Value):
        return [node] if _unsized(node) else []
    if not isinstance(node, Chunked) or node.bounds is not None:
        return []
    if isinstance(node, (graph.Filter, graph.Source)):
        return [node]
    if isinstance(node, graph.DeferredRows):
        return []
    return [r for i in node.rows_from() for r in _roots(i)]


def _unsized(node: Node) -> bool:
    """Whether ``node`` is a value whose length is known once computed (not one that
    waits for counts: that is built first)."""
    return isinstance(node, graph.Value) and not node.sized and not isinstance(node, graph.Deferred)


def _count_node(root: Chunked) -> graph.Reduce:
    """The cheapest reduction giving ``root``'s rows per block: the mask's true values
    when the mask is cut as the array is, else the rows the node makes."""
    if isinstance(root, graph.Filter) and root.fn is None:
        source, mask = root.inputs
        assert isinstance(source, Chunked) and isinstance(mask, Chunked)
        if mask.partition() == source.partition():
            return graph.Reduce(CountSpec.over("nonzero", mask, f"mask {mask.label()}"), (mask,))
    return graph.Reduce(CountSpec.over("rows", root, root.label()), (root,))


def _has_deferred(node: Node, memo: dict[int, bool]) -> bool:
    found = memo.get(id(node))
    if found is None:
        found = isinstance(node, (graph.DeferredRows, graph.DeferredValue)) or any(
            _has_deferred(i, memo) for i in node.inputs
        )
        memo[id(node)] = found
    return found


# -- rebuilding the graph on counted nodes ------------------------------------------------


def _known(node: Node) -> bool:
    """Whether ``node``'s rows (a value's length) are known."""
    if isinstance(node, Chunked):
        return node.n_rows is not None
    return not isinstance(node, graph.Value) or node.sized


def _build_deferred(node: graph.DeferredRows | graph.DeferredValue, inputs: list[Node]) -> Node:
    """The deferred operation built, once its inputs' rows are known; else itself (on
    ``inputs``)."""
    if all(_known(i) for i in inputs):
        return node.make(inputs)
    if all(a is b for a, b in zip(inputs, node.inputs, strict=True)):
        return node
    return node.with_inputs(inputs)


def _rebuild(node: Node, inputs: list[Node]) -> Node:
    """``node`` built again on ``inputs`` (its inputs, some of them replaced)."""
    if isinstance(node, (graph.DeferredRows, graph.DeferredValue)):
        return _build_deferred(node, inputs)
    if all(a is b for a, b in zip(inputs, node.inputs, strict=True)):
        return node
    made = node.with_inputs(inputs)
    made.cache_mark = node.cache_mark
    made.built_at = node.built_at
    return made


# Counts by origin, for origins made of keys only (a mask's key and the blocks it is cut
# in): an array masked again by an equal mask finds its counts here.
_KNOWN: OrderedDict[Any, tuple[int, ...]] = OrderedDict()
_KNOWN_MAX = 256  # origins remembered, least recently used leave first
_LOCK = threading.Lock()


def _by_content(origin: Any) -> bool:
    """Whether ``origin`` is made of keys and numbers only (no node objects)."""
    if isinstance(origin, tuple):
        return all(_by_content(o) for o in origin)
    return origin is None or isinstance(origin, (str, int))


def _remember(origin: Any, counts: tuple[int, ...]) -> None:
    if _by_content(origin):
        with _LOCK:
            _KNOWN[origin] = counts
            _KNOWN.move_to_end(origin)
            while len(_KNOWN) > _KNOWN_MAX:
                _KNOWN.popitem(last=False)


# Lengths of values computed for them, by key (content keys only): a value built again
# on counted rows, or built again from the same expression, finds its length here.
_LENGTHS: OrderedDict[str, tuple[int, ...]] = OrderedDict()


def _remember_length(value: graph.Value, shape: tuple[int, ...]) -> None:
    """``value``'s shape, found by computing it: on the node, and by its key."""
    value.shape = shape  # known from now on, for this node's later operations too
    key = value.ident
    if not key.startswith("id:"):
        with _LOCK:
            _LENGTHS[key] = shape
            _LENGTHS.move_to_end(key)
            while len(_LENGTHS) > _KNOWN_MAX:
                _LENGTHS.popitem(last=False)


def _learn_length(value: graph.Value) -> None:
    """``value``'s shape, where a value with its key was computed for its length."""
    key = value.ident
    if key.startswith("id:"):
        return
    with _LOCK:
        shape = _LENGTHS.get(key)
    if shape is not None and len(shape) == value.ndim:
        value.shape = shape


def _counts_of(root: Chunked, table: dict[Any, tuple[int, ...]]) -> tuple[int, ...] | None:
    found = root.row_counts if root.row_counts is not None else table.get(root.origin)
    if found is None and _by_content(root.origin):
        with _LOCK:
            found = _KNOWN.get(root.origin)
    if found is None or len(found) != root.nblocks:
        return None
    return found


@dataclass
class _Found:
    """What the passes found: rows per block by origin, and the values that were
    computed for their length (by node id, for this resolve only)."""

    counts: dict[Any, tuple[int, ...]] = field(default_factory=dict)
    # id -> (the node, its value): the node is held, so that its id names no other.
    values: dict[int, tuple[Node, Any]] = field(default_factory=dict)


def _rewrite(roots: list[Node], found: _Found) -> list[Node]:
    """``roots`` with every counted node wrapped in :class:`graph.Counted`, every
    value computed for its length in a :class:`graph.Const`, the nodes above built
    again, and the deferred nodes whose inputs are known built."""
    made: dict[int, Node] = {}
    for node in graph.walk(roots):
        computed = found.values.get(id(node))
        if computed is not None and computed[0] is node:
            made[id(node)] = graph.Const(computed[1])
            continue
        new = _rebuild(node, [made[id(i)] for i in node.inputs])
        if isinstance(new, graph.Value) and _unsized(new):
            _learn_length(new)
        if isinstance(new, (graph.Filter, graph.Source)) and new.bounds is None:
            counts = _counts_of(new, found.counts)
            if counts is not None:
                new.row_counts = counts
                new = graph.Counted(new, counts)
        made[id(node)] = new
    return [made[id(r)] for r in roots]


def _wanted(roots: list[Node], found: _Found, count_roots: bool) -> list[Node]:
    """Nodes to count now: those under deferred nodes that have no deferred node below
    (and under ``roots`` themselves with ``count_roots``); values to compute for their
    length among them."""
    memo: dict[int, bool] = {}
    wanted: dict[int, Node] = {}
    for node in graph.walk(roots):
        deferred = isinstance(node, (graph.DeferredRows, graph.DeferredValue))
        if not deferred and not (count_roots and any(node is r for r in roots)):
            continue
        if any(_has_deferred(i, memo) for i in node.inputs):
            continue
        for i in node.inputs if deferred else [node]:
            for root in _roots(i):
                if not isinstance(root, Chunked) or _counts_of(root, found.counts) is None:
                    wanted[id(root)] = root
    return list(wanted.values())


def _count(wanted: list[Node], found: _Found, count: Callable[[list[Node]], Sequence[Any]]) -> str:
    """One pass: the rows per block of the chunked nodes in ``wanted`` (once per
    origin) and the values among them, computed together; what it ran, in words."""
    first: dict[Any, Chunked] = {}
    values: list[graph.Value] = []
    for root in wanted:
        if isinstance(root, graph.Value):
            values.append(root)
        else:
            assert isinstance(root, Chunked)
            first.setdefault(root.origin, root)
    reductions = [_count_node(root) for root in first.values()]
    results = count([*reductions, *values])
    for (origin, root), result in zip(first.items(), results, strict=False):
        found.counts[origin] = tuple(int(v) for v in np.asarray(result))
        root.row_counts = found.counts[origin]
        _remember(origin, found.counts[origin])
    for root in wanted:
        if isinstance(root, Chunked):
            root.row_counts = found.counts[root.origin]
    for value, result in zip(values, results[len(reductions) :], strict=True):
        _remember_length(value, tuple(np.shape(result)))
        found.values[id(value)] = (value, result)
    names = [str(r.spec.label()) for r in reductions]
    names += [f"compute {v.label()} for its length" for v in values]
    return ", ".join(names)


def resolve(
    roots: list[Node], count: Callable[[list[Node]], Sequence[Any]], count_roots: bool = False
) -> tuple[list[Node], list[str]]:
    """``roots`` with nothing deferred left: the nodes they need counted (by
    ``count(nodes)``, which computes them: reductions that count rows, and values
    whose length is unknown), and the graph built again on the counts (see the
    module docstring); ``count_roots`` counts the roots' own rows too (for ``len``).
    Also the counting passes run, in words, for the plan's description. Raises what
    building a deferred node raises (NumPy's errors), after counting."""
    found = _Found()
    done: list[str] = []
    current = _rewrite(roots, found)
    while True:
        wanted = _wanted(current, found, count_roots)
        if not wanted:
            break
        done.append(f"pass {len(done) + 1}: {_count(wanted, found, count)}")
        current = _rewrite(current, found)
    memo: dict[int, bool] = {}
    if any(_has_deferred(r, memo) for r in current):
        raise RuntimeError("an operation waiting for row counts was left unbuilt")
    for root, built in zip(roots, current, strict=True):
        if _unsized(root) and isinstance(built, graph.Value) and built.sized:
            root.shape = built.shape  # the length ``len()`` found, kept on the array
    return current, done


def known_shape(node: Node) -> tuple[int | None, ...] | None:
    """``node``'s shape where the counts (or lengths) it needs are known, no pass run:
    ``node`` built on them; None otherwise."""
    nodes = graph.walk([node])
    if not any(
        (
            isinstance(n, (graph.Filter, graph.Source))
            and n.bounds is None
            and _counts_of(n, {}) is not None  # () for no blocks at all
        )
        or (isinstance(n, (graph.DeferredRows, graph.DeferredValue)) and all(map(_known, n.inputs)))
        for n in nodes
    ):
        return None
    try:
        (built,) = _rewrite([node], _Found())
    except Exception:  # an error NumPy raises once counted: the compute raises it
        return None
    return None if None in built.shape else built.shape
