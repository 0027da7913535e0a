"""The /dev/shm guard: refuse what does not fit, with both remedies; allocate what does."""

from __future__ import annotations

import errno
import gc
import multiprocessing as mp
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierflow import memory
from tierflow.errors import SharedMemoryError
from tierflow.storage import shm
from tierflow.storage.pages import file_range

MB = 1 << 20
TMPFS_SIZE = 4 * MB


@pytest.fixture
def small_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 4 MB tmpfs standing in for a container's /dev/shm (mounting needs root)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    monkeypatch.setattr(shm, "SHM_DIR", str(folder))
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _child_writes(x: np.ndarray) -> None:
    x[:] = 7.0


# -- the check -------------------------------------------------------------------------


def test_short_of_room_names_the_bytes_and_both_remedies(small_shm: Path) -> None:
    with pytest.raises(SharedMemoryError) as info:
        shm.shared_array((600_000,), "float64")  # 4.6 MB on a 4 MB mount
    message = str(info.value)
    assert re.search(r"\[600000\] float64 array of 4\.578 MB \(4800000 bytes\)", message)
    assert f"{small_shm} has 4.000 MB (4194304 bytes) free of 4.000 MB" in message
    assert "SIGBUS" in message
    assert "memory.array() spills to TIERFLOW_SPILL_DIR" in message
    assert "crosses processes by path" in message
    assert "docker run --shm-size=8g" in message
    assert info.value.errno == errno.ENOSPC
    assert isinstance(info.value, OSError)
    assert os.listdir(small_shm) == []  # nothing was created


def test_the_margin_counts(small_shm: Path) -> None:
    # 3.5 MB fits the 4 MB mount but not with the 1 MB kept spare.
    with pytest.raises(SharedMemoryError, match=r"keeps 1\.0 MB spare"):
        shm.check_room(3 * MB + MB // 2)
    shm.check_room(3 * MB)
    assert shm.margin(64 * MB) == MB and shm.margin(1 << 30) == (1 << 30) // 64


def test_enough_room_works_and_the_pages_are_reserved(small_shm: Path) -> None:
    x = shm.shared_array((256, 1024), "float64")  # 2 MB
    assert isinstance(x, np.memmap) and x.shape == (256, 1024) and not x.any()
    (name,) = os.listdir(small_shm)
    assert name.startswith(f"tierflow-shm-{os.getpid()}-")
    free, _ = shm.shm_free()
    assert free == TMPFS_SIZE - 2 * MB  # reserved up front, not on first write
    x[:] = 1.0
    with pytest.raises(SharedMemoryError, match="not enough shared memory"):
        shm.shared_array((MB // 8 * 2,))  # 2 MB more: only 2 MB left, less the margin
    del x
    gc.collect()
    assert os.listdir(small_shm) == []  # deleted with its last view


def test_a_race_lost_after_the_check_is_still_an_error(
    small_shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Someone else fills the mount between the check and the allocation.
    monkeypatch.setattr(shm, "check_room", lambda *a, **k: None)
    with pytest.raises(SharedMemoryError, match="not enough shared memory"):
        shm.shared_array((MB,), "float64")  # 8 MB: fallocate says ENOSPC, never SIGBUS
    assert os.listdir(small_shm) == []


def test_statvfs_is_what_is_checked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Stat:
        f_bavail, f_blocks, f_frsize = 10, 16, 4096 * 1024  # 40 MB free of 64 MB

    seen: list[str] = []

    def fake_statvfs(path: str) -> Stat:
        seen.append(path)
        return Stat()

    monkeypatch.setattr(shm.os, "statvfs", fake_statvfs)
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    with pytest.raises(
        SharedMemoryError, match=r"40\.000 MB \(41943040 bytes\) free of 64\.000 MB"
    ):
        shm.check_room(40 * MB)
    shm.check_room(39 * MB)
    assert seen == [str(tmp_path)] * 2


# -- shared arrays across processes ---------------------------------------------------


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_shared_array_is_shared_with_children(small_shm: Path, method: str) -> None:
    x = shm.shared_array((1000,), "float64")
    path = file_range(x).path  # type: ignore[union-attr]
    assert Path(path).parent == small_shm
    child = mp.get_context(method).Process(target=_child_writes, args=(x[100:200],))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert x[99] == 0.0 and x[100:200].sum() == 700.0 and x[200] == 0.0
    assert os.path.exists(path)  # the children did not delete it


def test_files_of_dead_processes_are_swept(
    small_shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = subprocess.Popen(["true"])  # a pid that is certainly gone
    proc.wait()
    stale = small_shm / f"tierflow-shm-{proc.pid}-12345-{uuid.uuid4().hex}.bin"
    stale.write_bytes(b"\0" * 4096)
    reused = small_shm / f"tierflow-shm-{os.getpid()}-1-abc.bin"  # our pid, other start
    reused.write_bytes(b"\0")
    other = small_shm / "someone-elses.bin"
    other.write_bytes(b"\0")
    monkeypatch.setattr(shm, "_swept", set())
    x = shm.shared_array((10,))
    names = sorted(os.listdir(small_shm))
    assert stale.name not in names and reused.name not in names
    assert other.name in names and len(names) == 2
    assert x.sum() == 0


def test_an_empty_array_needs_no_shared_memory(small_shm: Path) -> None:
    assert shm.shared_array((0, 5)).shape == (0, 5)
    assert os.listdir(small_shm) == []


def test_bad_requests() -> None:
    with pytest.raises(TypeError):
        shm.shared_array((3,), object)
    with pytest.raises(ValueError):
        shm.shared_array((-1,))


# -- torch -----------------------------------------------------------------------------


@pytest.mark.torch
def test_share_tensor_checks_before_share_memory(small_shm: Path) -> None:
    torch = pytest.importorskip("torch")
    big = torch.zeros(MB)  # 4 MB of float32
    with pytest.raises(SharedMemoryError, match=r"\[1048576\] torch\.float32 tensor of 4\.000 MB"):
        memory.share_tensor(big)
    assert not big.is_shared()

    small = torch.ones(1000)  # torch shares it in the real /dev/shm; the check passed
    assert memory.share_tensor(small) is small and small.is_shared()
    assert memory.share_tensor(small) is small  # already shared: nothing to check


@pytest.mark.torch
def test_share_tensor_leaves_disk_backed_tensors_alone(small_shm: Path) -> None:
    pytest.importorskip("torch")
    from tierflow.storage import spill

    x = spill.map_array((MB,), np.dtype(np.float64))
    t = memory.to_tensor(x)  # 8 MB: more than the 4 MB mount, yet not refused
    assert memory.share_tensor(t) is t
    # Still the spill file's mapping: it crosses by path, nothing was put in /dev/shm.
    assert t.untyped_storage().filename == spill.spill_file_of(x).path  # type: ignore[union-attr]
