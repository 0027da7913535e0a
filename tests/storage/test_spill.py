"""Spill files: reserve before map, clear errors on a full or unusable disk, cleanup."""

from __future__ import annotations

import errno
import gc
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierflow import config
from tierflow.errors import SpillError, TierflowError
from tierflow.storage import leases, spill
from tierflow.system import processes

MB = 1 << 20


def _files_in(folder: str | Path) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _open_descriptors_of(path: str) -> list[str]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(path):
            found.append(target)
    return found


def _mounted(kind: str, where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", kind, "-o", options, kind, str(where)],
        capture_output=True,
        text=True,
    )
    return result.returncode == 0


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MB tmpfs as the spill root (root only; skips where mounting is not allowed)."""
    where = tmp_path / "tmpfs"
    if os.geteuid() != 0 or not _mounted("tmpfs", where, "size=8m,mode=0700"):
        pytest.skip("needs root and permission to mount a tmpfs (mount -t tmpfs failed)")
    config.set(spill_dir=str(where))
    try:
        yield where
    finally:
        gc.collect()
        _umount(where)


# -- creating -------------------------------------------------------------------------


def test_file_is_reserved_in_a_private_process_folder() -> None:
    record = spill.create(3 * MB + 5)
    try:
        folder = os.path.dirname(record.path)
        assert os.path.basename(folder) == f"{os.getpid()}-{processes.start_time(os.getpid())}"
        assert os.path.dirname(folder) == spill.spill_root()
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(record.path).st_mode) == 0o600
        st = os.stat(record.path)
        assert st.st_size == 3 * MB + 5
        assert st.st_blocks * 512 >= 3 * MB + 5  # reserved, not sparse
        assert os.path.basename(record.path).startswith(spill.PREFIX)
        assert record.path.endswith(spill.SUFFIX)
    finally:
        record.delete()
    assert not os.path.exists(record.path)


def test_missing_parents_are_created_0700(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "spill"
    config.set(spill_dir=str(root))
    record = spill.create(4096)
    record.delete()
    for folder in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_two_files_of_the_same_size_never_share_a_name() -> None:
    a = spill.map_array((1000,), np.dtype("float64"))
    b = spill.map_array((1000,), np.dtype("float64"))
    assert spill.spill_file_of(a).path != spill.spill_file_of(b).path  # type: ignore[union-attr]
    a[:] = 1
    assert float(b.sum()) == 0.0


def test_spill_root_expands_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config.set(spill_dir="~/x/spill")
    assert spill.spill_root() == str(tmp_path / "x" / "spill")


# -- mapping, views, garbage collection -----------------------------------------------


def test_map_array_is_zero_filled_and_writes_reach_the_file() -> None:
    m = spill.map_array((256, 4), np.dtype("int32"))
    assert isinstance(m, np.memmap)
    assert m.shape == (256, 4) and m.dtype == np.int32
    assert not m.any()
    m[7] = [1, 2, 3, 4]
    m.flush()
    record = spill.spill_file_of(m)
    assert record is not None
    data = np.fromfile(record.path, dtype=np.int32).reshape(256, 4)
    assert data[7].tolist() == [1, 2, 3, 4]
    assert record.offset_of(m[7]) == 7 * 16
    assert record.offset_of(m[:, 2]) == 8


def test_spill_file_of_views_and_not_of_others(tmp_path: Path) -> None:
    m = spill.map_array((100, 10), np.dtype("float32"))
    record = spill.spill_file_of(m)
    assert record is not None and record.nbytes == 4000
    for view in (m[3:], m[::2, 1], np.asarray(m[5:]), m.view(np.ndarray), m.T, m.reshape(-1)):
        assert spill.spill_file_of(view) is record
    assert spill.spill_file_of(np.frombuffer(m, dtype=np.uint8)) is record
    assert spill.spill_file_of(memoryview(m)) is record  # type: ignore[arg-type]
    assert spill.spill_file_of(np.zeros(3)) is None
    assert spill.spill_file_of(m + 1) is None  # a new array in RAM
    foreign = np.memmap(tmp_path / "other.bin", dtype="f8", mode="w+", shape=(10,))
    assert spill.spill_file_of(foreign) is None
    assert spill.spill_file_of("not an array") is None


def test_last_view_collected_deletes_the_file() -> None:
    m = spill.map_array((1000,), np.dtype("float64"))
    path = spill.spill_file_of(m).path  # type: ignore[union-attr]
    view = np.asarray(m[10:20])
    del m
    gc.collect()
    assert os.path.exists(path), "a live view must keep the file"
    view[:] = 5  # still a valid mapping
    del view
    gc.collect()
    assert not os.path.exists(path)
    assert path not in [f.path for f in spill.live_files()]


# -- freeing now ------------------------------------------------------------------------


def test_discard_deletes_now_and_leaves_views_harmless() -> None:
    m = spill.map_array((512, 512), np.dtype("float64"))
    m[:] = 3.0
    view = m[100:]
    record = spill.spill_file_of(m)
    assert record is not None
    spill.discard(record)
    assert record.deleted
    assert not os.path.exists(record.path)
    # No descriptor or mapping of the file is left in this process: its disk space is free.
    assert _open_descriptors_of(record.path) == []
    with open("/proc/self/maps") as maps:
        assert record.path not in maps.read()
    assert spill.spill_file_of(view) is None
    # Using a freed array is a caller bug, but it must not crash the process.
    assert float(view.sum()) == 0.0
    view[:] = 1.0
    m.flush()
    spill.discard(record)  # twice: nothing happens
    del m, view
    gc.collect()


# -- errors -----------------------------------------------------------------------------


def test_filesystem_that_cannot_reserve_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    with pytest.raises(
        SpillError, match=r"cannot reserve space.*SIGBUS.*TIERFLOW_SPILL_DIR"
    ) as info:
        spill.map_array((1000,), np.dtype("float64"))
    assert info.value.errno == errno.EOPNOTSUPP
    assert isinstance(info.value, OSError) and isinstance(info.value, TierflowError)
    assert _files_in(spill.process_dir()) == []


def test_enospc_at_reservation_names_folder_sizes_and_remedy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "posix_fallocate", full)
    folder = spill.process_dir()
    with pytest.raises(SpillError) as info:
        spill.create(5 * MB)
    message = str(info.value)
    assert info.value.errno == errno.EDQUOT
    assert folder in message
    assert "5.000 MB (5242880 bytes)" in message
    assert "free there" in message
    assert "TIERFLOW_SPILL_DIR" in message and "RAM budget" in message
    assert _files_in(folder) == []


def test_more_than_the_free_space_is_refused_before_creating_a_file() -> None:
    with pytest.raises(
        SpillError, match=r"no room for a spill file of .*bytes\) free there"
    ) as info:
        spill.create(1 << 60)
    assert info.value.errno == errno.ENOSPC
    assert _files_in(spill.process_dir()) == []


def test_failed_mapping_unlinks_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(np, "memmap", broken)
    with pytest.raises(SpillError, match="could not map the spill file"):
        spill.map_array((1000,), np.dtype("float64"))
    assert _files_in(spill.process_dir()) == []


def test_full_tmpfs_raises_spill_error_and_leaves_nothing(
    small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = spill.map_array((4 * MB,), np.dtype("uint8"))
    a[:] = 1
    folder = spill.process_dir()
    assert folder.startswith(str(small_tmpfs))
    # First the free-space check, then (with it blinded) the kernel's own ENOSPC.
    with pytest.raises(SpillError, match="no room for a spill file") as info:
        spill.map_array((6 * MB,), np.dtype("uint8"))
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(spill, "free_bytes", lambda folder: 1 << 40)
    with pytest.raises(SpillError, match="no room for a spill file") as info:
        spill.map_array((6 * MB,), np.dtype("uint8"))
    assert info.value.errno == errno.ENOSPC
    assert len(_files_in(folder)) == 1  # only a's file
    assert int(a[-1]) == 1  # the process and its data are fine
    del a
    gc.collect()
    assert _files_in(folder) == []


def test_spill_folder_under_a_regular_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config.set(spill_dir=str(blocker / "spill"))
    with pytest.raises(SpillError, match=r"cannot create spill files in .*file/spill.*writable"):
        spill.create(4096)


def test_read_only_spill_folder_is_refused(tmp_path: Path) -> None:
    where = tmp_path / "ro"
    if os.geteuid() != 0 or not _mounted("tmpfs", where, "ro,size=1m"):
        pytest.skip("needs root and permission to mount a read-only tmpfs")
    try:
        config.set(spill_dir=str(where))
        with pytest.raises(SpillError, match=r"cannot create spill files.*Read-only") as info:
            spill.create(4096)
        assert info.value.errno == errno.EROFS
    finally:
        _umount(where)


# -- folders of other processes -------------------------------------------------------


def test_clean_stale_removes_dead_and_reused_pids_only(tmp_path: Path) -> None:
    root = tmp_path / "spill"
    root.mkdir()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    me = os.getpid()
    my_start = processes.start_time(me)
    assert my_start is not None
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sleeper_start = processes.start_time(sleeper.pid)
        assert sleeper_start is not None
        dead = root / f"{pid_max + 1}-12345"
        reused = root / f"{me}-{int(my_start) + 1}"
        live = root / f"{sleeper.pid}-{sleeper_start}"
        mine = root / f"{me}-{my_start}"
        other = root / "notes"
        for folder in (dead, reused, live, mine, other):
            folder.mkdir()
            (folder / "tmpx.bin").write_bytes(b"0" * 10)
        (root / "123-456").write_text("a file, not a folder")
        removed = spill.clean_stale(str(root))
        assert sorted(removed) == sorted([str(dead), str(reused)])
        assert not dead.exists() and not reused.exists()
        for kept in (live, mine, other):
            assert (kept / "tmpx.bin").exists(), kept
        assert (root / "123-456").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_first_use_in_a_process_cleans_stale_folders(tmp_path: Path) -> None:
    root = tmp_path / "fresh-root"
    root.mkdir()
    stale = root / f"{int(Path('/proc/sys/kernel/pid_max').read_text()) + 7}-1"
    stale.mkdir()
    (stale / "tmpold.bin").write_bytes(b"1")
    config.set(spill_dir=str(root))
    spill.process_dir()
    assert not stale.exists()


# -- exit -------------------------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )


def test_files_and_folder_are_removed_at_exit() -> None:
    result = _run(
        """
        import numpy as np, os
        from tierflow.storage import spill
        kept = spill.map_array((1000,), np.dtype("float64"))  # alive until exit
        kept[:] = 1
        record = spill.create(4096)  # never mapped
        print(spill.spill_file_of(kept).path)
        print(record.path)
        """
    )
    assert result.returncode == 0, result.stderr
    paths = result.stdout.split()
    assert len(paths) == 2
    for path in paths:
        assert not os.path.exists(path)
    assert not os.path.exists(os.path.dirname(paths[0]))


def test_a_forked_child_never_deletes_its_parents_files() -> None:
    result = _run(
        """
        import atexit, gc, os, numpy as np
        from tierflow.storage import spill
        a = spill.map_array((1000,), np.dtype("float64"))
        path = spill.spill_file_of(a).path
        pid = os.fork()
        if pid == 0:
            del a
            gc.collect()
            atexit._run_exitfuncs()
            os._exit(0)
        os.waitpid(pid, 0)
        print(os.path.exists(path))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


