"""One leased mapping of a file per process, shared and kept (tierflow.storage.filemaps)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow.storage import filemaps, leases, pages
from tierflow.storage.sources import open_npy, open_raw

from common import wait_for


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    filemaps.forget_all()
    yield
    filemaps.keep_files(None)
    filemaps.forget_all()


def _save(path: Path, value: float = 1.0, rows: int = 4096) -> np.ndarray:
    data = np.full((rows, 8), value, dtype=np.float32) + np.arange(8, dtype=np.float32)
    np.save(path, data)
    return data


def _mapping_id(source: object) -> int:
    m = source.block(0, 1)  # type: ignore[attr-defined]
    return id(m._mmap)


def _mapped_here(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) or f"{path} (deleted)" in line for line in f)


def test_sources_of_the_same_data_share_one_mapping(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    _save(path)
    a, b = open_npy(path, shared=True), open_npy(path, shared=True)
    assert _mapping_id(a) == _mapping_id(b)
    assert a._lease == b._lease and leases.held(a._lease)
    # the same data opened as a raw file shares it; another dtype and shape does not
    raw = open_raw(path, np.float32, (4096, 8), offset=a.offset, shared=True)
    assert _mapping_id(raw) == _mapping_id(a)
    other = open_raw(path, np.uint8, (4096 * 32,), offset=a.offset, shared=True)
    assert _mapping_id(other) != _mapping_id(a)
    # a source that does not share maps the file on its own, and lets go with it
    own = open_npy(path)
    assert _mapping_id(own) != _mapping_id(a) and own._lease != a._lease
    lease = own._lease
    own.close()
    gc.collect()
    assert not leases.held(lease)


def test_a_kept_mapping_outlives_its_source_with_its_pages(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    data = _save(path)
    x = tw.from_npy(path, rows=500)
    np.testing.assert_array_equal(x.sum(axis=0).compute(), data.sum(axis=0))
    first = _mapping_id(x._node.reader.source)
    del x
    gc.collect()
    y = tw.from_npy(path, rows=500)
    source = y._node.reader.source
    view = source.block(0, 4096)
    assert id(view._mmap) == first and source.kept()
    assert pages.mapped_bytes(view) >= view.nbytes  # the scan left its pages mapped


def test_with_no_room_nothing_is_kept_and_pages_are_released(tmp_path: Path) -> None:
    filemaps.keep_files(0)
    path = tmp_path / "x.npy"
    data = _save(path, rows=65536)  # 2 MB: more than the release's reach-back
    x = tw.from_npy(path, rows=4096)
    np.testing.assert_array_equal(x.sum(axis=0).compute(), data.sum(axis=0))
    source = x._node.reader.source
    assert not source.kept()
    view = source.block(0, 65536)
    assert pages.mapped_bytes(view) < view.nbytes // 4
    lease = source._lease
    del x, source, view
    gc.collect()
    assert not _mapped_here(path)
    assert not leases.held(lease)


def test_only_the_most_recent_files_that_fit_are_kept(tmp_path: Path) -> None:
    paths = [tmp_path / f"x{i}.npy" for i in range(3)]
    for p in paths:
        _save(p)
    one = open_npy(paths[0], shared=True).nbytes
    filemaps.keep_files(2 * one)
    for p in paths:
        open_npy(p, shared=True).block(0, 1)
    gc.collect()
    assert [_mapped_here(p) for p in paths] == [False, True, True]
    open_npy(paths[1], shared=True).block(0, 1)  # used again: now the most recent
    open_npy(paths[0], shared=True).block(0, 1)
    gc.collect()
    assert [_mapped_here(p) for p in paths] == [True, True, False]
    filemaps.keep_files(None)
    big = tmp_path / "big.npy"
    _save(big, rows=4096)
    filemaps.keep_files(one - 1)  # no file fits: none is kept
    open_npy(big, shared=True).block(0, 1)
    gc.collect()
    assert not any(_mapped_here(p) for p in [*paths, big])


def test_a_rewrite_in_place_lets_a_kept_mapping_go_and_is_read_anew(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    _save(path, 1.0)
    assert tw.from_npy(path, rows=500).sum().compute() > 0
    gc.collect()
    assert _mapped_here(path)
    new = np.full((4096, 8), -3.0, dtype=np.float32)  # same size, same header
    script = f"import numpy as np; np.save({str(path)!r}, np.full((4096, 8), -3.0, np.float32))"
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    assert time.monotonic() - started < 10  # not the 45 s lease-break time
    np.testing.assert_array_equal(tw.from_npy(path, rows=500).compute(), new)
    # and the same process writing it: the lease breaks and goes within a poll
    started = time.monotonic()
    np.save(path, new * 2)
    assert time.monotonic() - started < 5
    np.testing.assert_array_equal(tw.from_npy(path, rows=500).compute(), new * 2)


def test_a_deleted_file_is_kept_no_more(tmp_path: Path) -> None:
    path, other = tmp_path / "x.npy", tmp_path / "y.npy"
    _save(path)
    _save(other)
    open_npy(path, shared=True).block(0, 1)
    gc.collect()
    assert _mapped_here(path)
    kept = open_npy(other, shared=True)
    kept.block(0, 1)
    os.unlink(path)
    # let go within a sweep, with no other use of the table meanwhile
    wait_for(lambda: not _mapped_here(path), timeout=5 * filemaps.SWEEP_S)
    assert _mapped_here(other)  # a file still there stays kept


def test_a_forked_child_keeps_nothing_and_maps_anew(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    data = _save(path)
    source = open_npy(path, shared=True)
    source.block(0, 4096)
    inherited = source._map
    assert inherited is not None and filemaps.kept(inherited)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            mine = open_npy(path, shared=True)
            block = mine.block(0, 4096)
            ok = (
                not filemaps.kept(inherited)
                and mine._map is not inherited
                and mine.kept()
                and np.array_equal(block, data)
            )
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == b"1"
    assert filemaps.kept(inherited)  # the parent still keeps it
