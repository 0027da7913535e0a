"""Crash resume with the cache: a run killed with SIGKILL at a random point, run again,
computes only the missing blocks, writes the same bytes and leaves no temporary or
spill file; two processes on one cache at once; a cache on a full disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow import config
from tierflow.engine.io import cache as cache_module
from tierflow.engine.io.cache import CacheWarning
from tierflow.engine.io.destination import sweep_temps
from tierflow.system import processes

from common import wait_for

ROOT = Path(__file__).resolve().parents[3]
N = 24_000
WIDTH = 8
ROWS = 2_000  # 12 blocks of 64 KB
BLOCKS = N // ROWS
DELAY = 0.06  # seconds per block in the children: a run takes about 0.4 s on 2 cores

CHILD = textwrap.dedent(
    """
    import dataclasses, json, os, sys, time
    import numpy as np
    import tierflow as tw

    src, out, mode = sys.argv[1:4]

    def slow(b):
        time.sleep(0.06)
        result = np.sqrt(b * 2 + 1)
        with open(os.environ["PROGRESS_FILE"], "a") as f:
            f.write(f"{len(b)}\\n")
        return result

    y = tw.from_npy(src, rows=2000).map_blocks(slow, dtype=np.float32, row_shape=(8,))
    if mode == "npy":
        y.to_npy(out, cache=True, progress=False)
        spilled = False
    else:
        result = y.compute(cache=True, progress=False)
        spilled = tw.memory.on_disk(result)
        np.save(out, result)
    info = dataclasses.asdict(tw.cache_info()["cache"])
    info["spilled"] = bool(spilled)
    print(json.dumps(info))
    """
)


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return np.random.default_rng(11).random((N, WIDTH)).astype(np.float32)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, data: np.ndarray) -> Path:
    folder = tmp_path_factory.mktemp("resume")
    np.save(folder / "src.npy", data)
    (folder / "child.py").write_text(CHILD)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The output of a run nobody killed, with a cache of its own."""
    home = tmp_path_factory.mktemp("reference")
    out = home / "out.npy"
    child = start(workdir, out, "npy", home)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    return out.read_bytes()


def environment(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TIERFLOW_STORE_DIR=str(home / "store"),
        TIERFLOW_SPILL_DIR=str(home / "spill"),
        PROGRESS_FILE=str(home / "progress"),
        PYTHONPATH=str(ROOT),
    )
    env.pop("TIERFLOW_CACHE", None)
    return env


