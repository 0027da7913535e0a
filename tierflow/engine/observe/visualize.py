"""Drawing the graph of an array: graphviz when it is installed, text otherwise.

Each node shows its operation, shape, dtype and the first digits of its key; sources
show their files. The text drawing lists nodes inputs first, with the inputs of each:

    n0  from_npy('x.npy')   (1000000, 8) float32   3f2a9c01
    n1  multiply            (1000000, 8) float32   77b0e412  <- n0
"""

from __future__ import annotations

import os
from typing import Any

from .. import graph
from ..graph import Node

__all__ = ["TextGraph", "visualize"]


def _shape(node: Node) -> str:
    return (
        "("
        + ", ".join("?" if n is None else str(n) for n in node.shape)
        + ("," if node.ndim == 1 else "")
        + ")"
    )


class TextGraph(str):
    """The graph as text; shows as preformatted text in notebooks."""

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(str(self))}</pre>"

    def __repr__(self) -> str:
        return str(self)


def text(node: Node) -> TextGraph:
    """The text drawing of the graph under ``node``."""
    order = graph.walk([node])
    names = {id(n): f"n{k}" for k, n in enumerate(order)}
    rows = []
    for n in order:
        inputs = ", ".join(names[id(i)] for i in n.inputs)
        arrow = f"  <- {inputs}" if inputs else ""
        rows.append((names[id(n)], n.label(), _shape(n), str(n.dtype), n.key[:8], arrow))
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    lines = [
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}} {r[3]:<{widths[3]}}  {r[4]}{r[5]}"
        for r in rows
    ]
    return TextGraph("\n".join(lines))


def _graphviz(node: Node) -> Any:
    import graphviz

    dot = graphviz.Digraph(
        graph_attr={"rankdir": "BT"}, node_attr={"shape": "box", "fontsize": "10"}
    )
    for n in graph.walk([node]):
        shape = (
            "cylinder"
            if isinstance(n, graph.Source)
            else "ellipse"
            if isinstance(n, graph.Value)
            else "box"
        )
        dot.node(n.key, f"{n.label()}\n{_shape(n)} {n.dtype}\n{n.key[:8]}", shape=shape)
        for i in n.inputs:
            dot.edge(i.key, n.key)
    return dot


def visualize(node: Node, filename: str | os.PathLike[str] | None = None) -> Any:
    """A graphviz ``Digraph`` of the graph (rendered to ``filename`` when given; the
    format follows its extension, e.g. ``.svg``, ``.png``), or, without graphviz, the
    text drawing (written to ``filename`` when given)."""
    try:
        dot = _graphviz(node)
    except ImportError:
        drawing = text(node)
        if filename is not None:
            with open(os.fspath(filename), "w") as f:
                f.write(drawing + "\n")
        return drawing
    if filename is not None:
        base, ext = os.path.splitext(os.fspath(filename))
        dot.render(base, format=ext.lstrip(".") or "svg", cleanup=True)
    return dot
