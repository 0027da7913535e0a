"""Read leases keep a mapped file from shrinking under its views (tierflow.storage.leases)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tierflow.errors import SourceError
from tierflow.storage import leases
from tierflow.storage.sources import open_npy

from common import wait_for


def _save(path: Path, rows: int = 4096) -> np.ndarray:
    data = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8)
    np.save(path, data)
    return data


def test_a_truncate_waits_until_the_last_view_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    data = _save(path)
    size = path.stat().st_size
    source = open_npy(path)
    view = source.block(100, 200)
    assert isinstance(view, np.memmap) and source.leased
    truncate = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.truncate({str(path)!r}, 64)"]
    )
    try:
        wait_for(lambda: not source.leased)  # the watcher saw the break
        assert truncate.poll() is None  # the truncate is held while the view lives
        assert path.stat().st_size == size
        np.testing.assert_array_equal(view, data[100:200])
        copy = source.block(200, 300)  # read by copy while the break is pending
        assert not isinstance(copy, np.memmap)
        np.testing.assert_array_equal(copy, data[200:300])
        del view
        assert truncate.wait(30) == 0
    finally:
        truncate.kill()
    assert path.stat().st_size == 64
    with pytest.raises(SourceError, match=rf"had {size} bytes and now has 64"):
        source.block(0, 10)


def test_a_file_open_for_writing_is_read_by_copy(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    data = _save(path)
    with open(path, "r+b"):
        source = open_npy(path)
        block = source.block(10, 20)
        assert not isinstance(block, np.memmap)
        assert not source.leased
        np.testing.assert_array_equal(block, data[10:20])
    # once the writer is gone, blocks are views of a leased mapping again
    assert isinstance(source.block(10, 20), np.memmap) and source.leased


def test_a_file_shrunk_before_its_first_block_is_refused_with_both_sizes(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    _save(path)
    size = path.stat().st_size
    source = open_npy(path)
    os.truncate(path, 1000)
    with pytest.raises(SourceError, match=rf"x\.npy shrank .* had {size} bytes and now has 1000"):
        source.block(0, 1)


def test_a_file_replaced_before_its_first_block_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    _save(path)
    source = open_npy(path)
    _save(tmp_path / "new.npy")
    os.replace(tmp_path / "new.npy", path)
    with pytest.raises(SourceError, match="replaced by another file"):
        source.block(0, 1)


def test_the_lease_goes_with_the_mapping(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    _save(path)
    source = open_npy(path)
    view = source.block(0, 10)
    lease = source._lease
    assert lease is not None and leases.held(lease)
    source.close()
    assert leases.held(lease)  # the view still maps the file
    del view
    with open(path, "r+b"):  # would wait for a lease still held
        pass
    assert not source.leased
