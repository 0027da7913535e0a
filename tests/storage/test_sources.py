"""Sources: .npy headers, raw files, arrays; the errors for files that are not rows."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierflow import config
from tierflow.errors import SourceError
from tierflow.storage import pages, sources
from tierflow.storage.sources import ArraySource, FileSource, as_source, open_npy, open_raw


def save(path: Path, array: np.ndarray) -> Path:
    np.save(path, array)
    return path


def npy_bytes(header: str, version: tuple[int, int] = (1, 0)) -> bytes:
    """A .npy prefix with an arbitrary header text (padded like NumPy does)."""
    text = header.encode("latin1")
    if version[0] == 1:
        return b"\x93NUMPY" + bytes(version) + struct.pack("<H", len(text)) + text
    return b"\x93NUMPY" + bytes(version) + struct.pack("<I", len(text)) + text


# -- .npy -------------------------------------------------------------------------------


def test_npy_source_describes_the_file_and_blocks_are_views(tmp_path: Path) -> None:
    a = np.arange(3000, dtype=np.float32).reshape(-1, 6)
    path = save(tmp_path / "a.npy", a)
    src = open_npy(path)
    assert (src.kind, src.dtype, src.shape, src.n_rows, src.row_shape) == (
        "npy",
        np.dtype(np.float32),
        (500, 6),
        500,
        (6,),
    )
    assert src.row_nbytes == 24 and src.nbytes == a.nbytes
    assert src.offset + src.nbytes == os.path.getsize(path)
    block = src.block(100, 250)
    np.testing.assert_array_equal(block, a[100:250])
    assert not block.flags.owndata and not block.flags.writeable
    np.testing.assert_array_equal(src.block(490, 500), a[490:])
    with pytest.raises(IndexError, match="row block 10:501 is outside 0:500"):
        src.block(10, 501)
    src.close()
    np.testing.assert_array_equal(src.block(0, 1), a[:1])  # maps again after close


def test_npy_versions_2_and_3_and_structured_dtypes(tmp_path: Path) -> None:
    dt = np.dtype([("x", "<f8"), ("id", "<i4"), ("tag", "S3")])
    a = np.zeros(50, dtype=dt)
    a["x"] = np.arange(50)
    path = tmp_path / "v2.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, a, version=(2, 0))
    src = open_npy(path)
    assert src.dtype == dt and src.shape == (50,)
    np.testing.assert_array_equal(src.block(10, 20)["x"], np.arange(10, 20))
    path3 = tmp_path / "v3.npy"
    with open(path3, "wb") as f:
        np.lib.format.write_array(f, np.ones((4, 2)), version=(3, 0))
    assert open_npy(path3).shape == (4, 2)


def test_identity_changes_when_the_file_is_rewritten(tmp_path: Path) -> None:
    path = save(tmp_path / "a.npy", np.zeros((10, 2)))
    first = open_npy(path).identity()
    assert first[0] == str(path) and first[3:] == ("<f8", (10, 2), 128)
    save(path, np.zeros((12, 2)))
    os.utime(path, ns=(1, 1))
    assert open_npy(path).identity() != first


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", r"not a \.npy file: it does not start with the NumPy magic"),
        (b"PK\x03\x04 a zip file", r"not a \.npy file.*first bytes b'PK"),
        (b"\x93NUMPY\x07\x00\x10\x00", r"format version 7\.0 is not one tierflow reads"),
        (b"\x93NUMPY\x01\x00\x10", r"the file ends inside the header"),
        (b"\x93NUMPY\x01\x00\x40\x00{'descr': '<f4'", r"claims 64 header bytes but the file ends after 15"),
        (npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,"), r"is not a Python dict literal"),
        (npy_bytes("[1, 2, 3]"), r"expected a dict with the keys 'descr', 'fortran_order' and 'shape'"),
        (npy_bytes("{'descr': '<f4', 'fortran_order': False}"), r"expected a dict with the keys"),
        (npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3, -1)}"), r"shape \(3, -1\) is not a tuple of non-negative ints"),
        (npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': [3]}"), r"shape \[3\] is not a tuple"),
        (npy_bytes("{'descr': '<f4', 'fortran_order': 'no', 'shape': (3,)}"), r"fortran_order 'no' is not True or False"),
        (npy_bytes("{'descr': 'not-a-dtype', 'fortran_order': False, 'shape': (3,)}"), r"descr 'not-a-dtype' is not a dtype"),
        (npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}", (2, 0))[:9], r"the file ends inside the header"),
    ],
)  # fmt: skip
def test_corrupt_npy_headers_are_refused_naming_the_file(
    tmp_path: Path, content: bytes, match: str
) -> None:
    path = tmp_path / "bad.npy"
    path.write_bytes(content)
    with pytest.raises(SourceError, match=match) as info:
        open_npy(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_header_length_far_beyond_numpy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "huge.npy"
    path.write_bytes(b"\x93NUMPY\x02\x00" + struct.pack("<I", 1 << 30))
    with pytest.raises(SourceError, match=r"claims a 1073741824-byte header"):
        open_npy(path)


def test_truncated_npy_says_how_many_bytes_are_missing(tmp_path: Path) -> None:
    path = save(tmp_path / "t.npy", np.zeros((1000, 8), dtype=np.float32))
    assert os.path.getsize(path) == 128 + 32000
    os.truncate(path, 128 + 20000)
    with pytest.raises(
        SourceError,
        match=r"t\.npy: is truncated: its header says \(1000, 8\) float32, 32000 data bytes "
        r"after a 128-byte header \(32128 bytes in all\), but the file has 20128 bytes "
        r"\(12000 missing\)",
    ):
        open_npy(path)


def test_extra_trailing_bytes_are_ignored(tmp_path: Path) -> None:
    path = save(tmp_path / "t.npy", np.arange(10.0))
    with open(path, "ab") as f:
        f.write(b"trailer")
    np.testing.assert_array_equal(open_npy(path).block(0, 10), np.arange(10.0))


def test_fortran_order_is_refused_with_the_remedy(tmp_path: Path) -> None:
    path = save(tmp_path / "f.npy", np.asfortranarray(np.zeros((100, 3), dtype=np.int16)))
    with pytest.raises(
        SourceError, match=r"f\.npy: is stored in Fortran order \(\(100, 3\) int16\).*C order"
    ):
        open_npy(path)


def test_fortran_flag_on_a_layout_that_is_also_c_order_is_accepted(tmp_path: Path) -> None:
    # NumPy itself writes fortran_order=False for such arrays; other writers may not.
    a = np.arange(5.0).reshape(5, 1)
    path = tmp_path / "f.npy"
    path.write_bytes(
        npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (5, 1), }\n") + a.tobytes()
    )
    assert sources.read_npy_header(path)[2] is True
    np.testing.assert_array_equal(open_npy(path).block(0, 5), a)


def test_object_npy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "o.npy"
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(SourceError, match=r"o\.npy: holds an object array \(\(2,\) object\)"):
        open_npy(path)


def test_zero_d_npy_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path / "s.npy", np.array(3.0))
    with pytest.raises(SourceError, match=r"holds a 0-d array \(\(\) float64\)"):
        open_npy(path)


def test_release_reaches_one_huge_page_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows of 64 KB: one huge page (2 MB on x86-64) is 32 rows.
    path = save(tmp_path / "wide.npy", np.zeros((100, 16384), dtype=np.float32))
    behind = sources.behind_rows(64 * 1024)
    assert behind == sources.behind_bytes() // (64 * 1024) >= 32
    assert sources.behind_rows(1) == sources.behind_bytes()
    assert sources.behind_rows(1 << 30) == 1
    released: list[tuple[int, bool]] = []

    def release(x: np.ndarray, *, drop_cache: bool = True, count: bool = True) -> int:
        released.append((x.shape[0], drop_cache))
        return 0

    monkeypatch.setattr(pages, "release", release)
    src = open_npy(path)
    block = src.block(40, 80)  # releasing a source that mapped nothing drops nothing
    src.release(40, 80, drop_cache=True)  # rows max(0, 40 - behind):80
    src.release(90, 100)
    assert released == [(80 - max(0, 40 - behind), True), (100 - max(0, 90 - behind), False)]
    del block
    m = np.load(path, mmap_mode="r")
    ArraySource(m).release(95, 100)
    assert released[-1] == (100 - max(0, 95 - behind), False)


def test_zero_row_npy_opens_without_a_mapping(tmp_path: Path) -> None:
    path = save(tmp_path / "e.npy", np.zeros((0, 8), dtype=np.float32))
    src = open_npy(path)
    assert src.shape == (0, 8) and src.nbytes == 0
    block = src.block(0, 0)
    assert block.shape == (0, 8) and block.dtype == np.float32
    src.readahead(0, 0)
    assert src.release(0, 0) == 0


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_npy(tmp_path / "nope.npy")


# -- raw files --------------------------------------------------------------------------


def raw(path: Path, array: np.ndarray, prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + array.tobytes())
    return path


def test_raw_full_shape(tmp_path: Path) -> None:
    a = np.arange(80, dtype=np.int32).reshape(10, 8)
    src = open_raw(raw(tmp_path / "r.bin", a), np.int32, (10, 8))
    assert (src.kind, src.shape, src.offset) == ("raw", (10, 8), 0)
    np.testing.assert_array_equal(src.block(3, 7), a[3:7])


@pytest.mark.parametrize("shape", [(8,), (-1, 8), [-1, 8]])
def test_raw_row_shape_takes_the_row_count_from_the_file(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    a = np.arange(800, dtype=np.float32).reshape(100, 8)
    src = open_raw(raw(tmp_path / "r.bin", a, b"HEAD1234"), "float32", shape, offset=8)
    assert src.shape == (100, 8) and src.offset == 8
    np.testing.assert_array_equal(src.block(90, 100), a[90:])


def test_raw_shape_matching_exactly_is_the_full_shape(tmp_path: Path) -> None:
    path = raw(tmp_path / "r.bin", np.arange(8, dtype=np.float32))
    assert open_raw(path, np.float32, (8,)).shape == (8,)
    assert open_raw(path, np.float32, (-1, 8)).shape == (1, 8)
    assert open_raw(path, np.float32, 8).shape == (8,)
    assert open_raw(path, np.float32, (-1,)).shape == (8,)


def test_raw_size_not_a_whole_number_of_rows(tmp_path: Path) -> None:
    path = tmp_path / "r.bin"
    path.write_bytes(b"\0" * 100)
    with pytest.raises(
        SourceError,
        match=r"r\.bin: 100 bytes after offset 0 are not a whole number of float32 rows of "
        r"shape \(8,\) \(32 bytes each\): 3 rows and 4 bytes left over",
    ):
        open_raw(path, np.float32, (-1, 8))
    with pytest.raises(SourceError, match=r"it is not the full shape \(3, 8\) either \(96 bytes\)"):
        open_raw(path, np.float32, (3, 8))


def test_raw_bad_arguments(tmp_path: Path) -> None:
    path = tmp_path / "r.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(SourceError, match=r"offset 65 is past the end of the 64-byte file"):
        open_raw(path, np.uint8, (-1,), offset=65)
    with pytest.raises(SourceError, match=r"offset must be a non-negative number of bytes"):
        open_raw(path, np.uint8, (-1,), offset=-1)
    with pytest.raises(SourceError, match=r"only a leading -1 is allowed"):
        open_raw(path, np.uint8, (8, -1))
    with pytest.raises(TypeError, match=r"must hold ints, got 2\.5"):
        open_raw(path, np.uint8, (2.5, 8))  # type: ignore[arg-type]
    with pytest.raises(SourceError, match=r"holds Python objects"):
        open_raw(path, object, (-1,))
    with pytest.raises(SourceError, match=r"rows of shape \(0,\) hold no bytes"):
        open_raw(path, np.uint8, (-1, 0))


def test_empty_raw_file_has_zero_rows(tmp_path: Path) -> None:
    path = tmp_path / "e.bin"
    path.write_bytes(b"")
    src = open_raw(path, np.float64, (-1, 4))
    assert src.shape == (0, 4)
    assert src.block(0, 0).shape == (0, 4)


# -- arrays and dispatch ----------------------------------------------------------------


def test_array_source_in_ram_is_never_released(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> int:
        raise AssertionError("pages touched for a RAM array")

    monkeypatch.setattr(pages, "release", refuse)
    monkeypatch.setattr(pages, "readahead", refuse)
    a = np.arange(20.0).reshape(10, 2)
    src = as_source(a)
    assert isinstance(src, ArraySource) and not src.file_backed
    assert np.shares_memory(src.block(2, 5), a)
    src.readahead(0, 10)
    assert src.release(0, 10, drop_cache=True) == 0
    assert "in RAM" in repr(src)


@pytest.mark.parametrize(("mode", "backed"), [("r", True), ("r+", True), ("c", False)])
def test_array_source_of_a_memmap(tmp_path: Path, mode: Any, backed: bool) -> None:
    path = save(tmp_path / "m.npy", np.arange(4096.0).reshape(-1, 8))
    m = np.load(path, mmap_mode=mode)
    for x in (m, m[10:], np.asarray(m), m.reshape(-1, 4, 2)):
        src = ArraySource(x)
        assert src.file_backed is backed
    src = ArraySource(m)
    float(src.block(0, 512).sum())
    assert src.release(0, 512) == (512 * 8 * 8 if backed else 0)


def test_spilled_memory_array_is_file_backed() -> None:
    from tierflow.storage import placement

    with config.set(ram_budget="1MB"):
        x = placement.array((1 << 18, 8), "float32")  # 8 MB: over the budget
    try:
        assert placement.on_disk(x)
        assert ArraySource(x).file_backed
        assert ArraySource(x[100:]).file_backed
    finally:
        placement.free(x)
    assert not ArraySource(placement.array((10, 8), "float32")).file_backed


def test_as_source_dispatch(tmp_path: Path) -> None:
    npy = save(tmp_path / "a.npy", np.zeros((4, 2)))
    rawfile = raw(tmp_path / "a.bin", np.zeros((4, 2)))
    assert isinstance(as_source(npy), FileSource)
    assert isinstance(as_source(str(npy)), FileSource)
    assert as_source(rawfile, dtype="f8", shape=(-1, 2)).shape == (4, 2)
    src = open_npy(npy)
    assert as_source(src) is src
    with pytest.raises(TypeError, match=r"carries its own dtype and shape; drop dtype="):
        as_source(npy, dtype="f8", shape=(4, 2))
    with pytest.raises(TypeError, match=r"a raw file needs shape= as well as dtype="):
        as_source(rawfile, dtype="f8")
    with pytest.raises(TypeError, match=r"need dtype= too"):
        as_source(rawfile, shape=(4, 2))
    with pytest.raises(TypeError, match=r"only apply to raw files; an array carries its own"):
        as_source(np.zeros(3), dtype="f4")
    with pytest.raises(TypeError, match=r"cannot read rows from list"):
        as_source([1, 2, 3])
    with pytest.raises(
        SourceError,
        match=r"not a \.npy file.*give its dtype and shape: memory\.chunks\(path, dtype",
    ):
        as_source(rawfile)
    with pytest.raises(SourceError, match=r"0-d array has no rows"):
        as_source(np.array(1.0))


def test_sources_follow_the_protocol(tmp_path: Path) -> None:
    npy = save(tmp_path / "a.npy", np.zeros((4, 2)))
    assert isinstance(open_npy(npy), sources.Source)
    assert isinstance(ArraySource(np.zeros(3)), sources.Source)
