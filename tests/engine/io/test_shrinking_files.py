"""A file that shrinks or is replaced under a running compute: an error or the old
contents, never SIGBUS (see tierflow.storage.leases)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.errors import SourceError
from tierflow.storage import filemaps, leases

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT = 120  # seconds the child may take

# The child computes over a 16 MB file in 16 blocks. The map_blocks function starts a
# process that truncates the file while it holds block 3, and waits until the lease
# break shows (the truncate is then waiting for tierflow's views to go); later calls
# wait for that too, and a call given a block read by copy (after the break) then
# waits for the truncate to finish (one given a mapped block must not: it holds the
# truncate). The next block read sees the new size.
CHILD = r"""
import os, subprocess, sys, threading, time
import numpy as np
import tierflow as tw
from tierflow.errors import SourceError

path, executor = sys.argv[1], sys.argv[2]
rows = 16 * (1 << 20) // 32
np.lib.format.open_memmap(path, "w+", np.float32, (rows, 8))[:] = 1.0
x = tw.from_npy(path, rows=rows // 16)
source = x._node.reader.source
lock = threading.Lock()
calls = []
truncater = []
broken = threading.Event()

def until(condition, what):
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.001)

def fn(block):
    with lock:
        calls.append(1)
        k = len(calls)
    if k == 3:
        truncater.append(subprocess.Popen(
            [sys.executable, "-c", f"import os; os.truncate({path!r}, 4096)"]))
        until(lambda: not source.leased, "the lease break")
        broken.set()
    elif k > 3:
        broken.wait(30)
        if block.flags.owndata:  # read by copy, after the break (not a mapped view)
            truncater[0].wait(30)
    return block

y = np.sqrt(x.map_blocks(fn, dtype=np.float32, row_shape=(8,)) * 2 + 1).sum(axis=0)
try:
    y.compute(executor=executor)
except SourceError as exc:
    print(exc)
    sys.exit(3)
sys.exit("the compute finished over a truncated file")
"""


def _files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_source_truncated_mid_compute_is_a_source_error_not_sigbus(
    tmp_path: Path, executor: str
) -> None:
    path = tmp_path / "data" / "x.npy"
    path.parent.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), executor],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert run.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), run.stderr
    assert run.returncode == 3, run.stdout + run.stderr
    message = run.stdout
    assert str(path) in message
    assert str(16 * (1 << 20) + 128) in message  # the size it had (data + .npy header)
    assert "now has 4096" in message
    assert _files_under(Path(os.environ["TIERFLOW_SPILL_DIR"])) == []
    assert sorted(os.listdir(path.parent)) == ["x.npy"]  # no temporary file left behind


# The same with the cache: the second compute reads the cached blocks of ``emb`` from
# the store (views of leased mappings). While it holds block 3, a process truncates the
# entry files of blocks 12-15 (not read yet) and then of block 3. The last waits until
# block 3's views are gone; the others are damaged when read, and computed again.
CACHE_CHILD = r"""
import os, subprocess, sys, threading, time, warnings
import numpy as np
import tierflow as tw
from tierflow import memory
from tierflow.engine.io import cache
from tierflow.storage import leases
from tierflow.storage.store.keys import encode_key, name_of

folder, executor = sys.argv[1], sys.argv[2]
rows, per = 1 << 19, 1 << 15  # 16 blocks of 1 MB
path = os.path.join(folder, "x.npy")
np.save(path, np.repeat(np.arange(rows, dtype=np.float32)[:, None], 8, axis=1))
store = memory.store(os.path.join(folder, "store"), ram_mb=0)
emb = tw.from_npy(path, rows=per).map_blocks(np.negative).cache(store)
expected = emb.sum(axis=0, dtype=np.float64).compute()

def entry(j):
    key = cache._entry_key("block", emb.key, (j * per, (j + 1) * per))
    return store._file(name_of(encode_key(key)))

entries = {j: entry(j) for j in range(16)}
assert all(os.path.exists(p) for p in entries.values()), entries
truncater = []
broken = threading.Event()

def until(condition, what):
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.001)

def fn(block):
    j = int(-block[0, 0]) // per
    if j == 3:
        assert leases.held_by(block), "block 3 is not a view of a leased cache entry"
        paths = [entries[k] for k in (12, 13, 14, 15, 3)]
        truncater.append(subprocess.Popen([sys.executable, "-c",
            f"import os\nfor p in {paths!r}: os.truncate(p, 4096)"]))
        until(lambda: not leases.held_by(block), "the lease break")
        broken.set()
    elif j > 3:
        broken.wait(30)
    return block

