"""The processes executor: block tasks as data on spawned worker processes.

Functions here are module-level (or closures over plain values) so they pickle; what
happens in a worker is observed through what the workers return or write to files,
never through this process's memory.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.program import tasks
from tierflow.engine.runtime.executors import ProcessExecutor, WorkerDied, make_executor
from tierflow.engine.runtime.executors.processes import TRIES, RemoteError
from tierflow.engine.types import RowRange
from tierflow.errors import BlockError, PortabilityError
from tierflow.system import processes

from common import count_in, counting_into, wait_for

pytestmark = pytest.mark.executors("processes")


def _pid_rows(block: np.ndarray) -> np.ndarray:
    out = np.empty((len(block), 1), np.int64)
    total = 0.0
    for row in block:  # plain Python: holds the GIL
        total += float(row[0])
    out[:] = os.getpid()
    return out


def test_blocks_run_in_worker_processes_not_in_the_driver() -> None:
    x = tw.from_array(np.arange(40.0).reshape(20, 2), rows=2)
    pids = x.map_blocks(_pid_rows, dtype=np.int64, row_shape=(1,)).compute(workers=2)
    found = set(pids[:, 0].tolist())
    assert os.getpid() not in found
    assert 1 <= len(found) <= 2
    assert found <= set(ProcessExecutor(2).worker_pids())


def test_a_program_travels_once_per_worker(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(3000.0).reshape(1000, 3))
    x = tw.from_npy(tmp_path / "a.npy", rows=10)  # 100 blocks
    executor = ProcessExecutor(2)
    before = executor.shipped
    total = np.sqrt(x * 2 + 1).sum(axis=0).compute(executor=executor)
    np.testing.assert_allclose(total, np.sqrt(np.arange(3000.0).reshape(1000, 3) * 2 + 1).sum(0))
    assert 1 <= executor.shipped - before <= 2  # one program, at most once per worker


def test_a_block_task_is_small_data(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.ones((100, 3)))
    program_of = {}

    class Keep:  # a custom executor that records the block tasks it is given
        name, workers = "keep", 1

        def __init__(self) -> None:
            self.inner = ProcessExecutor(1)

        def submit(self, fn, done):  # type: ignore[no-untyped-def]
            self.inner.submit(fn, done)

        def submit_task(self, desc, done):  # type: ignore[no-untyped-def]
            program_of[desc] = len(pickle.dumps(desc))
            self.inner.submit_task(desc, done)

        def shutdown(self, *, cancel: bool = False) -> None:
            self.inner.shutdown(cancel=cancel)

    x = tw.from_npy(tmp_path / "a.npy", rows=10)
    keep = Keep()
    assert (x + 1).sum().compute(executor=keep) == 600
    keep.shutdown()
    assert len(program_of) == 10
    assert all(isinstance(d, tasks.BlockTask) for d in program_of)
    assert max(program_of.values()) < 300  # a hash, a block number and two row numbers


def _double(block: np.ndarray) -> np.ndarray:
    return block * 2


def test_to_npy_rows_are_written_in_place_by_the_workers(tmp_path: Path) -> None:
    a = np.random.default_rng(0).random((5000, 3))
    x = tw.from_array(a, rows=700)
    x.map_blocks(_double).to_npy(tmp_path / "out.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), a * 2)
    x[x[:, 0] > 0.5].to_npy(tmp_path / "masked.npy")  # unknown rows: by value, appended
    np.testing.assert_array_equal(np.load(tmp_path / "masked.npy"), a[a[:, 0] > 0.5])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["masked.npy", "out.npy"]


def _budget(block: np.ndarray) -> np.ndarray:
    return np.full((len(block), 1), tw.memory.budget(), np.int64)


def test_each_worker_runs_with_its_share_of_the_budget() -> None:
    tw.memory.budget("64MB")
    x = tw.from_array(np.zeros((8, 1)), rows=1)
    shares = x.map_blocks(_budget, dtype=np.int64, row_shape=(1,)).compute(workers=2)
    assert set(shares[:, 0].tolist()) == {32 << 20}


def _fails_on_block_3(block: np.ndarray) -> np.ndarray:
    if block[0, 0] == 300:
        raise ValueError("block 3 is bad")
    return block


def test_an_error_in_a_worker_comes_back_with_its_block_and_cause() -> None:
    x = tw.from_array(np.arange(1000.0).reshape(1000, 1), rows=100)
    with pytest.raises(BlockError, match="block 3 of 10") as info:
        x.map_blocks(_fails_on_block_3).compute()
    assert (info.value.index, info.value.start, info.value.stop) == (3, 300, 400)
    assert isinstance(info.value.__cause__, ValueError)
    assert "block 3 is bad" in str(info.value.__cause__)


def test_a_function_that_does_not_pickle_is_refused_clearly() -> None:
    lock = threading.Lock()

    def locked(block: np.ndarray) -> np.ndarray:
        with lock:
            return block

    x = tw.from_array(np.zeros((10, 1)), rows=5)
    with pytest.raises(PortabilityError, match=r"cannot be sent to worker processes.*'threads'"):
        x.map_blocks(locked).compute()
    np.testing.assert_array_equal(x.map_blocks(locked).compute(executor="threads"), 0)


def _kill_once(flag: str) -> object:
    def work(block: np.ndarray) -> np.ndarray:
        if block[0, 0] == 30 and not os.path.exists(flag):
            Path(flag).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return block + 1

    return work


def test_a_worker_killed_mid_task_is_replaced_and_its_task_sent_again(tmp_path: Path) -> None:
    flag = str(tmp_path / "killed")
    x = tw.from_array(np.arange(100.0).reshape(100, 1), rows=10)
    pids_before = set(ProcessExecutor(2).worker_pids())
    out = x.map_blocks(_kill_once(flag), dtype=np.float64, row_shape=(1,)).compute(workers=2)
    np.testing.assert_array_equal(out, np.arange(100.0).reshape(100, 1) + 1)
    assert os.path.exists(flag)  # a worker did die
    assert set(ProcessExecutor(2).worker_pids()) != pids_before or not pids_before


def _always_kill(block: np.ndarray) -> np.ndarray:
    if block[0, 0] == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return block


def test_a_task_that_kills_every_worker_fails_after_its_tries() -> None:
    # dtype and row_shape given: map_blocks would otherwise call the function here once.
    x = tw.from_array(np.arange(40.0).reshape(40, 1), rows=10)
    with pytest.raises(WorkerDied, match=f"died \\(signal 9\\) each of the {TRIES} times"):
        x.map_blocks(_always_kill, dtype=np.float64, row_shape=(1,)).compute(workers=2)
    # The pool serves the next compute.
    np.testing.assert_array_equal(
        x.map_blocks(_double).compute(workers=2), np.arange(40.0)[:, None] * 2
    )


def _slow_until_stopped(started: str) -> object:
    def work(block: np.ndarray) -> np.ndarray:
        Path(started, str(os.getpid())).touch()
        for _ in range(600):  # at most a minute: the interrupt kills the worker first
            import time

            time.sleep(0.1)
        return block

    return work


@pytest.mark.usefixtures("ctrl_c")
def test_keyboard_interrupt_kills_the_busy_workers_and_leaves_no_file(tmp_path: Path) -> None:
    started = tmp_path / "started"
    started.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    x = tw.from_array(np.zeros((40, 1)), rows=10).map_blocks(
        _slow_until_stopped(str(started)), dtype=np.float64, row_shape=(1,)
    )

    def interrupt_once_running() -> None:
        for _ in range(600):
            if len(os.listdir(started)) >= 1:
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C in a terminal
                return
            threading.Event().wait(0.05)

    watcher = threading.Thread(target=interrupt_once_running)
    watcher.start()
    with pytest.raises(KeyboardInterrupt):
        x.to_npy(out / "x.npy", workers=2)
    watcher.join()
    busy = [int(p) for p in os.listdir(started)]
    for pid in busy:  # killed, not left computing
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert os.listdir(out) == []
    np.testing.assert_array_equal(
        tw.from_array(np.ones((4, 1)), rows=1).map_blocks(_double).compute(workers=2), 2
    )


def _raise_interrupt(block: np.ndarray) -> np.ndarray:
    raise KeyboardInterrupt


def test_a_keyboard_interrupt_raised_in_a_worker_stops_the_compute() -> None:
    x = tw.from_array(np.zeros((40, 1)), rows=10)
    with pytest.raises(KeyboardInterrupt):
        x.map_blocks(_raise_interrupt, dtype=np.float64, row_shape=(1,)).compute(workers=2)


def test_the_executor_is_made_by_name_and_the_pool_outlives_a_compute() -> None:
    executor, owned = make_executor("processes", 2)
    assert isinstance(executor, ProcessExecutor) and owned
    x = tw.from_array(np.arange(20.0).reshape(10, 2), rows=2)
    x.map_blocks(_double).compute(executor=executor)
    pids = executor.worker_pids()
    executor.shutdown()
    assert ProcessExecutor(2).worker_pids() == pids


def test_a_block_result_and_task_round_trip_through_pickle() -> None:
    desc = tasks.BlockTask("ab" * 16, 3, RowRange(30, 40))
    assert pickle.loads(pickle.dumps(desc)) == desc
    result = tasks.BlockResult((np.float64(1.5),), (None, np.ones((2, 2))))
    back = cloudpickle.loads(cloudpickle.dumps(result))
    assert back.partials == result.partials and back.blocks[0] is None
    np.testing.assert_array_equal(back.blocks[1], result.blocks[1])


def test_a_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import numpy as np, tierflow as tw\n"
        "def f(b):\n"
        "    return b * 2\n"
        "x = tw.from_array(np.arange(20.0).reshape(10, 2), rows=2)\n"
        "print('result', x.map_blocks(f).sum().compute(executor='processes', progress=False))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["result 380.0"]  # the workers did not run it again


def test_workers_read_and_write_the_cache_and_report_to_the_driver(tmp_path: Path) -> None:
    data = np.arange(4000.0, dtype=np.float32).reshape(1000, 4)
    np.save(tmp_path / "src.npy", data)
    count = tmp_path / "count"
    count.mkdir()

    def y() -> tw.Array:
        x = tw.from_npy(tmp_path / "src.npy", rows=100)
        return x.map_blocks(counting_into(str(count)), dtype=np.float32, row_shape=(4,))

    store = tmp_path / "store"
    np.testing.assert_array_equal(y().compute(cache=store), data * 2 + 1)
    assert count_in(count) == 10
    (first,) = tw.cache_info(store).values()
    assert (first.hits, first.misses, first.writes, first.entries) == (0, 10, 10, 10)
    assert first.bytes_written == data.nbytes
    total = y().sum(axis=0).compute(cache=store)  # blocks from the cache, in the workers
    np.testing.assert_allclose(total, (data * 2 + 1).sum(axis=0))
    assert count_in(count) == 10
    (second,) = tw.cache_info(store).values()
    assert (second.hits, second.bytes_read) == (10, data.nbytes)


def _warns(block: np.ndarray) -> np.ndarray:
    import warnings

    warnings.warn(f"odd block of {len(block)} rows", RuntimeWarning, stacklevel=1)
    return block


def test_warnings_raised_in_a_worker_reach_the_driver() -> None:
    x = tw.from_array(np.zeros((30, 1)), rows=10)
    with pytest.warns(RuntimeWarning, match="odd block of 10 rows"):
        x.map_blocks(_warns, dtype=np.float64, row_shape=(1,)).compute()


class _Locked:
    """A partial result that does not pickle."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


