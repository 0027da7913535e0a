"""tw.from_dask and Array.to_dask: dask arrays in, dask arrays out, NumPy as the oracle."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import cloudpickle
import dask
import dask.array as da
import numpy as np
import pytest

import tierflow as tw
from tierflow.errors import BlockError, DependencyError, SourceError, install_command

# (shape, dask chunks, dtype): uneven chunks, chunks along trailing axes, one chunk.
CASES = {
    "1-D float32, uneven": ((1000,), ((300, 1, 450, 249),), np.float32),
    "2-D int64, trailing chunks": ((777, 6), (128, 4), np.int64),
    "3-D float32, trailing chunks": ((301, 4, 5), (50, 3, 2), np.float32),
    "2-D float32, one chunk": ((64, 3), (64, 3), np.float32),
}


def _data(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    values = np.random.default_rng(3).integers(-1000, 1000, size=shape)
    return values.astype(dtype) / (7 if np.dtype(dtype).kind == "f" else 1)


def _bounds(chunks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    edges = np.cumsum((0, *chunks)).tolist()
    return tuple(itertools.pairwise(edges))


class Calls:
    """Counts calls from any thread."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.n += 1


# -- from_dask ----------------------------------------------------------------------------


@pytest.mark.executors("threads", "serial", "processes", "dask", "ray")  # the source travels
@pytest.mark.parametrize("case", sorted(CASES))
def test_from_dask_computes_the_dask_arrays_rows_in_its_row_chunks(case: str) -> None:
    shape, chunks, dtype = CASES[case]
    data = _data(shape, dtype)
    d = da.from_array(data, chunks=chunks)
    x = tw.from_dask(d)
    assert (x.shape, x.dtype, x.ndim) == (data.shape, data.dtype, data.ndim)
    assert x.blocks == _bounds(d.chunks[0])
    got = x.compute()
    assert got.dtype == data.dtype
    np.testing.assert_array_equal(got, data)
    np.testing.assert_allclose(x.sum(axis=0).compute(), data.sum(axis=0, dtype=np.float64))
    np.testing.assert_array_equal(x[5:-7].compute(), data[5:-7])  # across chunk edges


@pytest.mark.executors("threads")
def test_from_dask_runs_the_dask_graph_not_a_copy_of_its_values() -> None:
    data = _data((500, 4), np.float32)
    calls = Calls()

    def shifted(block: np.ndarray) -> np.ndarray:
        if block.size:
            calls.add()
        return block + 1

    d = da.from_array(data, chunks=(100, 4)).map_blocks(shifted, dtype=np.float32)
    x = tw.from_dask(d)
    assert calls.n == 0, "building reads nothing"
    np.testing.assert_array_equal((x * 2).compute(), (data + 1) * 2)
    assert calls.n == 5, "each dask chunk is computed once"
    np.testing.assert_array_equal(x[120:180].compute(), data[120:180] + 1)
    assert calls.n == 6, "a row range inside one chunk computes that chunk only"


@pytest.mark.executors("threads", "serial")  # counts calls in this process
def test_a_chunk_too_big_for_the_budget_is_read_in_pieces_computed_once() -> None:
    tw.memory.budget("2MB")
    data = _data((200_000, 4), np.float32)  # two chunks of 1.6 MB
    calls = Calls()

    def counted(block: np.ndarray) -> np.ndarray:
        if block.size:
            calls.add()
        return block - 1

    d = da.from_array(data, chunks=(100_000, 4)).map_blocks(counted, dtype=np.float32)
    x = tw.from_dask(d)
    tasks = []
    total = x.sum(axis=0).compute(callbacks=[_Tasks(tasks)])
    np.testing.assert_allclose(total, (data.astype(np.float64) - 1).sum(axis=0), rtol=1e-6)
    assert len(tasks) > 3, "the chunks were cut to fit the budget"
    assert calls.n == 2, "each chunk computed once for all its pieces"
    assert x._node.reader._pieces == {}, "nothing kept once every row was read"