y = emb.map_blocks(fn, dtype=np.float32, row_shape=(8,)).sum(axis=0, dtype=np.float64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = y.compute(executor=executor)
np.testing.assert_array_equal(got, expected)
assert truncater[0].wait(30) == 0
dropped = [str(w.message) for w in caught if "dropped the entry" in str(w.message)]
assert len(dropped) == 4, dropped
assert os.path.getsize(entries[3]) == 4096  # read while it waited, then truncated
np.testing.assert_array_equal(emb.sum(axis=0, dtype=np.float64).compute(), expected)
print("computed again:", len(dropped))
"""


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_cache_entries_truncated_mid_compute_are_waited_for_or_computed_again(
    tmp_path: Path, executor: str
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", CACHE_CHILD, str(tmp_path), executor],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert run.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), run.stderr
    assert run.returncode == 0, run.stdout + run.stderr
    assert "computed again: 4" in run.stdout
    assert _files_under(Path(os.environ["TIERFLOW_SPILL_DIR"])) == []


# Spilled held blocks: under critical pressure a masked compute moves the blocks it
# holds (until it can assemble them) to spill files. On a late block, one process per
# spill file truncates it; the truncates wait until the blocks have been assembled and
# their files discarded, and the result is right.
SPILL_CHILD = r"""
import os, subprocess, sys, time
import numpy as np
import tierflow as tw
from tierflow.storage import leases, spill
from tierflow.system import pressure
from tierflow.system.types import Level

executor = sys.argv[1]
tw.memory.budget("64MB")
levels = iter([Level.OK])
pressure.level_now = lambda: next(levels, Level.CRITICAL)
a = np.random.default_rng(0).normal(size=(40_000, 4))
x = tw.from_array(a, rows=4000)
truncaters = []

def until(condition, what):
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.001)

def fn(block):
    if block[0, 1] == a[36_000, 1] and not truncaters:  # the last block
        spilled = [(ref(), record) for ref, record in list(spill._maps.values())]
        held = [(m, r) for m, r in spilled if m is not None and leases.held_by(m)]
        assert held, "no leased spill file"
        for _, record in held:
            truncaters.append(subprocess.Popen(
                [sys.executable, "-c", f"import os; os.truncate({record.path!r}, 0)"]))
        until(lambda: not any(leases.held_by(m) for m, _ in held), "the lease breaks")
    return block

masked = x.map_blocks(fn, dtype=np.float64, row_shape=(4,))
masked = masked[masked[:, 0] > 0]  # unknown sizes: blocks are held until assembled
result = masked.compute(executor=executor)
np.testing.assert_array_equal(result, a[a[:, 0] > 0])
assert truncaters and all(t.wait(30) == 0 for t in truncaters)
print("spilled files truncated:", len(truncaters))
"""


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_spilled_blocks_truncated_mid_compute_are_waited_for(tmp_path: Path, executor: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", SPILL_CHILD, executor],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert run.returncode not in (-signal.SIGBUS, 128 + signal.SIGBUS), run.stderr
    assert run.returncode == 0, run.stdout + run.stderr
    assert "spilled files truncated" in run.stdout
    assert _files_under(Path(os.environ["TIERFLOW_SPILL_DIR"])) == []


# -- in this process: replaced by rename, and the copy path ---------------------------------


def _data(rows: int = 4096) -> np.ndarray:
    return np.arange(rows * 8, dtype=np.float32).reshape(rows, 8) / 3


class OnBlock:
    """A map_blocks function that runs ``action`` once, when it is given block ``k``."""

    def __init__(self, k: int, action: Any) -> None:
        self.k, self.action = k, action
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, block: np.ndarray) -> np.ndarray:
        with self.lock:
            self.calls += 1
            now = self.calls == self.k
        if now:
            self.action()
        return block


@pytest.fixture(params=["leased", "copied"])
def lease(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Blocks as views of a leased mapping, or (no lease to be had) read by copy."""
    if request.param == "copied":
        monkeypatch.setattr(leases, "acquire", lambda fd: None)
    return str(request.param)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_file_renamed_over_mid_compute_is_read_from_the_old_inode(
    tmp_path: Path, executor: str, lease: str
) -> None:
    data = _data()
    path = tmp_path / "x.npy"
    np.save(path, data)
    other = tmp_path / "other.npy"
    np.save(other, np.zeros_like(data))
    x = tw.from_npy(path, rows=256)
    fn = OnBlock(3, lambda: os.replace(other, path))
    y = x.map_blocks(fn, dtype=np.float32, row_shape=(8,)).sum(axis=0, dtype=np.float64)
    np.testing.assert_allclose(y.compute(executor=executor), data.sum(axis=0, dtype=np.float64))
    assert fn.calls == 16
    assert x._node.reader.source.leased is (lease == "leased")
    with pytest.raises(SourceError, match="replaced by another file"):
        x.sum().compute()  # the next compute sees the new file at the path, and refuses it


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_without_a_lease_a_truncated_source_is_a_source_error(
    tmp_path: Path, executor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leases, "acquire", lambda fd: None)
    path = tmp_path / "x.npy"
    np.save(path, _data())
    size = path.stat().st_size
    x = tw.from_npy(path, rows=256)
    fn = OnBlock(3, lambda: os.truncate(path, 1000))  # blocks are copies: nothing faults
    y = np.sqrt(x.map_blocks(fn, dtype=np.float32, row_shape=(8,))).sum(axis=0)
    with pytest.raises(SourceError, match=rf"x\.npy shrank .* had {size} bytes and now has 1000"):
        y.compute(executor=executor)


def test_without_a_lease_results_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _data()
    path = tmp_path / "x.npy"
    np.save(path, data)
    expected = np.sqrt(tw.from_npy(path, rows=300) * 2 + 1).sum(axis=0).compute()
    filemaps.forget_all()  # else the new source shares the mapping the first one kept
    monkeypatch.setattr(leases, "acquire", lambda fd: None)
    x = tw.from_npy(path, rows=300)
    np.testing.assert_array_equal(np.sqrt(x * 2 + 1).sum(axis=0).compute(), expected)
    np.testing.assert_array_equal(x[1000:1010].compute(), data[1000:1010])
    assert not x._node.reader.source.leased
