"""Store keys: encoding, decoding, file names."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierflow.storage.store import keys as keys_mod
from tierflow.storage.store.keys import (
    MAX_KEY_BYTES,
    decode_key,
    encode_key,
    name_of,
    relative_path,
)

keys = st.recursive(
    st.text() | st.binary() | st.integers(),
    lambda inner: st.lists(inner, max_size=4).map(tuple),
    max_leaves=10,
)


@given(keys)
def test_decode_inverts_encode(key: object) -> None:
    assert decode_key(encode_key(key)) == key


@given(st.lists(st.text() | st.integers(), max_size=20).map(tuple))
def test_flat_tuples_encode_as_the_general_walk_does(key: tuple[object, ...]) -> None:
    # File names come from these bytes: a shortcut that changed them would orphan entries.
    out = bytearray()
    keys_mod._encode(key, out, key)
    assert encode_key(key) == bytes(out)


@given(keys, keys)
def test_equal_keys_and_only_those_share_an_encoding(a: object, b: object) -> None:
    assert (encode_key(a) == encode_key(b)) == (a == b)


@pytest.mark.parametrize("pair", [(1, "1"), ("1", b"1"), ((1, 2), (1, (2,))), ((), ""), (-1, "-1")])
def test_types_are_part_of_the_key(pair: tuple[object, object]) -> None:
    a, b = pair
    assert encode_key(a) != encode_key(b)
    assert name_of(encode_key(a)) != name_of(encode_key(b))


def test_concatenations_cannot_collide() -> None:
    assert encode_key(("ab", "c")) != encode_key(("a", "bc"))


@pytest.mark.parametrize(
    ("key", "shown"),
    [(1.5, "float"), (None, "NoneType"), ([1], "list"), (True, "bool"), (("a", 1.0), "float")],
)
def test_other_types_are_refused(key: object, shown: str) -> None:
    with pytest.raises(
        TypeError, match=rf"store keys are str, bytes, int or tuples .* got {shown}"
    ):
        encode_key(key)


def test_a_bad_part_names_the_whole_key() -> None:
    with pytest.raises(TypeError, match=r"got float \(inside the key \('a', 1\.0\)\)"):
        encode_key(("a", 1.0))


def test_long_keys_are_refused() -> None:
    encode_key("x" * (MAX_KEY_BYTES - 5))
    with pytest.raises(
        ValueError, match=r"store key is 65541 bytes once encoded; keys are limited"
    ):
        encode_key("x" * MAX_KEY_BYTES)


@pytest.mark.parametrize("key", ["../../etc/passwd", "/abs", "a/b", "\0", "..", ("..", "/")])
def test_file_names_are_hex_digests_whatever_the_key(key: object) -> None:
    name = name_of(encode_key(key))
    assert re.fullmatch(r"[0-9a-f]{32}", name)
    assert relative_path(name) == f"{name[:2]}/{name}"


@pytest.mark.parametrize("data", [b"", b"s\x00\x00", b"q\x00\x00\x00\x00", b"s\x00\x00\x00\x05ab"])
def test_malformed_encodings_are_value_errors(data: bytes) -> None:
    with pytest.raises(ValueError, match="malformed store key"):
        decode_key(data)


def test_str_and_int_subclasses_are_their_base_values() -> None:
    import enum

    class Colour(str, enum.Enum):
        RED = "red"

    assert decode_key(encode_key(Colour.RED)) == "red"