def test_a_result_that_cannot_come_back_is_refused_clearly() -> None:
    x = tw.from_array(np.zeros((30, 1)), rows=10)
    r = x.reduction(lambda b: _Locked(), lambda a, b: a, lambda p: 0.0, dtype=np.float64, shape=())
    with pytest.raises(PortabilityError, match="result cannot be sent back from a worker"):
        r.compute()


class _TwoPartError(Exception):
    """An error that does not unpickle: pickle rebuilds it with its message alone."""

    def __init__(self, message: str, part: int) -> None:
        super().__init__(message)
        self.part = part


def _raises_two_part(block: np.ndarray) -> np.ndarray:
    raise _TwoPartError(f"part of {len(block)} rows", 2)


def test_an_error_that_cannot_come_back_arrives_as_its_traceback_and_the_reason() -> None:
    x = tw.from_array(np.zeros((30, 1)), rows=10)
    with pytest.raises(RemoteError) as caught:
        x.map_blocks(_raises_two_part, dtype=np.float64, row_shape=(1,)).compute()
    message = str(caught.value)
    assert "_TwoPartError: part of 10 rows" in message  # the worker's traceback
    assert "(it does not pickle: TypeError: " in message  # and why it is only that


# -- no outcome lost: computes sharing the pool, deaths the pipes do not show ----------


