"""HDF5 datasets and Parquet tables as lazy arrays: the same numbers as h5py and pyarrow,
blocks on chunks and row groups, clear errors, staleness, every executor."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numcodecs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, GzipCodec, ZstdCodec

import tierflow as tw
from tierflow.errors import SourceError


def _h5(path: Path, data: np.ndarray, **options: object) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("group/x", data=data, **options)
        f.create_dataset("names", data=np.array([b"a", b"b"]))
    return path


# -- HDF5 ------------------------------------------------------------------------------


def test_an_hdf5_dataset_computes_as_numpy_on_every_executor(
    executor_name: str, tmp_path: Path
) -> None:
    data = np.random.default_rng(0).random((5000, 6)).astype(np.float32)
    path = _h5(tmp_path / "a.h5", data, chunks=(250, 6), compression="gzip")
    x = tw.from_hdf5(path, "group/x", rows=1000)
    assert x.shape == (5000, 6) and x.dtype == np.float32
    np.testing.assert_array_equal((x * 2 + 1).compute(executor=executor_name), data * 2 + 1)
    np.testing.assert_allclose(
        x.sum(axis=0).compute(executor=executor_name), data.astype(np.float64).sum(0), rtol=1e-6
    )
    np.testing.assert_array_equal(x[1234:3456:7].compute(executor=executor_name), data[1234:3456:7])


def test_hdf5_blocks_are_whole_chunks_by_default(tmp_path: Path) -> None:
    data = np.arange(30_000.0).reshape(10_000, 3)
    path = _h5(tmp_path / "a.h5", data, chunks=(300, 3))
    x = tw.from_hdf5(path, "group/x")
    bounds = x._node.bounds
    assert all(b % 300 == 0 for b in bounds[:-1]) and bounds[-1] == 10_000
    np.testing.assert_array_equal(x.compute(), data)


def test_hdf5_errors_name_the_file_and_the_dataset(tmp_path: Path) -> None:
    path = _h5(tmp_path / "a.h5", np.ones((10, 2)))
    with pytest.raises(SourceError, match=r"has no dataset 'nope'; its datasets: group/x, names"):
        tw.from_hdf5(path, "nope")
    with pytest.raises(SourceError, match=r"'group' is a group, not a dataset"):
        tw.from_hdf5(path, "group")
    with pytest.raises(SourceError, match=r"dataset 'names' holds \|S1, not numbers"):
        tw.from_hdf5(path, "names")
    (tmp_path / "b.h5").write_bytes(b"not hdf5")
    with pytest.raises(SourceError, match=r"b.h5 is not a readable HDF5 file"):
        tw.from_hdf5(tmp_path / "b.h5", "x")


def test_hdf5_blocks_are_read_into_pooled_buffers_that_come_back(tmp_path: Path) -> None:
    from tierflow.engine.program import steps

    data = np.random.default_rng(1).random((8000, 4))
    x = tw.from_hdf5(_h5(tmp_path / "a.h5", data), "group/x", rows=1000)
    (x.sum(axis=0) + 0).compute(executor="serial")
    pool = steps._block_pool
    assert pool is not None
    reused = pool.reused
    np.testing.assert_allclose(x.sum(axis=0).compute(executor="serial"), data.sum(0))
    assert pool.reused - reused == 8  # every block's buffer was one given back before


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda x: x.map_blocks(lambda b: b),  # the block itself is the result
        lambda x: x[x[:, 0] > 0.5],  # rows kept after a mask
        lambda x: x.filter(lambda b: b[:, 1] > 0.3),
        lambda x: x[:, 1:3],  # a view of each block
    ],
)
def test_a_pooled_block_still_in_use_is_not_read_into_again(
    tmp_path: Path, pipeline: Callable[[tw.Array], tw.Array]
) -> None:
    data = np.random.default_rng(2).random((8000, 4))
    x = tw.from_hdf5(_h5(tmp_path / "a.h5", data), "group/x", rows=1000)
    parts = [pipeline(x).compute(executor="serial"), pipeline(x).persist(executor="serial")]
    expected = pipeline(tw.from_array(data, rows=1000)).compute(executor="serial")
    for got in parts:
        np.testing.assert_array_equal(np.asarray(got), expected)


def test_a_partial_that_is_a_view_of_a_pooled_block_keeps_its_rows(tmp_path: Path) -> None:
    data = np.random.default_rng(4).random((8000, 4))
    x = tw.from_hdf5(_h5(tmp_path / "a.h5", data), "group/x", rows=1000)
    firsts = x.reduction(
        lambda b: b[:2], lambda p, q: np.concatenate([p, q]), commutative=False, shape=None
    )
    np.testing.assert_array_equal(
        firsts.compute(executor="serial"),
        np.concatenate([data[i : i + 2] for i in range(0, 8000, 1000)]),
    )


def test_an_hdf5_array_is_read_straight_into_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierflow.engine.program import steps

    lent: list[tuple[int, ...]] = []
    lend = steps._lend
    monkeypatch.setattr(
        steps, "_lend", lambda shape, dtype: lent.append(shape) or lend(shape, dtype)
    )
    data = np.random.default_rng(3).random((5000, 3)).astype(np.float32)
    x = tw.from_hdf5(_h5(tmp_path / "a.h5", data), "group/x", rows=1000)
    np.testing.assert_array_equal(x.compute(executor="serial"), data)
    x.to_npy(tmp_path / "b.npy", executor="serial")
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), data)
    assert lent == []  # no block of its own: read into the result's and the file's rows
    np.testing.assert_array_equal((x + 1).compute(executor="serial"), data + 1)
    assert lent == [(1000, 3)] * 5


def test_an_hdf5_file_changed_after_the_build_is_refused(tmp_path: Path) -> None:
    path = _h5(tmp_path / "a.h5", np.ones((10, 2)))
    x = tw.from_hdf5(path, "group/x")
    key = x.key
    with h5py.File(path, "a") as f:
        f["group/x"][0, 0] = 5.0
    with pytest.raises(SourceError, match=r"changed after the array was built.*tw.from_hdf5"):
        x.compute()
    assert tw.from_hdf5(path, "group/x").key != key  # the key follows the file


# -- Parquet ---------------------------------------------------------------------------


def _table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table(
        {
            "a": rng.random(n),
            "b": rng.integers(0, 100, n).astype(np.int32),
            "c": rng.random(n).astype(np.float32),
            "label": [f"r{i}" for i in range(n)],
        }
    )


def _expected(tables: list[pa.Table], columns: list[str], dtype: str) -> np.ndarray:
    return np.concatenate(
        [np.stack([t.column(c).to_numpy() for c in columns], axis=1).astype(dtype) for t in tables]
    )


def test_parquet_files_become_one_array_in_row_groups(executor_name: str, tmp_path: Path) -> None:
    tables = [_table(3000, 1), _table(2000, 2)]
    for k, t in enumerate(tables):
        pq.write_table(t, tmp_path / f"part-{k}.parquet", row_group_size=500)
    x = tw.from_parquet(str(tmp_path / "part-*.parquet"), columns=["a", "b", "c"], rows=1000)
    want = _expected(tables, ["a", "b", "c"], "float32")
    assert x.shape == (5000, 3) and x.dtype == np.float32
    assert x._node.bounds == tuple(range(0, 5001, 1000))  # two row groups a block
    np.testing.assert_array_equal(x.compute(executor=executor_name), want)
    np.testing.assert_allclose(
        x.sum(axis=0).compute(executor=executor_name),
        want.astype(np.float64).sum(0),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(x[2990:3010].compute(executor=executor_name), want[2990:3010])


def test_a_big_row_group_is_one_block_and_small_ones_go_together(tmp_path: Path) -> None:
    pq.write_table(_table(1000, 1), tmp_path / "a.parquet", row_group_size=100)
    pq.write_table(_table(3000, 2), tmp_path / "b.parquet", row_group_size=3000)
    x = tw.from_parquet([tmp_path / "a.parquet", tmp_path / "b.parquet"], ["a"], rows=450)
    assert x._node.bounds == (0, 500, 1000, 4000)
    assert x.compute().shape == (4000, 1)


def test_parquet_refuses_a_column_that_is_not_numeric_or_missing(tmp_path: Path) -> None:
    pq.write_table(_table(10, 1), tmp_path / "a.parquet")
    with pytest.raises(SourceError, match=r"column 'label' is string, not numeric"):
        tw.from_parquet(tmp_path / "a.parquet")  # every column by default
    with pytest.raises(SourceError, match=r"has no column 'z'; its columns: a, b, c, label"):
        tw.from_parquet(tmp_path / "a.parquet", columns=["a", "z"])
    with pytest.raises(FileNotFoundError, match="no file matches"):
        tw.from_parquet(str(tmp_path / "none-*.parquet"))
    with pytest.raises(ValueError, match="nulls='keep': use 'nan' or 'raise'"):
        tw.from_parquet(tmp_path / "a.parquet", columns=["a"], nulls="keep")


def test_parquet_nulls_are_nan_or_refused(tmp_path: Path) -> None:
    table = pa.table({"a": pa.array([1.0, None, 3.0]), "b": pa.array([1, 2, None])})
    pq.write_table(table, tmp_path / "n.parquet")
    got = tw.from_parquet(tmp_path / "n.parquet", dtype="float64").compute()
    np.testing.assert_array_equal(got, [[1.0, 1.0], [np.nan, 2.0], [3.0, np.nan]])
    with pytest.raises(SourceError, match=r"column 'a' has 1 null\(s\) in row group 0"):
        tw.from_parquet(tmp_path / "n.parquet", nulls="raise").compute()
    with pytest.raises(SourceError, match=r"int64 has no NaN: pass a float dtype"):
        tw.from_parquet(tmp_path / "n.parquet", columns=["b"], dtype="int64").compute()


def test_parquet_values_out_of_the_dtypes_range_are_refused_naming_column_and_value(
    executor_name: str, tmp_path: Path
) -> None:
    table = pa.table({"a": np.array([1, 2, 3], np.int64), "b": np.array([5, 300, -7], np.int64)})
    pq.write_table(table, tmp_path / "t.parquet")
    x = tw.from_parquet(tmp_path / "t.parquet", dtype="int8")
    message = r"column 'b' holds 300 \(row 1 of row group 0\), outside int8's range -128..127"
    with pytest.raises(SourceError, match=message):
        x.compute(executor=executor_name)
    ok = tw.from_parquet(tmp_path / "t.parquet", columns=["a"], dtype="int8").compute()
    assert ok.dtype == np.int8 and ok[:, 0].tolist() == [1, 2, 3]


@pytest.mark.executors("threads")
@pytest.mark.parametrize(
    ("values", "dtype", "bad"),
    [
        (np.array([0, 255, 256], np.int64), "uint8", "256"),
        (np.array([0, -1, 4], np.int32), "uint16", "-1"),
        (np.array([2**40, 0], np.int64), "int32", "1099511627776"),
        (np.array([2**63, 1], np.uint64), "int64", "9223372036854775808"),
        (np.array([1.0, 2.5], np.float64), "int32", "2.5"),
        (np.array([1.0, np.nan], np.float64), "int64", "nan"),
        (np.array([1.0, np.inf], np.float64), "int16", "inf"),
        (np.array([1.0, 1e300], np.float64), "float32", "1e+300"),
        (np.array([1.0, -7e4], np.float64), "float16", "-70000.0"),
        (np.array([1, 70000], np.int64), "float16", "70000"),
    ],
)
def test_every_narrowing_cast_a_parquet_source_makes_is_checked(
    tmp_path: Path, values: np.ndarray, dtype: str, bad: str
) -> None:
    pq.write_table(pa.table({"v": values}), tmp_path / "t.parquet")
    with pytest.raises(SourceError, match=rf"column 'v' holds {re.escape(bad)} "):
        tw.from_parquet(tmp_path / "t.parquet", dtype=dtype).compute()


@pytest.mark.executors("threads")
def test_parquet_casts_that_keep_every_value_are_made(tmp_path: Path) -> None:
    """Whole floats to integers, floats to a smaller float within its range (NaN and the
    infinities too), booleans, any byte order: the values NumPy's cast gives."""
    table = pa.table(
        {
            "i": np.array([-3, 0, 127], np.int64),
            "f": np.array([-3.0, 0.0, 127.0], np.float64),
            "w": np.array([np.nan, np.inf, -1.5], np.float64),
            "b": np.array([True, False, True]),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    ints = tw.from_parquet(tmp_path / "t.parquet", columns=["i", "f", "b"], dtype="int8")
    np.testing.assert_array_equal(ints.compute(), [[-3, -3, 1], [0, 0, 0], [127, 127, 1]])
    floats = tw.from_parquet(tmp_path / "t.parquet", dtype=">f4").compute()
    assert floats.dtype == np.dtype(">f4")
    np.testing.assert_array_equal(floats[:, 2], np.array([np.nan, np.inf, -1.5], np.float32))


def test_a_parquet_file_changed_after_the_build_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(_table(10, 1), path)
    x = tw.from_parquet(path, columns=["a"])
    pq.write_table(_table(12, 2), path)
    os.utime(path, ns=(1, 1))  # a different modification time even on a coarse clock
    with pytest.raises(SourceError, match=r"changed after the array was built.*tw.from_parquet"):
        x.compute()


# -- Zarr ------------------------------------------------------------------------------


def _zarr(path: Path | str, data: np.ndarray, **options: object) -> zarr.Array:
    z = zarr.create_array(store=str(path), shape=data.shape, dtype=data.dtype, **options)
    z[:] = data
    return z


def test_a_zarr_array_computes_as_numpy_in_whole_chunks(executor_name: str, tmp_path: Path) -> None:
    data = np.random.default_rng(1).random((4000, 3, 2)).astype(np.float32)
    _zarr(tmp_path / "a.zarr", data, chunks=(300, 2, 2))  # trailing axes chunked too
    x = tw.from_zarr(tmp_path / "a.zarr", rows=1000)
    assert x.shape == (4000, 3, 2) and x.dtype == np.float32
    assert x._node.bounds == (0, 900, 1800, 2700, 3600, 4000)  # 1000 rounded to 3 chunks
    np.testing.assert_array_equal((x * 2).compute(executor=executor_name), data * 2)
    np.testing.assert_allclose(
        x.sum(axis=0).compute(executor=executor_name), data.astype(np.float64).sum(0), rtol=1e-6
    )


def test_zarr_format_2_and_sharded_arrays(tmp_path: Path) -> None:
    data = np.arange(6000, dtype=np.int32).reshape(2000, 3)
    _zarr(tmp_path / "v2.zarr", data, chunks=(128, 3), zarr_format=2)
    np.testing.assert_array_equal(tw.from_zarr(tmp_path / "v2.zarr").compute(), data)
    _zarr(tmp_path / "s.zarr", data, chunks=(50, 3), shards=(500, 3))
    x = tw.from_zarr(tmp_path / "s.zarr", rows=700)
    assert x._node.bounds == (0, 500, 1000, 1500, 2000)  # whole shards
    np.testing.assert_array_equal(x.compute(), data)


@pytest.mark.parametrize(
    ("options", "direct"),
    [
        ({"compressors": [BloscCodec(cname="lz4", shuffle="shuffle")]}, True),
        ({"compressors": [ZstdCodec(level=3)]}, True),
        ({"compressors": [GzipCodec()]}, True),
        ({"compressors": None}, True),
        ({"zarr_format": 2}, True),
        ({"zarr_format": 2, "compressors": None}, True),
        ({"filters": [numcodecs.Shuffle(elementsize=8)], "zarr_format": 2}, False),
        ({"serializer": BytesCodec(endian="big")}, False),
        ({"chunks": (100, 2)}, False),  # the trailing axis in two chunks
        ({"shards": (300, 3)}, False),
    ],
)
def test_zarr_chunks_decoded_straight_into_blocks_match_zarrs_own_reads(
    tmp_path: Path, options: dict[str, object], direct: bool
) -> None:
    data = np.round(np.random.default_rng(5).standard_normal((1050, 3)), 2)
    z = _zarr(tmp_path / "a.zarr", data, **{"chunks": (100, 3), **options})
    z[200:300] = 0.0  # the fill value: zarr removes the chunk, which then reads as it
    data[200:300] = 0.0
    x = tw.from_zarr(tmp_path / "a.zarr", rows=300)
    assert (x._node.reader.decoder is not None) == direct
    np.testing.assert_array_equal(x.compute(executor="serial"), data)
    np.testing.assert_array_equal(x[1000:].compute(executor="serial"), data[1000:])  # last chunk


def test_a_format_2_array_without_a_fill_value_reads_missing_chunks_as_zarr_does(
    tmp_path: Path,
) -> None:
    z = zarr.create_array(
        store=str(tmp_path / "v2.zarr"), shape=(30, 2), chunks=(10, 2), dtype="i4",
        zarr_format=2, fill_value=None,
    )  # fmt: skip
    z[:10] = 5
    x = tw.from_zarr(tmp_path / "v2.zarr")
    assert x._node.reader.decoder is not None
    np.testing.assert_array_equal(x.compute(executor="serial"), z[:])


def test_a_chunk_bigger_than_the_budget_asks_for_smaller_chunks(tmp_path: Path) -> None:
    from tierflow import config
    from tierflow.errors import OutOfMemoryError

    _zarr(tmp_path / "a.zarr", np.ones((300_000, 4)), chunks=(100_000, 4))  # 3.2 MB chunks
    x = tw.from_zarr(tmp_path / "a.zarr")
    with (
        config.set(ram_budget="4MB"),
        pytest.raises(OutOfMemoryError, match=r"scratch 6\.\d+ MB.*in smaller chunks"),
    ):
        x.sum().compute()


def test_a_chunk_never_written_reads_as_the_fill_value(tmp_path: Path) -> None:
    z = zarr.create_array(
        store=str(tmp_path / "f.zarr"), shape=(1000, 2), chunks=(100, 2), dtype="float64",
        fill_value=-1.0,
    )  # fmt: skip
    z[:250] = 5.0
    want = np.full((1000, 2), -1.0)
    want[:250] = 5.0
    np.testing.assert_array_equal(tw.from_zarr(tmp_path / "f.zarr").compute(), want)


def test_a_corrupt_chunk_is_named(tmp_path: Path) -> None:
    _zarr(tmp_path / "c.zarr", np.ones((1000, 2)), chunks=(100, 2))
    x = tw.from_zarr(tmp_path / "c.zarr", rows=500)
    bad = tmp_path / "c.zarr" / "c" / "7" / "0"
    stat = bad.stat()
    bad.write_bytes(b"\x00garbage" * 3)
    os.utime(bad, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    y = tw.from_zarr(tmp_path / "c.zarr", rows=500)  # built after the damage
    with pytest.raises(SourceError, match=r"chunk 'c/7/0' \(rows 700:800\) cannot be read"):
        y.compute()
    with pytest.raises(SourceError, match=r"changed after the array was built.*tw.from_zarr"):
        x.compute()  # built before it: its objects' sizes differ now


def test_zarr_errors_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Zarr array at"):
        tw.from_zarr(tmp_path / "none.zarr")
    zarr.create_array(store=str(tmp_path / "s.zarr"), shape=(3,), dtype=str)
    with pytest.raises(SourceError, match="not numbers"):
        tw.from_zarr(tmp_path / "s.zarr")


@pytest.mark.executors("threads")  # refused before any compute
def test_an_unreachable_url_is_a_clear_error_in_seconds() -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(SourceError, match=r"s3://bucket/x.zarr could not be reached.*endpoint"):
        tw.from_zarr(
            "s3://bucket/x.zarr",
            storage_options={"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"},
        )
    assert time.monotonic() - start < 60


def test_zarr_over_s3_gives_the_same_bytes_as_on_disk(
    s3_server: dict[str, object], tmp_path: Path
) -> None:
    data = np.random.default_rng(2).random((3000, 4)).astype(np.float32)
    _zarr(tmp_path / "a.zarr", data, chunks=(250, 4))
    url = "s3://tierflow/a.zarr"
    z = zarr.create_array(
        store=url, shape=data.shape, dtype=data.dtype, chunks=(250, 4),
        storage_options=s3_server, overwrite=True,
    )  # fmt: skip
    z[:] = data
    remote = tw.from_zarr(url, rows=1000, storage_options=s3_server)
    local = tw.from_zarr(tmp_path / "a.zarr", rows=1000)
    assert remote.compute().tobytes() == local.compute().tobytes() == data.tobytes()
    np.testing.assert_array_equal(remote.sum(axis=0).compute(), local.sum(axis=0).compute())
    z[:250] = 0  # a chunk rewritten in the bucket: its ETag changes
    with pytest.raises(SourceError, match="changed after the array was built"):
        remote.compute()


# -- to_zarr ---------------------------------------------------------------------------


def test_to_zarr_writes_the_same_numbers_on_every_executor(
    executor_name: str, tmp_path: Path
) -> None:
    data = np.random.default_rng(3).random((5000, 4)).astype(np.float32)
    x = tw.from_array(data, rows=1000)
    (x * 2 + 1).to_zarr(tmp_path / "out.zarr", executor=executor_name)
    z = zarr.open_array(str(tmp_path / "out.zarr"), mode="r")
    assert z.chunks == (1000, 4) and z.shape == (5000, 4)
    np.testing.assert_array_equal(z[:], data * 2 + 1)
    assert z.attrs["tierflow"]["complete"] is True
    # and back again: the same bytes
    back = tw.from_zarr(tmp_path / "out.zarr").compute(executor=executor_name)
    assert back.tobytes() == (data * 2 + 1).tobytes()


@pytest.mark.executors("threads", "processes")
def test_to_zarr_keeps_complex_negative_zeros_in_chunks_zarr_takes_for_empty(
    executor_name: str, tmp_path: Path
) -> None:
    # Zarr takes a chunk of complex signed zeros for its fill value (0j) and would leave
    # it unwritten: it would read back as +0.0. Every chunk is written.
    data = np.array([1 + 1j, complex(-0.0, 0.0), complex(0.0, -0.0), -0.0j], ">c16")
    tw.from_array(data, rows=1).to_zarr(tmp_path / "z.zarr", executor=executor_name)
    z = zarr.open_array(str(tmp_path / "z.zarr"), mode="r")
    back = z[:]
    assert back.tobytes() == data.astype(back.dtype).tobytes()
    assert z.nchunks_initialized == 4


def test_to_zarr_chunks_shards_and_compressors(tmp_path: Path) -> None:
    data = np.arange(24_000.0).reshape(6000, 4)
    x = tw.from_array(data, rows=2000)
    x.to_zarr(tmp_path / "s.zarr", chunks=250, shards=1000, compressors=None)
    z = zarr.open_array(str(tmp_path / "s.zarr"), mode="r")
    assert z.chunks == (250, 4) and z.shards == (1000, 4) and z.compressors == ()
    np.testing.assert_array_equal(z[:], data)
    with pytest.raises(
        ValueError,
        match=r"blocks start at rows such as 2000, which are not whole chunks of 300 rows",
    ):
        x.to_zarr(tmp_path / "bad.zarr", chunks=300)
    with pytest.raises(
        ValueError, match=r"shards \(700, 4\) must be whole numbers of chunks \(250, 4\)"
    ):
        x.to_zarr(tmp_path / "bad.zarr", chunks=250, shards=700)
    assert not (tmp_path / "bad.zarr").exists()  # refused before anything was written


def test_to_zarr_of_a_masked_array_grows_in_whole_chunks(
    executor_name: str, tmp_path: Path
) -> None:
    data = np.random.default_rng(4).random((7000, 3))
    x = tw.from_array(data, rows=1000)
    kept = x[x[:, 0] > 0.3]
    kept.to_zarr(tmp_path / "m.zarr", chunks=400, executor=executor_name)
    z = zarr.open_array(str(tmp_path / "m.zarr"), mode="r")
    want = data[data[:, 0] > 0.3]
    assert z.shape == want.shape and z.chunks == (400, 3)
    np.testing.assert_array_equal(z[:], want)
    assert z.attrs["tierflow"]["complete"] is True


def test_a_failed_to_zarr_leaves_the_array_marked_incomplete_and_cache_resumes(
    tmp_path: Path,
) -> None:
    data = np.arange(8000.0).reshape(4000, 2)
    calls = tmp_path / "calls"
    calls.mkdir()

    def fails_on_block_3(block: np.ndarray) -> np.ndarray:
        (calls / f"{int(block[0, 0])}").touch()
        if block[0, 0] == 6000.0 and not (tmp_path / "fixed").exists():
            raise RuntimeError("block 3 fails")
        return block * 2

    y = tw.from_array(data, rows=1000).map_blocks(fails_on_block_3, row_shape=(2,))
    with pytest.raises(RuntimeError, match="block 3 fails"):
        y.to_zarr(tmp_path / "r.zarr", cache=str(tmp_path / "store"), executor="serial")
    z = zarr.open_array(str(tmp_path / "r.zarr"), mode="r")
    assert z.attrs["tierflow"]["complete"] is False
    (tmp_path / "fixed").touch()
    for f in calls.iterdir():
        f.unlink()
    y.to_zarr(tmp_path / "r.zarr", cache=str(tmp_path / "store"), executor="serial")
    z = zarr.open_array(str(tmp_path / "r.zarr"), mode="r")
    np.testing.assert_array_equal(z[:], data * 2)
    assert z.attrs["tierflow"]["complete"] is True
    assert sorted(int(p.name) for p in calls.iterdir()) == [6000]  # only the failed block ran


def test_to_zarr_over_s3_matches_a_local_write(
    s3_server: dict[str, object], tmp_path: Path
) -> None:
    data = np.random.default_rng(5).random((3000, 4)).astype(np.float32)
    x = tw.from_array(data, rows=500)
    url = f"s3://tierflow/{tmp_path.name}/out.zarr"  # one server for the whole session
    x.to_zarr(url, storage_options=s3_server)
    x.to_zarr(tmp_path / "out.zarr")
    remote = tw.from_zarr(url, storage_options=s3_server)
    assert remote.compute().tobytes() == tw.from_zarr(tmp_path / "out.zarr").compute().tobytes()


def test_zarr_rows_in_object_storage_are_fetched_ahead_of_their_tasks(
    s3_server: dict[str, object],
) -> None:
    data = np.random.default_rng(6).random((4000, 4))
    z = zarr.create_array(
        store="s3://tierflow/ahead.zarr", shape=data.shape, dtype=data.dtype, chunks=(100, 4),
        storage_options=s3_server, overwrite=True,
    )  # fmt: skip
    z[:] = data
    x = tw.from_zarr("s3://tierflow/ahead.zarr", rows=100, storage_options=s3_server)
    np.testing.assert_array_equal((x * 2).compute(executor="threads"), data * 2)
    reader = x._node.reader
    assert reader.reads_ahead and reader.ahead_hits > 0  # 40 blocks, queued behind 2 workers
    assert len(reader._ahead) <= 8


def test_a_zarr_task_is_admitted_with_its_decoded_rows_and_the_codec_scratch(
    tmp_path: Path,
) -> None:
    from tierflow.engine.program.steps import SourceStep

    _zarr(tmp_path / "a.zarr", np.ones((1000, 4), np.float32), chunks=(100, 4))
    x = tw.from_zarr(tmp_path / "a.zarr", rows=200)
    memory = SourceStep(x._node).memory(200, into_sink=False)
    assert memory.outputs == 200 * 4 * 4  # the decoded block
    assert memory.temps == 2 * 100 * 4 * 4  # one object encoded and decoded


# -- which executor reads a compressed HDF5 dataset --------------------------------------


class _Started:
    """A callback that keeps the executor each compute started on."""

    def __init__(self) -> None:
        self.executors: list[str] = []

    def start(self, event: object) -> None:
        self.executors.append(str(getattr(event, "executor", "")))


@pytest.mark.executors("threads")
def test_a_compressed_hdf5_dataset_is_read_by_worker_processes_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from tierflow.engine.runtime import run as run_module

    monkeypatch.setattr(run_module, "PROCESSES_PAY", 1)  # any size pays here
    data = np.random.default_rng(7).random((4000, 4)).astype(np.float32)
    gz = _h5(tmp_path / "gz.h5", data, chunks=(500, 4), compression="gzip")
    plain = _h5(tmp_path / "plain.h5", data, chunks=(500, 4))
    seen = _Started()
    x = tw.from_hdf5(gz, "group/x")
    lock = threading.Lock()  # a function that does not pickle stays in this process

    def locked(block: np.ndarray) -> np.ndarray:
        with lock:
            return block

    with tw.use_executor(None):  # no executor chosen: tierflow's choice
        np.testing.assert_array_equal((x * 2).compute(callbacks=[seen], progress=False), data * 2)
        (tw.from_hdf5(plain, "group/x") * 2).compute(callbacks=[seen], progress=False)
        with tw.use_executor("threads"):  # chosen by the user: kept
            (x * 2).compute(callbacks=[seen], progress=False)
        (x + tw.from_array(data, rows=500)).compute(callbacks=[seen], progress=False)
        x.map_blocks(locked).compute(callbacks=[seen], progress=False)
    assert seen.executors == ["processes", "threads", "threads", "threads", "threads"]