def start(
    workdir: Path, out: Path, mode: str, home: Path, budget: str | None = None
) -> subprocess.Popen[str]:
    env = environment(home)
    if budget is not None:
        env["TIERFLOW_RAM_BUDGET"] = budget
    return subprocess.Popen(
        [sys.executable, str(workdir / "child.py"), str(workdir / "src.npy"), str(out), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def progress(home: Path) -> int:
    try:
        return len((home / "progress").read_text().splitlines())
    except FileNotFoundError:
        return 0


def entry_files(home: Path) -> int:
    data = home / "store" / "cache" / "data"
    return sum(1 for p in data.rglob("*") if p.is_file()) if data.exists() else 0


def leftovers(home: Path) -> dict[str, list[str]]:
    """Temporary ``.npy`` files, store temporaries and spill folders left behind."""
    spill = home / "spill"
    tmp = home / "store" / "cache" / "tmp"
    return {
        "npy": sorted(p.name for p in home.iterdir() if p.name.endswith(".tmp")),
        "store": sorted(p.name for p in tmp.iterdir()) if tmp.exists() else [],
        "spill": sorted(p.name for p in spill.iterdir()) if spill.exists() else [],
    }


def kill_after(child: subprocess.Popen[str], home: Path, blocks: int, pause: float) -> None:
    def blocks_done() -> bool:
        assert child.poll() is None, child.communicate()[1]
        return progress(home) >= blocks

    wait_for(blocks_done, timeout=60, what=f"{blocks} blocks done by the child")
    time.sleep(pause)  # a random point of the run
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL


@dataclass(frozen=True)
class Kills:
    """How a run is killed: ``kills`` times, at points drawn from ``seed``."""

    seed: int
    mode: str  # "npy": to_npy; "compute": compute into a spill file
    kills: int


@pytest.mark.executors("threads")  # child processes, on their own executor
@pytest.mark.parametrize(
    "case",
    [Kills(1, "npy", 2), Kills(2, "compute", 1)],
    ids=["to_npy killed twice", "compute into a spill file"],
)
def test_a_killed_run_resumes_with_the_missing_blocks_only(
    case: Kills, workdir: Path, uninterrupted: bytes, tmp_path: Path
) -> None:
    rng = np.random.default_rng(case.seed)
    mode, kills = case.mode, case.kills
    home = tmp_path
    out = home / "out.npy"
    # A small budget puts compute's result in a spill file: the killed run leaves one.
    budget = "512KB" if mode == "compute" else None
    kept = 0
    for k in range(kills):  # killed at a random point, then killed again while resuming
        (home / "progress").write_text("")
        child = start(workdir, out, mode, home, budget)
        blocks = int(rng.integers(2, 6)) if k == 0 else int(rng.integers(1, 3))
        kill_after(child, home, blocks, float(rng.uniform(0, DELAY)))
        assert entry_files(home) > kept, "the killed run cached nothing"
        kept = entry_files(home)
    if mode == "compute":
        assert leftovers(home)["spill"], "the killed run's spill folder is there"

    (home / "progress").write_text("")
    again = start(workdir, out, mode, home, budget)
    stdout, stderr = again.communicate(timeout=120)
    assert again.returncode == 0, stderr
    info = json.loads(stdout.splitlines()[-1])
    computed = progress(home)
    # Every block is an entry now (a small budget cuts blocks into more, smaller ones).
    pieces = entry_files(home)
    assert pieces >= BLOCKS and kept < pieces
    assert info["hits"] + info["misses"] == pieces
    assert info["misses"] == computed, "a block was computed only if the cache lacked it"
    # A kill between an entry's index row and its rename leaves a row, not a file.
    assert kept - 1 <= info["hits"] <= kept
    assert out.read_bytes() == uninterrupted, "not the bytes of an uninterrupted run"
    np.testing.assert_array_equal(np.load(out), np.sqrt(np.load(workdir / "src.npy") * 2 + 1))
    assert leftovers(home) == {"npy": [], "store": [], "spill": []}
    if mode == "compute":
        assert info["spilled"], "the result did not go to a spill file; the test lost its point"


@pytest.mark.executors("threads")  # child processes, on their own executor
def test_two_processes_compute_one_cached_graph_at_once(
    workdir: Path, uninterrupted: bytes, tmp_path: Path
) -> None:
    home = tmp_path
    children = [start(workdir, home / f"out{k}.npy", "npy", home) for k in range(2)]
    infos = []
    for child in children:
        stdout, stderr = child.communicate(timeout=120)
        assert child.returncode == 0, stderr
        infos.append(json.loads(stdout.splitlines()[-1]))
    assert (home / "out0.npy").read_bytes() == uninterrupted
    assert (home / "out1.npy").read_bytes() == uninterrupted
    assert all(i["hits"] + i["misses"] == BLOCKS for i in infos)
    assert entry_files(home) == BLOCKS
    third = start(workdir, home / "out2.npy", "npy", home)
    stdout, stderr = third.communicate(timeout=120)
    assert third.returncode == 0, stderr
    info = json.loads(stdout.splitlines()[-1])
    assert (info["hits"], info["misses"]) == (BLOCKS, 0)
    assert (home / "out2.npy").read_bytes() == uninterrupted
    assert leftovers(home)["npy"] == [] and leftovers(home)["store"] == []


def test_temporary_files_of_writers_that_are_gone_are_swept(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    pid, start_time = (int(v) for v in processes.token().split("-"))
    names = {
        "dead": f".out.npy.tf{gone.pid}-12345-abcd1234.tmp",
        "reused pid": f".out.npy.tf{pid}-{start_time + 1}-abcd1234.tmp",
        "live": f".other.npy.tf{pid}-{start_time}-abcd1234.tmp",
        "not ours": ".out.npy.tmp",
        "user file": "out.npy.tf1-2-x.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    tw.from_array(np.arange(10.0)).to_npy(tmp_path / "out.npy")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([names["live"], names["not ours"], names["user file"], "out.npy"]), left
    assert sweep_temps(str(tmp_path)) == []


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KB tmpfs: a cache on it fills after a few blocks."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        cache_module.close_all()
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.executors("threads", "serial")  # counts calls or patches the store here
def test_a_cache_on_a_full_disk_warns_and_the_compute_completes(
    full_disk: Path, tmp_path: Path
) -> None:
    data = np.random.default_rng(5).random((40_000, 8))  # 2.4 MB in 20 blocks
    np.save(tmp_path / "src.npy", data)
    x: Any = tw.from_npy(tmp_path / "src.npy", rows=2_000)
    with pytest.warns(CacheWarning, match=r"disk is full.*completed without it"):
        result = np.sqrt(x * 2 + 1).compute(cache=full_disk / "cache")
    np.testing.assert_array_equal(result, np.sqrt(data * 2 + 1))
    info: Any = tw.cache_info(full_disk / "cache")["cache"]
    assert 0 < info.writes < 20 and info.failed_writes >= 1
    assert not list((full_disk / "cache" / "tmp").iterdir()), "a partial entry file is left"
    # The blocks that were written are read back by the next compute.
    with config.set(cache=str(full_disk / "cache")):
        again: Any = np.sqrt(tw.from_npy(tmp_path / "src.npy", rows=2_000) * 2 + 1)
        with pytest.warns(CacheWarning, match="disk is full"):
            np.testing.assert_array_equal(again.compute(), result)
    assert tw.cache_info(full_disk / "cache")["cache"].hits == info.writes
