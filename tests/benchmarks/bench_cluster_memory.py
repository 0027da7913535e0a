"""A Dask worker with a 300 MB memory limit and a 1 GB ``.npy``: tierflow vs dask.array.

One ``LocalCluster(n_workers=1, threads_per_worker=1, memory_limit="300MB")``; a
float32 ``[32M, 8]`` file (1 GiB) generated in a temporary folder and removed at the
end. On that one cluster, in turn:

* dask.array, first (a ``DaskExecutor`` sets the scheduler's ``allowed-failures`` to 0,
  which would take dask.array's own retries away): ``np.sqrt(x * 2 + 1).sum(axis=0)``
  and ``x * 2 + 1`` saved with ``da.to_npy_stack``, with ``x`` made two ways:
  ``da.from_array(np.load(path, mmap_mode="r"))`` (what the dask.array docs show for
  a ``.npy``), and the file read by path in each task (``from_delayed`` of an
  ``np.load(mmap_mode="r")`` slice), both in 1M-row chunks;
* then tierflow, ``executor=tw.DaskExecutor(client)``: the same sum, and
  ``(x * 2 + 1).to_npy(...)`` (the workers read the file by path and write the
  output's rows in place).

Each run: its outcome (``ok``, or the error: Dask's ``KilledWorker`` after its nanny
restarted the worker ``allowed-failures + 1`` times), its seconds, and how many times
the nanny restarted the worker for memory. A run that is killed is recorded, not
failed. Results are checked against NumPy (sums to 1e-6 relative).

Run: ``python tests/benchmarks/bench_cluster_memory.py`` (about 2 minutes; prints a
Markdown table).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS, COLS = 32 << 20, 8
CHUNK = 1 << 20
TIMEOUT = 300.0  # seconds one run may take before it is recorded as stuck


def write_big(path: Path) -> np.ndarray:
    """The file, and the column sums of ``sqrt(x * 2 + 1)`` by NumPy (float64)."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(ROWS, COLS))
    base = (np.arange(CHUNK * COLS, dtype=np.float32) % 997).reshape(CHUNK, COLS)
    total = np.zeros(COLS)
    for a in range(0, ROWS, CHUNK):
        out[a : a + CHUNK] = base + a // CHUNK
        total += np.sqrt(out[a : a + CHUNK] * 2 + 1).sum(axis=0, dtype=np.float64)
    out.flush()
    del out
    return total


def restarts(client: Any) -> int:
    return len(client.get_events("worker-restart-memory"))


def run(name: str, client: Any, fn: Any, check: Any) -> dict[str, Any]:
    before = restarts(client)
    start = time.perf_counter()
    try:
        value = fn()
        outcome = "ok" if check(value) else "wrong result"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {str(exc)[:90]}"
    seconds = time.perf_counter() - start
    # The nanny's event reaches the scheduler a moment after the death.
    time.sleep(1.0)
    found = {"run": name, "outcome": outcome, "seconds": seconds}
    found["restarts"] = restarts(client) - before
    print(f"{name}: {found}", file=sys.stderr, flush=True)
    client.wait_for_workers(1, timeout=60)
    return found


def main() -> None:
    import dask
    import dask.array as da
    from distributed import Client, LocalCluster

    import tierflow as tw

    folder = Path(tempfile.mkdtemp(prefix="bench-cluster-memory-"))
    os.environ.setdefault("TIERFLOW_SPILL_DIR", str(folder / "spill"))
    cluster = LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        memory_limit="300MB",
        processes=True,
        dashboard_address=None,
        silence_logs=logging.CRITICAL,
    )
    client = Client(cluster)
    rows: list[dict[str, Any]] = []
    try:
        path = folder / "big.npy"
        expected = write_big(path)

        def close(value: Any) -> bool:
            return bool(np.allclose(np.asarray(value, np.float64), expected, rtol=1e-6))

        def same_file(out: Path) -> bool:
            got = np.load(out, mmap_mode="r")
            src = np.load(path, mmap_mode="r")
            return all(
                np.array_equal(got[a : a + CHUNK], src[a : a + CHUNK] * 2 + 1)
                for a in range(0, ROWS, CHUNK)
            )

        def same_stack(out: Path) -> bool:
            got = da.from_npy_stack(str(out))
            src = np.load(path, mmap_mode="r")
            return all(
                np.array_equal(np.asarray(got[a : a + CHUNK]), src[a : a + CHUNK] * 2 + 1)
                for a in range(0, ROWS, CHUNK)
            )

        def by_path() -> Any:
            def load(a: int, b: int) -> np.ndarray:
                return np.asarray(np.load(path, mmap_mode="r")[a:b])

            parts = [
                da.from_delayed(
                    dask.delayed(load)(a, min(a + CHUNK, ROWS)),
                    (min(CHUNK, ROWS - a), COLS),
                    np.float32,
                )
                for a in range(0, ROWS, CHUNK)
            ]
            return da.concatenate(parts)

        def from_memmap() -> Any:
            return da.from_array(np.load(path, mmap_mode="r"), chunks=(CHUNK, COLS))

        for how, make in (("from_array(memmap)", from_memmap), ("by path", by_path)):
            rows.append(
                run(
                    f"dask.array {how} sum",
                    client,
                    lambda make=make: client.compute(
                        da.sqrt(make() * 2 + 1).sum(axis=0, dtype=np.float64)
                    ).result(timeout=TIMEOUT),
                    close,
                )
            )
            stack = folder / f"stack-{len(rows)}"
            rows.append(
                run(
                    f"dask.array {how} to_npy_stack",
                    client,
                    lambda make=make, stack=stack: (
                        da.to_npy_stack(str(stack), make() * 2 + 1) or stack
                    ),
                    same_stack,
                )
            )
        executor = tw.DaskExecutor(client)
        x = tw.from_npy(path)
        rows.append(
            run(
                "tierflow sum",
                client,
                lambda: np.sqrt(x * 2 + 1).sum(axis=0).compute(executor=executor, progress=False),
                close,
            )
        )
        out = folder / "tierflow.npy"
        rows.append(
            run(
                "tierflow to_npy",
                client,
                lambda: (x * 2 + 1).to_npy(out, executor=executor, progress=False) or out,
                same_file,
            )
        )
        out.unlink(missing_ok=True)

    finally:
        client.close()
        cluster.close()
        for p in sorted(folder.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        folder.rmdir()
    print("| run | outcome | seconds | nanny restarts for memory |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['outcome']} | {r['seconds']:.1f} | {r['restarts']} |")


if __name__ == "__main__":
    main()
