"""Arrays in memory: :class:`ArrayReader` (``tw.from_array``, ``np.memmap``,
``memory.array``: blocks are views, no copy) and :class:`ArraySink` (the result of
``compute`` and ``persist``).

A result is allocated with ``memory.array``: RAM while it fits the budget, else a spill
file; a spilled result's finished blocks are written back and dropped from RAM as they
are done. Known row counts: every block task writes its rows straight into the result's
rows (a fused kernel writes there with ``out=``, no copy). Unknown row counts (after a
mask): blocks come back to the scheduler, which holds them until every block's size is
known and assembles the array.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...storage import identity, pages, placement, sharing
from ...storage.sources import ArraySource
from ..graph import Chunked
from .npy import NpyRows
from .readers import COSTLY_BYTES, Reader

__all__ = [
    "ArrayReader",
    "ArraySink",
]


class ArrayReader(Reader):
    """An in-memory or memory-mapped array; blocks are slices (views)."""

    picks_rows = True

    def __init__(self, array: np.ndarray) -> None:
        self.source = ArraySource(array)
        self.array = array
        self.dtype = array.dtype
        self.row_shape = tuple(array.shape[1:])
        self.n_rows = int(array.shape[0])
        self.file_backed = self.source.file_backed
        self.label = "from_array"
        self._token: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The array by value (a spill file by path under multiprocessing), in its byte
        # order; the source is made again around what arrives, which may be in RAM
        # where this one was mapped.
        return {"array": sharing.in_byte_order(self.array), "_token": self._token}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["array"])  # type: ignore[misc]
        self._token = state["_token"]

    def read(self, a: int, b: int) -> np.ndarray:
        return self.array[a:b]

    def readahead(self, a: int, b: int) -> None:
        if self.file_backed:
            self.source.readahead(a, b)

    def release(self, a: int, b: int, *, drop_cache: bool = False) -> None:
        if self.file_backed:
            self.source.release(a, b, drop_cache=drop_cache, count=False)

    def costly_token(self) -> bool:
        """Whether :meth:`token` would hash a big in-memory array (not done yet)."""
        return self._token is None and not self.file_backed and self.array.nbytes > COSTLY_BYTES

    def token(self) -> str:
        # Hashing reads the whole array once; it happens the first time the key is
        # needed and is remembered (the array must not change while it is in use).
        if self._token is None:
            self._token = f"array({identity.array_digest(self.array)})"
        return self._token


class ArraySink:
    """The result of ``compute`` / ``persist``: an array made by ``memory.array``."""

    def __init__(self, node: Chunked) -> None:
        self.node = node
        self.known = node.n_rows is not None
        self.out: np.ndarray | None = None
        self.spilled = False

    def open(self) -> None:
        """Allocate the output (known row counts; unknown ones allocate in assemble)."""
        if self.known:
            self.out = placement.array(self.node.shape, self.node.dtype)  # type: ignore[arg-type]
            self.spilled = placement.on_disk(self.out)

    def task_bytes(self, rows: int) -> int:
        """Bytes a block task needs for this sink: none when it writes into the output
        (placement counts that), the block itself when it is held."""
        if self.known:
            return 0
        return rows * self.node.dtype.itemsize * math.prod(self.node.row_shape)  # type: ignore[union-attr]

    def place(self) -> NpyRows | None:
        """Where another process writes rows: nowhere (they come back by value)."""
        return None

    def dest(self, a: int, b: int) -> np.ndarray:
        assert self.out is not None
        return self.out[a:b]

    def written(self, a: int, b: int, block: np.ndarray) -> None:
        if self.spilled and b > a:
            # Written back and dropped, so a result bigger than RAM never sits in it.
            pages.release(block, drop_cache=True)

    def assemble(self, blocks: list[np.ndarray]) -> np.ndarray:
        """The output from blocks of sizes known only now."""
        total = sum(len(b) for b in blocks)
        out = placement.array((total, *self.node.row_shape), self.node.dtype)
        self.out = out
        self.spilled = placement.on_disk(out)
        start = 0
        for block in blocks:
            stop = start + len(block)
            if stop > start:
                out[start:stop] = block
                self.written(start, stop, out[start:stop])
            start = stop
        return out

    def commit(self) -> np.ndarray:
        assert self.out is not None
        out, self.out = self.out, None
        return out

    def abort(self) -> None:
        """Free the output (its spill file is deleted now)."""
        if self.out is not None:
            placement.free(self.out)
            self.out = None
