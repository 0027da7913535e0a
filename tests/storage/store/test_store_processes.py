"""Stores used by several processes: writers killed mid-set, two writers at once."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from tierflow.config import GB
from tierflow.storage.store import Store
from tierflow.storage.store.keys import decode_key, name_of
from tierflow.storage.store.serial import read_meta
from tierflow.storage.store.signing import load_signer

WORKER_PATH = Path(__file__).with_name("store_worker.py")


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("store_worker", WORKER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()
# The largest value the worker writes (an array of 301,000 int64), with its trailer.
MAX_ENTRY = (1000 + 6 * 50_000) * 8 + 4096


def start_writer(path: Path, start: int, count: int, disk_bytes: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER_PATH), str(path), str(start), str(count), str(disk_bytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "error::UserWarning"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(
            f"writer did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}"
        )
    return proc


def verify(path: Path, disk_bytes: int) -> int:
    """Open the store and check every file and every readable value; the number read.

    Every file under data/ must be a complete, signed entry that the index knows (a
    torn or unindexed file would mean a write was not atomic); an index row may lack
    its file (a kill between commit and rename), which reads as a miss.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a damaged entry would warn: none may exist
        with Store(path, ram_mb=0, disk_gb=disk_bytes / GB) as st:
            keys = list(st)
            files = [p for p in (path / "data").rglob("*") if p.is_file()]
            for f in files:
                meta, _ = read_meta(f, load_signer())  # EntryDamaged if torn
                assert name_of(meta.key) == f.name
                assert decode_key(meta.key) in keys, f"{f} is not in the index"
            found = 0
            for key in keys:
                value = st.get(key)
                if value is not None:
                    worker.check(key, value)
                    found += 1
            use = st.usage()
            on_disk = sum(f.stat().st_size for f in files)
            assert use.ssd_bytes <= disk_bytes
            assert on_disk <= disk_bytes + MAX_ENTRY
            assert list((path / "tmp").iterdir()) == []
            return found


@pytest.mark.slow
def test_writers_killed_mid_set_never_leave_a_torn_value(tmp_path: Path) -> None:
    path = tmp_path / "s"
    disk_bytes = 12_000_000  # small enough that the writer also evicts while it is killed
    rng = random.Random(1234)
    total_found = 0
    for round_ in range(8):
        proc = start_writer(path, round_ * 1_000_000, 10**9, disk_bytes)
        time.sleep(rng.uniform(0.02, 0.4))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)  # also closes its pipes
        assert proc.returncode == -signal.SIGKILL, err
        total_found += verify(path, disk_bytes)
    assert total_found > 0


def test_two_writers_share_one_store_within_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "s"
    disk_bytes = 6_000_000
    Store(path).close()
    procs = [start_writer(path, n * 1_000_000, 120, disk_bytes) for n in range(2)]
    peak = 0
    while any(p.poll() is None for p in procs):
        files = [p for p in (path / "data").rglob("*") if p.is_file()]
        size = 0
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                size += f.stat().st_size
        peak = max(peak, size)
        time.sleep(0.005)
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out.strip() == "done"
    assert peak <= disk_bytes + MAX_ENTRY
    assert verify(path, disk_bytes) > 0
    with Store(path, disk_gb=disk_bytes / GB) as st:
        on_disk = sum(p.stat().st_size for p in (path / "data").rglob("*") if p.is_file())
        assert st.usage().ssd_bytes == on_disk  # no crash: the index matches the files exactly
