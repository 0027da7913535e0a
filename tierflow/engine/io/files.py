"""Directories of files: :class:`FilesReader` (``tw.from_files``), rows loaded by the
user's ``load(path)`` in the process that runs the task, :class:`FileRows` of them per
file (one, a fixed number, or a number known once loaded).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BlockError
from ...operators import byteorder
from ...storage import identity
from ..graph import portable
from .readers import Reader, unfit

__all__ = [
    "FileRows",
    "FilesReader",
]


@dataclass(frozen=True)
class FileRows:
    """What ``load`` gives for each file: ``per_file`` rows of ``dtype`` and ``row_shape``.

    ``per_file`` is 1 (``load`` returns one row of ``row_shape``), a fixed number ``k``
    (``load`` returns ``k`` rows) or None (each file gives some number of rows, known
    once loaded).
    """

    per_file: int | None
    dtype: np.dtype
    row_shape: tuple[int, ...]


class FilesReader(Reader):
    """Rows loaded from many files by ``load(path)``, in the worker threads.

    Each file gives ``rows`` (:class:`FileRows`). ``files_per_block`` files make one
    block when the row count is unknown.
    """

    makes_blocks = True

    def __init__(
        self,
        paths: Sequence[str],
        load: Callable[[str], Any],
        rows: FileRows,
        files_per_block: int,
    ) -> None:
        self.paths = [os.fspath(p) for p in paths]
        self.load = load
        self.rows_per_file = rows.per_file
        self.dtype = rows.dtype
        self.row_shape = rows.row_shape
        self.files_per_block = files_per_block
        per_file = rows.per_file
        self.n_rows = None if per_file is None else per_file * len(self.paths)
        self.nblocks = math.ceil(len(self.paths) / files_per_block) if self.paths else 0
        name = getattr(load, "__qualname__", type(load).__name__)
        self.label = f"from_files({len(self.paths)} files, {name})"
        self._token: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "load": portable.by_value(self.load)}

    def _load(self, i: int) -> np.ndarray:
        path = self.paths[i]
        where = f"file {i} of {len(self.paths)} ({path})"
        try:
            value = np.asarray(self.load(path))
        except Exception as exc:
            name = getattr(self.load, "__qualname__", type(self.load).__name__)
            raise BlockError(
                f"from_files: {name} failed on {where}: {type(exc).__name__}: {exc}",
                index=i,
                start=i,
                stop=i + 1,
            ) from exc
        k = self.rows_per_file
        if k == 1:
            if value.shape != self.row_shape:
                raise BlockError(
                    f"from_files: load returned shape {value.shape} for {where}; every file "
                    f"must give one row of shape {self.row_shape} (from the first file or "
                    "row_shape=); pass rows_per_file=None if files hold several rows",
                    index=i,
                    start=i,
                    stop=i + 1,
                )
            value = value[np.newaxis]
        elif (
            value.ndim == 0
            or value.shape[1:] != self.row_shape
            or (k is not None and value.shape[0] != k)
        ):
            want = (
                f"({k}, {', '.join(map(str, self.row_shape))})"
                if k
                else (f"(rows, {', '.join(map(str, self.row_shape))})")
            )
            raise BlockError(
                f"from_files: load returned shape {value.shape} for {where}; every file must "
                f"give rows of shape {want}",
                index=i,
                start=i,
                stop=i + 1,
            )
        if value.dtype != self.dtype:
            if not np.can_cast(value.dtype, self.dtype, casting="same_kind"):
                raise BlockError(
                    f"from_files: load returned {value.dtype} for {where}, which does not "
                    f"cast to the array's {self.dtype}; return that dtype or pass dtype=",
                    index=i,
                    start=i,
                    stop=i + 1,
                )
            found = unfit(value, self.dtype)
            if found is not None:
                raise BlockError(
                    f"from_files: load returned {found.text()} for {where}, {found.why}; "
                    f"return values that fit, or pass dtype={value.dtype.name!r}",
                    index=i,
                    start=i,
                    stop=i + 1,
                )
            value = value.astype(self.dtype, casting="same_kind")
        return value

    def _stack(self, first: int, last: int) -> np.ndarray:
        parts = [self._load(i) for i in range(first, last)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.empty((0, *self.row_shape), self.dtype)
        return byteorder.join(parts)

    def read(self, a: int, b: int) -> np.ndarray:
        k = self.rows_per_file
        assert k is not None
        if b <= a:
            return np.empty((0, *self.row_shape), self.dtype)
        first, last = a // k, -(-b // k)
        block = self._stack(first, last)
        return block[a - first * k : b - first * k]

    def block_rows(self) -> int:
        return self.files_per_block

    def read_block(self, j: int) -> np.ndarray:
        first = j * self.files_per_block
        return self._stack(first, min(first + self.files_per_block, len(self.paths)))

    def token(self) -> str:
        if self._token is None:
            stats = []
            for p in self.paths:
                try:
                    st = os.stat(p)
                    stats.append(f"{p!r}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
                except OSError:
                    stats.append(f"{p!r}:missing")
            self._token = (
                f"files({identity.digest(','.join(stats))},{identity.function_token(self.load)},"
                f"{self.rows_per_file},{self.dtype.str},{self.row_shape})"
            )
        return self._token

    def files(self) -> list[str]:
        return self.paths
