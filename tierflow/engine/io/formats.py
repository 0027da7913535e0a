"""Readers of array formats: Zarr arrays, HDF5 datasets (h5py), Parquet tables (pyarrow).

Both read by path in whichever process runs the task (a worker process or a cluster
worker reopens the file), and both are told apart by the files' identity: size,
modification time and inode, read when the array is built. A file changed after that is
refused at the next compute (:meth:`check`), as ``.npy`` files are.

* :class:`ZarrReader`: a Zarr array (format 3 or 2) on a local disk or in object storage
  (an fsspec URL: ``s3://...``). Blocks are whole numbers of chunks (of shards, for a
  sharded array) along axis 0, the chunks along the other axes read together; zarr
  reads and decompresses them in the process that runs the task. A chunk that was never
  written reads as the fill value; a chunk that cannot be decoded raises ``SourceError``
  naming its key. An array a ``to_zarr`` left unfinished (marked ``tierflow: {"complete":
  false}``) is refused with ``IncompleteError``, counting the chunks not stored, unless
  the caller allows it. Its identity is the store URL, the array's metadata, and every stored
  object's size and modification time (or ETag, in object storage).
* :class:`Hdf5Reader`: rows ``a:b`` of one dataset, read with ``read_direct`` into the
  block the engine lends (a pooled one, or the sink's own; h5py decompresses chunked,
  compressed datasets itself). Default blocks are whole
  chunks along axis 0. The file stays open per process (h5py's handles are not shared
  between processes), reopened after a fork.
* :class:`ParquetReader`: numeric columns of one or more files as a 2-D array of one
  ``dtype``, in row groups: block boundaries fall on row-group edges (small groups are
  read together), so a block is read with ``read_row_groups``. Nulls become NaN
  (``nulls="nan"``, a float ``dtype``) or are refused (``nulls="raise"``), naming the
  column, the file and the row group.
"""

from __future__ import annotations

import bisect
import glob as glob_module
import hashlib
import itertools
import json
import math
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import IncompleteError, SourceError, missing_dependency
from .destination import chunk_key
from .readers import Reader, check_identity, file_stat, unfit

__all__ = ["Hdf5Reader", "ParquetReader", "ZarrReader", "parquet_paths"]


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise missing_dependency("h5py", "hdf5", "tw.from_hdf5") from None
    return h5py


def _zarr() -> Any:
    try:
        import zarr
    except ImportError:
        raise missing_dependency("zarr", "zarr", "tw.from_zarr") from None
    return zarr


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise missing_dependency("pyarrow", "parquet", "tw.from_parquet") from None
    return pyarrow


# -- Zarr ------------------------------------------------------------------------------


AHEAD_MAX = 8  # blocks of object storage fetched ahead, per reader and process
_ahead_lock = threading.Lock()
_ahead_threads: Any = None


def _ahead_pool() -> Any:
    """The threads that fetch object-storage rows ahead (I/O: they wait on the network)."""
    global _ahead_threads
    with _lock_pool:
        if _ahead_threads is None or _ahead_threads[0] != os.getpid():
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tierflow-readahead")
            _ahead_threads = (os.getpid(), pool)
        return _ahead_threads[1]


_lock_pool = threading.Lock()


# botocore's defaults wait 60 s for a connection and try 5 times: minutes before a
# compute learns that an endpoint is down. Used unless storage_options has config_kwargs.
S3_TIMEOUTS = {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3}}


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server could not be reached (refused, timed out)."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"ConnectionError", "ConnectTimeoutError", "EndpointConnectionError"})


def _unreachable_error(url: str, exc: BaseException) -> SourceError:
    return SourceError(
        f"{url} could not be reached ({exc}); check the URL and the storage_options "
        "(endpoint_url, credentials), and that the server is up"
    )


def _is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


