"""The lazy graph and what its nodes hold: the bottom of the engine.

* :mod:`.nodes`: the node classes, their metadata, row maps and content keys (this
  package's names are those of :mod:`.nodes`: ``graph.Source``, ``graph.walk``);
* :mod:`.specs`: what a node stores to build its operator later, as frozen dataclasses
  whose key is their fields (:mod:`.keyed`, the one rule for every part of a key);
* :mod:`.block_operators`: the block operators the engine adds to
  :mod:`tierflow.operators` (user functions, reshapes, stacking...), built from specs;
* :mod:`.blocksize`: how many rows a block gets; :mod:`.portable`: how a graph crosses a
  process boundary; :mod:`.callsites`: the user's line that built a node;
* :mod:`.rewrites`: rewrites of a graph (picks of rows moved down to the sources).

Imports: only :mod:`tierflow.engine.gpu` and the layers below the engine. Everything
else in the engine may import it.
"""

from .nodes import (
    Apply,
    BlockMap,
    Blocks,
    Chunked,
    Concat,
    Const,
    Counted,
    Deferred,
    DeferredRows,
    DeferredValue,
    Elementwise,
    ElemOp,
    Filter,
    Node,
    Reduce,
    RowSlice,
    RowTake,
    Source,
    Value,
    placeholder,
    quiet,
    substitute,
    walk,
)

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
