"""memory.chunks and memory.map: blocks, readahead and release, errors, residency."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow import config, memory
from tierflow.errors import BlockError, SourceError
from tierflow.storage import pages, placement, sources, stream
from tierflow.storage.sources import ArraySource, open_npy, open_raw
from tierflow.storage.stream import block_bounds, check_rows, chunks, default_rows

from common import examples

MB = 1 << 20


def write_npy(path: Path, array: np.ndarray) -> Path:
    """Save and fsync, so the page cache holds no dirty pages (those cannot be dropped)."""
    with open(path, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    return path


def mapped(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(str(path)) for line in f)


def mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings that are in this process's RSS (from smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                inside = line.rstrip("\n").endswith(str(path))
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def open_fds(path: Path) -> int:
    """Descriptors of this process open on ``path`` (other threads' sockets and pipes,
    a cluster client's say, come and go meanwhile and are not counted)."""
    target = os.path.realpath(path)
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            continue  # closed meanwhile
    return found


def readahead_window(path: Path) -> int:
    """The device's read_ahead_kb in bytes: how far a page fault may read around."""
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for candidate in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(candidate) as f:
                return int(f.read()) * 1024
        except OSError:
            continue
    return 128 * 1024


@pytest.fixture
def npy(tmp_path: Path) -> tuple[Path, np.ndarray]:
    a = np.arange(10_007 * 6, dtype=np.float32).reshape(-1, 6)
    return write_npy(tmp_path / "a.npy", a), a


# -- rows -------------------------------------------------------------------------------


def test_check_rows() -> None:
    assert check_rows(None) is None
    assert check_rows(5) == 5
    assert check_rows(np.int64(7)) == 7
    for negative in (0, -3):
        with pytest.raises(
            ValueError, match=rf"rows must be at least 1 row per block, got {negative}"
        ):
            check_rows(negative)
    for not_int in (2.5, "10", True, None.__class__):
        with pytest.raises(TypeError, match=r"rows must be an integer number of rows"):
            check_rows(not_int)


def test_default_rows_from_the_budget() -> None:
    assert default_rows(32, budget=64 * MB) == 4 * MB // 32  # budget / 16
    assert default_rows(32, budget=2 * MB) == 1 * MB // 32  # clamped up to 1 MB
    assert default_rows(32, budget=64 << 30) == 256 * MB // 32  # clamped down to 256 MB
    assert default_rows(1 << 30, budget=64 * MB) == 1  # at least one row
    assert default_rows(32, share=64, budget=256 * MB) == 4 * MB // 32
    with config.set(ram_budget="128MB"):
        assert default_rows(8) == 8 * MB // 8


def test_block_bounds() -> None:
    assert block_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert block_bounds(10, 10) == [(0, 10)]
    assert block_bounds(10, 11) == [(0, 10)]
    assert block_bounds(0, 5) == []


# -- chunks -----------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1000, 999, 10_007, 50_000])
def test_chunks_of_a_npy_equal_the_file(npy: tuple[Path, np.ndarray], rows: int) -> None:
    path, a = npy
    it = chunks(path, rows)
    blocks = list(it)
    assert len(blocks) == len(it) == -(-a.shape[0] // rows)
    assert all(b.shape[0] == rows for b in blocks[:-1])
    np.testing.assert_array_equal(np.concatenate(blocks), a)
    assert all(not b.flags.owndata for b in blocks)


def test_rows_larger_than_the_file_give_one_block(npy: tuple[Path, np.ndarray]) -> None:
    path, a = npy
    blocks = list(chunks(path, rows=10**12))
    assert len(blocks) == 1 and blocks[0].shape == a.shape


@pytest.mark.parametrize(("rows", "error"), [(0, ValueError), (-1, ValueError), (2.5, TypeError)])
def test_bad_rows_are_refused_before_opening(tmp_path: Path, rows: Any, error: type) -> None:
    with pytest.raises(error, match=r"rows must be"):
        chunks(tmp_path / "does-not-exist.npy", rows)


def test_default_rows_follow_the_budget(npy: tuple[Path, np.ndarray]) -> None:
    path, _ = npy
    with config.set(ram_budget="32MB"):
        it = chunks(path)
    assert it.rows == 2 * MB // 24


def test_zero_row_files_yield_nothing(tmp_path: Path) -> None:
    assert list(chunks(write_npy(tmp_path / "e.npy", np.zeros((0, 8))), 10)) == []
    empty = tmp_path / "e.bin"
    empty.write_bytes(b"")
    assert list(chunks(empty, 10, dtype=np.float32, shape=(-1, 8))) == []


def test_raw_file_with_row_shape_and_offset(tmp_path: Path) -> None:
    a = np.arange(4000, dtype=np.int16).reshape(-1, 8)
    path = tmp_path / "r.bin"
    path.write_bytes(b"\xff" * 16 + a.tobytes())
    got = np.concatenate(list(chunks(path, 77, dtype=np.int16, shape=(8,), offset=16)))
    np.testing.assert_array_equal(got, a)


def test_raw_file_not_a_whole_number_of_rows(tmp_path: Path) -> None:
    path = tmp_path / "r.bin"
    path.write_bytes(b"\0" * 1001)
    with pytest.raises(SourceError, match=r"1001 bytes .* 250 rows and 1 bytes left over"):
        chunks(path, 10, dtype=np.float32, shape=(-1,))


def test_chunks_of_arrays_are_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def release(*args: object, **kwargs: object) -> int:
        calls.append("release")
        return 0

    monkeypatch.setattr(pages, "release", release)
    a = np.arange(100).reshape(25, 4)
    blocks = list(memory.chunks(a, 10))
    assert [b.shape[0] for b in blocks] == [10, 10, 5]
    assert all(np.shares_memory(b, a) for b in blocks)
    assert calls == []  # a RAM array is never released


def test_chunks_of_a_spilled_memory_array_release_it() -> None:
    with config.set(ram_budget="1MB"):
        x = placement.array((1 << 20, 4), "float32")  # 16 MB, over the budget: spilled
    try:
        assert placement.on_disk(x)
        path = Path(pages.file_range(x).path)  # type: ignore[union-attr]
        x[:] = 1.0
        assert mapped_rss(path) >= 15 * MB
        pages.release(x, drop_cache=False)  # written back; the scan starts from nothing mapped
        peak, total = 0, 0.0
        for block in chunks(x, 1 << 16, drop_cache=True):  # 1 MB blocks
            total += float(block.sum())
            peak = max(peak, mapped_rss(path))
        del block
        assert total == x.shape[0] * 4
        assert mapped_rss(path) <= 64 * 1024
        assert peak <= 2 * MB + 64 * 1024
        assert pages.resident_bytes(x) <= sources.behind_bytes()
        np.testing.assert_array_equal(x[-3:], 1.0)  # written back, not lost
    finally:
        placement.free(x)


def test_readahead_and_release_order(
    npy: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = npy
    src = open_npy(path)
    events: list[tuple[str, int, int, bool | None]] = []

    def release(i0: int, i1: int, drop_cache: bool = False) -> int:
        events.append(("release", i0, i1, drop_cache))
        return 0

    monkeypatch.setattr(src, "readahead", lambda i0, i1: events.append(("ahead", i0, i1, None)))
    monkeypatch.setattr(src, "release", release)
    it = chunks(src, 4000, drop_cache=True)
    next(it)
    assert events == [("ahead", 0, 4000, None), ("ahead", 4000, 8000, None)]
    next(it)
    assert events[2:] == [("release", 0, 4000, True), ("ahead", 8000, 10_007, None)]
    next(it)
    # the last block: nothing to read ahead
    assert events[4:] == [("release", 4000, 8000, True)]
    with pytest.raises(StopIteration):
        next(it)
    assert events[5:] == [("release", 8000, 10_007, True)]


def test_breaking_out_early_unmaps_the_file(npy: tuple[Path, np.ndarray]) -> None:
    path, _ = npy
    list(chunks(path, 5000))  # first use opens whatever the process opens once
    gc.collect()
    fds = open_fds(path)
    for block in chunks(path, 1000):
        assert mapped(path)
        float(block.sum())
        break
    del block
    gc.collect()
    assert not mapped(path)
    assert open_fds(path) == fds == 0


def test_close_and_exhaustion_unmap_the_file(npy: tuple[Path, np.ndarray]) -> None:
    path, _ = npy
    with chunks(path, 1000) as it:
        next(it)
        assert mapped(path)
    assert not mapped(path)
    it = chunks(path, 3000)
    for block in it:
        float(block[0, 0])
    del block
    assert not mapped(path)  # `it` is still referenced, its mapping is not


def test_views_kept_by_the_consumer_stay_valid(npy: tuple[Path, np.ndarray]) -> None:
    path, a = npy
    kept = list(chunks(path, 2000, drop_cache=True))
    gc.collect()
    assert mapped(path)  # the views keep the mapping alive
    np.testing.assert_array_equal(np.concatenate(kept), a)  # released pages refault
    del kept
    gc.collect()
    assert not mapped(path)


@pytest.fixture(scope="module")
def big_npy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 MB of float32 rows of 32 bytes, fsynced (one file for the residency tests)."""
    a = np.ones((48 * MB // 32, 8), dtype=np.float32)
    return write_npy(tmp_path_factory.mktemp("big") / "big.npy", a)


@pytest.mark.parametrize("block_mb", [2, 0.3])
def test_a_scan_keeps_about_one_block_in_the_process(big_npy: Path, block_mb: float) -> None:
    rows = int(block_mb * MB) // 32
    src = open_npy(big_npy)
    peak, total = 0, 0.0
    for k, block in enumerate(chunks(src, rows)):
        total += float(block.sum(dtype=np.float64))
        if k % 4 == 0:  # reading smaps costs a few ms
            peak = max(peak, mapped_rss(big_npy))
    del block
    assert total == src.n_rows * 8
    # One block, rounded up to the huge pages the kernel may map it with.
    assert peak <= max(2 * rows * 32, 2 * sources.behind_bytes()), f"RSS peaked at {peak}"
    # Nothing left mapped behind the scan: the fault-around windows that reach into an
    # already released block are released with the next one (12 MB of a 96 MB scan in
    # 0.3 MB blocks stayed mapped before release reached behind).
    assert mapped(big_npy) and mapped_rss(big_npy) == 0
    src.close()


@pytest.mark.parametrize("block_mb", [4, 1])
def test_drop_cache_keeps_the_file_out_of_the_page_cache(big_npy: Path, block_mb: int) -> None:
    rows = block_mb * MB // 32
    pages.release_path(big_npy)
    src = open_npy(big_npy)
    whole = src.block(0, src.n_rows)
    # Besides the block in use and the next one, the kernel's own readahead may run up
    # to two device windows ahead, and a folio behind may wait for the next release.
    slack = 2 * readahead_window(big_npy) + sources.behind_bytes() + 2 * 4096
    peak = 0
    for block in chunks(src, rows, drop_cache=True):
        float(block.sum())
        peak = max(peak, pages.resident_bytes(whole))
    assert peak <= 2 * rows * 32 + slack, f"{peak} bytes of the file resident at once"
    assert peak < src.nbytes // 2
    # Large folios straddling block boundaries are dropped too (without release reaching
    # behind, 1 MB blocks left 62 of 96 MB cached).
    assert pages.resident_bytes(whole) == 0
    del whole, block
    src.close()


# -- map --------------------------------------------------------------------------------


def spill_files() -> list[str]:
    root = config.get("spill_dir")
    return [name for _, _, names in os.walk(root) for name in names]


@pytest.mark.parametrize("workers", [1, 3])
def test_map_equals_numpy_on_blocks_that_do_not_divide(
    npy: tuple[Path, np.ndarray], workers: int
) -> None:
    path, a = npy
    out = memory.map(lambda b: np.sqrt(b * 2 + 1), path, 997, workers=workers)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_allclose(out, np.sqrt(a * 2 + 1))


def test_map_output_shape_and_dtype_from_the_first_block_or_given() -> None:
    a = np.arange(60, dtype=np.int32).reshape(20, 3)
    out = memory.map(lambda b: b.sum(axis=1), a, 6, workers=2)
    assert out.shape == (20,) and out.dtype == a.sum(axis=1).dtype
    np.testing.assert_array_equal(out, a.sum(axis=1))
    # float64 results into a float32 output: same_kind allows it
    out = memory.map(lambda b: b / 2.0, a, 7, dtype=np.float32, row_shape=(3,), workers=2)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, a / 2.0)
    out = memory.map(lambda b: b[:, :1] * 1.5, a, 7, row_shape=(1,))
    assert out.shape == (20, 1) and out.dtype == np.float64


def test_map_of_zero_rows_asks_fn_about_the_shape() -> None:
    out = memory.map(lambda b: b[:, :2].astype(np.float16), np.zeros((0, 5)), 10)
    assert out.shape == (0, 2) and out.dtype == np.float16


def test_map_on_a_raw_source(tmp_path: Path) -> None:
    a = np.arange(900, dtype=np.uint16).reshape(-1, 3)
    path = tmp_path / "r.bin"
    path.write_bytes(a.tobytes())
    out = memory.map(lambda b: b.astype(np.int64) * 3, open_raw(path, np.uint16, (3,)), 41)
    np.testing.assert_array_equal(out, a.astype(np.int64) * 3)


@pytest.mark.parametrize("budget", ["1GB", "1MB"])
def test_wrong_row_count_names_the_block_and_frees_the_output(budget: str) -> None:
    a = np.ones((1000, 64))  # 512 KB of float64; the output spills under a 1 MB budget...
    config.set(ram_budget=budget)

    def fn(b: np.ndarray) -> np.ndarray:
        out = np.repeat(b, 8, axis=1)  # ...at 8 x the width (4 MB)
        return out[:-1] if b[0, 0] == 2 else out

    a[600:700] = 2
    before = len(placement.report())
    with pytest.raises(
        BlockError,
        match=r"fn returned 99 rows for block 6 of 10 \(rows 600:700\); it must return one "
        r"row per input row \(100\)",
    ) as info:
        memory.map(fn, a, 100, workers=2)
    assert (info.value.index, info.value.start, info.value.stop) == (6, 600, 700)
    assert spill_files() == []
    assert len(placement.report()) == before


def test_fn_raising_names_the_block_chains_the_error_and_frees_the_output() -> None:
    config.set(ram_budget="1MB")
    boom = ZeroDivisionError("bad row")

    def fn(b: np.ndarray) -> np.ndarray:
        if b[0, 0] >= 300:
            raise boom
        return np.repeat(b, 16, axis=1)

    a = np.arange(500 * 64, dtype=np.float64).reshape(500, 64) // 64
    with pytest.raises(
        BlockError,
        match=r"memory.map: fn failed on block 3 of 5 \(rows 300:400\): ZeroDivisionError: bad row",
    ) as info:
        memory.map(fn, a, 100, workers=1)
    assert info.value.__cause__ is boom
    assert spill_files() == []
    with pytest.raises(BlockError, match=r"ZeroDivisionError") as info:
        memory.map(fn, a, 100, workers=4)
    assert info.value.index in (3, 4) and info.value.__cause__ is boom
    assert spill_files() == []
    assert not [t for t in threading.enumerate() if t.name.startswith("tierflow-map")]


def test_fn_failing_on_the_first_block_leaves_nothing() -> None:
    with pytest.raises(BlockError, match=r"block 0 of 3 \(rows 0:4\): ValueError: no"):
        memory.map(lambda b: (_ for _ in ()).throw(ValueError("no")), np.zeros((10, 2)), 4)
    with pytest.raises(BlockError, match=r"<lambda> returned a scalar for block 0 of 1"):
        memory.map(lambda b: b.sum(), np.zeros((10, 2)))
    with pytest.raises(BlockError, match=r"<lambda> returned an object array"):
        memory.map(lambda b: np.array([None] * len(b)), np.zeros((10, 2)))


def test_wrong_trailing_shape_or_dtype_names_the_block() -> None:
    a = np.arange(40.0).reshape(20, 2)
    with pytest.raises(
        BlockError, match=r"rows of shape \(3,\) for block 2 of 4 \(rows 10:15\), but the "
    ):
        memory.map(lambda b: np.ones((len(b), 3 if b[0, 0] >= 20 else 2)), a, 5)
    with pytest.raises(
        BlockError,
        match=r"<lambda> returned float64 for block 0 of 4 \(rows 0:5\), which does not cast to "
        r"the output's int32 \(casting='same_kind'",
    ):
        memory.map(lambda b: b, a, 5, dtype=np.int32, row_shape=(2,))
    assert spill_files() == []


def test_map_output_bigger_than_the_budget_lands_on_the_ssd(tmp_path: Path) -> None:
    a = np.random.default_rng(0).random((1 << 16, 16), dtype=np.float32)  # 4 MB
    path = write_npy(tmp_path / "in.npy", a)
    with config.set(ram_budget="2MB"):
        out = memory.map(lambda b: np.sqrt(b * 2 + 1), path, 5000, workers=2)
    assert placement.on_disk(out) and isinstance(out, np.memmap)
    assert spill_files() != []
    # Released as it was written: neither mapped nor cached once the map returns.
    assert pages.resident_bytes(out) == 0
    np.testing.assert_allclose(out, np.sqrt(a * 2 + 1), rtol=1e-6)
    placement.free(out)
    assert spill_files() == []


class CountingSource(ArraySource):
    """Counts blocks asked for (readahead) and not yet finished (release)."""

    def __init__(self, array: np.ndarray) -> None:
        super().__init__(array)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0

    def readahead(self, i0: int, i1: int) -> None:
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    def release(self, i0: int, i1: int, *, drop_cache: bool = False) -> int:
        with self.lock:
            self.in_flight -= 1
        return 0


def test_map_bounds_the_blocks_in_flight() -> None:
    src = CountingSource(np.ones((4000, 4)))
    out = memory.map(lambda b: b * 2, src, 10, workers=3)
    assert float(out.sum()) == 4000 * 4 * 2
    assert src.in_flight == 0
    assert 3 <= src.peak <= 2 * 3 + 1


def test_map_argument_errors() -> None:
    a = np.zeros((4, 2))
    with pytest.raises(TypeError, match=r"fn must be callable"):
        memory.map("sqrt", a)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"workers must be at least 1, got 0"):
        memory.map(np.sqrt, a, workers=0)
    with pytest.raises(TypeError, match=r"workers must be an integer"):
        memory.map(np.sqrt, a, workers=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rows must be at least 1"):
        memory.map(np.sqrt, a, 0)
    with pytest.raises(TypeError, match=r"holds Python objects"):
        memory.map(np.sqrt, a, dtype=object)


@settings(max_examples=examples(40), deadline=None)
@given(
    n=st.integers(0, 300),
    width=st.integers(1, 4),
    rows=st.integers(1, 120),
    workers=st.integers(1, 4),
    dtype=st.sampled_from(["int16", "float32", "float64", "uint8"]),
)
def test_map_and_chunks_match_numpy(
    n: int, width: int, rows: int, workers: int, dtype: str
) -> None:
    a = (np.arange(n * width) % 97).astype(dtype).reshape(n, width)
    blocks = list(chunks(a, rows))
    assert len(blocks) == -(-n // rows)
    got = np.concatenate(blocks) if blocks else np.zeros((0, width), dtype)
    np.testing.assert_array_equal(got, a)
    out = stream.map(lambda b: b.astype(np.float64) * 2 + 1, a, rows, workers=workers)
    np.testing.assert_array_equal(out, a.astype(np.float64) * 2 + 1)