class _Tasks:
    """A callback that lists the block tasks a compute ran."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def start(self, event: Any) -> None:
        return None

    def task_done(self, event: Any) -> None:
        if event.name.startswith("block"):
            self.names.append(event.name)

    def finish(self, event: Any) -> None:
        return None


@pytest.mark.executors("threads")
def test_a_dask_graph_with_tasks_shared_across_row_chunks_computes_right() -> None:
    data = _data((400, 6), np.float64)
    d = da.from_array(data, chunks=(100, 6)).rechunk((70, 4))  # chunks cut across
    smoothed = d.map_overlap(lambda b: (b + np.roll(b, 1, axis=0)) / 2, depth=(1, 0))
    np.testing.assert_array_equal(tw.from_dask(smoothed).compute(), smoothed.compute())


# -- unknown chunk sizes ------------------------------------------------------------------


def test_nan_row_chunks_give_an_array_whose_row_count_is_known_once_computed() -> None:
    data = _data((900, 3), np.float32)
    d = da.from_array(data, chunks=(200, 2))
    masked = d[d[:, 0] > 0]
    assert np.isnan(masked.shape[0])
    x = tw.from_dask(masked)
    assert x.shape == (None, 3) and x.nblocks == 5
    want = data[data[:, 0] > 0]
    np.testing.assert_array_equal(x.compute(), want)
    np.testing.assert_allclose(x.mean(axis=0).compute(), want.mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(x.head(7).compute(), want[:7])


@pytest.mark.executors("threads")
def test_to_dask_of_unknown_row_counts_has_nan_chunks_as_dask_gives_after_a_mask() -> None:
    data = _data((900, 3), np.float32)
    x = tw.from_array(data, rows=200)
    kept = x[x[:, 0] > 0]
    y = kept.to_dask()
    assert len(y.chunks[0]) == 5 and all(np.isnan(c) for c in y.chunks[0])
    assert y.chunks[1:] == ((3,),)
    want = data[data[:, 0] > 0]
    np.testing.assert_array_equal(y.compute(scheduler="sync"), want)
    # and back: NaN chunks become unknown row counts again
    back = tw.from_dask(kept.to_dask())
    assert back.shape == (None, 3)
    np.testing.assert_array_equal(back.compute(), want)
    sizes = y.compute_chunk_sizes().chunks[0]  # in place, as dask does
    assert sizes == tuple(int((data[a:b, 0] > 0).sum()) for a, b in _bounds((200,) * 4 + (100,)))


def test_unknown_chunk_sizes_outside_the_rows_are_refused_with_the_remedy() -> None:
    d = da.from_array(_data((40, 30), np.float32), chunks=(10, 10))
    sideways = d[d[:, 0] > 0].T  # NaN chunks along axis 1
    with pytest.raises(ValueError, match=r"unknown chunk sizes along axis 1.*compute_chunk_sizes"):
        tw.from_dask(sideways)


# -- to_dask ------------------------------------------------------------------------------


@pytest.mark.executors("threads")
@pytest.mark.parametrize("scheduler", ["sync", "threads"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_to_dask_chunks_are_the_blocks_and_compute_through_tierflow(
    case: str, scheduler: str
) -> None:
    shape, _, dtype = CASES[case]
    data = _data(shape, dtype)
    x = tw.from_array(data, rows=90)
    y = x.to_dask()
    assert (y.shape, y.dtype) == (data.shape, data.dtype)
    assert _bounds(y.chunks[0]) == x.blocks
    assert y.chunks[1:] == tuple((n,) for n in shape[1:])
    np.testing.assert_array_equal(y.compute(scheduler=scheduler), data)
    # dask sums float32 chunks in float32, tierflow accumulates in float64
    np.testing.assert_allclose(
        y.sum(axis=0).compute(scheduler=scheduler), x.sum(axis=0).compute(), rtol=1e-5
    )


@pytest.mark.executors("threads")
def test_to_dask_of_a_file_pipeline_equals_its_tierflow_compute(tmp_path: Path) -> None:
    data = _data((1000, 5), np.float32)
    np.save(tmp_path / "x.npy", data)
    x = tw.from_npy(tmp_path / "x.npy", rows=128)
    y = np.sqrt(np.abs(x * 2 + 1)).map_blocks(lambda b: b[:, ::-1])
    np.testing.assert_array_equal(y.to_dask().compute(), y.compute())
    np.testing.assert_allclose(
        y.to_dask().sum(axis=0).compute(), y.sum(axis=0).compute(), rtol=1e-6
    )


@pytest.mark.executors("threads")
def test_a_value_the_blocks_use_is_computed_once_not_once_per_block() -> None:
    data = _data((1000, 4), np.float64)
    calls = Calls()

    def chunk(block: np.ndarray) -> np.ndarray:
        calls.add()
        return block.sum(axis=0)

    x = tw.from_array(data, rows=100)
    total = x.reduction(chunk, np.add, dtype=np.float64, shape=(4,))
    y = (x - total / len(data)).to_dask()
    got = y.compute(scheduler="threads")
    np.testing.assert_allclose(got, data - data.mean(axis=0))
    assert calls.n == 10, "one call per block of x, for the one value task"


@pytest.mark.executors("threads")
def test_to_dask_of_a_reduction_is_one_chunk() -> None:
    data = _data((300, 4), np.float32)
    y = tw.from_array(data, rows=64).max(axis=0).to_dask()
    assert y.chunks == ((4,),)
    np.testing.assert_array_equal(y.compute(), data.max(axis=0))
    s = tw.from_array(data, rows=64).sum().to_dask()
    assert s.shape == ()
    np.testing.assert_allclose(s.compute(), data.sum(dtype=np.float64))


@pytest.mark.executors("threads")
def test_to_dask_of_an_empty_array_has_one_empty_chunk() -> None:
    y = tw.from_array(np.zeros((0, 3), np.int64)).to_dask()
    assert y.chunks == ((0,), (3,))
    assert y.compute().shape == (0, 3)


@pytest.mark.executors("threads")
def test_to_dask_refuses_a_file_changed_since_the_build(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, _data((100, 2), np.float32))
    y = (tw.from_npy(path, rows=10) + 1).to_dask()
    np.save(path, _data((101, 2), np.float32))
    with pytest.raises(SourceError, match=r"x\.npy changed after the array was built"):
        y.compute(scheduler="sync")


# -- moving one step at a time ------------------------------------------------------------


def test_a_pipeline_moves_between_the_engines_one_step_at_a_time() -> None:
    data = _data((1200, 4), np.float32)
    d = da.from_array(data, chunks=(250, 2))
    step1 = (d * 3).clip(-100, 100)  # dask
    step2 = tw.from_dask(step1).map_blocks(lambda b: np.cumsum(b, axis=1))  # tierflow
    step3 = step2.to_dask() - d.mean(axis=0)  # dask again
    want = np.cumsum((data * 3).clip(-100, 100), axis=1) - data.mean(axis=0)
    np.testing.assert_allclose(step3.compute(), want, rtol=1e-5, atol=1e-4)
    assert step2.blocks == _bounds(d.chunks[0])


# -- pickling and keys --------------------------------------------------------------------


@pytest.mark.parametrize("dumps", ["pickle", "cloudpickle"])
def test_a_from_dask_array_pickles_with_its_graph_by_value(dumps: str) -> None:
    data = _data((400, 3), np.float32)
    offset = 2.5
    d = da.from_array(data, chunks=(90, 3)).map_blocks(lambda b: b - offset, dtype=np.float32)
    lazy = tw.from_dask(d).sum(axis=0)
    blob = pickle.dumps(lazy) if dumps == "pickle" else cloudpickle.dumps(lazy)
    del d
    back = pickle.loads(blob)
    assert back.key == lazy.key
    want = (data.astype(np.float64) - offset).sum(axis=0)
    np.testing.assert_allclose(back.compute(), want, rtol=1e-6)


@pytest.mark.executors("threads")
def test_a_to_dask_array_pickles_with_its_tierflow_graph(tmp_path: Path) -> None:
    data = _data((300, 2), np.float32)
    np.save(tmp_path / "x.npy", data)
    y = tw.from_npy(tmp_path / "x.npy", rows=50).map_blocks(lambda b: b * 4).to_dask()
    back = cloudpickle.loads(cloudpickle.dumps(y))
    np.testing.assert_array_equal(back.compute(), data * 4)


def test_the_key_is_the_dask_graphs_name_and_changes_with_the_graph() -> None:
    data = _data((200, 2), np.float32)
    d = da.from_array(data, chunks=(50, 2))
    assert tw.from_dask(d + 1).key == tw.from_dask(da.from_array(data, chunks=(50, 2)) + 1).key
    assert tw.from_dask(d + 1).key != tw.from_dask(d + 2).key
    assert tw.from_dask(d).key != tw.from_dask(da.from_array(data + 1, chunks=(50, 2))).key
    assert dask.base.tokenize(d + 1) == dask.base.tokenize((d + 1).name)


_EXPENSIVE_CALLS = Calls()


def _expensive(block: np.ndarray) -> np.ndarray:
    # Module-level: dask tokenizes it by name, so the same graph gets the same name
    # (a closure over a lock would get a random one).
    if block.size:
        _EXPENSIVE_CALLS.add()
    return block * 2


@pytest.mark.executors("threads", "serial")  # counts calls in this process
def test_a_from_dask_array_hits_the_cache_on_a_second_compute() -> None:
    data = _data((600, 4), np.float32)
    calls = _EXPENSIVE_CALLS
    calls.n = 0

    def build() -> Any:
        return tw.from_dask(
            da.from_array(data, chunks=(100, 4)).map_blocks(_expensive, dtype=np.float32)
        )

    first = build().compute(cache=True)
    assert calls.n == 6
    second = (build() + 1).compute(cache=True)
    assert calls.n == 6, "every block came from the cache"
    assert tw.cache_info("cache")["cache"].hits == 6
    np.testing.assert_array_equal(first, data * 2)
    np.testing.assert_array_equal(second, data * 2 + 1)
    changed = tw.from_dask(
        da.from_array(data, chunks=(100, 4)).map_blocks(_expensive, dtype=np.float32) + 1
    )
    np.testing.assert_array_equal(changed.compute(cache=True), data * 2 + 1)
    assert calls.n == 12, "a changed graph misses"


# -- errors -------------------------------------------------------------------------------


def test_from_dask_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(TypeError, match=r"needs a dask\.array\.Array, got ndarray"):
        tw.from_dask(np.zeros(3))
    with pytest.raises(ValueError, match="0-d"):
        tw.from_dask(da.from_array(np.float32(1.0)))
    with pytest.raises(TypeError, match="dtype object"):
        tw.from_dask(da.from_array(np.array([{}, {}], dtype=object), chunks=1))


def test_a_chunk_of_the_wrong_shape_is_named() -> None:
    d = da.from_array(np.zeros((40, 2), np.float32), chunks=(10, 2))
    lying = d.map_blocks(lambda b: b[:5], dtype=np.float32)  # the chunks say 10 rows
    with pytest.raises(BlockError, match=r"row chunk \d+ of .* computed to shape \(5, 2\)"):
        tw.from_dask(lying).compute()
    wider = d.map_blocks(lambda b: b.astype(np.float64) + 0.5, dtype=np.float32)
    got = tw.from_dask(wider).compute()  # float64 chunks, the dask array says float32
    assert got.dtype == np.float32 and got[0, 0] == 0.5
    complex_ = d.map_blocks(lambda b: b + 1j, dtype=np.float32)
    with pytest.raises(BlockError, match=r"computed to complex64, which does not cast"):
        tw.from_dask(complex_).compute()


def test_a_chunk_holding_a_value_its_declared_dtype_cannot_hold_is_refused() -> None:
    """A chunk computed to a wider dtype than the dask array says is cast to it; a value
    the cast would wrap (300 as int8) is refused, naming it, rather than changed."""
    values = np.arange(40, dtype=np.int64)
    values[25] = 300
    d = da.from_array(values, chunks=10)
    lying = d.map_blocks(lambda b: b, dtype=np.int8)  # int64 chunks
    with pytest.raises(BlockError, match=r"row chunk 2 .* holds 300, outside int8's range"):
        tw.from_dask(lying).compute()
    fits = da.from_array(np.arange(40, dtype=np.int64), chunks=10).map_blocks(
        lambda b: b, dtype=np.int8
    )
    np.testing.assert_array_equal(tw.from_dask(fits).compute(), np.arange(40, dtype=np.int8))


@pytest.mark.executors("threads")
def test_without_dask_both_directions_say_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = tw.from_array(np.zeros((4, 2)))
    monkeypatch.setitem(sys.modules, "dask.array", None)  # `import dask.array` fails
    for what, call in (
        ("tw.from_dask", lambda: tw.from_dask(object())),
        ("x.to_dask()", x.to_dask),
    ):
        with pytest.raises(DependencyError) as info:
            call()
        assert str(info.value) == (
            f"{what} needs the optional package 'dask': {install_command('dask')}"
        )
        assert isinstance(info.value, ImportError)


@pytest.mark.executors("threads")
def test_importing_tierflow_does_not_import_dask() -> None:
    code = "import sys, tierflow; print('dask' in sys.modules, 'dask.array' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "False"]


# -- a distributed cluster ----------------------------------------------------------------


def _pid_column(block: np.ndarray) -> np.ndarray:
    return np.full((len(block), 1), os.getpid(), np.int64)


@pytest.mark.executors("threads")
def test_to_dask_runs_on_a_distributed_cluster(dask_client: Any, tmp_path: Path) -> None:
    data = _data((2000, 4), np.float32)
    np.save(tmp_path / "x.npy", data)
    x = tw.from_npy(tmp_path / "x.npy", rows=250)
    scale = 0.5
    centred = (x - x.mean(axis=0)).map_blocks(lambda b: b * scale)  # a lambda, by value
    want = (data - data.mean(axis=0, dtype=np.float64)).astype(np.float32) * scale
    got = dask_client.compute(centred.to_dask()).result()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    summed = dask_client.compute(centred.to_dask().sum(axis=0)).result()
    # sums of centred float32 columns: near zero, so an absolute tolerance
    np.testing.assert_allclose(summed, centred.sum(axis=0).compute(), atol=0.05)
    pids = dask_client.compute(x.map_blocks(_pid_column).to_dask()).result()
    assert os.getpid() not in set(pids[:, 0].tolist()), "the blocks ran in the workers"


@pytest.mark.executors("threads")
def test_from_dask_to_dask_and_unknown_rows_on_a_distributed_cluster(dask_client: Any) -> None:
    data = _data((1500, 3), np.float64)
    d = da.from_array(data, chunks=(400, 2))
    step = tw.from_dask(d).map_blocks(lambda b: b**2).to_dask()
    np.testing.assert_array_equal(dask_client.compute(step).result(), data**2)
    kept = tw.from_dask(d)[tw.from_dask(d)[:, 1] > 0].to_dask()
    np.testing.assert_array_equal(dask_client.compute(kept).result(), data[data[:, 1] > 0])
