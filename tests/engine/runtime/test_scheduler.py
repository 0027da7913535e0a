"""The scheduler: admission within the budget, backpressure, spilling at critical,
release of source pages, errors and interrupts, executors and callbacks."""

from __future__ import annotations

import _thread
import collections
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tierflow as tw
from tierflow.engine import types
from tierflow.engine.runtime import executors
from tierflow.errors import BlockError
from tierflow.storage import pages, spill
from tierflow.system import pressure
from tierflow.system.types import Level

from common import Concurrency

MB = 1 << 20


class Recorder:
    """A callback that keeps every event."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def start(self, event: types.ComputeStarted) -> None:
        self.events.append(event)

    def task_done(self, event: types.TaskFinished) -> None:
        self.events.append(event)

    def finish(self, event: types.ComputeFinished) -> None:
        self.events.append(event)

    @property
    def finished(self) -> types.ComputeFinished:
        last = self.events[-1]
        assert isinstance(last, types.ComputeFinished)
        return last


def worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tierflow-worker")]


def blocks_of(mb: float, n: int) -> tw.Array:
    rows = int(mb * MB) // 8
    return tw.from_array(np.ones((rows * n, 1)), rows=rows)


@pytest.mark.executors("threads")
def test_blocks_too_big_for_a_workers_share_are_cut_to_fit() -> None:
    tw.memory.budget("3MB")  # a 1 MB block task projects 2 MB: more than 3 MB / (2 x 4)
    fn = Concurrency()
    rec = Recorder()
    x = blocks_of(1, 8).map_blocks(fn, dtype=np.float64, row_shape=(1,))
    result = x.compute(workers=4, callbacks=rec)
    assert fn.calls > 8 and float(result.sum()) == 2 * len(result)
    assert 0 < rec.finished.peak_bytes <= 3 * MB


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_admission_keeps_projected_memory_within_a_tiny_budget() -> None:
    tw.memory.budget("3MB")
    fn = Concurrency()
    rec = Recorder()
    x = blocks_of(1, 8)
    # After a mask, blocks cannot be cut: each task projects its 1 MB block several
    # times (masked copy, result, held block), more than the budget: one at a time.
    y = x[x[:, 0] > 0].map_blocks(fn, dtype=np.float64, row_shape=(1,))
    result = y.compute(workers=4, callbacks=rec)
    assert fn.most == 1 and fn.calls == 8 and len(result) == 8 * (MB // 8)


@pytest.mark.executors("threads")
def test_a_bigger_budget_lets_workers_run_together() -> None:
    tw.memory.budget("64MB")
    fn = Concurrency()
    rec = Recorder()
    blocks_of(1, 8).map_blocks(fn, dtype=np.float64, row_shape=(1,)).compute(
        workers=4, callbacks=rec
    )
    assert fn.most >= 2
    assert rec.finished.peak_bytes <= 64 * MB


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_high_pressure_admits_one_task_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    tw.memory.budget("64MB")
    monkeypatch.setattr(pressure, "level_now", lambda: Level.HIGH)
    fn = Concurrency()
    result = blocks_of(0.25, 6).map_blocks(fn, dtype=np.float64, row_shape=(1,)).compute(workers=4)
    assert fn.most == 1 and fn.calls == 6 and float(result.sum()) == 2 * len(result)


def test_critical_pressure_spills_held_blocks_and_deletes_them_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tw.memory.budget("64MB")
    levels = iter([Level.OK])  # the first blocks run at ok, then the level is critical
    monkeypatch.setattr(pressure, "level_now", lambda: next(levels, Level.CRITICAL))
    before = len(spill.live_files())
    a = np.random.default_rng(0).normal(size=(40_000, 4))
    x = tw.from_array(a, rows=4000)
    rec = Recorder()
    masked = x[x[:, 0] > 0]  # unknown sizes: blocks are held until assembled
    result = masked.compute(executor="serial", callbacks=rec)
    np.testing.assert_array_equal(result, a[a[:, 0] > 0])
    assert rec.finished.spilled_bytes > 0
    assert len(spill.live_files()) == before + (1 if tw.memory.on_disk(result) else 0)


def _summed_16_mb(tmp_path: Path, budget: str) -> tuple[tw.Array, np.ndarray]:
    """A 16 MB file's lazy array, summed once under ``budget``, and its mapping."""
    path = tmp_path / "x.npy"
    np.save(path, np.ones((1 << 20, 4), np.float32))
    tw.memory.budget(budget)
    x = tw.from_npy(path, rows=1 << 17)
    assert x.sum().compute() == 4 << 20
    return x, x._node.reader.source._mapping()  # type: ignore[attr-defined]


