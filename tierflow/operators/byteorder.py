"""Byte order: how blocks in either byte order keep NumPy's answers and dtypes.

A block keeps the dtype of its array, byte order included (a ``'>f4'`` HDF5 dataset
gives ``'>f4'`` blocks), so results carry NumPy's dtype: ``np.sort`` and ``np.unique``
of a ``'>i4'`` array are ``'>i4'``, ``x + 1`` is native ``int32``. NumPy's ufuncs,
reductions, sorts and products read either byte order (their loops swap as they go).
Two things do not:

* A kernel that reinterprets values as another type (``values.view(np.uint32)`` for a
  sort key, a row seen as one structured value), or that keeps keys from several blocks
  which must compare alike, brings its input to native order first with :func:`native`.
  That is one copy of a non-native block (a pass at memory speed, the block's size in
  scratch) and nothing for a native one; the sort kernels fold it into the copy they
  make anyway. Their results go back into arrays of the array's own dtype.
* ``np.concatenate`` gives native order whatever its inputs' order: the pieces of one
  array's rows are joined with :func:`join`, which keeps their dtype.

>>> native(np.array([1, 256], ">i4")).tolist(), native(np.array([1, 256], ">i4")).dtype.isnative
([1, 256], True)
>>> join([np.array([1], ">i4"), np.array([256], ">i4")]).dtype.str
'>i4'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["join", "native", "native_dtype"]


def native_dtype(dtype: Any) -> np.dtype:
    """``dtype`` in this machine's byte order (every field of a structured dtype too)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def native(values: np.ndarray) -> np.ndarray:
    """``values`` in native byte order: ``values`` itself when they are, else a copy
    holding the same numbers."""
    if values.dtype.isnative:
        return values
    return values.astype(native_dtype(values.dtype))


def join(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The pieces of one array's rows (all of one dtype) joined along the rows, in their
    dtype, byte order included (``np.concatenate`` alone would give native order)."""
    return np.concatenate(parts, dtype=parts[0].dtype)
