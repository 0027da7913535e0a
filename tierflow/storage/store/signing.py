"""The per-user key that signs store entries, and the HMAC made with it.

A store never unpickles a file it cannot prove it wrote: every entry ends in a trailer
signed with HMAC-SHA256 under a 32-byte secret key (see :mod:`.serial`). The key is
one file per user, by default ``~/.tierflow/store.key`` (next to the ``store_dir``
folder, so ``TIERFLOW_STORE_DIR`` moves it too), readable by its owner only.

The key file is created on first use, atomically: the secret is written to a temporary
file opened with ``O_EXCL`` and mode 0600, flushed to disk, then hard-linked to the
final name. ``link`` fails if the name exists, so two processes racing to create the
key agree on one, and no process can ever read a half-written key (which would make
every entry look forged and get it deleted).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from pathlib import Path

from ... import config
from ...errors import StoreError

__all__ = ["KEY_BYTES", "Signer", "default_key_path", "load_key", "load_signer"]

KEY_BYTES = 32
_DOMAIN = b"tierflow-store-entry-v1\0"

_lock = threading.Lock()
_signers: dict[str, Signer] = {}


class Signer:
    """Signs and checks entry trailers with one secret key.

    ``key_id`` is a short public fingerprint of the key (it does not reveal the key);
    a store records it so that opening it with another key is refused instead of
    every entry being treated as forged.
    """

    __slots__ = ("_inner", "_outer", "key_id")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a store key is {KEY_BYTES} bytes, got {len(key)}")
        # HMAC (RFC 2104) with its two keyed SHA-256 states computed once: a signature
        # then hashes only the data, which halves its cost for a small trailer. The
        # domain prefix is part of the signed message, so it goes into the inner state.
        block = key.ljust(hashlib.sha256().block_size, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block) + _DOMAIN)
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))
        self.key_id = hashlib.blake2b(key, digest_size=8, person=b"tierflow-keyid").hexdigest()

    def sign(self, data: bytes) -> bytes:
        """The 32-byte HMAC-SHA256 of the domain prefix followed by ``data``."""
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def verify(self, data: bytes, mac: bytes) -> bool:
        """Whether ``mac`` is the signature of ``data`` (constant-time comparison)."""
        return hmac.compare_digest(self.sign(data), mac)

    def __repr__(self) -> str:
        return f"Signer(key_id={self.key_id!r})"


def default_key_path() -> Path:
    """``store.key`` in the folder above the ``store_dir`` setting (``~/.tierflow``)."""
    return Path(config.get("store_dir")).expanduser().absolute().parent / "store.key"


def load_signer(path: str | os.PathLike[str] | None = None) -> Signer:
    """The signer for the key file at ``path`` (default :func:`default_key_path`).

    Creates the key file (and its folder, mode 0700) if it does not exist. Cached per
    path for the life of the process. Raises :class:`~tierflow.errors.StoreError`
    when the file is not a regular file of this user with mode 0600 and exactly
    :data:`KEY_BYTES` bytes: a key others can read lets them forge entries that this
    process would unpickle.
    """
    where = Path(path).expanduser().absolute() if path is not None else default_key_path()
    with _lock:
        signer = _signers.get(str(where))
        if signer is None:
            signer = Signer(_read_or_create(where))
            _signers[str(where)] = signer
        return signer


def load_key(path: str | os.PathLike[str] | None = None) -> bytes:
    """The secret bytes of the key file at ``path`` (default :func:`default_key_path`),
    created if it does not exist; checked as :func:`load_signer` checks it. For a store
    whose entries processes on other machines read (an object-storage cache): the key
    travels to them with the store, so they trust the same entries."""
    where = Path(path).expanduser().absolute() if path is not None else default_key_path()
    return _read_or_create(where)


def _read_or_create(path: Path) -> bytes:
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process won the race; use its key
        else:
            _fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(f"store key {path} is not a regular file; remove it")
        if st.st_uid != os.geteuid():
            raise StoreError(
                f"store key {path} belongs to user {st.st_uid}, not to this user "
                f"({os.geteuid()}); a key must be private to its user: remove it, or point "
                "the store at another key file"
            )
        if st.st_mode & 0o077:
            raise StoreError(
                f"store key {path} has mode {stat.S_IMODE(st.st_mode):o}; others could read "
                f"it and forge store entries. Run: chmod 600 {path}"
            )
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise StoreError(
            f"store key {path} holds {len(data)} bytes, expected {KEY_BYTES}: it was changed "
            "outside tierflow. Restore it, or remove it and the stores signed with it"
        )
    return data


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
