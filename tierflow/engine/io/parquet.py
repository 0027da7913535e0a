"""Parquet tables (pyarrow): :class:`ParquetReader` (``tw.from_parquet``).

Numeric columns of one or more files as a 2-D array of one ``dtype``, in row groups:
block boundaries fall on row-group edges (small groups are read together), so a block
is read with ``read_row_groups``. Nulls become NaN (``nulls="nan"``, a float ``dtype``)
or are refused (``nulls="raise"``), naming the column, the file and the row group. The
files' identity is read when the array is built; a file changed after that is refused at
the next compute.
"""

from __future__ import annotations

import bisect
import glob as glob_module
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import SourceError, missing_dependency
from .readers import Reader, check_identity, file_stat, unfit

__all__ = [
    "ParquetReader",
    "parquet_paths",
]


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise missing_dependency("pyarrow", "parquet", "tw.from_parquet") from None
    return pyarrow


def parquet_paths(paths_or_glob: str | os.PathLike[str] | Sequence[Any]) -> list[str]:
    """The files of ``paths_or_glob``: a path, a glob pattern (sorted), or a list of
    paths (kept in order). Raises ``FileNotFoundError`` for a pattern that matches
    nothing, or a path that is not there."""
    if isinstance(paths_or_glob, (str, os.PathLike)):
        text = os.fspath(paths_or_glob)
        if glob_module.has_magic(text):
            found = sorted(glob_module.glob(text))
            if not found:
                raise FileNotFoundError(f"no file matches {text!r}")
            return [os.path.abspath(p) for p in found]
        paths = [text]
    else:
        paths = [os.fspath(p) for p in paths_or_glob]
        if not paths:
            raise ValueError("from_parquet needs at least one file")
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no Parquet file {p!r}")
    return [os.path.abspath(p) for p in paths]


class ParquetReader(Reader):
    """Numeric ``columns`` of the Parquet files ``paths`` as one ``[rows, columns]``
    array of ``dtype`` (see the module docstring)."""

    file_backed = False
    makes_blocks = True

    def __init__(
        self,
        paths: Sequence[str],
        columns: Sequence[str] | None,
        dtype: Any,
        nulls: str,
    ) -> None:
        pa = _pyarrow()
        if nulls not in ("nan", "raise"):
            raise ValueError(f"nulls={nulls!r}: use 'nan' or 'raise'")
        self.dtype = np.dtype(dtype)
        if self.dtype.kind not in "biuf":
            raise ValueError(f"dtype={dtype!r}: from_parquet gives numbers; use a numeric dtype")
        self.nulls = nulls
        self.paths = list(paths)
        groups: list[tuple[int, int, int]] = []  # (file, group, rows)
        chosen: list[str] | None = list(columns) if columns is not None else None
        for i, path in enumerate(self.paths):
            try:
                meta = pa.parquet.ParquetFile(path).metadata
            except (OSError, pa.ArrowException) as exc:
                raise SourceError(f"{path} is not a readable Parquet file: {exc}") from None
            schema = meta.schema.to_arrow_schema()
            names = list(schema.names)
            if chosen is None:
                chosen = names
            for name in chosen:
                if name not in names:
                    raise SourceError(
                        f"{path} has no column {name!r}; its columns: {', '.join(names)}"
                    )
                kind = schema.field(name).type
                if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                        or pa.types.is_boolean(kind)):  # fmt: skip
                    raise SourceError(
                        f"{path}: column {name!r} is {kind}, not numeric; pick numeric "
                        "columns with columns=[...]"
                    )
            for g in range(meta.num_row_groups):
                groups.append((i, g, int(meta.row_group(g).num_rows)))
        assert chosen is not None
        if not chosen:
            raise SourceError(f"{self.paths[0]} has no columns to read")
        self.columns = chosen
        self.groups = groups
        self.group_starts = [0]
        for _, _, n in groups:
            self.group_starts.append(self.group_starts[-1] + n)
        self.n_rows = self.group_starts[-1]
        self.row_shape = (len(chosen),)
        self.stats = [file_stat(p) for p in self.paths]
        first = os.path.basename(self.paths[0])
        more = f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        self.label = f"from_parquet({first!r}{more})"
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_local", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def group_bounds(self, rows: int) -> tuple[int, ...]:
        """Block boundaries on row-group edges: each block the groups that together
        make at most about ``rows`` rows (at least one group)."""
        bounds = [0]
        for start in self.group_starts[1:]:
            if start - bounds[-1] >= rows:
                bounds.append(start)
        if bounds[-1] != self.group_starts[-1]:
            bounds.append(self.group_starts[-1])
        return tuple(bounds)

    def _file(self, i: int) -> Any:
        cache: tuple[int, dict[int, Any]] | None = getattr(self._local, "files", None)
        if cache is None or cache[0] != os.getpid():
            cache = self._local.files = (os.getpid(), {})
        opened = cache[1]
        if i not in opened:
            opened[i] = _pyarrow().parquet.ParquetFile(self.paths[i])
        return opened[i]

    reads_into = True

    def read(self, a: int, b: int) -> np.ndarray:
        return self.read_into(a, b, np.empty((max(0, b - a), len(self.columns)), self.dtype))

    def read_into(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        if b <= a:
            return out
        first = bisect.bisect_right(self.group_starts, a) - 1
        last = bisect.bisect_right(self.group_starts, b - 1) - 1
        for k in range(first, last + 1):
            i, g, _ = self.groups[k]
            start = self.group_starts[k]
            lo, hi = max(a, start), min(b, self.group_starts[k + 1])
            table = self._file(i).read_row_groups([g], columns=self.columns)
            for j, name in enumerate(self.columns):
                column = table.column(name)
                if column.null_count:
                    self._nulls(name, i, g, column.null_count)
                values = column.to_numpy(zero_copy_only=False)[lo - start : hi - start]
                self._check_fits(values, name, k, lo - start)
                out[lo - a : hi - a, j] = values
        return out

    def _check_fits(self, values: np.ndarray, name: str, k: int, first: int) -> None:
        """Refuse values of column ``name`` (rows from ``first`` of row group ``k``) that
        the array's dtype cannot hold, rather than wrap or truncate them."""
        found = unfit(values, self.dtype)
        if found is None:
            return
        i, g, _ = self.groups[k]
        raise SourceError(
            f"{self.paths[i]}: column {name!r} holds {found.text()} (row {first + found.index} "
            f"of row group {g}), {found.why}; pass a dtype that holds it, such as the "
            f"column's own: from_parquet(..., dtype={values.dtype.name!r})"
        )

    def _nulls(self, name: str, i: int, g: int, count: int) -> None:
        if self.nulls == "raise" or self.dtype.kind != "f":
            fix = "; pass nulls='nan' with a float dtype to read them as NaN"
            if self.nulls == "nan":
                fix = f"; {self.dtype} has no NaN: pass a float dtype"
            raise SourceError(
                f"{self.paths[i]}: column {name!r} has {count} null(s) in row group {g}{fix}"
            )

    def check(self) -> None:
        for path, stat in zip(self.paths, self.stats, strict=True):
            check_identity(path, stat, "tw.from_parquet")

    def token(self) -> str:
        files = ",".join(f"({p!r},{s})" for p, s in zip(self.paths, self.stats, strict=True))
        return f"parquet([{files}],{self.columns!r},{self.dtype.str},{self.nulls})"

    def files(self) -> list[str]:
        return list(self.paths)
