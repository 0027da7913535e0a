"""The one depth-first walk of the package: expressions and the lazy graph use it."""

from __future__ import annotations

import numpy as np

from tierflow.operators import elementwise as ew
from tierflow.operators.dag import postorder


class _Node:
    def __init__(self, name: str, *children: _Node) -> None:
        self.name = name
        self.children = children

    def __repr__(self) -> str:
        return self.name


def _names(nodes: list[_Node]) -> list[str]:
    return [n.name for n in nodes]


def test_children_come_before_their_parents_and_a_shared_node_once() -> None:
    shared = _Node("s")
    left, right = _Node("l", shared), _Node("r", shared, _Node("x"))
    top = _Node("t", left, right)
    assert _names(postorder([top], lambda n: n.children)) == ["s", "l", "x", "r", "t"]


def test_roots_are_walked_in_order_and_stop_keeps_a_node_without_what_is_below() -> None:
    a, b = _Node("a"), _Node("b")
    c = _Node("c", a)
    d = _Node("d", b)
    walked = postorder([d, c], lambda n: n.children, stop=lambda n: n.name == "c")
    assert _names(walked) == ["b", "d", "c"]


def test_a_graph_deeper_than_pythons_recursion_limit_walks() -> None:
    node = _Node("0")
    for i in range(1, 5000):
        node = _Node(str(i), node)
    walked = postorder([node], lambda n: n.children)
    assert _names(walked) == [str(i) for i in range(5000)]


def test_an_expression_walks_by_its_operands() -> None:
    x = ew.Input(0)
    y = x * 2.0
    expr = ew.call(np.add, y, y)
    walked = ew.walk(expr)
    assert walked[-1] is expr
    assert sum(n is y for n in walked) == 1
    assert walked.index(x) < walked.index(y)
