"""A store in object storage: the engine's cache at an fsspec URL (``s3://bucket/cache``).

A cluster without a shared disk keeps its cache where every node reaches it: a prefix
in object storage, opened with the ``shared_options`` setting (the filesystem's
``storage_options``). :class:`ObjectStore` has the part of :class:`~.tiers.Store`'s
interface the engine's cache uses (``get``, ``set``, ``in``, ``count``, ``clear``,
``usage``, ``close``), with the same entry format (:mod:`.serial`) and the same trust:

* every entry is one object, ``<prefix>/<32 hex digits of the key>.tfe``, written as a
  complete signed entry to a local temporary file, sent under a temporary key and then
  committed under its final key (a copy, the temporary key deleted), so a reader never
  sees part of one, and two processes writing the same entry leave one whole entry;
* a read downloads the object to a local temporary file and checks it as a folder
  store does (the signed trailer, the key it holds, the pickle's digest) before anything
  is unpickled or mapped; an array comes back memory-mapped from that file, which is
  unlinked at once (the mapping keeps its pages);
* ``<prefix>/.tierflow-store`` records the signing key's id. A store signed with
  another key is refused when opened, and a prefix that holds other objects but no such
  record is not taken over. The key itself travels with the store when it is pickled
  (to a cluster's workers, with the tasks), so every worker signs and trusts the same
  entries: the bucket's other users cannot make a worker unpickle an entry without it.

There is no RAM tier and no size limit: object storage is billed, not full, and its
lifecycle rules expire what is old. :meth:`ObjectStore.clear` removes only this
layout's objects (entries and temporary keys), never other objects under the prefix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
import warnings
from typing import Any

from ... import config
from ...errors import StoreError
from .. import spill
from .keys import Key, encode_key, name_of
from .serial import EntryDamaged, StoreWarning, read_entry, write_entry
from .signing import Signer, load_key
from .tiers import FORMAT, MARKER, StoreUsage

__all__ = ["LISTING_SECONDS", "SUFFIX", "ObjectStore"]

log = logging.getLogger("tierflow.store")

SUFFIX = ".tfe"  # an entry's object: <32 hex digits>.tfe
LISTING_SECONDS = 5.0  # how old a listing ``in`` answers from may be
_opened: dict[tuple[str, bytes], ObjectStore] = {}  # stores unpickled here; _opened_lock
_opened_lock = threading.Lock()
_OURS = re.compile(r"^[0-9a-f]{32}\.tfe(\.tmp-[0-9a-f]{32})?$")  # entries and temporary keys


class ObjectStore:
    """The store at the fsspec URL ``url`` (see the module docstring).

    ``options``: fsspec storage options (default: the ``shared_options`` setting);
    ``key``: the signing key's bytes (default: this user's key file, as a folder store
    uses). Raises :class:`~tierflow.errors.StoreError` when the prefix is a store signed
    with another key, or holds other objects and is not a store.
    """

    ram_limit = 0  # no RAM tier: values are read from object storage each time
    disk_limit = 0  # no size limit (object storage expires entries by its own rules)
    durable = True

    def __init__(
        self, url: str, options: dict[str, Any] | None = None, key: bytes | None = None
    ) -> None:
        import fsspec

        self.path = url.rstrip("/")
        self.options = dict(config.get("shared_options") or {}) if options is None else options
        self._key = load_key() if key is None else key
        self._signer = Signer(self._key)
        self._fs, self._root = fsspec.core.url_to_fs(self.path, **self.options)
        self._root = self._root.rstrip("/")
        self.closed = False
        # The entries' names as last listed (see __contains__); _listed_lock guards them.
        self._listed: set[str] | None = None
        self._listed_at = 0.0
        self._listed_lock = threading.Lock()
        self._prepare()

    @property
    def name(self) -> str:
        """The last part of the prefix (``cache`` for ``s3://bucket/cache``)."""
        return self.path.rsplit("/", 1)[-1]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopened, (self.path, self.options, self._key))

    def __repr__(self) -> str:
        return f"ObjectStore({self.path!r}, key_id={self._signer.key_id!r})"

    # -- the prefix --

    def _prepare(self) -> None:
        """Record the key's id at a new prefix; refuse one signed with another key, or
        one that holds other objects and is not a store."""
        marker = f"{self._root}/{MARKER}"
        try:
            fields = json.loads(self._fs.cat_file(marker))
            if not isinstance(fields, dict):
                raise ValueError(f"it holds {type(fields).__name__}, not an object")
        except FileNotFoundError:
            fields = None
        except ValueError as exc:
            raise StoreError(
                f"{self.path}/{MARKER} is not a tierflow store record ({exc}); it was changed "
                "outside tierflow. Remove it only if the prefix holds nothing else"
            ) from exc
        if fields is None:
            others = [p for p in self._names() if not _OURS.match(p)]
            if others:
                raise StoreError(
                    f"{self.path} holds other objects ({', '.join(others[:3])}"
                    f"{', ...' if len(others) > 3 else ''}) and is not a tierflow store (no "
                    f"{MARKER}); give the cache a prefix of its own"
                )
            record = json.dumps({"format": FORMAT, "key_id": self._signer.key_id}).encode()
            self._fs.pipe_file(marker, record + b"\n")
            return
        theirs = str(fields.get("key_id"))
        if int(fields.get("format", 0)) > FORMAT:
            raise StoreError(
                f"{self.path} is a store of format {fields.get('format')}, newer than this "
                f"tierflow reads ({FORMAT}); upgrade tierflow or use another prefix"
            )
        if theirs != self._signer.key_id:
            raise StoreError(
                f"{self.path} was signed with key id {theirs}, and this process's key has id "
                f"{self._signer.key_id}, so none of its entries could be trusted. Give every "
                "driver that shares this cache the same key file (~/.tierflow/store.key, "
                "beside the store_dir setting), or use another prefix"
            )

    def _names(self) -> list[str]:
        """The names directly under the prefix (empty when it does not exist)."""
        self._fs.invalidate_cache(self._root)
        try:
            found = self._fs.ls(self._root, detail=False)
        except (FileNotFoundError, OSError):
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]

    def _object(self, key: Key) -> tuple[bytes, str]:
        encoded = encode_key(key)
        return encoded, f"{self._root}/{name_of(encoded)}{SUFFIX}"

    def _check_open(self) -> None:
        if self.closed:
            raise StoreError(f"store {self.path} is closed")

    # -- entries --

    def set(self, key: Key, value: Any, *, tag: str | None = None) -> None:
        """Store ``value`` under ``key``, replacing any value. Raises ``TypeError`` for a
        bad key, what pickling raises for an unpicklable value, and ``OSError`` for a
        failed write (nothing is left under the key's name then)."""
        self._check_open()
        encoded, final = self._object(key)
        fd, local = tempfile.mkstemp(suffix=SUFFIX, dir=spill.process_dir())
        temp = f"{final}.tmp-{uuid.uuid4().hex}"
        try:
            try:
                write_entry(fd, value, encoded, tag, self._signer)
            finally:
                os.close(fd)
            self._fs.put_file(local, temp)
            self._fs.mv(temp, final)
            with self._listed_lock:
                if self._listed is not None:
                    self._listed.add(final.rsplit("/", 1)[-1])
        except BaseException:
            with contextlib.suppress(Exception):
                self._fs.rm_file(temp)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(local)

    def get(self, key: Key, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when there is none. An object that fails
        the checks is a miss (never unpickled or mapped) and a ``StoreWarning``."""
        self._check_open()
        encoded, remote = self._object(key)
        fd, local = tempfile.mkstemp(suffix=SUFFIX, dir=spill.process_dir())
        os.close(fd)
        try:
            try:
                self._fs.get_file(remote, local)
            except FileNotFoundError:
                return default
            try:
                return read_entry(local, encoded, self._signer).value
            except EntryDamaged as exc:
                warnings.warn(
                    StoreWarning(
                        f"store {self.path}: the entry {remote.rsplit('/', 1)[-1]} failed its "
                        f"checks ({exc}); it is treated as missing and will be written again"
                    ),
                    stacklevel=2,
                )
                return default
        finally:
            with contextlib.suppress(OSError):
                os.unlink(local)  # a memory-mapped array keeps its pages

    def __contains__(self, key: object) -> bool:
        """Whether the store has ``key``, from a listing of the prefix at most
        :data:`LISTING_SECONDS` old (and the entries this object wrote since): one
        request per few seconds, not one per block. The engine asks only for hints
        (what readahead may skip, which nodes an earlier compute cached), and
        :meth:`get` is exact: an entry another process wrote in the last seconds may be
        missed here, not there."""
        self._check_open()
        _, remote = self._object(key)  # type: ignore[arg-type]
        name = remote.rsplit("/", 1)[-1]
        with self._listed_lock:
            now = time.monotonic()
            if self._listed is None or now - self._listed_at > LISTING_SECONDS:
                self._listed = {n for n in self._entries() if n.endswith(SUFFIX)}
                self._listed_at = now
            return name in self._listed

    def _entries(self) -> dict[str, int]:
        """This layout's objects under the prefix: name -> size in bytes."""
        self._fs.invalidate_cache(self._root)
        try:
            found = self._fs.ls(self._root, detail=True)
        except (FileNotFoundError, OSError):
            return {}
        out = {}
        for info in found:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if _OURS.match(name):
                out[name] = int(info.get("size") or 0)
        return out

    def count(self, tag: str | None = None) -> int:
        """The number of entries (every entry here is the engine's: ``tag`` is not
        stored apart from the entry, and the engine writes one tag)."""
        self._check_open()
        return sum(1 for n in self._entries() if n.endswith(SUFFIX))

    def clear(self, tag: str | None = None) -> int:
        """Remove every entry (and temporary key left by a write that died); the number
        of entries removed. Other objects under the prefix stay."""
        self._check_open()
        names = self._entries()
        with self._listed_lock:
            self._listed = None
        if names:
            self._fs.rm([f"{self._root}/{n}" for n in names])
        return sum(1 for n in names if n.endswith(SUFFIX))

    def usage(self) -> StoreUsage:
        """Entries and bytes in the prefix (``ssd_*``; the limit is 0: none)."""
        self._check_open()
        sizes = [s for n, s in self._entries().items() if n.endswith(SUFFIX)]
        return StoreUsage(0, 0, 0, len(sizes), sum(sizes), 0)

    def close(self) -> None:
        """Stop using the store (nothing is held open)."""
        self.closed = True


def _reopened(url: str, options: dict[str, Any], key: bytes) -> ObjectStore:
    """The store ``url`` as another process sent it (with its options and key): opened
    once per process, not once per task that carries it."""
    with _opened_lock:
        found = _opened.get((url, key))
        if found is None or found.closed:
            found = _opened[url, key] = ObjectStore(url, options, key)
        return found
