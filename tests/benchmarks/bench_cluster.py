"""tierflow on a Dask distributed cluster and on Ray, against threads and dask.array.

Both clusters are local, on this machine: a ``distributed.LocalCluster(n_workers=2,
threads_per_worker=1, processes=True, dashboard_address=None)`` and
``ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)``.
tierflow drives (``tw.DaskExecutor(client)``, ``tw.RayExecutor()``); its block tasks run
in the workers. Each engine's figures come from one child process (``bench_cluster.py
--child ENGINE ...``) that starts its cluster, measures, and closes it: the cluster's
start is timed and reported, outside the measured rounds. Three parts, each selectable with ``--only``;
every ratio is measured in one run, alternating the contenders round by round (medians
and ranges over the rounds), never bare times. Each timed compute starts after a
``gc.collect()`` outside its time, as ``timeit`` keeps the collector out of its times:
otherwise one contender's garbage sets off a collection in the next one's compute:

1. ``mapblocks`` (issue 12: >= 1.7x threads): the pure-Python per-row function of
   ``bench_processes.py`` (:func:`bench_processes.per_row`, about 5 us a row with the
   GIL held) through ``map_blocks`` on a float32 ``[200,000, 8]`` ``.npy`` read by path
   (``tw.from_npy``, 5,000-row blocks, 40 tasks), as ``.sum(axis=0)`` (a partial of 8
   values a block comes back) and ``.compute()`` (160 KB blocks, which the workers write
   to the shared folder and the driver maps). After one warm-up compute on each (the
   cluster's is reported as its *first*: it sends the program and probes the source),
   each round runs ``[threads, ENGINE]`` on both cases; a round's ratio is threads /
   engine.
2. ``columns`` (issue 26): ``x.sum(axis=0)`` (``sum``), the fused
   ``np.sqrt(x * 2 + 1).sum(axis=0)`` (``chain``), and ``x.mean(axis=0)`` with
   ``x.std(axis=0)`` in one compute (``meanstd``) on a float32 ``[N, 8]`` ``.npy`` of
   ``--size-gb`` (default 4 GB, decimal), its page cache warm before every compute.
   tierflow on the cluster reads the file by path in 32 MB blocks
   (``tw.from_npy(path, rows=1,048,576)``). Its contenders, each in the same 32 MB
   blocks:

   - tierflow on local threads in the driver (target: the cluster >= 0.8x its speed,
     ratio threads / cluster);
   - on Dask, **dask.array reading each chunk by path**, as a user who knows dask writes
     it: ``da.concatenate`` of ``da.from_delayed(delayed(read)(path, a, b))``, ``read``
     copying a slice of ``np.load(path, mmap_mode="r")`` in the worker, computed with
     ``client.compute`` on the same cluster (target: tierflow >= 3x, ratio dask.array /
     tierflow);
   - on Dask, **dask.array as a newcomer writes it**,
     ``da.from_array(np.load(path, mmap_mode="r"), chunks=(1,048,576, 8))``, made inside
     the measured part (``from_array`` copies the memmap into the driver's RAM, and the
     copy then travels whole to the workers that read it): shown, no target. It is not
     run on a file whose copies would not fit: :data:`DASK_FOOTPRINT` times the file over
     :data:`DASK_ROOM` of the available memory (the kernel's OOM killer would pick any
     process on the machine); a smaller ``--size-gb`` measures it.

   tierflow on Ray is measured against threads the same way; its ratio to dask.array by
   path (from the Dask child) is shown as an extra, not a target.
   **Peak RSS per worker**: the child samples every worker process's ``VmRSS`` and
   ``RssAnon`` (``/proc/<pid>/status``) every 20 ms from the driver while each contender
   runs, and keeps each worker's peak over that contender's computes and its largest
   growth within one compute (a worker keeps what the other contender left it), and
   the same for the driver (the workers are Dask's worker processes, not their
   nannies; Ray's are the processes titled
   ``ray::...``). ``RSS`` counts the file's mapped pages, which the kernel can drop;
   ``anonymous`` is the heap and copies.
   **CPU a compute**: the driver's (``time.process_time``, all its threads: on Dask the
   scheduler's too), the workers', and that of every process the driver started (Dask's
   nannies and workers; Ray's raylet, GCS and workers), from ``/proc/<pid>/stat`` (in
   ticks of 10 ms: medians over the rounds). From it, the most tierflow on the cluster
   could reach against threads on this machine: threads' seconds / (that CPU / the
   cores), as though the cores ran nothing else and never waited (shown, no target).
3. ``overhead`` (issue 12: <= 1 ms a task on Dask, <= 2 ms on Ray): 2,000 tiny block
   tasks, ``tw.from_array(np.zeros((2000, 1), "float32"), rows=1).sum(axis=0)``. The
   cost per task is (the compute's wall time on the cluster - the work) / the block
   tasks the engine reports, where the work is the same compute on the ``serial``
   executor in the driver (the kernels and tierflow's own per-task work, one task after
   another): so it counts what running on the cluster adds per task, i.e. sending the
   task, the engine's scheduling and transfers both ways, the worker's dispatch and
   the driver's handling of the result, less what overlaps across the two workers.
   Shown too: the seconds the tasks ran in the workers (as ``run_block`` measured them)
   summed, and the engine's own floor on this machine: as many trivial tasks
   submitted at once and their results fetched at once, straight on Dask
   (``client.map`` + ``client.gather``) or Ray (``ray.get`` of the ``.remote`` calls),
   wall time per task. After a warm-up compute on each, ``--rounds`` rounds of
   ``[serial, ENGINE, floor]``; the median.

``--quiet CORES`` makes each round wait first (up to ``--quiet-wait`` seconds, default
120) until the rest of the machine uses under ``CORES`` cores
(:func:`bench_processes.wait_quiet`); the 1-minute load average is recorded at the
start, after every round and at the end. Every result is checked: a computed array
bitwise against threads', a sum within 1e-6 relative of threads' (dask.array's float32
sums are shown against tierflow's, not checked).

``python tests/benchmarks/bench_cluster.py [--only mapblocks,columns,overhead]
[--engines dask,ray] [--size-gb 4] [--rounds 5] [--column-rounds 3] [--quiet CORES]
[--quiet-wait S] [--dir DIR] [--json figures.json]`` prints the figures and a table of the targets (PASS/MISS; exit
status 1 on a MISS only with ``--strict``). The generated files live in a temporary
folder under ``--dir`` and are removed at the end. ``make bench`` runs the
pytest-benchmark test below on tiny sizes (20,000 rows, a 16 MB file, 200 tasks, one
round): it asserts that every contender ran and that the cluster results equal threads',
and records the figures in ``extra_info``; speed targets are not asserted there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import emit, ensure_warm, make_npy, run_sampled, save_figures, span, status, verdict
from bench_processes import _cpu_seconds, _difference, _Tasks, per_row, wait_quiet

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

GB = 10**9  # decimal, as the design's figures
MB = 1 << 20
WIDTH = 8
MAP_ROWS = 200_000  # part 1: bench_processes.py's data
MAP_BLOCK_ROWS = 5_000
COLUMN_BLOCK_ROWS = (32 * MB) // (4 * WIDTH)  # part 2: 32 MB blocks, both contenders
TINY_TASKS = 2_000  # part 3
ROUNDS = 5
COLUMN_ROUNDS = 3
MAP_TARGET = 1.7  # engine / threads, per-row map_blocks
COLUMN_TARGET = 3.0  # tierflow on Dask / dask.array reading by path, on the same cluster
CLUSTER_TARGET = 0.8  # tierflow on the cluster / tierflow on local threads
# dask.array's peak memory over the file's size, driver and workers together (measured on
# a 0.5 GB file: 4.6x in the driver, 3.2x in one worker), and the share of the machine's
# available memory it may take: above it, it is not run, so as not to bring down the
# machine (the kernel's OOM killer picks any process, not necessarily dask's).
DASK_FOOTPRINT = 8.5
DASK_ROOM = 0.7
OVERHEAD_TARGET = {"dask": 1e-3, "ray": 2e-3}  # seconds per task, at most
SUM_RTOL = 1e-6
SAMPLE_S = 0.02
QUIET_TIMEOUT_S = 120.0
TIMEOUT_S = 3600.0
PARTS = ("mapblocks", "columns", "overhead")
ENGINES = ("dask", "ray")
MAP_CASES = ("sum", "compute")
COLUMN_CASES = ("sum", "chain", "meanstd")
BY_PATH = "dask.array"  # dask.array reading each chunk by path
NEWCOMER = "dask.array from_array"  # dask.array over a memmap, through from_array

BENCH_ROWS = int(os.environ.get("TIERFLOW_BENCH_CLUSTER_ROWS", "20000"))
BENCH_SIZE_GB = float(os.environ.get("TIERFLOW_BENCH_CLUSTER_SIZE_GB", "0.016"))
BENCH_TASKS = int(os.environ.get("TIERFLOW_BENCH_CLUSTER_TASKS", "200"))


@dataclass(frozen=True)
class Options:
    """What a run measures: the parts and engines, the sizes, the rounds, and the wait for
    a quiet machine before each round (``quiet``: the cores other work may use)."""

    parts: tuple[str, ...] = PARTS
    engines: tuple[str, ...] = ENGINES
    rows: int = MAP_ROWS
    size_gb: float = 4.0
    tasks: int = TINY_TASKS
    rounds: int = ROUNDS
    column_rounds: int = COLUMN_ROUNDS
    quiet: float | None = None
    quiet_wait: float = QUIET_TIMEOUT_S


# -- the child side: one engine's cluster, every part on it -------------------------------


@dataclass(frozen=True)
class Cluster:
    """The child's engine: its name, the Dask client (None on Ray), tierflow's executor
    on it, a function listing its worker processes' pids, and one that waits until the
    cluster has let go of the last compute's work (:func:`_dask_settle`)."""

    engine: str
    client: Any
    executor: Any
    workers: Callable[[], list[int]]
    settle: Callable[[], None] | None = None


