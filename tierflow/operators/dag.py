"""Walks over a graph of nodes: an elementwise expression here, the engine's lazy graph
above (:func:`tierflow.engine.graph.walk`). One order for both, without recursion, so
a graph thousands of operations deep walks as well as a shallow one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["postorder"]

N = TypeVar("N")


def postorder(
    roots: Iterable[N],
    children: Callable[[N], Sequence[N]],
    stop: Callable[[N], bool] | None = None,
) -> list[N]:
    """Every node reachable from ``roots`` through ``children``, each once (by
    identity), children before their parents, depth first from the first root and the
    first child.

    ``stop(node)`` True keeps ``node`` but not what lies below it.

    >>> tree = {"a": ["b", "c"], "b": ["c"], "c": []}
    >>> postorder(["a"], tree.__getitem__)
    ['c', 'b', 'a']
    """
    order: list[N] = []
    seen: set[int] = set()
    stack: list[tuple[N, bool]] = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if stop is not None and stop(node):
            continue
        for child in reversed(children(node)):
            if id(child) not in seen:
                stack.append((child, False))
    return order
