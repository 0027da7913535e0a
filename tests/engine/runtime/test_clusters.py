"""Cluster executors under faults: killed workers, memory deaths, stragglers, hidden
sources, Ctrl-C, the cache and callbacks, on real Dask and Ray clusters.

Tests that kill Dask workers run on a cluster of their own (the session's serves the
others); a Ray worker process that is killed is replaced by Ray, so Ray's tests share
the session's runtime. What happens in a worker is observed through files it writes;
a function that must be stopped in the middle waits for a file the test writes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.runtime.executors import ClusterExecutor, DaskExecutor, RayExecutor, cluster
from tierflow.system import processes

from common import IdleCluster, count_in, counting_into, wait_for

WAIT = 60.0  # seconds a test waits for an event before it fails

# Ray's workers do not have the tests on their path: this module's functions travel by
# value, not by reference.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _wait_for(check: Callable[[], Any], what: str, timeout: float = WAIT) -> None:
    wait_for(check, timeout, what)


def _cluster(**options: Any) -> tuple[Any, Any]:
    from distributed import Client, LocalCluster

    settings: dict[str, Any] = {
        "n_workers": 2,
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
        "silence_logs": logging.CRITICAL,
    }
    cluster = LocalCluster(**{**settings, **options})
    # Not the default client: executor="dask" keeps meaning the session's.
    return cluster, Client(cluster, set_as_default=False)


@pytest.fixture(scope="module")
def own_dask() -> Iterator[Any]:
    """A Dask cluster of its own (2 workers x 1 thread) for tests that kill workers."""
    cluster, client = _cluster()
    try:
        yield client
    finally:
        client.close()
        cluster.close()


_MADE: list[ClusterExecutor] = []


def _made(executor: ClusterExecutor) -> Any:
    """``executor``, closed when the test ends (its straggler watch stops)."""
    _MADE.append(executor)
    return executor


@pytest.fixture(autouse=True)
def _close_executors() -> Iterator[None]:
    yield
    while _MADE:
        _MADE.pop().close()


def _engine(name: str, own_dask: Any = None) -> ClusterExecutor:
    return _made(DaskExecutor(own_dask) if name == "dask" else RayExecutor())


def _source(tmp_path: Path, rows: int = 1000, cols: int = 3) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(7).random((rows, cols))
    path = tmp_path / "src.npy"
    np.save(path, data)
    return path, data


def _pipeline(path: Path, fn: Callable[[np.ndarray], np.ndarray], rows: int = 50) -> tw.Array:
    x = tw.from_npy(path, rows=rows)
    return np.sqrt(x.map_blocks(fn, dtype=np.float64, row_shape=(x.shape[1],)) * 2 + 1)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- a worker killed in the middle of a compute ----------------------------------------


def _stalls_once(folder: str, first: float) -> Callable[[np.ndarray], np.ndarray]:
    """A function that, on the block starting with ``first`` and until ``killed`` is
    in ``folder``, writes its pid to ``victim`` and waits there to be killed."""

    def work(block: np.ndarray) -> np.ndarray:
        killed = os.path.join(folder, "killed")
        if block[0, 0] == first and _first_time(os.path.join(folder, "claimed")):
            Path(folder, "victim").write_text(str(os.getpid()))
            for _ in range(int(WAIT / 0.02)):
                if os.path.exists(killed):
                    break
                threading.Event().wait(0.02)
        return block * 3 + 1

    return work


def _first_time(marker: str) -> bool:
    """True for the first process to call this with ``marker`` (it creates the file)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _kill_victim(folder: Path) -> threading.Thread:
    """Start a thread that SIGKILLs the process that writes ``victim`` in ``folder``."""

    def kill() -> None:
        victim = folder / "victim"
        _wait_for(lambda: victim.exists() and victim.read_text(), "a victim")
        pid = int(victim.read_text())
        os.kill(pid, signal.SIGKILL)
        (folder / "killed").touch()  # after the kill: the victim must not see it and go on

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.executors("dask", "ray")
def test_a_worker_killed_mid_compute_has_its_tasks_sent_again(
    executor_name: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No backup copies here: the victim's block stalls until it is killed, and a backup
    # that won first (a straggler, on a loaded machine) would leave nothing to send again.
    monkeypatch.setattr(cluster, "STRAGGLER_MIN_SECONDS", 10 * WAIT)
    client = request.getfixturevalue("own_dask") if executor_name == "dask" else None
    executor = _engine(executor_name, client)
    path, data = _source(tmp_path)
    first = float(data[300, 0])
    expected = _pipeline(path, _stalls_once(str(tmp_path / "no-kill"), np.nan)).compute(
        executor="threads"
    )
    for run in ("compute", "to_npy"):
        folder = tmp_path / run
        folder.mkdir()
        killer = _kill_victim(folder)
        before = executor.resent
        y = _pipeline(path, _stalls_once(str(folder), first))
        if run == "compute":
            out = y.compute(executor=executor)
        else:
            y.to_npy(folder / "out.npy", executor=executor)
            out = np.load(folder / "out.npy")
        killer.join()
        victim = int((folder / "victim").read_text())
        # Killed: a zombie until its parent (Ray's raylet, Dask's nanny) reaps it, and
        # a zombie runs nothing, though its pid still answers a signal 0.
        _wait_for(lambda victim=victim: not _alive(victim), f"worker {victim} to end")
        assert executor.resent > before, run
        assert _same_bytes(out, expected)
    assert (tmp_path / "to_npy" / "out.npy").read_bytes() == _npy_bytes(expected, tmp_path)


def _npy_bytes(array: np.ndarray, tmp_path: Path) -> bytes:
    np.save(tmp_path / "expected.npy", array)
    return (tmp_path / "expected.npy").read_bytes()


# -- deaths of memory, MemoryError in a worker -----------------------------------------


@pytest.fixture(scope="module")
def small_dask() -> Iterator[Any]:
    """A Dask cluster of one worker with a 300 MB memory limit (its nanny restarts it
    above 95 % of that)."""
    cluster, client = _cluster(n_workers=1, memory_limit="300MB")
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def _grows_above(rows: int) -> Callable[[np.ndarray], np.ndarray]:
    """A function that, called on more than ``rows`` rows, takes memory 16 MB at a
    time until its worker is killed for it."""

    def work(block: np.ndarray) -> np.ndarray:
        if len(block) > rows:
            held = []
            for _ in range(int(WAIT / 0.05)):
                held.append(np.ones(16 << 17))  # 16 MB, written
                threading.Event().wait(0.05)
        return block * 3 + 1

    return work


def _kind(executor: ClusterExecutor) -> Any:
    (kind,) = [k for k in executor._kinds.values() if k.cap is not None]
    return kind


@pytest.mark.executors("dask")
def test_a_dask_worker_killed_for_memory_has_its_tasks_sent_on_halved_blocks(
    small_dask: Any, tmp_path: Path
) -> None:
    executor = _made(DaskExecutor(small_dask))
    path, _ = _source(tmp_path, rows=640)
    expected = _pipeline(path, lambda b: b * 3 + 1, rows=64).compute(executor="threads")
    out = _pipeline(path, _grows_above(40), rows=64).compute(executor=executor)
    assert _same_bytes(out, expected)
    assert executor.resent >= 1
    assert _kind(executor).cap == 32  # halved once: the size that worked, for every task


def _ray_oom_above(rows: int) -> Callable[..., Any]:
    """Ray's block task, ended as Ray ends a task it killed for memory
    (``OutOfMemoryError``) while its operators would run on more than ``rows`` rows.
    (Ray's own killer acts only when the whole node nears its memory threshold.)"""

    def task(desc: Any, data: bytes, settings: Any, cap: Any, shared: Any) -> Any:
        import ray

        from tierflow.engine.runtime.executors.ray import _ray_block

        if cap is None or cap > rows:
            raise ray.exceptions.OutOfMemoryError(f"task killed on {cap or 'all'} rows")
        return _ray_block(desc, data, settings, cap, shared)

    return task


@pytest.mark.executors("ray")
def test_a_ray_task_killed_for_memory_is_sent_on_halved_blocks(
    ray_runtime: Any, tmp_path: Path
) -> None:
    executor = _made(RayExecutor())
    executor._task = ray_runtime.remote(num_cpus=1, max_retries=0, retry_exceptions=False)(
        _ray_oom_above(40)
    )
    path, _ = _source(tmp_path, rows=640)
    expected = _pipeline(path, lambda b: b * 3 + 1, rows=64).compute(executor="threads")
    out = _pipeline(path, lambda b: b * 3 + 1, rows=64).compute(executor=executor)
    assert _same_bytes(out, expected)
    assert executor.resent >= 1
    assert _kind(executor).cap == 32


def _memory_error_above(rows: int, log: str) -> Callable[[np.ndarray], np.ndarray]:
    """A function that raises MemoryError on more than ``rows`` rows; the sizes it is
    called on are appended to ``log``."""

    def work(block: np.ndarray) -> np.ndarray:
        with open(log, "a") as f:
            f.write(f"{len(block)}\n")
        if len(block) > rows:
            raise MemoryError(f"{len(block)} rows do not fit")
        return block * 3 + 1

    return work


@pytest.mark.executors("dask", "ray")
def test_a_memory_error_in_a_worker_is_halved_there(executor_name: str, tmp_path: Path) -> None:
    executor = _engine(executor_name) if executor_name == "ray" else None
    path, _ = _source(tmp_path, rows=640)
    expected = _pipeline(path, lambda b: b * 3 + 1, rows=64).compute(executor="threads")
    log = tmp_path / "sizes"
    y = _pipeline(path, _memory_error_above(20, str(log)), rows=64)
    out = y.compute(executor=executor or executor_name)
    assert _same_bytes(out, expected)
    sizes = {int(n) for n in log.read_text().split()}
    assert 64 in sizes and 16 in sizes and max(sizes - {64, 32}) == 16


# -- stragglers ------------------------------------------------------------------------


def _session_engine(name: str, request: pytest.FixtureRequest) -> ClusterExecutor:
    if name == "dask":
        return _made(DaskExecutor(request.getfixturevalue("dask_client")))
    return _made(RayExecutor())


def _slow_once(folder: str, first: float) -> Callable[[np.ndarray], np.ndarray]:
    """A function whose first run on the block starting with ``first`` holds until
    ``release`` is in ``folder`` (its copies run at once); each run on that block is
    a line in ``runs``."""

    def work(block: np.ndarray) -> np.ndarray:
        if block[0, 0] == first:
            with open(os.path.join(folder, "runs"), "a") as f:
                f.write(f"{os.getpid()}\n")
            if _first_time(os.path.join(folder, "claimed")):
                release = os.path.join(folder, "release")
                for _ in range(int(WAIT / 0.02)):
                    if os.path.exists(release):
                        break
                    threading.Event().wait(0.02)
                else:
                    Path(folder, "timed-out").touch()
        return block * 3 + 1

    return work


@pytest.mark.executors("dask", "ray")
def test_a_straggler_gets_a_backup_copy_and_the_first_result_wins(
    executor_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    executor = _session_engine(executor_name, request)
    path, data = _source(tmp_path, rows=200)
    expected = _pipeline(path, lambda b: b * 3 + 1, rows=10).compute(executor="threads")
    before = executor.backups
    try:
        out = _pipeline(path, _slow_once(str(tmp_path), float(data[150, 0])), rows=10).compute(
            executor=executor
        )
        # The first copy still holds (nothing released it): its backup's result won.
        assert not (tmp_path / "timed-out").exists()
    finally:
        (tmp_path / "release").touch()
    assert _same_bytes(out, expected)
    assert executor.backups > before
    assert len((tmp_path / "runs").read_text().split()) >= 2


def _stragglers(done: list[float], count: int, running: dict[int, float | None]) -> list[int]:
    """The blocks :meth:`ClusterExecutor.stragglers` picks at time 100 s: ``done`` the
    workers' times of the finished tasks of a pass of ``count``, ``running`` how long
    each block not done has run (None: it waits in the engine's queue)."""
    from tierflow.engine.program.tasks import BlockTask
    from tierflow.engine.runtime.executors.cluster import _Kind, _Pending
    from tierflow.engine.types import RowRange

    executor = IdleCluster(2)
    executor._kinds["p"] = _Kind(count, seconds=list(done), probed=True)
    for index, ran in running.items():
        started = 0.0 if ran is None else 100.0 - ran
        pending = _Pending(BlockTask("p", index, RowRange(index, index + 1)), 0, print)
        pending.handles, pending.started = [object()], started
        executor._pending[id(pending)] = pending
    return sorted(p.desc.index for p in executor.stragglers(100.0))


@pytest.mark.executors("threads")
def test_the_straggler_rules() -> None:
    from tierflow.engine.runtime.executors.cluster import (
        STRAGGLER_FACTOR,
        STRAGGLER_MIN_SECONDS,
        STRAGGLER_MIN_TASKS,
    )

    assert (STRAGGLER_MIN_TASKS, STRAGGLER_FACTOR, STRAGGLER_MIN_SECONDS) == (10, 3.0, 1.0)
    ten = [1.0] * 9 + [2.0]  # median 1 s
    assert _stragglers(ten, 20, {10: 3.5, 11: 2.9, 12: None}) == [10]
    assert _stragglers(ten[:9], 18, {10: 30.0}) == []  # fewer than 10 tasks done
    assert _stragglers(ten, 21, {10: 30.0}) == []  # fewer than half of the pass done
    assert _stragglers([0.1] * 10, 20, {10: 0.9, 11: 1.1}) == [11]  # at least a second
    assert _stragglers(ten, 20, {10: None}) == []  # queued, not running


@pytest.mark.executors("threads")
def test_a_straggler_gets_one_backup_copy() -> None:
    from tierflow.engine.program.tasks import BlockTask
    from tierflow.engine.runtime.executors.cluster import _Kind, _Pending
    from tierflow.engine.types import RowRange

    executor = IdleCluster(2)
    executor._kinds["p"] = _Kind(20, seconds=[1.0] * 10, probed=True)
    pending = _Pending(BlockTask("p", 10, RowRange(10, 11)), 0, print)
    pending.handles, pending.started = [object()], 50.0
    executor._pending[id(pending)] = pending
    assert executor.stragglers(100.0) == [pending]
    pending.backed_up = True
    assert executor.stragglers(100.0) == []


# -- Ctrl-C ----------------------------------------------------------------------------


def _held_until_released(folder: str) -> Callable[[np.ndarray], np.ndarray]:
    """A function that notes its pid in ``started/`` and holds until ``release`` is in
    ``folder``."""

    def work(block: np.ndarray) -> np.ndarray:
        Path(folder, "started", str(os.getpid())).touch()
        release = os.path.join(folder, "release")
        for _ in range(int(WAIT / 0.02)):
            if os.path.exists(release):
                break
            threading.Event().wait(0.02)
        return block * 3 + 1

    return work


def _interrupt_once_started(started: Path) -> threading.Thread:
    def interrupt() -> None:
        _wait_for(lambda: any(started.iterdir()), "a task to start")
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in a terminal

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    return thread


def _block_tasks_on_scheduler(dask_scheduler: Any) -> list[str]:
    return [str(k) for k in dask_scheduler.tasks if "tierflow-block" in str(k)]


def _files_left(*folders: Path) -> list[str]:
    return sorted(str(p) for f in folders if f.exists() for p in f.rglob("*") if p.is_file())


@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.executors("dask", "ray")
def test_ctrl_c_cancels_the_cluster_tasks_and_leaves_no_file(
    executor_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    executor = _session_engine(executor_name, request)
    rows = 2000  # blocks of 2000 x 8 float64 (128 KB) come back through the shared folder
    path, _ = _source(tmp_path, rows=20 * rows, cols=8)
    spill = Path(os.environ["TIERFLOW_SPILL_DIR"])
    for run in ("compute", "to_npy"):
        folder = tmp_path / run
        (folder / "started").mkdir(parents=True)
        (folder / "out").mkdir()
        y = _pipeline(path, _held_until_released(str(folder)), rows=rows)
        interrupter = _interrupt_once_started(folder / "started")
        earlier: set[str] = set()  # block tasks other tests left on the session cluster
        if executor_name == "dask":
            earlier = set(
                request.getfixturevalue("dask_client").run_on_scheduler(_block_tasks_on_scheduler)
            )
        try:
            with pytest.raises(KeyboardInterrupt):
                if run == "compute":
                    y.compute(executor=executor)
                else:
                    y.to_npy(folder / "out" / "y.npy", executor=executor)
            interrupter.join()
            busy = [int(p.name) for p in (folder / "started").iterdir()]
            if executor_name == "ray":  # ray.cancel(force=True) kills what runs them
                for pid in busy:
                    _wait_for(lambda pid=pid: not _alive(pid), f"worker {pid} to be killed")
            else:
                client = request.getfixturevalue("dask_client")
                _wait_for(
                    lambda client=client, earlier=earlier: (
                        set(client.run_on_scheduler(_block_tasks_on_scheduler)) <= earlier
                    ),
                    "the scheduler to forget this compute's block tasks",
                )
        finally:
            (folder / "release").touch()
        assert os.listdir(folder / "out") == []
    # Once the tasks that were running have ended, no block of theirs is left.
    x = tw.from_array(np.arange(40.0).reshape(20, 2), rows=5)
    for _ in range(3):  # enough tasks for every worker to have finished what it ran
        np.testing.assert_array_equal(
            x.map_blocks(lambda b: b * 2).compute(executor=executor), x.compute() * 2
        )
    _wait_for(
        lambda: [f for f in _files_left(spill) if ".tf-block-" in f] == [],
        "the blocks of the cancelled tasks to be removed",
    )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    return processes.start_time(pid) is not None


# -- the cache, progress and callbacks -------------------------------------------------


@pytest.mark.executors("dask", "ray")
def test_the_cache_in_a_shared_folder_is_read_and_written_by_every_worker(
    executor_name: str, tmp_path: Path
) -> None:
    data = np.arange(4000.0, dtype=np.float32).reshape(1000, 4)
    np.save(tmp_path / "src.npy", data)
    count = tmp_path / "count"
    count.mkdir()

    def y() -> tw.Array:
        x = tw.from_npy(tmp_path / "src.npy", rows=100)
        return x.map_blocks(counting_into(str(count)), dtype=np.float32, row_shape=(4,))

    store = tmp_path / "shared" / "store"
    np.testing.assert_array_equal(y().compute(cache=store), data * 2 + 1)
    assert count_in(count) == 10
    (first,) = tw.cache_info(store).values()
    assert (first.hits, first.misses, first.writes) == (0, 10, 10)
    total = y().sum(axis=0).compute(cache=store)  # blocks from the cache, in the workers
    np.testing.assert_allclose(total, (data * 2 + 1).sum(axis=0))
    assert count_in(count) == 10
    (second,) = tw.cache_info(store).values()
    assert (second.hits, second.bytes_read) == (10, data.nbytes)


class _Seen:
    """A callback that keeps every event it is given."""

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.tasks: list[Any] = []
        self.finished: list[Any] = []
        self.threads: set[int] = set()

    def start(self, event: Any) -> None:
        self.started.append(event)

    def task_done(self, event: Any) -> None:
        self.threads.add(threading.get_ident())
        self.tasks.append(event)

    def finish(self, event: Any) -> None:
        self.finished.append(event)


@pytest.mark.executors("dask", "ray")
def test_callbacks_and_progress_see_every_task_as_in_a_local_run(
    executor_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    x = tw.from_array(np.arange(300.0).reshape(100, 3), rows=10)
    y = (x.map_blocks(lambda b: b + 1) * 2).sum(axis=0)
    seen, local = _Seen(), _Seen()
    np.testing.assert_array_equal(
        y.compute(callbacks=[seen], progress=True), y.compute(executor="threads", callbacks=[local])
    )
    ((started,), (finished,)) = (seen.started, seen.finished)
    assert (started.executor, started.workers, started.tasks) == (executor_name, 2, len(seen.tasks))
    assert sorted(t.index for t in seen.tasks) == list(range(started.tasks))
    assert [t.done for t in seen.tasks] == list(range(1, started.tasks + 1))
    assert started.tasks == local.started[0].tasks
    assert seen.threads == {threading.get_ident()}  # called on the thread that computes
    assert (finished.done, finished.error) == (started.tasks, None)
    assert f"{started.tasks}/{started.tasks}" in capsys.readouterr().err


# -- a worker that cannot see a source -------------------------------------------------


@pytest.mark.executors("dask")
def test_a_compute_whose_source_a_worker_cannot_see_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    """One worker runs in a mount namespace of its own, where the folder that holds the
    source is covered by an empty tmpfs: the file exists for the driver and one worker,
    not for the other."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    path, data = _source(hidden, rows=100)
    cluster, client = _cluster(n_workers=1)
    root = str(Path(tw.__file__).resolve().parents[1])
    worker = (
        f"mount -t tmpfs tmpfs {hidden} && exec {sys.executable} -m "
        f"distributed.cli.dask_worker {cluster.scheduler_address} --nthreads 1 "
        "--no-nanny --no-dashboard --name blind"
    )
    blind = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", worker],
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client.wait_for_workers(2, timeout=WAIT)
        workers = client.scheduler_info(n_workers=-1)["workers"]
        (address,) = [a for a, w in workers.items() if w.get("name") == "blind"]
        executor = _made(DaskExecutor(client))
        y = tw.from_npy(path, rows=10) * 2
        with pytest.raises(tw.errors.SourceError) as info:
            y.compute(executor=executor)
        message = str(info.value)
        assert f"worker {address} cannot read 1 of the compute's 1 source files" in message
        assert f"{path} (FileNotFoundError" in message
        assert "put them on storage every node mounts at the same path" in message
        # What every worker sees computes there.
        seen = tmp_path / "seen.npy"
        np.save(seen, data)
        np.testing.assert_array_equal(
            (tw.from_npy(seen, rows=10) * 2).compute(executor=executor), data * 2
        )
    finally:
        blind.kill()  # its own namespace, and the tmpfs in it, go with it
        blind.wait(WAIT)
        client.close()
        cluster.close()


# -- a worker with 300 MB, a 1 GB file -------------------------------------------------


def _big_npy(path: Path, rows: int, cols: int = 8) -> None:
    """A float32 ``.npy`` of ``rows`` x ``cols``, written 1M rows at a time."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, cols))
    step = 1 << 20
    base = (np.arange(step * cols, dtype=np.float32) % 997).reshape(step, cols)
    for a in range(0, rows, step):
        out[a : a + step] = base[: min(step, rows - a)] + a // step
    out.flush()
    del out


@pytest.mark.executors("dask")
def test_a_300_mb_dask_worker_runs_a_pipeline_over_a_1_gb_file(
    small_dask: Any, tmp_path: Path
) -> None:
    path = tmp_path / "big.npy"
    _big_npy(path, 32 << 20)  # 32M x 8 float32: 1 GiB
    assert path.stat().st_size > 1 << 30
    limit = next(iter(small_dask.scheduler_info(n_workers=-1)["workers"].values()))
    assert limit["memory_limit"] == 300_000_000
    executor = _made(DaskExecutor(small_dask))
    pids = small_dask.run(os.getpid)
    x = tw.from_npy(path)
    total = np.sqrt(x * 2 + 1).sum(axis=0).compute(executor=executor)
    expected = np.sqrt(x * 2 + 1).sum(axis=0).compute(executor="threads")
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    (x * 2 + 1).to_npy(tmp_path / "out.npy", executor=executor)
    out = np.load(tmp_path / "out.npy", mmap_mode="r")
    source = np.load(path, mmap_mode="r")
    for a in range(0, len(out), 1 << 22):
        assert np.array_equal(out[a : a + (1 << 22)], source[a : a + (1 << 22)] * 2 + 1)
    assert small_dask.run(os.getpid) == pids  # no worker was restarted
    assert executor.resent == 0


# -- two Ray nodes, blocks through a shared folder -------------------------------------


@pytest.mark.executors("threads")
def test_two_ray_nodes_return_blocks_through_the_shared_folder(tmp_path: Path) -> None:
    import json

    script = Path(__file__).with_name("ray_two_nodes.py")
    root = str(Path(tw.__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": root, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["nodes"] == 2
    assert found["compute"] and found["sum"]
    nodes = {r.split()[0] for r in found["ran"]}
    spills = {r.split()[1] for r in found["ran"]}
    assert len(nodes) == 2  # both nodes ran blocks ...
    assert spills == {str(tmp_path / "spill-a"), str(tmp_path / "spill-b")}  # ... each with its own
    assert found["shared_left"] == []
    # every whole-array operation, on nodes with separate spill folders
    assert found["operations"] == dict.fromkeys(found["operations"], True)
    assert len(found["operations"]) == 14
    # a node joined and another left during a compute: the joined one ran blocks, the
    # removed one's were sent again, and the bytes are the same
    moved = found["membership"]
    assert moved["error"] is None and moved["bytes"] and moved["new_node_ran"]
    assert moved["resent"] >= 1
    assert moved["slots"] == 3  # the executor counted the new node's CPU ...
    assert moved["alive"] == 2  # ... and node b is gone


# -- short tasks travel in packs -------------------------------------------------------


@pytest.mark.executors("dask", "ray")
def test_short_tasks_travel_in_packs_and_a_killed_pack_is_sent_again(
    executor_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    client = request.getfixturevalue("own_dask") if executor_name == "dask" else None
    executor = _engine(executor_name, client)
    path, data = _source(tmp_path, rows=6000)
    expected = _pipeline(path, _stalls_once(str(tmp_path / "no-kill"), np.nan), rows=10)
    want = expected.compute(executor="threads")
    killer = _kill_victim(tmp_path)
    # 600 blocks of 10 rows: after the first tasks the workers timed, they go in packs.
    y = _pipeline(path, _stalls_once(str(tmp_path), float(data[4000, 0])), rows=10)
    out = y.compute(executor=executor)
    killer.join()
    assert executor.packed > 0
    assert executor.resent >= 1
    assert _same_bytes(out, want)
