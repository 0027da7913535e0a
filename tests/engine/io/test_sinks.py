"""Sinks: compute into the tiers, to_npy (streamed, atomic), persist."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import tierflow as tw
from tierflow.config import format_bytes
from tierflow.engine.io.npy import npy_header
from tierflow.errors import BlockError
from tierflow.storage import placement, spill

MB = 1 << 20


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [("<f4", (1000, 8)), ("|b1", (0,)), ("<i8", (3, 2, 5)), ([("a", "<f4"), ("b", "<i2")], (7,))],
)
def test_npy_header_is_numpys(dtype: object, shape: tuple[int, ...]) -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(shape, dtype))
    data = buffer.getvalue()
    header = npy_header(np.dtype(dtype), shape)
    assert data.startswith(header)


def test_a_padded_header_still_reads(tmp_path: Path) -> None:
    wide = npy_header(np.dtype("<f4"), (10**19 - 1, 8))
    header = npy_header(np.dtype("<f4"), (3, 8), len(wide))
    (tmp_path / "p.npy").write_bytes(header + np.ones((3, 8), "<f4").tobytes())
    np.testing.assert_array_equal(np.load(tmp_path / "p.npy"), np.ones((3, 8)))


def test_compute_places_a_result_bigger_than_the_budget_on_the_ssd(tmp_path: Path) -> None:
    tw.memory.budget("4MB")
    a = np.random.default_rng(0).normal(size=(200_000, 4)).astype(np.float32)  # 3 MB
    x = tw.from_array(a, rows=20_000)
    y = (x * 2).astype(np.float64)  # 6 MB: more than the budget
    result = y.compute()
    assert placement.on_disk(result)
    np.testing.assert_array_equal(result, a.astype(np.float64) * 2)
    small = (x[:10] + 1).compute()
    assert not placement.on_disk(small)


def test_to_npy_streams_known_and_unknown_row_counts(tmp_path: Path) -> None:
    a = np.random.default_rng(1).normal(size=(5000, 3))
    x = tw.from_array(a, rows=701)
    (x * 2).to_npy(tmp_path / "double.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "double.npy"), a * 2)
    x[x[:, 1] > 0.5].to_npy(tmp_path / "masked.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "masked.npy"), a[a[:, 1] > 0.5])
    x[x[:, 1] > 99].to_npy(tmp_path / "empty.npy")
    assert np.load(tmp_path / "empty.npy").shape == (0, 3)
    x.sum(axis=0).to_npy(tmp_path / "sum.npy", fsync=True)
    np.testing.assert_allclose(np.load(tmp_path / "sum.npy"), a.sum(axis=0))
    assert leftovers(tmp_path) == []


def test_to_npy_writes_over_its_own_source_safely(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    np.save(path, np.arange(1000.0))
    (tw.from_npy(path, rows=100) + 1).to_npy(path, overwrite=True)
    np.testing.assert_array_equal(np.load(path), np.arange(1000.0) + 1)


@pytest.mark.parametrize("unknown_rows", [False, True])
def test_a_failing_to_npy_leaves_no_file_and_no_temporary(
    tmp_path: Path, unknown_rows: bool
) -> None:
    target = tmp_path / "out.npy"
    np.save(target, np.arange(3))
    old = target.read_bytes()

    def fails_late(b: np.ndarray) -> np.ndarray:
        if b[0, 0] >= 600:
            raise RuntimeError("disk of doom")
        return b

    x = tw.from_array(np.arange(2000.0).reshape(1000, 2), rows=100)
    y = x.map_blocks(fails_late, dtype=np.float64, row_shape=(2,))
    if unknown_rows:
        y = y[y[:, 1] > 0]
    with pytest.raises(BlockError, match="disk of doom"):
        y.to_npy(target, overwrite=True)
    assert target.read_bytes() == old
    assert leftovers(tmp_path) == []


def test_a_full_disk_is_refused_before_any_work_with_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    calls = []
    x = tw.from_array(np.zeros((1000, 4)), rows=100).map_blocks(
        lambda b: calls.append(1) or b, dtype=np.float64, row_shape=(4,)
    )
    with pytest.raises(
        OSError,
        match=r"no room to write .*out\.npy: it needs 31\.375 KB \(32128 bytes\) and .* are free there",
    ):
        x.to_npy(tmp_path / "out.npy")
    assert calls == [] and leftovers(tmp_path) == []


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_an_interrupted_to_npy_leaves_nothing(tmp_path: Path) -> None:
    started = threading.Event()

    def slow(b: np.ndarray) -> np.ndarray:
        started.set()
        if b[0, 0] >= 300:
            raise KeyboardInterrupt
        return b

    x = tw.from_array(np.arange(1000.0).reshape(500, 2), rows=50)
    with pytest.raises(KeyboardInterrupt):
        x.map_blocks(slow, dtype=np.float64, row_shape=(2,)).to_npy(tmp_path / "k.npy")
    assert started.is_set() and leftovers(tmp_path) == [] and not (tmp_path / "k.npy").exists()


def test_persist_keeps_key_and_blocks_and_reads_the_tiers(tmp_path: Path) -> None:
    a = np.random.default_rng(2).normal(size=(3000, 2))
    x = tw.from_array(a, rows=1000)
    y = np.exp(x) - 1
    p = y.persist()
    assert p.key == y.key and p.blocks == y.blocks
    np.testing.assert_array_equal(p.compute(), np.exp(a) - 1)
    masked = y[y[:, 0] > 0].persist()
    assert masked.shape == (int((a[:, 0] > 0).sum()), 2)
    total = y.sum().persist()
    assert total.key == y.sum().key and float(total) == pytest.approx(float((np.exp(a) - 1).sum()))


def test_failed_compute_frees_its_spilled_output() -> None:
    tw.memory.budget("1MB")
    before = len(spill.live_files())

    def fail(b: np.ndarray) -> np.ndarray:
        if b[0, 0] > 100_000:
            raise ValueError("late failure")
        return b

    x = tw.from_array(np.arange(400_000.0).reshape(200_000, 2), rows=20_000)
    with pytest.raises(BlockError, match="late failure"):
        x.map_blocks(fail, dtype=np.float64, row_shape=(2,)).compute()
    assert len(spill.live_files()) == before


def test_masked_blocks_wait_for_slow_appends_rather_than_spill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierflow.engine import types
    from tierflow.engine.io import npy

    tw.memory.budget("8MB")
    write = npy.NpySink.append

    def slow_append(self: npy.NpySink, row: int, block: np.ndarray) -> int:
        time.sleep(0.01)  # a slow disk: blocks are computed faster than appended
        return write(self, row, block)

    monkeypatch.setattr(npy.NpySink, "append", slow_append)
    a = np.random.default_rng(0).normal(size=(400_000, 4))  # 12.8 MB, 1.6x the budget
    x = tw.from_array(a, rows=10_000)
    names: list[str] = []

    class Order:
        def task_done(self, event: types.TaskFinished) -> None:
            names.append(event.name.split(" of ")[0])

        def finish(self, event: types.ComputeFinished) -> None:
            self.spilled = event.spilled_bytes

    order = Order()
    x[x[:, 0] > 0].to_npy(tmp_path / "m.npy", workers=2, callbacks=order)
    np.testing.assert_array_equal(np.load(tmp_path / "m.npy"), a[a[:, 0] > 0])
    # No block is computed more than 2 x workers ahead of the appends, so none is held
    # past half the budget and none is spilled.
    computed = appended = most = 0
    for name in names:
        computed += name.startswith("block")
        appended += name.startswith("append")
        most = max(most, computed - appended)
    assert computed == appended == 40
    assert most <= 4 and order.spilled == 0


# -- a disk too small, file modes, options ---------------------------------------------


def _free(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def small_ext4(tmp_path: Path) -> Iterator[Path]:
    """A 64 MB ext4 filesystem, loop-mounted (root only; skips where it cannot be made).

    ext4's posix_fallocate takes blocks as it goes and keeps them when it fails, which
    is what a tmpfs does not do.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to loop-mount an ext4 image")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4 (e2fsprogs) to make an ext4 image")
    image, where = tmp_path / "ext4.img", tmp_path / "ext4"
    with open(image, "wb") as f:
        f.truncate(64 * MB)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    where.mkdir()
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    mounted = subprocess.run(
        ["mount", "-o", "loop", str(image), str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


class LowestFree:
    """The least free space a folder's filesystem had while this was running."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.lowest = _free(folder)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.lowest = min(self.lowest, _free(self.folder))

    def __enter__(self) -> LowestFree:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_to_npy_onto_a_disk_too_small_takes_no_space_and_says_what_is_free(
    small_ext4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = _free(small_ext4)
    asked: list[tuple[int, int]] = []  # (bytes asked, bytes free then)
    fallocate = os.posix_fallocate

    def recorded(fd: int, offset: int, length: int) -> None:
        asked.append((length, _free(small_ext4)))
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", recorded)
    x = tw.from_array(np.zeros((free // 8 + MB, 1)), rows=MB)  # 8 MB more than is free
    with LowestFree(small_ext4) as seen, pytest.raises(OSError) as info:
        x.to_npy(small_ext4 / "out.npy")
    assert info.value.errno == errno.ENOSPC
    assert f"and {format_bytes(free, 3)} ({free} bytes) are free there" in str(info.value)
    assert all(length <= was_free for length, was_free in asked), asked
    assert seen.lowest >= free - MB  # never close to full, even for a moment
    assert _free(small_ext4) == free and leftovers(small_ext4) == []


def test_a_reservation_that_fails_midway_reports_the_space_free_after_it(
    small_ext4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = _free(small_ext4)
    fallocate = os.posix_fallocate

    def takes_all_then_fails(fd: int, offset: int, length: int) -> None:
        # As ext4 does when the space went to another writer meanwhile.
        with contextlib.suppress(OSError):
            fallocate(fd, offset, 4 * free)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", takes_all_then_fails)
    x = tw.from_array(np.zeros((MB, 1)), rows=MB // 4)  # 8 MB: fits
    with pytest.raises(OSError, match=r"no room to write .*out\.npy") as info:
        x.to_npy(small_ext4 / "out.npy")
    reported = int(re.findall(r"\((\d+) bytes\) are free there", str(info.value))[0])
    assert reported >= free - MB  # the space the failed reservation took is given back
    assert _free(small_ext4) == free and leftovers(small_ext4) == []


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600)])
def test_to_npy_files_follow_the_umask_as_np_save_does(
    tmp_path: Path, umask: int, mode: int
) -> None:
    x = tw.from_array(np.arange(300.0).reshape(100, 3), rows=30)
    old = os.umask(umask)
    try:
        np.save(tmp_path / "numpy.npy", np.zeros(3))
        (x * 2).to_npy(tmp_path / "known.npy")
        x[x[:, 0] > 50].to_npy(tmp_path / "masked.npy")
        x.sum(axis=0).to_npy(tmp_path / "value.npy")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(["numpy.npy", "known.npy", "masked.npy", "value.npy"], mode)


def test_spill_files_stay_private_whatever_the_umask() -> None:
    old = os.umask(0)
    try:
        record = spill.create(MB)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(record.path).st_mode) == 0o600
    finally:
        record.delete()


def test_an_unknown_option_is_named_with_the_public_function(tmp_path: Path) -> None:
    x = tw.from_array(np.ones((10, 2)), rows=5)
    calls: dict[str, Callable[[], object]] = {
        "to_npy": lambda: x.to_npy(tmp_path / "a.npy", bogus=1),
        "compute": lambda: x.compute(bogus=1),
        "persist": lambda: x.persist(bogus=1),
    }
    public: dict[str, Callable[[], object]] = {
        "to_npy": lambda: tw.to_npy(x, tmp_path / "a.npy", bogus=1),
        "compute": lambda: tw.compute(x, bogus=1),
        "persist": lambda: tw.persist(x, bogus=1),
    }
    for name, call in [*calls.items(), *public.items()]:
        with pytest.raises(
            TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'bogus'"
        ):
            call()
    assert list(tmp_path.iterdir()) == []
