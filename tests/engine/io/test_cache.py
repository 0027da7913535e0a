"""The engine's cache: what is kept, what is read back, info and clear, memory, faults."""

from __future__ import annotations

import errno
import os
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow import config, memory
from tierflow.engine.io import cache as cache_module
from tierflow.engine.io.cache import CacheWarning
from tierflow.errors import StoreError
from tierflow.storage import pages
from tierflow.storage.store import Store, StoreWarning
from tierflow.system import pressure
from tierflow.system.types import Level

ROWS = 100
N = 1000


class Calls:
    """Counts calls of a pipeline's function. It pickles without its count, so the
    function's key (which covers the objects it closes over) does not follow it."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.n += 1

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


@pytest.fixture
def data() -> np.ndarray:
    return np.random.default_rng(7).random((N, 4)).astype(np.float32)


def doubled(calls: Calls) -> Any:
    def f(b: np.ndarray) -> np.ndarray:
        calls.add()
        return b * 2 + 1

    return f


def info(name: str = "cache") -> cache_module.CacheInfo:
    return tw.cache_info(name)[name]


def store_dir() -> Path:
    return Path(config.get("store_dir"))


def entry_files(name: str = "cache") -> list[Path]:
    return sorted(p for p in (store_dir() / name / "data").rglob("*") if p.is_file())


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_a_second_compute_reads_every_block_from_the_cache(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    first = y.compute(cache=True)
    assert calls.n == 10
    assert (info().hits, info().misses, info().writes) == (0, 10, 10)
    assert info().bytes_written == data.nbytes and info().entries == 10
    again = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    second = again.compute(cache=True)
    assert calls.n == 10, "every block came from the cache"
    assert (info().hits, info().misses) == (10, 10) and info().bytes_read == data.nbytes
    np.testing.assert_array_equal(second, data * 2 + 1)
    np.testing.assert_array_equal(first, second)
    second[0] = 0  # a result of its own, not a view of the cache
    assert np.asarray(tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls)).compute(cache=True))[
        0, 0
    ] == pytest.approx(data[0, 0] * 2 + 1)


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_to_npy_and_persist_cache_blocks_that_compute_then_reads(
    tmp_path: Path, src: Path, data: np.ndarray
) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    y.to_npy(tmp_path / "out.npy", cache=True)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data * 2 + 1)
    kept = y.persist(cache=True)
    assert calls.n == 10 and kept.key == y.key
    np.testing.assert_array_equal(kept.compute(), data * 2 + 1)
    assert info().hits == 10


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_values_and_partials_are_cached_and_skip_the_pass(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    mean, std = tw.compute(y.mean(axis=0), y.std(axis=0), cache=True)
    assert calls.n == 10
    assert info().writes == 2 * 10 + 2  # a partial per block of each, and both values
    again, again_std = tw.compute(y.mean(axis=0), y.std(axis=0), cache=True)
    assert calls.n == 10 and info().hits == 2  # both values: nothing else was looked at
    np.testing.assert_array_equal(again, mean)
    np.testing.assert_array_equal(again_std, std)
    assert again.flags.writeable
    np.testing.assert_allclose(mean, (data * 2 + 1).mean(axis=0), rtol=1e-6)


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_a_resumed_pipeline_needs_no_value_below_a_cached_one(
    tmp_path: Path, src: Path, data: np.ndarray
) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    z = (y - y.mean(axis=0)) / y.std(axis=0)
    z.to_npy(tmp_path / "z.npy", cache=True)
    assert calls.n == 20  # one pass for the statistics, one for z
    z.to_npy(tmp_path / "z2.npy", cache=True)
    assert calls.n == 20
    assert (tmp_path / "z.npy").read_bytes() == (tmp_path / "z2.npy").read_bytes()


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_a_compute_sharing_part_of_a_cached_graph_reads_it(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    x = tw.from_npy(src, rows=ROWS)
    y = x.map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    y.compute(cache=True)
    total = (y * 2).sum(axis=0).compute(cache=True)
    assert calls.n == 10, "y's blocks were read from the cache"
    np.testing.assert_allclose(total, ((data * 2 + 1) * 2).sum(axis=0), rtol=1e-5)
    (y * 3).sum(axis=0).compute(cache=False)
    assert calls.n == 20, "cache=False reads nothing"


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_unknown_row_counts_are_cached_per_block(
    tmp_path: Path, src: Path, data: np.ndarray
) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    masked = y[y[:, 0] > 2.0]
    first = masked.compute(cache=True)
    masked.to_npy(tmp_path / "m.npy", cache=True)
    assert calls.n == 10
    expect = (data * 2 + 1)[(data * 2 + 1)[:, 0] > 2.0]
    np.testing.assert_array_equal(first, expect)
    np.testing.assert_array_equal(np.load(tmp_path / "m.npy"), expect)
    assert info().hits == 10


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_a_marked_node_is_cached_without_caching_the_rest(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    x = tw.from_npy(src, rows=ROWS)
    z = x.map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,)).cache()
    (z + 1).sum().compute()
    (z - 1).max().compute()
    assert calls.n == 10
    assert info().entries == 10, "only z's blocks: not the sum, not z + 1"
    (z + 2).sum().compute(cache=False)
    assert calls.n == 20, "cache=False ignores marks"
    assert z.cache(False) is z and z._node.cache_mark is None
    (z + 1).sum().compute()
    assert calls.n == 30


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_values_under_a_marked_node_are_kept_with_it(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    centred = (y - y.mean(axis=0)).cache()
    first = centred.sum(axis=0).compute()
    assert calls.n == 20  # a pass for the mean, one for the centred blocks
    assert info().entries == 10 + 10 + 1  # centred's blocks, the mean's partials and value
    again = centred.sum(axis=0).compute()
    assert calls.n == 20, "centred from the cache, and the mean it needs too"
    np.testing.assert_array_equal(first, again)


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_a_marked_reduction_keeps_its_value(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    m = y.mean(axis=0).cache()
    (y - m).sum(axis=0).compute()
    assert calls.n == 20
    (y - m).max(axis=0).compute()
    assert calls.n == 30, "only the pass over y - m: the mean came from the cache"


def test_a_mark_can_name_its_own_store(src: Path) -> None:
    x = tw.from_npy(src, rows=ROWS)
    z = x.map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,)).cache("embeddings")
    z.sum().compute()
    assert info("embeddings").entries == 10
    assert not (store_dir() / "cache").exists()
    with pytest.raises(TypeError, match=r"cache must be True, False, None, a store name.*float"):
        z.cache(3.5)
    with pytest.raises(TypeError, match=r"cache must be True, False, None.*\(3\)"):
        z.compute(cache=3)


def test_the_setting_and_the_environment_choose_the_store(
    src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    with config.set(cache="everyday"):
        y.compute()
        assert info("everyday").entries == 10
        y.compute(cache=False)
        assert info("everyday").hits == 0
        y.compute(cache=True)  # True: the setting's store
        assert info("everyday").hits == 10
    monkeypatch.setenv("TIERFLOW_CACHE", "from-env")
    config.reset()
    y.compute()
    assert info("from-env").entries == 10
    monkeypatch.setenv("TIERFLOW_CACHE", "1")
    config.reset()
    y.compute()
    assert info("cache").entries == 10
    monkeypatch.setenv("TIERFLOW_CACHE", "0")
    config.reset()
    assert cache_module.session(None, [y._node]) is None


def test_cache_info_and_clear_touch_only_the_engines_entries(src: Path) -> None:
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    y.compute(cache=True)
    with memory.store("cache") as mine:
        mine["not the engine's"] = 42
    found = tw.cache_info()
    assert list(found) == ["cache"]
    got = found["cache"]
    assert got.entries == 10 and got.ssd_entries == 11 and got.ram_bytes == 0
    assert got.ssd_bytes >= 10 * ROWS * 4 * 4 and got.ssd_limit == 10 * 2**30
    assert "10 misses" in str(got) and "cache 'cache'" in str(got)
    assert tw.cache_clear() == 10
    after = info()
    assert (after.hits, after.misses, after.writes, after.entries) == (0, 0, 0, 0)
    with memory.store("cache") as mine:
        assert mine["not the engine's"] == 42


def test_a_store_object_is_used_without_its_ram_tier(src: Path) -> None:
    given = memory.store("big", ram_mb=64, disk_gb=1)
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    y.compute(cache=given)
    use = given.usage()
    assert use.ssd_entries == 10 and use.ram_entries == 0, "no copy of a block in RAM"
    got = tw.cache_info(given)["big"]
    assert got.ram_bytes == 0 and got.ssd_limit == 2**30 and got.writes == 10
    given.close()


def test_a_store_filled_under_a_larger_limit_keeps_its_entries(
    src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    y.compute(cache=memory.store("grown", ram_mb=0, disk_gb=1))
    cache_module.close_all()
    monkeypatch.setattr(cache_module, "DISK_GB", 1e-5)  # 10 KB: less than the 16 KB held
    (y + 1).sum().compute(cache="grown", executor="serial")  # by name; partials written
    got = info("grown")
    assert got.hits == 10, "y's blocks were evicted to fit the default limit"
    assert got.ssd_limit >= 16_000


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_cache_reads_are_memory_maps_released_after_use(src: Path) -> None:
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    y.compute(cache=True)
    seen: list[bool] = []
    lock = threading.Lock()

    def probe(b: np.ndarray) -> np.ndarray:
        with lock:
            seen.append(pages.file_range(b) is not None)
        return b + 0

    # A cached y read by a consumer that is not cached: y's blocks reach it mapped.
    y.map_blocks(probe, dtype=np.float32, row_shape=(4,)).sum().compute(cache=False)
    assert seen == [False] * 10, "without the cache y is computed into RAM"
    seen.clear()
    y.cache()
    y.map_blocks(probe, dtype=np.float32, row_shape=(4,)).sum().compute()
    assert seen == [True] * 10, "cached blocks are mapped from the store, not copied"


def test_writes_under_high_pressure_go_straight_to_the_disk(
    src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.random.default_rng(1).random((64_000, 16))  # 8 MB: blocks of 800 KB
    path = src.parent / "big.npy"
    np.save(path, data)
    y = tw.from_npy(path, rows=6400).map_blocks(doubled(Calls()), row_shape=(16,), dtype="f8")
    monkeypatch.setattr(pressure, "level_now", lambda: Level.HIGH)
    y.compute(cache=True, executor="serial")
    files = entry_files()
    assert len(files) == 10
    resident = sum(pages.file_resident_bytes(f) for f in files)
    assert resident <= 0.1 * data.nbytes, f"{resident} bytes of the cache left in RAM"


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_a_failing_write_is_one_warning_and_the_result_is_complete(
    src: Path, data: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: Store, key: Any, value: Any, *, tag: str | None = None) -> None:
        raise StoreError("the store refused it (a test)")

    monkeypatch.setattr(Store, "set", refuse)
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    with pytest.warns(CacheWarning, match=r"'cache'.*10 write\(s\) failed.*refused it") as got:
        result = y.compute(cache=True)
    assert len([w for w in got if issubclass(w.category, CacheWarning)]) == 1
    np.testing.assert_array_equal(result, data * 2 + 1)
    assert info().failed_writes == 10


def test_a_full_disk_stops_the_writes_of_that_compute(
    src: Path, data: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries = []

    def full(self: Store, key: Any, value: Any, *, tag: str | None = None) -> None:
        tries.append(key)
        raise StoreError("no space left to store the value") from OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(Store, "set", full)
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    with pytest.warns(CacheWarning, match=r"the disk is full.*stopped writing.*cache_clear"):
        result = y.compute(cache=True, executor="serial")
    assert len(tries) == 1
    np.testing.assert_array_equal(result, data * 2 + 1)


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_a_partial_that_cannot_be_pickled_is_a_warning(src: Path, data: np.ndarray) -> None:
    x = tw.from_npy(src, rows=ROWS)

    def chunk(b: np.ndarray) -> tuple[float, Any]:
        return float(b.sum()), threading.Lock()

    def combine(a: tuple[float, Any], b: tuple[float, Any]) -> tuple[float, Any]:
        return a[0] + b[0], a[1]

    total = x.reduction(chunk, combine, lambda p: p[0], dtype=np.float64, shape=())
    with pytest.warns(CacheWarning, match=r"write\(s\) failed.*TypeError.*lock"):
        value = total.compute(cache=True)
    assert value == pytest.approx(float(data.astype(np.float64).sum()), rel=1e-6)


def test_a_tampered_entry_is_recomputed_and_never_unpickled(
    tmp_path: Path, src: Path, data: np.ndarray
) -> None:
    x = tw.from_npy(src, rows=ROWS)
    total = x.sum(dtype=np.float64)
    expect = total.compute(cache=True)
    marker = tmp_path / "owned"

    class Exploit:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    files = entry_files()
    assert len(files) == 11  # ten partials and the value, all pickled
    for f in files:
        f.write_bytes(pickle.dumps(Exploit()))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        again = tw.from_npy(src, rows=ROWS).sum(dtype=np.float64).compute(cache=True)
    assert not marker.exists(), "a planted pickle was loaded"
    assert again == expect
    assert any(issubclass(w.category, StoreWarning) for w in got)
    assert info().misses >= 11


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_a_damaged_block_header_is_a_miss(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    y.compute(cache=True)
    victim = entry_files()[3]
    raw = bytearray(victim.read_bytes())
    at = raw.index(b"'shape': (")
    raw[at + 10 : at + 13] = b"999"  # the header no longer matches its signed digest
    victim.write_bytes(bytes(raw))
    with pytest.warns(StoreWarning, match="header"):
        result = y.compute(cache=True)
    np.testing.assert_array_equal(result, data * 2 + 1)
    assert calls.n == 11


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_an_entry_of_another_shape_is_a_miss(src: Path, data: np.ndarray) -> None:
    calls = Calls()
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
    y.compute(cache=True)
    with memory.store("cache") as s:
        s.set(("tierflow", cache_module.FORMAT, "block", y.key, 0, ROWS), np.zeros((3, 4), "f4"))
    result = y.compute(cache=True)
    np.testing.assert_array_equal(result, data * 2 + 1)
    assert calls.n == 11 and info().hits == 9


def test_a_store_that_cannot_open_is_a_warning(tmp_path: Path, src: Path, data: np.ndarray) -> None:
    folder = tmp_path / "not-a-store"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    with pytest.warns(
        CacheWarning, match=r"cannot open the cache store at .*not-a-store.*without it"
    ):
        result = y.compute(cache=folder)
    np.testing.assert_array_equal(result, data * 2 + 1)
    assert (folder / "notes.txt").read_text() == "mine"


@pytest.mark.executors("threads", "serial")  # counts calls here
def test_a_cache_in_object_storage_keeps_blocks_and_values(
    src: Path, data: np.ndarray, s3_server: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("s3fs")
    config.set(shared_options=s3_server)
    name = "cache-" + request.node.callspec.id  # each test's store has its own key
    url = f"s3://tierflow/{name}"
    calls = Calls()

    def pipeline() -> Any:
        y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(calls), dtype=np.float32, row_shape=(4,))
        return y, y.sum(axis=0)

    first = tw.compute(*pipeline(), cache=url)
    assert calls.n == 10
    got = tw.cache_info(url)[name]
    # 10 blocks, 10 partials of the sum and its value
    assert (got.misses, got.writes, got.entries, got.path) == (21, 21, 21, url)
    assert "in object storage" in str(got)
    second = tw.compute(*pipeline(), cache=url + "/")  # the same store
    assert calls.n == 10, "every block and the sum came from the bucket"
    assert tw.cache_info(url)[name].hits == 11  # the value and the 10 blocks
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(second[1], (data * 2 + 1).sum(axis=0), rtol=1e-5)
    assert tw.cache_clear(url) == 21
    assert tw.cache_info(url)[name].entries == 0


def test_a_prefix_that_is_not_a_store_is_a_warning_and_kept(
    src: Path, data: np.ndarray, s3_server: dict[str, Any]
) -> None:
    s3fs = pytest.importorskip("s3fs")
    config.set(shared_options=s3_server)
    fs = s3fs.S3FileSystem(**s3_server)
    fs.pipe_file("tierflow/user-data/table.csv", b"a,b\n")
    y = tw.from_npy(src, rows=ROWS).map_blocks(doubled(Calls()), dtype=np.float32, row_shape=(4,))
    with pytest.warns(CacheWarning, match=r"user-data.*holds other objects.*without it"):
        result = y.compute(cache="s3://tierflow/user-data")
    np.testing.assert_array_equal(result, data * 2 + 1)
    fs.invalidate_cache()
    assert fs.find("tierflow/user-data") == ["tierflow/user-data/table.csv"]


@pytest.mark.executors("threads")
def test_other_byte_orders_and_empty_results_round_trip_through_a_bucket_cache(
    tmp_path: Path, s3_server: dict[str, Any]
) -> None:
    pytest.importorskip("s3fs")
    config.set(shared_options=s3_server)
    url = "s3://tierflow/cache-byte-orders"
    big = np.arange(600, dtype=">f8").reshape(200, 3)
    np.save(tmp_path / "big.npy", big)
    x = tw.from_npy(tmp_path / "big.npy", rows=50)
    cases = {
        "doubled": lambda: x * 2,
        "none kept": lambda: x[x[:, 0] < -1],  # every block empty
        "column sums": lambda: x.sum(axis=0),
    }
    first = {k: make().compute(cache=url) for k, make in cases.items()}
    hits = tw.cache_info(url)["cache-byte-orders"].hits
    for name, make in cases.items():
        again = make().compute(cache=url)
        assert again.dtype == first[name].dtype, name
        np.testing.assert_array_equal(again, first[name], err_msg=name)
    np.testing.assert_array_equal(first["doubled"], big * 2)
    assert first["none kept"].shape == (0, 3)
    # read back from the bucket: 4 blocks of x * 2, 4 empty blocks, the sums' value
    assert tw.cache_info(url)["cache-byte-orders"].hits == hits + 9