@contextlib.contextmanager
def dask_cluster() -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """A 2-worker LocalCluster, its client and tierflow's executor on it; the figures
    record how long the cluster's start and the executor's setup took, and the slots."""
    from distributed import Client, LocalCluster

    import tierflow as tw

    start = time.perf_counter()
    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    )
    client = Client(cluster)
    client.wait_for_workers(2)
    started = time.perf_counter() - start
    executor = tw.DaskExecutor(client)
    figures = {
        "start_s": started,
        "executor_s": time.perf_counter() - start - started,
        "slots": executor.workers,
    }
    try:
        yield client, executor, figures
    finally:
        client.close()
        cluster.close()


@contextlib.contextmanager
def ray_cluster() -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """A local Ray instance with 2 CPUs (a new one, never someone else's) and tierflow's
    executor on it."""
    import ray

    import tierflow as tw

    start = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter() - start
    executor = tw.RayExecutor()
    figures = {
        "start_s": started,
        "executor_s": time.perf_counter() - start - started,
        "slots": executor.workers,
    }
    try:
        yield None, executor, figures
    finally:
        ray.shutdown()


def _dask_workers(client: Any) -> Callable[[], list[int]]:
    pids = sorted(client.run(os.getpid).values())
    return lambda: pids


def _ray_workers() -> list[int]:
    """This process's descendants titled ``ray::...``: Ray's worker processes (Ray may
    start one at any time, so they are listed again while sampling)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::"):
                found.append(p.pid)
    return found


class WorkerMemory:
    """Samples the RSS of the worker processes every 20 ms in a thread while a ``with``
    block runs. Per worker, over every block: the peak ``VmRSS`` and ``RssAnon`` (bytes)
    and the largest growth of each over its first sample in a block (a worker keeps
    memory another contender's compute left it, which the growth leaves out)."""

    def __init__(self, workers: Callable[[], list[int]]) -> None:
        self.workers = workers
        self.peaks: dict[int, dict[str, int]] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WorkerMemory:
        self._done.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        assert self._thread is not None
        self._thread.join()

    def _sample(self) -> None:
        pids = [os.getpid(), *self.workers()]
        listed = time.monotonic()
        first: dict[int, dict[str, int]] = {}
        while True:
            for pid in pids:
                with contextlib.suppress(OSError):
                    s = status(pid)
                    now = {"rss": s.get("VmRSS", 0), "anon": s.get("RssAnon", 0)}
                    start = first.setdefault(pid, now)
                    peak = self.peaks.setdefault(
                        pid, {"rss": 0, "anon": 0, "rss_growth": 0, "anon_growth": 0}
                    )
                    for key in ("rss", "anon"):
                        peak[key] = max(peak[key], now[key])
                        peak[f"{key}_growth"] = max(peak[f"{key}_growth"], now[key] - start[key])
            if self._done.wait(SAMPLE_S):
                return
            if time.monotonic() - listed > 0.5:
                pids, listed = [os.getpid(), *self.workers()], time.monotonic()

    def worker_peaks(self) -> list[dict[str, int]]:
        """Each worker's figures, highest peak RSS first."""
        workers = [p for pid, p in self.peaks.items() if pid != os.getpid()]
        return sorted(workers, key=lambda p: p["rss"], reverse=True)

    def driver_peak(self) -> dict[str, int]:
        """The same figures for this process, the driver."""
        return self.peaks.get(os.getpid(), {})


def _timed(
    compute: Callable[[Any], Any],
    workers: Sequence[int] = (),
    settle: Callable[[], None] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """One compute: its result and figures. ``compute(callbacks)`` runs it; the tasks'
    seconds are as the engine reports them (in the worker, on a cluster). ``settle``
    runs first, outside the time."""
    tasks = _Tasks()
    if settle is not None:
        settle()
    # Collected first, outside the time (timeit turns the collector off for the same
    # reason): a collection the previous contender's garbage set off would otherwise
    # land in this one's time (a 20 ms pause at the start of a 1 GB compute, seen).
    gc.collect()
    before = _cpu_seconds(workers)
    others = _descendants_cpu()
    cpu = time.process_time()
    start = time.perf_counter()
    result = compute(tasks)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    after = _cpu_seconds(workers)
    others_after = _descendants_cpu()
    return result, {
        "seconds": seconds,
        "driver_cpu": cpu,
        "worker_cpu": sum(t - before.get(pid, 0.0) for pid, t in after.items()),
        "processes_cpu": sum(t - others.get(pid, 0.0) for pid, t in others_after.items()),
        "busy": tasks.busy,
        "blocks": tasks.blocks,
    }


def _descendants_cpu() -> dict[int, float]:
    """CPU seconds so far of every process this one started, and theirs: the engine's
    processes on this machine (Dask's nannies and workers; Ray's raylet, GCS and
    workers)."""
    import psutil

    return _cpu_seconds([p.pid for p in psutil.Process().children(recursive=True)])


SETTLE_S = 10.0  # longest wait of _dask_settle


def _dask_settle(client: Any) -> Callable[[], None]:
    """Wait (up to :data:`SETTLE_S`) until neither the scheduler nor a worker holds a
    computed task any more, then collect the workers' garbage. A contender's results are
    let go after its compute returns: without this, the workers freed the 1 GB that
    ``from_array`` had sent them, and collected its garbage, inside the time of the
    contender after it (tierflow's 1 GB sum: 138 ms instead of 76 ms, seen)."""

    def settle() -> None:
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            held = client.run_on_scheduler(_scheduler_tasks)
            if not held and not any(client.run(_worker_tasks).values()):
                break
            time.sleep(0.01)
        client.run(gc.collect)

    return settle


def _scheduler_tasks(dask_scheduler: Any) -> int:
    """Tasks with code to run (not scattered data, such as tierflow's programs) that the
    scheduler still holds."""
    return sum(1 for ts in list(dask_scheduler.tasks.values()) if ts.run_spec is not None)


def _worker_tasks(dask_worker: Any) -> int:
    """The same, held by a worker."""
    return sum(1 for ts in list(dask_worker.state.tasks.values()) if ts.run_spec is not None)


def _load() -> float:
    return os.getloadavg()[0]


def quiet(options: Options, waits: list[tuple[float, float]]) -> None:
    if options.quiet is not None:
        waits.append(wait_quiet(options.quiet, options.quiet_wait))


def measure_mapblocks(path: str, cluster: Cluster, options: Options) -> dict[str, Any]:
    """Part 1: warm-ups, then ``rounds`` rounds of ``[threads, engine]`` on each case."""
    import tierflow as tw

    engine, executor, workers = cluster.engine, cluster.executor, cluster.workers

    mapped = tw.from_npy(path, rows=MAP_BLOCK_ROWS).map_blocks(
        per_row, dtype=np.float32, row_shape=(WIDTH,)
    )
    lazies = {"sum": mapped.sum(axis=0), "compute": mapped}

    def run(case: str, on: Any) -> Callable[[Any], Any]:
        return lambda cb: np.asarray(
            lazies[case].compute(executor=on, progress=False, callbacks=cb)
        )

    plain = _plain_map(cluster, path)
    cases: dict[str, Any] = {}
    references: dict[str, Any] = {}
    _timed(plain, settle=cluster.settle)
    for case in MAP_CASES:
        references[case], warm = _timed(run(case, "threads"), settle=cluster.settle)
        got, first = _timed(run(case, executor), workers=workers(), settle=cluster.settle)
        cases[case] = {"warm_threads": warm, "first": first, "rounds": [], "difference": {}}
        cases[case]["difference"][engine] = _difference(got, references[case], case)
    waits: list[tuple[float, float]] = []
    for _ in range(options.rounds):
        quiet(options, waits)
        for case in MAP_CASES:
            row: dict[str, Any] = {}
            _, row["threads"] = _timed(run(case, "threads"), settle=cluster.settle)
            got, row[engine] = _timed(run(case, executor), workers=workers(), settle=cluster.settle)
            found = _difference(got, references[case], case)
            cases[case]["difference"][engine] = max(cases[case]["difference"][engine], found)
            if case == "sum":
                got, row["plain"] = _timed(plain, settle=cluster.settle)
                found = _difference(got, references[case], case)
                cases[case]["difference"]["plain"] = max(
                    cases[case]["difference"].get("plain", 0.0), found
                )
            row["load"] = _load()
            cases[case]["rounds"].append(row)
    return {"cases": cases, "quiet_waits": waits}


def _block_sum(path: str, start: int, stop: int) -> np.ndarray:
    rows = np.asarray(np.load(path, mmap_mode="r")[start:stop])
    return per_row(rows).sum(axis=0)


def _plain_map(cluster: Cluster, path: str) -> Callable[[Any], Any]:
    """Part 1's sum straight on the engine, without tierflow: one task per block (the
    same rows, read the same way, the same function), all submitted at once, the
    blocks' sums fetched at once and added up in the driver (``client.map`` +
    ``client.gather``; ``ray.get`` of the ``.remote`` calls). What the engine itself
    reaches on this work, on the same workers."""
    n = len(np.load(path, mmap_mode="r"))
    starts = list(range(0, n, MAP_BLOCK_ROWS))
    stops = [min(n, a + MAP_BLOCK_ROWS) for a in starts]

    def total(parts: list[np.ndarray]) -> np.ndarray:
        out = np.zeros(WIDTH, np.float32)
        for part in parts:
            out += part
        return out

    if cluster.engine == "dask":
        client = cluster.client

        def on_dask(cb: Any) -> Any:
            paths = [path] * len(starts)
            return total(client.gather(client.map(_block_sum, paths, starts, stops, pure=False)))

        return on_dask
    import ray

    remote = ray.remote(num_cpus=1)(_block_sum)

    def on_ray(cb: Any) -> Any:
        return total(
            ray.get([remote.remote(path, a, b) for a, b in zip(starts, stops, strict=True)])
        )

    return on_ray


def _dask_array(path: str) -> Any:
    """dask.array as a newcomer writes it: ``from_array`` over a memmap."""
    import dask.array as da

    return da.from_array(np.load(path, mmap_mode="r"), chunks=(COLUMN_BLOCK_ROWS, WIDTH))


def _read_rows(path: str, a: int, b: int) -> np.ndarray:
    """Rows ``[a, b)`` of the ``.npy`` at ``path``, read into the worker's memory (a
    slice of a memmap left mapped would count the file's pages in the worker's RSS,
    which Dask's memory monitor reads: at 4 GB it paused the workers)."""
    return np.array(np.load(path, mmap_mode="r")[a:b])


def _dask_by_path(path: str) -> Any:
    """dask.array reading each chunk by path in the worker that computes it."""
    import dask
    import dask.array as da

    n = int(np.load(path, mmap_mode="r").shape[0])
    read = dask.delayed(_read_rows, pure=True)
    return da.concatenate(
        [
            da.from_delayed(
                read(path, a, min(a + COLUMN_BLOCK_ROWS, n)),
                (min(COLUMN_BLOCK_ROWS, n - a), WIDTH),
                np.float32,
            )
            for a in range(0, n, COLUMN_BLOCK_ROWS)
        ]
    )


def _too_big_for_dask(path: str) -> str:
    """Why dask.array is not run on this file ("" when it is): its footprint would not
    fit the machine's available memory (:data:`DASK_FOOTPRINT`)."""
    size = os.path.getsize(path)
    available = _available_memory()
    need = DASK_FOOTPRINT * size
    if need <= DASK_ROOM * available:
        return ""
    return (
        f"it would need about {need / GB:.1f} GB ({DASK_FOOTPRINT:g}x the {size / GB:.2f} GB "
        f"file: from_array copies it into the driver, and the copy travels whole to the "
        f"workers), and {available / GB:.1f} GB is available; run part 2 with a smaller "
        "--size-gb for the pair"
    )


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _column_exprs(x: Any, case: str) -> list[Any]:
    if case == "sum":
        return [x.sum(axis=0)]
    if case == "chain":
        return [np.sqrt(x * 2 + 1).sum(axis=0)]
    return [x.mean(axis=0), x.std(axis=0)]


def measure_columns(path: str, cluster: Cluster, options: Options) -> dict[str, Any]:
    """Part 2: per round and case, tierflow on the cluster, then the other contender
    (dask.array on the same cluster for Dask, tierflow on threads for Ray); the file's
    page cache warm before each."""
    import tierflow as tw

    engine, client, executor, workers = (
        cluster.engine, cluster.client, cluster.executor, cluster.workers,
    )  # fmt: skip

    def tierflow_on(on: Any, case: str) -> Callable[[Any], Any]:
        def compute(cb: Any) -> Any:
            x = tw.from_npy(path, rows=COLUMN_BLOCK_ROWS)
            found = tw.compute(*_column_exprs(x, case), executor=on, progress=False, callbacks=cb)
            return np.concatenate([np.asarray(r, np.float64) for r in found])

        return compute

    def dask_on_cluster(make: Callable[[str], Any], case: str) -> Callable[[Any], Any]:
        def compute(cb: Any) -> Any:
            found = client.gather(client.compute(_column_exprs(make(path), case)))
            return np.concatenate([np.asarray(r, np.float64) for r in found])

        return compute

    contenders: dict[str, Callable[[str], Callable[[Any], Any]]] = {
        "tierflow": lambda case: tierflow_on(executor, case),
        "threads": lambda case: tierflow_on("threads", case),
    }
    skipped = ""
    if engine == "dask":
        contenders[BY_PATH] = lambda case: dask_on_cluster(_dask_by_path, case)
        skipped = _too_big_for_dask(path)
        if not skipped:
            contenders[NEWCOMER] = lambda case: dask_on_cluster(_dask_array, case)
    memory = {name: WorkerMemory(workers) for name in contenders}
    cases: dict[str, Any] = {
        c: {"rounds": [], "difference": {}, "results": {}} for c in COLUMN_CASES
    }
    references: dict[str, Any] = {}
    for case in COLUMN_CASES:  # the reference, and the program's first run on the cluster
        ensure_warm(path)
        references[case], _ = _timed(tierflow_on("threads", case), settle=cluster.settle)
        cases[case]["results"]["threads"] = references[case]
        ensure_warm(path)
        _, cases[case]["first"] = _timed(tierflow_on(executor, case), settle=cluster.settle)
    waits: list[tuple[float, float]] = []
    for _ in range(options.column_rounds):
        quiet(options, waits)
        for case in COLUMN_CASES:
            row: dict[str, Any] = {}
            for name, make in contenders.items():
                ensure_warm(path)
                with memory[name]:
                    got, row[name] = _timed(make(case), workers=workers(), settle=cluster.settle)
                cases[case]["results"][name] = got
                found = _difference(got, references[case], "sum")
                cases[case]["difference"][name] = max(
                    cases[case]["difference"].get(name, 0.0), found
                )
            row["load"] = _load()
            cases[case]["rounds"].append(row)
    return {
        "cases": cases,
        "worker_peaks": {name: m.worker_peaks() for name, m in memory.items()},
        "driver_peaks": {name: m.driver_peak() for name, m in memory.items()},
        "dask_skipped": skipped,
        "quiet_waits": waits,
        "rows": int(np.load(path, mmap_mode="r").shape[0]),
    }


def _noop(i: int) -> int:
    return i


def _engine_floor(cluster: Cluster, n: int) -> Callable[[Any], Any]:
    """``n`` trivial tasks straight on the engine, all submitted at once and their
    results fetched at once (``client.map`` + ``client.gather``; ``ray.get`` of ``n``
    ``.remote`` calls): the engine's own cost per task at its most favourable."""
    if cluster.engine == "dask":
        client = cluster.client

        def on_dask(cb: Any) -> Any:
            return client.gather(client.map(_noop, range(n), pure=False))

        return on_dask
    import ray

    noop = ray.remote(num_cpus=1)(_noop)

    def on_ray(cb: Any) -> Any:
        return ray.get([noop.remote(i) for i in range(n)])

    return on_ray


def measure_overhead(cluster: Cluster, options: Options) -> dict[str, Any]:
    """Part 3: a warm-up on each, then ``rounds`` rounds of ``[serial, engine, floor]``
    (floor: :func:`_engine_floor`)."""
    import tierflow as tw

    executor, workers = cluster.executor, cluster.workers
    lazy = tw.from_array(np.zeros((options.tasks, 1), "float32"), rows=1).sum(axis=0)

    def run(on: Any) -> Callable[[Any], Any]:
        return lambda cb: np.asarray(lazy.compute(executor=on, progress=False, callbacks=cb))

    floor = _engine_floor(cluster, options.tasks)
    reference, warm_serial = _timed(run("serial"), settle=cluster.settle)
    got, first = _timed(run(executor), workers=workers(), settle=cluster.settle)
    _timed(floor, settle=cluster.settle)
    rows: list[dict[str, Any]] = []
    difference = _difference(got, reference, "sum")
    waits: list[tuple[float, float]] = []
    for _ in range(options.rounds):
        quiet(options, waits)
        row: dict[str, Any] = {}
        _, row["serial"] = _timed(run("serial"), settle=cluster.settle)
        got, row["engine"] = _timed(run(executor), workers=workers(), settle=cluster.settle)
        difference = max(difference, _difference(got, reference, "sum"))
        _, row["floor"] = _timed(floor, settle=cluster.settle)
        row["load"] = _load()
        rows.append(row)
    return {
        "warm_serial": warm_serial,
        "first": first,
        "rounds": rows,
        "difference": difference,
        "quiet_waits": waits,
    }


def child_main(engine: str, options: Options, map_path: str, column_path: str) -> None:
    figures: dict[str, Any] = {"engine": engine, "load_start": os.getloadavg()}
    start_cluster = dask_cluster if engine == "dask" else ray_cluster
    with start_cluster() as (client, executor, start):
        figures["cluster"] = start
        workers = _dask_workers(client) if engine == "dask" else _ray_workers
        settle = _dask_settle(client) if engine == "dask" else None
        cluster = Cluster(engine, client, executor, workers, settle)
        if "mapblocks" in options.parts:
            figures["mapblocks"] = measure_mapblocks(map_path, cluster, options)
        if "columns" in options.parts:
            figures["columns"] = measure_columns(column_path, cluster, options)
        if "overhead" in options.parts:
            figures["overhead"] = measure_overhead(cluster, options)
        figures["backups"] = executor.backups
        figures["resent"] = executor.resent
    figures["load_end"] = os.getloadavg()
    emit(figures)


# -- the parent side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One line of the final table: ``value`` against ``target`` (``at_least`` or, for
    a cost, at most); ``target`` None is a figure shown without a target."""

    what: str
    value: float | None
    target: float | None
    at_least: bool = True
    unit: str = "x"
    skipped: bool = False  # not measured at this size (said why above the table)

    @property
    def verdict(self) -> str:
        return "SKIP" if self.skipped else verdict(self.value, self.target, self.at_least)


def _child_env(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TIERFLOW_CACHE", None)
    env["TIERFLOW_SPILL_DIR"] = str(folder / "spill")
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # The workers (started by the child) import this tree's tierflow and per_row's module.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return env


def run_all(options: Options, where: str | None = None) -> dict[str, Any]:
    """Generate the files in a temporary folder under ``where``, run each engine's
    child, and remove the folder."""
    folder = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=where))
    try:
        return _run_children(folder, options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_children(folder: Path, options: Options) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--only", ",".join(options.parts)]
    cmd += ["--rounds", str(options.rounds), "--column-rounds", str(options.column_rounds)]
    cmd += ["--tasks", str(options.tasks)]
    if options.quiet is not None:
        cmd += ["--quiet", str(options.quiet), "--quiet-wait", str(options.quiet_wait)]
    if "mapblocks" in options.parts:
        path = make_npy(folder / "rows.npy", options.rows, WIDTH, block_rows=MAP_BLOCK_ROWS * 20)
        cmd += ["--map-path", str(path)]
    if "columns" in options.parts:
        column_rows = max(1, int(options.size_gb * GB) // (4 * WIDTH))
        path = make_npy(folder / "columns.npy", column_rows, WIDTH)
        cmd += ["--column-path", str(path)]
    report: dict[str, Any] = {
        **options.__dict__,
        "cores": os.cpu_count(),
        "load_start": os.getloadavg(),
        "engines": {},
    }
    for engine in options.engines:
        run = run_sampled([*cmd, "--child", engine], timeout=TIMEOUT_S, env=_child_env(folder))
        figures = run.figures()
        figures["returncode"] = run.returncode
        figures["driver_peak_rss"] = max((s.rss for s in run.samples), default=0)
        if run.returncode != 0 or "load_end" not in figures:
            figures["error"] = run.stderr[-3000:] or f"exit status {run.returncode}, no output"
        report["engines"][engine] = figures
    report["load_end"] = os.getloadavg()
    return report


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def map_ratios(case: dict[str, Any], engine: str) -> list[float]:
    """threads / engine of each round."""
    return [r["threads"]["seconds"] / r[engine]["seconds"] for r in case["rounds"]]


def column_ratios(case: dict[str, Any], slower: str, faster: str = "tierflow") -> list[float]:
    """``slower`` / ``faster`` of each round."""
    return [r[slower]["seconds"] / r[faster]["seconds"] for r in case["rounds"]]


def cpu_bounds(case: dict[str, Any], cores: int) -> list[float]:
    """Per round, the most tierflow on the cluster / on threads could be, given the CPU
    its compute used in all the engine's processes here (the driver, with a Dask
    scheduler in it, and every process it started): threads' seconds / (that CPU /
    ``cores``), as though every core ran nothing else and never waited."""
    return [
        r["threads"]["seconds"]
        / max(1e-9, (r["tierflow"]["driver_cpu"] + r["tierflow"]["processes_cpu"]) / cores)
        for r in case["rounds"]
        if "processes_cpu" in r["tierflow"]
    ]


def per_task_costs(part: dict[str, Any]) -> list[float]:
    """(engine wall - serial wall) / block tasks, per round, in seconds."""
    return [
        (r["engine"]["seconds"] - r["serial"]["seconds"]) / max(1, r["engine"]["blocks"])
        for r in part["rounds"]
    ]


def targets(report: dict[str, Any]) -> list[Target]:
    rows: list[Target] = []
    engines = report.get("engines", {})
    for engine, figures in engines.items():
        for case, found in figures.get("mapblocks", {}).get("cases", {}).items():
            rows.append(
                Target(
                    f"1 per-row map_blocks .{case}: {engine} / threads",
                    _median(map_ratios(found, engine)),
                    MAP_TARGET,
                )
            )
    for case in COLUMN_CASES:
        for engine, figures in engines.items():
            found = figures.get("columns", {}).get("cases", {}).get(case)
            if found is not None:
                rows.append(
                    Target(
                        f"2 {case}: tierflow on {engine} / on threads",
                        _median(column_ratios(found, "threads")),  # its speed over threads
                        CLUSTER_TARGET,
                    )
                )
                rows.append(
                    Target(
                        f"2 {case}: the most {engine}'s CPU allows (extra)",
                        _median(cpu_bounds(found, int(report.get("cores") or 1))),
                        None,
                    )
                )
        dask_part = engines.get("dask", {}).get("columns", {})
        dask_case = dask_part.get("cases", {}).get(case)
        if dask_case is not None:
            rows.append(
                Target(
                    f"2 {case}: tierflow on dask / dask.array by path",
                    _median(column_ratios(dask_case, BY_PATH)),
                    COLUMN_TARGET,
                )
            )
            newcomer = all(NEWCOMER in r for r in dask_case["rounds"])
            rows.append(
                Target(
                    f"2 {case}: tierflow on dask / from_array (extra)",
                    _median(column_ratios(dask_case, NEWCOMER)) if newcomer else None,
                    None,
                    skipped=not newcomer,
                )
            )
        ray_case = engines.get("ray", {}).get("columns", {}).get("cases", {}).get(case)
        if ray_case is not None and dask_case is not None:
            ray_s = statistics.median(r["tierflow"]["seconds"] for r in ray_case["rounds"])
            dask_s = statistics.median(r[BY_PATH]["seconds"] for r in dask_case["rounds"])
            rows.append(
                Target(
                    f"2 {case}: tierflow on ray / dask.array by path (extra)", dask_s / ray_s, None
                )
            )
    for engine, figures in engines.items():
        part = figures.get("overhead")
        if part is not None:
            cost = _median(per_task_costs(part))
            rows.append(
                Target(
                    f"3 cost per task on {engine}",
                    None if cost is None else cost * 1e3,
                    OVERHEAD_TARGET[engine] * 1e3,
                    at_least=False,
                    unit=" ms",
                )
            )
    return rows


def _loads(rounds: Sequence[dict[str, Any]]) -> str:
    loads = [r["load"] for r in rounds]
    return f"{min(loads):.2f}-{max(loads):.2f}" if loads else "-"


def print_report(report: dict[str, Any], rows: Sequence[Target]) -> None:
    load = report["load_start"]
    print(
        f"{report['cores']} cores; load average at the start {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} (1, 5, 15 min); rounds: {report['rounds']} (part 2: "
        f"{report['column_rounds']})"
    )
    for engine, figures in report["engines"].items():
        print()
        if "error" in figures:
            print(f"{engine}: FAILED: {figures['error']}")
        cluster = figures.get("cluster", {})
        print(
            f"{engine}: cluster started in {cluster.get('start_s', 0):.2f} s (+ "
            f"{cluster.get('executor_s', 0):.2f} s for tierflow's executor), "
            f"{cluster.get('slots')} task slots; backups {figures.get('backups')}, "
            f"tasks sent again {figures.get('resent')}"
        )
        if "mapblocks" in figures:
            _print_mapblocks(engine, report["rows"], figures["mapblocks"])
        if "columns" in figures:
            _print_columns(engine, report["size_gb"], figures["columns"], report["cores"])
        if "overhead" in figures:
            _print_overhead(engine, figures["overhead"])
        waits = [w for part in PARTS for w in figures.get(part, {}).get("quiet_waits", [])]
        if waits:
            print(
                "  waits for a quiet machine before each round (s, other work in cores): "
                + ", ".join(f"{w:.0f} ({c:.2f})" for w, c in waits)
            )
        end = figures.get("load_end")
        if end:
            print(f"  load average at the child's end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")
    print()
    for t in rows:
        value = "-" if t.value is None else f"{t.value:.2f}{t.unit}"
        bound = "-" if t.target is None else f"{'>=' if t.at_least else '<='} {t.target}{t.unit}"
        print(f"  {t.verdict:<5} {t.what:<50} {value:>10}  (target {bound})")
    end = report.get("load_end")
    if end:
        print(f"load average at the end: {end[0]:.2f} {end[1]:.2f} {end[2]:.2f}")


def _print_mapblocks(engine: str, rows: int, part: dict[str, Any]) -> None:
    print(
        f"  1. per-row map_blocks on {rows:,} rows x {WIDTH} in {MAP_BLOCK_ROWS:,}-row "
        f"blocks, tw.from_npy; threads / {engine} per round, median (min-max)"
    )
    print(
        f"    {'case':<10}{'threads s':>10}{engine + ' s':>9}{'ratio':>22}{'first s':>9}"
        f"{'driver CPU':>12}{'worker CPU':>12}{'task s':>8}{'load':>11}"
    )
    for case, found in part["cases"].items():
        rounds = found["rounds"]

        def med(who: str, key: str, rounds: list[Any] = rounds) -> float:
            return statistics.median(r[who][key] for r in rounds)

        print(
            f"    {case:<10}{med('threads', 'seconds'):>10.3f}{med(engine, 'seconds'):>9.3f}"
            f"{span(map_ratios(found, engine)):>22}{found['first']['seconds']:>9.3f}"
            f"{med(engine, 'driver_cpu'):>12.2f}{med(engine, 'worker_cpu'):>12.2f}"
            f"{med(engine, 'busy'):>8.2f}{_loads(rounds):>11}"
        )
        if all("plain" in r for r in rounds):
            ratios = [r["threads"]["seconds"] / r["plain"]["seconds"] for r in rounds]
            print(
                f"      {engine} itself (client.map / .remote of the same blocks, no "
                f"tierflow): {med('plain', 'seconds'):.3f} s, threads / it {span(ratios)}, "
                f"driver CPU {med('plain', 'driver_cpu'):.2f} s"
            )
        print(
            "      differences from threads: "
            + ", ".join(f"{k} {v:.1e}" for k, v in found["difference"].items())
        )


def _print_columns(engine: str, size_gb: float, part: dict[str, Any], cores: int) -> None:
    others = [
        n
        for n in (part["cases"][COLUMN_CASES[0]]["rounds"] or [{}])[0]
        if n not in ("tierflow", "load")
    ]
    print(
        f"  2. {size_gb:g} GB float32 [{part['rows']:,}, {WIDTH}] .npy in "
        f"{COLUMN_BLOCK_ROWS:,}-row (32 MB) blocks: tierflow on {engine} against "
        f"{', '.join(others)}; each other / tierflow per round, median (min-max)"
    )
    for case, found in part["cases"].items():
        rounds = found["rounds"]
        tw_s = statistics.median(r["tierflow"]["seconds"] for r in rounds)
        shown = [
            f"{name} {statistics.median(r[name]['seconds'] for r in rounds):.3f} s "
            f"{span(column_ratios(found, name))}"
            for name in others
            if all(name in r for r in rounds)
        ]
        print(
            f"    {case:<8} tierflow {tw_s:.3f} s ({size_gb / tw_s:.2f} GB/s); "
            f"{'; '.join(shown)}; load {_loads(rounds)}"
        )
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in found["difference"].items())
        print(f"      relative differences from tierflow on threads: {diffs}")
        if all("processes_cpu" in r["tierflow"] for r in rounds):
            _print_cpu(engine, found, cores)
    print(
        "    peak RSS per worker, MB (anonymous), and in brackets the largest growth within"
        " one compute:"
    )
    for name, peaks in part["worker_peaks"].items():
        shown = ", ".join(
            f"{p['rss'] / MB:.0f} ({p['anon'] / MB:.0f}) [+{p['rss_growth'] / MB:.0f}"
            f" (+{p['anon_growth'] / MB:.0f})]"
            for p in peaks
        )
        driver = part.get("driver_peaks", {}).get(name, {})
        if driver:
            shown += (
                f"; the driver {driver['rss'] / MB:.0f} ({driver['anon'] / MB:.0f})"
                f" [+{driver['rss_growth'] / MB:.0f} (+{driver['anon_growth'] / MB:.0f})]"
            )
        print(f"      while {name} ran: {shown or '-'}")
    if part.get("dask_skipped"):
        print(f"    dask.array not run: {part['dask_skipped']}")


def _print_cpu(engine: str, case: dict[str, Any], cores: int) -> None:
    """Where a compute's CPU went (medians, ms): threads' in the driver; the cluster's in
    the driver (with a Dask scheduler in it), in its workers, and in all the processes
    the driver started (the workers among them); and the ratio to threads that CPU
    allows on ``cores`` cores at most."""
    rounds = case["rounds"]

    def med(who: str, key: str) -> float:
        return statistics.median(r[who][key] for r in rounds) * 1e3

    print(
        f"      CPU a compute, ms: threads {med('threads', 'driver_cpu'):.0f}; tierflow on "
        f"{engine} {med('tierflow', 'driver_cpu'):.0f} in the driver + "
        f"{med('tierflow', 'processes_cpu'):.0f} in the processes it started (its workers "
        f"{med('tierflow', 'worker_cpu'):.0f}); on {cores} cores that CPU allows "
        f"{span(cpu_bounds(case, cores))} of threads' speed at most"
    )


def _print_overhead(engine: str, part: dict[str, Any]) -> None:
    rounds = part["rounds"]
    blocks = rounds[0]["engine"]["blocks"] if rounds else 0
    print(
        f"  3. {blocks:,} tiny block tasks: (wall on {engine} - wall on serial) / tasks, per "
        "round, median (min-max)"
    )
    serial = statistics.median(r["serial"]["seconds"] for r in rounds)
    wall = statistics.median(r["engine"]["seconds"] for r in rounds)
    busy = statistics.median(r["engine"]["busy"] for r in rounds)
    cpu = statistics.median(r["engine"]["driver_cpu"] for r in rounds)
    floors = [r["floor"]["seconds"] / max(1, r["engine"]["blocks"]) for r in rounds]
    print(
        f"    serial {serial:.3f} s, {engine} {wall:.3f} s (first {part['first']['seconds']:.3f}"
        f" s), tasks ran {busy:.3f} s in the workers, driver CPU {cpu:.2f} s; per task "
        f"{span(per_task_costs(part), ' ms', 1e3)}; load {_loads(rounds)}; "
        f"difference from serial {part['difference']:.1e}"
    )
    print(
        f"    {engine}'s own floor, as many trivial tasks submitted and fetched at once: "
        f"{span(floors, ' ms', 1e3)} a task"
    )


def main(argv: Sequence[str] | None = None) -> int:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated engines")
    parser.add_argument("--size-gb", type=float, default=4.0, help="part 2's file in 10^9 bytes")
    parser.add_argument("--rows", type=int, default=MAP_ROWS, help="part 1's rows")
    parser.add_argument("--tasks", type=int, default=TINY_TASKS, help="part 3's tasks")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of parts 1 and 3")
    parser.add_argument("--column-rounds", type=int, default=COLUMN_ROUNDS, help="part 2's")
    parser.add_argument(
        "--quiet",
        type=float,
        metavar="CORES",
        help="before each round, wait (up to --quiet-wait s) until other work uses under CORES cores",
    )
    parser.add_argument(
        "--quiet-wait", type=float, default=QUIET_TIMEOUT_S, help="longest wait of --quiet, s"
    )
    parser.add_argument("--dir", help="folder for the generated files (default: temp)")
    parser.add_argument("--json", help="write the figures (JSON) here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--map-path", help=argparse.SUPPRESS)
    parser.add_argument("--column-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(parts) - set(PARTS)) + sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}; parts {PARTS}, engines {ENGINES}")
    options = Options(
        parts=tuple(parts),
        engines=tuple(engines),
        rows=args.rows,
        size_gb=args.size_gb,
        tasks=args.tasks,
        rounds=args.rounds,
        column_rounds=args.column_rounds,
        quiet=args.quiet,
        quiet_wait=args.quiet_wait,
    )
    if args.child:
        child_main(args.child, options, args.map_path, args.column_path)
        return 0
    report = run_all(options, args.dir)
    rows = targets(report)
    missed = save_figures(report, rows, args.json)  # first: the figures outlive a bad print
    print_report(report, rows)
    failed = any("error" in f for f in report["engines"].values())
    missed = missed or failed
    return 1 if missed and args.strict else 0


# -- pytest-benchmark ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("bench-cluster")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_tierflow_on_dask_and_ray_gives_threads_results(benchmark: Any, folder: Path) -> None:
    benchmark.group = "engine: clusters"
    options = Options(
        rows=BENCH_ROWS, size_gb=BENCH_SIZE_GB, tasks=BENCH_TASKS, rounds=1, column_rounds=1
    )
    report = benchmark.pedantic(run_all, args=(options, str(folder)), rounds=1, iterations=1)
    rows = targets(report)
    print_report(report, rows)
    benchmark.extra_info["targets"] = {t.what: t.value for t in rows}
    for engine in ENGINES:
        figures = report["engines"][engine]
        assert "error" not in figures, (engine, figures["error"])
        for case in MAP_CASES:
            found = figures["mapblocks"]["cases"][case]
            assert found["difference"][engine] <= SUM_RTOL, (engine, case, found["difference"])
            assert found["difference"].get("plain", 0.0) <= 1e-4, (engine, found["difference"])
            blocks = -(-BENCH_ROWS // MAP_BLOCK_ROWS)
            assert all(r[engine]["blocks"] == blocks for r in found["rounds"]), (engine, case)
        for case in COLUMN_CASES:
            found = figures["columns"]["cases"][case]
            assert found["difference"]["tierflow"] <= SUM_RTOL, (engine, case, found)
            if engine == "dask":
                for name in (BY_PATH, NEWCOMER):
                    np.testing.assert_allclose(
                        found["results"][name], found["results"]["threads"], rtol=1e-4
                    )
        overhead = figures["overhead"]
        assert overhead["difference"] == 0.0, (engine, overhead["difference"])
        assert all(r["engine"]["blocks"] == BENCH_TASKS for r in overhead["rounds"]), engine
    assert not list(folder.iterdir()), "the generated files were not removed"


if __name__ == "__main__":
    sys.exit(main())
