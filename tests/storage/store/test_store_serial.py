"""Entry files: how values become bytes, and which bytes are trusted again."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import stat
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow.errors import StoreError
from tierflow.storage import leases
from tierflow.storage.store import signing
from tierflow.storage.store.keys import encode_key
from tierflow.storage.store.serial import EntryDamaged, Written, read_entry, read_meta, write_entry
from tierflow.storage.store.signing import KEY_BYTES, Signer, load_signer

KEY = encode_key("k")
SIGNER = Signer(b"s" * KEY_BYTES)


def write(path: Path, value: Any, key: bytes = KEY, tag: str | None = None) -> Written:
    with open(path, "xb", buffering=0) as f:
        return write_entry(f.fileno(), value, key, tag, SIGNER)


def read(path: Path, key: bytes = KEY) -> Any:
    return read_entry(path, key, SIGNER).value


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
        np.arange(40, dtype=np.int16).reshape(8, 5)[::2, 1:4],  # not contiguous
        np.zeros((0, 3), dtype=np.float64),
        np.array(3.5),
        np.array([(1, 2.0), (3, 4.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        np.array(["ab", "c"]),
        np.array(["2024-01-01"], dtype="M8[D]"),
    ],
    ids=["c", "fortran", "strided", "empty", "0d", "structured", "unicode", "datetime"],
)
def test_arrays_round_trip_memory_mapped_and_read_only(tmp_path: Path, arr: np.ndarray) -> None:
    path = tmp_path / "e"
    written = write(path, arr)
    assert written.kind == "npy"
    assert written.size == path.stat().st_size
    back = read(path)
    np.testing.assert_array_equal(back, arr)
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert not back.flags.writeable
    if arr.size:
        assert isinstance(back, np.memmap)


@pytest.mark.parametrize("order", ["C", "F"])
def test_without_a_lease_an_array_entry_is_read_into_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    monkeypatch.setattr(leases, "acquire", lambda fd: None)
    arr = np.asarray(np.arange(24, dtype=np.float32).reshape(4, 6), order=order)  # type: ignore[call-overload]
    write(tmp_path / "e", arr)
    back = read(tmp_path / "e")
    assert not isinstance(back, np.memmap) and not back.flags.writeable
    np.testing.assert_array_equal(back, arr)


def test_an_array_entry_is_mapped_under_a_lease(tmp_path: Path) -> None:
    write(tmp_path / "e", np.arange(1024.0))
    back = read(tmp_path / "e")
    assert leases.held_by(back) is True
    with pytest.raises(BlockingIOError):  # an open for writing would have to wait
        fd = os.open(tmp_path / "e", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    del back
    os.close(os.open(tmp_path / "e", os.O_WRONLY | os.O_NONBLOCK))  # the lease went with it


def test_an_array_entry_is_a_valid_npy_file(tmp_path: Path) -> None:
    arr = np.arange(6.0).reshape(2, 3)
    write(tmp_path / "e", arr)
    np.testing.assert_array_equal(np.load(tmp_path / "e"), arr)


@pytest.mark.parametrize(
    "arr",
    [
        np.zeros((3, 4)),
        np.asfortranarray(np.zeros((3, 4))),
        np.zeros((8, 5))[::2, 1:4],
        np.zeros((3, 1)).T,  # both C- and Fortran-contiguous
        np.zeros(3, dtype=">i2"),
        np.zeros(2, dtype=np.dtype([("a", "i1"), ("b", "f8")], align=True)),
    ],
    ids=["c", "fortran", "strided", "both", "big-endian", "aligned-struct"],
)
def test_cached_npy_headers_are_the_ones_numpy_writes(tmp_path: Path, arr: np.ndarray) -> None:
    for _ in range(2):  # the second write takes its header from the cache
        with open(tmp_path / "e", "wb") as f:
            np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
        expected = (tmp_path / "e").read_bytes()
        (tmp_path / "e").unlink()
        write(tmp_path / "e", arr)
        assert (tmp_path / "e").read_bytes()[: len(expected)] == expected
        np.testing.assert_array_equal(read(tmp_path / "e"), arr)
        (tmp_path / "e").unlink()


def test_the_ram_copy_of_an_array_is_a_read_only_copy(tmp_path: Path) -> None:
    arr = np.arange(4.0)
    written = write(tmp_path / "e", arr)
    assert written.holder is not None and written.held_nbytes == 32
    held = written.holder()
    arr[0] = 99
    assert held[0] == 0 and not held.flags.writeable


def test_object_arrays_are_pickled(tmp_path: Path) -> None:
    arr = np.array([{"a": 1}, None], dtype=object)
    assert write(tmp_path / "e", arr).kind == "pickle"
    assert read(tmp_path / "e")[0] == {"a": 1}


@pytest.mark.parametrize("value", [{"a": [1, 2]}, "text", None, 3, (1, "x"), b"\x00" * 5000])
def test_other_values_are_pickled(tmp_path: Path, value: Any) -> None:
    written = write(tmp_path / "e", value, tag="t")
    assert written.kind == "pickle"
    assert read(tmp_path / "e") == value
    meta, size = read_meta(tmp_path / "e", SIGNER)
    assert (meta.key, meta.kind, meta.tag, size) == (KEY, "pickle", "t", written.size)


def test_mutable_values_are_held_as_copies(tmp_path: Path) -> None:
    value = {"a": [1]}
    written = write(tmp_path / "e", value)
    assert written.holder is not None
    held = written.holder()
    value["a"].append(2)
    assert held == {"a": [1]}


@pytest.mark.torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool", "complex64", "float16"])
def test_tensors_come_back_as_tensors(tmp_path: Path, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    t = (torch.arange(12) % 3).to(getattr(torch, dtype)).reshape(3, 4)
    written = write(tmp_path / "e", t)
    assert written.kind == "torch" and written.holder is None
    back = read(tmp_path / "e")
    assert isinstance(back, torch.Tensor) and back.dtype == t.dtype
    assert torch.equal(back, t)
    back[0, 0] = 1  # copy-on-write: private to this process
    assert torch.equal(read(tmp_path / "e"), t)


@pytest.mark.torch
def test_tensor_views_and_grad_flags_survive(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(20.0).reshape(4, 5).t()[1:3]  # a non-contiguous view
    p = torch.nn.Parameter(torch.ones(3))
    write(tmp_path / "a", t)
    write(tmp_path / "b", p)
    assert torch.equal(read(tmp_path / "a"), t)
    back = read(tmp_path / "b")
    assert type(back) is torch.Tensor and back.requires_grad


@pytest.mark.torch
def test_sparse_tensors_are_pickled(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    t = torch.eye(3).to_sparse()
    assert write(tmp_path / "e", t).kind == "pickle"
    assert torch.equal(read(tmp_path / "e").to_dense(), torch.eye(3))


# -- what is not trusted ------------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_changed_pickle_byte_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "e", {"a": 1})
    flip(tmp_path / "e", 5)
    with pytest.raises(EntryDamaged, match="pickle does not match the signed digest"):
        read(tmp_path / "e")


def test_a_changed_trailer_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "e", {"a": 1})
    flip(tmp_path / "e", os.path.getsize(tmp_path / "e") - 60)
    with pytest.raises(EntryDamaged, match="signature does not match"):
        read(tmp_path / "e")


def test_another_key_signs_differently(tmp_path: Path) -> None:
    write(tmp_path / "e", 1)
    with pytest.raises(EntryDamaged, match="signature does not match"):
        read_entry(tmp_path / "e", KEY, Signer(b"t" * KEY_BYTES))


def test_a_file_moved_to_another_key_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "e", 1)
    with pytest.raises(EntryDamaged, match="holds the value of another key"):
        read(tmp_path / "e", encode_key("other"))


@pytest.mark.parametrize("cut", [1, 100, 4000])
def test_truncated_files_are_refused(tmp_path: Path, cut: int) -> None:
    write(tmp_path / "e", np.arange(1000.0))
    data = (tmp_path / "e").read_bytes()
    (tmp_path / "e").write_bytes(data[:-cut])
    with pytest.raises(EntryDamaged):
        read(tmp_path / "e")


def test_an_appended_byte_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "e", np.arange(10.0))
    with open(tmp_path / "e", "ab") as f:
        f.write(b"\0")
    with pytest.raises(EntryDamaged, match="no tierflow trailer"):
        read(tmp_path / "e")


def test_a_changed_npy_header_is_refused_before_mapping(tmp_path: Path) -> None:
    write(tmp_path / "e", np.arange(10.0))
    data = (tmp_path / "e").read_bytes().replace(b"(10,)", b"(99,)")
    (tmp_path / "e").write_bytes(data)
    with pytest.raises(EntryDamaged, match=r"\.npy header does not match the signed digest"):
        read(tmp_path / "e")


def test_changed_array_data_gives_changed_numbers_not_a_crash(tmp_path: Path) -> None:
    # Documented: array data is not checksummed (that would mean reading it).
    write(tmp_path / "e", np.zeros(16, dtype=np.uint8))
    flip(tmp_path / "e", 128)
    assert read(tmp_path / "e")[0] == 255


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x80\x04K\x01." * 20])
def test_foreign_files_are_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "e").write_bytes(content)
    with pytest.raises(EntryDamaged):
        read(tmp_path / "e")
    with pytest.raises(EntryDamaged):
        read_meta(tmp_path / "e", SIGNER)


def test_a_trailer_claiming_a_huge_meta_is_refused(tmp_path: Path) -> None:
    footer = struct.pack("<32sI8s", b"\0" * 32, 1 << 30, b"TFSTORE\x01")
    (tmp_path / "e").write_bytes(b"x" * 100 + footer)
    with pytest.raises(EntryDamaged, match="claims 1073741824 bytes of meta"):
        read(tmp_path / "e")


def test_a_signed_pickle_of_a_vanished_class_is_damaged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "e", Vanishing())
    monkeypatch.delattr(sys.modules[__name__], "Vanishing")
    with pytest.raises(EntryDamaged, match="signed but cannot be unpickled"):
        read(tmp_path / "e")


class Vanishing:
    pass


def test_damage_carries_the_identity_of_the_file_read(tmp_path: Path) -> None:
    write(tmp_path / "e", 1)
    flip(tmp_path / "e", 1)
    with pytest.raises(EntryDamaged) as info:
        read(tmp_path / "e")
    assert info.value.ident is not None and info.value.ident[1] == (tmp_path / "e").stat().st_ino


# -- the signing key ----------------------------------------------------------------------


@pytest.fixture
def fresh_signers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signing, "_signers", {})


def test_the_key_is_created_private_next_to_the_store_dir(fresh_signers: None) -> None:
    path = signing.default_key_path()
    assert path.name == "store.key" and not path.exists()
    signer = load_signer()
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == KEY_BYTES
    assert load_signer(path) is signer
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".store.key")] == []


def test_a_key_is_reused_across_processes(fresh_signers: None, tmp_path: Path) -> None:
    path = tmp_path / "k"
    first = load_signer(path)
    signing._signers.clear()
    assert load_signer(path).key_id == first.key_id


def test_racing_creators_agree_on_one_key(fresh_signers: None, tmp_path: Path) -> None:
    path = tmp_path / "k"
    ids: list[str] = []
    barrier = threading.Barrier(4)

    def create() -> None:
        barrier.wait()
        ids.append(Signer(signing._read_or_create(path)).key_id)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and len(ids) == 4


def test_a_key_others_can_read_is_refused(fresh_signers: None, tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_bytes(b"k" * KEY_BYTES)
    path.chmod(0o644)
    with pytest.raises(StoreError, match=r"has mode 644; others could read it .* chmod 600"):
        load_signer(path)


def test_a_key_of_the_wrong_size_is_refused(fresh_signers: None, tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(StoreError, match=r"holds 5 bytes, expected 32: it was changed outside"):
        load_signer(path)


def test_a_key_that_is_a_folder_is_refused(fresh_signers: None, tmp_path: Path) -> None:
    (tmp_path / "k").mkdir(mode=0o700)
    with pytest.raises((StoreError, IsADirectoryError)):
        load_signer(tmp_path / "k")


@pytest.mark.parametrize("data", [b"", b"{}", bytes(range(256)) * 3])
def test_signatures_are_hmac_sha256_of_the_domain_and_the_data(data: bytes) -> None:
    # Entries written by any version must keep verifying: pin the construction.
    key = bytes(range(KEY_BYTES))
    expected = hmac.new(key, b"tierflow-store-entry-v1\0" + data, hashlib.sha256).digest()
    signer = Signer(key)
    assert signer.sign(data) == expected
    assert signer.sign(data) == expected  # the keyed states are copied, never used up
    assert signer.verify(data, expected) and not signer.verify(data + b"x", expected)


def test_key_ids_do_not_reveal_the_key() -> None:
    signer = Signer(b"a" * KEY_BYTES)
    assert len(signer.key_id) == 16 and "61616161" not in signer.key_id
    assert pickle.dumps(signer.key_id)  # a plain string, safe to write in a marker
