"""Directories of files: ``np.load`` over ``.npy`` files read straight into the block,
and every file it cannot read that way loaded by ``np.load`` itself."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.engine.io.files import FileRows, FilesReader
from tierflow.errors import BlockError

from common import examples

ROW = (3, 4)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, *ROW)).astype(np.float32)


def save_each(folder: Path, values: np.ndarray) -> list[str]:
    paths = []
    for i, v in enumerate(values):
        path = folder / f"{i}.npy"
        np.save(path, v)
        paths.append(str(path))
    return paths


def reader(paths: list[str], load: object = np.load, per_file: int | None = 1) -> FilesReader:
    return FilesReader(paths, load, FileRows(per_file, np.dtype(np.float32), ROW), 4)  # type: ignore[arg-type]


def test_np_load_over_npy_files_reads_them_straight_into_the_block(tmp_path: Path) -> None:
    values = rows(10)
    r = reader(save_each(tmp_path, values))
    got = np.concatenate([r.read_block(j) for j in range(r.nblocks)])
    np.testing.assert_array_equal(got, values)
    assert r._npy is not None and r._npy.header is not None  # the header was learnt once
    np.testing.assert_array_equal(r.read(3, 7), values[3:7])


def test_another_loader_or_unknown_row_counts_load_every_file(tmp_path: Path) -> None:
    paths = save_each(tmp_path, rows(4))
    assert reader(paths, lambda p: np.load(p))._npy is None
    assert reader(paths, per_file=None)._npy is None


def test_files_of_another_layout_go_through_np_load(tmp_path: Path) -> None:
    """The same rows as ``np.load`` gives, cast as it is: other dtypes, byte orders and
    orders, a version 2 header, a file with trailing bytes; an ``.npz`` is refused."""
    values = rows(7)
    paths = save_each(tmp_path, values)
    np.save(paths[1], values[1].astype(np.float64))
    np.save(paths[2], values[2].astype(">f4"))
    np.save(paths[3], np.asfortranarray(values[3]))
    with open(paths[4], "wb") as f:
        np.lib.format.write_array(f, values[4], version=(2, 0))
    with open(paths[5], "ab") as f:
        f.write(b"trailing bytes np.load ignores")
    r = reader(paths)
    got = np.concatenate([r.read_block(j) for j in range(r.nblocks)])
    np.testing.assert_array_equal(got, values)
    npz = str(tmp_path / "rows.npz")
    np.savez(npz, values[6])
    with pytest.raises(BlockError, match=r"load returned shape \(1,\) for file 1 of 2"):
        reader([paths[0], npz]).read_block(0)  # np.load gives an NpzFile, not a row


def test_a_truncated_or_missing_file_is_reported_by_np_load(tmp_path: Path) -> None:
    paths = save_each(tmp_path, rows(4))
    r = reader(paths)
    r.read_block(0)
    data = Path(paths[2]).read_bytes()
    Path(paths[2]).write_bytes(data[:-8])
    with pytest.raises(BlockError, match=r"load failed on file 2 of 4 .*ValueError"):
        r.read_block(0)
    Path(paths[2]).unlink()
    with pytest.raises(BlockError, match=r"load failed on file 2 of 4 .*FileNotFoundError"):
        r.read_block(0)


def test_several_rows_per_file_are_read_straight_in_too(tmp_path: Path) -> None:
    values = rows(12)
    paths = save_each(tmp_path, values.reshape(4, 3, *ROW))
    r = reader(paths, per_file=3)
    assert r._npy is not None
    np.testing.assert_array_equal(r.read(2, 11), values[2:11])
    np.save(paths[1], values[:2])  # two rows where three are expected
    with pytest.raises(BlockError, match=r"shape \(2, 3, 4\) for file 1 of 4"):
        r.read(0, 12)


LAYOUTS = st.sampled_from(["<f4", ">f4", "<f8", "<i2", "fortran", "v2"])


@settings(max_examples=examples(40), deadline=None)
@given(
    layouts=st.lists(LAYOUTS, min_size=1, max_size=9),
    per_block=st.integers(1, 4),
    span=st.tuples(st.integers(0, 9), st.integers(0, 9)),
)
def test_any_mix_of_npy_layouts_reads_as_np_load_does(
    layouts: list[str], per_block: int, span: tuple[int, int]
) -> None:
    values = np.round(rows(len(layouts)) * 100)  # integral: every layout holds them exactly
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for i, (layout, v) in enumerate(zip(layouts, values, strict=True)):
            path = f"{folder}/{i}.npy"
            if layout == "v2":
                with open(path, "wb") as f:
                    np.lib.format.write_array(f, v, version=(2, 0))
            else:
                np.save(path, np.asfortranarray(v) if layout == "fortran" else v.astype(layout))
            paths.append(path)
        r = FilesReader(paths, np.load, FileRows(1, np.dtype(np.float32), ROW), per_block)
        want = np.stack([np.load(p).astype(np.float32) for p in paths])
        got = np.concatenate([r.read_block(j) for j in range(r.nblocks)])
        np.testing.assert_array_equal(got, want)
        a, b = sorted(v % (len(paths) + 1) for v in span)
        np.testing.assert_array_equal(r.read(a, b), want[a:b])
