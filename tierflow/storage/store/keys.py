"""Keys of a store: which Python values may be keys, their bytes, and their file names.

A key is a ``str``, ``bytes``, ``int`` or a tuple of keys (nested tuples are fine).
It is encoded into bytes that say the type of every part, so ``1``, ``"1"`` and
``b"1"`` are three different keys and the encoding can be turned back into the key
(iteration over a store, and rebuilding a lost index, decode it).

The file of a key is named by a 128-bit BLAKE2b digest of that encoding, fanned out in
256 subfolders by its first two hex digits (``data/3f/3fa4...``): a key never becomes
a path, so no key can reach outside the store (``"../../etc/passwd"`` is just a key),
and a folder holds ~400 files at 100,000 entries.

>>> encode_key(("model", 3))
b't\\x00\\x00\\x00\\x02s\\x00\\x00\\x00\\x05modeli\\x00\\x00\\x00\\x013'
>>> decode_key(encode_key(("model", 3)))
('model', 3)
"""

from __future__ import annotations

import hashlib
import struct
from typing import TypeAlias

__all__ = ["MAX_KEY_BYTES", "Key", "decode_key", "encode_key", "name_of", "relative_path"]

Key: TypeAlias = str | bytes | int | tuple["Key", ...]

# Keys live in the index and in every file's signed trailer; a key this long is a
# value in disguise (hash it yourself).
MAX_KEY_BYTES = 64 * 1024

_LENGTH = struct.Struct(">I")
_STR, _BYTES, _INT, _TUPLE = b"s", b"b", b"i", b"t"
_PERSON = b"tierflow-key-v1"


def encode_key(key: object) -> bytes:
    """The type-tagged bytes of ``key``.

    Raises ``TypeError`` for a key (or part of a tuple key) that is not a ``str``,
    ``bytes``, ``int`` or tuple (``bool`` included: ``True`` would collide with ``1``),
    and ``ValueError`` for a key longer than :data:`MAX_KEY_BYTES` once encoded.
    """
    # The common cases, without the general walk.
    if type(key) is str:
        data = key.encode("utf-8", "surrogatepass")
        if len(data) + 5 <= MAX_KEY_BYTES:
            return _STR + _LENGTH.pack(len(data)) + data
    elif type(key) is bytes and len(key) + 5 <= MAX_KEY_BYTES:
        return _BYTES + _LENGTH.pack(len(key)) + key
    elif type(key) is tuple and len(key) <= 16:
        flat = _encode_flat(key)
        if flat is not None and len(flat) <= MAX_KEY_BYTES:
            return flat
    out = bytearray()
    _encode(key, out, key)
    if len(out) > MAX_KEY_BYTES:
        raise ValueError(
            f"store key is {len(out)} bytes once encoded; keys are limited to "
            f"{MAX_KEY_BYTES} bytes: use a digest of it as the key"
        )
    return bytes(out)


def _encode_flat(key: tuple[object, ...]) -> bytes | None:
    """The encoding of a short tuple of ``str`` and ``int`` (the usual composite key),
    or None for anything else: the same bytes as :func:`_encode`, built in one join."""
    parts = [_TUPLE, _LENGTH.pack(len(key))]
    for part in key:
        if type(part) is str:
            data = part.encode("utf-8", "surrogatepass")
            parts += (_STR, _LENGTH.pack(len(data)), data)
        elif type(part) is int:  # not bool, nor an int subclass: those take the walk
            data = str(part).encode("ascii")
            parts += (_INT, _LENGTH.pack(len(data)), data)
        else:
            return None
    return b"".join(parts)


def _encode(part: object, out: bytearray, whole: object) -> None:
    if isinstance(part, bool) or not isinstance(part, (str, bytes, int, tuple)):
        where = "" if part is whole else f" (inside the key {whole!r})"
        raise TypeError(
            f"store keys are str, bytes, int or tuples of them; got {type(part).__name__}{where}"
        )
    if isinstance(part, str):
        data = part.encode("utf-8", "surrogatepass")
        out += _STR + _LENGTH.pack(len(data)) + data
    elif isinstance(part, bytes):
        out += _BYTES + _LENGTH.pack(len(part)) + part
    elif isinstance(part, int):
        data = str(int(part)).encode("ascii")
        out += _INT + _LENGTH.pack(len(data)) + data
    else:
        out += _TUPLE + _LENGTH.pack(len(part))
        for item in part:
            _encode(item, out, whole)


def decode_key(data: bytes) -> Key:
    """The key whose :func:`encode_key` bytes are ``data``; ``ValueError`` if malformed."""
    key, end = _decode(data, 0)
    if end != len(data):
        raise ValueError(f"malformed store key: {len(data) - end} trailing bytes")
    return key


def _decode(data: bytes, at: int) -> tuple[Key, int]:
    if at + 5 > len(data):
        raise ValueError("malformed store key: truncated")
    tag = data[at : at + 1]
    (length,) = _LENGTH.unpack_from(data, at + 1)
    at += 5
    if tag == _TUPLE:
        items = []
        for _ in range(length):
            item, at = _decode(data, at)
            items.append(item)
        return tuple(items), at
    if at + length > len(data):
        raise ValueError("malformed store key: truncated")
    raw = data[at : at + length]
    at += length
    if tag == _STR:
        return raw.decode("utf-8", "surrogatepass"), at
    if tag == _BYTES:
        return raw, at
    if tag == _INT:
        return int(raw.decode("ascii")), at
    raise ValueError(f"malformed store key: unknown tag {tag!r}")


def name_of(encoded: bytes) -> str:
    """The file name of an encoded key: 32 hex digits of its BLAKE2b digest."""
    return hashlib.blake2b(encoded, digest_size=16, person=_PERSON).hexdigest()


def relative_path(name: str) -> str:
    """Where the file ``name`` lives under the store's ``data`` folder (``3f/3fa4...``)."""
    return f"{name[:2]}/{name}"