def test_finished_blocks_of_a_file_over_half_the_budget_leave_the_process(
    tmp_path: Path,
) -> None:
    x, mapping = _summed_16_mb(tmp_path, "24MB")
    assert pages.mapped_bytes(mapping) <= 2 * 4096 * x.nblocks  # page edges at most


@pytest.mark.executors("threads", "serial")  # the mapping looked at is this process's
def test_a_file_under_half_the_budget_stays_mapped_until_memory_runs_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, mapping = _summed_16_mb(tmp_path, "64MB")
    assert pages.mapped_bytes(mapping) > 8 << 20  # a second scan finds its pages mapped
    monkeypatch.setattr(pressure, "level_now", lambda: Level.MODERATE)
    assert x.sum().compute() == 4 << 20
    assert pages.mapped_bytes(mapping) <= 2 * 4096 * x.nblocks


def test_depth_first_order_appends_a_block_before_reading_the_next() -> None:
    rec = Recorder()
    x = tw.from_array(np.arange(100.0), rows=10)
    with tempfile.TemporaryDirectory() as folder:
        x[x > 17].to_npy(f"{folder}/m.npy", executor="serial", callbacks=rec)
    names = [e.name for e in rec.events if isinstance(e, types.TaskFinished)]
    blocks = [i for i, n in enumerate(names) if n.startswith("block")]
    appends = [i for i, n in enumerate(names) if n.startswith("append")]
    assert len(blocks) == len(appends) == 10
    # At most one block is read ahead (the queued one) before a block is appended.
    assert all(appends[j] < blocks[j + 2] for j in range(8))


@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_the_first_error_stops_the_compute_and_the_workers() -> None:
    calls: list[int] = []

    def fails(b: np.ndarray) -> np.ndarray:
        calls.append(int(b[0, 0]))
        if b[0, 0] == 300:
            raise ValueError("block 3 is bad")
        time.sleep(0.01)
        return b

    x = tw.from_array(np.arange(2000.0).reshape(2000, 1), rows=100)
    with pytest.raises(
        BlockError, match=r"failed on block 3 of 20 \(rows 300:400\).*block 3 is bad"
    ) as info:
        x.map_blocks(fails, dtype=np.float64, row_shape=(1,)).compute(workers=2)
    assert isinstance(info.value.__cause__, ValueError)
    assert (info.value.index, info.value.start, info.value.stop) == (3, 300, 400)
    assert len(calls) < 20 and worker_threads() == []