# -- write_array: written once, then read under a lease -----------------------------------


def test_write_array_gives_a_read_only_leased_copy_deleted_with_it() -> None:
    value = np.arange(100_000, dtype=np.float64).reshape(-1, 4)
    x = spill.write_array(value)
    record = spill.spill_file_of(x)
    assert record is not None and os.path.exists(record.path)
    np.testing.assert_array_equal(x, value)
    assert not x.flags.writeable
    assert leases.held_by(x) is True
    with pytest.raises(BlockingIOError):  # a truncate or writer would have to wait
        os.close(os.open(record.path, os.O_WRONLY | os.O_NONBLOCK))
    del x
    gc.collect()
    assert record.deleted and not os.path.exists(record.path)


def test_discarding_a_written_array_lets_go_of_its_lease_and_its_file() -> None:
    x = spill.write_array(np.ones((1000, 8)))
    record = spill.spill_file_of(x)
    assert record is not None
    spill.discard(record)
    assert leases.lease_of(x) is None
    assert not os.path.exists(record.path)
    assert _open_descriptors_of(record.path) == []  # the disk space is back now


def test_a_spill_file_shrunk_before_it_is_mapped_is_a_spill_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    acquire = leases.acquire

    def truncated_first(fd: int) -> int | None:
        os.truncate(f"/proc/self/fd/{fd}", 100)  # another process, in the instant before
        return acquire(fd)

    monkeypatch.setattr(leases, "acquire", truncated_first)
    before = spill.live_files()
    with pytest.raises(SpillError, match=r"tmp\w+\.bin shrank from 80000 to 100 bytes"):
        spill.write_array(np.ones((1000, 10)))
    assert spill.live_files() == before
