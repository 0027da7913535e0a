"""Intermediates that another process reads, perhaps on another node: blocks a cluster
worker hands back to the driver, in a shared folder or in object storage.

The place is the ``shared_dir`` setting (``TIERFLOW_SHARED_DIR``): a folder every worker
mounts at the same path, or an fsspec URL (``s3://bucket/prefix``, ``gs://...``,
``file:///...``), reached with the ``shared_options`` setting (the filesystem's
``storage_options``: endpoint, credentials), which travels to the workers with the
other settings. The same functions serve both, by path or URL:

* :func:`write_npy` (and :func:`write_bytes`: an external sort's runs) writes ``.npy``
  bytes under a temporary name and then commits them
  under the final one (a rename in a folder; in object storage a copy to the final key
  and the temporary key deleted), so a reader never sees a partial object and a task
  retried or run twice is harmless;
* :func:`read_npy` reads one back whole, :func:`read_range` a byte range of one
  (ranged reads: a ``GET`` with a ``Range`` header in object storage);
* :func:`remove` and :func:`remove_matching` delete them (a missing one is fine);
  :func:`listing` lists what is under a prefix, for the driver to remove what attempts
  it stopped may have left.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from .. import config

__all__ = [
    "is_url",
    "join",
    "listing",
    "makedirs",
    "read_npy",
    "read_range",
    "remove",
    "remove_matching",
    "write_bytes",
    "write_npy",
]


def is_url(place: str) -> bool:
    """Whether ``place`` is an fsspec URL (``protocol://...``) rather than a path."""
    return "://" in place


def join(place: str, name: str) -> str:
    """``name`` inside the folder or prefix ``place``."""
    return f"{place.rstrip('/')}/{name}" if is_url(place) else os.path.join(place, name)


def _fs(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` (with the ``shared_options`` setting) and the
    path within it."""
    import fsspec

    options = config.get("shared_options") or {}
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs, path


def makedirs(place: str) -> None:
    """Make the folder ``place`` (a prefix in object storage needs nothing)."""
    if is_url(place):
        fs, path = _fs(place)
        with contextlib.suppress(FileExistsError):
            fs.makedirs(path, exist_ok=True)
        return
    os.makedirs(place, exist_ok=True)


def write_npy(stem: str, block: np.ndarray) -> str:
    """Write ``block`` as ``stem + ".npy"`` by way of ``stem + ".tmp"``; the final path
    or URL. A failed write leaves neither."""
    block = np.ascontiguousarray(block)
    return _commit(
        stem + ".tmp",
        stem + ".npy",
        lambda f: np.lib.format.write_array(f, block, allow_pickle=False),
    )


def write_bytes(stem: str, data: Any) -> str:
    """Write the bytes of ``data`` (a buffer) as ``stem + ".bin"`` by way of
    ``stem + ".tmp"``; the final path or URL. A failed write leaves neither."""
    return _commit(stem + ".tmp", stem + ".bin", lambda f: f.write(memoryview(data).cast("B")))


def _commit(temp: str, final: str, write: Callable[[BinaryIO], Any]) -> str:
    """``write(file)`` at ``temp``, then put at ``final`` in one step (a rename; in
    object storage a copy, the temporary key deleted). A file is written straight to
    disk; an object is made in memory first, as fsspec sends it whole."""
    if is_url(final):
        fs, temp_path = _fs(temp)
        _, final_path = _fs(final)
        buffer = io.BytesIO()
        write(buffer)
        try:
            fs.pipe_file(temp_path, buffer.getvalue())
            fs.mv(temp_path, final_path)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm_file(temp_path)
            raise
        return final
    try:
        with open(temp, "wb") as f:
            write(f)
        os.replace(temp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return final


def read_npy(path: str) -> np.ndarray:
    """The ``.npy`` at ``path`` (or URL), read whole into this process's RAM."""
    if is_url(path):
        fs, inner = _fs(path)
        return np.load(io.BytesIO(fs.cat_file(inner)), allow_pickle=False)
    return np.asarray(np.load(path, allow_pickle=False))


def read_range(path: str, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of the file or object at ``path``."""
    if is_url(path):
        fs, inner = _fs(path)
        return bytes(fs.cat_file(inner, start=start, end=stop))
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(stop - start)


def remove(path: str) -> None:
    """Delete the file or object at ``path``; gone already is fine."""
    if is_url(path):
        fs, inner = _fs(path)
        with contextlib.suppress(FileNotFoundError, OSError):
            fs.rm_file(inner)
        return
    with contextlib.suppress(OSError):
        os.unlink(path)


def listing(prefix: str) -> list[str]:
    """The files or objects whose path or URL starts with ``prefix`` (ending in "/":
    every one in that folder, at any depth)."""
    if is_url(prefix):
        fs, inner = _fs(prefix)
        protocol = prefix.split("://", 1)[0]
        fs.invalidate_cache()  # other processes wrote since the last listing
        try:  # a prefix ending in "/" is a folder: everything under it
            found = fs.find(inner) if prefix.endswith("/") else fs.glob(glob.escape(inner) + "*")
        except (FileNotFoundError, OSError):
            return []
        return [f"{protocol}://{p}" for p in found]
    if prefix.endswith("/"):
        return [os.path.join(d, f) for d, _, files in os.walk(prefix) for f in files]
    return glob.glob(glob.escape(prefix) + "*")


def remove_matching(prefix: str) -> None:
    """Delete every file or object whose path or URL starts with ``prefix``."""
    for path in listing(prefix):
        remove(path)