@pytest.mark.usefixtures("ctrl_c")  # _thread.interrupt_main does nothing if SIGINT is ignored
@pytest.mark.parametrize("where", ["worker", "main"])
@pytest.mark.executors("threads", "serial")  # observes calls in this process
def test_keyboard_interrupt_stops_workers_and_leaves_nothing(
    tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tw.memory.budget("1MB")  # the output spills: its file must go too
    before = len(spill.live_files())
    previous = sys.unraisablehook

    def send_again(unraisable: Any) -> None:
        # An interrupt that lands while the main thread runs a finalizer (a spill file's)
        # is swallowed there, by Python; a user would press Ctrl-C again. Sent from
        # another thread once this hook has returned, or it would land in the hook.
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            threading.Timer(0.01, _thread.interrupt_main).start()
        else:
            previous(unraisable)

    monkeypatch.setattr(sys, "unraisablehook", send_again)
    calls: list[int] = []
    callers: set[threading.Thread] = set()

    def work(b: np.ndarray) -> np.ndarray:
        calls.append(1)
        callers.add(threading.current_thread())
        if len(calls) == 5:
            if where == "worker":
                raise KeyboardInterrupt
            _thread.interrupt_main()
        time.sleep(0.01)  # a block's work
        return b + 1

    x = tw.from_array(np.zeros((400_000, 1)), rows=10_000)
    y = x.map_blocks(work, dtype=np.float64, row_shape=(1,))
    with pytest.raises(KeyboardInterrupt):
        y.compute(workers=2)
        time.sleep(1)  # the interrupt of the main thread may land just after
    # Every thread but this one that ran a block has ended, and this one has returned:
    # nothing runs after the interrupt.
    me = threading.current_thread()
    assert callers and not any(t.is_alive() for t in callers if t is not me)
    assert len(calls) < 40
    assert worker_threads() == [] and len(spill.live_files()) == before
    with pytest.raises(KeyboardInterrupt):
        calls.clear()
        y.to_npy(tmp_path / "out.npy", workers=2)
        time.sleep(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_serial_and_thread_executors_and_a_custom_one() -> None:
    main = threading.get_ident()
    seen: set[int] = set()

    def where(b: np.ndarray) -> np.ndarray:
        seen.add(threading.get_ident())
        return b

    x = tw.from_array(np.zeros((100, 1)), rows=10).map_blocks(
        where, dtype=np.float64, row_shape=(1,)
    )
    x.compute(executor="serial")
    assert seen == {main}
    seen.clear()
    x.compute(executor="threads", workers=2)
    assert main not in seen and worker_threads() == []

    class Counting(executors.SerialExecutor):
        """Runs tasks inside ``submit`` and counts the blocks that ran there."""

        name = "counting"

        def __init__(self) -> None:
            self.submitted = 0
            self.inside = False

        def submit(self, fn: Any, done: Any) -> None:
            self.submitted += 1
            self.inside = True
            try:
                super().submit(fn, done)
            finally:
                self.inside = False

    custom = Counting()
    ran_inside: list[bool] = []

    def counted(b: np.ndarray) -> np.ndarray:
        ran_inside.append(custom.inside)
        return b

    y = tw.from_array(np.zeros((100, 1)), rows=10).map_blocks(
        counted, dtype=np.float64, row_shape=(1,)
    )
    y.compute(executor=custom)
    # Every block ran through the executor; tiny ones share a submit (the lane).
    assert ran_inside == [True] * 10 and 1 <= custom.submitted <= 11
    with tw.use_executor(custom):
        before = custom.submitted
        y.compute()
    assert ran_inside == [True] * 20 and custom.submitted > before
    with pytest.raises(ValueError, match="unknown executor 'dask-ish'"):
        x.compute(executor="dask-ish")
    with pytest.raises(TypeError, match="is not an executor"):
        x.compute(executor=object())  # type: ignore[arg-type]


def test_callbacks_see_start_every_task_and_finish() -> None:
    rec = Recorder()
    x = tw.from_array(np.ones((1000, 2)), rows=100)
    tw.compute(x.sum(), x.max(axis=0), callbacks=[rec], executor="serial")
    start, *done, finish = rec.events
    assert (
        isinstance(start, types.ComputeStarted) and start.tasks == 12 and start.executor == "serial"
    )
    assert [e.done for e in done] == list(range(1, 13)) and all(e.total == 12 for e in done)
    assert finish.done == 12 and finish.error is None and finish.seconds > 0

    class Boom(Recorder):
        def task_done(self, event: types.TaskFinished) -> None:
            raise RuntimeError("reporting failed")

    with pytest.raises(RuntimeError, match="reporting failed"):
        x.sum().compute(callbacks=Boom())
    assert worker_threads() == []


# The first compute on processes starts the pool, which can outlast the bar's delay.
@pytest.mark.executors("threads", "serial")
def test_progress_bar_after_a_delay_or_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    x = tw.from_array(np.ones((100, 2)), rows=10)
    x.sum().compute()
    assert capsys.readouterr().err == ""
    x.sum().compute(progress=True)
    assert "11/11" in capsys.readouterr().err
    x.sum().compute(progress=False)
    assert capsys.readouterr().err == ""


def test_inbox_loses_no_wake_up_between_workers_and_the_scheduler() -> None:
    from tierflow.engine.runtime.lane import Inbox

    inbox = Inbox()
    per_worker, workers = 3000, 3

    def work(w: int) -> None:
        for k in range(per_worker):
            inbox.put((w * per_worker + k, None, None))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    got: list[int] = []
    total = per_worker * workers
    deadline = time.monotonic() + 20
    while len(got) < total and time.monotonic() < deadline:
        # A lost wake-up would leave this wait to its timeout: a second at most, which
        # the deadline turns into a failure if it keeps happening.
        items = inbox.take(min(7, total - len(got)), 1.0)
        got.extend(i for i, _, _ in items)
    for t in threads:
        t.join()
    assert sorted(got) == list(range(total))
    assert inbox.wanted > total  # nobody waits: workers take no lock


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_delivered_to_another_thread_stops_the_scheduler_waiting_for_tasks() -> None:
    # The kernel hands a process's SIGINT to any thread; Python runs its handler in the
    # main thread, which must wake up for it: a scheduler waiting for tasks with no
    # timeout (a compute's tasks running on a cluster) never would.
    from tierflow.engine.runtime.lane import NOBODY, Inbox

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only")
    inbox = Inbox()

    def ctrl_c_to_this_thread() -> None:
        deadline = time.monotonic() + 10
        while inbox.wanted == NOBODY and time.monotonic() < deadline:
            time.sleep(0.01)  # until the scheduler waits
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    # Should the wait never wake, a task finishing after 10 s ends it, and the test fails.
    late_task = threading.Timer(10.0, inbox.put, args=((0, None, None),))
    late_task.start()
    interrupter = threading.Thread(target=ctrl_c_to_this_thread)
    interrupter.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            inbox.take(1, None)
        waited = time.monotonic() - started
    finally:
        late_task.cancel()
        interrupter.join()
    assert waited < 5, f"the Ctrl-C was handled after {waited:.1f} s, once a task finished"


def test_inbox_wakes_the_scheduler_at_once_for_an_error() -> None:
    from tierflow.engine.runtime.lane import Inbox

    inbox = Inbox()
    inbox.put((0, None, None))
    timer = threading.Timer(0.05, inbox.put, args=((1, None, ValueError("bad block")),))
    timer.start()
    started = time.monotonic()
    items = inbox.take(100, 10.0)
    timer.join()
    assert time.monotonic() - started < 5
    assert [i for i, _, _ in items] == [0, 1] and isinstance(items[1][2], ValueError)
    assert inbox.take(100, 10.0) == []  # after an error, take no longer waits


# -- tiny tasks: the lane ---------------------------------------------------------------


class CountingThreads(executors.ThreadExecutor):
    """Threads that count their submits."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.submitted = 0

    def submit(self, fn: Any, done: Any) -> None:
        self.submitted += 1
        super().submit(fn, done)


def run_tasks(fn: Any, n: int, executor: Any) -> list[Any]:
    """Run ``fn(k)`` for k < n as one kind of task; the results in order."""
    from tierflow.engine.runtime import scheduler

    tasks = [types.Task(f"task {k}", fn, args=(k,)) for k in range(n)]
    try:
        results, stats = scheduler.run(tasks, executor, keep=set(range(n)))
    finally:
        executor.shutdown()
    assert stats.done == n
    return [results[k] for k in range(n)]


def test_tiny_tasks_share_one_job_and_never_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierflow.engine.runtime import lane

    # A threshold no hiccup of a busy machine crosses: the test is about the lane itself.
    monkeypatch.setattr(lane, "TINY_TASK_SECONDS", 0.01)
    ex = CountingThreads(2)
    fn = Concurrency(pause=0)
    results = run_tasks(lambda k: fn(np.array([k])), 2000, ex)
    assert [int(r[0]) for r in results] == [2 * k for k in range(2000)]
    # Tiny tasks ran on the lane: a few jobs for 2,000 tasks, never two at once.
    assert ex.submitted < 200 and fn.most == 1


def test_slow_tasks_go_to_the_workers_after_a_short_probe() -> None:
    fn = Concurrency(pause=0.003)  # sleeping releases the GIL: worth two workers
    order: list[int] = []

    def task(k: int) -> np.ndarray:
        with fn.lock:
            order.append(fn.now)  # tasks already running when this one starts
        return fn(np.array([k]))

    run_tasks(task, 60, executors.ThreadExecutor(2))
    # Probed one at a time until two tasks after the first were slow, then two at once.
    assert order[:3] == [0, 0, 0]
    assert fn.most == 2 and max(order[3:6]) == 1


def test_a_kind_that_turns_slow_leaves_the_lane() -> None:
    fn = Concurrency(pause=0.004)
    late: list[int] = []

    def task(k: int) -> int:
        if k < 200:
            return k  # tiny: the kind goes to the lane
        with fn.lock:
            late.append(fn.now)
        fn(np.array([k]))
        return k

    assert run_tasks(task, 260, executors.ThreadExecutor(2)) == list(range(260))
    assert max(late) == 1  # the later, slow tasks ran two at a time


def test_kind_judgement_probe_and_band() -> None:
    from tierflow.engine.runtime.lane import LANE_PROBE, TINY_TASK_SECONDS, Kind

    tiny, slow = TINY_TASK_SECONDS / 3, TINY_TASK_SECONDS * 3
    kind = Kind()
    for seconds in [1.0] + [tiny] * (LANE_PROBE - 1):  # the first (warm-up) is left out
        assert kind.lane and kind.probing
        kind.observe(seconds)
    assert kind.lane and not kind.probing
    kind.observe(TINY_TASK_SECONDS * 1.5)  # inside the band: stays
    assert kind.lane
    while kind.lane:
        kind.observe(slow)
    assert kind.mean > 2 * TINY_TASK_SECONDS
    kind.observe(TINY_TASK_SECONDS * 0.9)  # inside the band on the workers: stays there
    assert not kind.lane
    while not kind.lane:
        kind.observe(tiny / 10)
    assert kind.mean < TINY_TASK_SECONDS / 2

    slow_kind = Kind()
    for _ in range(3):  # warm-up, then two slow tasks: no need to probe further
        assert slow_kind.probing
        slow_kind.observe(slow)
    assert not slow_kind.lane and not slow_kind.probing

    one_slow = Kind()  # a single slow task among tiny ones is noise
    for seconds in [slow, tiny, slow, *[tiny] * (LANE_PROBE - 3)]:
        assert one_slow.probing
        one_slow.observe(seconds)
    assert one_slow.lane and not one_slow.probing


@pytest.mark.parametrize("raised", [ValueError("task 30 is bad"), KeyboardInterrupt()])
def test_an_error_on_the_lane_stops_it(raised: BaseException) -> None:
    calls: list[int] = []
    callers: set[threading.Thread] = set()

    def task(k: int) -> int:
        calls.append(k)
        callers.add(threading.current_thread())
        if k == 30:
            raise raised
        return k

    with pytest.raises(type(raised)):
        run_tasks(task, 5000, executors.ThreadExecutor(2))
    # Every thread that ran a task has ended, so no task runs after the error.
    assert callers and not any(t.is_alive() for t in callers)
    assert len(calls) < 100 and worker_threads() == []


def test_lane_loses_no_task_when_its_job_ends_as_tasks_come() -> None:
    from tierflow.engine.runtime.lane import Inbox, Lane

    # A job that finds the queue empty ends under the lock; an append meanwhile makes
    # ``extend`` ask for a new job. Each round appends as soon as the last task is in,
    # while the job is on its way out: a task left in a queue nobody runs never comes.
    class SlowToFindEmpty(collections.deque):  # type: ignore[type-arg]
        """Widens the race: a pop from an empty queue fails after a pause."""

        def popleft(self) -> Any:
            if not self:
                time.sleep(0.0005)
                raise IndexError("pop from an empty deque")
            return super().popleft()

    inbox = Inbox()
    lane = Lane(inbox)
    lane.queue = SlowToFindEmpty()
    jobs: list[threading.Thread] = []
    got: list[int] = []
    total = 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes
    try:
        for round_ in range(500):
            items = [(total + j, lambda k: k, (total + j,)) for j in range(round_ % 3 + 1)]
            total += len(items)
            if lane.extend(items):
                job = threading.Thread(target=lane.job)
                job.start()
                jobs.append(job)
            while len(got) < total:
                came = inbox.take(total - len(got), 2.0)
                assert came, f"round {round_}: tasks {len(got)}..{total - 1} never ran"
                got.extend(i for i, _, _ in came)
    finally:
        sys.setswitchinterval(interval)
        lane.stop()
        for job in jobs:
            job.join()
    assert got == list(range(total)) and not lane.active