def _holds_block_0(folder: str) -> object:
    """A function that, on block 0 the first time, says so (``held``) and waits for
    ``release``; every other block runs at once."""

    def work(block: np.ndarray) -> np.ndarray:
        if block[0, 0] == 0 and not os.path.exists(os.path.join(folder, "held")):
            Path(folder, "held").touch()
            wait_for(lambda: os.path.exists(os.path.join(folder, "release")), 60, "release")
        return block * 2

    return work


def _in_thread(fn: Callable[[], np.ndarray]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` on a daemon thread; its result or error lands in the dict."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def _holding_block_0(x: Any, folder: Path, workers: int) -> tuple[threading.Thread, dict[str, Any]]:
    """``x.map_blocks(_holds_block_0)`` computed on ``workers`` worker processes on a
    thread (:func:`_in_thread`), once its block 0 is held (until ``folder/release``)."""
    held = x.map_blocks(_holds_block_0(str(folder)), dtype=np.float64, row_shape=(1,))
    thread, out = _in_thread(
        lambda: held.compute(executor="processes", workers=workers, progress=False)
    )
    wait_for(lambda: (folder / "held").exists(), 60, "block 0 to be held")
    return thread, out


def test_a_failing_compute_cancels_only_its_own_tasks_with_the_clusters_alive(
    tmp_path: Path, dask_client: Any, ray_runtime: Any
) -> None:
    # Two computes share the pool. Cancelling the one that fails once killed every
    # busy worker and dropped the other's tasks with them: that compute waited forever
    # (the driver in the scheduler's inbox, the new workers idle), and so did every
    # later compute on the pool. The Dask and Ray runtimes run alongside, as in the suite.
    x = tw.from_array(np.arange(200.0).reshape(200, 1), rows=10)
    thread, out = _holding_block_0(x, tmp_path, workers=2)
    with pytest.raises(BlockError, match="block 3 is bad"):
        (x * 10).map_blocks(_fails_on_block_3).compute(workers=2, progress=False)
    (tmp_path / "release").touch()
    thread.join(60)
    assert not thread.is_alive(), "the compute that shared the pool never finished"
    assert "error" not in out, out.get("error")
    np.testing.assert_array_equal(out["result"], np.arange(200.0).reshape(200, 1) * 2)
    # And the pool serves the next compute.
    np.testing.assert_array_equal(x.map_blocks(_double).compute(workers=2), x.compute() * 2)


def test_a_compute_never_waits_behind_another_computes_task_while_a_worker_is_free(
    tmp_path: Path,
) -> None:
    # One compute holds a worker with a long task; the other worker is free. The second
    # compute's tasks once went to the least busy worker whatever it ran: its second
    # task queued behind the long one, and the compute waited for it.
    one_block = tw.from_array(np.arange(10.0).reshape(10, 1), rows=10)
    thread, out = _holding_block_0(one_block, tmp_path, workers=2)
    x = tw.from_array(np.arange(1.0, 201.0).reshape(200, 1), rows=10)
    other, other_out = _in_thread(
        lambda: x.map_blocks(_double).compute(executor="processes", workers=2, progress=False)
    )
    other.join(30)
    finished = not other.is_alive()
    (tmp_path / "release").touch()
    thread.join(60)
    other.join(60)
    assert finished, "the second compute waited for the first one's long task"
    assert "error" not in other_out, other_out.get("error")
    np.testing.assert_array_equal(other_out["result"], np.arange(1.0, 201.0).reshape(200, 1) * 2)
    assert "error" not in out, out.get("error")
    np.testing.assert_array_equal(out["result"], np.arange(10.0).reshape(10, 1) * 2)


def _sleeps(folder: str) -> object:
    """A function that says it has started (``started``) and takes 10 ms a block."""

    def work(block: np.ndarray) -> np.ndarray:
        Path(folder, "started").touch()
        time.sleep(0.01)
        return block * 2

    return work


def test_two_computes_on_one_busy_worker_take_turns(tmp_path: Path) -> None:
    # A long compute keeps the pool's one worker busy. A short one started after it
    # takes its turn rather than waiting for the long one to end.
    long = tw.from_array(np.arange(300.0).reshape(300, 1), rows=1)
    slow = long.map_blocks(_sleeps(str(tmp_path)), dtype=np.float64, row_shape=(1,))
    thread, out = _in_thread(lambda: slow.compute(executor="processes", workers=1, progress=False))
    wait_for(lambda: (tmp_path / "started").exists(), 60, "the long compute to start")
    short = tw.from_array(np.arange(5.0).reshape(5, 1), rows=1)
    got = short.map_blocks(_double).compute(executor="processes", workers=1, progress=False)
    assert thread.is_alive(), "the short compute waited for the long one (3 s) to end"
    np.testing.assert_array_equal(got, np.arange(5.0).reshape(5, 1) * 2)
    thread.join(60)
    assert "error" not in out, out.get("error")
    np.testing.assert_array_equal(out["result"], np.arange(300.0).reshape(300, 1) * 2)


def _kills_block_0(block: np.ndarray) -> np.ndarray:
    if block[0, 0] == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return block * 2


def test_a_death_counts_against_the_task_running_not_those_queued_behind_it(
    tmp_path: Path,
) -> None:
    # One worker, two computes. Each death once counted against every task queued on
    # the worker, so after three deaths a task that never ran failed with WorkerDied:
    # the killer's own tasks queue behind it (those of the other compute wait in the
    # pool, which never queues them behind another compute's).
    x = tw.from_array(np.arange(200.0).reshape(200, 1), rows=10)
    thread, out = _holding_block_0(x, tmp_path, workers=1)
    killer = x.map_blocks(_kills_block_0, dtype=np.float64, row_shape=(1,))
    bad, bad_out = _in_thread(
        lambda: killer.compute(executor="processes", workers=1, progress=False)
    )
    (tmp_path / "release").touch()
    for t in (bad, thread):
        t.join(120)
        assert not t.is_alive()
    assert isinstance(bad_out.get("error"), WorkerDied)
    assert "block 0" in str(bad_out["error"])
    assert "error" not in out, out.get("error")
    np.testing.assert_array_equal(out["result"], np.arange(200.0).reshape(200, 1) * 2)


def _dies_leaving_a_child(folder: str) -> object:
    """A function that, the first time, starts a process that inherits the worker's
    descriptors (so the worker's pipe and sentinel outlive it) and then kills the
    worker."""

    def work(block: np.ndarray) -> np.ndarray:
        if block[0, 0] == 0 and not os.path.exists(os.path.join(folder, "child")):
            release = os.path.join(folder, "release")
            child = subprocess.Popen(
                [sys.executable, "-c", _WAIT_FOR_FILE, release], close_fds=False
            )
            Path(folder, "child").write_text(str(child.pid))
            os.kill(os.getpid(), signal.SIGKILL)
        return block * 2

    return work


_WAIT_FOR_FILE = (
    "import os, sys, time\n"
    "for _ in range(1200):\n"
    "    if os.path.exists(sys.argv[1]): break\n"
    "    time.sleep(0.1)\n"
)


def test_a_worker_whose_pipes_outlive_it_is_still_seen_to_die(tmp_path: Path) -> None:
    # The worker's death closes neither its pipe nor its sentinel (a process it
    # started holds both): only its pid tells. The task is sent again and the compute
    # finishes while that process still runs.
    x = tw.from_array(np.arange(40.0).reshape(40, 1), rows=10)
    y = x.map_blocks(_dies_leaving_a_child(str(tmp_path)), dtype=np.float64, row_shape=(1,))
    try:
        np.testing.assert_array_equal(y.compute(workers=2), x.compute() * 2)
        child = int((tmp_path / "child").read_text())
        assert processes.start_time(child) is not None  # still running, pipes held
    finally:
        (tmp_path / "release").touch()
