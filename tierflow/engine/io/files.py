"""Directories of files: :class:`FilesReader` (``tw.from_files``), rows loaded by the
user's ``load(path)`` in the process that runs the task, :class:`FileRows` of them per
file (one, a fixed number, or a number known once loaded).

``load=np.load`` over ``.npy`` files of one layout is read straight into the block: the
first file's header is parsed once (NumPy's own reader), and every file whose header has
the same bytes gets its data read with ``readinto`` into its rows, the GIL released
during the read, with no array per file. ``np.load`` parses each header with
``ast.literal_eval``: about 37 us a file of 12 KB, against 7-12 us read this way,
and the parse holds the GIL that the other workers' torch calls wait for between their
operators. A header with other bytes is parsed: read straight in too when it describes
the same array (a version 2 header, other padding); a file of another dtype, shape or
order, an ``.npz``, a pickle, or one too short goes through ``np.load`` as before,
which gives the same rows or says what is wrong with the file.
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
        self._npy = _NpyLayout.of(load, rows)
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
        if self._npy is not None:
            return self._read_npy(first, last, self._npy)
        parts = [self._load(i) for i in range(first, last)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.empty((0, *self.row_shape), self.dtype)
        return byteorder.join(parts)

    def _read_npy(self, first: int, last: int, layout: _NpyLayout) -> np.ndarray:
        """Files ``first`` to ``last`` read straight into one block (module docstring);
        a file ``layout`` does not read goes through :meth:`_load`."""
        k = layout.rows
        block = np.empty(((last - first) * k, *self.row_shape), self.dtype)
        flat = block.data.cast("B")
        size = layout.data_nbytes
        for j, i in enumerate(range(first, last)):
            if not layout.read_into(self.paths[i], flat[j * size : (j + 1) * size]):
                block[j * k : (j + 1) * k] = self._load(i)
        return block

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


class _NpyLayout:
    """How ``np.load`` reads every ``.npy`` file of a :class:`FilesReader`: ``rows`` rows
    of ``data_nbytes`` bytes in all, after a header whose bytes are learnt from a file
    that has this dtype and shape in C order (``header``: a file with the same bytes is
    read without parsing its header; one with other bytes is parsed, and learnt from
    when it matches). Workers may learn at once: they store equally good headers."""

    def __init__(self, rows: int, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.rows = rows
        self.dtype = dtype
        self.shape = shape
        self.data_nbytes = dtype.itemsize * math.prod(shape)
        self.header: bytes | None = None

    @classmethod
    def of(cls, load: Callable[[str], Any], rows: FileRows) -> _NpyLayout | None:
        """The layout to read for ``load`` when it is ``np.load`` and every file holds a
        known number of rows of plain (not object) values; else None."""
        k = rows.per_file
        if load is not np.load or k is None or rows.dtype.hasobject:
            return None
        shape = rows.row_shape if k == 1 else (k, *rows.row_shape)
        if rows.dtype.itemsize * math.prod(shape) == 0:
            return None
        return cls(k, rows.dtype, shape)

    def read_into(self, path: str, out: memoryview) -> bool:
        """Whether the file's data went into ``out``: False for a file this layout does
        not describe, a short file or one that cannot be opened (``np.load`` then says
        why, or reads it another way)."""
        try:
            with open(path, "rb", buffering=0) as f:
                header = self.header
                if header is None or f.read(len(header)) != header:
                    f.seek(0)
                    if self._learn(f) is None:
                        return False
                done = 0
                while done < len(out):
                    got = f.readinto(out[done:])
                    if not got:
                        return False
                    done += got
        except OSError:
            return False
        return True

    def _learn(self, f: Any) -> bytes | None:
        """The header bytes of the open file ``f`` if its array is this layout's (C order,
        this dtype and shape), leaving ``f`` at the data; else None."""
        fmt = np.lib.format
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(f)
            else:
                return None
        except ValueError:
            return None
        if fortran or dtype != self.dtype or tuple(shape) != self.shape:
            return None
        offset = f.tell()
        f.seek(0)
        self.header = f.read(offset)
        return self.header
