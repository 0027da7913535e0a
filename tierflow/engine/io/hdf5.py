"""HDF5 datasets (h5py): :class:`Hdf5Reader` (``tw.from_hdf5``).

Rows ``a:b`` of one dataset, read with ``read_direct`` into the block the engine lends (a
pooled one, or the sink's own; h5py decompresses chunked, compressed datasets itself).
Default blocks are whole chunks along axis 0. The file stays open per process (h5py's
handles are not shared between processes), reopened after a fork. The file's identity
(size, modification time, inode) is read when the array is built; a file changed after
that is refused at the next compute.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from ...errors import SourceError, missing_dependency
from .readers import Reader, check_identity, file_stat

__all__ = [
    "Hdf5Reader",
]


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise missing_dependency("h5py", "hdf5", "tw.from_hdf5") from None
    return h5py


class Hdf5Reader(Reader):
    """Dataset ``dataset`` of the HDF5 file ``path`` (see the module docstring)."""

    file_backed = False  # read through h5py, not mapped: nothing to drop from the cache
    makes_blocks = True

    def __init__(self, path: str | os.PathLike[str], dataset: str) -> None:
        h5py = _h5py()
        self.path = os.path.abspath(os.fspath(path))
        self.dataset = str(dataset)
        try:
            with h5py.File(self.path, "r") as f:
                if self.dataset not in f:
                    names: list[str] = []
                    f.visititems(
                        lambda name, obj: (
                            names.append(name) if isinstance(obj, h5py.Dataset) else None
                        )
                    )
                    raise SourceError(
                        f"{self.path} has no dataset {self.dataset!r}; its datasets: "
                        f"{', '.join(names[:10]) or 'none'}"
                    )
                ds = f[self.dataset]
                if not isinstance(ds, h5py.Dataset):
                    raise SourceError(f"{self.path}: {self.dataset!r} is a group, not a dataset")
                if ds.ndim == 0:
                    raise SourceError(f"{self.path}: dataset {self.dataset!r} is 0-d: no rows")
                self.dtype = np.dtype(ds.dtype)
                if self.dtype.hasobject or self.dtype.kind in "OSUV":
                    raise SourceError(
                        f"{self.path}: dataset {self.dataset!r} holds {self.dtype}, not "
                        "numbers; tierflow reads numeric datasets"
                    )
                self.row_shape = tuple(int(n) for n in ds.shape[1:])
                self.n_rows = int(ds.shape[0])
                self.chunk_rows = int(ds.chunks[0]) if ds.chunks else None
                self.compression = ds.compression
        except OSError as exc:
            raise SourceError(f"{self.path} is not a readable HDF5 file: {exc}") from None
        self.stat = file_stat(self.path)
        self.label = f"from_hdf5({os.path.basename(self.path)!r}, {self.dataset!r})"
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_local", None)  # open handles stay in their process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _dataset(self) -> Any:
        # One handle per thread and process: h5py serialises its calls on one lock, and
        # a handle opened before a fork must not be used after it.
        found = getattr(self._local, "open", None)
        if found is None or found[0] != os.getpid():
            handle = _h5py().File(self.path, "r")
            found = self._local.open = (os.getpid(), handle, handle[self.dataset])
        return found[2]

    reads_into = True

    def read(self, a: int, b: int) -> np.ndarray:
        return self.read_into(a, b, np.empty((b - a, *self.row_shape), self.dtype))

    def read_into(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        if b > a:
            try:
                self._dataset().read_direct(out, np.s_[a:b])
            except (OSError, ValueError) as exc:
                raise SourceError(
                    f"{self.path}: reading rows {a}:{b} of dataset {self.dataset!r} failed "
                    f"({exc}); the file may be damaged or was changed while being read"
                ) from None
        return out

    def processes_pay(self) -> int:
        """The bytes this dataset decompresses under h5py's one lock (0 when it is not
        compressed): what worker processes, each with its own h5py, read in parallel."""
        if not self.compression:
            return 0
        return int(self.n_rows or 0) * self.row_nbytes

    def check(self) -> None:
        check_identity(self.path, self.stat, "tw.from_hdf5")

    def token(self) -> str:
        return f"hdf5({self.path!r},{self.dataset!r},{self.stat})"

    def files(self) -> list[str]:
        return [self.path]
