"""What a sink may replace at its destination, and how its output takes the place.

The rules, for ``to_npy`` and ``to_zarr`` alike (docs/engine.md, "Where results go")::

    at the destination               overwrite=False       overwrite=True
    nothing, or an empty folder      written               written
    the sink's own kind of output    refused               replaced, once the new
                                                           one is complete
    anything else                    refused               refused

* **Checked before anything runs.** :func:`check_npy` and :func:`claim_zarr` raise
  :class:`~tierflow.errors.DestinationExistsError` (a ``FileExistsError``), saying what
  is there and what to do, before a block is computed. The sink checks again when it
  opens, and the final rename never replaces a file it was not allowed to.
* **The sink's own kind of output.** For ``to_npy``: a ``.npy`` file (or an empty
  file). For ``to_zarr``: a Zarr array whose folder or prefix holds nothing but the
  array's metadata and chunk keys (:func:`own_key`). A folder, another kind of file, a
  Zarr group, or a README beside the array is never replaced: a sink owns only what it
  wrote.
* **Write beside, swap at the end.** A replacing sink writes under a temporary name next
  to the destination (:func:`temp_file`, :func:`temp_zarr_url`). The old output stays
  until the new one is complete, so an output that is also a source of the same compute
  is read whole while it is rewritten. Then:

  - a ``.npy`` file is renamed over the old one;
  - a local Zarr folder is exchanged with the old one in one step (``renameat2`` with
    ``RENAME_EXCHANGE``; two renames where the filesystem lacks it), and the old
    array's keys are removed;
  - in object storage (no rename), the destination's metadata is first replaced by the
    new metadata marked incomplete, then the new objects are copied over the old ones,
    the old array's other keys deleted, and the metadata marked complete last. A
    process killed half-way leaves an array marked incomplete, never a wrong one.

* **Resuming.** ``to_zarr`` marks its array ``tierflow: {"complete": false, "key":
  ...}`` until the last block is in. An incomplete array whose key is the compute's own
  is that compute's unfinished output: the same ``to_zarr`` run again replaces it in
  place, without ``overwrite=True`` (with ``cache=``, computing only the blocks not
  cached). The key is the compute's node key, which names its inputs' contents; a
  compute over a big in-memory array has no such key, so its array needs
  ``overwrite=True``.

Temporary names hold the writer's :func:`~tierflow.system.processes.token`
(``.<name>.tf<pid>-<start>-<random>.tmp``), so the next sink writing into the same
folder removes those of writers that are gone (:func:`sweep_temps`): a file, or a
folder that holds a Zarr array's keys and nothing else. A temporary prefix in object
storage is not swept.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from ...errors import DestinationExistsError
from ...system import processes

__all__ = [
    "ZarrFound",
    "check_npy",
    "chunk_key",
    "claim_zarr",
    "inspect_zarr",
    "install_file",
    "local_path",
    "own_key",
    "remove_zarr",
    "swap_zarr",
    "sweep_temps",
    "temp_file",
    "temp_zarr_url",
]

_NPY_MAGIC = b"\x93NUMPY"
# .<target name>.tf<pid>-<start time>-<random part>.tmp
_TEMP_RE = re.compile(r"\..+\.tf(\d+)-(\d+)-[A-Za-z0-9_]+\.tmp")
_METADATA = frozenset({"zarr.json", ".zarray", ".zattrs"})
# Chunk (or shard) keys: format 3's default encoding ("c/0/1", "c.0.1", "c" for 0-d) and
# format 2's ("0.1", "0/1").
_CHUNK_RE = re.compile(r"c([/.]\d+)*|\d+([/.]\d+)*")
# What zarr's local store leaves of a write that was killed: "<key stem>.<uuid>.partial".
_PARTIAL_RE = re.compile(r"(.*)\.[0-9a-f]{32}\.partial")
_SHOWN = 3  # foreign names quoted in a message

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _umask() -> int:
    """This process's umask, read without setting it: ``os.umask`` can only read it by
    setting it, which for a moment changes the mode of every other thread's new files."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_file(path: str) -> tuple[int, str]:
    """A new temporary file next to ``path`` named for this process: ``(fd, name)``.

    Its mode follows the umask, as a file ``np.save`` creates does (0644 under umask
    022), since it is renamed to be the output: ``mkstemp`` alone makes it 0600.
    """
    folder, base = os.path.split(path)
    fd, name = tempfile.mkstemp(prefix=f".{base}.tf{processes.token()}-", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except BaseException:
        os.close(fd)
        os.unlink(name)
        raise
    return fd, name


def sweep_temps(folder: str) -> list[str]:
    """Remove the temporary outputs in ``folder`` whose writer is gone (see the module
    docstring); the paths removed. One whose writer may still run is kept, a folder
    holding anything but a Zarr array's keys is kept, and nothing that does not follow
    the temporary name's pattern is touched."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP_RE.fullmatch(entry.name)
        if match is None or entry.is_symlink():
            continue
        if processes.may_be_running(int(match.group(1)), int(match.group(2))):
            continue
        if entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(entry.path)
        elif entry.is_dir():
            keys = _local_keys(entry.path)
            if keys is not None and all(own_key(k) for k in keys):
                _remove_local(entry.path, keys)
                removed.append(entry.path)
    return removed


def local_path(path: str | os.PathLike[str]) -> str:
    """The absolute path a sink writes for ``path``, links resolved: a link to a file or
    a folder is written through (the output replaces what it points to, and the link
    stays), as ``np.save`` writes through one."""
    return os.path.realpath(os.path.abspath(os.fspath(path)))


# -- renames that never replace by accident --------------------------------------------


def _load_renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def _rename2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the system or filesystem lacks it."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), src, None, dst)


def _rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists, whatever it is."""
    if _rename2(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.isfile(src):
        try:
            os.link(src, dst)  # fails if dst exists: the check and the rename are one
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                raise
        else:
            os.unlink(src)
            return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


# -- .npy files ----------------------------------------------------------------------


def _npy_kind(path: str) -> str | None:
    """What is at ``path`` for ``to_npy``: None (nothing), "npy" (a ``.npy`` file or an
    empty one, which holds nothing to lose), "folder" or "other"."""
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path):
        return "folder"
    try:
        with open(path, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
    except OSError:
        return "other"
    return "npy" if head in (b"", _NPY_MAGIC) else "other"


def check_npy(path: str, overwrite: bool) -> None:
    """Raise :class:`~tierflow.errors.DestinationExistsError` unless ``to_npy`` may write
    ``path``: nothing there, or a ``.npy`` file and ``overwrite``."""
    kind = _npy_kind(path)
    if kind is None or (kind == "npy" and overwrite):
        return
    if kind == "npy":
        raise DestinationExistsError(
            f"to_npy: {path} exists (a .npy file of {os.path.getsize(path)} bytes); pass "
            "overwrite=True to replace it (the new file takes its place only once it is "
            "complete), or write elsewhere"
        )
    what = "a folder" if kind == "folder" else "a file that is not a .npy file"
    raise DestinationExistsError(
        f"to_npy: {path} is {what}; to_npy replaces only a .npy file, never this, even "
        "with overwrite=True: write elsewhere, or move it away"
    )


def install_file(tmp: str, path: str, overwrite: bool) -> None:
    """Rename the finished file ``tmp`` to ``path``: over a ``.npy`` file there only with
    ``overwrite`` (checked again now), never over anything else. ``tmp`` is left in place
    when this raises (the sink's abort removes it)."""
    if overwrite:
        check_npy(path, overwrite)
        os.replace(tmp, path)
        return
    try:
        _rename_noreplace(tmp, path)
    except FileExistsError:
        raise DestinationExistsError(
            f"to_npy: {path} appeared while the file was being written; it was left as it "
            "is. Pass overwrite=True to replace it, or write elsewhere"
        ) from None


# -- Zarr arrays -------------------------------------------------------------------------


def chunk_key(key: str) -> bool:
    """Whether ``key`` (relative to an array's folder or prefix, ``/``-separated) names a
    chunk or a shard."""
    return _CHUNK_RE.fullmatch(key) is not None


def own_key(key: str) -> bool:
    """Whether ``key`` (as in :func:`chunk_key`) is one a Zarr array writes: its
    metadata, a chunk or shard, or what a killed write of one left (zarr's ``.partial``
    files)."""
    partial = _PARTIAL_RE.fullmatch(key)
    if partial is not None:
        stem = partial.group(1)
        return stem in ("zarr", ".zarray", ".zattrs") or chunk_key(stem)
    return key in _METADATA or chunk_key(key)


def _is_url(text: str) -> bool:
    return "://" in text


def _fs(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, root.rstrip("/")


def _local_keys(root: str) -> list[str] | None:
    """Every file under the folder ``root`` as a ``/``-separated key (a link to a folder
    counts as one key); None if ``root`` is not a folder."""
    if not os.path.isdir(root):
        return None
    keys: list[str] = []
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        keys.extend(prefix + name for name in files)
        keys.extend(prefix + name for name in dirs if os.path.islink(os.path.join(folder, name)))
    return keys


def _remove_local(root: str, keys: list[str]) -> None:
    """Remove ``keys`` under the folder ``root``, then the folders they leave empty
    (``root`` too); a folder still holding something stays."""
    for key in keys:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, *key.split("/")))
    for folder, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


@dataclass(frozen=True)
class ZarrFound:
    """What :func:`inspect_zarr` found at a Zarr destination."""

    url: str
    is_file: bool = False  # a file (an object) where the folder (prefix) would be
    keys: tuple[str, ...] = ()  # every key under it
    node: str | None = None  # "array", "group", or None (no Zarr metadata)
    marker: Any = None  # the array's ``tierflow`` attribute, if any

    @property
    def empty(self) -> bool:
        return not self.is_file and not self.keys

    @property
    def foreign(self) -> list[str]:
        """Keys that are not the array's own (all of them when there is no array)."""
        if self.node != "array":
            return list(self.keys)
        return [k for k in self.keys if not own_key(k)]

    @property
    def incomplete(self) -> bool:
        return isinstance(self.marker, dict) and self.marker.get("complete") is False

    def describe(self) -> str:
        """What is there, in words."""
        if self.is_file:
            return "a file"
        if self.node == "group":
            return "a Zarr group"
        foreign = self.foreign
        if foreign:
            shown = ", ".join(repr(k) for k in sorted(foreign)[:_SHOWN])
            more = f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
            if self.node == "array":
                return f"a Zarr array and {len(foreign)} other file(s): {shown}{more}"
            return f"{len(foreign)} file(s) that are not a Zarr array's: {shown}{more}"
        if not isinstance(self.marker, dict):
            return "a Zarr array"
        if self.incomplete:
            return "an incomplete Zarr array that a to_zarr of another compute left"
        return "a Zarr array written by tierflow"


def _read_json(fs: Any, path: str) -> Any:
    try:
        return json.loads(fs.cat_file(path))
    except (OSError, ValueError):
        return None


def inspect_zarr(url: str, options: dict[str, Any]) -> ZarrFound:
    """What is at the Zarr destination ``url`` (a local folder or an fsspec URL): its
    keys, whether they make a Zarr array or group, and the array's ``tierflow`` mark."""
    if not _is_url(url):
        if os.path.lexists(url) and not os.path.isdir(url):
            return ZarrFound(url, is_file=True)
        keys = _local_keys(url) or []
    else:
        fs, root = _fs(url, options)
        if fs.isfile(root):
            return ZarrFound(url, is_file=True)
        keys = [p[len(root) :].lstrip("/") for p in fs.find(root)]
    names = set(keys)
    if not names & _METADATA:
        return ZarrFound(url, keys=tuple(keys))
    fs, root = _fs(url, options) if _is_url(url) else (_local_fs(), url)
    meta = _read_json(fs, f"{root}/zarr.json") if "zarr.json" in names else None
    if isinstance(meta, dict):
        node = meta.get("node_type")
        attributes = meta.get("attributes") or {}
    elif ".zarray" in names:
        node = "array"
        attributes = _read_json(fs, f"{root}/.zattrs") if ".zattrs" in names else {}
    else:
        node, attributes = ("group" if ".zgroup" in names else None), {}
    marker = attributes.get("tierflow") if isinstance(attributes, dict) else None
    return ZarrFound(url, keys=tuple(keys), node=node, marker=marker)


def _local_fs() -> Any:
    import fsspec

    return fsspec.filesystem("file")


def claim_zarr(url: str, options: dict[str, Any], *, overwrite: bool, key: str | None) -> str:
    """How ``to_zarr`` may write at ``url``: ``"new"`` (nothing there: write in place),
    ``"resume"`` (this compute's own incomplete array, ``key`` in its mark: remove its
    keys, write in place) or ``"replace"`` (a Zarr array alone in its folder, and
    ``overwrite``: write beside, swap at the end). Raises
    :class:`~tierflow.errors.DestinationExistsError` for anything else."""
    found = inspect_zarr(url, options)
    if found.empty:
        return "new"
    if found.is_file:
        raise DestinationExistsError(
            f"to_zarr: {url} is a file; to_zarr writes a folder (a prefix) and never "
            "replaces a file, even with overwrite=True: write elsewhere, or move it away"
        )
    replaceable = found.node == "array" and not found.foreign
    if replaceable and found.incomplete and key is not None and found.marker.get("key") == key:
        return "resume"
    if replaceable and overwrite:
        return "replace"
    if replaceable:
        raise DestinationExistsError(
            f"to_zarr: {url} already holds {found.describe()}; pass overwrite=True to "
            "replace it (its metadata and chunks are removed only once the new array is "
            "complete), or write elsewhere"
        )
    raise DestinationExistsError(
        f"to_zarr: {url} holds {found.describe()}. to_zarr replaces only a Zarr array that "
        "is alone in its folder (its metadata and chunks), never anything else, even with "
        "overwrite=True: write elsewhere, or move those away"
    )


def temp_zarr_url(url: str) -> str:
    """A new temporary place next to ``url`` named for this process: a folder it creates
    (mode as the umask gives folders), or a prefix in object storage."""
    if _is_url(url):
        parent, base = url.rstrip("/").rsplit("/", 1)
        return f"{parent}/.{base}.tf{processes.token()}-{secrets.token_hex(6)}.tmp"
    parent, base = os.path.split(url.rstrip("/"))
    folder = tempfile.mkdtemp(prefix=f".{base}.tf{processes.token()}-", suffix=".tmp", dir=parent)
    os.chmod(folder, 0o777 & ~_umask())
    return folder


def remove_zarr(url: str, options: dict[str, Any], keys: list[str] | None = None) -> None:
    """Remove ``keys`` of the array at ``url`` (None: every key there, for a temporary
    place this process made), then, locally, the folders that leaves empty."""
    if not _is_url(url):
        if keys is None:
            shutil.rmtree(url, ignore_errors=True)
        else:
            _remove_local(url, keys)
        return
    fs, root = _fs(url, options)
    if keys is None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(root, recursive=True)
    elif keys:
        fs.rm([f"{root}/{k}" for k in keys])


def swap_zarr(temp: str, url: str, options: dict[str, Any]) -> None:
    """Put the complete array at ``temp`` in the place of the array at ``url`` (checked
    again: a Zarr array alone in its folder, or nothing), then remove the old one's keys
    and ``temp`` (see the module docstring)."""
    found = inspect_zarr(url, options)
    if not found.empty and (found.is_file or found.node != "array" or found.foreign):
        raise DestinationExistsError(
            f"to_zarr: {url} now holds {found.describe()}, which appeared while the new "
            f"array was being written; nothing was replaced. Move those away and run again"
        )
    if _is_url(url):
        _swap_objects(temp, url, options, list(found.keys))
    else:
        _swap_local(temp, url)


def _swap_local(temp: str, url: str) -> None:
    if not os.path.lexists(url):
        _rename_noreplace(temp, url)
        return
    if _rename2(temp, url, _RENAME_EXCHANGE):
        old = temp  # the exchange left the old array under the temporary name
    else:
        old = f"{temp[: -len('.tmp')]}.old"
        os.rename(url, old)
        os.rename(temp, url)
    _remove_local(old, _local_keys(old) or [])


def _swap_objects(temp: str, url: str, options: dict[str, Any], old_keys: list[str]) -> None:
    fs, root = _fs(url, options)
    _, temp_root = _fs(temp, options)
    new_keys = [p[len(temp_root) :].lstrip("/") for p in fs.find(temp_root)]
    meta = json.loads(fs.cat_file(f"{temp_root}/zarr.json"))
    unfinished = dict(meta)
    attributes = dict(unfinished.get("attributes") or {})
    attributes["tierflow"] = {**attributes.get("tierflow", {}), "complete": False}
    unfinished["attributes"] = attributes
    fs.pipe_file(f"{root}/zarr.json", json.dumps(unfinished, indent=2).encode())
    chunks = [k for k in new_keys if k != "zarr.json"]
    if chunks:
        fs.copy([f"{temp_root}/{k}" for k in chunks], [f"{root}/{k}" for k in chunks])
    kept = set(new_keys)
    stale = [k for k in old_keys if k not in kept]
    if stale:
        fs.rm([f"{root}/{k}" for k in stale])
    fs.pipe_file(f"{root}/zarr.json", json.dumps(meta, indent=2).encode())
    remove_zarr(temp, options)
