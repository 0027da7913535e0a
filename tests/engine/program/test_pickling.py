"""Lazy arrays pickle: the graph by value, sources by path and the identity read at build."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import tierflow as tw
from tierflow import memory
from tierflow.errors import SourceError
from tierflow.storage import spill

TIMEOUT = 60  # seconds a spawned pool may take (each worker imports numpy and tierflow)

DUMPS: dict[str, Callable[[Any], bytes]] = {
    "pickle": pickle.dumps,
    "cloudpickle": cloudpickle.dumps,
    "multiprocessing": lambda x: bytes(ForkingPickler.dumps(x)),
}


def _data(rows: int = 1000) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / 7


def _pipeline(x: Any) -> Any:
    return np.sqrt(x * 2 + 1).sum(axis=0)


def _load_row(path: str) -> np.ndarray:
    return np.load(path)


# -- round trips over each kind of source -------------------------------------------------


def _sources(tmp_path: Path) -> dict[str, tuple[Any, np.ndarray]]:
    """Each kind of source over the same rows, with the rows it holds."""
    data = _data()
    npy = tmp_path / "x.npy"
    np.save(npy, data)
    raw = tmp_path / "x.f32"
    data.tofile(raw)
    rows = []
    for i in range(40):
        p = tmp_path / f"row{i:02d}.npy"
        np.save(p, data[i])
        rows.append(str(p))
    chunks = []
    for i in range(4):
        p = tmp_path / f"chunk{i}.npy"
        np.save(p, data[i * 10 : (i + 1) * 10 + i])  # 10, 11, 12, 13 rows
        chunks.append(str(p))
    chunk_rows = np.concatenate([np.load(p) for p in chunks])
    return {
        "npy": (tw.from_npy(npy, rows=128), data),
        "raw": (tw.from_raw(raw, np.float32, (-1, 4), rows=128), data),
        "array": (tw.from_array(data.copy(), rows=128), data),
        # a lambda: only cloudpickle can carry it, whatever pickler carries the array
        "files": (tw.from_files(rows, lambda p: np.load(p), rows=8), data[:40]),
        "files, unknown rows": (
            tw.from_files(chunks, _load_row, rows=2, rows_per_file=None),
            chunk_rows,
        ),
    }


@pytest.mark.parametrize("dumps", sorted(DUMPS))
def test_a_pipeline_over_each_source_computes_the_same_after_a_round_trip(
    tmp_path: Path, dumps: str
) -> None:
    for name, (x, data) in _sources(tmp_path).items():
        lazy = _pipeline(x)
        expected = lazy.compute()  # computed first: open maps and caches must not travel
        back = pickle.loads(DUMPS[dumps](lazy))
        np.testing.assert_array_equal(back.compute(), expected, err_msg=name)
        np.testing.assert_allclose(expected, _pipeline(data.astype(np.float64)), rtol=1e-5)
        assert back.key == lazy.key, name


@pytest.mark.parametrize("dumps", sorted(DUMPS))
def test_an_array_in_the_other_byte_order_keeps_it_whatever_the_pickler(
    tmp_path: Path, dumps: str
) -> None:
    """NumPy's own pickle (below protocol 5, as ``pickle.dumps`` and multiprocessing use
    by default) would bring the array back native: blocks would no longer have the
    array's dtype."""
    data = (np.arange(40, dtype=np.int64).reshape(20, 2) * 300 - 3000).astype(">i4")
    np.save(tmp_path / "b.npy", data)
    for x in (tw.from_array(data, rows=6), tw.from_npy(tmp_path / "b.npy", rows=6)):
        back = pickle.loads(DUMPS[dumps](x))
        assert back.dtype == data.dtype
        got, total, ordered = tw.compute(back, back.sum(axis=0), np.sort(back, axis=0))
        assert got.dtype == ordered.dtype == data.dtype
        np.testing.assert_array_equal(got, data)
        np.testing.assert_array_equal(total, data.sum(axis=0))
        np.testing.assert_array_equal(ordered, np.sort(data, axis=0))


def test_a_block_tasks_result_keeps_its_arrays_byte_order_under_protocol_4() -> None:
    """Dask's scheduler and multiprocessing pickle results with protocol 4."""
    from tierflow.engine.program.tasks import BlockResult

    swapped = np.array([1, 256, 70000], ">i4")
    result = BlockResult((swapped, [swapped, (swapped[:1], "x")], None), (swapped, None))
    back = pickle.loads(pickle.dumps(result, protocol=4))
    arrays = [back.partials[0], *back.partials[1][:1], back.partials[1][1][0], back.blocks[0]]
    assert [a.dtype.str for a in arrays] == [">i4"] * 4
    np.testing.assert_array_equal(back.partials[1][0], swapped)
    assert back.partials[1][1][1] == "x" and back.partials[2] is None


