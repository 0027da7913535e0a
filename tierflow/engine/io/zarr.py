"""Zarr arrays: :class:`ZarrReader` (``tw.from_zarr``) and :class:`ZarrSink`
(``to_zarr``).

A Zarr array (format 3 or 2) on a local disk or in object storage (an fsspec URL:
``s3://...``). Blocks are whole numbers of chunks (of shards, for a sharded array) along
axis 0, the chunks along the other axes read together; zarr reads and decompresses them
in the process that runs the task (or tierflow decodes the chunks straight into the
block, for the common local layout). A chunk that was never written reads as the fill
value; a chunk that cannot be decoded raises ``SourceError`` naming its key. An array a
``to_zarr`` left unfinished (marked ``tierflow: {"complete": false}``) is refused with
``IncompleteError``, counting the chunks not stored, unless the caller allows it. Its
identity is the store URL, the array's metadata, and every stored object's size and
modification time (or ETag, in object storage): an array changed after it was opened is
refused at the next compute.

``to_zarr`` follows :mod:`tierflow.engine.io.destination`'s rules: it writes beside the
destination and swaps at the end, refuses to replace what it did not write, and resumes
an unfinished array of its own.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sys
import threading
from typing import Any

import numpy as np

from ...errors import IncompleteError, SourceError, missing_dependency
from ...operators import byteorder
from ...storage.pool import Scratch
from ..graph import Chunked
from .destination import (
    chunk_key,
    claim_zarr,
    inspect_zarr,
    local_path,
    remove_zarr,
    swap_zarr,
    sweep_temps,
    temp_zarr_url,
)
from .readers import Reader

__all__ = [
    "AHEAD_MAX",
    "S3_TIMEOUTS",
    "WRITE_EVERY_CHUNK",
    "ZarrReader",
    "ZarrRows",
    "ZarrSink",
]


# botocore's defaults wait 60 s for a connection and try 5 times: minutes before a
# compute learns that an endpoint is down. Used unless storage_options has config_kwargs.
S3_TIMEOUTS = {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3}}


_ahead_threads: Any = None


def _zarr() -> Any:
    try:
        import zarr
    except ImportError:
        raise missing_dependency("zarr", "zarr", "tw.from_zarr") from None
    return zarr


AHEAD_MAX = 8  # blocks of object storage fetched ahead, per reader and process
_ahead_lock = threading.Lock()


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


class ZarrRows:
    """Where a worker process writes a Zarr sink's known rows: the array at ``url``,
    opened once per process (small and picklable)."""

    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url
        self.storage_options = storage_options
        self._open: tuple[int, Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (ZarrRows, (self.url, self.storage_options))

    def array(self) -> Any:
        if self._open is None or self._open[0] != os.getpid():
            self._open = (os.getpid(), _open_zarr(self.url, self.storage_options, "r+"))
        return self._open[1]

    def write(self, row: int, block: np.ndarray) -> None:
        """Write ``block`` at row ``row``: whole chunks (the planner cut the tasks so)."""
        if len(block):
            self.array()[row : row + len(block)] = block


def _open_zarr(url: str, storage_options: dict[str, Any], mode: str) -> Any:
    import zarr

    if "://" in url:
        array = zarr.open_array(url, mode=mode, storage_options=storage_options)
    else:
        array = zarr.open_array(url, mode=mode)
    return array.with_config(WRITE_EVERY_CHUNK)  # open_array leaves config= out


def _zarr_url(path_or_url: str | os.PathLike[str]) -> str:
    text = os.fspath(path_or_url)
    if text.startswith("file://"):
        text = text[len("file://") :]
    return text if "://" in text else local_path(text)


class ZarrSink:
    """The result of ``to_zarr``: a Zarr array, written in whole chunks (or shards).

    The array is created at :meth:`open` with the attribute ``tierflow: {"complete":
    false, "key": ...}`` (the compute's key, when it has one that names its inputs'
    contents), set to ``complete: true`` by :meth:`commit` once the last block is in; a
    run that fails or is killed leaves it marked incomplete, with no torn chunk (each
    chunk is one object, written whole: zarr's local store writes a temporary file and
    renames it, an object store puts it at once). Where it is written follows
    :func:`~tierflow.engine.io.destination.claim_zarr`: in place where nothing was (or
    where this compute's own incomplete array was, its keys removed first), beside the
    destination and swapped in at :meth:`commit` where an array is replaced
    (``overwrite=True``). Known rows: each block task writes its rows, whole
    chunks, where it runs (:meth:`place`); :attr:`align` makes the planner cut tasks on
    chunk edges. Unknown rows (after a mask): blocks are appended in row order, whole
    chunks written as they fill, the array resized as it grows.
    """

    appends = True  # unknown row counts: appended in order, as a .npy file is

    def __init__(  # noqa: PLR0913 -- to_zarr's options, passed through
        self,
        node: Chunked,
        path_or_url: str | os.PathLike[str],
        *,
        chunks: Any = None,
        shards: Any = None,
        compressors: Any = "auto",
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        try:
            import zarr  # noqa: F401
        except ImportError:
            from ...errors import missing_dependency

            raise missing_dependency("zarr", "zarr", "to_zarr") from None
        self.node = node
        self.url = _zarr_url(path_or_url)
        self.storage_options = dict(storage_options or {})
        self.known = node.n_rows is not None
        self.dtype: np.dtype = node.dtype  # type: ignore[assignment]
        self.row_shape = tuple(node.row_shape)
        self.row_nbytes = self.dtype.itemsize * math.prod(self.row_shape)
        self.chunks = self._chunks(chunks)
        self.shards = None if shards is None else self._full(shards, "shards")
        if self.shards is not None and any(
            s % c for s, c in zip(self.shards, self.chunks, strict=True)
        ):
            raise ValueError(
                f"to_zarr: shards {self.shards} must be whole numbers of chunks {self.chunks}"
            )
        self.align = (self.shards or self.chunks)[0]  # rows of one stored object
        if self.known and node.bounds is not None:
            off = [a for a in node.bounds[1:-1] if a % self.align]
            if off:
                raise ValueError(
                    f"to_zarr: the array's blocks start at rows such as {off[0]}, which are not "
                    f"whole {'shards' if self.shards else 'chunks'} of {self.align} rows; pass "
                    f"chunks= (and shards=) dividing the block size, or build the array with "
                    f"rows= a multiple of {self.align}"
                )
        self.compressors = compressors
        self.overwrite = overwrite
        # The compute's key, recorded in the array's mark: a run of the same compute
        # finishes an array it left incomplete. A key that names an object of this
        # process only (a big in-memory array) is not recorded.
        self.key: str | None = None if node.ident.startswith("id:") else node.ident
        self.mode = ""  # how claim() found the destination: "new", "resume", "replace"
        self.write_url = self.url  # where the array is written: the url, or a temporary
        self.array: Any = None
        self._scratch = Scratch(self.dtype, self.row_shape)
        self._tail: list[np.ndarray] = []  # appended rows not yet a whole object
        self._tail_rows = 0
        self._written = 0  # rows written by appends

    def _full(self, value: Any, what: str) -> tuple[int, ...]:
        if isinstance(value, (int, np.integer)):
            return (int(value), *self.row_shape)
        shape = tuple(int(n) for n in value)
        if len(shape) != 1 + len(self.row_shape) or min(shape, default=1) < 1:
            raise ValueError(
                f"to_zarr: {what}={value!r}: give rows per {what[:-1]} (an int), or a shape of "
                f"{1 + len(self.row_shape)} positive sizes"
            )
        return shape

    def _chunks(self, chunks: Any) -> tuple[int, ...]:
        if chunks is not None:
            return self._full(chunks, "chunks")
        bounds = self.node.bounds
        if self.known and bounds is not None and len(bounds) > 2:
            return (max(1, bounds[1] - bounds[0]), *self.row_shape)
        from ..graph import blocksize

        rows = blocksize.default_rows(self.row_nbytes, self.node.n_rows)
        if self.known:
            rows = min(rows, max(1, self.node.n_rows or 1))
        return (rows, *self.row_shape)

    def claim(self) -> None:
        """Refuse a destination this sink may not write (see
        :mod:`tierflow.engine.io.destination`), before anything is computed; remember how
        it will be written."""
        self.mode = claim_zarr(
            self.url, self.storage_options, overwrite=self.overwrite, key=self.key
        )

    def open(self) -> None:
        """Create the array, marked incomplete: at the destination, or beside it when an
        array there is replaced (see :meth:`claim`)."""
        import zarr

        self.claim()
        local = "://" not in self.url
        if local:
            sweep_temps(os.path.dirname(self.url))
        if self.mode == "resume":
            found = inspect_zarr(self.url, self.storage_options)
            remove_zarr(self.url, self.storage_options, list(found.keys))
        self.write_url = temp_zarr_url(self.url) if self.mode == "replace" else self.url
        mark: dict[str, Any] = {"complete": False}
        if self.key is not None:
            mark["key"] = self.key
        options: dict[str, Any] = {"config": WRITE_EVERY_CHUNK}
        if not local:
            options["storage_options"] = self.storage_options
        try:
            self.array = zarr.create_array(
                store=self.write_url,
                shape=(self.node.n_rows or 0, *self.row_shape),
                dtype=self.dtype,
                chunks=self.chunks,
                shards=self.shards,
                compressors=self.compressors,
                attributes={"tierflow": mark},
                **options,
            )
        except BaseException:
            self.abort()
            raise

    def place(self) -> ZarrRows | None:
        """Where another process writes known rows: the array, by URL."""
        return ZarrRows(self.write_url, self.storage_options) if self.known else None

    def task_bytes(self, rows: int) -> int:
        """The block a task writes from, and the encoder's copy of it."""
        return 2 * rows * self.row_nbytes

    def dest(self, a: int, b: int) -> np.ndarray:
        return self._scratch.get(b - a)

    def written(self, a: int, b: int, block: np.ndarray) -> None:
        if b > a:
            self.array[a:b] = block

    def append(self, row: int, block: np.ndarray) -> int:
        """Rows ``row:row + len(block)`` (unknown row counts, in order); the next row.
        Whole objects are written as they fill."""
        if len(block):
            self._tail.append(np.array(block, dtype=self.dtype))
            self._tail_rows += len(block)
            if self._tail_rows >= self.align:
                self._flush(whole=True)
        return row + len(block)

    def _flush(self, whole: bool) -> None:
        rows = byteorder.join(self._tail) if len(self._tail) > 1 else self._tail[0]
        take = (len(rows) // self.align) * self.align if whole else len(rows)
        start = self._written
        self.array.resize((start + take, *self.row_shape))
        self.array[start : start + take] = rows[:take]
        self._written += take
        rest = rows[take:]
        self._tail = [rest] if len(rest) else []
        self._tail_rows = len(rest)

    def commit(self, n_rows: int | None = None) -> None:
        """Write what is left, mark the array complete, and swap it into the place of
        the array it replaces (if any)."""
        self._scratch.clear()
        if not self.known and self._tail_rows:
            self._flush(whole=False)
        attributes = dict(self.array.attrs.asdict())
        attributes["tierflow"] = {**attributes.get("tierflow", {}), "complete": True}
        self.array.update_attributes(attributes)
        if self.write_url != self.url:
            swap_zarr(self.write_url, self.url, self.storage_options)
            self.write_url = self.url

    def abort(self) -> None:
        """Leave an array written in place as it is, marked incomplete (no chunk is
        torn); remove one written beside the destination (the destination is as it
        was)."""
        self._scratch.clear()
        self._tail = []
        if self.write_url != self.url:
            remove_zarr(self.write_url, self.storage_options)
            self.write_url = self.url


# Zarr leaves a chunk equal to the fill value unwritten, and takes a complex chunk of
# negative zeros for one (0j): it would read back as +0.0. A sink writes every chunk it
# computed, so what it wrote reads back as it was, and a chunk not there was not written.
WRITE_EVERY_CHUNK: Any = {"write_empty_chunks": True}  # zarr's ArrayConfigParams
