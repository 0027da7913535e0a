"""Page release, readahead and residency, measured with mincore and /proc/self/pagemap."""

from __future__ import annotations

import itertools
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from tierflow.storage import pages
from tierflow.storage.pages import (
    file_range,
    file_resident_bytes,
    mapped_bytes,
    readahead,
    release,
    release_path,
    resident_bytes,
)

from common import wait_for

PAGE = mmap.PAGESIZE
MB = 1 << 20


def _memmap(tmp_path: Path, nbytes: int = 4 * MB, name: str = "a.bin") -> np.memmap:
    """A written float64 memmap whose values are their own indices."""
    x = np.memmap(tmp_path / name, dtype=np.float64, mode="w+", shape=(nbytes // 8,))
    x[:] = np.arange(x.size, dtype=np.float64)
    return x


# -- release ---------------------------------------------------------------------------


def test_release_drops_mapping_and_cache_and_values_refault(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    assert resident_bytes(x) == x.nbytes
    assert mapped_bytes(x) == x.nbytes

    released = release(x)

    assert released == x.nbytes
    assert mapped_bytes(x) == 0
    assert resident_bytes(x) == 0
    assert file_resident_bytes(x.filename) == 0
    # Refaulted from the file, which is where the values must have gone.
    np.testing.assert_array_equal(x, np.arange(x.size, dtype=np.float64))
    assert resident_bytes(x) == x.nbytes


def test_release_writes_dirty_pages_back_before_dropping(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    x[123_456 // 8] = -1.5  # dirty one page, no flush
    x[-1] = 42.0

    release(x)

    # The page cache of the file is empty, so this read comes from the disk: the
    # change was written back, not merely kept in a cached page.
    assert file_resident_bytes(x.filename) == 0
    data = np.frombuffer(Path(x.filename).read_bytes(), dtype=np.float64)
    assert data[123_456 // 8] == -1.5
    assert data[-1] == 42.0
    assert data[7] == 7.0


def test_release_without_drop_cache_leaves_the_page_cache(tmp_path: Path) -> None:
    x = _memmap(tmp_path)

    assert release(x, drop_cache=False) == x.nbytes

    assert mapped_bytes(x) == 0  # gone from this process's RSS
    # mincore of a file mapping reports the page cache, which was kept.
    assert resident_bytes(x) == x.nbytes
    assert file_resident_bytes(x.filename) == x.nbytes
    assert float(x[-1]) == x.size - 1


def test_release_without_counting_returns_zero_and_still_releases(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    assert mapped_bytes(x) == x.nbytes
    assert release(x, drop_cache=False, count=False) == 0
    assert mapped_bytes(x) == 0
    assert float(x[-1]) == x.size - 1


def test_release_of_a_row_block_rounds_outward_to_pages(tmp_path: Path) -> None:
    # Rows of 1000 bytes: block boundaries fall inside pages.
    path = tmp_path / "rows.bin"
    x = np.memmap(path, dtype=np.uint8, mode="w+", shape=(4096, 1000))
    x[:] = 7
    block = x[1000:2000]
    low, high = pages._address_range(block)
    first_page, last_page = low // PAGE * PAGE, -(-high // PAGE) * PAGE
    base = pages._data_address(x)
    before = x.reshape(-1)[: first_page - base]
    after = x.reshape(-1)[last_page - base :]

    release(block, drop_cache=False)

    # The partial pages at both ends leave the process too (outward), nothing beyond.
    assert mapped_bytes(block) == 0
    assert mapped_bytes(before) == before.nbytes
    assert mapped_bytes(after) == after.nbytes
    assert int(block.sum()) == 7 * block.size


def test_a_forward_stream_of_releases_leaves_nothing_cached(tmp_path: Path) -> None:
    # 24 MB written in one go (the page cache may hold it in large folios), released in
    # blocks whose edges fall inside pages and folios.
    x = _memmap(tmp_path, 24 * MB).view(np.uint8)
    edges = [0, 1_000_001, 5_555_555, 9_000_000, 16_777_217, x.nbytes]
    blocks = [x[a:b] for a, b in itertools.pairwise(edges)]
    for i, block in enumerate(blocks):
        release(block)
        assert mapped_bytes(block) == 0
        # Everything released before this block has left the page cache in full; this
        # block may keep the folio it shares with the next until that is released.
        assert resident_bytes(x[: edges[i]]) == 0
        assert resident_bytes(block) <= 2 * MB
        rest = -(-edges[i + 1] // PAGE) * PAGE  # after the page this block ends in
        assert resident_bytes(x[rest:]) == x.nbytes - rest
    assert file_resident_bytes(path := tmp_path / "a.bin") == 0
    assert np.frombuffer(path.read_bytes(), dtype=np.float64)[-1] == x.nbytes // 8 - 1


def test_release_accepts_views_that_are_not_memmaps(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    view = np.asarray(x)[::-1].reshape(-1, 8)[10:20]  # plain ndarray, negative stride
    assert type(view) is np.ndarray

    assert release(view) == view.nbytes

    assert resident_bytes(view) == 0
    assert resident_bytes(x[: x.size // 2]) == x.nbytes // 2  # the rest is untouched
    np.testing.assert_array_equal(
        view, np.arange(x.size, dtype=np.float64)[::-1].reshape(-1, 8)[10:20]
    )


def test_release_of_read_only_and_bare_mmap_arrays(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, np.arange(MB // 8, dtype=np.float64))
    loaded = np.load(path, mmap_mode="r")
    assert float(loaded.sum()) == float(np.arange(MB // 8).sum())

    assert release(loaded) == loaded.nbytes
    assert resident_bytes(loaded) == 0

    # An mmap.mmap seen through np.frombuffer: the file is found in /proc/self/maps.
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    bare = np.frombuffer(mm, dtype=np.uint8)
    bare[-1] ^= 0  # fault one page in
    assert resident_bytes(bare) > 0
    assert file_range(bare) == pages.FileRange(str(path), 0, bare.nbytes, 0, True, False)
    release(bare)
    assert resident_bytes(bare) == 0
    del bare
    mm.close()


def test_release_refuses_an_ordinary_ram_array() -> None:
    x = np.ones(1 << 16)
    with pytest.raises(ValueError, match=r"ordinary in-memory array.*would discard its data"):
        release(x)
    assert x.sum() == 1 << 16
    with pytest.raises(TypeError, match="takes a NumPy array"):
        release([1.0, 2.0])  # type: ignore[arg-type]


def test_release_refuses_a_copy_on_write_memmap(tmp_path: Path) -> None:
    _memmap(tmp_path).flush()
    cow = np.memmap(tmp_path / "a.bin", dtype=np.float64, mode="c")
    cow[0] = 99.0
    with pytest.raises(ValueError, match=r"copy-on-write memmap \(mode='c'\).*discard"):
        release(cow)
    assert cow[0] == 99.0


def test_release_of_an_empty_array_is_zero(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    assert release(x[5:5]) == 0
    assert resident_bytes(x[5:5]) == 0
    readahead(x[5:5])


def test_release_after_the_file_was_deleted_still_drops_the_mapping(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    os.unlink(x.filename)
    release(x)
    assert mapped_bytes(x) == 0
    assert float(x[-1]) == x.size - 1


# -- readahead -------------------------------------------------------------------------


def test_readahead_brings_a_cold_range_into_the_page_cache(tmp_path: Path) -> None:
    # 24 MB: larger than one device readahead window, which is all a single WILLNEED
    # reads; the whole range must come in.
    x = _memmap(tmp_path, 24 * MB)
    release(x)
    assert file_resident_bytes(x.filename) == 0
    block = x[x.size // 4 :]

    readahead(block)

    wait_for(lambda: resident_bytes(block) >= 0.98 * block.nbytes, what="the block in the cache")
    assert mapped_bytes(block) == 0  # read into the cache, not mapped yet
    assert resident_bytes(x[: x.size // 8]) == 0  # nothing before the block


def test_readahead_of_a_ram_array_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_file(path: str | None) -> int:
        raise AssertionError(f"readahead asked for a window of {path!r}")

    monkeypatch.setattr(pages, "_readahead_window", no_file)  # asked before any madvise
    untouched = np.empty(16 * MB // 8)  # its own anonymous mapping, no page faulted yet
    before = resident_bytes(untouched)
    readahead(untouched)
    readahead(np.zeros(0))
    assert resident_bytes(untouched) == before


def test_readahead_of_a_range_all_in_memory_asks_the_kernel_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _memmap(tmp_path, 4 * MB)
    assert float(x.sum()) >= 0  # read: every page is in memory

    def asked(path: str | None) -> int:
        raise AssertionError(f"readahead asked for pages already in memory ({path!r})")

    monkeypatch.setattr(pages, "_readahead_window", asked)  # asked before any madvise
    readahead(x[1:])
    release(x, drop_cache=True)
    monkeypatch.undo()
    readahead(x)  # cold again: asked for
    wait_for(lambda: resident_bytes(x) >= 0.98 * x.nbytes, what="the file in the cache")


def test_readahead_of_a_range_with_a_cold_middle_asks_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether a range is in memory is told by pages sampled over it: a quarter out in
    # the middle (four of the samples) is noticed, and read again.
    x = _memmap(tmp_path, 8 * MB)
    assert float(x.sum()) >= 0
    middle = x[x.size // 4 : x.size // 2]
    release(middle, drop_cache=True)
    assert resident_bytes(middle) == 0
    windows: list[str | None] = []
    window = pages._readahead_window

    def asked(path: str | None) -> int:
        windows.append(path)
        return window(path)

    monkeypatch.setattr(pages, "_readahead_window", asked)
    readahead(x)
    assert windows == [str(x.filename)]
    wait_for(lambda: resident_bytes(middle) >= 0.98 * middle.nbytes, what="the middle")


def test_readahead_window_comes_from_the_device(tmp_path: Path) -> None:
    window = pages._readahead_window(str(tmp_path))
    assert window >= PAGE and window % PAGE == 0
    assert pages._readahead_window(None) == pages._DEFAULT_WINDOW
    assert pages._readahead_window(str(tmp_path / "missing")) == pages._DEFAULT_WINDOW


# -- residency -------------------------------------------------------------------------


def test_resident_bytes_of_ram_counts_faulted_pages() -> None:
    # Above glibc's largest mmap threshold (32 MB): a fresh mapping, untouched but for
    # malloc's header (which may fault one 2 MB huge page).
    x = np.empty(64 * MB, dtype=np.uint8)
    assert resident_bytes(x) <= 4 * MB
    x[:] = 1
    assert resident_bytes(x) == x.nbytes


def test_resident_bytes_counts_only_the_range_of_partial_pages(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    piece = x.view(np.uint8)[100:110]
    assert resident_bytes(piece) == 10
    strided = x[::1024]  # one element per two pages, the span covers them all
    assert resident_bytes(strided) == (strided.size - 1) * 8192 + 8


def test_resident_bytes_spans_many_mincore_windows(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pages, "_MINCORE_WINDOW", 7)
    x = _memmap(tmp_path, MB)
    view = x.view(np.uint8)[100 : x.nbytes - 100]
    assert resident_bytes(view) == view.nbytes
    release(x[: x.size // 2])
    assert resident_bytes(view) == x.nbytes // 2 - 100


def test_file_resident_bytes_and_release_path(tmp_path: Path) -> None:
    path = tmp_path / "written.bin"
    path.write_bytes(b"\x01" * (3 * MB + 100))
    assert file_resident_bytes(path) == 3 * MB + 100

    assert release_path(path) == 3 * MB + 100

    assert file_resident_bytes(path) == 0
    assert path.read_bytes()[-1] == 1
    assert (
        file_resident_bytes(
            tmp_path / "empty.bin" if (tmp_path / "empty.bin").touch() is None else path
        )
        == 0
    )
    with pytest.raises(FileNotFoundError):
        file_resident_bytes(tmp_path / "missing.bin")
    with pytest.raises(FileNotFoundError):
        release_path(tmp_path / "missing.bin")


def test_release_path_refuses_while_mapped_and_allows_after(tmp_path: Path) -> None:
    x = _memmap(tmp_path)
    link = tmp_path / "link.bin"
    link.symlink_to(x.filename)

    with pytest.raises(
        ValueError, match=r"still maps .*a\.bin \(1 mapping, 4\.0 MB\).*Release the mapped array"
    ):
        release_path(x.filename)
    with pytest.raises(ValueError, match="still maps"):
        release_path(link)  # same file under another name
    assert file_resident_bytes(x.filename) == x.nbytes  # nothing was done

    del x
    assert release_path(link) == 4 * MB
    assert file_resident_bytes(link) == 0


# -- file_range ------------------------------------------------------------------------


def test_file_range_of_views(tmp_path: Path) -> None:
    path = tmp_path / "off.bin"
    path.write_bytes(b"\0" * (3 * PAGE + 24))
    x = np.memmap(path, dtype=np.float64, mode="r+", offset=PAGE + 8, shape=(10, 4))

    assert file_range(x) == pages.FileRange(str(path), PAGE + 8, 320, 0, True, False)
    assert file_range(x[2:5, 1]) == pages.FileRange(
        str(path), PAGE + 8 + 72, 2 * 32 + 8, 0, True, False
    )
    flipped = x[::-1, ::-1]
    assert file_range(flipped) == pages.FileRange(str(path), PAGE + 8, 320, 312, True, False)
    assert file_range(np.zeros(3)) is None

    os.unlink(path)
    with pytest.raises(ValueError, match="deleted"):
        file_range(x)