@pytest.mark.parametrize("dumps", sorted(DUMPS))
def test_user_functions_travel_by_value_whatever_the_pickler(tmp_path: Path, dumps: str) -> None:
    data = _data()
    path = tmp_path / "x.npy"
    np.save(path, data)
    x = tw.from_npy(path, rows=100)
    offset = 3.0
    mapped = x.map_blocks(lambda b: b + offset)
    kept = mapped[mapped[:, 0] > 100]
    filtered = x.filter(lambda b: b[:, 1] < 50)
    counted = x.reduction(lambda b: b.shape[0], lambda a, b: a + b, dtype=np.int64, shape=())
    for lazy, expected in [
        (mapped.sum(axis=0), (data + offset).sum(axis=0)),
        (kept.sum(axis=0), (data + offset)[data[:, 0] + offset > 100].sum(axis=0)),
        (filtered.sum(axis=0), data[data[:, 1] < 50].sum(axis=0)),
        (counted, len(data)),
    ]:
        back = pickle.loads(DUMPS[dumps](lazy))
        np.testing.assert_allclose(back.compute(), expected, rtol=1e-5)
        assert back.key == lazy.key


def test_a_file_source_travels_as_its_path_not_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "big.npy"
    np.save(path, np.zeros((1 << 18, 8), np.float32))  # 8 MB
    x = tw.from_npy(path)
    x.sum().compute()
    assert len(pickle.dumps(_pipeline(x))) < 10_000


def test_a_spilled_array_crosses_processes_by_path_and_pickles_by_value(tmp_path: Path) -> None:
    big = spill.map_array((1 << 20, 8), np.dtype(np.float64))  # 64 MB in a spill file
    big[:] = 1.5
    lazy = _pipeline(tw.from_array(big))
    by_path = bytes(ForkingPickler.dumps(lazy))
    assert len(by_path) < 100_000
    by_value = pickle.dumps(lazy)
    assert len(by_value) > big.nbytes
    for blob in (by_path, by_value):
        np.testing.assert_allclose(pickle.loads(blob).compute(), np.full(8, 2.0 * (1 << 20)))


def test_a_cache_mark_on_a_store_travels_as_the_store_path(tmp_path: Path) -> None:
    data = _data()
    path = tmp_path / "x.npy"
    np.save(path, data)
    with memory.store(tmp_path / "store", ram_mb=0) as store:
        lazy = tw.from_npy(path, rows=100).map_blocks(np.negative).cache(store).sum(axis=0)
        back = pickle.loads(pickle.dumps(lazy))
        np.testing.assert_allclose(back.compute(), -data.sum(axis=0), rtol=1e-5)
        assert len(store) > 0  # the unpickled mark wrote into the same store


# -- identity travels: a file changed since the build is refused -------------------------


def test_a_file_changed_after_the_build_is_refused_after_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, _data())
    blob = pickle.dumps(_pipeline(tw.from_npy(path, rows=100)))
    np.save(path, _data() + 1)  # same size, new contents
    os.utime(path, ns=(1, 1))  # and a modification time that cannot match the build's
    back = pickle.loads(blob)
    with pytest.raises(SourceError, match=r"x\.npy changed after the array was built"):
        back.compute()


def test_a_file_replaced_after_the_build_is_refused_after_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, _data())
    stat = os.stat(path)
    blob = cloudpickle.dumps(_pipeline(tw.from_npy(path, rows=100)))
    new = tmp_path / "new.npy"
    np.save(new, _data())
    os.utime(new, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime
    os.replace(new, path)
    with pytest.raises(SourceError, match="replaced by another file"):
        pickle.loads(blob).compute()


# -- a spawned pool --------------------------------------------------------------------------


def _compute(blob: bytes) -> np.ndarray:
    """Runs in a spawned worker: compute a lazy array pickled by the parent."""
    return np.asarray(pickle.loads(blob).compute())


def _compute_lazy(lazy: Any) -> np.ndarray:
    """Runs in a spawned worker: compute a lazy array that ``Pool.map`` pickled."""
    return np.asarray(lazy.compute())


def test_a_spawned_pool_computes_lazy_arrays(tmp_path: Path) -> None:
    sources = _sources(tmp_path)
    lazies = [_pipeline(x) for x, _ in sources.values()]
    expected = [lazy.compute() for lazy in lazies]
    with mp.get_context("spawn").Pool(2) as pool:
        by_map = pool.map_async(_compute_lazy, lazies).get(TIMEOUT)
        by_blob = pool.map_async(_compute, [cloudpickle.dumps(x) for x in lazies]).get(TIMEOUT)
    for name, want, got, got_blob in zip(sources, expected, by_map, by_blob, strict=True):
        np.testing.assert_array_equal(got, want, err_msg=name)
        np.testing.assert_array_equal(got_blob, want, err_msg=name)
