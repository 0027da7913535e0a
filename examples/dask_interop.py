"""Move one step of a dask.array pipeline into tierflow, and back.

    python examples/dask_interop.py                  # dask's threaded scheduler
    python examples/dask_interop.py --distributed    # a local cluster of 2 processes

A dask pipeline standardises a (rows, 8) float32 array; its slowest step, a function
written in plain Python over every row, moves to tierflow with
``tw.from_dask(d).map_blocks(f).to_dask()``, and the rest stays in dask. The chunks
line up (one tierflow block per dask row chunk), the result matches dask alone, and
after a boolean mask (chunk sizes dask does not know) tierflow still reads the rows.
Needs the ``dask`` extra (``pip install -e '.[dask]'`` in the tierflow checkout).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from typing import Any

import numpy as np

import tierflow as tw
from tierflow.errors import install_command


def score(block: np.ndarray) -> np.ndarray:
    """A score per row, computed row by row in plain Python (a parser, a rule engine)."""
    out = np.empty((len(block), 1), np.float32)
    for i, row in enumerate(block.tolist()):
        out[i, 0] = sum(v * v if v > 0 else -v for v in row)
    return out


def run(rows: int, compute: Any) -> None:
    import dask.array as da

    data = np.random.default_rng(0).standard_normal((rows, 8), dtype=np.float32)
    d = da.from_array(data, chunks=(rows // 8, 4))
    standardised = (d - d.mean(axis=0)) / d.std(axis=0)  # dask

    start = time.perf_counter()
    scored = tw.from_dask(standardised).map_blocks(score).to_dask()  # tierflow, back to dask
    ranked = scored / scored.max()  # dask again
    got = compute(ranked)
    seconds = time.perf_counter() - start
    # dask alone: score needs whole rows, so the columns go into one chunk first
    whole_rows = standardised.rechunk((rows // 8, 8))
    alone = compute(whole_rows.map_blocks(score, chunks=(rows // 8, 1), dtype=np.float32))
    want = alone / alone.max()
    print(
        f"dask -> tierflow -> dask: {got.shape} {got.dtype} in {len(scored.chunks[0])} "
        f"chunks, {seconds:.2f} s; matches dask alone: {np.allclose(got, want, rtol=1e-5)}"
    )

    kept = standardised[standardised[:, 0] > 1]  # chunk sizes now unknown (NaN)
    x = tw.from_dask(kept)
    mean = x.mean(axis=0).compute()
    expect = compute(kept.mean(axis=0))
    print(
        f"after a dask mask: shape {x.shape}, {x.nblocks} blocks of unknown size; "
        f"tierflow's mean matches dask's: {np.allclose(mean, expect, rtol=1e-4, atol=1e-5)}"
    )


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=lambda s: int(s.replace("_", "")), default=200_000)
    parser.add_argument("--distributed", action="store_true", help="run on a LocalCluster")
    args = parser.parse_args()
    try:
        import dask.array
    except ImportError:
        print(f"this example needs dask: {install_command('dask')}")
        return
    if not args.distributed:
        run(args.rows, lambda a: a.compute(scheduler="threads"))
        return
    import logging

    import dask
    from distributed import Client, LocalCluster

    scratch = tempfile.mkdtemp(prefix="tierflow-dask-")  # the workers' folders, removed
    try:
        with (
            dask.config.set({"temporary-directory": scratch}),
            LocalCluster(
                n_workers=2,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            ) as cluster,
            Client(cluster) as client,
        ):
            quiet_close(client)
            print(f"on a distributed cluster of {len(cluster.workers)} worker processes")
            run(args.rows, lambda a: client.compute(a).result())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
