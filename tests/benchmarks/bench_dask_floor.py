"""What a compute of four 20 ms tasks costs on a 2-worker Dask LocalCluster, tierflow aside.

Four tasks, each spinning 20 ms of CPU, two named to each worker (``workers=``, with
``allow_other_workers``), as tierflow's Dask executor sends a 1 GB column sum (four packs
of 8 blocks). Perfectly spread over two workers they need 40 ms. Submitted two ways:
one ``client.submit`` per task (one ``update-graph`` each), and one ``client.map`` (one
``update-graph`` for all four, the workers given per key through ``dask.annotate``).
Prints the median wall time of a compute, from before the submit to after the gather,
and when the first and second tasks started.

    .venv/bin/python tests/benchmarks/bench_dask_floor.py --rounds 30
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import uuid
from typing import Any

TASK_S = 0.02
TASKS = 4


def spin(i: int) -> tuple[float, float]:
    """Spin ``TASK_S`` of CPU; returns when it started and ended."""
    start = time.perf_counter()
    while time.perf_counter() - start < TASK_S:
        pass
    return start, time.perf_counter()


def one_compute(client: Any, workers: list[str], mode: str) -> tuple[float, list[float]]:
    """Seconds of one compute and the tasks' start times from its start, sorted."""
    import dask

    gc.collect()
    keys = [f"spin-{i}-{uuid.uuid4().hex[:12]}" for i in range(TASKS)]
    where = {k: [workers[i % len(workers)]] for i, k in enumerate(keys)}
    start = time.perf_counter()
    if mode == "submit":
        futures = [
            client.submit(spin, i, key=k, pure=False, workers=where[k], allow_other_workers=True)
            for i, k in enumerate(keys)
        ]
    else:
        with dask.annotate(workers=where.__getitem__, allow_other_workers=True):
            futures = client.map(spin, range(TASKS), key=keys, pure=False)
    out = client.gather(futures)
    took = time.perf_counter() - start
    return took, sorted(s - start for s, _ in out)


def main(argv: list[str] | None = None) -> int:
    from distributed import Client, LocalCluster

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    )
    client = Client(cluster)
    try:
        client.wait_for_workers(2)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        figures: dict[str, list[tuple[float, list[float]]]] = {"submit": [], "map": []}
        for _ in range(args.rounds):
            for mode, runs in figures.items():
                runs.append(one_compute(client, workers, mode))
        ideal = TASKS * TASK_S / len(workers)
        print(
            f"{TASKS} tasks of {TASK_S * 1e3:.0f} ms on {len(workers)} workers "
            f"({ideal * 1e3:.0f} ms if spread perfectly); {args.rounds} rounds, medians"
        )
        for mode, runs in figures.items():
            wall = statistics.median(r[0] for r in runs)
            first = statistics.median(r[1][0] for r in runs)
            second = statistics.median(r[1][1] for r in runs)
            print(
                f"  {mode:6}  {wall * 1e3:.1f} ms a compute ({wall / ideal:.2f}x the ideal); "
                f"first task started at {first * 1e3:.1f} ms, second at {second * 1e3:.1f} ms"
            )
    finally:
        client.close()
        cluster.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
