"""A pipeline on a Dask distributed cluster (or Ray), tierflow still driving.

    python examples/cluster_pipeline.py                        # starts a LocalCluster
    python examples/cluster_pipeline.py --address tcp://host:8786 --dir /shared/tmp
    python examples/cluster_pipeline.py --ray                  # a local Ray instead

A float32 file is generated in a temporary folder (``--dir``: on a real cluster, a
folder every worker mounts at the same path), then the same pipeline runs on the
cluster and on local threads: a standardised copy written with ``to_npy`` (the workers
write their rows into the file), a plain-Python score per row reduced to its column
sums, and a masked selection brought back to the driver. The script prints how long
each took and whether the cluster's results match the local ones byte for byte, and
removes what it made.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import tierflow as tw


def score(block: np.ndarray) -> np.ndarray:
    """A score per row, in plain Python (it holds the GIL, as a parser would)."""
    out = np.empty((len(block), 1), np.float64)
    for i, row in enumerate(block.tolist()):
        out[i, 0] = sum(v * v if v > 0 else -v for v in row)
    return out


def pipeline(path: str, out: str, executor: Any) -> tuple[np.ndarray, np.ndarray, float]:
    """Run the pipeline on ``executor``: the scores' sums, the masked rows, seconds."""
    start = time.perf_counter()
    x = tw.from_npy(path)
    z = (x - x.mean(axis=0)) / x.std(axis=0)
    z.to_npy(out, executor=executor, progress=False)
    sums = x.map_blocks(score, dtype=np.float64, row_shape=(1,)).sum(axis=0)
    totals = sums.compute(executor=executor, progress=False)
    kept = x[x[:, 0] > 2.0].compute(executor=executor, progress=False)
    return totals, kept, time.perf_counter() - start


def quiet_close(client: Any) -> None:
    """Drop the one error distributed logs, with a traceback, as its workers close.

    A worker that closes while its heartbeat to the scheduler is in flight closes that
    connection under it and logs "Failed to communicate with scheduler during heartbeat"
    with a traceback (dask/distributed#7192): harmless, but printed on this script's
    stderr. A filter in each worker drops that record, and only while the worker closes.
    """
    import logging

    from distributed.core import Status
    from distributed.diagnostics.plugin import WorkerPlugin

    closing = (Status.closing, Status.closing_gracefully, Status.closed)

    class QuietClose(WorkerPlugin):
        name = "quiet-close"

        def setup(self, worker: Any) -> None:
            class HeartbeatWhileClosing(logging.Filter):
                def filter(self, record: logging.LogRecord) -> bool:
                    message = record.getMessage()
                    heartbeat = message.startswith("Failed to communicate with scheduler")
                    return not (heartbeat and worker.status in closing)

            # never removed: a closing worker tears its plugins down before the record
            logging.getLogger("distributed.worker").addFilter(HeartbeatWhileClosing())

    client.register_plugin(QuietClose())


def cluster(args: argparse.Namespace, scratch: str) -> tuple[Any, Any]:
    """The executor to use and what to close at the end."""
    if args.ray:
        import ray

        if args.address:
            ray.init(address=args.address)
            return tw.RayExecutor(), ray.shutdown
        # Ray's sockets live in its temporary folder, whose path must stay short.
        temp = tempfile.mkdtemp(prefix="tfray-", dir="/tmp")
        ray.init(
            num_cpus=args.workers, include_dashboard=False, log_to_driver=False, _temp_dir=temp
        )

        def stop() -> None:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)

        return tw.RayExecutor(), stop
    import dask
    from distributed import Client, LocalCluster

    if args.address:
        client = Client(args.address)
        return tw.DaskExecutor(client), client.close
    dask.config.set({"temporary-directory": scratch})  # the workers' scratch, removed
    local = LocalCluster(
        n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None
    )
    client = Client(local)
    quiet_close(client)  # a cluster of the user's own (--address) keeps its logging

    def close() -> None:
        client.close()
        local.close()

    return tw.DaskExecutor(client), close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=lambda s: int(s.replace("_", "")), default=400_000)
    parser.add_argument("--address", default=None, help="a Dask scheduler (or Ray) address")
    parser.add_argument("--ray", action="store_true", help="run on Ray instead of Dask")
    parser.add_argument("--workers", type=int, default=2, help="workers of a local cluster")
    parser.add_argument("--dir", default=None, help="a folder every worker sees")
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="tierflow-cluster-", dir=args.dir)
    close = None
    try:
        path = os.path.join(folder, "x.npy")
        data = np.random.default_rng(0).standard_normal((args.rows, 8), dtype=np.float32)
        np.save(path, data)
        executor, close = cluster(args, os.path.join(folder, "scratch"))
        print(f"{args.rows:,} rows x 8 float32 on {executor!r}")
        there = pipeline(path, os.path.join(folder, "z-cluster.npy"), executor)
        here = pipeline(path, os.path.join(folder, "z-local.npy"), "threads")
        print(f"cluster: {there[2]:.2f} s, local threads: {here[2]:.2f} s")
        same_file = np.array_equal(
            np.load(os.path.join(folder, "z-cluster.npy")),
            np.load(os.path.join(folder, "z-local.npy")),
        )
        print(f"standardised file identical: {same_file}")
        print(f"score sums identical: {np.array_equal(there[0], here[0])}")
        print(f"masked rows identical: {np.array_equal(there[1], here[1])} ({len(here[1]):,} rows)")
    finally:
        if close is not None:
            close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
