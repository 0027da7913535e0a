"""Which running cluster tasks get a backup copy (the rule alone, without a cluster)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tierflow.engine.program.tasks import BlockTask
from tierflow.engine.runtime.executors import cluster
from tierflow.engine.types import RowRange

from common import IdleCluster

pytestmark = pytest.mark.executors("threads")

NOW = 1000.0


@pytest.fixture
def executor() -> Iterator[cluster.ClusterExecutor]:
    """A cluster executor whose pass ``p`` has 20 tasks done in 10 ms each (median)."""
    found = IdleCluster(2)
    found._kinds["p"] = cluster._Kind(count=30, seconds=[0.01] * 20, probed=True)
    try:
        yield found
    finally:
        found.close()


def _running(executor: cluster.ClusterExecutor, index: int, for_seconds: float) -> object:
    pending = cluster._Pending(BlockTask("p", index, RowRange(index, index + 1)), 0, print)
    pending.started = NOW - for_seconds
    pending.handles.append(object())
    executor._pending[id(pending)] = pending
    return pending


def test_a_task_over_three_times_the_median_and_a_second_gets_a_backup(
    executor: cluster.ClusterExecutor,
) -> None:
    slow = _running(executor, 0, 1.5)
    assert executor.stragglers(NOW) == [slow]


def test_a_short_task_over_three_times_the_median_gets_none(
    executor: cluster.ClusterExecutor,
) -> None:
    # 50 ms is 5 times the median: a task that waited in a deep queue on a busy machine.
    _running(executor, 0, 0.05)
    _running(executor, 1, cluster.STRAGGLER_MIN_SECONDS * 0.9)
    assert executor.stragglers(NOW) == []


def test_no_backup_before_half_the_pass_is_done(executor: cluster.ClusterExecutor) -> None:
    executor._kinds["p"].count = 100
    _running(executor, 0, 60.0)
    assert executor.stragglers(NOW) == []
