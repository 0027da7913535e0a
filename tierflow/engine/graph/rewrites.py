"""Rewrites of a graph that give the same rows by a cheaper road.

:func:`take_below`: ``x[positions]`` with the picks of rows moved below every operation
that works row by row, down to the sources, where a memory-mapped file or an in-memory
array is picked from in any order, block by block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import nodes as graph
from .nodes import Chunked

__all__ = ["take_below"]


def take_below(
    node: Chunked, positions: np.ndarray, rows: int, made: dict[tuple[int, int], Chunked]
) -> Chunked | None:
    """``node[positions]`` with the picks moved below every operation to the sources:
    picking rows commutes with operations that work row by row (elementwise, trailing
    selections and reductions, ``@``, row slices). A source whose rows are views (a
    memory-mapped file, an array in memory) is then picked from in any order, block by
    block. None where something else lies on the way (``map_blocks``, a mask, a
    concatenation, files loaded by ``from_files``). ``made`` shares what was built for
    a node reached twice."""
    found = made.get((id(node), id(positions)))
    if found is not None:
        return found
    out: Chunked | None = None
    if isinstance(node, graph.Source):
        if node.reader.picks_rows:
            out = graph.RowTake(node, positions, rows)
    elif isinstance(node, graph.RowSlice):
        out = take_below(node.inputs[0], node.first + positions * node.step, rows, made)  # type: ignore[arg-type]
    elif isinstance(node, graph.Elementwise):
        operands: list[Any] = []
        for o in node.operands:
            moved = take_below(o, positions, rows, made) if isinstance(o, Chunked) else o
            if moved is None:
                return None
            operands.append(moved)
        out = graph.Elementwise(node.op, tuple(operands))
    elif isinstance(node, graph.BlockMap) and not node.spec.user:
        chunked = []
        for c in node.inputs[: node.n_chunked]:
            moved = take_below(c, positions, rows, made)  # type: ignore[arg-type]
            if moved is None:
                return None
            chunked.append(moved)
        values = tuple(node.inputs[node.n_chunked :])
        out = graph.BlockMap(node.spec, tuple(chunked), values)  # type: ignore[arg-type]
    if out is not None:
        made[(id(node), id(positions))] = out
    return out
