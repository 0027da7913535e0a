"""``np.einsum`` on lazy arrays: NumPy's own on each block when the row letter stays
in the output, a float64-accumulated sum over the rows when it does not (see
:mod:`.blockwise`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...operators import reductions as red
from .. import graph
from ..graph import Chunked, Value, specs
from . import blockwise, build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    from .array import Array

__all__ = ["einsum"]


# -- np.einsum --------------------------------------------------------------------------


@dispatch.implements(np.einsum)
def einsum(*operands: Any, out: Any = None, dtype: Any = None, **kwargs: Any) -> Any:
    """``np.einsum(subscripts, *operands)`` with lazy operands that share their rows.

    The row axis is each lazy operand's first subscript letter. Kept as the first axis
    of the output, the einsum runs on each block (``"ij,jk->ik"``, ``"ij,ij->i"``); summed
    over, it is a reduction whose partials are the einsum of each block, added in
    float64 (``"ij->j"``, ``"ij,ij->"``, ``"ij,ik->jk"``). Anything else raises
    ValueError saying how to write it."""
    blockwise.no_extras("einsum", out)
    kwargs.pop("optimize", None)  # the contraction order is NumPy's on each block
    if not operands or not isinstance(operands[0], str):
        raise TypeError(
            "np.einsum on lazy arrays takes the subscripts as a string ('ij,jk->ik'), not "
            "the sublist form"
        )
    subscripts = operands[0].replace(" ", "")
    arrays = list(operands[1:])
    if dtype is not None:
        kwargs["dtype"] = np.dtype(dtype)
    nodes = [build.node_of(a) for a in arrays]
    if not any(isinstance(n, Chunked) for n in nodes):
        return blockwise.in_memory(np.einsum, "einsum", subscripts, *arrays, **kwargs)
    if "..." in subscripts:
        raise ValueError(
            f"np.einsum({subscripts!r}) on a lazy array: spell out every axis instead of "
            "'...' (the row axis must be named)"
        )
    inputs, arrow, output = subscripts.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(arrays):
        raise ValueError(
            f"np.einsum({subscripts!r}): {len(terms)} operand(s) in the subscripts, "
            f"{len(arrays)} given"
        )
    if not arrow:
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    row = _row_letter(subscripts, terms, nodes)
    arrays = [
        from_array(a) if isinstance(n, np.ndarray) and row in t else a
        for a, n, t in zip(arrays, nodes, terms, strict=True)
    ]
    nodes = [build.node_of(a) for a in arrays]
    chunked = [n for n in nodes if isinstance(n, Chunked)]
    if build.line_up_later(chunked):  # different masks, block sizes, or known rows

        def again(xs: list[Array]) -> Any:
            picked = iter(xs)
            return einsum(
                subscripts,
                *(
                    next(picked) if isinstance(n, Chunked) else a
                    for a, n in zip(arrays, nodes, strict=True)
                ),
                **kwargs,
            )

        return build.defer_function(again, chunked, f"einsum({subscripts!r})")
    _refuse_other_rows(subscripts, nodes)
    for n, t in zip(nodes, terms, strict=True):
        if not isinstance(n, Chunked) and row in t:
            raise ValueError(
                f"np.einsum({subscripts!r}): the row axis '{row}' of the lazy operands also "
                f"indexes an in-memory result of shape {build.describe_shape(n.shape)}; only "
                "arrays with the same rows (lazy, or in memory with the rows first) can share it"
            )
    full = f"{inputs}->{output}"
    if row in output:
        if output[0] != row:
            rest = output.replace(row, "")
            raise ValueError(
                f"np.einsum({subscripts!r}) moves the row axis '{row}' to position "
                f"{output.index(row)} of the output; a lazy array keeps its rows first: write "
                f"'{inputs}->{row}{rest}' and move the axis after compute(), or compute() first"
            )
        return blockwise.on_blocks("einsum", _einsum_rows, arrays, subscripts=full, **kwargs)
    return _einsum_over_rows(full, arrays, nodes, kwargs)


def _refuse_other_rows(subscripts: str, nodes: Sequence[Any]) -> None:
    """NumPy's error for lazy operands whose (known) rows differ: NumPy's own check, on
    zero-strided stand-ins of their shapes (no memory), raises it before any work."""
    rows = {int(n.n_rows) for n in nodes if isinstance(n, Chunked) and n.n_rows is not None}
    if len(rows) < 2:
        return
    if 1 in rows:  # NumPy would broadcast the one row: not over row blocks
        raise ValueError(
            f"np.einsum({subscripts!r}) with an operand of one row and others of "
            f"{max(rows)} broadcasts that row over the others, which is not lazy; "
            "compute() the one-row operand first"
        )
    standins = [
        build.shape_only(n)
        if isinstance(n, Chunked)
        else graph.placeholder(n)
        if isinstance(n, Value)
        else n
        for n in nodes
    ]
    np.einsum(subscripts, *standins)
    raise ValueError(f"np.einsum({subscripts!r}): the arrays have different rows: {sorted(rows)}")


def _row_letter(subscripts: str, terms: Sequence[str], nodes: Sequence[Any]) -> str:
    """The letter of the row axis, shared by every lazy chunked operand."""
    letters = set()
    for term, node in zip(terms, nodes, strict=True):
        if not isinstance(node, Chunked):
            continue
        if not term:
            raise ValueError(f"np.einsum({subscripts!r}): a lazy operand needs subscripts")
        if term.count(term[0]) > 1:
            raise ValueError(
                f"np.einsum({subscripts!r}) repeats the row axis '{term[0]}' within one "
                "operand (a diagonal across rows); compute() first"
            )
        letters.add(term[0])
    if len(letters) > 1:
        raise ValueError(
            f"np.einsum({subscripts!r}): the lazy operands name their row axes "
            f"{', '.join(sorted(letters))}; arrays with the same rows must share one letter "
            "(a product across two row axes would not fit in memory)"
        )
    return letters.pop()


def _einsum_rows(*operands: Any, subscripts: str, **kwargs: Any) -> Any:
    return np.einsum(subscripts, *operands, **kwargs)


def _einsum_partial(
    subscripts: str, template: tuple[Any, ...], kwargs: dict[str, Any], *blocks: np.ndarray
) -> np.ndarray:
    next_block = iter(blocks)
    operands = [next(next_block) if t is None else t for t in template]
    return np.asarray(np.einsum(subscripts, *operands, **kwargs))


def _einsum_over_rows(
    subscripts: str, arrays: Sequence[Any], nodes: Sequence[Any], kwargs: dict[str, Any]
) -> Array:
    if any(isinstance(n, Value) for n in nodes):
        raise ValueError(
            f"np.einsum({subscripts!r}) sums over the rows with a lazy in-memory operand (a "
            "reduction's result); compute() that operand first"
        )
    chunked = tuple(n for n in nodes if isinstance(n, Chunked))
    template = tuple(None if isinstance(n, Chunked) else np.asarray(n) for n in nodes)
    zeros = [np.zeros((1, *n.row_shape), n.dtype) for n in chunked]
    probe = _einsum_partial(subscripts, template, kwargs, *zeros)
    out_dtype = probe.dtype
    acc = blockwise.float_acc(out_dtype) if out_dtype.kind in "fc" else out_dtype
    chunk = functools.partial(_einsum_partial, subscripts, template, {**kwargs, "dtype": acc})
    options = red.ReductionOptions(
        n_inputs=len(chunked), out_dtype=out_dtype, out_shape=probe.shape,
        partial_bytes=max(1, probe.size) * acc.itemsize + 64, name="einsum",
    )  # fmt: skip
    finish = functools.partial(blockwise.cast_result, out_dtype)
    return build.wrap(graph.Reduce(specs.UserSpec(chunk, np.add, finish, options), chunked))
