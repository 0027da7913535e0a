"""Packs: short block tasks sent several to one engine task (the driver's rules, on a
cluster executor whose engine tasks are placeholders; real packs run in
test_clusters.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tierflow.engine.program.tasks import BlockTask
from tierflow.engine.runtime.executors import cluster
from tierflow.engine.types import RowRange

from common import IdleCluster, wait_for

pytestmark = pytest.mark.executors("threads")


class Killed(Exception):
    """Stands for an engine's error saying the worker died."""


class Recording(IdleCluster):
    """Notes each engine task launched: how many block tasks it carries."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.launched: list[int] = []
        self.cancelled: list[Any] = []

    def _launch(self, pack: Any, stems: Any, cap: int | None, prefer: str | None) -> Any:
        self.launched.append(len(pack))
        return object()

    def _cancel(self, handles: Any) -> None:
        self.cancelled.extend(handles)

    def _death(self, error: BaseException) -> Any:
        return cluster.Death("w1", True, "killed") if isinstance(error, Killed) else None


def _pack(executor: cluster.ClusterExecutor, size: int) -> tuple[list[Any], list[Any]]:
    """``size`` tasks of program ``p`` (10 rows each), launched as one pack; and what
    each one's ``done`` was called with."""
    executor._kinds["p"] = cluster._Kind(count=100, probed=True)
    calls: list[Any] = []
    pack = []
    for index in range(size):
        desc = BlockTask("p", index, RowRange(10 * index, 10 * index + 10))
        pending = cluster._Pending(desc, 0, lambda out, err, i=index: calls.append((i, out, err)))
        executor._pending[id(pending)] = pending
        pack.append(pending)
    executor._attempt(pack, executor._kinds["p"])
    return pack, calls


def _ran(seconds: float) -> tuple[Any, float, tuple[Any, ...], str]:
    return ("result", seconds, (), "w1")


def test_the_pack_size_follows_the_workers_times() -> None:
    executor = IdleCluster(2)
    kind = cluster._Kind(count=1000, probed=True)
    assert executor._pack_size(kind, 32) == 1  # no task timed yet
    kind.seconds = [0.001] * 3
    assert executor._pack_size(kind, 32) == 1  # too few timed
    kind.seconds = [0.001] * 40
    # Two packs in flight per slot at least, a multiple of the slots, of one size.
    assert executor._pack_size(kind, 32) == 8
    assert executor._pack_size(kind, 5) == 2
    assert executor._pack_size(kind, 1000) == cluster.PACK_MAX
    kind.seconds = [cluster.PACK_TASK_SECONDS] * 40
    assert executor._pack_size(kind, 1000) == 1  # not short: one task each
    kind.seconds = [0.015] * 40  # 8 of them make PACK_SECONDS
    assert executor._pack_size(kind, 1000) == int(cluster.PACK_SECONDS / 0.015) == 8
    assert IdleCluster(3)._pack_size(kind, 10) == 2  # 6 packs: 2 per slot


def test_tasks_submitted_in_a_batch_are_launched_as_packs_of_one_size() -> None:
    # One task at a time, the launch thread would send each alone while there is room;
    # handed over together, 32 short tasks on 2 slots go as 4 packs of 8 (the room:
    # two engine tasks per slot).
    executor = Recording(2)
    executor._kinds["p"] = cluster._Kind(count=32, probed=True, seconds=[0.004] * 8)
    with executor.batch():
        for index in range(32):
            desc = BlockTask("p", index, RowRange(10 * index, 10 * index + 10))
            executor.submit_task(desc, lambda out, err: None)
        assert executor.launched == []  # nothing before the batch ends
    wait_for(lambda: len(executor.launched) == 4, what="4 engine tasks launched")
    assert executor.launched == [8, 8, 8, 8]
    assert executor.packed == 32