class ZarrReader(Reader):
    """The Zarr array at ``url`` (a folder, or an fsspec URL with ``storage_options``);
    see the module docstring."""

    file_backed = False
    makes_blocks = True

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None,
        *,
        allow_incomplete: bool = False,
    ) -> None:
        _zarr()
        text = os.fspath(url)
        if text.startswith("file://"):
            text = text[len("file://") :]
        self.url = text if _is_url(text) else os.path.abspath(text)
        self.storage_options = dict(storage_options or {})
        if self.url.startswith("s3://") and "config_kwargs" not in self.storage_options:
            self.storage_options["config_kwargs"] = dict(S3_TIMEOUTS)
        # Listed first: an unreachable store fails here, before zarr's asynchronous reads.
        root, listing = self._listing()
        self.objects = _digest(listing)
        array = self._open()
        mark = array.attrs.get("tierflow")
        if isinstance(mark, dict) and mark.get("complete") is False and not allow_incomplete:
            keys = [name[len(root) :].lstrip("/") for name in listing]
            raise self._incomplete(array, keys)
        self.dtype = np.dtype(array.dtype)
        if self.dtype.hasobject or self.dtype.kind in "OSUV":
            raise SourceError(
                f"{self.url} holds {self.dtype}, not numbers; tierflow reads numeric arrays"
            )
        if array.ndim == 0:
            raise SourceError(f"{self.url} is a 0-d Zarr array: it has no rows")
        self.row_shape = tuple(int(n) for n in array.shape[1:])
        self.n_rows = int(array.shape[0])
        unit = array.shards if getattr(array, "shards", None) else array.chunks
        self.unit = tuple(int(n) for n in unit)  # what one stored object holds
        self.chunk_rows = self.unit[0]
        self.reads_ahead = _is_url(self.url)  # object storage: fetched ahead of use
        self.ahead_hits = 0  # reads served by a fetch started ahead (in this process)
        self.metadata = json.dumps(array.metadata.to_dict(), sort_keys=True, default=str)
        self.decoder = _direct_decoder(array) if not self.reads_ahead else None
        self.reads_into = self.decoder is not None
        # Format 2 may say no fill value (None): zarr then reads a missing chunk as zeros.
        self.fill = array.fill_value if array.fill_value is not None else 0
        self.label = f"from_zarr({os.path.basename(self.url.rstrip('/'))!r})"
        self._local = threading.local()

    def _open(self) -> Any:
        zarr = _zarr()
        try:
            if _is_url(self.url):
                return zarr.open_array(self.url, mode="r", storage_options=self.storage_options)
            return zarr.open_array(self.url, mode="r")
        except FileNotFoundError:
            raise FileNotFoundError(f"no Zarr array at {self.url}") from None
        except Exception as exc:
            if _unreachable(exc):
                raise _unreachable_error(self.url, exc) from None
            raise SourceError(f"{self.url} is not a readable Zarr array: {exc}") from None

    def _listing(self) -> tuple[str, dict[str, dict[str, Any]]]:
        """The array's root path and every stored object under it, by path: size, time
        or ETag."""
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
            found = fs.find(root, detail=True)
        except Exception as exc:
            if _unreachable(exc):
                raise _unreachable_error(self.url, exc) from None
            raise SourceError(f"{self.url}: listing the array's objects failed: {exc}") from None
        return root.rstrip("/"), dict(found)

    def _objects(self) -> str:
        """A digest of every stored object's key, size and modification time or ETag."""
        return _digest(self._listing()[1])

    def _incomplete(self, array: Any, keys: list[str]) -> IncompleteError:
        """The error for an array a ``to_zarr`` left unfinished, with the count of the
        stored objects (chunks, or shards) it lacks."""
        unit = array.shards if getattr(array, "shards", None) else array.chunks
        what = "shards" if getattr(array, "shards", None) else "chunks"
        expected = math.prod(-(-int(n) // int(u)) for n, u in zip(array.shape, unit, strict=True))
        stored = sum(1 for key in keys if chunk_key(key))
        fill = array.fill_value if array.fill_value is not None else 0
        return IncompleteError(
            f"{self.url} is marked incomplete (tierflow: complete false): a to_zarr that "
            f"failed or was killed left it with {stored} of its {expected} {what} stored, "
            f"so {expected - stored} are missing (a {what[:-1]} that is only the fill "
            f"value is not stored either) and would read as {fill}. Run the same to_zarr "
            "again to finish it: it replaces this array, and with the same cache= computes "
            "only the blocks not cached (another compute needs overwrite=True). Or read it "
            "as it is with tw.from_zarr(..., allow_incomplete=True)"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_local", None)
        state.pop("_ahead", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def scratch_bytes(self, rows: int) -> int:
        """A stored object's encoded and decoded bytes, at most (zarr decodes object by
        object into the block)."""
        return 2 * self.dtype.itemsize * math.prod(self.unit)

    def readahead(self, a: int, b: int) -> None:
        """Object storage: start fetching rows ``a:b`` on a reader thread (at most
        :data:`AHEAD_MAX` blocks ahead; the block's bytes are the task's, admitted with
        it); :meth:`read` takes them."""
        if not self.reads_ahead:
            return
        ahead = self.__dict__.setdefault("_ahead", {})
        with _ahead_lock:
            if (a, b) in ahead:
                return
            while len(ahead) >= AHEAD_MAX:  # the oldest goes (its task read it itself)
                ahead.pop(next(iter(ahead))).cancel()
            ahead[(a, b)] = _ahead_pool().submit(self._fetch, a, b)

    def _fetch(self, a: int, b: int) -> np.ndarray:
        return np.asarray(self._array()[a:b])

    def _array(self) -> Any:
        found = getattr(self._local, "open", None)
        if found is None or found[0] != os.getpid():
            found = self._local.open = (os.getpid(), self._open())
        return found[1]

    def read(self, a: int, b: int) -> np.ndarray:
        if self.decoder is not None:
            return self.read_into(a, b, np.empty((b - a, *self.row_shape), self.dtype))
        with _ahead_lock:
            fetching = self.__dict__.get("_ahead", {}).pop((a, b), None)
            if fetching is not None and fetching.cancelled():
                fetching = None
            if fetching is not None:
                self.ahead_hits += 1
        array = self._array()
        try:
            if fetching is not None:
                return np.asarray(fetching.result())
            return np.asarray(array[a:b])
        except Exception as exc:
            if _unreachable(exc):
                raise SourceError(
                    f"{self.url}: reading rows {a}:{b} failed, the store could not be "
                    f"reached ({exc})"
                ) from None
            raise self._corrupt(array, a, b, exc) from None

    def read_into(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        """Rows ``a:b`` decoded chunk by chunk straight into ``out`` (arrays with a
        :func:`_direct_decoder`): each chunk file read whole, a chunk never written
        filled with the fill value."""
        import numcodecs

        assert self.decoder is not None
        config = self.decoder["config"]
        codec = None if config is None else numcodecs.get_codec(dict(config))
        rows, n = self.chunk_rows, int(self.n_rows or 0)
        encode = self._array().metadata.encode_chunk_key
        zeros = (0,) * len(self.row_shape)
        for i in range(a // rows, -(-b // rows)):
            first, last = i * rows, min(n, (i + 1) * rows)
            lo, hi = max(a, first), min(b, last)
            key = encode((i, *zeros))
            try:
                with open(os.path.join(self.url, key), "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                out[lo - a : hi - a] = self.fill
                continue
            try:
                if hi - lo == rows:  # the whole chunk: decoded in place
                    _decode_into(codec, raw, out[lo - a : hi - a])
                else:  # the array's last chunk, stored whole: its first rows
                    chunk = np.empty((rows, *self.row_shape), self.dtype)
                    _decode_into(codec, raw, chunk)
                    out[lo - a : hi - a] = chunk[lo - first : hi - first]
            except Exception as exc:
                raise SourceError(
                    f"{self.url}: chunk {key!r} (rows {first}:{last}) cannot be read: {exc}. "
                    "The object is damaged or was written with a codec this installation lacks"
                ) from None
        return out

    def _corrupt(self, array: Any, a: int, b: int, exc: Exception) -> SourceError:
        """The error naming the stored object of rows ``a:b`` that cannot be read."""
        rows, n = self.chunk_rows, int(self.n_rows or 0)
        grid = [range(-(-k // u)) for k, u in zip(self.row_shape, self.unit[1:], strict=True)]
        for i in range(a // rows, -(-b // rows)):
            first, last = i * rows, min(n, (i + 1) * rows)
            for rest in itertools.product(*grid):
                trailing = [
                    slice(j * u, (j + 1) * u) for j, u in zip(rest, self.unit[1:], strict=True)
                ]
                try:
                    array[tuple([slice(first, last), *trailing])]
                except Exception as found:
                    key = array.metadata.encode_chunk_key((i, *rest))
                    return SourceError(
                        f"{self.url}: chunk {key!r} (rows {first}:{last}) cannot be read: "
                        f"{found}. The object is damaged or was written with a codec this "
                        "installation lacks"
                    )
        return SourceError(f"{self.url}: reading rows {a}:{b} failed: {exc}")

    def check(self) -> None:
        if self._objects() != self.objects:
            raise SourceError(
                f"{self.url} changed after the array was built from it (its objects' sizes, "
                "times or ETags differ); its shape and key describe the old contents, so "
                "tierflow will not read it. Build the array again (tw.from_zarr) to use it"
            )

    def token(self) -> str:
        meta = hashlib.sha256(self.metadata.encode()).hexdigest()[:16]
        return f"zarr({self.url!r},{meta},{self.objects[:32]})"

    def files(self) -> list[str]:
        if _is_url(self.url):
            return []  # object storage: every worker reaches it by URL
        for name in ("zarr.json", ".zarray"):
            path = os.path.join(self.url, name)
            if os.path.exists(path):
                return [path]
        return []


def _digest(listing: dict[str, dict[str, Any]]) -> str:
    """A digest of the stored objects' keys, sizes and modification times or ETags."""
    digest = hashlib.sha256()
    for name in sorted(listing):
        info = listing[name]
        when = info.get("ETag") or info.get("mtime") or info.get("LastModified") or ""
        digest.update(f"{name}\0{info.get('size')}\0{when}\n".encode())
    return digest.hexdigest()


def _direct_decoder(array: Any) -> dict[str, Any] | None:
    """How to decode the chunks of ``array`` without zarr's read path, or None where it
    does not apply. It applies to the common layout: an unsharded array in a local folder
    whose chunks span the whole of every axis but the first, C order, native byte
    order, and one compressor from numcodecs (blosc, zstd, gzip) or none, no filters.
    Then a block is decoded chunk by chunk straight into it: half the copies and none of
    zarr's per-read machinery (1.1-1.5x zarr's own read of the same rows)."""
    from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, ZstdCodec

    meta = array.metadata
    if getattr(array, "shards", None) or tuple(array.chunks[1:]) != tuple(array.shape[1:]):
        return None
    if not isinstance(array.store, _zarr_local_store()):
        return None
    dtype = np.dtype(array.dtype)
    if not dtype.isnative or dtype.hasobject:
        return None
    if array.metadata.zarr_format == 2:
        if meta.filters or meta.order != "C":
            return None
        compressor = meta.compressor
        config = compressor.get_config() if compressor is not None else None
    else:
        codecs = list(meta.codecs)
        if not codecs or not isinstance(codecs[0], BytesCodec):
            return None
        endian = codecs[0].endian
        if dtype.itemsize > 1 and (endian is None or endian.value != sys.byteorder):
            return None
        rest = codecs[1:]
        if len(rest) > 1:
            return None
        known = {BloscCodec: "blosc", ZstdCodec: "zstd", GzipCodec: "gzip"}
        config = None
        if rest:
            kind = known.get(type(rest[0]))
            if kind is None:
                return None
            config = {"id": kind}
    if config is not None and config.get("id") not in ("blosc", "zstd", "gzip", "zlib", "lz4"):
        return None
    return {"config": config}


def _zarr_local_store() -> type:
    from zarr.storage import LocalStore

    return LocalStore


def _decode_into(codec: Any, raw: bytes, dest: np.ndarray) -> np.ndarray:
    """``raw`` decoded into ``dest`` (C-contiguous); raises ValueError when it does not
    decode to exactly ``dest``'s bytes."""
    if codec is None:
        decoded: Any = raw
    elif codec.codec_id == "blosc":  # blosc's header says the size: decoded in place
        if len(raw) < 16:
            raise ValueError(f"{len(raw)} bytes are too few for a blosc frame")
        size = int.from_bytes(raw[4:8], "little")  # the header's decoded size
        if size != dest.nbytes:
            raise ValueError(f"it decodes to {size} bytes, not the chunk's {dest.nbytes}")
        codec.decode(raw, out=dest)
        return dest
    else:
        decoded = codec.decode(raw)
    view = memoryview(decoded).cast("B")
    if view.nbytes != dest.nbytes:
        raise ValueError(f"it decodes to {view.nbytes} bytes, not the chunk's {dest.nbytes}")
    dest.reshape(-1).view(np.uint8)[:] = np.frombuffer(view, np.uint8)
    return dest


# -- HDF5 ------------------------------------------------------------------------------


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


# -- Parquet ---------------------------------------------------------------------------


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
