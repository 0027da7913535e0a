"""Workers that come and go during a compute: a Dask ``LocalCluster`` scaled down to
one worker and up to three while a compute runs (what an adaptive deployment does).

The workers that leave retire gracefully (Dask moves their tasks elsewhere): that is
not a death, and nothing is sent again by tierflow. The workers that join get the
program and the budget and run blocks; the result has the same bytes as on threads.
Which worker ran each block, and with which budget, is noted in files the blocks write.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import tierflow as tw
from tierflow.engine.runtime.executors import DaskExecutor

from common import wait_for

WAIT = 60.0  # seconds a test waits for an event before it fails

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _noted(folder: str) -> Callable[[np.ndarray], np.ndarray]:
    """A block function that notes the worker and budget it ran with, takes 20 ms, and
    once ``retired`` is in ``folder`` waits for ``grown`` (so the compute is still
    running when the new workers arrive)."""

    def work(block: np.ndarray) -> np.ndarray:
        from distributed import get_worker

        from tierflow.system import budget

        note = f"{get_worker().address} {budget.budget_bytes()}"
        with open(os.path.join(folder, "ran", f"{os.getpid()}-{block[0, 0]!r}"), "w") as f:
            f.write(note)
        threading.Event().wait(0.02)
        if os.path.exists(os.path.join(folder, "retired")):
            for _ in range(int(WAIT / 0.02)):
                if os.path.exists(os.path.join(folder, "grown")):
                    break
                threading.Event().wait(0.02)
        return block * 3 + 1

    return work


def _workers(client: Any) -> set[str]:
    return set(client.scheduler_info(n_workers=-1)["workers"])


@pytest.mark.executors("dask")
def test_a_dask_cluster_scaled_down_and_up_during_a_compute_gives_the_same_bytes(
    tmp_path: Path,
) -> None:
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.CRITICAL,
    )
    client = Client(cluster, set_as_default=False)
    executor = DaskExecutor(client)
    try:
        data = np.random.default_rng(5).random((400 * 15, 4))
        path = tmp_path / "src.npy"
        np.save(path, data)
        (tmp_path / "ran").mkdir()
        first = _workers(client)
        seen: dict[str, Any] = {}

        def scale() -> None:
            ran = tmp_path / "ran"
            wait_for(lambda: len(os.listdir(ran)) >= 20, WAIT, "20 blocks run")
            cluster.scale(1)
            wait_for(lambda: len(_workers(client)) == 1, WAIT, "one worker left")
            seen["left"] = _workers(client)
            (tmp_path / "retired").touch()
            cluster.scale(3)
            wait_for(lambda: len(_workers(client)) == 3, WAIT, "three workers")
            seen["joined"] = _workers(client) - seen["left"]
            (tmp_path / "grown").touch()

        thread = threading.Thread(target=scale, daemon=True)
        thread.start()
        x = tw.from_npy(path, rows=15)  # 400 blocks of 20 ms
        y = x.map_blocks(_noted(str(tmp_path)), dtype=np.float64, row_shape=(4,))
        out = y.compute(executor=executor, progress=False)
        thread.join(WAIT)
        assert not thread.is_alive()
        want = data * 3 + 1
        assert out.dtype == want.dtype and out.tobytes() == want.tobytes()
        assert len(seen["left"]) == 1 and seen["left"] <= first
        assert len(seen["joined"]) == 2 and not seen["joined"] & first
        notes = [p.read_text().split() for p in (tmp_path / "ran").iterdir()]
        by_worker: dict[str, set[int]] = {}
        for address, budget in notes:
            by_worker.setdefault(address, set()).add(int(budget))
        # The joined workers ran blocks, with the budget the first ones had.
        assert seen["joined"] & set(by_worker)
        budgets = set().union(*by_worker.values())
        assert len(budgets) == 1 and budgets.pop() > 0
        assert executor.moved >= 1  # the leaving worker's tasks went elsewhere ...
        assert executor.resent == 0  # ... and a retirement is not a death
        assert not any(p.deaths for p in executor._pending.values())
        assert executor.workers == 3  # the slots followed the cluster
    finally:
        executor.close()
        client.close()
        cluster.close()