def test_the_driver_reads_ahead_as_it_launches_not_for_the_whole_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # All 32 tasks are handed over at once, but the driver (its workers on this machine)
    # asks for the rows of the first task of each engine task it launches: 2 per slot,
    # never the whole queue's (which, on a file bigger than memory, would evict rows
    # before they are read). A pack's worker reads its later tasks ahead itself.
    read: list[int] = []
    monkeypatch.setattr(cluster, "_read_ahead", lambda program, desc: read.append(desc.index))
    for seconds, first in (([], [0, 1, 2, 3]), ([0.004] * 8, [0, 8, 16, 24])):
        read.clear()
        executor = Recording(2)
        executor.one_host = True
        executor._kinds["p"] = cluster._Kind(count=32, probed=True, seconds=list(seconds))
        with executor.batch():
            for index in range(32):
                desc = BlockTask("p", index, RowRange(10 * index, 10 * index + 10))
                executor.submit_task(desc, lambda out, err: None)
        _wait_for_launches(executor, 4)
        assert read == first
    executor = Recording(2)  # workers elsewhere: the driver's page cache is not theirs
    executor._kinds["p"] = cluster._Kind(count=1, probed=True)
    read.clear()
    executor.submit_task(BlockTask("p", 0, RowRange(0, 10)), lambda out, err: None)
    _wait_for_launches(executor, 1)
    assert read == []


def _wait_for_launches(executor: Recording, count: int) -> None:
    wait_for(lambda: len(executor.launched) == count, what=f"{count} engine tasks launched")


def test_each_task_of_a_pack_gets_its_own_outcome_and_error() -> None:
    executor = Recording(2)
    pack, calls = _pack(executor, 3)
    assert executor.launched == [3] and executor.packed == 3
    handle = pack[0].handles[0]
    error = ValueError("block 1 failed")
    executor._landed(pack, handle, [_ran(0.1), cluster.Raised(error), _ran(0.2)], None)
    assert [(i, out) for i, out, err in calls if err is None] == [
        (0, ("result", 0.1)),
        (2, ("result", 0.2)),
    ]
    assert [(i, err) for i, _, err in calls if err is not None] == [(1, error)]
    assert executor._kinds["p"].seconds == [0.1, 0.2]


def test_a_pack_whose_worker_died_sends_each_task_again_alone_with_the_cap_halved_once() -> None:
    executor = Recording(2)
    pack, calls = _pack(executor, 4)
    executor._landed(pack, pack[0].handles[0], None, Killed())
    assert calls == []  # none failed: each was sent again
    assert executor.launched == [4, 1, 1, 1, 1]
    assert executor.resent == 4
    assert executor._kinds["p"].cap == 5  # half the 10 rows they ran at, once


def test_a_task_whose_backup_won_leaves_its_pack_running() -> None:
    executor = Recording(2)
    pack, calls = _pack(executor, 2)
    shared = pack[0].handles[0]
    executor._attempt([pack[0]], executor._kinds["p"])  # a backup copy of task 0, alone
    backup = pack[0].handles[1]
    executor._landed([pack[0]], backup, [_ran(0.1)], None)
    assert calls == [(0, ("result", 0.1), None)]
    assert executor.cancelled == []  # the pack still carries task 1
    executor._landed(pack, shared, [_ran(0.3), _ran(0.3)], None)
    assert calls[1:] == [(1, ("result", 0.3), None)]  # task 0's second result is dropped


# -- a compute stopped while its attempts are being launched ---------------------------


class Slow(Recording):
    """Its launches wait for ``go``: a stop can come while one is on the way."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.entered = threading.Event()
        self.go = threading.Event()
        self.handles: list[Any] = []

    def _launch(self, pack: Any, stems: Any, cap: int | None, prefer: str | None) -> Any:
        self.entered.set()
        assert self.go.wait(10)
        self.launched.append(len(pack))
        self.handles.append(object())
        return self.handles[-1]


def test_a_stop_during_a_launch_cancels_that_attempt_and_launches_no_other() -> None:
    # The stop waits for the launch on its way and cancels it with the others; no task
    # is launched after it (an engine told to launch and cancel at once can run the
    # task all the same).
    executor = Slow(1)
    executor._kinds["p"] = cluster._Kind(count=100, probed=True)
    for index in range(6):
        desc = BlockTask("p", index, RowRange(10 * index, 10 * index + 10))
        executor.submit_task(desc, lambda out, err: None)
    assert executor.entered.wait(10)
    stopper = threading.Thread(target=lambda: executor.shutdown(cancel=True))
    stopper.start()
    assert not _joined(stopper, 0.2)  # it waits for the launch on its way
    executor.go.set()
    assert _joined(stopper, 10)
    launched = len(executor.launched)
    assert 1 <= launched <= 2  # at most the room of one slot, all before the stop
    assert [id(h) for h in executor.cancelled] == [id(h) for h in executor.handles]
    executor._launch_wake.set()  # the launch thread looks at the queue again
    executor.close()
    assert len(executor.launched) == launched


def _joined(thread: threading.Thread, seconds: float) -> bool:
    thread.join(seconds)
    return not thread.is_alive()
