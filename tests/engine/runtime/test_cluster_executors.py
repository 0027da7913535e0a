"""The cluster executors' own rules: placement, budgets, shipping, shared blocks.

On the session's real clusters (``dask_client``: a LocalCluster of 2 worker processes;
``ray_runtime``: a local Ray with 2 CPUs). What happens in a worker is observed through
what the workers return, never through this process's memory. Faults, stragglers and
memory limits are in ``test_clusters.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow import config
from tierflow.engine.program import halving, tasks
from tierflow.engine.runtime import executors
from tierflow.engine.runtime.executors import DaskExecutor, RayExecutor, cluster
from tierflow.engine.runtime.executors.cluster import RESOURCE
from tierflow.engine.types import RowRange
from tierflow.errors import ConfigError, DependencyError, install_command
from tierflow.storage import filemaps
from tierflow.system.limits import read_memory

from common import wait_for

pytestmark = pytest.mark.executors("threads")  # the executor is passed to each compute


@pytest.fixture
def dask_executor(dask_client: Any) -> DaskExecutor:
    return DaskExecutor(dask_client)


@pytest.fixture
def ray_executor(ray_runtime: Any) -> RayExecutor:
    return RayExecutor()


def _pid_rows(block: np.ndarray) -> np.ndarray:
    return np.full((len(block), 1), os.getpid(), np.int64)


def test_dask_workers_get_their_budget_as_a_resource_and_as_tierflow_budget(
    dask_client: Any, dask_executor: DaskExecutor
) -> None:
    info = dask_client.scheduler_info(n_workers=-1)["workers"]
    budgets = dask_client.run(lambda: config.get("ram_budget"))
    for address, worker in info.items():
        expected = dask_client.run(
            cluster.node_budget, worker["memory_limit"], 1, workers=[address]
        )[address]
        assert worker["resources"][RESOURCE] == expected == budgets[address]
        assert expected <= 0.7 * worker["memory_limit"] + 1
    spilling = dask_client.run(lambda dask_worker: dask_worker.memory_manager.memory_spill_fraction)
    assert set(spilling.values()) == {False}


def test_a_budget_in_the_workers_environment_lowers_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TIERFLOW_RAM_BUDGET", raising=False)
    derived = cluster.node_budget(8 * 2**30, 2)
    assert derived == int(min(8 * 2**30, read_memory().usable) * 0.7) // 2
    monkeypatch.setenv("TIERFLOW_RAM_BUDGET", "1GB")
    assert cluster.node_budget(8 * 2**30, 2) == 2**29  # the node's 1 GB, for 2 slots
    monkeypatch.setenv("TIERFLOW_RAM_BUDGET", "100TB")
    assert cluster.node_budget(8 * 2**30, 2) == derived  # never more than it holds
    monkeypatch.setenv("TIERFLOW_RAM_BUDGET", "lots")
    with pytest.raises(ConfigError, match="TIERFLOW_RAM_BUDGET"):
        cluster.node_budget(8 * 2**30, 2)


def test_dask_engine_tasks_are_spread_over_the_workers(
    dask_client: Any, dask_executor: DaskExecutor
) -> None:
    # Dask placed every pack of a compute on one of two workers when its estimates tied;
    # the executor names the worker with the fewest of its tasks in flight per thread.
    workers = set(dask_client.scheduler_info(n_workers=-1)["workers"])
    picks = [dask_executor._spread() for _ in range(4)]
    assert set(picks) == workers and sorted(picks.count(w) for w in workers) == [2, 2]
    dask_executor._placed.clear()
    pids = tw.from_array(np.zeros((400, 1)), rows=10).map_blocks(_pid_rows, dtype=np.int64)
    ran = np.unique(pids.compute(executor=dask_executor))
    assert len(ran) == 2  # both workers ran blocks
    assert set(dask_executor._placed.values()) <= {0}  # every placed task landed


def _set_status(name: str, dask_worker: Any = None) -> None:
    from distributed.core import Status

    dask_worker.status = Status[name]


def test_a_paused_dask_worker_is_named_and_gets_no_new_task(
    dask_client: Any, dask_executor: DaskExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    workers = sorted(dask_client.scheduler_info(n_workers=-1)["workers"])
    paused, running = workers
    dask_client.run(_set_status, "paused", workers=[paused])
    try:
        wait_for(
            lambda: (
                dask_client.scheduler_info(n_workers=-1)["workers"][paused]["status"] == "paused"
            ),
            10.0,
            "the scheduler sees the worker paused",
        )
        dask_executor._seen_at = 0.0
        with caplog.at_level("WARNING", logger="tierflow.engine"):
            dask_executor._observe()
            dask_executor._observe()  # once a pause
        said = [r.getMessage() for r in caplog.records if "Dask paused worker" in r.getMessage()]
        assert len(said) == 1 and paused in said[0] and "MB of its" in said[0]
        # one worker runs: placing is left to Dask, which sends nothing to a paused one
        assert list(dask_executor._threads) == [running] and dask_executor._spread() is None
        x = tw.from_array(np.arange(2000.0)[:, None], rows=100)
        np.testing.assert_array_equal((x * 2).compute(executor=dask_executor), x.compute() * 2)
    finally:
        dask_client.run(_set_status, "running", workers=[paused])
    wait_for(
        lambda: dask_client.scheduler_info(n_workers=-1)["workers"][paused]["status"] == "running",
        10.0,
        "the worker running again",
    )
    dask_executor._seen_at = 0.0
    dask_executor._observe()
    assert set(dask_executor._threads) == set(workers)


def test_dask_slots_are_the_workers_threads(dask_client: Any) -> None:
    assert DaskExecutor(dask_client).workers == 2
    assert DaskExecutor(dask_client, workers=1).workers == 1
    with pytest.raises(ValueError, match="at least 1"):
        DaskExecutor(dask_client, workers=0)


def test_ray_slots_are_the_cluster_cpus(ray_executor: RayExecutor) -> None:
    assert ray_executor.workers == 2


@pytest.mark.parametrize("engine", ["dask", "ray"])
def test_blocks_run_in_cluster_workers_and_equal_threads(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    executor = request.getfixturevalue(f"{engine}_executor")
    data = np.random.default_rng(1).random((3000, 4), dtype=np.float32)
    np.save(tmp_path / "a.npy", data)
    x = tw.from_npy(tmp_path / "a.npy", rows=300)
    pids = x.map_blocks(_pid_rows, dtype=np.int64, row_shape=(1,)).compute(executor=executor)
    assert os.getpid() not in set(pids[:, 0].tolist())
    y = np.sqrt(x * 2 + 1)
    there = y.compute(executor=executor)
    assert np.array_equal(there, y.compute(executor="threads"))
    y.to_npy(tmp_path / "there.npy", executor=executor)
    y.to_npy(tmp_path / "here.npy", executor="threads")
    assert (tmp_path / "there.npy").read_bytes() == (tmp_path / "here.npy").read_bytes()
    total = y.sum(axis=0).compute(executor=executor)
    assert np.array_equal(total, y.sum(axis=0).compute(executor="threads"))


@pytest.mark.parametrize("engine", ["dask", "ray"])
def test_big_held_blocks_come_back_by_the_shared_folder_and_are_removed(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    executor = request.getfixturevalue(f"{engine}_executor")
    shared = tmp_path / "shared"
    config.set(shared_dir=str(shared))
    data = np.arange(200_000, dtype=np.float64).reshape(50_000, 4)
    x = tw.from_array(data, rows=10_000)  # 320 KB blocks, over SHARED_MIN
    seen: list[str] = []
    original = tw.engine.program.roots.SharedBlock.take

    def take(block: Any) -> np.ndarray:
        seen.append(block.path)
        return original(block)

    tw.engine.program.roots.SharedBlock.take = take  # type: ignore[method-assign]
    try:
        kept = x[x[:, 0] % 3 == 0].compute(executor=executor)  # unknown rows: held blocks
        doubled = (x * 2).compute(executor=executor)
    finally:
        tw.engine.program.roots.SharedBlock.take = original  # type: ignore[method-assign]
    assert np.array_equal(kept, data[data[:, 0] % 3 == 0])
    assert np.array_equal(doubled, data * 2)
    assert len(seen) == 10 and all(Path(p).parent == shared for p in seen)
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("engine", ["dask", "ray"])
def test_a_program_is_sent_once_per_compute_pass(
    engine: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    executor = request.getfixturevalue(f"{engine}_executor")
    np.save(tmp_path / "a.npy", np.arange(3000.0).reshape(1000, 3))
    x = tw.from_npy(tmp_path / "a.npy", rows=10)  # 100 blocks
    before = len(executor._programs)
    shipped: list[str] = []
    original = executor._program

    def program(key: str) -> Any:
        if key not in executor._programs:
            shipped.append(key)
        return original(key)

    executor._program = program  # type: ignore[method-assign]
    try:
        total = np.sqrt(x * 2 + 1).sum(axis=0).compute(executor=executor)
    finally:
        del executor._program
    np.testing.assert_allclose(total, np.sqrt(np.arange(3000.0).reshape(1000, 3) * 2 + 1).sum(0))
    assert len(shipped) == 1 and len(executor._programs) <= before + 1


def test_a_task_prefers_the_machine_that_read_its_rows_before(tmp_path: Path) -> None:
    # Two machines as Dask sees them: a worker on 127.0.0.1 and one on 127.0.0.2.
    import dask
    from distributed import Client, LocalCluster

    # Without work stealing: the preference is loose (allow_other_workers), and on a busy
    # machine Dask's stealing moved a preferred task to the idle first worker. The test
    # is about what tierflow asks for, not about Dask's stealing.
    with dask.config.set({"distributed.scheduler.work-stealing": False}):
        cluster = LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None
        )
    client = Client(cluster, set_as_default=False)
    other = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
         "--nthreads", "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.2"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},  # the tests
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client.wait_for_workers(2, timeout=60)
        executor = DaskExecutor(client)
        np.save(tmp_path / "a.npy", np.ones((4000, 2), np.float32))
        x = tw.from_npy(tmp_path / "a.npy", rows=250)  # 16 blocks
        x.sum(axis=0).compute(executor=executor)
        files = (str(tmp_path / "a.npy"),)
        keys = [k for k in executor._read_by if k[0] == files]
        assert len(keys) == 16
        assert set(executor._read_by.values()) <= {"127.0.0.1", "127.0.0.2"}
        for k in keys:  # as if the second machine had read every block
            executor._read_by[k] = "127.0.0.2"
        pids = x.map_blocks(_pid_rows, dtype=np.int64, row_shape=(1,)).compute(executor=executor)
        assert {executor._read_by[k] for k in keys} == {"127.0.0.2"}
        assert set(pids[:, 0].tolist()) == {other.pid}  # without it, both would take blocks
        executor.close()
    finally:
        other.kill()
        other.wait(60)
        client.close()
        cluster.close()


def test_on_one_machine_every_worker_takes_blocks_of_rows_another_read(
    dask_executor: DaskExecutor, tmp_path: Path
) -> None:
    np.save(tmp_path / "a.npy", np.ones((4000, 2), np.float32))
    x = tw.from_npy(tmp_path / "a.npy", rows=100)  # 40 blocks
    x.sum(axis=0).compute(executor=dask_executor)
    files = (str(tmp_path / "a.npy"),)
    keys = [k for k in dask_executor._read_by if k[0] == files]
    # Remembered by machine (the workers' host), not by worker process:
    assert {dask_executor._read_by[k] for k in keys} == {"127.0.0.1"}
    slow = x.map_blocks(_pid_rows_slowly, dtype=np.int64, row_shape=(1,))
    pids = slow.compute(executor=dask_executor)
    assert len(set(pids[:, 0].tolist())) == 2  # both worker processes ran blocks


def _pid_rows_slowly(block: np.ndarray) -> np.ndarray:
    threading.Event().wait(0.02)
    return _pid_rows(block)


def test_run_block_caps_every_operator_of_its_program(tmp_path: Path) -> None:
    # run_block runs in any process: here, to see the worker's halving state.
    data = np.arange(600.0).reshape(200, 3)
    y = (tw.from_array(data, rows=100) + 1).sum(axis=0)
    plan_program: list[Any] = []
    original = tasks.ship

    def ship(program: Any) -> str:
        plan_program.append(program)
        return original(program)

    tasks.ship = ship  # type: ignore[assignment]
    try:
        y.compute(executor=DaskLike())
    finally:
        tasks.ship = original  # type: ignore[assignment]
    program = plan_program[0]
    key = tasks.ship(program)
    sites = program.sites()
    assert sites
    for site in sites:
        halving.forget(site)
    desc = tasks.BlockTask(key, 0, RowRange(0, 100))
    whole, _, _, _ = cluster.run_block(desc, tasks.program_bytes(key), (), None, None)
    assert all(halving.remembered(site) is None for site in sites)
    try:
        capped, seconds, caught, where = cluster.run_block(
            desc, tasks.program_bytes(key), (), 7, None
        )
        assert all(halving.remembered(site) == 7 for site in sites)
    finally:
        for site in sites:
            halving.forget(site)
    assert repr(capped.partials) == repr(whole.partials)  # 100 rows in pieces of 7: same sum
    assert seconds >= 0 and caught == () and where is None


class DaskLike:
    """Runs block tasks as data in this process (run_block), as a worker would."""

    name = "inline"
    workers = 1

    def submit(self, fn: Any, done: Any) -> None:
        try:
            result = fn()
        except BaseException as exc:
            done(None, exc)
            return
        done(result, None)

    def submit_task(self, desc: Any, done: Any) -> None:
        try:
            result, seconds, _, _ = cluster.run_block(
                desc, tasks.program_bytes(desc.program), (), None, None
            )
        except BaseException as exc:
            done(None, exc)
            return
        done((result, seconds), None)

    def shutdown(self, *, cancel: bool = False) -> None:
        pass


def _run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": "/tmp"},  # Ray's socket paths must stay short
    )


def test_executor_dask_without_a_client_says_how_to_start_one(tmp_path: Path) -> None:
    code = (
        "import numpy as np, tierflow as tw\n"
        "try:\n"
        "    tw.from_array(np.ones((4, 2))).sum().compute(executor='dask')\n"
        "except tw.TierflowError as e:\n"
        "    print('refused:', e)\n"
    )
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "refused: executor='dask' found no Dask client: start one first" in result.stdout
    assert "tw.DaskExecutor(client)" in result.stdout


@pytest.mark.parametrize(("engine", "module"), [("dask", "distributed"), ("ray", "ray")])
def test_a_cluster_executor_without_its_package_names_the_extra(
    engine: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import distributed` / `import ray` fails
    monkeypatch.setattr(executors, "_clusters", {})  # none made earlier in this process
    x = tw.from_array(np.ones((4, 2)))
    made = DaskExecutor if engine == "dask" else RayExecutor
    for call in (made, lambda: x.sum().compute(executor=engine)):
        with pytest.raises(DependencyError) as info:
            call()
        assert str(info.value) == (
            f"executor='{engine}' needs the optional package '{module}': {install_command(engine)}"
        )
        assert isinstance(info.value, ImportError)


@pytest.mark.slow  # starts a local Ray
def test_executor_ray_without_ray_starts_a_local_one_and_says_so(tmp_path: Path) -> None:
    # And once that Ray is shut down, the executor made on it refuses to launch (a call
    # into Ray after ray.shutdown() would end the process, with no exception), and
    # executor="ray" makes a new one on a new local Ray.
    code = (
        "import numpy as np, ray, tierflow as tw\n"
        "from tierflow.engine.runtime.executors import make_executor\n"
        "x = tw.from_array(np.ones((40, 2)), rows=8)\n"
        "print('sum', x.sum().compute(executor='ray'))\n"
        "old = make_executor('ray')[0]\n"
        "ray.shutdown()\n"
        "try:\n"
        "    x.sum().compute(executor=old)\n"
        "except tw.errors.TierflowError as exc:\n"
        "    print('refused:', exc)\n"
        "old.close()\n"
        "print('again', x.sum().compute(executor='ray'), make_executor('ray')[0] is not old)\n"
    )
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sum 80.0" in result.stdout
    assert "executor='ray' started a local Ray instance" in result.stderr
    assert "refused: the Ray instance this RayExecutor was made on has been shut down" in (
        result.stdout
    )
    assert "again 80.0 True" in result.stdout


def test_a_dask_task_declares_its_bytes_when_they_matter_to_a_worker(
    dask_executor: DaskExecutor,
) -> None:
    from tierflow.engine.runtime.executors.dask import DECLARED_SHARE

    smallest, largest = dask_executor._smallest, dask_executor._largest
    assert 0 < smallest <= largest
    assert dask_executor._resources(int(DECLARED_SHARE * smallest) - 1) is None
    assert dask_executor._resources(smallest // 2) == {RESOURCE: smallest // 2}
    assert dask_executor._resources(2 * largest) == {RESOURCE: largest}  # the most any has


def test_dask_workers_run_without_the_profiler_and_with_a_slow_tick(dask_client: Any) -> None:
    DaskExecutor(dask_client)

    def callbacks(dask_worker: Any) -> tuple[bool, bool, float]:
        found = dask_worker.periodic_callbacks
        return (
            found["profile"].is_running(),
            found["profile-cycle"].is_running(),
            found["tick"].callback_time,
        )

    assert set(dask_client.run(callbacks).values()) == {(False, False, 1000)}


def _mapped_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def _keeping(dask_worker: Any) -> tuple[int, int, float, int]:
    manager = dask_worker.memory_manager
    return (
        filemaps.keep_limit(),
        manager.memory_limit,
        manager.memory_pause_fraction,
        int(config.get("ram_budget")),
    )


def test_dask_workers_keep_a_files_pages_once_and_below_the_pause_threshold(
    dask_client: Any, tmp_path: Path
) -> None:
    """Dask's memory monitor reads a worker's RSS, which counts mapped file pages. Each
    compute's program maps the file, and when each mapping was its own, kept pages
    added up (a 4 GB file, three computes: 9.7 GB in one worker, and Dask paused it).
    Now a worker keeps one mapping of a file, and only as many bytes as Dask's pause
    threshold leaves above its budget; past that, pages are released after each block."""
    executor = DaskExecutor(dask_client)
    for keep, limit, pause, budget in dask_client.run(_keeping).values():
        assert 0 <= keep <= limit * pause - budget
    path = tmp_path / "x.npy"
    data = np.ones((1 << 21, 8), np.float32)  # 64 MB
    np.save(path, data)

    def grown_mb(exprs: list[Any]) -> dict[str, int]:
        before = dask_client.run(_mapped_file_kb)
        for expr in exprs:
            np.testing.assert_array_equal(expr.compute(executor=executor), data.sum(axis=0))
        after = dask_client.run(_mapped_file_kb)
        return {w: (after[w] - before[w]) // 1024 for w in after}

    def exprs() -> list[Any]:  # a new source each time, as a notebook's cells make
        return [tw.from_npy(path, rows=1 << 18).sum(axis=0) for _ in range(4)]

    limits = dask_client.run(filemaps.keep_limit)
    kept = grown_mb(exprs())
    assert max(kept.values()) <= 64 + 12 and sum(kept.values()) <= 2 * 64 + 24, kept
    if min(limits.values()) > 64 << 20:  # room for the file: its pages stayed mapped
        assert sum(kept.values()) >= 48, kept
    try:
        dask_client.run(filemaps.keep_files, 16 << 20)  # less than the file: none kept
        dask_client.run(filemaps.forget_all)
        released = grown_mb(exprs())
        assert max(released.values()) < 24, f"MB of file pages kept per worker: {released}"
    finally:
        for worker, limit in limits.items():
            dask_client.run(filemaps.keep_files, limit, workers=[worker])


@pytest.mark.executors("dask", "ray")
def test_a_warning_comes_back_from_every_compute_not_only_the_first(executor_name: str) -> None:
    # A worker process lives on between computes, and Python shows a warning once per
    # place in it: the warnings of each task must still reach the driver every time,
    # as in a local run.
    x = tw.from_array(np.array([[1.0], [-1.0]] * 8), rows=2)
    for _ in range(4):
        with pytest.warns(RuntimeWarning, match="invalid value"):
            np.sqrt(x).compute(executor=executor_name)
        with pytest.warns(UserWarning, match="a block went by"):
            x.map_blocks(_warns, dtype=np.float64, row_shape=(1,)).compute(executor=executor_name)


def _warns(block: np.ndarray) -> np.ndarray:
    import warnings

    warnings.warn("a block went by", UserWarning, stacklevel=1)
    return block
