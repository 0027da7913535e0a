"""Objects that slice like arrays: ``tw.from_array`` reads them block by block (any
blocks, ``rows=`` each block's rows), ``tw.store`` writes into them, region by region,
on their stored chunks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

import tierflow as tw
from tierflow.errors import SourceError


class Sliced:
    """An object that slices like an array and counts its reads."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.shape = values.shape
        self.dtype = values.dtype
        self.ndim = values.ndim
        self.reads: list[tuple[int, int]] = []

    def __getitem__(self, key: slice) -> np.ndarray:
        self.reads.append((key.start, key.stop))
        return self.values[key]


@pytest.mark.executors("threads", "serial")  # counts reads in this process
def test_an_object_that_slices_is_read_block_by_block_never_whole() -> None:
    values = np.arange(3000.0).reshape(1000, 3)
    obj = Sliced(values)
    x = tw.from_array(obj, rows=(100, 400, 500))
    assert x.chunks == ((100, 400, 500), (3,)) and obj.reads == []
    np.testing.assert_array_equal((x * 2).sum(axis=0).compute(), (values * 2).sum(axis=0))
    assert sorted(obj.reads) == [(0, 100), (100, 500), (500, 1000)]


def test_a_zarr_array_through_from_array_on_every_executor(
    executor_name: str, tmp_path: Path
) -> None:
    values = np.random.default_rng(0).random((500, 4)).astype(np.float32)
    z = zarr.create_array(tmp_path / "z.zarr", shape=values.shape, chunks=(64, 4), dtype="f4")
    z[:] = values
    x = tw.from_array(z, rows=128)
    np.testing.assert_array_equal(x.compute(executor=executor_name), values)


@pytest.mark.executors("threads")
def test_rows_per_block_given_one_by_one_are_checked() -> None:
    with pytest.raises(ValueError, match="add up to 9, but the array has 10 rows"):
        tw.from_array(np.ones(10), rows=(4, 5))
    with pytest.raises(ValueError, match="a block cannot have -1 rows"):
        tw.from_array(np.ones(10), rows=(11, -1))
    x = tw.from_array(np.arange(10), rows=[3, 0, 7])
    assert x.chunks == ((3, 7),)
    assert "2 of 3 to 7 rows" in repr(x)


@pytest.mark.executors("threads")
def test_an_object_that_changed_shape_is_refused_naming_the_rows() -> None:
    obj = Sliced(np.ones((10, 2)))
    x = tw.from_array(obj, rows=5)
    obj.values = np.ones((7, 2))
    with pytest.raises(SourceError, match=r"rows 5:10 came back with shape \(2, 2\)"):
        x.compute()


def test_store_writes_only_its_region_on_whole_chunks(executor_name: str, tmp_path: Path) -> None:
    target = zarr.create_array(
        tmp_path / "t.zarr", shape=(1000, 3), chunks=(64, 3), dtype="f8", fill_value=-1.0
    )
    values = np.arange(1500.0).reshape(500, 3)
    x = tw.from_array(values, rows=100)  # blocks that cut the target's chunks
    tw.store(x * 2, target, (slice(300, 800),), executor=executor_name)
    got = target[:]
    assert (got[:300] == -1).all() and (got[800:] == -1).all()
    np.testing.assert_array_equal(got[300:800], values * 2)


@pytest.mark.executors("threads")
def test_store_of_several_sources_in_one_compute(tmp_path: Path) -> None:
    values = np.random.default_rng(1).random((300, 2))
    x = tw.from_array(values, rows=64)
    a = np.lib.format.open_memmap(tmp_path / "a.npy", "w+", np.float64, (300, 2))
    b = zarr.create_array(tmp_path / "b.zarr", shape=(300, 4), chunks=(50, 2), dtype="f8")
    b[:] = 7.0
    with tw.profile() as p:
        tw.store([x, x + 1], [a, b], [None, (slice(None), slice(2, 4))])
    assert len(p.computes) == 1
    np.testing.assert_array_equal(np.asarray(a), values)
    np.testing.assert_array_equal(b[:, 2:], values + 1)
    assert (b[:, :2] == 7.0).all()


@pytest.mark.executors("threads")
def test_store_says_what_does_not_fit(tmp_path: Path) -> None:
    x = tw.from_array(np.ones((10, 2)), rows=4)
    target = np.zeros((20, 2))
    with pytest.raises(ValueError, match=r"has shape \(10, 2\) but its region"):
        tw.store(x, target)
    with pytest.raises(ValueError, match="step 2; use step 1"):
        tw.store(x, target, (slice(0, 20, 2),))
    with pytest.raises(ValueError, match=r"store\(compute=False\) is not supported"):
        tw.store(x, target, (slice(0, 10),), compute=False)
    with pytest.raises(ValueError, match="rows are unknown until counted"):
        tw.store(x[x[:, 0] > 0], target, (slice(0, 10),))
    with pytest.raises(ValueError, match="2 sources, 1 targets"):
        tw.store([x, x], [target], [None, None])
    tw.store(x, target, (slice(5, 15),))
    np.testing.assert_array_equal(target[5:15], 1.0)
    assert (target[:5] == 0).all() and (target[15:] == 0).all()


@pytest.mark.executors("threads")
def test_store_refuses_a_source_that_reads_its_target(tmp_path: Path) -> None:
    """Written in place while other blocks read it (a shift, a window over neighbours),
    the answer would depend on the order the blocks ran: refused, the target untouched."""
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "t.zarr"
    target = zarr.create_array(path, shape=(100, 2), chunks=(10, 2), dtype="f8")
    values = np.arange(200.0).reshape(100, 2)
    target[:] = values
    again = zarr.open_array(path, mode="r+")  # another object over the same array
    shifted = tw.from_array(again, rows=10)[1:]
    with pytest.raises(ValueError, match=r"the source reads .* which holds the target"):
        tw.store(shifted, target, (slice(0, 99),))
    with pytest.raises(ValueError, match="which holds the target"):
        tw.store(tw.from_zarr(path)[1:] + 1, target, (slice(0, 99),))  # tierflow's reader
    np.testing.assert_array_equal(target[:], values)  # nothing was written
    # another array beside it in the same folder is fine
    other = zarr.create_array(tmp_path / "o.zarr", shape=(99, 2), chunks=(10, 2), dtype="f8")
    tw.store(shifted, other)
    np.testing.assert_array_equal(other[:], values[1:])
    # an HDF5 dataset read and written, and a memory-mapped file
    with h5py.File(tmp_path / "t.h5", "w") as f:
        d = f.create_dataset("d", data=values)
        with pytest.raises(ValueError, match="which holds the target"):
            tw.store(tw.from_array(d, rows=10)[::-1], d)
    mm = np.lib.format.open_memmap(tmp_path / "m.npy", "w+", np.float64, (100, 2))
    with pytest.raises(ValueError, match="which holds the target"):
        tw.store(tw.from_npy(tmp_path / "m.npy")[::-1], mm)
