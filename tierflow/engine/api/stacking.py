"""``np.vstack``, ``np.hstack`` and ``np.column_stack`` on lazy arrays (``np.stack``
and ``np.concatenate`` are in :mod:`.functions`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph import Chunked
from . import blockwise, build, dispatch
from .creation import from_array

if TYPE_CHECKING:
    pass

__all__ = ["column_stack", "hstack", "vstack"]


# -- vstack, hstack, column_stack -------------------------------------------------------


@dispatch.implements(np.vstack)
def vstack(tup: Sequence[Any], *, dtype: Any = None, casting: str = "same_kind") -> Any:
    """``np.vstack``: arrays of two or more dimensions one after the other along the
    rows (lazy, nothing copied until computed). A 1-D lazy array would become one
    row: refused."""
    from .functions import cast_joined, concatenate

    items = [from_array(a) for a in _sequence("vstack", tup)]
    for item in items:
        if item.ndim < 2 and isinstance(item._node, Chunked):
            raise ValueError(
                f"np.vstack of a 1-D lazy array of shape {build.describe_shape(item.shape)} would "
                "make its rows one row; stack with np.column_stack (its values as a column) "
                "or np.stack(..., axis=1), or reshape it to (-1, 1) first"
            )
    items = [
        i if i.ndim >= 2 else blockwise.in_memory(np.atleast_2d, "atleast_2d", i) for i in items
    ]
    return cast_joined(concatenate(items, axis=0), dtype, casting)


@dispatch.implements(np.hstack)
def hstack(tup: Sequence[Any], *, dtype: Any = None, casting: str = "same_kind") -> Any:
    """``np.hstack``: 1-D arrays one after the other (along the rows); arrays of two or
    more dimensions side by side along axis 1 (they must have the same rows)."""
    from .functions import cast_joined, concatenate

    items = [from_array(a) for a in _sequence("hstack", tup)]
    axis = 0 if items and items[0].ndim == 1 else 1
    return cast_joined(concatenate(items, axis=axis), dtype, casting)


@dispatch.implements(np.column_stack)
def column_stack(tup: Sequence[Any]) -> Any:
    """``np.column_stack``: 1-D arrays as columns, 2-D arrays as they are, side by side
    (same rows)."""
    from .functions import concatenate

    items = [from_array(a) for a in _sequence("column_stack", tup)]
    columns = [i.reshape(-1, 1) if i.ndim == 1 else i for i in items]
    return concatenate(columns, axis=1)


def _sequence(name: str, tup: Any) -> list[Any]:
    if build.is_array(tup) or not isinstance(tup, (list, tuple)):
        raise TypeError(f"np.{name} takes a sequence of arrays (a list or a tuple)")
    if not tup:
        raise ValueError("need at least one array to concatenate")
    return list(tup)
